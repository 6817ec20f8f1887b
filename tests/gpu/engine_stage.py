"""A whole vLLM 0.33 engine on a CUDA GPU with kvdbg's plugin capturing: serve, then replay every snapshot.

Run by tests/gpu/run_engine_stage.sh on the GPU machine (vLLM's Python files and small wheels carried, no vLLM
install, no network). An in-process ``LLM`` (vLLM's V1 engine core in this process) serves a tiny random Llama
(tests/engine/tiny_model.py: GQA, and a sliding-window model) on TRITON_ATTN, in eager mode and in each CUDA-graph
mode asked for, through the cases of the CPU engine stage: prefill, chunked prefill mixed with decodes, decode,
a prefix-cache hit and a window past its pages. Every snapshot is then replayed by kvdbg on the GPU and judged as
the CPU stage judges: the captured output against the reference, the vllm column (vLLM's own TRITON_ATTN code,
run by kvdbg) against the captured output, and no error finding on a correct engine.

What the harness stands in for (vLLM's compiled extension is not carried; nothing of kvdbg's is):
- the compiled modules, as empty modules (tests/gpu/stub_site): the attention path calls none of them;
- ``torch.ops._C.silu_and_mul``, read by ``SiluAndMul.__init__`` even with ``custom_ops=["none"]`` (the forward
  then runs vLLM's own native torch path): plain torch, ``silu(x[..., :d]) * x[..., d:]``;
- ``torch.ops._C_cache_ops.reshape_and_cache_flash`` (FLASHINFER's cache write; TRITON_ATTN writes with its
  own Triton kernel): plain torch;
- ``torch.ops._C.weak_ref_tensor`` (vLLM's CUDA-graph wrapper on a graph's outputs): a view, which keeps the
  outputs alive where vLLM's would not.
And it sets ``kernel_config.ir_op_priority`` to vLLM's native implementations, ``VLLM_USE_V2_MODEL_RUNNER=0`` (the V2 runner needs a compiled CUDA view of pinned host memory),
``VLLM_USE_FLASHINFER_SAMPLER=0`` (FlashInfer is not carried for this stage) and
``compilation_config.custom_ops=["none"]`` (vLLM's own torch-native RMSNorm, rotary embedding and activation).

Usage: python tests/gpu/engine_stage.py OUT [--modes eager,FULL_DECODE_ONLY] [--models plain,sliding]
Prints one JSON line per engine run and a summary; exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.engine.tiny_model import TinyModel, write_model  # noqa: E402

MODELS = {
    "plain": TinyModel("plain", dtype="float16", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2),
    "sliding": TinyModel("sliding", dtype="float16", sliding_window=32, seed=1),
    "softcap": TinyModel("softcap", dtype="bfloat16", seed=2),
}
BLOCK_SIZE = 16
# vLLM's IR ops (RMSNorm, its fused-add form) dispatch to its compiled kernels first: its own native torch
# implementations instead (the same priority vLLM gives them when inductor compiles the model).
NATIVE_IR_OPS = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]}


def prompt(seed: int, length: int, vocab: int = 512) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


# case -> list of (prompt lengths, tokens to generate); the same seeds make a prefix-cache hit.
CASES = {
    "prefill_decode": [([40, 75, 9], 6)],
    "chunked_mixed": [([300, 12, 20], 8)],  # 300 tokens > max_num_batched_tokens: chunks beside decodes
    "prefix_hit": [([64], 2), ([64], 4)],  # the second request finds the first's 64 tokens cached
    "long_window": [([200], 10)],  # the sliding model: a window (32) far past the first pages
}


def engine_run(model_dir: str, model: str, mode: str, out: str) -> dict:
    from vllm import LLM, SamplingParams

    from kvdbg import vllm_plugin

    record = {"model": model, "mode": mode, "cases": {}, "problems": []}
    compilation = {"custom_ops": ["none"], "mode": 0}
    kwargs = {}
    if mode == "eager":
        kwargs["enforce_eager"] = True
    else:
        compilation["cudagraph_mode"] = mode
        compilation["cudagraph_capture_sizes"] = [1, 2, 4, 8]
    started = time.monotonic()
    llm = LLM(model=model_dir, skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=64, enable_prefix_caching=True, num_gpu_blocks_override=128, seed=0,
              gpu_memory_utilization=0.2, attention_backend="TRITON_ATTN", compilation_config=compilation,
              kernel_config={"ir_op_priority": NATIVE_IR_OPS}, **kwargs)
    record["startup_s"] = round(time.monotonic() - started, 1)
    capturer = vllm_plugin.active_capturer()
    if capturer is None and not os.environ.get("KVDBG_CAPTURE_DIR"):  # the engine alone, for comparison
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        results = llm.generate([{"prompt_token_ids": prompt(0, 40)}], params, use_tqdm=False)
        record["cases"] = {}
        record["generated_without_kvdbg"] = [list(r.outputs[0].token_ids) for r in results]
        return record
    if capturer is None:
        record["problems"].append("the kvdbg plugin is not active in the engine's process")
        return record
    cases = [c for c in CASES if (c == "long_window") == (model == "sliding") or c == "prefill_decode"]
    for case in cases:
        case_dir = os.path.join(out, f"{model}-{mode}", case)
        capturer.reconfigure(directory=case_dir)
        before = len(capturer.written)
        outputs = []
        for seed, (lengths, new_tokens) in enumerate(CASES[case]):
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
            seeds = [0] * len(lengths) if case == "prefix_hit" else range(100 * seed, 100 * seed + len(lengths))
            prompts = [{"prompt_token_ids": prompt(s, n)} for s, n in zip(seeds, lengths)]
            results = llm.generate(prompts, params, use_tqdm=False)
            outputs.append([list(r.outputs[0].token_ids) for r in results])
        if not capturer.flush(120):
            record["problems"].append(f"{case}: snapshots still unwritten after 120 s")
        record["cases"][case] = {"snapshots": len(capturer.written) - before, "generated": outputs,
                                 "dir": case_dir}
    record["dropped"] = dict(capturer.dropped)
    record["failures"] = dict(capturer.failures)
    return record


def from_graph(path: str) -> bool:
    """Whether the snapshot was captured from a step replayed as a full CUDA graph (its notes say so)."""
    from kvdbg import api

    return "full CUDA graph" in api.load(path).meta.notes


def judge(path: str, device: str = "cuda") -> list[str]:
    """The CPU stage's judgement of one snapshot, on the GPU: captured vs reference, vllm vs captured, no error."""
    from kvdbg import api

    report = api.replay(path, ["reference", "vllm"], device=device)
    data = report.to_json()
    problems = []
    status = next((b for b in data.get("backends", []) if b.get("name") == "vllm"), {})
    if not status.get("available"):
        problems.append(f"vllm column unavailable: {status.get('reason')}")
    comparisons = {(c["actual"], c["expected"]): c for c in data.get("comparisons", [])}
    for pair in (("captured", "reference"), ("vllm", "captured")):
        comp = comparisons.get(pair)
        if comp is None:
            if pair[0] == "vllm" and not status.get("available"):
                continue
            problems.append(f"no {pair[0]} vs {pair[1]} comparison")
            continue
        failed = [h for h in comp.get("heads", []) if not h.get("passed")]
        if not comp.get("heads") or failed:
            worst = max((h.get("max_abs") or 0.0 for h in failed), default=0.0)
            problems.append(f"{pair[0]} vs {pair[1]}: {len(failed)}/{len(comp.get('heads', []))} heads fail "
                            f"(max {worst:.3g})")
    for finding in data.get("findings", []):
        if finding.get("severity") == "error":
            problems.append(f"error finding {finding.get('backend')}:{finding.get('code')}")
    return problems


