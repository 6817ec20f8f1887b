"""Time to verdict on a GPU: `kvdbg replay --device cuda` against `import torch` + CUDA init, cold and warm.

Usage: python bench/cuda_verdict.py [--runs 5] [--fixture dflash] [--backend NAME ...]

Runs the baseline (``python -c "import torch; torch.zeros(1, device='cuda')"``)
and the replay alternately, each in a fresh process. The first replay is the
cold one: no Triton or compile cache entry of this checkout yet (the caches are
pointed at an empty temporary directory for the whole run). Prints every
time, the cold and the median warm ratio (target: <= 2x), and the same per
backend alone.

Python's bytecode cache matters here: a Python started with
PYTHONDONTWRITEBYTECODE and site-packages without .pyc files recompiles every
module it imports, which doubles `import torch`. A normal `pip install` writes
the .pyc files; this script warns when torch has none.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = [sys.executable, "-c", "import torch; torch.zeros(1, device='cuda')"]


def wall(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False)
    if done.returncode not in (0, 1):
        sys.exit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-400:]}")
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fixture", default="dflash")
    parser.add_argument("--backend", action="append", default=None)
    args = parser.parse_args()
    import torch

    if not glob.glob(os.path.join(os.path.dirname(torch.__file__), "__pycache__", "*.pyc")):
        print("warning: torch has no .pyc files here; every run recompiles its modules (see the docstring)")
    snap = os.path.join(HERE, "fixtures", f"{args.fixture}.safetensors")
    replay = [sys.executable, "-m", "kvdbg", "replay", snap, "--device", "cuda"]
    caches = tempfile.mkdtemp(prefix="kvdbg-cuda-verdict-")
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"))
    base, runs = [], []
    for _ in range(args.runs):
        base.append(wall(BASELINE, env))
        runs.append(wall(replay, env))
    floor = statistics.median(base)
    print(f"import torch + CUDA init: {', '.join(f'{t:.2f}' for t in base)} s (median {floor:.2f} s)")
    print(f"kvdbg replay {args.fixture} --device cuda: {', '.join(f'{t:.2f}' for t in runs)} s")
    warm = statistics.median(runs[1:]) if len(runs) > 1 else runs[0]
    print(f"  cold {runs[0]:.2f} s = {runs[0] / floor:.2f}x, warm median {warm:.2f} s = {warm / floor:.2f}x "
          f"(target <= 2x)")
    for name in args.backend or []:
        times = [wall(replay + ["--backend", name], env) for _ in range(max(1, args.runs // 2))]
        print(f"  --backend {name}: median {statistics.median(times):.2f} s = "
              f"{statistics.median(times) / floor:.2f}x")


if __name__ == "__main__":
    main()
