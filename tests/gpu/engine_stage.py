"""A whole vLLM 0.33 engine on a CUDA GPU with kvdbg's plugin on: serve, then replay every snapshot.

Run by tests/gpu/run_engine_stage.sh on the GPU machine (vLLM's Python files and small wheels carried, no vLLM
install, no network). Each engine is an in-process ``LLM`` (vLLM's V1 engine core in the process) in a process of
its own, on TRITON_ATTN (``--backend FLASHINFER``: vLLM's FLASHINFER with FlashInfer's JIT-built kernels, the
capture part only; run_engine_stage.sh with ``KVDBG_GPU_FLASHINFER=1`` puts FlashInfer's carried files on the
path). Two parts (``--parts``):

- **capture** (the default): tiny random models (tests/engine/tiny_model.py) -- ``plain`` (float16, GQA),
  ``sliding`` (float16, window 32) and ``softcap`` (a bfloat16 Gemma 2 whose attention logits are capped at 5:
  vLLM hands the cap to the kernel; vLLM refuses Gemma 2 in float16) -- serve the cases of the CPU engine stage
  with every step captured: prefill, chunked prefill mixed with decodes, decode, a prefix-cache hit, and for the
  sliding model a window past its pages. ``plain`` and ``sliding`` run in eager mode and FULL_DECODE_ONLY;
  ``softcap`` in FULL_DECODE_ONLY only, whose prefill and mixed steps run eagerly and decodes from graphs (one
  engine covers both paths with the cap). Every snapshot is replayed by kvdbg on the GPU and judged as the CPU
  stage judges: the captured output against the reference, the vllm column (vLLM's own TRITON_ATTN code, run by
  kvdbg) against the captured output, no error finding on a correct engine; under full graphs some snapshots
  must come from steps replayed from a graph. In each engine's first passing snapshot a wrong output is then
  planted (+0.5 on one request's last token, one head): ``kvdbg replay`` must fail that request and head alone.
- **sentinel** (tests/gpu/engine_sentinel.py): ``KVDBG_SENTINEL=1`` on the plain model: three faults in
  TRITON_ATTN (eager) each caught, captured and failed by ``kvdbg replay``; no fault (eager, and
  FULL_DECODE_ONLY with the graph steps checked): nothing written, every step checked.

The engines run one after the other; the replays of one engine's snapshots run in this process while the next
engine serves. ``--budget`` bounds the whole: an engine that would not finish in time is not started, replays
stop at the limit, and either is a failure naming what was left out.

What the harness stands in for (vLLM's compiled extension is not carried; nothing of kvdbg's is):
- the compiled modules, as empty modules (tests/gpu/stub_site): the attention path calls none of them;
- ``torch.ops._C.silu_and_mul``, ``gelu_and_mul`` and ``gelu_tanh_and_mul``, read by ``SiluAndMul.__init__`` and
  ``GeluAndMul.__init__`` (Gemma 2) even with ``custom_ops=["none"]`` (the forward then runs vLLM's own native
  torch path): plain torch;
- ``torch.ops._C_cache_ops.reshape_and_cache_flash`` (FLASHINFER's cache write; TRITON_ATTN writes with its
  own Triton kernel): plain torch;
- ``torch.ops._C.weak_ref_tensor`` (vLLM's CUDA-graph wrapper on a graph's outputs): a view, which keeps the
  outputs alive where vLLM's would not.
And it sets ``kernel_config.ir_op_priority`` to vLLM's native implementations, ``VLLM_USE_V2_MODEL_RUNNER=0``
(the V2 runner needs a compiled CUDA view of pinned host memory), ``VLLM_USE_FLASHINFER_SAMPLER=0`` (vLLM's own sampler, FlashInfer carried or not) and
``compilation_config.custom_ops=["none"]`` (vLLM's own torch-native RMSNorm, rotary embedding and activation).

Usage: python tests/gpu/engine_stage.py OUT [--parts capture,sentinel] [--models plain,sliding,softcap]
       [--modes eager,FULL_DECODE_ONLY] [--sentinel-runs faults,clean,clean_graphs] [--budget SECONDS]
Prints one JSON line per engine run (its logs in OUT/logs/) and a summary; exit 0 only when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.engine.tiny_model import TinyModel, write_model  # noqa: E402
from tests.gpu import engine_sentinel  # noqa: E402

MODELS = {
    "plain": TinyModel("plain", dtype="float16", num_layers=2, hidden_size=256, num_heads=4, num_kv_heads=2),
    "sliding": TinyModel("sliding", dtype="float16", sliding_window=32, seed=1),
    "softcap": TinyModel("softcap", dtype="bfloat16", seed=2, soft_cap=5.0),
}
# The modes each model runs in when --modes is not given.
MODEL_MODES = {"plain": ("eager", "FULL_DECODE_ONLY"), "sliding": ("eager", "FULL_DECODE_ONLY"),
               "softcap": ("FULL_DECODE_ONLY",)}
GRAPH_MODES = ("FULL_DECODE_ONLY", "FULL", "FULL_AND_PIECEWISE")
PARTS = ("capture", "sentinel")
# The attention backends an engine of the stage may run (the first is the default): FLASHINFER needs FlashInfer
# carried and on the path (run_engine_stage.sh with KVDBG_GPU_FLASHINFER=1), and has no sentinel part (its faults
# are TRITON_ATTN's, tests/gpu/triton_faults.py).
BACKENDS = ("TRITON_ATTN", "FLASHINFER")
BACKEND_ENV = "KVDBG_GPU_STAGE_BACKEND"
BLOCK_SIZE = 16
# vLLM's IR ops (RMSNorm, its fused-add form) dispatch to its compiled kernels first: its own native torch
# implementations instead (the same priority vLLM gives them when inductor compiles the model).
NATIVE_IR_OPS = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]}
# An engine run is not started unless this much of the budget is left (measured on an H200: 60-80 s a run).
RUN_ESTIMATE_S = 90
RECORD = "ENGINE-RECORD "


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


def cases_of(model: str) -> list[str]:
    """Every case but the window's, which only a windowed model has."""
    windowed = MODELS[model].sliding_window is not None
    return [case for case in CASES if case != "long_window" or windowed]


