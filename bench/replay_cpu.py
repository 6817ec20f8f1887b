"""Replay time per backend on CPU for a 64-request snapshot, against a per-request gathered-SDPA loop.

The loop is how vLLM's backend tests build their reference: for each request,
gather its pages through the block table, run scaled_dot_product_attention,
copy the result out. Ratios are measured in one run; nothing is asserted.

    python bench/replay_cpu.py [--seq-len 1024] [--query-len 1] [--repeat 3] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvdbg.attention import ReplayOptions
from kvdbg.replay import common_metadata, kv_views, load_backends, run_backend, working_cache
from kvdbg.synth import SynthSpec, synth_snapshot


def sdpa_loop(snap, cache, common, query):
    """Per-request gather + SDPA, the way vLLM's tests compute expected outputs."""
    layer, ps = snap.meta.layer, snap.page_size
    k_pages, v_pages = kv_views(snap.meta, cache)
    out = torch.empty(query.shape, dtype=torch.float32)
    qsl = common.query_start_loc.tolist()
    for r, length in enumerate(common.seq_lens.tolist()):
        pages = common.block_table[r, : -(-length // ps)]
        k = k_pages[pages].permute(1, 0, 2, 3).reshape(layer.num_kv_heads, -1, layer.head_size)[:, :length].float()
        v = v_pages[pages].permute(1, 0, 2, 3).reshape(layer.num_kv_heads, -1, layer.head_size)[:, :length].float()
        q = query[qsl[r]:qsl[r + 1]].transpose(0, 1).float()
        q_len = q.shape[1]
        mask = torch.arange(length).unsqueeze(0) <= (length - q_len + torch.arange(q_len)).unsqueeze(1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True)
        out[qsl[r]:qsl[r + 1]] = o.transpose(0, 1)
    return out


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--query-len", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time compiled flex (first call excluded)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    lens = tuple(args.seq_len - (i * 37) % (args.seq_len // 2) for i in range(args.requests))
    snap = synth_snapshot(SynthSpec(seq_lens=lens, query_len=args.query_len, num_heads=8, num_kv_heads=2,
                                    head_size=64, page_size=16, dtype="bfloat16", new_kv=False))
    common = common_metadata(snap, 0)
    cache = working_cache(snap)
    query = snap.steps[0].query
    print(f"{args.requests} requests, seq_len {min(lens)}..{max(lens)}, query_len {args.query_len}, "
          f"Hq 8 / Hkv 2, D 64, page 16, bf16, {torch.get_num_threads()} threads")
    base = timed(lambda: sdpa_loop(snap, cache, common, query), args.repeat)
    print(f"{'per-request gathered SDPA loop':34s} {base * 1e3:9.1f} ms   1.00x")
    configs = [("reference", ReplayOptions()), ("reference --exact", ReplayOptions(exact=True)),
               ("flex (eager)", ReplayOptions(compile=False)), ("flashinfer_ts", ReplayOptions())]
    if args.compile:
        configs.append(("flex (compiled)", ReplayOptions(compile=True)))
    for label, options in configs:
        name = label.split()[0]
        statuses, instances, specs = load_backends([name], snap.meta, options)
        if name not in instances:
            print(f"{label:34s} unavailable: {statuses[0].reason}")
            continue
        inst = instances[name]
        dtype = getattr(torch, snap.meta.layer.dtype)
        run_backend(name, specs[name], inst, common, query, cache, dtype)  # warm-up (and compile)
        t = timed(lambda: run_backend(name, specs[name], inst, common, query, cache, dtype), args.repeat)
        print(f"{label:34s} {t * 1e3:9.1f} ms  {t / base:5.2f}x  ({inst.describe().kernel})")


if __name__ == "__main__":
    main()
