"""Small CPU replay: `kvdbg replay fixtures/dflash.safetensors` vs `python -c "import torch, torch._dynamo"`.

Usage:
    python bench/replay_start.py [--runs N] [--checkout] [--backend NAME ...]

A replay of a small snapshot is mostly start-up: torch, and the Dynamo import
that torch's flex_attention needs even when nothing is traced. The baseline is
that import alone; target: the whole replay <= 1.15x it. The cases are
interleaved (each round runs every case once, the order rotated per round) and
the figure is the median over rounds of replay / baseline in the same round.
Children run on the CPU (CUDA_VISIBLE_DEVICES empty) with the default thread
count. ``--backend NAME`` adds `kvdbg replay ... --backend NAME` (the
reference always runs too). Which kvdbg runs: as in bench/cli_start.py (the
installed script, or ``--checkout``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _launch import REPO, child_env, kvdbg_command, run_and_report  # noqa: E402

BASELINE = 'python -c "import torch, torch._dynamo"'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("snapshot", nargs="?", default=os.path.join(REPO, "fixtures", "dflash.safetensors"))
    parser.add_argument("--runs", type=int, default=7, help="rounds (default 7)")
    parser.add_argument("--checkout", action="store_true",
                        help="time this checkout (python -m kvdbg, PYTHONPATH=checkout), not the installed script")
    parser.add_argument("--with-installed", action="store_true",
                        help="with --checkout: also time the installed script's kvdbg in the same rounds (before/after)")
    parser.add_argument("--backend", action="append", default=[], help="also time --backend NAME (repeatable)")
    args = parser.parse_args()
    env = child_env(args.checkout, CUDA_VISIBLE_DEVICES="")
    kvdbg = kvdbg_command(args.checkout)
    name = os.path.basename(args.snapshot)
    cases = {BASELINE: [sys.executable, "-c", "import torch, torch._dynamo"],
             f"kvdbg replay {name}": [*kvdbg, "replay", args.snapshot]}
    for backend in args.backend:
        cases[f"kvdbg replay {name} --backend {backend}"] = [*kvdbg, "replay", args.snapshot, "--backend", backend]
    installed = kvdbg_command(False) if args.checkout and args.with_installed else None
    if installed:
        # The installed script ignores PYTHONPATH only if told: run it with the checkout left off the path.
        cases[f"installed: kvdbg replay {name}"] = ["env", f"PYTHONPATH={os.environ.get('PYTHONPATH', '')}",
                                                     *installed, "replay", args.snapshot]
    run_and_report(cases, args.runs, env, kvdbg, installed, BASELINE, 1.15)


if __name__ == "__main__":
    main()