def build_llm(model_dir: str, mode: str, **overrides):
    """The stage's engine: its attention backend (TRITON_ATTN unless --backend), 16-token pages, 128 of them, in
    ``mode`` (eager or a CUDA-graph mode)."""
    from vllm import LLM

    compilation = {"custom_ops": ["none"], "mode": 0}
    kwargs = {}
    if mode == "eager":
        kwargs["enforce_eager"] = True
    else:
        compilation["cudagraph_mode"] = mode
        compilation["cudagraph_capture_sizes"] = [1, 2, 4, 8]
    settings = dict(model=model_dir, skip_tokenizer_init=True, block_size=BLOCK_SIZE, max_model_len=512,
                    max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=True,
                    num_gpu_blocks_override=128, seed=0, gpu_memory_utilization=0.2, attention_backend=backend(),
                    compilation_config=compilation, kernel_config={"ir_op_priority": NATIVE_IR_OPS}, **kwargs)
    settings.update(overrides)
    return LLM(**settings)


def engine_run(model_dir: str, model: str, mode: str, out: str) -> dict:
    from vllm import SamplingParams

    from kvdbg import vllm_plugin

    record = {"model": model, "mode": mode, "cases": {}, "problems": []}
    started = time.monotonic()
    llm = build_llm(model_dir, mode)
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
    for case in cases_of(model):
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


def backend() -> str:
    """The engines' attention backend: the stage's --backend, handed to its engine processes in the environment."""
    return os.environ.get(BACKEND_ENV, BACKENDS[0])


