"""Run one vLLM engine (in this process) over named cases, capturing every attention step with kvdbg's plugin.

Usage (inside the engine venv): python -m tests.engine.engine_case --backend CPU_ATTN --model DIR --out DIR
--cases decode,prefill,... [--block-size 32] [--flex-shims]

Each case writes its snapshots into OUT/<case>/ (the plugin's capturer is pointed
there before the case's requests run) and OUT/cases.json records what ran.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import sys
import time


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    # Deterministic token ids away from the special ids 0-2.
    return [3 + (seed * 7919 + i * 104729) % (vocab - 3) for i in range(length)]


# case -> (prompts as (seed, length) or a shared-prefix pair, max_tokens); one generate() per entry in order
CASES = {
    # one request: its prefill step, then decode steps
    "prefill": [([(1, 40)], 1)],
    "decode": [([(2, 24), (3, 37)], 4)],
    # chunked prefill with a small token budget: later steps hold decodes and prefill chunks together
    "mixed": [([(4, 20), (5, 70), (6, 110)], 2)],
    # the second request shares a 96-token prefix (3 full blocks of 32) with the first: a prefix-cache hit
    "prefix_hit": [("first", 1), ("second", 2)],
    # sliding-window model: sequences outgrow window + block size (vLLM 0.32 leaves the freed blocks'
    # ids in the worker's table, stale, some reused further on)
    "sliding": [([(7, 100), (8, 75)], 3)],
    # sliding-window model with a prefix-cache hit: the cached blocks wholly before the window come
    # back as the null block (id 0) in the new request's table
    "sliding_prefix_hit": [("first", 1), ("second", 2)],
    # the disk fills up in the middle of the first snapshot (a file size limit on this process):
    # the engine serves on, one error line, capture turns off, no file under a final name
    "disk_full": [([(12, 30)], 3)],
    # the capture directory cannot be created (a regular file stands where its parent should be):
    # the engine serves on, one error line, capture turns off (so, like disk_full, last in its engine)
    "unwritable": [([(13, 30)], 3)],
}
# Both layers only where the case needs them (every replay costs seconds); layer 1 elsewhere.
BOTH_LAYERS = ("decode",)
DISK_FULL_BYTES = 8192  # smaller than any snapshot of these models
PREFIX = prompt(9, 96)


def case_prompts(case: str, entry) -> list[list[int]]:
    spec = entry[0]
    if spec == "first":  # also for sliding_prefix_hit
        return [PREFIX + prompt(10, 9)]
    if spec == "second":
        return [PREFIX + prompt(11, 13)]
    return [prompt(seed, length) for seed, length in spec]


@contextlib.contextmanager
def disk_full():
    """Files this process writes stop growing at DISK_FULL_BYTES (writes past it fail with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK_FULL_BYTES, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", required=True, choices=["CPU_ATTN", "FLEX_ATTENTION"])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--cases", required=True)
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=64)
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    os.environ["KVDBG_CAPTURE_DIR"] = os.path.join(args.out, "_before_cases")
    os.environ.pop("KVDBG_CAPTURE_BACKENDS", None)  # the default: the backend each layer is built on
    os.environ["KVDBG_CAPTURE_MAX"] = "unlimited"  # the writer's memory budget keeps its default
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine in this process: the capturer can be redirected

    if args.backend == "FLEX_ATTENTION":
        import vllm._custom_ops  # noqa: F401  (loads the CPU build's own ops first)

        from tests.engine import flex_shims

        flex_shims.install()

    from vllm import LLM, SamplingParams

    from kvdbg import vllm_plugin

    started = time.monotonic()
    llm = LLM(
        model=args.model, skip_tokenizer_init=True, enforce_eager=True, block_size=args.block_size,
        max_model_len=512, max_num_seqs=8, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=True, num_gpu_blocks_override=48, seed=0,
        gpu_memory_utilization=0.25,  # on CPU: the share of RAM vLLM requires free at start-up
    )
    startup_s = time.monotonic() - started
    capturer = vllm_plugin.active_capturer()
    if capturer is None:
        print("engine_case: the kvdbg plugin is not active in this process", file=sys.stderr)
        return 2

    record = {"backend": args.backend, "model": args.model, "startup_s": startup_s, "cases": {},
              "wrapped": list(vllm_plugin._state.wrapped)}
    for case in args.cases.split(","):
        case_dir = os.path.join(args.out, case)
        if case == "unwritable":
            blocker = os.path.join(args.out, "not_a_directory")
            with open(blocker, "w") as f:
                f.write("a regular file where the capture directory's parent should be\n")
            case_dir = os.path.join(blocker, "snapshots")
        capturer.reconfigure(directory=case_dir)
        capturer.select_layers(None if case in BOTH_LAYERS else "*.layers.1.*")
        before = len(capturer.written)
        failures_before = dict(capturer.failures)
        t0 = time.monotonic()
        outputs, cached = [], []
        with disk_full() if case == "disk_full" else contextlib.nullcontext():
            for entry in CASES[case]:
                prompts = case_prompts(case, entry)
                params = SamplingParams(max_tokens=entry[1], temperature=0.0, ignore_eos=True)
                results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                outputs.append([list(r.outputs[0].token_ids) for r in results])
                cached.append([getattr(r, "num_cached_tokens", None) for r in results])
            if not capturer.flush(60):
                print(f"engine_case: snapshots of {case} still unwritten after 60 s", file=sys.stderr)
                return 1
        record["cases"][case] = {
            "snapshots": len(capturer.written) - before,
            "run_s": time.monotonic() - t0,
            "prompt_lens": [[len(p) for p in case_prompts(case, e)] for e in CASES[case]],
            "generated": outputs,
            "num_cached_tokens": cached,
            "capture_active_after": capturer.active,
            "failures": {k: v - failures_before.get(k, 0) for k, v in capturer.failures.items()
                         if v != failures_before.get(k, 0)},
            "files": sorted(os.listdir(case_dir)) if os.path.isdir(case_dir) else [],
            "dropped": dict(capturer.dropped),
        }
    record["failures"] = dict(capturer.failures)
    with open(os.path.join(args.out, "cases.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps({k: v["snapshots"] for k, v in record["cases"].items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
