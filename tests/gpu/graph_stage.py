"""Proof on a GPU that kvdbg's capture and sentinel work inside vLLM 0.33's own full CUDA graphs.

Run by tests/gpu/run_graph_stage.sh on the GPU machine (the carry, stand-ins and switches of
tests/gpu/engine_stage.py, whose models, prompts and judge this reuses). Whole in-process vLLM 0.33 engines run
TRITON_ATTN's layers, metadata builder and cache update as vLLM's FULL CUDA-graph mode runs them: vLLM's
CUDAGraphWrapper records one full graph per padded batch size (``cudagraph_capture_sizes`` 1, 2, 4, 8, 16) at
start-up and replays it for every batch of up to 16 tokens, decode and mixed alike. The workloads
(tests/gpu/graph_plan.py) add requests at chosen engine steps so that the batches are decode and mixed batches of
3, 5, 6 and 7 requests padded to 4, 8 and 16. Parts (``--parts``):

plain, sliding, fp8
    The comparison workload served by an eager engine and by a FULL-graph engine (fp8: the plain model with
    ``kv_cache_dtype="fp8"``), kvdbg capturing the wanted steps through ``KVDBG_CAPTURE_STEPS``. Checked: the two
    engines generate the same tokens from the same batches; exactly the wanted (layer, step) snapshots are on
    disk; every wanted step of the graph engine was replayed from a full graph and its snapshot equals the eager
    one of the same batch (block table, lengths, query offsets and page ids byte for byte; query, output and the
    pages the batch reads within a few units in the last place); every graph snapshot replays PASS against the
    reference (captured vs reference) and a sample passes engine_stage.judge (with the vllm column); during a
    graph replay neither TritonAttentionImpl.forward nor any per-layer hook of kvdbg runs (counted by a wrapper
    installed before kvdbg's), while kvdbg's graph hook runs once per step.
fault
    A FULL engine whose 8-token graph is recorded with a private seq_lens buffer (a test-only wrapper of
    TritonAttentionMetadataBuilder.build_for_cudagraph_capture, installed before kvdbg's): the buffer is filled
    once, while vLLM records that graph, and never refreshed, so every replay of the 8-token graph reads the
    lengths of the recording; eager steps and the other graphs read vLLM's refreshed buffers. With
    ``KVDBG_SENTINEL=1`` the sentinel must name layer, step and request of the wrong steps (all of them replays
    of that graph), its snapshots must replay FAIL (``kvdbg replay`` exit 1) naming requests whose length was
    stale, and the steps of the other graphs must stay clean (their captured snapshots replay PASS). kvdbg's
    recorded lengths come from the CommonAttentionMetadata vLLM hands the builder (the runner's buffers, refreshed
    every step), not from the buffer the graph's kernel reads: the stage checks them against the scheduler's own
    counts.
--try-piecewise [MODES]
    Engines under PIECEWISE / FULL_AND_PIECEWISE, which need torch.compile (compilation mode 3): whether one starts
    and serves with kvdbg capturing, and if it does, whether its snapshots replay PASS. Reported either way; only
    a snapshot that does not replay PASS fails the stage.

Engines run in child processes (vLLM's engine core and distributed state are per process), ``--jobs`` at a time
(their KV cache is sized by ``kv_cache_memory_bytes``, so vLLM's memory profiling, which other processes on the
GPU could upset, does not run); each part's checks run in a child process of their own as soon as its engines are
done. ``--cpu``: a dry run of the harness on a CPU build of vLLM (two eager engines, no graphs; the graph checks
are skipped).

Usage: python tests/gpu/graph_stage.py OUT [--parts plain,sliding,fp8,fault] [--try-piecewise [MODES]]
       [--jobs N] [--budget SECONDS] [--judge-max N] [--cpu]
Prints one JSON line per engine run and per check, then one JSON summary; exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu import graph_plan  # noqa: E402
from tests.gpu.engine_stage import BLOCK_SIZE, MODELS, NATIVE_IR_OPS, judge, prompt  # noqa: E402

PARTS = ("plain", "sliding", "fp8", "fault")
PIECEWISE_MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")
GRAPH_MODE = "FULL"
FALLBACK_MODE = "FULL_DECODE_ONLY"  # only if vLLM refuses FULL (said in the summary)
# Capture selects no step while the engine starts: the wanted steps are set once its start-up steps are counted.
NOTHING_YET = "1000000000-"
MIN_GRAPH_STEPS = 20  # wanted steps that must have been replayed from full graphs, per graph engine
ULPS_WARN = 8  # a float tensor further from the eager one than this (units in the last place) is said
ULPS_FAIL = 64  # and fails the stage past this
KV_CACHE_BYTES = 256 * 1024**2
CPU_BLOCK_SIZE = 32  # CPU_ATTN's pages (the --cpu dry run)
LOG_PATTERN = re.compile(r"kvdbg sentinel: layer (\S+) step (\d+) is wrong \((.*?)\): first failing request (\d+) "
                         r"head (\d+); (.*)$")


# --------------------------------------------------------------------------- the runs


@dataclasses.dataclass(frozen=True)
class RunSpec:
    name: str
    model: str
    mode: str  # "eager" or a CUDAGraphMode name
    plan: str = "compare"
    kv_cache_dtype: str = "auto"
    fault: bool = False
    compile: bool = False  # torch.compile (compilation mode 3): piecewise graphs


def all_specs(cpu: bool = False) -> dict[str, RunSpec]:
    if cpu:  # the dry run: the "graph" engines run eagerly too, and the fault is emulated (Probes)
        specs = [RunSpec("plain-eager", "plain", "eager"), RunSpec("plain-graph", "plain", "eager"),
                 RunSpec("fault-graph", "plain", "eager", plan="fault", fault=True)]
    else:
        specs = [RunSpec("plain-eager", "plain", "eager"), RunSpec("plain-graph", "plain", GRAPH_MODE),
                 RunSpec("sliding-eager", "sliding", "eager"), RunSpec("sliding-graph", "sliding", GRAPH_MODE),
                 RunSpec("fp8-eager", "plain", "eager", kv_cache_dtype="fp8"),
                 RunSpec("fp8-graph", "plain", GRAPH_MODE, kv_cache_dtype="fp8"),
                 RunSpec("fault-graph", "plain", GRAPH_MODE, plan="fault", fault=True)]
        specs += [RunSpec(f"piecewise-{m}", "plain", m, compile=True) for m in PIECEWISE_MODES]
    return {s.name: s for s in specs}


def layer_names(model: str) -> list[str]:
    """The attention layers of a tiny Llama of tests/engine/tiny_model.py, as vLLM names them."""
    return [f"model.layers.{i}.self_attn.attn" for i in range(MODELS[model].num_layers)]


def engine_kwargs(spec: RunSpec, model_dir: str, cpu: bool) -> dict:
    """LLM(...) arguments: engine_stage's, with a 16-token budget (every batch fits a graph), no prefix cache (the
    batches and blocks do not depend on the tokens), synchronous scheduling (steps happen as the plan says)."""
    compilation = {"custom_ops": ["none"], "mode": 3 if spec.compile else 0}
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, max_model_len=128,
                  max_num_seqs=graph_plan.MAX_NUM_SEQS, max_num_batched_tokens=graph_plan.MAX_NUM_BATCHED_TOKENS,
                  enable_prefix_caching=False, num_gpu_blocks_override=128, seed=0, async_scheduling=False)
    if cpu:
        kwargs.update(block_size=CPU_BLOCK_SIZE, gpu_memory_utilization=0.25)
    else:
        kwargs.update(block_size=BLOCK_SIZE, gpu_memory_utilization=0.1, kv_cache_memory_bytes=KV_CACHE_BYTES,
                      attention_backend="TRITON_ATTN", kernel_config={"ir_op_priority": NATIVE_IR_OPS})
    if spec.mode == "eager":
        kwargs["enforce_eager"] = True
    else:
        compilation["cudagraph_mode"] = spec.mode
        compilation["cudagraph_capture_sizes"] = list(graph_plan.CAPTURE_SIZES)
    kwargs["compilation_config"] = compilation
    if spec.kv_cache_dtype != "auto":
        kwargs["kv_cache_dtype"] = spec.kv_cache_dtype
    return kwargs


# --------------------------------------------------------------------------- in the engine's process


class Probes:
    """Test-only wrappers, installed before vLLM builds anything, so before kvdbg's plugin wraps the same classes
    (kvdbg's wrappers then call these): what ran in each served step.

    - the attention impl's forward: its calls per step (none may run while a full graph replays);
    - vLLM's CUDAGraphWrapper.__call__: which graph a step recorded or replayed;
    - the model runner's execute_model: the step's requests in batch order, their tokens and lengths as the
      scheduler counts them (an account of the batch independent of kvdbg's);
    - with ``fault``, TritonAttentionMetadataBuilder.build_for_cudagraph_capture: the 8-token graph is recorded
      with a private seq_lens buffer, filled then and never again.
    After the engine has started, kvdbg's own per-layer hooks and its graph hook are counted too.
    """

    def __init__(self, plan, layers, fault_size: int | None = None, emulate_fault: bool = False):
        self.emulate_fault = emulate_fault and fault_size is not None
        self.prompt_lens = {a.name: a.prompt_len for a in plan}
        self.layers = layers
        self.fault_size = fault_size
        self.serving = False
        self.current: dict | None = None
        self.replaying = False
        self.steps: list[dict] = []
        self.recorded: Counter = Counter()  # graphs recorded at start-up: "kind num_tokens"
        self.fault: list[dict] = []
        self.kept: list = []  # the fault's private buffers (alive as long as the engine)
        self.state = None  # kvdbg's plugin state, once the engine has started
        self.outside = Counter()  # forward calls with metadata outside served steps (start-up)

    def install(self, impl_cls) -> None:
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        probes = self
        forward_original = impl_cls.forward

        @functools.wraps(forward_original)
        def forward(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs):
            current = probes.current
            if attn_metadata is not None:
                if current is None:
                    probes.outside["forward"] += 1
                else:
                    current["forward_calls"] += 1
                    current["forward_in_replay"] += probes.replaying
            result = forward_original(impl, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)
            if probes.emulate_fault and current is not None and attn_metadata is not None:
                tokens = int(attn_metadata.num_actual_tokens)
                if graph_plan.padded(tokens) == probes.fault_size:  # the dry run's stand-in for the stale graph
                    result[:tokens] += 1.0
            return result

        impl_cls.forward = forward

        graph_original = CUDAGraphWrapper.__call__

        @functools.wraps(graph_original)
        def __call__(wrapper, *args, **kwargs):
            kind, batch = graph_kind(wrapper)
            if kind is None:
                return graph_original(wrapper, *args, **kwargs)
            info = {"kind": kind, "num_tokens": batch.num_tokens, "num_reqs": batch.num_reqs,
                    "uniform": bool(batch.uniform), "mode": wrapper.runtime_mode.name}
            current = probes.current
            if current is None:
                probes.recorded[f"{kind} {info['mode']} {batch.num_tokens}"] += 1
                return graph_original(wrapper, *args, **kwargs)
            current["graphs"].append(info)
            probes.replaying = kind == "replay"
            try:
                return graph_original(wrapper, *args, **kwargs)
            finally:
                probes.replaying = False

        CUDAGraphWrapper.__call__ = __call__

        execute_original = GPUModelRunner.execute_model

        @functools.wraps(execute_original)
        def execute_model(runner, scheduler_output, *args, **kwargs):
            if not probes.serving:
                return execute_original(runner, scheduler_output, *args, **kwargs)
            counts = getattr(probes.state, "_forward_counts", {})
            current = probes.current = {
                "index": len(probes.steps), "kvdbg_step": counts.get(probes.layers[0], 0), "rows": [],
                "graphs": [], "forward_calls": 0, "forward_in_replay": 0, "layer_hooks": 0, "graph_hooks": 0}
            computed = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
            cached = scheduler_output.scheduled_cached_reqs
            computed.update(zip(cached.req_ids, cached.num_computed_tokens))
            try:
                return execute_original(runner, scheduler_output, *args, **kwargs)
            finally:
                batch = runner.input_batch
                for req_id in list(batch.req_ids[: batch.num_reqs]):
                    tokens = int(scheduler_output.num_scheduled_tokens.get(req_id, 0))
                    name = request_name(req_id)
                    before = computed.get(req_id)
                    current["rows"].append([name, tokens, None if before is None else before + tokens,
                                            None if before is None else before >= probes.prompt_lens.get(name, 0)])
                if current["rows"] and any(r[1] for r in current["rows"]):
                    probes.steps.append(current)
                probes.current = None

        GPUModelRunner.execute_model = execute_model

        if self.emulate_fault:
            self.fault.append({"num_tokens": self.fault_size, "stale_seq_lens": [1] * self.fault_size,
                               "emulated": "no graphs here: the output of every step of 5-8 tokens is shifted"})
        elif self.fault_size is not None:
            self._install_fault()

    def _install_fault(self) -> None:
        from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder

        probes, size = self, self.fault_size
        original = TritonAttentionMetadataBuilder.build_for_cudagraph_capture

        @functools.wraps(original)
        def build_for_cudagraph_capture(builder, common_attn_metadata):
            metadata = original(builder, common_attn_metadata)
            if int(common_attn_metadata.num_actual_tokens) == size:
                # Outside the graph (vLLM builds before it records): a copy made once, now, of what vLLM set for
                # the recording. The graph's kernel reads this buffer at every replay; nothing updates it.
                private = metadata.seq_lens.clone()
                probes.kept.append(private)
                metadata.seq_lens = private
                probes.fault.append({"num_tokens": size, "num_reqs": int(common_attn_metadata.num_reqs),
                                     "stale_seq_lens": private.tolist()})
            return metadata

        TritonAttentionMetadataBuilder.build_for_cudagraph_capture = build_for_cudagraph_capture

    def count_kvdbg_hooks(self, state) -> None:
        """Count kvdbg's per-layer hooks and its graph hook per served step (instance attributes over its methods:
        its wrappers call them through the state)."""
        self.state = state
        probes = self

        def counting(name: str, key: str):
            original = getattr(state, name)

            def hook(*args, **kwargs):
                if probes.current is not None:
                    probes.current[key] += 1
                return original(*args, **kwargs)

            setattr(state, name, hook)

        counting("before_forward", "layer_hooks")
        counting("before_cache_update", "layer_hooks")
        counting("after_graph_replay", "graph_hooks")


def request_name(req_id: str) -> str:
    """The plan's name of a request (vLLM 0.33 appends ``-<8 random characters>`` to the id it was given)."""
    return req_id.rsplit("-", 1)[0] if "-" in req_id else req_id


def graph_kind(wrapper) -> tuple[str | None, object]:
    """What this call of vLLM's CUDAGraphWrapper does: ``record`` a graph, ``replay`` a full one, ``pieces`` (a
    piecewise graph replayed: attention runs in Python between its pieces); None: no graph."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None, None
    context = get_forward_context()
    mode, batch = context.cudagraph_runtime_mode, context.batch_descriptor
    if mode is None or batch is None or mode != wrapper.runtime_mode or mode.name == "NONE":
        return None, None
    entry = wrapper.concrete_cudagraph_entries.get(batch)
    if entry is None or entry.cudagraph is None:
        return "record", batch
    return ("replay" if mode.name == "FULL" else "pieces"), batch


class _Lines(logging.Handler):
    """kvdbg's log lines of this process, kept for the record (the sentinel's all, the others the last ones)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.sentinel: list[str] = []

    def emit(self, record):
        message = record.getMessage()[:600]
        self.lines.append(message)
        if message.startswith("kvdbg sentinel") and len(self.sentinel) < 100:
            self.sentinel.append(message)