def planted_fault(path: str, device: str = "cuda") -> list[str]:
    """A wrong output planted in a passing snapshot (+0.5 on one request's last token, one query head, as a wrong
    kernel would write it) must fail ``kvdbg replay`` naming that request and head alone."""
    from kvdbg import api

    snap = api.load(path)
    index = len(snap.steps) - 1
    step = snap.steps[index]
    if step.output is None:
        return [f"planted fault: {os.path.basename(path)} holds no captured output"]
    starts = [int(x) for x in step.query_start_loc]
    request = min(1, len(starts) - 2)
    head = min(1, snap.meta.layer.num_heads - 1)
    output = step.output.clone()
    output[starts[request + 1] - 1, head] += 0.5
    step.output = output
    report = api.replay(snap, ["reference"], device=device)
    failing = sorted({(c.step, h.request, h.head) for c in report.comparisons
                      if (c.actual, c.expected) == ("captured", "reference") for h in c.failed})
    problems = []
    if failing != [(index, request, head)]:
        problems.append(f"planted fault at step {index} request {request} head {head}: replay named {failing}")
    if report.verdict.exit_code != 1:
        problems.append(f"planted fault: replay exit {report.verdict.exit_code}, not 1")
    return problems


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


def _trace() -> list[str]:
    return traceback.format_exc().strip().splitlines()[-40:]


def one_run(out: str, what: str, capture: bool = True) -> int:
    """One engine, in this process (vLLM's engine core and its distributed state are per process): ``MODEL:MODE``
    of the capture part, or ``sentinel:RUN``. Its record goes to stdout on one line."""
    kind, name = what.split(":")
    if capture and kind != "sentinel":
        os.environ["KVDBG_CAPTURE_DIR"] = os.path.join(out, "_start")
        os.environ["KVDBG_CAPTURE_MAX"] = "unlimited"
    else:
        os.environ.pop("KVDBG_CAPTURE_DIR", None)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: redirectable
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    model = "plain" if kind == "sentinel" else kind
    try:
        model_dir = write_model(MODELS[model], os.path.join(out, "models", model))
        if kind == "sentinel":
            record = engine_sentinel.engine_run(out, name, model_dir, build_llm)
        else:
            record = engine_run(model_dir, model, name, out)
    except Exception as exc:  # say where the engine stopped
        record = {"problems": [f"engine stopped: {exc!r}"[:400]], "trace": _trace()}
    record["run"] = what
    print(RECORD + json.dumps(record), flush=True)
    return 0


# --------------------------------------------------------------------------- the stage's process


@dataclass
class Run:
    """One engine process of the plan: ``one`` is its --one argument."""

    part: str
    one: str

    @property
    def name(self) -> str:
        return self.one.replace(":", "-")

    @property
    def judged_beside_an_engine(self) -> bool:
        """Whether its judgement may run while the next engine starts. Not the sentinel's faults: their replays are
        processes of their own, whose exit frees GPU memory, and vLLM stops an engine whose profiling sees memory
        freed meanwhile (it measures the device's free memory)."""
        return self.one != "sentinel:faults"


def plan(parts: list[str], models: list[str], modes: list[str] | None, sentinel_runs: list[str]) -> list[Run]:
    """The engine runs, in order: the capture part's models in their modes, then the sentinel's runs."""
    runs = []
    if "capture" in parts:
        for model in models:
            runs += [Run("capture", f"{model}:{mode}") for mode in (modes or MODEL_MODES[model])]
    if "sentinel" in parts:
        runs += [Run("sentinel", f"sentinel:{name}") for name in sentinel_runs]
    return runs


