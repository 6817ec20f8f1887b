"""Where a GPU replay's time goes: each backend's build and forward split into parts, and baselines.

Usage: python bench/gpu_breakdown.py [--requests 64] [--seq-len 8192] [--query-len 8] [--iters 30]
                                     [--profile] [--json]

On the 64 x 8192 case (Hq 32 / Hkv 8, D 128, bf16, dense) it prints, all from
one run:

- the memory-bound limit (bytes touched / copy bandwidth, as bench/gpu_replay.py);
- flashinfer_ts: builder.build, forward, and the emulation kernel launched alone
  with the same arguments (with and without its in-kernel precondition check),
  each as a share of the limit, timed two ways:

  * *back to back*: ``--iters`` calls queued with no synchronisation between
    them, timed on the device (CUDA events). The host's launch work for a call
    (Python, Triton's launcher: ~0.1-0.2 ms) overlaps the device's work on the
    calls before, so this is the device's time per call -- what the emulation
    costs the GPU's memory system. Its share for build + forward is the
    figure (target >= 80 %): a replay of many steps, like vLLM's decode under
    CUDA graphs, keeps the device busy with the next step while the host
    prepares it.
  * *one call alone*: synchronised before and after each call, so the
    device idles while the host launches. That is what one step costs a
    clock on the wall when nothing else is queued, and it bounds any figure
    by device / (device + host launch time). The last flashinfer_ts row is a
    whole step of the column as kvdbg's runner runs it (``run_backend``:
    build, forward, findings, explain; it synchronises after build and
    forward to time them).

- the reference's forward against a gathered SDPA: the K/V gathered through the
  block table into contiguous tensors, then ``scaled_dot_product_attention``
  (bf16 flash, and fp32 with the same upcast the reference makes);
- with ``--profile``, the CUDA profiler's top operators over flashinfer_ts
  build + forward and the reference's forward.

``--json`` ends the output with one line of JSON (every row, the figure, and
whether it meets the target). ``--device cpu`` with tiny sizes runs the
script's own logic without a GPU (the Triton rows then say why they are
missing); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import traceback

import torch
import torch.nn.functional as F

from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.layout import kv_views
from kvdbg.replayer.runner import common_metadata, load_backends, run_backend
from kvdbg.moves.synth import SynthSpec, synth_snapshot

TARGET = 0.80  # FLASHINFER_TS emulation, build + forward back to back, as a share of the limit
FIGURE_ROW = "build + forward, back to back"
DEVICE = "cuda"


def _is_cuda() -> bool:
    return DEVICE.startswith("cuda")


def _sync() -> None:
    if _is_cuda():
        torch.cuda.synchronize()


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy rate, bytes read + written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    seconds = back_to_back(lambda: dst.copy_(src), iters)
    return 2 * nbytes / seconds


def synced_time(fn, iters: int) -> float:
    """Median seconds of one call alone: host and device together, synchronised before and after it."""
    for _ in range(2):
        fn()
    _sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_time(fn, iters: int) -> float:
    """Median seconds the host spends in a call (launch overhead), the device idle before each call."""
    fn()
    times = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    _sync()
    return statistics.median(times)


def back_to_back(fn, iters: int) -> float:
    """Seconds per call of ``iters`` calls queued without a synchronisation between them, timed on the device.

    Only the first call's launch is not hidden behind earlier work (it adds
    host launch time / iters: a conservative bias). Where the host cannot keep
    ahead of the device, this measures the host instead, as it should.
    """
    for _ in range(2):
        fn()
    _sync()
    if not _is_cuda():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def gathered_sdpa(q, k_pages, v_pages, table, dtype):
    """The obvious baseline: gather pages into [B, Hkv, L, D], then one SDPA call (GQA by the call)."""
    b, pages = table.shape
    keys, values = k_pages[table], v_pages[table]  # [B, pages, Hkv, ps, D]
    hkv, ps, d = keys.shape[2:]
    keys = keys.permute(0, 2, 1, 3, 4).reshape(b, hkv, pages * ps, d).to(dtype)
    values = values.permute(0, 2, 1, 3, 4).reshape(b, hkv, pages * ps, d).to(dtype)
    return F.scaled_dot_product_attention(q.to(dtype), keys, values, enable_gqa=True)


class Report:
    """Rows printed as they come, kept for the JSON line; a failed section prints its traceback's tail."""

    def __init__(self, limit: float):
        self.limit = limit
        self.rows: dict[str, dict[str, float]] = {}
        self.errors: dict[str, str] = {}
        self.section = ""

    def heading(self, name: str) -> None:
        self.section = name
        print(name)

    def row(self, label: str, seconds: float) -> None:
        print(f"  {label:52s} {seconds * 1e3:9.3f} ms  {self.limit / seconds:7.1%} of the limit")
        self.rows[f"{self.section}: {label}"] = {"ms": seconds * 1e3, "share": self.limit / seconds}

    def failed(self, what: str) -> None:
        tail = traceback.format_exc().strip().splitlines()[-6:]
        print(f"  {what} FAILED:\n    " + "\n    ".join(tail))
        self.errors[f"{self.section}: {what}"] = tail[-1] if tail else "?"


