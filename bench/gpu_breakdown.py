"""Where a GPU replay's time goes: each backend's build and forward split into parts, and baselines.

Usage: python bench/gpu_breakdown.py [--requests 64] [--seq-len 8192] [--query-len 8] [--iters 20]

On the 64 x 8192 case (Hq 32 / Hkv 8, D 128, bf16, dense) it prints, all from
one run:

- the memory-bound limit (bytes touched / copy bandwidth, as bench/gpu_replay.py);
- flashinfer_ts: builder.build, forward, and the emulation kernel launched alone
  with the same arguments, each as a share of the limit;
- the reference's forward against a gathered SDPA: the K/V gathered through the
  block table into contiguous tensors, then ``scaled_dot_product_attention``
  (bf16 flash, and fp32 with the same upcast the reference makes);
- the CUDA profiler's top operators over the timed flashinfer_ts iterations.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.layout import kv_views
from kvdbg.replayer.runner import common_metadata, load_backends
from kvdbg.moves.synth import SynthSpec, synth_snapshot


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = gpu_time(lambda: dst.copy_(src), iters)
    return 2 * nbytes / seconds


def gpu_time(fn, iters: int) -> float:
    """Median seconds per call, host and device together (synchronised around each call)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_time(fn, iters: int) -> float:
    """Median seconds the host spends in a call (launch overhead), the device idle before each call."""
    fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times)


def gathered_sdpa(q, k_pages, v_pages, table, dtype):
    """The obvious baseline: gather pages into [B, Hkv, L, D], then one SDPA call (GQA by the call)."""
    b, pages = table.shape
    keys, values = k_pages[table], v_pages[table]  # [B, pages, Hkv, ps, D]
    hkv, ps, d = keys.shape[2:]
    keys = keys.permute(0, 2, 1, 3, 4).reshape(b, hkv, pages * ps, d).to(dtype)
    values = values.permute(0, 2, 1, 3, 4).reshape(b, hkv, pages * ps, d).to(dtype)
    return F.scaled_dot_product_attention(q.to(dtype), keys, values, enable_gqa=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--query-len", type=int, default=8)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="also print the CUDA profiler's top operators")
    args = parser.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    bw = copy_bandwidth()
    spec = SynthSpec(seq_lens=(args.seq_len,) * args.requests, query_len=args.query_len, num_heads=32,
                     num_kv_heads=8, head_size=128, causal=False, new_kv=False,
                     max_model_len=max(32768, args.seq_len))
    snap = synth_snapshot(spec)
    cache = working_cache(snap, "cuda")
    common = common_metadata(snap, 0, "cuda")
    query = snap.steps[0].query.to("cuda")
    kv_bytes = args.requests * args.seq_len * 8 * 128 * 2 * 2
    limit = (kv_bytes + 2 * query.numel() * 2) / bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.requests} x {args.seq_len}, q {args.query_len}: "
          f"limit {limit * 1e3:.3f} ms")

    def row(label: str, seconds: float) -> None:
        print(f"  {label:44s} {seconds * 1e3:9.3f} ms  {limit / seconds:7.1%} of the limit")

    options = ReplayOptions(device="cuda")
    _, instances, _ = load_backends(["reference", "flashinfer_ts"], snap.meta, options)
    out = torch.empty(query.shape, dtype=torch.bfloat16, device="cuda")

    ts = instances["flashinfer_ts"]
    md = ts.builder.build(common)
    print("flashinfer_ts")
    row("builder.build", gpu_time(lambda: ts.builder.build(common), args.iters))

    def ts_forward():
        ts.impl.forward(query, cache, ts.builder.build(common), out)

    row("build + forward (what a replay runs)", gpu_time(ts_forward, args.iters))
    md = ts.builder.build(common)
    row("forward", gpu_time(lambda: ts.impl.forward(query, cache, md, out), args.iters))
    row("forward, host side only (launches, no wait)", host_time(lambda: ts.impl.forward(query, cache, md, out),
                                                                 args.iters))
    from kvdbg.backends.flashinfer_ts import triton_decode as _triton_decode
    from kvdbg.backends.flashinfer_ts import undefined_codes

    k_cache, v_cache = ts.impl.last_views[:2]
    q4 = query.reshape(args.requests, args.query_len, 32, 128)
    valid = torch.ones(args.requests, dtype=torch.bool, device="cuda")
    o4 = out.view(q4.shape)
    row("undefined_codes (the precondition scan)",
        gpu_time(lambda: undefined_codes(md, int(k_cache.shape[0]), ts.builder.page_size), args.iters))

    def kernel_alone():
        _triton_decode.triton_decode(q4, k_cache, v_cache, md.seq_lens, md.block_table, mask_type="dense",
                                     window_left=-1, bmm1_scale=ts.impl.bmm1_scale, bmm2_scale=1.0, out=o4,
                                     valid=valid)

    row("Triton kernel alone (launch included)", gpu_time(kernel_alone, args.iters))
    row("Triton kernel alone, host side only", host_time(kernel_alone, args.iters))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        kernel_alone()
    end.record()
    torch.cuda.synchronize()
    row("Triton kernel, back to back (device time)", start.elapsed_time(end) / 1e3 / args.iters)

    ref = instances["reference"]
    out32 = torch.empty(query.shape, dtype=torch.float32, device="cuda")
    print("reference")
    from kvdbg.backends import reference

    default_budget = reference.CUDA_CHUNK_BUDGET_BYTES
    for budget in sorted({default_budget, 256 << 20, 1 << 30}):
        reference.CUDA_CHUNK_BUDGET_BYTES = budget
        rmd = ref.builder.build(common)
        row(f"build, budget {budget >> 20} MiB ({len(rmd.chunks)} chunks)",
            gpu_time(lambda: ref.builder.build(common), args.iters))
        row(f"forward, budget {budget >> 20} MiB", gpu_time(lambda: ref.impl.forward(query, cache, rmd, out32),
                                                           args.iters))
    reference.CUDA_CHUNK_BUDGET_BYTES = default_budget
    k_pages, v_pages = kv_views(snap.meta, cache)
    table = common.block_table[:, :args.seq_len // snap.page_size]
    qb = query.reshape(args.requests, args.query_len, 32, 128).transpose(1, 2)
    for dtype in (torch.bfloat16, torch.float32):
        try:
            row(f"gathered SDPA, {str(dtype)[6:]}",
                gpu_time(lambda: gathered_sdpa(qb, k_pages, v_pages, table, dtype), args.iters))
        except torch.OutOfMemoryError as exc:
            print(f"  gathered SDPA {dtype}: out of memory ({exc})")

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        rmd = ref.builder.build(common)
        for label, fn in (("flashinfer_ts build + forward", ts_forward),
                          ("reference forward", lambda: ref.impl.forward(query, cache, rmd, out32))):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(f"{label}, 5 calls:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