def _names(text: str, known, what: str) -> list[str]:
    names = [n for n in (s.strip() for s in text.split(",")) if n]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{what}: unknown {unknown or text!r}; known: {', '.join(known)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--parts", default="capture", help=f"comma-separated, of {','.join(PARTS)} [capture]")
    parser.add_argument("--models", default="plain,sliding,softcap", help="the capture part's models")
    parser.add_argument("--modes", default=None, help="the capture part's modes for every model [each model's own: "
                        + "; ".join(f"{m} {','.join(v)}" for m, v in MODEL_MODES.items()) + "]")
    parser.add_argument("--sentinel-runs", default=",".join(engine_sentinel.RUNS),
                        help=f"the sentinel part's runs, of {','.join(engine_sentinel.RUNS)}")
    parser.add_argument("--one", help="MODEL:MODE or sentinel:RUN, run in this process (the stage's child)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for one engine run")
    parser.add_argument("--budget", type=float, default=510,
                        help="seconds for the whole stage (its engines and replays; the setup before is not in it)")
    parser.add_argument("--without-kvdbg", action="store_true", help="the engines alone (plugin not switched on)")
    parser.add_argument("--backend", default=BACKENDS[0], help=f"the engines' attention backend, of "
                                                               f"{','.join(BACKENDS)} [{BACKENDS[0]}]")
    args = parser.parse_args(argv)
    if args.backend not in BACKENDS:
        raise SystemExit(f"--backend: unknown {args.backend!r} (known: {', '.join(BACKENDS)})")
    if args.backend != BACKENDS[0] and "sentinel" in args.parts.split(","):
        raise SystemExit(f"--backend {args.backend}: the sentinel part's faults are TRITON_ATTN's; run --parts "
                         "capture")
    args.parts = _names(args.parts, PARTS, "--parts")
    args.models = _names(args.models, MODELS, "--models")
    args.modes = _names(args.modes, ("eager",) + GRAPH_MODES, "--modes") if args.modes else None
    args.sentinel_runs = _names(args.sentinel_runs, engine_sentinel.RUNS, "--sentinel-runs")
    if args.without_kvdbg and "sentinel" in args.parts:
        raise SystemExit("--without-kvdbg runs the capture part's engines alone; leave out --parts sentinel")
    return args


class Stage:
    """The plan's engines one at a time, each judged while the next one serves, within one time budget."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.started = time.monotonic()
        self.deadline = self.started + args.budget
        # The engines' environment is this one as it starts: the replays here import vLLM's backends, which quiet
        # vLLM's logging in this process's environment (VLLM_CONFIGURE_LOGGING=0), and with it the plugin's lines.
        self.env = {**os.environ, BACKEND_ENV: args.backend}
        self.logs = os.path.join(args.out, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.summary = {"backend": args.backend, "runs": [], "snapshots": 0, "passed": 0, "from_graphs": {},
                        "planted": {}, "sentinel": {},
                        "not_run": [], "problems": []}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def launch(self, run: Run) -> subprocess.Popen:
        command = [sys.executable, os.path.abspath(__file__), self.args.out, "--one", run.one]
        if self.args.without_kvdbg:
            command.append("--without-kvdbg")
        with open(os.path.join(self.logs, f"{run.name}.out"), "w") as stdout, \
                open(os.path.join(self.logs, f"{run.name}.err"), "w") as stderr:
            return subprocess.Popen(command, stdout=stdout, stderr=stderr, env=self.env, start_new_session=True)

    def wait(self, run: Run, proc: subprocess.Popen, started: float) -> tuple[dict, str]:
        """The engine's record and its whole log (stdout, then stderr)."""
        limit = max(1.0, min(self.args.timeout - (time.monotonic() - started), self.left()))
        try:
            proc.wait(timeout=limit)
            problems = []
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine and any child it started
            except OSError:
                proc.kill()
            proc.wait()
            problems = [f"engine run stopped after {time.monotonic() - started:.0f} s (its time or the stage's "
                        "budget ran out)"]
        with open(os.path.join(self.logs, f"{run.name}.out")) as f:
            out = f.read()
        with open(os.path.join(self.logs, f"{run.name}.err")) as f:
            err = f.read()
        lines = [ln for ln in out.splitlines() if ln.startswith(RECORD)]
        if lines:
            record = json.loads(lines[-1][len(RECORD):])
        else:
            record = {"problems": [] if problems else [f"engine process exit {proc.returncode}, no record"],
                      "trace": err.strip().splitlines()[-40:]}
        record["run"] = run.one
        record["problems"] = problems + record.get("problems", [])
        record["wall_s"] = round(time.monotonic() - started, 1)
        record["kvdbg_log"] = [ln for ln in err.splitlines() if "kvdbg" in ln][-12:]
        return record, out + err

    def judge_capture(self, run: Run, record: dict) -> None:
        model, mode = run.one.split(":")
        name = f"{model}/{mode}"
        left_out = 0
        for case, info in record.get("cases", {}).items():
            files = sorted(f for f in os.listdir(info["dir"]) if f.endswith(".safetensors")) \
                if os.path.isdir(info["dir"]) else []
            for file in files:
                if self.left() <= 0:
                    left_out += 1
                    continue
                path = os.path.join(info["dir"], file)
                self.summary["snapshots"] += 1
                try:
                    if from_graph(path):
                        self.summary["from_graphs"][name] = self.summary["from_graphs"].get(name, 0) + 1
                    problems = judge(path)
                except Exception as exc:
                    problems = [f"replay raised {exc!r}"[:300] + " | " + " / ".join(_trace()[-3:])]
                if problems:
                    self.summary["problems"] += [f"{name}/{case}/{file}: {p}" for p in problems]
                    continue
                self.summary["passed"] += 1
                if name not in self.summary["planted"]:  # one per engine: a wrong output must fail where it is
                    try:
                        planted = planted_fault(path)
                    except Exception as exc:
                        planted = [f"planted fault: replay raised {exc!r}"[:300]]
                    self.summary["planted"][name] = "FAIL where planted" if not planted else "; ".join(planted)
                    self.summary["problems"] += [f"{name}/{case}/{file}: {p}" for p in planted]
        if left_out:
            self.summary["problems"].append(f"{name}: {left_out} snapshot(s) not replayed within the budget")
        # Under full CUDA graphs decode steps are replayed from graphs: some of each such run's snapshots must be.
        if mode in GRAPH_MODES and not self.args.without_kvdbg and not record["problems"] \
                and not self.summary["from_graphs"].get(name):
            self.summary["problems"].append(f"{name}: no snapshot was captured from a step replayed as a CUDA graph")

    def judge_sentinel(self, run: Run, record: dict, text: str) -> None:
        name = run.one.split(":")[1]
        try:
            problems, line = engine_sentinel.judge(name, record, text, replay_seconds=max(30.0, self.left()))
        except Exception as exc:
            problems, line = [f"sentinel {name}: judging raised {exc!r}"[:300] + " | " + " / ".join(_trace()[-3:])], ""
        self.summary["sentinel"][name] = line
        self.summary["problems"] += problems

    def judge(self, run: Run, record: dict, text: str) -> None:
        print(json.dumps(record), flush=True)
        self.summary["runs"].append({k: record.get(k) for k in ("run", "startup_s", "wall_s")})
        self.summary["problems"] += [f"{run.one}: {p}" for p in record["problems"]]
        try:
            if run.part == "sentinel":
                self.judge_sentinel(run, record, text)
            else:
                self.judge_capture(run, record)
        except Exception as exc:  # the next engines still run
            self.summary["problems"].append(f"{run.one}: judging raised {exc!r}"[:300] + " | "
                                            + " / ".join(_trace()[-3:]))

    def run(self, runs: list[Run]) -> int:
        waiting = None  # the last engine's (run, record, log), judged while the next one serves
        for run in runs:
            if waiting is not None and not waiting[0].judged_beside_an_engine:
                self.judge(*waiting)
                waiting = None
            if self.left() < RUN_ESTIMATE_S:
                self.summary["not_run"].append(run.one)
                continue
            started = time.monotonic()
            proc = self.launch(run)
            if waiting is not None:
                self.judge(*waiting)
            waiting = (run, *self.wait(run, proc, started))
        if waiting is not None:
            self.judge(*waiting)
        if self.summary["not_run"]:
            self.summary["problems"].append(f"not run within the {self.args.budget:.0f} s budget: "
                                            f"{', '.join(self.summary['not_run'])} (run them with --parts/--models)")
        if "capture" in self.args.parts and not self.args.without_kvdbg and not self.summary["snapshots"]:
            self.summary["problems"].append("the capture part replayed no snapshot")
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 1)
        self.summary["passed_all"] = not self.summary["problems"]
        print(json.dumps(self.summary, indent=1), flush=True)
        return 0 if self.summary["passed_all"] else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        return one_run(args.out, args.one, capture=not args.without_kvdbg)
    stage = Stage(args)
    try:
        return stage.run(plan(args.parts, args.models, args.modes, args.sentinel_runs))
    except Exception as exc:  # the summary still comes out
        stage.summary["problems"].append(f"the stage stopped: {exc!r}"[:300] + " | " + " / ".join(_trace()[-3:]))
        print(json.dumps(stage.summary, indent=1), flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
