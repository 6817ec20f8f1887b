"""Which kvdbg a start-up benchmark runs, and paired, interleaved timing of whole commands.

By default the ``kvdbg`` console script installed beside this Python (else the
first on PATH), the way a user starts it; an editable install runs the source
tree it was installed from. ``checkout=True`` runs ``python -m kvdbg`` with this
checkout first on PYTHONPATH instead, to time a working tree other than the
installed one.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(checkout: bool, **extra: str) -> dict[str, str]:
    """The children's environment. Without PYTHONDONTWRITEBYTECODE: an installed kvdbg has its .pyc files,
    and compiling kvdbg's sources on every run would time the compiler."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if checkout:
        env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    env.update(extra)
    return env


def kvdbg_command(checkout: bool) -> list[str]:
    if checkout:
        return [sys.executable, "-m", "kvdbg"]
    here = os.path.join(os.path.dirname(sys.executable), "kvdbg")
    found = here if os.path.exists(here) else shutil.which("kvdbg")
    if found is None:
        sys.exit("no installed `kvdbg` script beside this Python or on PATH: install kvdbg, or pass --checkout")
    return [found]


def describe(kvdbg: list[str], env: dict[str, str]) -> str:
    """``<command> -> <the kvdbg package it imports>``."""
    origin = subprocess.run([sys.executable, "-c", "import kvdbg; print(kvdbg.__file__)"], capture_output=True,
                            text=True, env=env, cwd="/").stdout.strip()
    return f"{' '.join(kvdbg)} -> {origin}"


def run_once(argv: list[str], env: dict[str, str], cwd: str = REPO) -> tuple[float, float]:
    """(wall seconds, CPU seconds: user + system) of one run. CPU time moves far less than wall time when other
    jobs share the cores, so both are kept."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    _, _, usage = os.wait4(proc.pid, 0)  # this child's own rusage
    return time.perf_counter() - start, usage.ru_utime + usage.ru_stime


def interleaved(cases: dict[str, list[str]], rounds: int, env: dict[str, str]) -> dict[str, list[tuple[float, float]]]:
    """Each case once untimed, then ``rounds`` rounds of every case once, the order rotated every round."""
    names = list(cases)
    for name in names:
        run_once(cases[name], env)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(run_once(cases[name], env))
    return times


def print_ratios(times: dict[str, list[tuple[float, float]]], baseline: str, target: float) -> None:
    """Per case: median and minimum wall time; *paired*: the median over rounds of its wall time / the
    baseline's in the same round (the figure: a shared machine's drift cancels within a round); the ratio of
    the minimums; and the same paired ratio of CPU time (user + system), which load disturbs least."""
    base = times[baseline]
    print(f"{'median':>9s} {'min':>9s}  {'paired':>7s} {'min/min':>7s} {'cpu':>7s}  (paired: median over rounds of "
          f"wall time / baseline's in the same round; cpu: the same of user+system time; target <= {target:.2f}x)")
    for name, values in times.items():
        walls = [w for w, _ in values]
        paired = statistics.median(w / b for (w, _), (b, _) in zip(values, base))
        cpu = statistics.median(c / b for (_, c), (_, b) in zip(values, base))
        print(f"{statistics.median(walls) * 1e3:7.1f}ms {min(walls) * 1e3:7.1f}ms  {paired:6.3f}x "
              f"{min(walls) / min(w for w, _ in base):6.3f}x {cpu:6.3f}x  {name}")


def run_and_report(cases: dict[str, list[str]], rounds: int, env: dict[str, str], kvdbg: list[str],
                   installed: list[str] | None, baseline: str, target: float) -> None:
    """Run ``cases`` interleaved, then say what ran (and the load around it) and print the ratios."""
    load_before = os.getloadavg()[0]
    times = interleaved(cases, rounds, env)
    print(describe(kvdbg, env))
    if installed:
        print(f"installed: {describe(installed, child_env(False))}")
    print(f"{rounds} interleaved rounds, {os.cpu_count()} CPUs, python {sys.version.split()[0]}, "
          f"load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    print_ratios(times, baseline, target)
