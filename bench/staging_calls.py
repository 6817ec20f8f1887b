"""What each runtime call of a wanted CUDA-graph step costs the engine's thread, one call at a time (CUDA only).

Usage (a GPU machine with kvdbg installed; no vLLM needed):
    python bench/staging_calls.py [--layers 8] [--batch 64] [--pages-per-request 10] [--iters 300]

``bench/graph_cost.py`` times the plugin's hooks inside a whole engine; this bench takes apart the two parts that
dominate a wanted step there (the build's copies of its metadata to the host, and the staging program run
after the graph's replay) on tensors shaped as that engine's (8 layers of 8 KV heads of 128, bfloat16, pages of
16 tokens, a decode batch of 64), and times each runtime call they make, and the whole of each part, on the
host (``perf_counter_ns``, median and 90th percentile of ``--iters`` calls; the device is synchronized between
calls, so no call waits for a full queue). Prints one line per call and ``STAGING-CALLS {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _timed(fn, iters: int, sync) -> dict:
    for _ in range(10):
        fn()
    sync()
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
        sync()
    samples.sort()
    return {"median_us": statistics.median(samples) / 1e3, "p90_us": samples[int(0.9 * (len(samples) - 1))] / 1e3}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--pages-per-request", type=int, default=10)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--iters", type=int, default=300)
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    from kvdbg.capture.buffers import HostCopiesReady, copies_to_host, current_stream
    from kvdbg.vllm_plugin.graph_staging import GraphStager, StageHint

    if not torch.cuda.is_available():
        print("staging_calls: needs a CUDA device")
        return 2
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    n, width, page = args.batch, 128, 16
    rng = np.random.default_rng(0)
    table = torch.from_numpy(rng.integers(1, args.num_blocks, (n, width), dtype=np.int32)).to(dev)
    seq_lens = torch.full((n,), args.pages_per_request * page - 3, dtype=torch.int32, device=dev)
    qsl = torch.arange(n + 1, dtype=torch.int32, device=dev)
    slots = torch.arange(n, dtype=torch.int64, device=dev)
    # vLLM's TRITON_ATTN cache of one layer: (blocks, 2, page, kv heads, head size).
    caches = [torch.zeros(args.num_blocks, 2, page, 8, 128, dtype=torch.bfloat16, device=dev)
              for _ in range(args.layers)]
    queries = [torch.zeros(n, 32, 128, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    outputs = [torch.zeros(n, 32 * 128, dtype=torch.bfloat16, device=dev) for _ in range(args.layers)]
    layers = [(f"model.layers.{i}.self_attn.attn", caches[i], 0, queries[i], outputs[i]) for i in range(args.layers)]
    bound = np.full(n, args.pages_per_request * page, dtype=np.int64)
    # With the runner's lengths and offsets: the program also stages the step's metadata (no build copies).
    hint = StageHint(table, n, bound, int(bound.max()), seq_lens, qsl, n)
    stager = GraphStager()
    program = stager.stage(layers, hint, page, n).program  # made, and recorded as a graph of its own
    flat = np.arange(n * args.pages_per_request, dtype=np.int64)
    pinned = torch.empty(program.size, dtype=torch.int64, pin_memory=True)
    rows = [table, seq_lens, qsl, slots, None]

    def fill() -> None:
        values = pinned.numpy()
        values[: flat.size] = flat
        values[flat.size:] = 0

    def event() -> None:
        torch.cuda.Event().record(current_stream(dev))

    def copies() -> None:
        copies_to_host(rows)
        HostCopiesReady(dev)

    calls = {
        "python call, nothing": lambda: None,
        "torch.cuda.current_stream": lambda: torch.cuda.current_stream(dev),
        "kvdbg's kept current stream": lambda: current_stream(dev),
        "pinned torch.empty (the index)": lambda: torch.empty(program.size, dtype=torch.int64, pin_memory=True),
        "numpy fill of the index": fill,
        "index copy to the device": lambda: program.index.copy_(program.host_index, non_blocking=True),
        "staging graph replay": program.graph.replay,
        "event made and recorded": event,
        "the program's own event recorded": lambda: program.ready.record(current_stream(dev)),
        "stager.stage, whole": lambda: stager.stage(layers, hint, page, n),
        "one small copy to the host": lambda: seq_lens.to("cpu", non_blocking=True),
        "copies_to_host (4) + event, whole": copies,
    }
    results = {}
    for name, fn in calls.items():
        results[name] = _timed(fn, args.iters, sync)
        print(f"{name:34s} median {results[name]['median_us']:8.1f} us   p90 {results[name]['p90_us']:8.1f} us",
              flush=True)
    summary = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "layers": args.layers,
               "batch": n, "pages": int(flat.size), "program_pages": program.size, "calls": results}
    print("STAGING-CALLS " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