def serve(llm, plan, probes: Probes) -> dict[str, list[int]]:
    """The plan's requests, each added before its engine step; greedy, ignore_eos. Tokens per request name."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    pending = sorted(plan, key=lambda a: a.at)
    outputs: dict[str, list[int]] = {}
    loop = 0
    probes.serving = True
    try:
        while pending or engine.has_unfinished_requests():
            while pending and pending[0].at <= loop:
                a = pending.pop(0)
                params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
                engine.add_request(a.name, {"prompt_token_ids": prompt(a.seed, a.prompt_len)}, params)
            for out in engine.step():
                if out.finished:
                    outputs[request_name(out.request_id)] = list(out.outputs[0].token_ids)
            loop += 1
            if loop > 500:
                raise RuntimeError("the plan's requests did not finish in 500 engine steps")
    finally:
        probes.serving = False
    return outputs


def engine_child(out: str, spec: RunSpec, cpu: bool) -> dict:
    """One engine: start, count its start-up steps, ask capture for the wanted steps, serve the plan, drain."""
    run_dir = os.path.join(out, spec.name)
    snap_dir = os.path.join(run_dir, "snapshots")
    record: dict = {"name": spec.name, "model": spec.model, "mode": spec.mode, "kv_cache_dtype": spec.kv_cache_dtype,
                    "plan": spec.plan, "problems": [], "stage": "start", "served": False}
    os.environ.update({"KVDBG_CAPTURE_DIR": os.path.join(run_dir, "_start"), "KVDBG_CAPTURE_STEPS": NOTHING_YET,
                       "KVDBG_CAPTURE_MAX": "unlimited"})
    os.environ.pop("KVDBG_CAPTURE_LAYERS", None)
    if spec.fault:
        os.environ.update({"KVDBG_SENTINEL": "1", "KVDBG_SENTINEL_DIR": os.path.join(run_dir, "sentinel"),
                           "KVDBG_SENTINEL_INTERVAL": "0", "KVDBG_SENTINEL_MAX": "unlimited",
                           "KVDBG_SENTINEL_SEED": "0"})
    else:
        os.environ.pop("KVDBG_SENTINEL", None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    lines = _Lines()
    logging.getLogger("kvdbg").addHandler(lines)
    plan, _ = graph_plan.PLANS[spec.plan]
    wanted = graph_plan.wanted_steps(spec.plan)
    layers = layer_names(spec.model)
    record.update(layers=layers, wanted_rel=wanted)
    probes = Probes(plan, layers, graph_plan.FAULT_GRAPH_SIZE if spec.fault else None, emulate_fault=cpu)
    try:
        import importlib

        impl_path = ("vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl") if cpu else \
            ("vllm.v1.attention.backends.triton_attn", "TritonAttentionImpl")
        impl_cls = getattr(importlib.import_module(impl_path[0]), impl_path[1])
        probes.install(impl_cls)
        from vllm import LLM

        from kvdbg import vllm_plugin
        from kvdbg.capture.config import ENV_DIR, ENV_STEPS, CaptureConfig

        model_dir = os.path.join(out, "models", spec.model)
        started = time.monotonic()
        llm = LLM(**engine_kwargs(spec, model_dir, cpu))
        record["startup_s"] = round(time.monotonic() - started, 1)
        compilation = llm.llm_engine.vllm_config.compilation_config
        record["cudagraph_mode"] = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
        record["capture_sizes"] = list(compilation.cudagraph_capture_sizes or [])
        record["recorded_graphs"] = dict(probes.recorded)
        record["fault"] = probes.fault
        state = vllm_plugin._state
        if state is None or vllm_plugin.active_capturer() is None:
            raise RuntimeError("the kvdbg plugin is not active in the engine's process")
        record["stage"] = "configure"
        base = {name: state._forward_counts.get(name, 0) for name in layers}
        record["startup_steps"] = base
        if len(set(base.values())) != 1:
            raise RuntimeError(f"the layers counted different start-up steps: {base}")
        record["base"] = base[layers[0]]
        text = graph_plan.ranges_text(wanted, record["base"])
        # Parsed as the variable is (the grammar and its checks): the wanted steps, counted after start-up.
        config = CaptureConfig.from_env({ENV_DIR: snap_dir, ENV_STEPS: text})
        state.capturer.reconfigure(directory=snap_dir, steps=config.steps)
        record["capture_steps"] = text
        probes.count_kvdbg_hooks(state)
        record["stage"] = "serve"
        record["outputs"] = serve(llm, plan, probes)
        record["served"] = True
        record["stage"] = "drain"
        if not state.capturer.flush(120):
            record["problems"].append("snapshots still unwritten after 120 s")
        capturer = state.capturer
        record["written"] = len(capturer.written)
        record["dropped"] = dict(capturer.dropped)
        record["failures"] = dict(capturer.failures)
        if state.sentinel is not None:
            state.sentinel.close(state, 60)
            sentinel = state.sentinel.sentinel
            record["sentinel"] = {
                "counts": dict(sentinel.counts),
                "findings": [{"layer": f.result.layer, "step": f.result.step, "kind": f.kind,
                              "request": f.first[0], "head": f.first[1]} for f in sentinel.findings],
                "written": list(state.sentinel.capturer.written)}
        record["stage"] = "done"
    except Exception as exc:  # say where the engine stopped
        record["problems"].append(f"engine stopped ({record['stage']}): {exc!r}"[:600])
        record["trace"] = traceback.format_exc().strip().splitlines()[-30:]
    record["steps"] = probes.steps
    record["startup_forward_calls"] = probes.outside["forward"]
    record["kvdbg_log"] = lines.lines[-40:]
    record["sentinel_log"] = lines.sentinel
    return record


# --------------------------------------------------------------------------- checks (a child process each)


def load_index(directory: str) -> tuple[dict, list[str]]:
    """``{(layer, step): path}`` of the snapshots in ``directory`` and the files that are not one (or twice one)."""
    from kvdbg import api

    index, odd = {}, []
    if not os.path.isdir(directory):
        return index, odd
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".safetensors"):
            odd.append(name)
            continue
        meta = api.load(path).meta
        key = (meta.layer.name, int(meta.capture.get("step")))
        if key in index:
            odd.append(name)
        index[key] = path
    return index, odd


def files_check(record: dict, index: dict, odd: list[str]) -> list[str]:
    """Exactly the wanted (layer, step) snapshots, nothing else."""
    if "base" not in record:
        return ["no start-up count: the wanted steps are unknown"]
    wanted = {(layer, record["base"] + s) for layer in record["layers"] for s in record["wanted_rel"]}
    found = set(index)
    problems = []
    if found - wanted:
        problems.append(f"{len(found - wanted)} snapshot(s) of unwanted steps: {sorted(found - wanted)[:6]}")
    if wanted - found:
        problems.append(f"{len(wanted - found)} wanted step(s) without a snapshot: {sorted(wanted - found)[:6]}")
    if odd:
        problems.append(f"other files in the capture directory: {odd[:6]}")
    return problems


def rel_steps(record: dict) -> dict[int, dict]:
    """The served steps by their number counted from the first served step."""
    base = record.get("base", 0)
    return {s["kvdbg_step"] - base: s for s in record.get("steps", [])}


def replayed(step: dict) -> dict | None:
    """The full graph a served step was replayed from (None: it ran in Python)."""
    return next((g for g in step.get("graphs", []) if g["kind"] == "replay"), None)


def graph_size(step: dict, cpu: bool = False) -> int | None:
    """The full graph a step was replayed from (its token count); in the dry run, the graph it would have been."""
    graph = replayed(step)
    if graph is not None:
        return graph["num_tokens"]
    return graph_plan.padded(sum(r[1] for r in step["rows"])) if cpu else None


def shape_of(step: dict) -> graph_plan.StepShape:
    return graph_plan.StepShape([graph_plan.Row(n, t, s, bool(d)) for n, t, s, d in step["rows"] if t])


def python_per_layer(record: dict, layers: int) -> tuple[list[str], dict]:
    """No attention forward and no per-layer kvdbg hook during a replayed step; kvdbg's graph hook once."""
    problems, counts = [], Counter()
    for rel, step in sorted(rel_steps(record).items()):
        if replayed(step) is None:
            counts["eager_steps"] += 1
            counts["eager_forward_calls"] += step["forward_calls"]
            continue
        counts["replayed_steps"] += 1
        counts["forward_calls_in_replayed_steps"] += step["forward_calls"]
        counts["kvdbg_layer_hooks_in_replayed_steps"] += step["layer_hooks"]
        counts["kvdbg_graph_hooks"] += step["graph_hooks"]
        if step["forward_calls"] or step["layer_hooks"] or step["forward_in_replay"] or step["graph_hooks"] != 1:
            problems.append(f"step {rel} (replayed from the {replayed(step)['num_tokens']}-token graph): "
                            f"{step['forward_calls']} attention forward(s), {step['layer_hooks']} per-layer kvdbg "
                            f"hook call(s), {step['graph_hooks']} graph hook call(s) (want 0, 0, 1)")
    if counts["eager_steps"] and counts["eager_forward_calls"] != counts["eager_steps"] * layers:
        problems.append(f"{counts['eager_forward_calls']} attention forwards in {counts['eager_steps']} eager steps "
                        f"of {layers} layers: the counting wrapper missed some")
    return problems, dict(counts)


