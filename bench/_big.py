"""The 2 GiB benchmark snapshot, synthesised with `kvdbg synth` when a script is asked to make it."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# 64 requests x 8192 tokens, Hq 32 / Hkv 8, D 128, bf16, page 16: 32768 pages, 2 GiB of KV (~30 s on 2 cores).
BIG_ARGS = ["--seq-len", ",".join(["8192"] * 64), "--num-heads", "32", "--num-kv-heads", "8",
            "--head-size", "128", "--dtype", "bfloat16"]


def make_2gb(path: str) -> str:
    """Write the 2 GiB snapshot to ``path`` unless a file is already there; return the path."""
    if not os.path.exists(path):
        print(f"synthesising the 2 GiB snapshot at {path} (kvdbg synth, ~30 s)...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "kvdbg", "synth", "-o", path, *BIG_ARGS], check=True,
                       stdout=subprocess.DEVNULL, cwd=REPO)
    return path