def one_run(out: str, model: str, mode: str, capture: bool = True) -> int:
    """One engine (a process of its own: vLLM's engine core and its distributed state are per process)."""
    if capture:
        os.environ["KVDBG_CAPTURE_DIR"] = os.path.join(out, "_start")
        os.environ["KVDBG_CAPTURE_MAX"] = "unlimited"
    else:
        os.environ.pop("KVDBG_CAPTURE_DIR", None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: redirectable
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    model_dir = write_model(MODELS[model], os.path.join(out, "models", model))
    try:
        record = engine_run(model_dir, model, mode, out)
    except Exception as exc:  # say where the engine stopped
        tail = traceback.format_exc().strip().splitlines()[-40:]
        record = {"model": model, "mode": mode, "problems": [f"engine stopped: {exc!r}"[:400]], "trace": tail}
    print("ENGINE-RECORD " + json.dumps(record), flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--modes", default="eager,FULL_DECODE_ONLY")
    parser.add_argument("--models", default="plain,sliding")
    parser.add_argument("--one", help="MODEL:MODE, run in a child process")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one engine run")
    parser.add_argument("--without-kvdbg", action="store_true", help="the engines alone (plugin not switched on)")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        return one_run(args.out, *args.one.split(":"), capture=not args.without_kvdbg)
    import subprocess

    summary = {"runs": [], "snapshots": 0, "passed": 0, "from_graphs": {}, "problems": []}
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            started = time.monotonic()
            try:
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), args.out, "--one", f"{model}:{mode}"]
                                     + (["--without-kvdbg"] if args.without_kvdbg else []),
                                      capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ENGINE-RECORD ")]
                record = json.loads(lines[-1][len("ENGINE-RECORD "):]) if lines else {
                    "model": model, "mode": mode, "problems": [f"engine process exit {proc.returncode}"],
                    "trace": proc.stderr.strip().splitlines()[-40:]}
                record["kvdbg_log"] = [ln for ln in proc.stderr.splitlines() if "kvdbg" in ln][-12:]
            except subprocess.TimeoutExpired:
                record = {"model": model, "mode": mode, "problems": [f"engine run over {args.timeout:.0f} s"]}
            record["wall_s"] = round(time.monotonic() - started, 1)
            print(json.dumps(record), flush=True)
            summary["runs"].append({k: record.get(k) for k in ("model", "mode", "startup_s", "wall_s")})
            summary["problems"] += [f"{model}/{mode}: {p}" for p in record["problems"]]
            for case, info in record.get("cases", {}).items():
                files = sorted(f for f in os.listdir(info["dir"]) if f.endswith(".safetensors")) \
                    if os.path.isdir(info["dir"]) else []
                run = f"{model}/{mode}"
                for name in files:
                    summary["snapshots"] += 1
                    if from_graph(os.path.join(info["dir"], name)):
                        summary["from_graphs"][run] = summary["from_graphs"].get(run, 0) + 1
                    problems = judge(os.path.join(info["dir"], name))
                    if problems:
                        summary["problems"] += [f"{model}/{mode}/{case}/{name}: {p}" for p in problems]
                    else:
                        summary["passed"] += 1
    # Under full CUDA graphs, decode steps are replayed from graphs: some of each such run's snapshots must be.
    for run in summary["runs"]:
        name = f"{run['model']}/{run['mode']}"
        if run["mode"] in ("FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE") and not args.without_kvdbg \
                and not summary["from_graphs"].get(name):
            summary["problems"].append(f"{name}: no snapshot was captured from a step replayed as a CUDA graph")
    print(json.dumps(summary, indent=1))
    return 0 if (summary["snapshots"] or args.without_kvdbg) and not summary["problems"] else 1


if __name__ == "__main__":
    sys.exit(main())
