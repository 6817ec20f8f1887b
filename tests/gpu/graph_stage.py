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
    counts. The checks sent to the sentinel's checker process must give it each layer once and share storages only
    for kvdbg's staging buffers (graph_checks.checker_check: every check after the first sharing some means a step's
    own tensors went).
--try-piecewise [MODES]
    Engines under PIECEWISE / FULL_AND_PIECEWISE, which need torch.compile (compilation mode 3): whether one starts
    and serves with kvdbg capturing, and if it does, whether its snapshots replay PASS. Reported either way; only
    a snapshot that does not replay PASS fails the stage.

Engines run in child processes (vLLM's engine core and distributed state are per process), ``--jobs`` at a time
(their KV cache is sized by ``kv_cache_memory_bytes``, so vLLM's memory profiling, which other processes on the
GPU could upset, does not run); each part's checks (tests/gpu/graph_checks.py) run in a child process of their own
as soon as its engines are done. ``--cpu``: a dry run of the harness on a CPU build of vLLM (eager engines only,
the fault emulated by shifting outputs; the graph checks are skipped).

Usage: python tests/gpu/graph_stage.py OUT [--parts plain,sliding,fp8,fault] [--try-piecewise [MODES]]
       [--jobs N] [--budget SECONDS] [--judge-max N] [--cpu]
Prints one JSON line per engine run and per check, then one JSON summary; exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import logging
import os
import subprocess
import sys
import time
import traceback
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu import graph_plan  # noqa: E402
from tests.gpu.graph_checks import check_fault, check_pair, check_piecewise, read_record, write_json  # noqa: E402
from tests.gpu.engine_stage import BLOCK_SIZE, MODELS, NATIVE_IR_OPS, prompt  # noqa: E402

PARTS = ("plain", "sliding", "fp8", "fault")
PIECEWISE_MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")
# vLLM 0.33's PassConfig switches of the fusions that rewrite a graph with its compiled ops (quantisation, norm,
# rope, all-reduce): a torch.compile engine of the stage runs with each off.
COMPILE_FUSIONS = ("fuse_norm_quant", "fuse_act_quant", "fuse_attn_quant", "fuse_allreduce_rms",
                   "enable_qk_norm_rope_fusion", "fuse_rope_kvcache_cat_mla", "fuse_act_padding",
                   "fuse_mla_dual_rms_norm", "fuse_rope_kvcache", "fuse_qk_norm_rope_kvcache")
GRAPH_MODE = "FULL"
FALLBACK_MODE = "FULL_DECODE_ONLY"  # only if vLLM refuses FULL (said in the summary)
# Capture selects no step while the engine starts: the wanted steps are set once its start-up steps are counted.
NOTHING_YET = "1000000000-"
KV_CACHE_BYTES = 256 * 1024**2
PORT_BASE = 41000
CPU_BLOCK_SIZE = 32  # CPU_ATTN's pages (the --cpu dry run)


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
    if spec.compile:  # vLLM's fusions would put compiled ops (not carried) into the graph: off, as they are here
        compilation["pass_config"] = {name: False for name in COMPILE_FUSIONS}
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
        self.wrappers: dict = {}
        self.shares_by_check: list[int] = []  # the checker process's storages shared so far, after each check sent

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
        self.wrappers["forward"] = forward

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
        self.wrappers["graph_call"] = __call__

        execute_original = GPUModelRunner.execute_model

        @functools.wraps(execute_original)
        def execute_model(runner, scheduler_output, *args, **kwargs):
            if not probes.serving:
                return execute_original(runner, scheduler_output, *args, **kwargs)
            counts = getattr(probes.state, "_forward_counts", {})
            current = probes.current = {
                "index": len(probes.steps), "kvdbg_step": counts.get(probes.layers[0], 0), "rows": [],
                "graphs": [], "forward_calls": 0, "forward_in_replay": 0, "layer_hooks": 0, "graph_hooks": 0,
                "quiet_replays": 0}
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

    def inside_kvdbg(self, impl_cls) -> dict[str, bool]:
        """Whether kvdbg's wrappers call these probes (installed first), as a fault or a kernel would sit."""
        from vllm.compilation.cuda_graph import CUDAGraphWrapper

        return {"forward": getattr(impl_cls.forward, "_kvdbg_original", None) is self.wrappers.get("forward"),
                "graph_call": getattr(CUDAGraphWrapper.__call__, "_kvdbg_original", None)
                is self.wrappers.get("graph_call")}

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
        # A replay's hook: after_graph_replay, quiet_replayed for a step of a run told unwanted ahead (which
        # skips the graph call's questions and that hook: graph_hooks.quiet_replay), or ticket_replayed for a step
        # told on its shape's ticket (graph_hooks.ticket_replay), counted once when after_graph_replay calls it.
        counting("after_graph_replay", "graph_hooks")
        counting("quiet_replayed", "graph_hooks")
        within, ticketed = state.after_graph_replay, state.ticket_replayed
        inside = [False]

        def after_graph_replay(*args, **kwargs):
            inside[0] = True
            try:
                return within(*args, **kwargs)
            finally:
                inside[0] = False

        def ticket_replayed(*args, **kwargs):
            if probes.current is not None and not inside[0]:
                probes.current["graph_hooks"] += 1
            return ticketed(*args, **kwargs)

        state.after_graph_replay, state.ticket_replayed = after_graph_replay, ticket_replayed
        counting("quiet_replayed", "quiet_replays")
        from kvdbg.sentinel.remote import CheckerProcess

        submit = CheckerProcess.submit

        def counted_submit(remote, *args, **kwargs):
            try:
                return submit(remote, *args, **kwargs)
            finally:
                probes.shares_by_check.append(remote.shares)

        CheckerProcess.submit = counted_submit


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
    logging.getLogger("kvdbg").setLevel(logging.INFO)
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
        record["probes_inside_kvdbg"] = probes.inside_kvdbg(impl_cls)
        record["fault"] = probes.fault
        state = vllm_plugin._state
        if state is None or vllm_plugin.active_capturer() is None:
            raise RuntimeError("the kvdbg plugin is not active in the engine's process")
        if state.sentinel is not None and not cpu:  # its checks of staged steps in its checker process, once ready
            waited = time.monotonic()
            record["checker_process"] = state.sentinel.checker_ready(60.0)
            record["checker_wait_s"] = round(time.monotonic() - waited, 1)
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
        # Full graphs recorded twice (with kvdbg's copies and without) and a third time with kvdbg's staging in
        # them; the replays of the plain ones, of the staged ones, and the wanted steps staged inside the graph.
        record["graph_variants"] = {"recorded": len(getattr(state, "_graph_variants", {})),
                                    "plain_replays": getattr(state, "plain_replays", 0),
                                    "staged_recorded": len(getattr(state, "_staged_variants", {})),
                                    "staged_replays": getattr(state, "staged_replays", 0),
                                    "staged_in_graph": capturer.engine_time.in_graph,
                                    "staged_by_host": capturer.engine_time.staged - capturer.engine_time.in_graph}
        record["dropped"] = dict(capturer.dropped)
        record["failures"] = dict(capturer.failures)
        if state.sentinel is not None:
            remote = getattr(getattr(state.sentinel, "_deferred", None), "remote", None)
            if remote is not None:  # what its checks gave the checker process: kvdbg's buffers and layers, each once
                record["checker"] = {"shares": remote.shares, "layers_given": remote.defines,
                                     "shares_by_check": probes.shares_by_check}
            state.sentinel.close(state, 60)
            if remote is not None:  # where the staged steps were checked, their answers all read now
                record["checker"]["checks"] = dict(state.sentinel.sentinel.staged_checks)
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


# --------------------------------------------------------------------------- the parent


_PORTS = itertools.count()


def child(args, extra: list[str], log_name: str, timeout: float,
          env_extra: dict | None = None) -> tuple[int | None, float]:
    """This script in a child process; its output into logs/NAME.log. (exit code or None on timeout, seconds)

    Each child's vLLM looks for its free ports from a base of its own (``VLLM_PORT``): engines starting together
    never race for one port."""
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    env = dict(os.environ, VLLM_PORT=str(PORT_BASE + 100 * next(_PORTS)), **(env_extra or {}))
    cmd = [sys.executable, os.path.abspath(__file__), args.out, *extra] + (["--cpu"] if args.cpu else [])
    cmd += ["--deadline", str(args.deadline), "--judge-max", str(args.judge_max)]
    cmd += ["--allow-token-divergence"] if args.allow_token_divergence else []
    started = time.monotonic()
    with open(os.path.join(args.out, "logs", f"{log_name}.log"), "w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=max(1.0, timeout), env=env)
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
        # a torch.compile engine's passes name compiled ops at import: their stand-ins (stub_site/sitecustomize.py)
        env_extra = {"KVDBG_GPU_COMPILE_OPS": "1"} if spec.compile else None
        rc, took = child(args, extra, spec.name, min(args.engine_timeout, left), env_extra)
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
    """Run ``{name: (deps, fn, pool)}``, each task once its dependencies are done, ``jobs`` at a time per pool
    (engines and checks do not wait for each other's places)."""
    results, running = {}, {}
    remaining = dict(tasks)
    pools: dict[str, ThreadPoolExecutor] = {}
    try:
        while remaining or running:
            for name in [n for n, (deps, _, _) in remaining.items() if all(d in results for d in deps)]:
                deps, fn, pool = remaining.pop(name)
                if pool not in pools:
                    pools[pool] = ThreadPoolExecutor(max_workers=jobs)
                running[pools[pool].submit(fn)] = name
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
    finally:
        for pool in pools.values():
            pool.shutdown(wait=True)
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
    tasks = {s.name: ([], functools.partial(run_engine, args, s), "engines") for s in runs}
    tasks.update({name: (deps, functools.partial(run_check, args, what), "checks")
                  for name, (deps, what) in checks.items()})
    results = run_dag(tasks, args.jobs)
    summary = summarize(args, runs, checks, results, time.monotonic() - started)
    with open(os.path.join(args.out, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=1, default=str)
    print(compact(summary), flush=True)
    print(f"graph stage {'PASSED' if summary['passed'] else 'FAILED'}: {len(summary['problems'])} + "
          f"{summary['more_problems']} problem(s), {len(summary['warnings'])} warning(s), {summary['wall_s']} s; "
          f"all of it in {os.path.join(args.out, 'summary.json')}", flush=True)
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
    shown = 25
    return {"passed": not problems, "wall_s": round(wall, 1), "cpu_dry_run": bool(args.cpu), "engines": engines,
            "parts": parts, "problems": [p[:300] for p in problems[:shown]],
            "more_problems": max(0, len(problems) - shown), "warnings": [w[:300] for w in warnings[:shown]],
            "out": args.out}


def compact(summary: dict) -> str:
    """The summary as JSON with one line per engine, part, problem and warning (the whole of it in summary.json)."""
    def one(value) -> str:
        return json.dumps(value, default=str, separators=(",", ":"))

    lines = []
    for key, value in summary.items():
        if key in ("engines", "problems", "warnings") and value:
            inner = ",\n  ".join(one(v) for v in value)
            lines.append(f' "{key}": [\n  {inner}]')
        elif key == "parts" and value:
            inner = ",\n  ".join(f"{json.dumps(k)}: {one(v)}" for k, v in value.items())
            lines.append(f' "{key}": {{\n  {inner}}}')
        else:
            lines.append(f" {json.dumps(key)}: {one(value)}")
    return "{\n" + ",\n".join(lines) + "\n}"


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
