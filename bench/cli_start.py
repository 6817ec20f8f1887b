"""CLI start-up: `kvdbg --help`, `kvdbg window`, `kvdbg info` vs `python -c "import click, rich"`.

Usage: python bench/cli_start.py [SNAPSHOT] [--runs N]
Prints the median wall time of each command over N runs (default 15) and its
ratio to the click+rich import baseline, all measured in this one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def median_time(argv: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("snapshot", nargs="?", default=os.path.join(here, "fixtures", "dflash.safetensors"))
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    py = sys.executable
    cases = {
        'python -c "import click, rich"': [py, "-c", "import click, rich"],
        "kvdbg --help": [py, "-m", "kvdbg", "--help"],
        "kvdbg window --seq-len 9000 --window 4096 --query-len 8": [
            py, "-m", "kvdbg", "window", "--seq-len", "9000", "--window", "4096", "--query-len", "8"],
        f"kvdbg info {os.path.basename(args.snapshot)} ({os.path.getsize(args.snapshot) / 2**20:.0f} MiB)": [
            py, "-m", "kvdbg", "info", args.snapshot],
        "python -c \"import torch\" (for scale)": [py, "-c", "import torch"],
    }
    results = {name: median_time(argv, args.runs) for name, argv in cases.items()}
    base = next(iter(results.values()))
    print(f"median of {args.runs} runs each, {os.cpu_count()} CPUs")
    for name, t in results.items():
        print(f"{t * 1000:8.1f} ms  {t / base:5.2f}x  {name}")


if __name__ == "__main__":
    main()
