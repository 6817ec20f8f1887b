"""What capture's background writer spends per snapshot, step by step, and what the metadata's JSON costs.

Usage (any venv with kvdbg and torch; no engine):
    python bench/writer_cost.py [--snapshots 200] [--out /tmp/kvdbg-writer-cost]

Copies a decode step like the engine stage's (a CPU_ATTN cache of 48 pages
of 32 tokens, 2 KV heads of 64, float16, one request of 61 to 124 tokens, the
plugin's provenance: a snapshot of about 40 KB) with the calls the vLLM
plugin makes, and writes it with the calls the writer makes, in this thread,
``--snapshots`` times:

    build          the snapshot from the copies: the layout conversion, the read-back, the metadata
    metadata check the reader's checks on the metadata's values
    size           the exact file size, for the byte budget
    write          the reader's checks on the tensors, the encoding, the file and its fsync

Printed: the median of each per snapshot, and the metadata's JSON encoded by
``SnapshotMeta.to_json`` against the way it was encoded until it stopped
deep-copying (``dataclasses.asdict``), and their ratio (the writer encodes it
three times per snapshot). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import timeit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--snapshots", type=int, default=200)
    parser.add_argument("--out", default="/tmp/kvdbg-writer-cost")
    args = parser.parse_args()

    import torch

    from kvdbg.capture.capturer import Capturer, CaptureBackend, CaptureLayer, StepTensors
    from kvdbg.capture.build import check_metadata, snapshot_file_size
    from kvdbg.capture.engine_layouts import CPU_ATTN_K_TRANSPOSED, vllm_to_cpu_attn
    from kvdbg.snapshot.store import save_snapshot
    from tests.helpers import asdict_meta_json

    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    pages, heads, page_size, dim = 48, 2, 32, 64
    gen = torch.Generator().manual_seed(0)
    cache = vllm_to_cpu_attn(torch.randn(pages, heads, page_size, 2 * dim, generator=gen).half())
    layer = CaptureLayer(name="model.layers.1.self_attn.attn", num_heads=heads, num_kv_heads=heads, head_size=dim,
                         scale=dim ** -0.5, dtype="float16", kv_layout=CPU_ATTN_K_TRANSPOSED)
    backend = CaptureBackend(name="CPU_ATTN", max_model_len=512, max_decode_query_len=1, max_num_seqs=8,
                             max_num_batched_tokens=64)
    capturer = Capturer(args.out)  # no background writer: its steps are called here, one by one
    # The provenance the vLLM plugin adds (the same keys, values of about the same length).
    info = {
        "metadata_source": "CommonAttentionMetadata as passed to CPUAttentionMetadataBuilder.build (before "
                           "restriction)",
        "new_kv": "saved before do_kv_cache_update; the pages it overwrote are restored",
        "max_decode_query_len_source": "format default 1 (the builder has no query_len)",
        "kv_cache_spec_block_size": page_size, "impl": "CPUAttentionBackendImpl", "attention_backend": "CPU_ATTN",
        "kernel_variant": "vec", "kv_cache_layout": "LBHNC",
        "kv_cache_layout_source": "cache_config.get_resolved_kv_cache_layout() via CPUAttentionMetadataBuilder",
        "kv_cache_spec": {"type": "FullAttentionSpec", "block_size": page_size, "num_kv_heads": heads,
                          "head_size": dim, "dtype": "float16", "sliding_window": None},
        "kv_layout_description": "vLLM CPU_ATTN (vec, vec16): per (page, head), K transposed [D, page_size] then V "
                                 "[page_size, D]; converted to pages,heads,tokens,2*dim at capture",
        "tp_size": 1, "pp_size": 1, "dp_rank": 0, "engine_instance": 1796216322234845843,
    }
    phases: dict[str, list[int]] = {"build": [], "metadata check": [], "size": [], "write": []}
    meta = None
    for i in range(args.snapshots):
        tokens = 61 + i % 64
        tensors = StepTensors(
            query=torch.randn(1, heads, dim, generator=gen).half(), kv_cache=cache,
            block_table=torch.arange(16, dtype=torch.int32).view(1, 16),
            seq_lens=torch.tensor([tokens], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            causal=True, key=torch.randn(1, heads, dim, generator=gen).half(),
            value=torch.randn(1, heads, dim, generator=gen).half(),
            slot_mapping=torch.tensor([tokens - 1], dtype=torch.int64), metadata_copied=True)
        pending = capturer.begin(layer, backend, tensors, step=i, rank=0, info=info)
        pending.attach_output(torch.randn(1, heads, dim, generator=gen).half())
        start = time.perf_counter_ns()
        snapshot = capturer._build(pending, f"step {i}")
        built = time.perf_counter_ns()
        check_metadata(snapshot.meta)
        checked = time.perf_counter_ns()
        snapshot_file_size(snapshot)
        sized = time.perf_counter_ns()
        save_snapshot(snapshot, os.path.join(args.out, f"s{i:04d}.safetensors"))
        written = time.perf_counter_ns()
        pending.release()
        for name, ns in zip(phases, (built - start, checked - built, sized - checked, written - sized)):
            phases[name].append(ns)
        meta = snapshot.meta
    medians = {name: statistics.median(values) / 1e3 for name, values in phases.items()}
    total = sum(medians.values())
    assert meta is not None and meta.to_json() == asdict_meta_json(meta)
    n = 2000
    to_json_us = min(timeit.repeat(meta.to_json, number=n, repeat=5)) / n * 1e6
    asdict_us = min(timeit.repeat(lambda: asdict_meta_json(meta), number=n, repeat=5)) / n * 1e6
    size = os.path.getsize(os.path.join(args.out, "s0000.safetensors"))
    print(f"the writer's work per {size:,}-byte snapshot (median over {args.snapshots}, wall time, this thread):")
    for name, value in medians.items():
        print(f"  {name:<16}{value:>9.1f} us")
    print(f"  {'total':<16}{total:>9.1f} us")
    print(f"the metadata's JSON ({len(meta.to_json()):,} characters), encoded three times per snapshot:")
    print(f"  SnapshotMeta.to_json      {to_json_us:>8.1f} us")
    print(f"  dataclasses.asdict, then  {asdict_us:>8.1f} us   (the same bytes)")
    print(f"  ratio: asdict / to_json   {asdict_us / to_json_us:>8.2f}")
    print(json.dumps({"snapshot_bytes": size, "phases_us": medians, "total_us": total, "to_json_us": to_json_us,
                      "asdict_us": asdict_us, "asdict_to_json_ratio": asdict_us / to_json_us}))
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