def token_check(eager: dict, graph: dict) -> tuple[list[str], dict[str, int]]:
    """The two engines' tokens per request; the first diverging index of each request that diverged."""
    problems, diverged = [], {}
    a, b = eager.get("outputs", {}), graph.get("outputs", {})
    if set(a) != set(b):
        problems.append(f"requests finished differ: {sorted(a)} vs {sorted(b)}")
    for name in sorted(set(a) & set(b)):
        at = graph_plan.first_divergence(a[name], b[name])
        if at is not None:
            diverged[name] = at
            problems.append(f"request {name}: tokens differ from generated token {at} on "
                            f"({a[name][at:at + 3]} vs {b[name][at:at + 3]})")
    return problems, diverged


def schedule_check(eager: dict, graph: dict, plan_name: str) -> tuple[list[str], list[str]]:
    """Both engines ran the same batches (requests, tokens, lengths) in the same order; warnings where the plan's
    model of the scheduler says otherwise."""
    problems, warnings = [], []
    a, b = rel_steps(eager), rel_steps(graph)
    if sorted(a) != sorted(b):
        problems.append(f"served steps differ: {len(a)} vs {len(b)}")
    for rel in sorted(set(a) & set(b)):
        if a[rel]["rows"] != b[rel]["rows"]:
            problems.append(f"step {rel}: batches differ: {a[rel]['rows']} vs {b[rel]['rows']}")
            break
    plan, _ = graph_plan.PLANS[plan_name]
    model = graph_plan.simulate(plan)
    seen = [sorted((n, t, s) for n, t, s, _ in step["rows"] if t) for _, step in sorted(a.items())]
    said = [sorted((r.name, r.tokens, r.seq_len) for r in shape.rows) for shape in model]
    if seen != said:
        first = next((i for i, (x, y) in enumerate(zip(seen, said)) if x != y), min(len(seen), len(said)))
        warnings.append(f"the engine's batches differ from graph_plan.simulate's from step {first} "
                        f"(the checks use the engine's own account)")
    return problems, warnings


