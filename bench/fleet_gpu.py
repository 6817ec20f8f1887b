"""`kvdbg replay DIR --device cuda` on a GPU machine: one GPU's throughput, every GPU's, and a worker killed.

Every run is the command a user types (``python -m kvdbg replay DIR --results
FILE --json ...``, default backends) in a child process; ratios are from this
one invocation. Rates are files per second over the whole command and *steady*
(from the 10th finished row to the last, start-up left out; see _fleet.py).

``--one-gpu`` (the fleet issue's figure): one GPU (``--device cuda:0``) on
  - small captures (``--small N``, ~330 KiB each) with 1, 2 and 4 workers;
  - the 2 GiB capture of bench/_big.py (made at ``--big PATH`` if missing),
    hard-linked ``--big-copies`` times, with 1 and 2 workers (GB/s of snapshot
    replayed too).

``--all-gpus`` (the multi-GPU issue's run): a directory of at least 200
captures of mixed sizes -- small ones, 64 MiB ones, and a few 1-2 GiB ones
(the 2 GiB capture and a 1 GiB one, hard-linked twice each) -- plus files
with planted failures (tests/fleet_helpers.py), replayed on one GPU
(``--device cuda:0``) and then on every visible GPU (``--device cuda``) with
the same workers per GPU: per-GPU file counts, throughput per GPU against the
one-GPU figure (target: within 20 %), the same verdicts. Then once more on
every GPU with one worker process killed (SIGKILL) mid-run: every file still
gets its row and its verdict.

    python bench/fleet_gpu.py --one-gpu [--small 200] [--big /tmp/kvdbg-2g.safetensors]
    python bench/fleet_gpu.py --all-gpus [--per-gpu 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _big import make_2gb  # noqa: E402
from _fleet import REPO, link_into, make_small, run, table  # noqa: E402

sys.path.insert(0, REPO)  # tests.fleet_helpers

# 1 GiB: 32 requests x 8192 tokens of the 2 GiB capture's layer; 64 MiB: 4 requests x 4096.
ONE_GIB = dict(seq_lens=(8192,) * 32, num_heads=32, num_kv_heads=8, head_size=128)
MEDIUM = dict(seq_lens=(4096,) * 4, num_heads=32, num_kv_heads=8, head_size=128)


def _synth_args(spec: dict) -> list[str]:
    args = ["--seq-len", ",".join(map(str, spec["seq_lens"])), "--num-heads", str(spec["num_heads"]),
            "--num-kv-heads", str(spec["num_kv_heads"]), "--head-size", str(spec["head_size"])]
    return args


def make_one_gib(path: str) -> str:
    import subprocess

    if not os.path.exists(path):
        print(f"synthesising a 1 GiB capture at {path}...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "kvdbg", "synth", "-o", path, *_synth_args(ONE_GIB),
                        "--dtype", "bfloat16"], check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return path


def gpus() -> int:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device visible")
    count = torch.cuda.device_count()
    print(f"{count} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPU(s)")
    return count


def one_gpu(args, work: str) -> None:
    small_dir = os.path.join(work, "small")
    link_into(small_dir, make_small(os.path.join(args.cache, "small"), args.small))
    runs = [run(f"small, {j} worker(s)", small_dir, ["--device", "cuda:0", "--jobs", str(j)], work)
            for j in (1, 2, 4)]
    table(runs, runs[0])
    big_dir = os.path.join(work, "big")
    link_into(big_dir, [make_2gb(args.big)], copies=args.big_copies)
    big = [run(f"2 GiB, {j} worker(s)", big_dir, ["--device", "cuda:0", "--jobs", str(j)], work) for j in (1, 2)]
    table(big, big[0])
    for r in big:
        print(f"{r['label']}: {r['bytes'] / r['wall'] / 1e9:.2f} GB/s of snapshot over the whole command")
    print("same verdicts across worker counts:",
          all(r["verdicts"] == runs[0]["verdicts"] for r in runs) and
          all(r["verdicts"] == big[0]["verdicts"] for r in big))


def all_gpus(args, work: str, count: int) -> None:
    from tests.fleet_helpers import mixed_directory

    cache = args.cache
    directory = os.path.join(work, "mixed")
    link_into(directory, make_small(os.path.join(cache, "small"), 180))
    link_into(directory, make_small(os.path.join(cache, "medium"), 12, prefix="medium", **MEDIUM))
    link_into(directory, [make_2gb(args.big), make_one_gib(os.path.join(cache, "one-gib.safetensors"))], copies=2)
    planted = os.path.join(cache, "planted")
    if not os.path.isdir(planted):
        mixed_directory(planted)
    link_into(directory, sorted(os.path.join(planted, n) for n in os.listdir(planted)
                                if n.endswith(".safetensors")))
    files = len([n for n in os.listdir(directory) if n.endswith(".safetensors")])
    per = ["--jobs", str(args.per_gpu)]
    one = run("one GPU (cuda:0)", directory, ["--device", "cuda:0", *per], work)
    every = run(f"every GPU ({count})", directory, ["--device", "cuda", *per], work)
    killed = run("every GPU, one killed", directory, ["--device", "cuda", *per], work, kill_after=files // 4)
    print(f"{files} captures, {args.per_gpu} worker(s) per GPU")
    table([one, every, killed], one)
    print("per GPU:", ", ".join(f"{d['device']} {d['files']} files" for d in every["devices"]))
    ratio = (every["steady"] / count) / one["steady"]
    print(f"throughput per GPU / one GPU's: {ratio:.2f} (steady rates; target >= 0.80)")
    print(f"every GPU got work: {len(every['devices']) == count and all(d['files'] for d in every['devices'])}")
    print(f"same verdicts as one GPU: {every['verdicts'] == one['verdicts']}; "
          f"same groups: {every['signatures'] == one['signatures']}")
    print(f"killed worker pid {killed['killed']}: lost {killed['lost']}; rows {killed['rows']} of {files}; "
          f"same verdicts: {killed['verdicts'] == one['verdicts']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one-gpu", action="store_true")
    ap.add_argument("--all-gpus", action="store_true")
    ap.add_argument("--small", type=int, default=200)
    ap.add_argument("--big", default=os.path.join(tempfile.gettempdir(), "kvdbg-2g.safetensors"))
    ap.add_argument("--big-copies", type=int, default=4)
    ap.add_argument("--per-gpu", type=int, default=2)
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "kvdbg-fleet-gpu"),
                    help="where the synthetic captures are made once")
    args = ap.parse_args()
    if not (args.one_gpu or args.all_gpus):
        ap.error("give --one-gpu and/or --all-gpus")
    count = gpus()
    work = tempfile.mkdtemp(prefix="kvdbg-fleet-gpu-", dir=os.path.dirname(args.big))
    t0 = time.perf_counter()
    if args.one_gpu:
        one_gpu(args, work)
    if args.all_gpus:
        all_gpus(args, work, count)
    print(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
