"""`kvdbg --help`, `window` and `info` import only what they use (their start-up is measured by bench/cli_start.py)."""

from __future__ import annotations

import pytest

from tests.helpers import run_python

# Modules each of these commands never needs: torch and numpy (no tensors), ctypes (the malloc policy of tensor
# commands), tempfile (only a file write needs it), difflib (only a "did you mean" needs it). (inspect is
# click's own import.)
NEVER = ("torch", "numpy", "safetensors", "ctypes", "tempfile", "difflib")


def _modules_after(argv: list[str]) -> set[str]:
    out = run_python(f"""
import sys
from kvdbg.cli import main
try:
    main({argv!r})
except SystemExit as exc:
    assert not exc.code, exc.code
print("MODULES", " ".join(sorted(sys.modules)))
""")
    return set(out.strip().splitlines()[-1].split()[1:])


@pytest.mark.parametrize("argv", [["--help"], ["window", "--seq-len", "9000", "--window", "4096"],
                                  ["info", "fixtures/dflash.safetensors"]], ids=["help", "window", "info"])
def test_start_up_commands_import_nothing_they_do_not_use(argv):
    modules = _modules_after(argv)
    assert not [m for m in NEVER if m in modules]


def test_help_imports_no_command_and_no_verdict():
    """The group's help lists the commands from a table: no command module, no verdict catalogue."""
    modules = _modules_after(["--help"])
    assert not [m for m in modules if m.startswith(("kvdbg.cli.", "kvdbg.judge", "kvdbg.ts", "rich"))]


def _exit_of(argv: list[str]) -> tuple[int, str]:
    """(exit code, stdout) of the console script run in a child, with an exit handler (run after main's own)
    that prints how many objects were frozen for the interpreter's final collection."""
    import subprocess
    import sys

    from tests.helpers import ROOT

    code = ("import atexit, gc\natexit.register(lambda: print('FROZEN', gc.get_freeze_count() > 0))\n"
            f"from kvdbg.cli import main\nmain({argv!r})\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return done.returncode, done.stdout


@pytest.mark.parametrize("argv, code", [
    (["window", "--seq-len", "9000", "--window", "4096", "--query-len", "8", "--mask", "causal"], 1),
    (["info", "fixtures/dflash.safetensors", "--json"], 0),
    (["--help"], 0),
], ids=["window_fails", "info_json", "help"])
def test_header_only_commands_spare_the_final_collection_and_keep_their_exit_code(argv, code):
    returncode, out = _exit_of(argv)
    assert (returncode, out.rstrip().splitlines()[-1]) == (code, "FROZEN True")


def test_a_tensor_command_exits_as_usual(tmp_path):
    returncode, out = _exit_of(["synth", "-o", str(tmp_path / "s.safetensors"), "--seq-lens", "40"])
    assert (returncode, out.rstrip().splitlines()[-1]) == (0, "FROZEN False")


def test_main_in_a_callers_process_gives_the_collector_back():
    out = run_python("import gc\nfrom kvdbg.cli import main\ntry:\n    main(['window', '--seq-len', '90'])\n"
                     "except SystemExit as exc:\n    print('EXIT', exc.code, gc.isenabled())\n")
    assert out.strip().splitlines()[-1] == "EXIT 0 True"