def request_rows(snapshot, rows: list) -> list[str]:
    """The request name of each row of a one-step snapshot (rows with tokens, in batch order, as the probe saw)."""
    names = [r[0] for r in rows if r[1]]
    if len(names) != snapshot.steps[0].num_reqs:
        raise ValueError(f"the snapshot has {snapshot.steps[0].num_reqs} requests, the step {len(names)}")
    return names


def compare_snapshots(e_path: str, g_path: str, e_rows: list, g_rows: list, diverged: dict, prompt_lens: dict,
                      floats_matter: bool = True, from_graph: bool = True) -> dict:
    """The graph engine's snapshot of a batch against the eager engine's, request by request (``from_graph``: the
    graph engine replayed this step from a full graph, so its snapshot holds the pages after the update and no
    new K/V; an eager snapshot holds the pages before it and the new K/V, which are written here first)."""
    import torch

    from kvdbg import api
    from kvdbg.snapshot.cache import apply_step_update

    E, G = api.load(e_path), api.load(g_path)
    result = {"problems": [], "floats": {}, "excluded_rows": 0}
    problems = result["problems"]
    if E.meta.layer != G.meta.layer:
        problems.append(f"layer metadata differs: {E.meta.layer} vs {G.meta.layer}")
    backend_fields = ("page_size", "max_model_len", "num_gpu_blocks", "max_decode_query_len", "max_num_seqs",
                      "max_num_batched_tokens")
    for name in backend_fields:
        if getattr(E.meta.backend, name) != getattr(G.meta.backend, name):
            problems.append(f"backend.{name} differs: {getattr(E.meta.backend, name)} vs {getattr(G.meta.backend, name)}")
    es, gs = E.steps[0], G.steps[0]
    e_names, g_names = request_rows(E, e_rows), request_rows(G, g_rows)
    exact = {n: bool(torch.equal(getattr(es, n), getattr(gs, n))) for n in ("block_table", "seq_lens",
                                                                             "query_start_loc")}
    exact["page_ids"] = bool(torch.equal(E.page_ids, G.page_ids))
    result["byte_exact"] = exact
    if e_names == g_names and not all(exact.values()):
        problems.append(f"metadata not byte-exact: {[n for n, ok in exact.items() if not ok]}")
    if from_graph and gs.slot_mapping is not None:
        problems.append("the graph snapshot carries new K/V: a graph replay hands none over")
    e_cache, g_cache = E.kv_cache.clone(), G.kv_cache.clone()
    apply_step_update(E, e_cache, 0)  # an eager snapshot holds the pages before the update, and its new K/V
    apply_step_update(G, g_cache, 0)
    e_k, e_v = E.kv_views(e_cache)
    g_k, g_v = G.kv_views(g_cache)
    ps = E.page_size
    kv_dtype = e_k.dtype
    stats = {k: graph_plan.FloatComparison() for k in ("query", "output", "pages")}
    e_qsl, g_qsl = es.query_start_loc.tolist(), gs.query_start_loc.tolist()
    for i, name in enumerate(e_names):
        if name not in g_names:
            problems.append(f"request {name} is not in the graph snapshot")
            continue
        j = g_names.index(name)
        length = int(es.seq_lens[i])
        # The lengths kvdbg recorded against the scheduler's own count (not read from any buffer a kernel reads).
        want = [r[2] for r in e_rows if r[1] and r[0] == name][0]
        if length != want or int(gs.seq_lens[j]) != want:
            problems.append(f"request {name}: seq_len {length} (eager) / {int(gs.seq_lens[j])} (graph), the "
                            f"scheduler counted {want}")
        pages = -(-length // ps)
        if not torch.equal(es.block_table[i, :pages], gs.block_table[j, :pages]):
            problems.append(f"request {name}: block table rows differ")
            continue
        if e_qsl[i + 1] - e_qsl[i] != g_qsl[j + 1] - g_qsl[j]:
            problems.append(f"request {name}: query lengths differ")
            continue
        if name in diverged and length > prompt_lens[name] + diverged[name]:
            result["excluded_rows"] += 1  # its input holds a token the engines sampled differently
            continue
        stats["query"].add(graph_plan.compare_floats(gs.query[g_qsl[j]:g_qsl[j + 1]],
                                                     es.query[e_qsl[i]:e_qsl[i + 1]]))
        if es.output is not None and gs.output is not None:
            stats["output"].add(graph_plan.compare_floats(gs.output[g_qsl[j]:g_qsl[j + 1]],
                                                          es.output[e_qsl[i]:e_qsl[i + 1]]))
        for p in range(pages):
            page = int(es.block_table[i, p])
            if page == 0:  # vLLM's null block (a page before the sliding window): nothing is read there
                continue
            live = min(ps, length - p * ps)
            se = int(E.to_stored_index(torch.tensor([page]))[0])
            sg = int(G.to_stored_index(torch.tensor([page]))[0])
            for a, b in ((g_k, e_k), (g_v, e_v)):
                stats["pages"].add(graph_plan.compare_floats(a[sg, :, :live], b[se, :, :live], kv_dtype))
    result["floats"] = {k: v.to_json() for k, v in stats.items()}
    if es.output is None or gs.output is None:
        problems.append("a snapshot holds no engine output")
    worst = max((v.max_ulps for v in stats.values()), default=0.0)
    result["max_ulps"] = worst
    if floats_matter and worst > ULPS_FAIL:
        problems.append(f"floats differ by up to {worst:.3g} units in the last place (> {ULPS_FAIL}): "
                        f"{ {k: round(v.max_ulps, 1) for k, v in stats.items()} }")
    return result


def replay_verdict(path: str, device: str) -> dict:
    """captured vs reference (vLLM's kernel output against exact attention): passed, failing requests, errors."""
    from kvdbg import api

    data = api.replay(path, ["reference"], device=device).to_json()
    comp = next((c for c in data.get("comparisons", []) if (c["actual"], c["expected"]) == ("captured", "reference")),
                None)
    errors = [f"{f.get('backend')}:{f.get('code')}" for f in data.get("findings", []) if f.get("severity") == "error"]
    if comp is None:
        return {"passed": False, "failing_requests": [], "errors": errors, "note": "no captured vs reference"}
    failing = sorted({h["request"] for h in comp.get("heads", []) if not h.get("passed")})
    return {"passed": bool(comp.get("heads")) and not failing and not errors, "failing_requests": failing,
            "errors": errors, "max_abs": comp.get("max_abs")}


def cli_replay(path: str, device: str) -> dict:
    """``kvdbg replay SNAP`` as a user types it (reference only): its exit code and its comparison rows."""
    done = subprocess.run([sys.executable, "-m", "kvdbg", "replay", path, "--backend", "reference", "--device",
                           device], capture_output=True, text=True, timeout=300)
    rows = [ln.strip() for ln in done.stdout.splitlines() if "captured vs reference" in ln or ln.startswith("FAIL")]
    return {"exit": done.returncode, "rows": rows[:4], "stderr": done.stderr.strip().splitlines()[-3:]}


def judge_sample(index: dict, steps: dict, base: int, limit: int) -> list[str]:
    """Snapshots to judge with engine_stage.judge: one per (kind, graph size) of the last layer first, then more."""
    picked, seen = [], set()
    keys = sorted(index, key=lambda k: (k[0] != max(x[0] for x in index), k[1]))
    for layer, step in keys:
        info = steps.get(step - base)
        graph = replayed(info) if info else None
        tag = (shape_of(info).kind if info else "?", graph["num_tokens"] if graph else None)
        if tag not in seen:
            seen.add(tag)
            picked.append(index[(layer, step)])
    for key in keys:
        if len(picked) >= limit:
            break
        if index[key] not in picked:
            picked.append(index[key])
    return picked[:limit]


def check_pair(out: str, model: str, eager_name: str, graph_name: str, args) -> dict:
    """Eager against graph engine of one model: every check of the comparison parts."""
    records = {n: read_record(out, n) for n in (eager_name, graph_name)}
    eager, graph = records[eager_name], records[graph_name]
    result = {"check": f"pair:{model}", "eager": eager_name, "graph": graph_name, "problems": [], "warnings": [],
              "graph_mode": graph.get("cudagraph_mode")}
    problems, warnings = result["problems"], result["warnings"]
    piecewise = graph_name.startswith("piecewise-")
    for rec in (eager, graph):
        problems += [f"{rec['name']}: {p}" for p in rec.get("problems", [])]
        for what in ("dropped", "failures"):
            if rec.get(what):
                problems.append(f"{rec['name']}: capture {what}: {rec[what]}")
    if not (eager.get("served") and graph.get("served")):
        return result
    if graph.get("requested_mode"):
        warnings.append(f"{graph_name}: vLLM refused {graph['requested_mode']} ({graph.get('fallback_reason')}); "
                        f"ran {graph['mode']}")
    p, diverged = token_check(eager, graph)
    result["diverged"] = diverged
    (warnings if args.allow_token_divergence else problems).extend(p)
    p, w = schedule_check(eager, graph, eager["plan"])
    problems += p
    warnings += w
    e_index, e_odd = load_index(os.path.join(out, eager_name, "snapshots"))
    g_index, g_odd = load_index(os.path.join(out, graph_name, "snapshots"))
    problems += [f"{eager_name}: {p}" for p in files_check(eager, e_index, e_odd)]
    problems += [f"{graph_name}: {p}" for p in files_check(graph, g_index, g_odd)]
    e_steps, g_steps = rel_steps(eager), rel_steps(graph)
    layers = len(graph["layers"])
    wanted = graph["wanted_rel"]
    # Which wanted steps the graph engine replayed from full graphs, and what they were.
    replays = {rel: replayed(g_steps[rel]) for rel in wanted if rel in g_steps}
    from_graphs = [rel for rel, g in replays.items() if g is not None]
    result["graph_steps"] = {"wanted": len(wanted), "replayed_from_graphs": len(from_graphs),
                             "by_graph": dict(Counter(f"{shape_of(g_steps[r]).kind} {len(shape_of(g_steps[r]).rows)}"
                                                      f"->{replays[r]['num_tokens']}" for r in from_graphs)),
                             "recorded_graphs": graph.get("recorded_graphs")}
    if not args.cpu and not piecewise:
        if len(from_graphs) < MIN_GRAPH_STEPS:
            problems.append(f"only {len(from_graphs)} wanted step(s) were replayed from full graphs "
                            f"(want >= {MIN_GRAPH_STEPS})")
        gaps = graph_plan.coverage_gaps([shape_of(g_steps[r]) for r in from_graphs])
        problems += [f"among the steps replayed from graphs: {g}" for g in gaps]
        if graph.get("cudagraph_mode") != graph["mode"]:
            warnings.append(f"vLLM resolved cudagraph_mode {graph['mode']} to {graph.get('cudagraph_mode')}")
    p, counts = python_per_layer(graph, layers)
    result["python_per_layer"] = counts
    problems += p
    # Every wanted (layer, step): the graph snapshot against the eager one of the same batch.
    base_e, base_g = eager.get("base", 0), graph.get("base", 0)
    prompt_lens = {a.name: a.prompt_len for a in graph_plan.PLANS[eager["plan"]][0]}
    totals = {k: graph_plan.FloatComparison() for k in ("query", "output", "pages")}
    compared, excluded, worst, exact = 0, 0, 0.0, Counter()
    notes_wrong = []
    for layer in graph["layers"]:
        for rel in wanted:
            ek, gk = (layer, base_e + rel), (layer, base_g + rel)
            if ek not in e_index or gk not in g_index or rel not in e_steps or rel not in g_steps:
                continue
            try:
                res = compare_snapshots(e_index[ek], g_index[gk], e_steps[rel]["rows"], g_steps[rel]["rows"],
                                        diverged, prompt_lens, floats_matter=not piecewise,
                                        from_graph=replays.get(rel) is not None)
            except Exception as exc:
                problems.append(f"{layer} step {rel}: comparison failed: {exc!r}"[:300])
                continue
            compared += 1
            excluded += res["excluded_rows"]
            worst = max(worst, res["max_ulps"])
            exact.update(k for k, ok in res["byte_exact"].items() if ok)
            for k, v in res["floats"].items():
                totals[k].add(graph_plan.FloatComparison(v["elements"], v["bit_equal"], v["max_ulps"], v["max_abs"]))
            problems += [f"{layer} step {rel}: {p}" for p in res["problems"]]
            from_graph = "full CUDA graph" in load_notes(g_index[gk])
            if (replays.get(rel) is not None) != from_graph and not args.cpu:
                notes_wrong.append(rel)
    result["compared"] = {"pairs": compared, "byte_exact": dict(exact), "excluded_rows": excluded,
                          "floats": {k: v.to_json() for k, v in totals.items()}}
    if notes_wrong:
        problems.append(f"snapshot notes disagree with the replays for steps {sorted(set(notes_wrong))[:8]}")
    if worst > ULPS_WARN:
        warnings.append(f"floats differ from the eager engine's by up to {worst:.3g} units in the last place")
    # Judged: every graph snapshot against the reference; a sample with engine_stage.judge (vllm column too).
    deadline = args.deadline
    device = "cpu" if args.cpu else "cuda"
    judged, failed, skipped = 0, [], 0
    for key in sorted(g_index):
        if time.time() > deadline - 5:
            skipped += 1
            continue
        verdict = replay_verdict(g_index[key], device)
        judged += 1
        if not verdict["passed"]:
            failed.append(f"{key[0]} step {key[1] - base_g}: {verdict}")
    result["replayed_vs_reference"] = {"judged": judged, "failed": len(failed), "skipped_for_time": skipped}
    problems += [f"{graph_name} snapshot does not replay PASS: {f}"[:300] for f in failed[:6]]
    if skipped:
        problems.append(f"{skipped} graph snapshot(s) not judged within the time budget")
    sample = judge_sample(g_index, g_steps, base_g, args.judge_max)
    full, full_failed = 0, []
    for path in sample:
        if time.time() > deadline - 10:
            break
        full += 1
        found = judge(path, device)
        if found:
            full_failed.append(f"{os.path.basename(path)}: {found}")
    result["engine_stage_judge"] = {"judged": full, "failed": len(full_failed)}
    problems += [f"engine_stage.judge: {f}"[:300] for f in full_failed[:4]]
    return result


def load_notes(path: str) -> str:
    from kvdbg import api

    return api.load(path).meta.notes


def check_fault(out: str, name: str, args) -> dict:
    """The graph-only fault: caught by the sentinel on the faulty graph's steps only, its snapshots FAIL naming
    requests whose length was stale, the other graphs' steps clean; kvdbg's lengths are the scheduler's."""
    record = read_record(out, name)
    result = {"check": "fault", "problems": [], "warnings": []}
    problems, warnings = result["problems"], result["warnings"]
    problems += [f"{name}: {p}" for p in record.get("problems", [])]
    if not record.get("served"):
        return result
    device = "cpu" if args.cpu else "cuda"
    fault = record.get("fault", [])
    result["fault_recorded"] = fault
    if len(fault) != 1:
        problems.append(f"the fault wrapper fired {len(fault)} time(s) while graphs were recorded (want 1)")
    stale = fault[0]["stale_seq_lens"] if fault else []
    steps = rel_steps(record)
    base = record["base"]
    sizes = {base + rel: graph_size(s, args.cpu) for rel, s in steps.items()}
    faulty = sorted(step for step, size in sizes.items() if size == graph_plan.FAULT_GRAPH_SIZE)
    result["steps"] = {"faulty_graph": len(faulty), "other": len(sizes) - len(faulty),
                       "other_graphs": sorted({s for s in sizes.values() if s} - {graph_plan.FAULT_GRAPH_SIZE})}
    if not faulty:
        problems.append(f"no step was replayed from the {graph_plan.FAULT_GRAPH_SIZE}-token graph")
    by_step = {base + rel: s for rel, s in steps.items()}
    sentinel = record.get("sentinel") or {}
    findings = sentinel.get("findings", [])
    counts = sentinel.get("counts", {})
    result["sentinel"] = {"counts": counts, "findings": len(findings)}
    layers = record["layers"]
    if not findings:
        problems.append("the sentinel found no wrong step")
    outside = [f for f in findings if f["step"] not in faulty]
    if outside:
        problems.append(f"the sentinel found wrong steps outside the faulty graph: {outside[:4]}")
    flagged = {(f["layer"], f["step"]) for f in findings}
    result["sentinel"]["flagged_of_faulty"] = f"{len(flagged)}/{len(faulty) * len(layers)}"
    if counts.get("checked", 0) < len(steps) * len(layers):
        warnings.append(f"the sentinel checked {counts.get('checked', 0)} step(s) of {len(steps) * len(layers)}")
    # Its log lines: layer, step and request named.
    said = [m.groups() for m in (LOG_PATTERN.search(line) for line in record.get("sentinel_log", [])) if m]
    result["sentinel"]["log_lines"] = [f"layer {g[0]} step {g[1]}: first failing request {g[3]} head {g[4]}"
                                       for g in said][:8]
    if not said:
        problems.append("no sentinel log line names a wrong step's layer, step and request")
    for layer, step, _, request, _, _ in said:
        if int(step) not in faulty or layer not in layers:
            problems.append(f"a sentinel line names layer {layer} step {step}, not a step of the faulty graph")
    # Its snapshots: FAIL naming requests whose length was stale; the lengths kvdbg recorded are the scheduler's.
    s_index, s_odd = load_index(os.path.join(out, name, "sentinel"))
    result["sentinel"]["snapshots"] = len(s_index)
    if not s_index:
        problems.append("the sentinel wrote no snapshot")
    verdicts = []
    for (layer, step), path in sorted(s_index.items()):
        if step not in faulty:
            problems.append(f"sentinel snapshot of step {step - base}, not a step of the faulty graph")
        verdicts.append(fault_verdict(path, by_step.get(step), stale, device, expect_fail=True))
    if s_index:
        first = sorted(s_index.values())[0]
        cli = cli_replay(first, device)
        result["sentinel"]["kvdbg_replay"] = cli
        if cli["exit"] != 1 or not any("req" in row for row in cli["rows"]):
            problems.append(f"`kvdbg replay` of a sentinel snapshot: exit {cli['exit']} (want 1 naming the "
                            f"requests): {cli['rows']}")
    # Capture's own snapshots of the same engine: the faulty graph's steps FAIL, every other step PASS.
    c_index, c_odd = load_index(os.path.join(out, name, "snapshots"))
    problems += files_check(record, c_index, c_odd)
    for (layer, step), path in sorted(c_index.items()):
        verdicts.append(fault_verdict(path, by_step.get(step), stale, device, expect_fail=step in faulty))
    result["snapshots"] = {"sentinel": len(s_index), "capture": len(c_index),
                           "verdicts": Counter(v["outcome"] for v in verdicts)}
    problems += [v["problem"] for v in verdicts if v.get("problem")][:10]
    result["stale_named"] = sorted({r for v in verdicts for r in v.get("named", [])})
    return result


def fault_verdict(path: str, step: dict | None, stale: list, device: str, expect_fail: bool) -> dict:
    """One snapshot of the fault engine: replayed, its failing requests against those whose length was stale."""
    from kvdbg import api

    name = os.path.basename(path)
    if step is None:
        return {"outcome": "unknown step", "problem": f"{name}: its step was not served"}
    snap = api.load(path)
    lengths = snap.steps[0].seq_lens.tolist()
    rows = [r for r in step["rows"] if r[1]]
    scheduler = [r[2] for r in rows]
    verdict = replay_verdict(path, device)
    failed = not verdict["passed"]
    out = {"outcome": ("FAIL" if failed else "PASS") + (" as expected" if failed == expect_fail else " unexpectedly")}
    if lengths != scheduler:
        out["problem"] = f"{name}: recorded seq_lens {lengths}, the scheduler counted {scheduler}"
        return out
    if not expect_fail:
        if not verdict["passed"]:
            out["problem"] = f"{name}: a step of another graph replays FAIL: {verdict}"
        return out
    stale_rows = {i for i, n in enumerate(lengths) if i < len(stale) and stale[i] != n}
    failing = set(verdict["failing_requests"])
    out["named"] = [rows[i][0] for i in sorted(failing) if i < len(rows)]
    if verdict["passed"]:
        out["problem"] = f"{name}: a step of the faulty graph replays PASS"
    elif not failing <= stale_rows:
        out["problem"] = f"{name}: failing requests {sorted(failing)} include ones whose length was not stale"
    return out


def check_piecewise(out: str, name: str, args) -> dict:
    """A torch.compile engine under piecewise graphs: did it start and serve; if so, its snapshots replay PASS."""
    record = read_record(out, name)
    result = {"check": name, "problems": [], "warnings": [], "started": "startup_s" in record,
              "served": bool(record.get("served")), "cudagraph_mode": record.get("cudagraph_mode")}
    if not record.get("served"):
        result["not_served"] = (record.get("problems") or ["?"])[0][:400]
        result["trace_tail"] = record.get("trace", [])[-4:]
        return result
    eager = read_record(out, "plain-eager")
    if eager.get("served"):
        pair = check_pair(out, "plain", "plain-eager", name, args)
        result["problems"] += pair["problems"]
        result["warnings"] += pair["warnings"]
        result["pair"] = {k: pair.get(k) for k in ("graph_steps", "python_per_layer", "compared",
                                                    "replayed_vs_reference", "engine_stage_judge")}
    else:
        index, odd = load_index(os.path.join(out, name, "snapshots"))
        result["problems"] += files_check(record, index, odd)
        device = "cpu" if args.cpu else "cuda"
        bad = [p for p in index.values() if not replay_verdict(p, device)["passed"]]
        result["replayed_vs_reference"] = {"judged": len(index), "failed": len(bad)}
        result["problems"] += [f"does not replay PASS: {os.path.basename(p)}" for p in bad[:4]]
    return result


# --------------------------------------------------------------------------- the parent


def read_record(out: str, name: str) -> dict:
    path = os.path.join(out, "records", f"{name}.json")
    if not os.path.exists(path):
        return {"name": name, "problems": ["no record: the engine did not run"], "served": False}
    with open(path) as fh:
        return json.load(fh)


def write_json(out: str, name: str, data: dict) -> str:
    os.makedirs(os.path.join(out, "records"), exist_ok=True)
    path = os.path.join(out, "records", f"{name}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh, default=str)
    os.replace(path + ".tmp", path)
    return path


def child(args, extra: list[str], log_name: str, timeout: float) -> tuple[int | None, float]:
    """This script in a child process; its output into logs/NAME.log. (exit code or None on timeout, seconds)"""
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), args.out, *extra] + (["--cpu"] if args.cpu else [])
    cmd += ["--deadline", str(args.deadline), "--judge-max", str(args.judge_max)]
    cmd += ["--allow-token-divergence"] if args.allow_token_divergence else []
    started = time.monotonic()
    with open(os.path.join(args.out, "logs", f"{log_name}.log"), "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(1.0, timeout))
            return proc.returncode, time.monotonic() - started
        except subprocess.TimeoutExpired:
            return None, time.monotonic() - started


def log_tail(out: str, name: str, lines: int = 12) -> list[str]:
    try:
        with open(os.path.join(out, "logs", f"{name}.log"), errors="replace") as fh:
            return [ln.rstrip()[:300] for ln in fh.readlines()[-lines:]]
    except OSError:
        return []


def run_engine(args, spec: RunSpec) -> dict:
    """One engine in a child process (with FULL refused at start-up, once more under FULL_DECODE_ONLY)."""
    def once(mode: str) -> dict:
        left = args.deadline - time.time() - args.check_reserve
        if left < 45:
            return {"name": spec.name, "problems": ["not run: the time budget was spent"], "served": False}
        extra = ["--one", spec.name] + (["--mode", mode] if mode != spec.mode else [])
        rc, took = child(args, extra, spec.name, min(args.engine_timeout, left))
        record = read_record(args.out, spec.name) if rc is not None else {}
        if rc is None:
            record = {"name": spec.name, "problems": [f"engine run over {min(args.engine_timeout, left):.0f} s"],
                      "served": False, "log_tail": log_tail(args.out, spec.name)}
            write_json(args.out, spec.name, record)
        elif not record or record.get("name") != spec.name:
            record = {"name": spec.name, "problems": [f"engine process exit {rc} without a record"],
                      "served": False, "log_tail": log_tail(args.out, spec.name)}
            write_json(args.out, spec.name, record)
        record["wall_s"] = round(took, 1)
        return record

    try:
        os.makedirs(os.path.join(args.out, "records"), exist_ok=True)
        stale = os.path.join(args.out, "records", f"{spec.name}.json")
        if os.path.exists(stale):
            os.remove(stale)
        record = once(spec.mode)
        if spec.mode == GRAPH_MODE and record.get("stage") == "start" and not record.get("served") \
                and "startup_s" not in record and not args.cpu:
            reason = (record.get("problems") or ["?"])[0]
            record = once(FALLBACK_MODE)
            record.update(requested_mode=GRAPH_MODE, fallback_reason=reason[:300])
            write_json(args.out, spec.name, record)
    except Exception as exc:
        record = {"name": spec.name, "problems": [f"harness error: {exc!r}"], "served": False}
    line = {k: record.get(k) for k in ("name", "mode", "cudagraph_mode", "startup_s", "wall_s", "served",
                                       "base", "written", "problems")}
    if record.get("problems"):
        line["trace_tail"] = record.get("trace", [])[-6:] or record.get("log_tail", [])[-6:]
    print("ENGINE " + json.dumps(line, default=str), flush=True)
    return record


def run_check(args, what: str) -> dict:
    left = args.deadline - time.time()
    rc, took = child(args, ["--check", what], f"check-{what.replace(':', '-')}", max(30.0, left))
    result = read_record(args.out, f"check-{what.replace(':', '-')}")
    if rc is None or result.get("check") is None:
        result = {"check": what, "problems": [f"check process {'timed out' if rc is None else f'exit {rc}'} "
                                              "without a result"], "log_tail": log_tail(
                                                  args.out, f"check-{what.replace(':', '-')}")}
    result["wall_s"] = round(took, 1)
    print("CHECK " + json.dumps(result, default=str)[:4000], flush=True)
    return result


def run_dag(tasks: dict, jobs: int) -> dict:
    """Run ``{name: (deps, fn)}`` on ``jobs`` threads, each task once its dependencies are done."""
    results, running = {}, {}
    remaining = dict(tasks)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while remaining or running:
            for name in [n for n, (deps, _) in remaining.items() if all(d in results for d in deps)]:
                deps, fn = remaining.pop(name)
                running[pool.submit(fn)] = name
            if not running:
                for name in remaining:
                    results[name] = {"problems": [f"{name}: not run (its engines did not)"]}
                break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                name = running.pop(future)
                try:
                    results[name] = future.result()
                except Exception as exc:
                    results[name] = {"problems": [f"{name}: harness error {exc!r}"]}
    return results


def parent(args) -> int:
    from tests.engine.tiny_model import write_model

    started = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    specs = all_specs(args.cpu)
    parts = [p for p in args.parts.split(",") if p]
    if args.cpu:
        parts = [p for p in parts if p in ("plain", "fault")]
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"unknown part(s) {sorted(unknown)}; parts: {','.join(PARTS)}", file=sys.stderr)
        return 2
    piecewise = [m for m in (args.try_piecewise or "").split(",") if m] if not args.cpu else []
    runs: list[RunSpec] = []
    checks: dict[str, tuple[list[str], str]] = {}
    if "fault" in parts:
        runs.append(specs["fault-graph"])
        checks["fault"] = (["fault-graph"], "fault")
    for model in ("plain", "sliding", "fp8"):
        if model in parts:
            runs += [specs[f"{model}-eager"], specs[f"{model}-graph"]]
            checks[f"pair:{model}"] = ([f"{model}-eager", f"{model}-graph"], f"pair:{model}")
    for mode in piecewise:
        runs.append(specs[f"piecewise-{mode}"])
        deps = [f"piecewise-{mode}"] + (["plain-eager"] if "plain" in parts else [])
        checks[f"piecewise:{mode}"] = (deps, f"piecewise:{mode}")
    for model in {s.model for s in runs}:
        write_model(MODELS[model], os.path.join(args.out, "models", model))
    tasks = {s.name: ([], functools.partial(run_engine, args, s)) for s in runs}
    tasks.update({name: (deps, functools.partial(run_check, args, what)) for name, (deps, what) in checks.items()})
    results = run_dag(tasks, args.jobs)
    summary = summarize(args, runs, checks, results, time.monotonic() - started)
    text = json.dumps(summary, indent=1, default=str)
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        fh.write(text)
    print(text, flush=True)
    return 0 if summary["passed"] else 1


