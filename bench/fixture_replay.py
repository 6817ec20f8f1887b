"""`kvdbg replay` on each bundled fixture (CPU) against `python -c "import torch"`.

Usage:
    python bench/fixture_replay.py [--runs N] [--backend NAME ...]

Prints, for each fixture, the median wall time of the whole `kvdbg replay`
command over N runs (default 5, one untimed run first) and its ratio to a bare
`python -c "import torch"` measured in this same run (target: <= 1.5x), then
the same per backend alone (the replay always adds the reference), so the
backend that costs the time is named. Children run on the CPU
(CUDA_VISIBLE_DEVICES is emptied) with the machine's default thread count.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def median_time(argv: list[str], runs: int, env: dict[str, str]) -> tuple[float, int]:
    first = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times), first.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--backend", action="append", default=None,
                        help="also time `--backend NAME` alone (repeatable; default flex, flashinfer_ts)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    py = sys.executable
    base, _ = median_time([py, "-c", "import torch"], args.runs, env)
    print(f"median of {args.runs} runs each (one untimed run first), {os.cpu_count()} CPUs, "
          f"python {sys.version.split()[0]}")
    print(f"{base * 1000:8.0f} ms  1.00x  python -c \"import torch\" (baseline)")
    worst = 0.0
    for path in sorted(glob.glob(os.path.join(HERE, "fixtures", "*.safetensors"))):
        name = os.path.basename(path)
        t, rc = median_time([py, "-m", "kvdbg", "replay", path], args.runs, env)
        worst = max(worst, t / base)
        print(f"{t * 1000:8.0f} ms  {t / base:5.2f}x  kvdbg replay {name} (exit {rc})")
        for backend in args.backend or ["flex", "flashinfer_ts"]:
            t, rc = median_time([py, "-m", "kvdbg", "replay", path, "--backend", backend], args.runs, env)
            print(f"{t * 1000:8.0f} ms  {t / base:5.2f}x      --backend {backend} (exit {rc})")
    verdict = "met" if worst <= 1.5 else "missed"
    print(f"worst whole replay: {worst:.2f}x import torch (target <= 1.5x: {verdict})")


if __name__ == "__main__":
    main()
