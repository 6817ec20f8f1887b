"""Per-backend replay time on a GPU against the memory-bound limit, and the BlockMask build time.

Usage: python bench/gpu_replay.py [--requests 64] [--seq-len 8192] [--kv-heads 8] [--head-dim 128]
                                  [--query-len 8] [--mask dense|causal] [--iters 10]

The limit is bytes touched / measured copy bandwidth: the K/V of every live
token plus query and output, over the device-to-device copy rate measured in
this same run (bytes read + written per second, the memory's total traffic). All numbers printed are from
one run; the ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import working_cache
from kvdbg.replayer.runner import common_metadata, load_backends, run_backend
from kvdbg.moves.synth import SynthSpec, synth_snapshot


def copy_bandwidth(device: str, nbytes: int = 4 << 30, iters: int = 10) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / iters
    return 2 * nbytes / seconds  # read + written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--query-len", type=int, default=8)
    parser.add_argument("--mask", choices=["dense", "causal"], default="dense")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--backend", action="append", default=None)
    args = parser.parse_args()
    device = "cuda"
    print(f"device: {torch.cuda.get_device_name()} (capability {torch.cuda.get_device_capability()}), "
          f"torch {torch.__version__}")
    bw = copy_bandwidth(device)
    print(f"copy bandwidth: {bw / 1e12:.2f} TB/s (bytes read + written)")

    t0 = time.perf_counter()
    spec = SynthSpec(seq_lens=(args.seq_len,) * args.requests, query_len=args.query_len, num_heads=args.heads,
                     num_kv_heads=args.kv_heads, head_size=args.head_dim, causal=args.mask == "causal",
                     new_kv=False, max_model_len=max(32768, args.seq_len))
    snap = synth_snapshot(spec)
    print(f"snapshot: {args.requests} requests x {args.seq_len} tokens, Hq {args.heads} / Hkv {args.kv_heads}, "
          f"D {args.head_dim}, q {args.query_len}, {args.mask}, bf16; built in {time.perf_counter() - t0:.1f} s")

    options = ReplayOptions(device=device)
    cache = working_cache(snap, device)
    common = common_metadata(snap, 0, device)
    query = snap.steps[0].query.to(device)
    itemsize = 2
    kv_bytes = args.requests * args.seq_len * args.kv_heads * args.head_dim * 2 * itemsize
    qo_bytes = 2 * query.numel() * itemsize
    # HBM bandwidth is shared by reads and writes: a read-only kernel's ceiling is the copy's total rate.
    limit_s = (kv_bytes + qo_bytes) / bw
    print(f"bytes touched: {(kv_bytes + qo_bytes) / 1e9:.3f} GB -> memory-bound limit {limit_s * 1e3:.3f} ms")

    names = args.backend or ["reference", "flex", "flashinfer_ts"]
    statuses, instances, specs = load_backends(names, snap.meta, options)
    for st in statuses:
        if not st.available:
            print(f"{st.name:14s} unavailable: {st.reason}")
    rows = [(name, name) for name in names if name in instances]
    if "flex" in instances:  # the replay default picks eager or compiled by size: time the other one too
        forced = ReplayOptions(device=device, compile=not instances["flex"].impl.compiled
                               if instances["flex"].impl.requested is not None else True)
        _, extra, _ = load_backends(["flex"], snap.meta, forced)
        instances["flex (forced)"], specs["flex (forced)"] = extra["flex"], specs["flex"]
        rows.append(("flex (forced)", "flex"))
    print(f"{'backend':14s} {'kernel':44s} {'build ms':>9s} {'forward ms':>11s} {'limit/forward':>14s}")
    for name, backend in rows:
        builds, forwards = [], []
        for i in range(args.iters + 2):  # two warm-ups: compilation and autotuning happen there
            run = run_backend(backend, specs[name], instances[name], common, query, cache, torch.bfloat16)
            if run.error:
                print(f"{name:14s} raised: {run.error}")
                break
            if i >= 2:
                builds.append(run.build_s)
                forwards.append(run.forward_s)
        if not forwards:
            continue
        build, forward = statistics.median(builds), statistics.median(forwards)
        info = run.info
        print(f"{name:14s} {info.kernel[:44]:44s} {build * 1e3:9.3f} {forward * 1e3:11.3f} "
              f"{limit_s / forward:13.1%}")
    print("flex's build time is its BlockMask build (physical->logical map + BlockMask.from_kv_blocks).")


if __name__ == "__main__":
    main()
