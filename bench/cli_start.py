"""CLI start-up: `kvdbg --help`, `kvdbg window`, `kvdbg info` vs `python -c "import click, rich"`.

Usage:
    python bench/cli_start.py --make-2gb /tmp/kvdbg-2g.safetensors   # synthesise it first if missing (~30 s)
    python bench/cli_start.py [SNAPSHOT] [--runs N]

Prints the median wall time of each command over N runs (default 15) and its
ratio to the click+rich import baseline, all measured in this one run, plus
the floor any rich-table command pays (click + rich.console + rich.table).

Children may write bytecode caches even when PYTHONDONTWRITEBYTECODE is set
here, and each command runs once untimed first: an installed kvdbg has its
.pyc files, and compiling kvdbg's sources on every run would time the compiler.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _big import make_2gb  # noqa: E402


def median_time(argv: list[str], runs: int, env: dict[str, str]) -> float:
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("snapshot", nargs="?", default=os.path.join(here, "fixtures", "dflash.safetensors"))
    parser.add_argument("--make-2gb", metavar="PATH",
                        help="use (and first synthesise, if missing) the 2 GiB 64 x 8192 snapshot at PATH")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    snapshot = make_2gb(args.make_2gb) if args.make_2gb else args.snapshot
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    py = sys.executable
    cases = {
        'python -c "import click, rich"': [py, "-c", "import click, rich"],
        "kvdbg --help": [py, "-m", "kvdbg", "--help"],
        "kvdbg window --seq-len 9000 --window 4096 --query-len 8": [
            py, "-m", "kvdbg", "window", "--seq-len", "9000", "--window", "4096", "--query-len", "8"],
        f"kvdbg info {os.path.basename(snapshot)} ({os.path.getsize(snapshot) / 2**20:.0f} MiB)": [
            py, "-m", "kvdbg", "info", snapshot],
        'floor of a rich table: python -c "import click, rich.console, rich.table"': [
            py, "-c", "import click, rich.console, rich.table"],
        'python -c "pass" (interpreter start)': [py, "-c", "pass"],
        'python -c "import torch" (for scale)': [py, "-c", "import torch"],
    }
    results = {name: median_time(argv, args.runs, env) for name, argv in cases.items()}
    base = next(iter(results.values()))
    print(f"median of {args.runs} runs each (one untimed run first), {os.cpu_count()} CPUs, "
          f"python {sys.version.split()[0]}")
    for name, t in results.items():
        print(f"{t * 1000:8.1f} ms  {t / base:5.2f}x  {name}")


if __name__ == "__main__":
    main()
