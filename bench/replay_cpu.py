"""Replay time per backend on CPU for a 64-request snapshot, against a per-request gathered-SDPA loop.

The loop is how vLLM's backend tests build their reference: for each request,
gather its pages through the block table, run scaled_dot_product_attention,
copy the result out. Ratios are measured in one run; nothing is asserted.

    python bench/replay_cpu.py [--seq-len 1024] [--query-len 1] [--repeat 3] [--compile]

Peak memory: with ``--rss SNAPSHOT`` (or ``--make-2gb PATH``, which first
synthesises the 2 GiB 64 x 8192 snapshot there if missing), each
``kvdbg replay SNAPSHOT --backend X`` runs in a child process of its own and its
peak RSS (the kernel's ru_maxrss for that child, from os.wait4) is printed
against the file size. The replay CLI always adds the reference, so
``--backend flashinfer_ts`` is reference + flashinfer_ts. Eager flex on CPU
scores each run of query blocks against only the pages those blocks list, but
is still measured on ``--flex-snapshot`` (default: a 64 x 1024, 256 MiB
snapshot made here) unless ``--flex-big``.

    python bench/replay_cpu.py --make-2gb /tmp/kvdbg-2g.safetensors
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from kvdbg.backends.base import ReplayOptions
from kvdbg.snapshot.cache import working_cache
from kvdbg.snapshot.layout import kv_views
from kvdbg.replayer.runner import common_metadata, load_backends, run_backend
from kvdbg.moves.synth import SynthSpec, synth_snapshot

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _big import REPO, make_2gb  # noqa: E402


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
    ap.add_argument("--rss", metavar="SNAPSHOT", help="also measure each backend's peak RSS replaying SNAPSHOT")
    ap.add_argument("--make-2gb", metavar="PATH", help="--rss on the 2 GiB snapshot at PATH (made first if missing)")
    ap.add_argument("--flex-snapshot", metavar="SNAPSHOT", help="snapshot for flex's RSS (default: 64 x 1024)")
    ap.add_argument("--flex-big", action="store_true", help="measure flex on the --rss snapshot too (may not fit)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds each RSS child may run")
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
    if args.make_2gb:
        args.rss = make_2gb(args.make_2gb)
    if args.rss:
        peak_rss_table(args.rss, args.flex_snapshot, args.flex_big, args.timeout)


def child_peak_rss(argv: list[str], timeout: float) -> tuple[int, float, int]:
    """Run ``argv``; return (its own peak RSS in bytes, wall seconds, exit code). Linux: ru_maxrss is KiB."""
    import threading

    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    try:
        # wait4, not Popen.wait: it returns this child's own rusage, not a maximum over all children.
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, time.perf_counter() - t0, proc.returncode


def peak_rss_table(snapshot: str, flex_snapshot: str | None, flex_big: bool, timeout: float) -> None:
    size = os.path.getsize(snapshot)
    if flex_snapshot is None and not flex_big:
        flex_snapshot = os.path.join(tempfile.gettempdir(), "kvdbg-bench-64x1024.safetensors")
        if not os.path.exists(flex_snapshot):
            subprocess.run([sys.executable, "-m", "kvdbg", "synth", "-o", flex_snapshot, "--seq-len",
                            ",".join(["1024"] * 64), "--num-heads", "32", "--num-kv-heads", "8", "--head-size", "128",
                            "--dtype", "bfloat16"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd=REPO)
    rows = [("reference", snapshot), ("flashinfer_ts", snapshot),
            ("flex", snapshot if flex_big else flex_snapshot)]
    print()
    print(f"peak RSS of `kvdbg replay SNAP --backend X` in a child process each (target <= 1.5x the file)")
    print(f"{'backend':16s} {'file':>10s} {'peak RSS':>10s} {'RSS/file':>9s} {'wall':>8s}  snapshot")
    for backend, path in rows:
        argv = [sys.executable, "-m", "kvdbg", "replay", path, "--backend", backend]
        rss, wall, code = child_peak_rss(argv, timeout)
        file_size = os.path.getsize(path)
        note = "" if code in (0, 1) else (f"  (timed out after {timeout:.0f} s)" if code < 0 else f"  (exit {code})")
        print(f"{backend:16s} {file_size / 2**20:8.0f}Mi {rss / 2**20:8.0f}Mi {rss / file_size:8.2f}x "
              f"{wall:7.1f}s  {os.path.basename(path)}{note}")


if __name__ == "__main__":
    main()
