"""Time to verdict on a GPU: `kvdbg replay --device cuda` against `import torch` + CUDA init, cold and warm.

Usage: python bench/cuda_verdict.py [--runs 5] [--fixture dflash] [--backend NAME ...] [--diagnose]
                                    [--pycache DIR] [--json]

Runs the baseline (``python -c "import torch; torch.zeros(1, device='cuda')"``)
and the replay alternately, each in a fresh process. The first replay is the
cold one: no Triton or compile cache entry of this checkout yet (the caches are
pointed at an empty temporary directory for the whole run). Prints every
time, the cold and the median warm ratio (target: <= 2x), and the same per
backend alone; then, untimed, what each column of the replay ran (its
``--json`` record). ``--diagnose`` also times ``import torch, torch._dynamo``
+ CUDA init: what a replay would pay if anything on its path imported Dynamo
(torch's eager flex_attention call does; kvdbg's flex column on CUDA does not).

Python's bytecode cache matters here: a Python started with
PYTHONDONTWRITEBYTECODE and site-packages without .pyc files recompiles every
module it imports, which doubles `import torch`. A normal `pip install` writes
the .pyc files; this script says which case it ran in. ``--pycache DIR`` runs
the children with bytecode written to and read from DIR (PYTHONPYCACHEPREFIX,
PYTHONDONTWRITEBYTECODE dropped), each command run once untimed first to fill
it: the figures of a normal install, without writing into site-packages.
``--json`` ends the output with one line of JSON holding every time and ratio.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "import torch; torch.zeros(1, device='{device}')"
DYNAMO = "import torch, torch._dynamo; torch.zeros(1, device='{device}')"
TARGET = 2.0


def wall(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, check=False, cwd=HERE)
    if done.returncode not in (0, 1):
        sys.exit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.decode()[-400:]}")
    return time.perf_counter() - t0


def what_ran(replay: list[str], env: dict[str, str]) -> dict[str, str]:
    """backend -> the kernel its column says it ran (or why it is unavailable), from one --json replay."""
    done = subprocess.run(replay + ["--json"], capture_output=True, text=True, env=env, check=False, cwd=HERE)
    try:
        record = json.loads(done.stdout)
    except ValueError:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-300:]}"}
    return {b["name"]: (b["run"]["kernel"] if b.get("run") else f"unavailable: {b.get('reason')}")
            for b in record.get("backends", [])}


def children_env(caches: str, pycache: str | None) -> dict[str, str]:
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(caches, "triton"),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"))
    if pycache:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = os.path.abspath(pycache)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--fixture", default="dflash")
    parser.add_argument("--backend", action="append", default=None)
    parser.add_argument("--diagnose", action="store_true", help="also time import torch, torch._dynamo + CUDA init")
    parser.add_argument("--pycache", default=None, help="bytecode written to and read from this directory")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke run of the script
    args = parser.parse_args()
    baseline = [sys.executable, "-c", BASELINE.format(device=args.device)]
    with_dynamo = [sys.executable, "-c", DYNAMO.format(device=args.device)]
    import torch

    has_pyc = bool(glob.glob(os.path.join(os.path.dirname(torch.__file__), "__pycache__", "*.pyc")))
    if args.pycache:
        regime = f"bytecode cached under {args.pycache} (PYTHONPYCACHEPREFIX; filled by one untimed run each)"
    elif os.environ.get("PYTHONDONTWRITEBYTECODE") and not has_pyc:
        regime = "no bytecode cache: torch has no .pyc files and PYTHONDONTWRITEBYTECODE is set (every run recompiles)"
    else:
        regime = f"torch .pyc files {'present' if has_pyc else 'absent'}, PYTHONDONTWRITEBYTECODE " \
                 f"{'set' if os.environ.get('PYTHONDONTWRITEBYTECODE') else 'unset'}"
    print(f"bytecode: {regime}")
    snap = os.path.join(HERE, "fixtures", f"{args.fixture}.safetensors")
    replay = [sys.executable, "-m", "kvdbg", "replay", snap, "--device", args.device]
    caches = tempfile.mkdtemp(prefix="kvdbg-cuda-verdict-")
    env = children_env(caches, args.pycache)
    if args.pycache:  # fill the bytecode cache; the Triton/Inductor caches stay empty for the cold replay
        wall(baseline, env)
        wall(replay, dict(env, TRITON_CACHE_DIR=os.path.join(caches, "fill-triton"),
                          TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "fill-inductor")))
    base, runs, dynamo = [], [], []
    for _ in range(args.runs):
        base.append(wall(baseline, env))
        runs.append(wall(replay, env))
        if args.diagnose:
            dynamo.append(wall(with_dynamo, env))
    floor = statistics.median(base)
    print(f"import torch + CUDA init: {', '.join(f'{t:.2f}' for t in base)} s (median {floor:.2f} s)")
    print(f"kvdbg replay {args.fixture} --device {args.device}: {', '.join(f'{t:.2f}' for t in runs)} s")
    warm = statistics.median(runs[1:]) if len(runs) > 1 else runs[0]
    print(f"  cold {runs[0]:.2f} s = {runs[0] / floor:.2f}x, warm median {warm:.2f} s = {warm / floor:.2f}x "
          f"(target <= {TARGET:g}x)")
    summary = {"regime": regime, "baseline_s": base, "baseline_median_s": floor, "replay_s": runs,
               "cold_s": runs[0], "cold_ratio": runs[0] / floor, "warm_median_s": warm, "warm_ratio": warm / floor,
               "target": TARGET, "met": runs[0] / floor <= TARGET and warm / floor <= TARGET, "per_backend": {}}
    if dynamo:
        print(f"  import torch, torch._dynamo + CUDA init: median {statistics.median(dynamo):.2f} s = "
              f"{statistics.median(dynamo) / floor:.2f}x (what an import of Dynamo would add)")
        summary["dynamo_baseline_s"] = dynamo
    for name in args.backend or []:
        times = [wall(replay + ["--backend", name], env) for _ in range(max(1, args.runs // 2))]
        print(f"  --backend {name}: median {statistics.median(times):.2f} s = "
              f"{statistics.median(times) / floor:.2f}x")
        summary["per_backend"][name] = {"s": times, "ratio": statistics.median(times) / floor}
    ran = what_ran(replay, env)
    for name, kernel in ran.items():
        print(f"  ran: {name}: {kernel}")
    summary["ran"] = ran
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
