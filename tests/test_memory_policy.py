"""The command line's malloc policy: freed large blocks go back to the system (kvdbg.util.memory)."""

from __future__ import annotations

import sys

import pytest

from tests.helpers import run_python

glibc = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# Allocate and free one 4 MiB block, allocate another, and report whether that second block has a mapping of its
# own (mallinfo2's hblkhd: bytes in mmapped blocks). glibc's default raises its mmap threshold on the first free,
# so the second block comes from the heap, where it stays resident once freed.
SECOND_BLOCK = """
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
size = 4 << 20
libc.free(libc.malloc(size))
second = libc.malloc(size)
print("MAPPED", libc.mallinfo2().hblkhd >= size)
libc.free(second)
"""


@glibc
def test_after_the_policy_a_large_block_has_its_own_mapping_every_time():
    out = run_python("from kvdbg.util.memory import return_freed_memory\nprint('APPLIED', return_freed_memory())\n"
                     + SECOND_BLOCK)
    assert out.split() == ["APPLIED", "True", "MAPPED", "True"], out


@glibc
def test_without_the_policy_glibc_keeps_the_second_block_in_its_heap():
    """The behaviour the policy changes: this is what the test above would see without it."""
    assert run_python(SECOND_BLOCK).split() == ["MAPPED", "False"]


def test_the_command_line_applies_it_for_tensor_commands_and_not_for_header_only_ones(tmp_path):
    """`kvdbg synth` (torch) gets the policy; window, info and explain start without it (nor ctypes)."""
    out = run_python(f"""
import sys
from kvdbg.cli import main
def run(*argv):
    try:
        main(list(argv))
    except SystemExit as exc:
        assert not exc.code, (argv, exc.code)
run("window", "--seq-len", "9000", "--window", "4096")
run("info", "fixtures/dflash.safetensors")
run("explain", "live_page_zero")
print("LIGHT", "kvdbg.util.memory" in sys.modules, "ctypes" in sys.modules)
run("synth", "-o", {str(tmp_path / "s.safetensors")!r}, "--seq-lens", "40")
import kvdbg.util.memory as memory
print("SYNTH", memory._applied)
""")
    lines = out.strip().splitlines()
    assert lines[-2] == "LIGHT False False", out
    assert lines[-1] == ("SYNTH True" if sys.platform.startswith("linux") else "SYNTH False"), out
