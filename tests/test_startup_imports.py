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
