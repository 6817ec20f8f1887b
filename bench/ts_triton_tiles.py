"""Tile choices of the Triton prims_ts emulation (backends/flashinfer_ts/triton_decode.py) on one GPU.

Usage: python bench/ts_triton_tiles.py [--requests 64] [--seq-len 8192]
Prints each (block_n, num_warps, num_stages) time and its fraction of the
memory-bound limit (K/V bytes over the copy bandwidth measured in this run).
"""

from __future__ import annotations

import argparse

import torch

from kvdbg.backends.flashinfer_ts.triton_decode import triton_decode


def timed(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--query-len", type=int, default=8)
    args = ap.parse_args()
    nbytes = 4 << 30
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    bw = 2 * nbytes / timed(lambda: dst.copy_(src), 10)
    del src, dst
    b, sq, hq, hkv, d, ps = args.requests, args.query_len, 32, 8, 128, 16
    pages = b * args.seq_len // ps
    cache = torch.randn(pages, hkv, ps, 2 * d, device="cuda", dtype=torch.bfloat16)
    k, v = cache[..., :d], cache[..., d:]
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, -1)
    lens = torch.full((b,), args.seq_len, dtype=torch.int32, device="cuda")
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    limit = cache.numel() * 2 / bw  # read-only: the copy's total (read + write) rate is the ceiling
    print(f"copy {bw / 1e12:.2f} TB/s; K/V {cache.numel() * 2 / 1e9:.2f} GB; limit {limit * 1e3:.3f} ms")
    for mask in ("dense", "causal"):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    try:
                        t = timed(lambda: triton_decode(q, k, v, lens, table, mask_type=mask, window_left=-1,
                                                        bmm1_scale=0.08, bmm2_scale=1.0, out=out, block_n=block_n,
                                                        num_warps=warps, num_stages=stages))
                    except Exception as exc:  # out of shared memory etc.
                        print(f"{mask:6s} block_n {block_n:3d} warps {warps} stages {stages}: {type(exc).__name__}")
                        continue
                    print(f"{mask:6s} block_n {block_n:3d} warps {warps} stages {stages}: {t * 1e3:7.3f} ms "
                          f"{limit / t:6.1%}")


if __name__ == "__main__":
    main()
