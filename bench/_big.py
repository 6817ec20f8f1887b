"""The large benchmark snapshots, synthesised with `kvdbg synth` when a script is asked to make them."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 64 requests x N tokens, Hq 32 / Hkv 8, D 128, bf16, page 16: N = 8192 is 32768 pages, 2 GiB of KV (~30 s on
# 2 cores); N = 2048 is 512 MiB.
HEADS = ["--num-heads", "32", "--num-kv-heads", "8", "--head-size", "128", "--dtype", "bfloat16"]
BIG_ARGS = ["--seq-len", ",".join(["8192"] * 64), *HEADS]


def make_capture(path: str, tokens: int, requests: int = 64) -> str:
    """Write ``requests`` x ``tokens`` (the heads above) to ``path`` unless a file is already there; return it."""
    if not os.path.exists(path):
        print(f"synthesising {requests} x {tokens} at {path} (kvdbg synth)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "kvdbg", "synth", "-o", path, "--seq-len",
                        ",".join([str(tokens)] * requests), *HEADS], check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return path


def make_2gb(path: str) -> str:
    """Write the 2 GiB snapshot to ``path`` unless a file is already there; return the path."""
    return make_capture(path, 8192)
