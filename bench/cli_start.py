"""CLI start-up: `kvdbg --help`, `kvdbg window`, `kvdbg info` vs the import of click + rich.console + rich.table.

Usage:
    python bench/cli_start.py [SNAPSHOT] [--runs N]          # the installed `kvdbg` script (default)
    python bench/cli_start.py --checkout                      # this checkout: python -m kvdbg, PYTHONPATH=here
    python bench/cli_start.py --make-2gb /tmp/kvdbg-2g.safetensors   # info on the 2 GiB snapshot (made if missing)

Which kvdbg is measured: by default the ``kvdbg`` console script installed
beside this Python (else the first on PATH), as a user starts it (an editable
install runs the tree it was installed from); ``--checkout`` runs this
checkout instead. The first line printed names the file imported.

The baseline is the floor of any command that draws a rich table:
``python -c "import click, rich.console, rich.table"``. Target: each command
<= 1.3x it. The machine is shared and timings drift, so the cases are
interleaved: every round runs each once (the order rotated per round), and
each command's figure is the median over rounds of its time divided by the
baseline's in the same round; the ratio of the minimums is printed beside it.
Each case runs once untimed first (bytecode caches). The load average before
and after is printed.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _big import make_2gb  # noqa: E402
from _launch import REPO, child_env, kvdbg_command, run_and_report  # noqa: E402

BASELINE = 'python -c "import click, rich.console, rich.table"'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", nargs="?", default=os.path.join(REPO, "fixtures", "dflash.safetensors"))
    parser.add_argument("--make-2gb", metavar="PATH",
                        help="use (and first synthesise, if missing) the 2 GiB 64 x 8192 snapshot at PATH")
    parser.add_argument("--runs", type=int, default=21, help="rounds (default 21)")
    parser.add_argument("--checkout", action="store_true",
                        help="time this checkout (python -m kvdbg, PYTHONPATH=checkout), not the installed script")
    parser.add_argument("--with-installed", action="store_true",
                        help="with --checkout: also time the installed script's kvdbg in the same rounds (before/after)")
    parser.add_argument("--with-torch", action="store_true", help="also time `python -c \"import torch\"`, for scale")
    args = parser.parse_args()
    snapshot = make_2gb(args.make_2gb) if args.make_2gb else args.snapshot
    env = child_env(args.checkout)
    kvdbg = kvdbg_command(args.checkout)
    py = sys.executable
    cases = {
        BASELINE: [py, "-c", "import click, rich.console, rich.table"],
        "kvdbg --help": [*kvdbg, "--help"],
        "kvdbg window --seq-len 9000 --window 4096": [*kvdbg, "window", "--seq-len", "9000", "--window", "4096"],
        f"kvdbg info {os.path.basename(snapshot)} ({os.path.getsize(snapshot) / 2**20:.0f} MiB)": [
            *kvdbg, "info", snapshot],
        'python -c "import click, rich"': [py, "-c", "import click, rich"],
        'python -c "pass" (interpreter start)': [py, "-c", "pass"],
    }
    if args.with_torch:
        cases['python -c "import torch" (for scale)'] = [py, "-c", "import torch"]
    installed = kvdbg_command(False) if args.checkout and args.with_installed else None
    if installed:
        # Run with the checkout left off PYTHONPATH, so that it imports what it was installed from.
        keep = ["env", f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}", *installed]
        for name in [n for n in cases if n.startswith("kvdbg ")]:
            cases[f"installed: {name}"] = keep + cases[name][len(kvdbg):]
    run_and_report(cases, args.runs, env, kvdbg, installed, BASELINE, 1.3)


if __name__ == "__main__":
    main()
