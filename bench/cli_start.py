"""Start-up cost of `kvdbg window` against bare `import click, rich` (ratio of medians, one run)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

RUNS = 15
WINDOW = [sys.executable, "-m", "kvdbg", "window", "--seq-len", "9000", "--window", "4096", "--query-len", "8"]
BASELINE = [sys.executable, "-c", "import click, rich"]


def median_seconds(cmd: list[str], runs: int = RUNS) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    median_seconds(WINDOW, 2)  # warm the OS file cache and bytecode
    window = median_seconds(WINDOW)
    baseline = median_seconds(BASELINE)
    print(f"kvdbg window: {window * 1000:.0f} ms, import click, rich: {baseline * 1000:.0f} ms "
          f"(median of {RUNS}); ratio {window / baseline:.2f}")


if __name__ == "__main__":
    main()
