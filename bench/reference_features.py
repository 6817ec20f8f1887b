"""The reference's time with each layer feature it models, against the same snapshot without features, on CPU.

One synthetic batch (64 requests by default), replayed through the reference alone: plain, with a soft cap,
with sinks (the online softmax starts from them), with ALiBi (the bias added in place to the scores), with all
three, and with all three while the chunk budget cuts every request into KV blocks. Ratios come from one run;
nothing is asserted.

    python bench/reference_features.py [--requests 64] [--seq-len 2048] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import kvdbg.backends.reference as reference_module
from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import working_cache
from kvdbg.replayer.runner import common_metadata, load_backends, run_backend
from kvdbg.moves.synth import SynthSpec, synth_snapshot


def best_time(snap, repeat: int) -> float:
    statuses, instances, specs = load_backends(["reference"], snap.meta, ReplayOptions())
    cache = working_cache(snap)
    common = common_metadata(snap, 0)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run_backend("reference", specs["reference"], instances["reference"], common, snap.steps[0].query, cache,
                    snap.kv_cache.dtype, propagate=True)
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--query-len", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    base = dict(seq_lens=(args.seq_len,) * args.requests, query_len=args.query_len, num_heads=32, num_kv_heads=8,
                head_size=128, new_kv=False)
    variants = {
        "plain": {},
        "soft cap": dict(logits_soft_cap=30.0),
        "sinks": dict(sinks="auto"),
        "ALiBi": dict(alibi_slopes="auto"),
        "all three": dict(logits_soft_cap=30.0, sinks="auto", alibi_slopes="auto"),
    }
    results = {name: best_time(synth_snapshot(SynthSpec(**base, **extra)), args.repeat)
               for name, extra in variants.items()}
    budget = reference_module.CHUNK_BUDGET_BYTES
    reference_module.CHUNK_BUDGET_BYTES = 4 * 1024 * 1024  # every request cut into KV blocks
    try:
        plain_cut = best_time(synth_snapshot(SynthSpec(**base)), args.repeat)
        all_cut = best_time(synth_snapshot(SynthSpec(**base, **variants["all three"])), args.repeat)
    finally:
        reference_module.CHUNK_BUDGET_BYTES = budget
    plain = results["plain"][0]
    print(f"{args.requests} requests x {args.seq_len} keys, q={args.query_len}, Hq 32 / Hkv 8, D 128 (best of "
          f"{args.repeat})")
    for name, (best, median) in results.items():
        print(f"  {name:<10} {best * 1e3:8.1f} ms  (median {median * 1e3:8.1f})  x{best / plain:.2f} of plain")
    print(f"  KV blocks of 4 MiB: plain {plain_cut[0] * 1e3:.1f} ms, all three {all_cut[0] * 1e3:.1f} ms "
          f"(x{all_cut[0] / plain_cut[0]:.2f})")


if __name__ == "__main__":
    main()