def summarize(args, runs, checks, results, wall: float) -> dict:
    problems, warnings = [], []
    engines = []
    for spec in runs:
        rec = results.get(spec.name, {})
        engines.append({k: rec.get(k) for k in ("name", "mode", "requested_mode", "cudagraph_mode", "startup_s",
                                                "wall_s", "served", "written")})
        if spec.compile:  # an attempt: its engine not starting is reported, not failed
            continue
        if not rec.get("served"):
            problems.append(f"{spec.name}: did not serve: {(rec.get('problems') or ['?'])[0]}"[:400])
    parts = {}
    for name in checks:
        res = results.get(name, {})
        parts[name] = {k: v for k, v in res.items() if k not in ("problems", "warnings", "check", "log_tail")}
        problems += [f"{name}: {p}"[:400] for p in res.get("problems", [])]
        warnings += [f"{name}: {w}"[:400] for w in res.get("warnings", [])]
    shown = 40
    return {"passed": not problems, "wall_s": round(wall, 1), "cpu_dry_run": bool(args.cpu), "engines": engines,
            "parts": parts, "problems": problems[:shown], "more_problems": max(0, len(problems) - shown),
            "warnings": warnings[:shown], "out": args.out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--try-piecewise", nargs="?", const=",".join(PIECEWISE_MODES), default="",
                        help=f"also try torch.compile engines under these modes (default {','.join(PIECEWISE_MODES)})")
    parser.add_argument("--jobs", type=int, default=4, help="engines (and checks) at a time")
    parser.add_argument("--budget", type=float, default=360, help="seconds for the whole stage")
    parser.add_argument("--engine-timeout", type=float, default=240, help="seconds for one engine run")
    parser.add_argument("--check-reserve", type=float, default=45, help="seconds kept for the checks after engines")
    parser.add_argument("--judge-max", type=int, default=6, help="snapshots per part judged with engine_stage.judge")
    parser.add_argument("--allow-token-divergence", action="store_true",
                        help="tokens that part between the engines are a warning, not a failure")
    parser.add_argument("--cpu", action="store_true", help="dry run on a CPU build of vLLM (no graphs)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--check", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.deadline is None:
        args.deadline = time.time() + args.budget
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        spec = all_specs(args.cpu)[args.one]
        if args.mode:
            spec = dataclasses.replace(spec, mode=args.mode)
        record = engine_child(args.out, spec, args.cpu)
        print("ENGINE-RECORD " + write_json(args.out, spec.name, record), flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # vLLM's and kvdbg's teardown are not what this stage checks; the snapshots are written
    if args.check:
        kind, _, name = args.check.partition(":")
        try:
            if kind == "pair":
                result = check_pair(args.out, name, f"{name}-eager", f"{name}-graph", args)
            elif kind == "fault":
                result = check_fault(args.out, "fault-graph", args)
            else:
                result = check_piecewise(args.out, f"piecewise-{name}", args)
        except Exception as exc:
            result = {"check": args.check, "problems": [f"check failed: {exc!r}"[:400]],
                      "trace": traceback.format_exc().strip().splitlines()[-20:]}
        write_json(args.out, f"check-{args.check.replace(':', '-')}", result)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