def flashinfer_ts_rows(report: Report, ts, spec, common, query, cache, out, args) -> dict:
    md = ts.builder.build(common)
    ts.impl.forward(query, cache, md, out)
    emulator = {"emulator": ts.impl.emulator, "note": ts.impl.emulator_note}
    print(f"  emulation the forward runs: {ts.impl.emulator}" +
          (f" ({ts.impl.emulator_note})" if ts.impl.emulator_note else ""))

    def step():
        ts.impl.forward(query, cache, ts.builder.build(common), out)

    report.row(FIGURE_ROW, back_to_back(step, args.iters))
    report.row("build + forward, one step alone (synchronised)", synced_time(step, args.iters))
    report.row("builder.build, back to back", back_to_back(lambda: ts.builder.build(common), args.iters))
    report.row("builder.build, one call alone", synced_time(lambda: ts.builder.build(common), args.iters))
    md = ts.builder.build(common)
    report.row("forward, back to back", back_to_back(lambda: ts.impl.forward(query, cache, md, out), args.iters))
    report.row("forward, one call alone", synced_time(lambda: ts.impl.forward(query, cache, md, out), args.iters))
    report.row("forward, host side only (launches, no wait)",
               host_time(lambda: ts.impl.forward(query, cache, md, out), args.iters))
    report.row("a replay's step of this column (run_backend)",
               synced_time(lambda: run_backend("flashinfer_ts", spec, ts, common, query, cache, torch.bfloat16),
                           max(3, args.iters // 3)))
    return emulator


def kernel_rows(report: Report, ts, md, query, out, args) -> None:
    """The Triton kernel as the forward launches it (precondition check in the kernel), and without the check."""
    from kvdbg.backends.flashinfer_ts import triton_decode as _triton_decode

    k_cache, v_cache = ts.impl.last_views[:2]
    layer = ts.meta.layer
    q4 = query.reshape(args.requests, args.query_len, layer.num_heads, layer.head_size)
    o4 = out.view(q4.shape)

    def launch(max_kv_len):
        return lambda: _triton_decode.triton_decode(
            q4, k_cache, v_cache, md.seq_lens, md.block_table, mask_type=md.plan.mask_type,
            window_left=md.plan.window_left, bmm1_scale=ts.impl.bmm1_scale, bmm2_scale=ts.impl.bmm2_scale,
            out=o4, max_kv_len=max_kv_len)

    checked, unchecked = launch(md.max_kv_len), launch(None)
    report.row("Triton kernel, back to back (check in the kernel)", back_to_back(checked, args.iters))
    report.row("Triton kernel, back to back, no precondition check", back_to_back(unchecked, args.iters))
    report.row("Triton kernel, one call alone", synced_time(checked, args.iters))
    report.row("Triton kernel, host side only", host_time(checked, args.iters))


def scan_rows(report: Report, ts, md, num_pages: int, args) -> None:
    """The host-side rule (findings and written tokens): not part of build + forward, which checks on the device."""
    from dataclasses import replace

    from kvdbg.backends.flashinfer_ts import undefined_codes

    ps = ts.builder.page_size
    report.row("undefined_codes on the device (findings' rule only)",
               synced_time(lambda: undefined_codes(md, num_pages, ps).tolist(), args.iters))

    def on_host():
        host = replace(md, seq_lens=md.seq_lens.cpu(), block_table=md.block_table.cpu())
        return undefined_codes(host, num_pages, ps).tolist()

    report.row("undefined_codes on a host copy (what written_tokens runs)", synced_time(on_host, args.iters))


def reference_rows(report: Report, ref, snap, common, query, cache, args) -> None:
    from kvdbg.backends import reference

    out32 = torch.empty(query.shape, dtype=torch.float32, device=DEVICE)
    default_budget = reference.CUDA_CHUNK_BUDGET_BYTES
    try:
        for budget in sorted({default_budget, 256 << 20, 1 << 30}):
            reference.CUDA_CHUNK_BUDGET_BYTES = budget
            rmd = ref.builder.build(common)
            report.row(f"build, budget {budget >> 20} MiB ({len(rmd.chunks)} chunks)",
                       synced_time(lambda: ref.builder.build(common), args.iters))
            report.row(f"forward, budget {budget >> 20} MiB",
                       synced_time(lambda: ref.impl.forward(query, cache, rmd, out32), args.iters))
    finally:
        reference.CUDA_CHUNK_BUDGET_BYTES = default_budget
    k_pages, v_pages = kv_views(snap.meta, cache)
    table = common.block_table[:, :args.seq_len // snap.page_size]
    layer = snap.meta.layer
    qb = query.reshape(args.requests, args.query_len, layer.num_heads, layer.head_size).transpose(1, 2)
    for dtype in (torch.bfloat16, torch.float32):
        try:
            report.row(f"gathered SDPA, {str(dtype)[6:]}",
                       synced_time(lambda: gathered_sdpa(qb, k_pages, v_pages, table, dtype), args.iters))
        except torch.OutOfMemoryError as exc:
            print(f"  gathered SDPA {dtype}: out of memory ({exc})")


def main() -> None:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--query-len", type=int, default=8)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="also print the CUDA profiler's top operators")
    parser.add_argument("--json", action="store_true", help="end with one line of JSON")
    parser.add_argument("--device", default="cuda", help="cuda (the figures) or cpu (a smoke run of the script)")
    args = parser.parse_args()
    DEVICE = args.device
    name = torch.cuda.get_device_name() if _is_cuda() else "cpu"
    print(f"device: {name}, torch {torch.__version__}")
    bw = copy_bandwidth(4 << 30 if _is_cuda() else 64 << 20)
    heads, kv_heads, head_size = 32, 8, 128
    spec = SynthSpec(seq_lens=(args.seq_len,) * args.requests, query_len=args.query_len, num_heads=heads,
                     num_kv_heads=kv_heads, head_size=head_size, causal=False, new_kv=False,
                     max_model_len=max(32768, args.seq_len))
    snap = synth_snapshot(spec)
    cache = working_cache(snap, DEVICE)
    common = common_metadata(snap, 0, DEVICE)
    query = snap.steps[0].query.to(DEVICE)
    kv_bytes = args.requests * args.seq_len * kv_heads * head_size * 2 * 2
    limit = (kv_bytes + 2 * query.numel() * 2) / bw
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.requests} x {args.seq_len}, q {args.query_len}: "
          f"limit {limit * 1e3:.3f} ms")
    report = Report(limit)
    summary: dict = {"device": name, "torch": torch.__version__, "bandwidth_tb_s": bw / 1e12,
                     "limit_ms": limit * 1e3, "case": vars(args), "target": TARGET}

    options = ReplayOptions(device=DEVICE)
    _, instances, specs = load_backends(["reference", "flashinfer_ts"], snap.meta, options)
    out = torch.empty(query.shape, dtype=torch.bfloat16, device=DEVICE)
    ts = instances["flashinfer_ts"]
    report.heading("flashinfer_ts")
    try:
        summary.update(flashinfer_ts_rows(report, ts, specs["flashinfer_ts"], common, query, cache, out, args))
    except Exception:
        report.failed("build + forward")
    md = ts.builder.build(common)
    try:
        kernel_rows(report, ts, md, query, out, args)
    except Exception:
        report.failed("Triton kernel alone")
    try:
        scan_rows(report, ts, md, int(cache.shape[0]), args)
    except Exception:
        report.failed("precondition scan")

    report.heading("reference")
    try:
        reference_rows(report, instances["reference"], snap, common, query, cache, args)
    except Exception:
        report.failed("reference rows")

    if args.profile and _is_cuda():
        from torch.profiler import ProfilerActivity, profile

        ref = instances["reference"]
        rmd = ref.builder.build(common)
        out32 = torch.empty(query.shape, dtype=torch.float32, device=DEVICE)
        for label, fn in (("flashinfer_ts build + forward",
                           lambda: ts.impl.forward(query, cache, ts.builder.build(common), out)),
                          ("reference forward", lambda: ref.impl.forward(query, cache, rmd, out32))):
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            print(f"{label}, 5 calls:")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))

    figure = report.rows.get(f"flashinfer_ts: {FIGURE_ROW}")
    if figure is not None:
        print(f"FLASHINFER_TS emulation, {FIGURE_ROW}: {figure['share']:.1%} of the limit "
              f"(target >= {TARGET:.0%}): {'met' if figure['share'] >= TARGET else 'NOT met'}")
    summary.update(rows=report.rows, errors=report.errors, figure=figure,
                   met=figure is not None and figure["share"] >= TARGET)
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
