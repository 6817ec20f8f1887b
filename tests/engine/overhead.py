"""Engine decode-step time with kvdbg's capture off and on (one layer), measured in one run.

Usage (inside the engine venv): python -m tests.engine.overhead --model DIR [--tokens 48] [--repeats 3]

One CPU_ATTN engine in this process; per setting, the time of a generate() of
``tokens`` decode steps minus that of its prefill alone, divided by ``tokens``
(best of ``repeats``). Per decode step: wall time, CPU time of the engine's thread (what capture
costs the engine; robust to a neighbour's load) and of the whole process.
Settings: the plugin not wrapping anything (unregistered),
wrapped but no step selected, one layer captured with the background writer, one
layer captured with the write in the engine's thread. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    os.environ.update(KVDBG_CAPTURE_DIR=args.out, KVDBG_CAPTURE_BACKENDS="CPU_ATTN", KVDBG_CAPTURE_MAX="unlimited",
                      KVDBG_CAPTURE_LAYERS="*.layers.1.*", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import torch
    from vllm import LLM, SamplingParams

    from kvdbg import vllm_plugin
    from kvdbg.ranges import IntRanges

    llm = LLM(model=args.model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=512,
              num_gpu_blocks_override=48, seed=0, gpu_memory_utilization=0.25, enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": [3 + (i * 37) % 500 for i in range(60)]}]

    def run(max_tokens: int) -> tuple[float, float, float]:
        """Wall time, CPU time of this (the engine's) thread, CPU time of the process."""
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        llm.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t0, time.thread_time() - c0, time.process_time() - p0

    def per_step_ms() -> float:
        best = float("inf")
        for _ in range(args.repeats):
            best = min(best, (run(args.tokens + 1) - run(1)) / args.tokens * 1e3)
        return best

    run(4)  # warm up
    settings = ["unwrapped", "wrapped, nothing captured", "one layer, background writer",
                "one layer, write in the engine thread"]
    metrics = ("wall", "engine_thread_cpu", "process_cpu")
    best = {m: {name: float("inf") for name in settings} for m in metrics}
    written = dropped = 0
    bytes_total = 0
    # Settings alternate within each round, so a neighbour's load on a shared machine hits them alike.
    for _ in range(args.repeats):
        for name in settings:
            vllm_plugin.unregister()
            if name != "unwrapped":
                vllm_plugin.register()
                capturer = vllm_plugin.active_capturer()
                capturer.reconfigure(steps=IntRanges(()) if name == "wrapped, nothing captured" else None)
                if name == "one layer, write in the engine thread":
                    capturer.reconfigure(queue_size=0)
            long, short = run(args.tokens + 1), run(1)
            for m, a, b in zip(metrics, long, short):
                best[m][name] = min(best[m][name], (a - b) / args.tokens * 1e3)
            if name == "one layer, background writer":
                capturer.flush(60)
                written += len(capturer.written)
                bytes_total += capturer.bytes_written
                dropped += capturer.failures.get("dropped:queue_full", 0)
    results = best
    per_snapshot = bytes_total / max(written, 1)
    # The floor: copying a snapshot's worth of bytes once, in this process.
    buf = torch.empty(int(per_snapshot), dtype=torch.uint8)
    t0 = time.perf_counter()
    for _ in range(100):
        buf.clone()
    copy_ms = (time.perf_counter() - t0) / 100 * 1e3
    print(json.dumps({"decode_step_ms": results["wall"], "engine_thread_cpu_ms": results["engine_thread_cpu"],
                      "process_cpu_ms": results["process_cpu"], "snapshot_bytes": int(per_snapshot),
                      "snapshots_written_background": written, "dropped_background": dropped,
                      "copy_snapshot_bytes_ms": copy_ms, "tokens": args.tokens, "repeats": args.repeats}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
