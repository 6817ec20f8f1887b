"""Helpers shared by the test files (importable as tests.helpers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from kvdbg.snapshot.format import FORMAT_KEY, META_KEY, write_safetensors
from kvdbg.snapshot.store import dtype_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Float outputs of kernels are compared within a few ulps of their dtype, never bit for bit: another CPU
# (Intel vs AMD), BLAS path or batch shape may round the last bit differently. Only inputs and metadata
# that are deterministic by construction are compared byte for byte.
KERNEL_ULPS = 4


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: int = KERNEL_ULPS, **kw) -> None:
    """``actual`` equals ``expected`` within ``ulps`` units in the last place of ``expected``'s dtype."""
    tol = ulps * torch.finfo(expected.dtype).eps
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, **kw)
FIXTURES = os.path.join(ROOT, "fixtures")
_SHORT: list[str] = []


def wider_than(lines: list[str], width: int = 80) -> list[str]:
    """The lines wider than ``width``, less those that are one shell word (a path, quoted if it holds a space)
    shown whole: a printed command breaks only between words, so a longer word stands alone on its line."""
    import shlex

    def one_word(line: str) -> bool:
        try:
            return len(shlex.split(line.strip().removesuffix(" \\"))) == 1
        except ValueError:
            return False

    return [line for line in lines if len(line) > width and not one_word(line)]


def shown_commands(text: str, start: str = "$ kvdbg ") -> list[str]:
    """The commands printed from lines beginning (after their indent) with ``start``, each joined back from
    its continuation lines (a line ending `` \\`` goes on), as one line of shell without ``start``'s ``$ ``."""
    commands: list[str] = []
    going_on = False
    for line in text.splitlines():
        body = line.strip()
        if not going_on and not body.startswith(start):
            continue
        if not going_on:
            commands.append("")
            body = body.removeprefix("$ ")
        going_on = body.endswith(" \\")
        commands[-1] += body.removesuffix(" \\") + (" " if going_on else "")
    return commands


def short_fixtures() -> str:
    """FIXTURES through a short path (a link in a temp dir of this run, removed at exit). A command prints a
    snapshot's path as given, and whole: tests of line widths and line counts then see the same lines whatever
    the depth of the checkout they run in (a deeper one than the author's once failed CI)."""
    if not _SHORT:
        import atexit
        import shutil
        import tempfile

        directory = tempfile.mkdtemp(prefix="kvf-")
        atexit.register(shutil.rmtree, directory, True)
        os.symlink(FIXTURES, os.path.join(directory, "f"))
        _SHORT.append(os.path.join(directory, "f"))
    return _SHORT[0]


def write_raw(path, tensors: dict[str, torch.Tensor], meta, *, fmt: str | None = "1", extra_meta=None) -> str:
    """Write a safetensors file exactly as given (no kvdbg validation), for bad-input tests."""
    metadata = {}
    if fmt is not None:
        metadata[FORMAT_KEY] = fmt
    if meta is not None:
        metadata[META_KEY] = meta if isinstance(meta, str) else json.dumps(meta)
    metadata.update(extra_meta or {})
    entries = [
        (n, dtype_name(t.dtype), tuple(t.shape), t.contiguous().reshape(-1).view(torch.uint8).numpy())
        for n, t in tensors.items()
    ]
    with open(path, "wb") as fh:
        write_safetensors(fh, entries, metadata)
    return str(path)


def run_python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout


def asdict_meta_json(meta) -> str:
    """A snapshot's metadata JSON as ``dataclasses.asdict`` builds it: how ``SnapshotMeta.to_json`` encoded it
    until it stopped deep-copying (the test of the same bytes, and bench/writer_cost.py's reference)."""
    import dataclasses

    from kvdbg.snapshot.format import LAYER_FIELDS_WRITTEN_WHEN_SET, LayerMeta

    record = dataclasses.asdict(meta)
    for name in LAYER_FIELDS_WRITTEN_WHEN_SET:
        if record["layer"][name] == LayerMeta.__dataclass_fields__[name].default:
            del record["layer"][name]
    return json.dumps(record, sort_keys=True, separators=(",", ":"))
