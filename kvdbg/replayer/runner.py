"""The replay core: derive each step's CommonMetadata, apply the step's cache update, run every backend."""

from __future__ import annotations

import re
import time
import traceback
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from kvdbg.backends.base import BackendSpec, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.backends import DEFAULT_ORDER, backend_names, get_backend
from kvdbg.snapshot.cache import apply_step_update, replay_cache
from kvdbg.snapshot.layout import holds_fp8, read_value_magnitudes, stored_index
from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.snapshot.format import OUTPUTS_KEY
from kvdbg.snapshot.pagemap import live_page_values, value_anomalies
from kvdbg.judge.verdict import counted_backends

if TYPE_CHECKING:
    from kvdbg.judge.compare import Comparison
    from kvdbg.snapshot.format import SnapshotMeta
    from kvdbg.snapshot.store import Snapshot
    from kvdbg.judge.verdict import Verdict


@dataclass
class BackendRun:
    """One backend on one step: what ran, what it wrote, what it found."""

    backend: str
    engine_name: str
    step: int
    info: RunInfo | None = None
    output: torch.Tensor | None = None  # [num_tokens, Hq, D]; NaN where the backend wrote nothing
    written: torch.Tensor | None = None  # [num_tokens] bool, tokens the backend wrote; None: every token
    not_applicable: str | None = None  # why the backend's builder would not run this step (not compared)
    findings: list[Finding] = field(default_factory=list)
    explain: list[dict[str, Any]] = field(default_factory=list)
    build_s: float = 0.0
    forward_s: float = 0.0
    error: str | None = None  # the backend raised while building or running (reported as a finding too)


@dataclass
class StepReplay:
    step: int
    common: CommonMetadata
    runs: dict[str, BackendRun]  # in the order the backends were asked for
    captured_output: torch.Tensor | None  # the engine's own output, if the snapshot has one
    findings: list[Finding] = field(default_factory=list)  # about the inputs themselves, before any backend
    # The step's query is FP8 (the engine ran P·V on FP8 operands): the extra atol every comparison of the step
    # allows for the kernel's e4m3 rounding of P (kvdbg.judge.compare.fp8_query_allowance). None: not FP8.
    fp8_query_allowance: float | None = None


@dataclass
class BackendStatus:
    """Whether a backend could be set up for this snapshot, and if not, why."""

    name: str
    engine_name: str | None
    available: bool
    reason: str | None = None
    info: RunInfo | None = None
    # An unavailable backend whose real kernel refuses the snapshot: that refusal, as findings (judged as
    # any other finding of this backend: they fail a replay of a snapshot captured from it).
    findings: list[Finding] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "engine_name": self.engine_name, "available": self.available,
                "reason": self.reason, "run": self.info.to_json() if self.info else None}


@dataclass
class ReplayResult:
    path: str | None
    meta: "SnapshotMeta"
    options: ReplayOptions
    backends: list[BackendStatus]
    steps: list[StepReplay]

    named: tuple[str, ...] = ()  # backends the user asked for by name (--backend): always judged

    @property
    def counted(self) -> frozenset[str]:
        """The sources whose results set the exit code: kvdbg.judge.verdict's rule."""
        return counted_backends(self.meta.backend.name, [(st.name, st.engine_name) for st in self.backends],
                                self.named)

    @property
    def findings(self) -> list[Finding]:
        return [f for st in self.backends for f in st.findings] + \
            [f for s in self.steps for f in s.findings] + \
            [f for s in self.steps for run in s.runs.values() for f in run.findings]

    def judge(self, *, atol: float | None = None, rtol: float | None = None, requests: list[int] | None = None,
              heads: list[int] | None = None) -> "ReplayReport":
        """Compare every output with its expectation and keep the findings in scope: the judged replay.

        ``requests`` narrows the findings as it narrows the comparisons (a finding about no one request
        stays); ``heads`` narrows the comparisons only, since findings concern whole requests.
        """
        from kvdbg.judge.compare import compare_step

        comparisons = [c for s in self.steps
                       for c in compare_step(s, self.meta, atol=atol, rtol=rtol, requests=requests, heads=heads)]
        findings = [f for f in self.findings if requests is None or f.request is None or f.request in requests]
        return ReplayReport(self, comparisons, findings, requests)

    def query_starts(self) -> dict[int, list[int]]:
        """step -> query_start_loc, to turn a batch-wide token row into the request's own index."""
        return {s.step: [int(x) for x in s.common.query_start_loc.tolist()] for s in self.steps}

    def to_json(self, *, explain: bool = False) -> dict[str, Any]:
        """What ran: the snapshot, each backend's status and run, each step's runs (and decisions)."""
        steps = []
        for step in self.steps:
            record: dict[str, Any] = {
                "step": step.step,
                "num_reqs": step.common.num_reqs,
                "num_tokens": step.common.num_actual_tokens,
                "has_captured_output": step.captured_output is not None,
                "runs": {name: {"build_s": run.build_s, "forward_s": run.forward_s, "error": run.error,
                                "not_applicable": run.not_applicable}
                         for name, run in step.runs.items()},
            }
            if explain:
                record["explain"] = {name: run.explain for name, run in step.runs.items() if run.explain}
            steps.append(record)
        return {"snapshot": self.path, "backends": [st.to_json() for st in self.backends], "steps": steps}


@dataclass
class ReplayReport:
    """A replay judged: what ran, the comparisons and the findings in scope, and the one verdict.

    `kvdbg replay` (its tables and --json) and `kvdbg report` all read :attr:`verdict`.
    """

    result: ReplayResult
    comparisons: list["Comparison"]
    findings: list[Finding]  # in scope: --request narrows them as it narrows the comparisons
    requests: list[int] | None = None  # the requests compared (None: all)

    @cached_property
    def verdict(self) -> "Verdict":
        """Pass, fail or unverified, and the exit code: kvdbg.judge.verdict's rule over what counts."""
        from kvdbg.judge.verdict import replay_verdict

        return replay_verdict(self.comparisons, self.findings, self.result.counted)

    @property
    def passed(self) -> bool:
        return self.verdict.passed

    def to_json(self, *, explain: bool = False) -> dict[str, Any]:
        """The replay as JSON; "verdict" is the last key, as the verdict line is the last line of the tables."""
        ran = self.result.to_json(explain=explain)
        starts = self.result.query_starts()
        comparisons = []
        for c in self.comparisons:
            record = c.to_json()
            first = starts.get(c.step)
            for head in record["heads"]:
                if first is not None and head["request"] < len(first):
                    head["worst_token_in_request"] = head["worst_token"] - first[head["request"]]
            comparisons.append(record)
        return {
            "snapshot": ran["snapshot"],
            "passed": self.passed,
            "backends": ran["backends"],
            "findings": [f.to_json() for f in self.findings],
            "steps": ran["steps"],
            "comparisons": comparisons,
            "rule": "|a - e| <= atol + rtol*|e|",
            "verdict": self.verdict.to_json(),
        }


def resolve_device(device: str) -> str:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` → a device torch can use here; a one-line reason otherwise."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise OptionError(f"--device must be cpu, cuda, cuda:N or auto, got {device!r}")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            built = ("this torch build has no CUDA support" if torch.version.cuda is None
                     else "no CUDA device is visible")
            raise BackendUnavailable(f"--device {device}: {built} (torch {torch.__version__})")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise OptionError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible "
                              f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
    return device


def common_metadata(snapshot: "Snapshot", step: int, device: str = "cpu") -> CommonMetadata:
    """Engine-level metadata of one step, on ``device``, shared by every backend's builder."""
    if not 0 <= step < len(snapshot.steps):
        raise OptionError(f"--step {step} is out of range: the snapshot has {len(snapshot.steps)} step(s)")
    s = snapshot.steps[step]
    seq_lens = s.seq_lens.to(torch.int64)
    qsl = s.query_start_loc.to(torch.int64)
    qlens = qsl[1:] - qsl[:-1]
    new_key = new_value = new_slots = None
    if s.key is not None and s.value is not None and s.slot_mapping is not None:
        slots = s.slot_mapping.to(torch.int64)
        stored = stored_index(snapshot.page_ids, slots.clamp_min(0) // snapshot.page_size)
        written = (slots >= 0) & (stored >= 0)
        new_slots = torch.where(written, stored * snapshot.page_size + slots % snapshot.page_size,
                                torch.full_like(slots, -1)).to(device)
        new_key, new_value = s.key.to(device), s.value.to(device)
    return CommonMetadata(
        block_table=snapshot.stored_block_table(step).to(device),
        block_table_engine=s.block_table.to(torch.int64).to(device),
        seq_lens=seq_lens.to(device),
        query_start_loc=qsl.to(device),
        num_reqs=s.num_reqs,
        num_actual_tokens=s.num_tokens,
        max_query_len=int(qlens.max()) if len(qlens) else 0,
        max_seq_len=int(seq_lens.max()) if len(seq_lens) else 0,
        causal=snapshot.meta.layer.causal,
        sliding_window=snapshot.meta.layer.sliding_window,
        page_size=snapshot.page_size,
        num_pages=snapshot.num_pages,
        null_page=snapshot.null_page_index(),
        step=step,
        has_engine_output=s.output is not None,
        new_key=new_key,
        new_value=new_value,
        new_slots=new_slots,
        sinks=None if snapshot.sinks is None else snapshot.sinks.to(device),
        alibi_slopes=None if snapshot.alibi_slopes is None else snapshot.alibi_slopes.to(device),
    )


def input_findings(snapshot: "Snapshot", step: int, cache: torch.Tensor) -> list[Finding]:
    """NaN/Inf and all-zero live pages of the cache the step's backends are about to read."""
    return value_anomalies(live_page_values(snapshot, step, cache), backend="replay", step=step)


# --------------------------------------------------------------------------- backends


def load_backends(names: Iterable[str], meta: "SnapshotMeta", options: ReplayOptions,
                  *, required: Iterable[str] = ()) -> tuple[list[BackendStatus], dict[str, Any], dict[str, BackendSpec]]:
    """Import and create each backend. One that cannot run becomes an unavailable status with the reason.

    Unknown names raise OptionError. A backend in ``required`` (asked for by name) that is unavailable
    raises BackendUnavailable instead: the user asked for it, so nothing is shown without it. So does the
    reference, whatever was asked: nothing can be judged without it.
    """
    names = list(dict.fromkeys(names))
    valid = backend_names()
    for name in names:
        if name not in valid:
            raise OptionError(f"unknown backend {name!r}; choose from: {', '.join(valid)}")
    required = set(required)
    statuses, instances, specs = [], {}, {}
    for name in names:
        try:
            spec = get_backend(name)
        except Exception as exc:  # a missing or broken optional module must not take the replay down
            reason = f"kvdbg.backends.{name} cannot be imported: {type(exc).__name__}: {_first_line(exc)}"
            statuses.append(BackendStatus(name, None, False, reason))
            continue
        reason = spec.unsupported_reason(meta, options.device)
        if reason is None:
            try:
                inst = spec.create(meta, options)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {_first_line(exc)}" if not isinstance(exc, BackendUnavailable) \
                    else _first_line(exc)
            else:
                instances[name], specs[name] = inst, spec
                statuses.append(BackendStatus(name, spec.engine_name_for(meta), True, None, inst.describe()))
                continue
        statuses.append(BackendStatus(name, spec.engine_name_for(meta), False, reason,
                                      findings=list(spec.kernel_refusals(meta))))
    for st in statuses:
        # Without the reference nothing can be judged: a layer feature it cannot model is refused, never ignored.
        if not st.available and (st.name in required or st.name == "reference"):
            raise BackendUnavailable(f"backend {st.name} cannot run: {st.reason}")
    return statuses, instances, specs


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


def run_backend(name: str, spec: BackendSpec, inst: Any, common: CommonMetadata, query: torch.Tensor,
                cache: torch.Tensor, output_dtype: torch.dtype, *, propagate: bool = False) -> BackendRun:
    """builder.build → impl.forward into a NaN-filled output → findings → explain, timed."""
    num_tokens = query.shape[0]
    meta_layer = getattr(getattr(inst, "meta", None), "layer", None)
    hq = query.shape[1]
    d = meta_layer.head_size if meta_layer is not None else query.shape[2]
    dtype = getattr(inst, "output_dtype", None) or output_dtype
    engine_name = spec.engine_name_for(inst.meta) if hasattr(inst, "meta") else spec.engine_name
    run = BackendRun(backend=name, engine_name=engine_name, step=common.step, info=inst.describe())
    output = torch.full((num_tokens, hq, d), float("nan"), dtype=dtype, device=query.device)
    try:
        t0 = time.perf_counter()
        md = inst.builder.build(common)
        _sync(query.device)
        t1 = time.perf_counter()
        inst.impl.forward(query, cache, md, output)
        _sync(query.device)
        t2 = time.perf_counter()
    except Exception as exc:
        if propagate:
            raise
        run.error = f"{type(exc).__name__}: {_first_line(exc)}"
        run.findings.append(Finding(backend=name, code="backend_raised", step=common.step,
                                    message=f"{name} raised while replaying step {common.step}: {run.error}",
                                    details={"traceback": traceback.format_exc(limit=6)}))
        return run
    run.build_s, run.forward_s = t1 - t0, t2 - t1
    run.output = output
    run.info = inst.describe()  # a backend may refine what it reports once it has run
    not_applicable_fn = getattr(inst, "not_applicable", None)
    if not_applicable_fn is not None:
        run.not_applicable = not_applicable_fn(common, md)
    written_fn = getattr(inst, "written_tokens", None)
    if written_fn is not None:
        run.written = written_fn(common, md)
    findings_fn = getattr(inst, "findings", None)
    if findings_fn is not None:
        run.findings.extend(findings_fn(common, md))
    explain_fn = getattr(inst, "explain", None)
    if explain_fn is not None:
        run.explain = list(explain_fn(common, md))
    return run


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class ReplaySetup:
    """What a replay of one snapshot starts from (replay, poison): checked options, the backends
    loaded, the steps wanted, and the cache at step 0 (see :func:`kvdbg.snapshot.cache.replay_cache`)."""

    options: ReplayOptions  # device resolved
    names: list[str]
    steps: list[int]  # sorted, each checked against the snapshot
    statuses: list[BackendStatus]
    instances: dict[str, Any]
    specs: dict[str, BackendSpec]
    model_dtype: torch.dtype
    cache: torch.Tensor
    named: tuple[str, ...] = ()  # backends asked for by name (required)


# Provenance (meta.capture) entries that change what a backend runs: CPU_ATTN's kernel variant and the
# engine's resolved KVCacheLayout, both followed by the vllm column (kvdbg.backends.vllm_native).
PROVENANCE_READ = ("kernel_variant", "kv_cache_layout")


def backend_key(meta: "SnapshotMeta") -> tuple:
    """What a backend instance is made from: the layer, the engine's backend settings, the cache layout, and
    the provenance entries a backend follows (``PROVENANCE_READ``: the vllm column runs the kernel variant and
    the cache layout the engine used).

    Backends read nothing else of the metadata (not the rest of the provenance,
    notes or step count), so snapshots equal in these can share instances.
    """
    capture = meta.capture if isinstance(meta.capture, dict) else {}
    return (meta.layer, meta.backend, meta.kv_layout, tuple(str(capture.get(k)) for k in PROVENANCE_READ))


class ReplayContext:
    """The checked options and backend names of many replays, and the backends made for them.

    Backends are created once per :func:`backend_key` and reused, as vLLM
    reuses one builder per layer for every step: plans and persistent buffers
    carry over between replays exactly as between the steps of one replay.
    `kvdbg shrink` replays every candidate through one context, so only a pass
    that changes the layer (the head pass) creates backends again.
    """

    def __init__(self, backends: Iterable[str] | None = None, options: ReplayOptions | None = None, *,
                 required: Iterable[str] = ()):
        self.options = options or ReplayOptions()
        self.options.device = resolve_device(self.options.device)
        self.names = list(dict.fromkeys(backends if backends is not None else DEFAULT_ORDER))
        if not self.names:
            raise OptionError("--backend: give at least one backend")
        self.required = tuple(dict.fromkeys(required))
        self._loaded: dict[tuple, tuple[list[BackendStatus], dict[str, Any], dict[str, BackendSpec]]] = {}

    def backends(self, meta: "SnapshotMeta") -> tuple[list[BackendStatus], dict[str, Any], dict[str, BackendSpec]]:
        """The backends for ``meta``'s layer: created on first use, afterwards reset and reused."""
        key = backend_key(meta)
        if key in self._loaded:
            statuses, instances, specs = self._loaded[key]
            for inst in instances.values():
                # What the last replay left on an instance (views of its cache, counters its describe()
                # reports) must not show in this one; plans and buffers stay.
                reset = getattr(inst, "reset", None)
                if reset is not None:
                    reset()
        else:
            statuses, instances, specs = load_backends(self.names, meta, self.options, required=self.required)
            self._loaded[key] = statuses, instances, specs
        # A replay records each backend's last RunInfo on its status: each replay gets statuses of its own.
        return [replace(st) for st in statuses], instances, specs

    def setup(self, snapshot: "Snapshot", steps: Iterable[int] | None = None, *,
              private_cache: bool = True) -> ReplaySetup:
        """Check the steps, load (or reuse) the backends, open the cache; ``private_cache`` for a caller that
        writes into it (poison): otherwise it is private only when a step's update writes."""
        num_steps = len(snapshot.steps)
        wanted = sorted(set(range(num_steps) if steps is None else steps))
        for s in wanted:
            if not 0 <= s < num_steps:
                raise OptionError(f"--step {s} is out of range: the snapshot has {num_steps} step(s)")
        statuses, instances, specs = self.backends(snapshot.meta)
        cache = replay_cache(snapshot, self.options.device, range(wanted[-1] + 1 if wanted else 0),
                             private=private_cache)
        return ReplaySetup(self.options, self.names, wanted, statuses, instances, specs,
                           getattr(torch, snapshot.meta.layer.dtype), cache, self.required)


def prepare_replay(snapshot: "Snapshot", backends: Iterable[str] | None = None,
                   options: ReplayOptions | None = None, *, steps: Iterable[int] | None = None,
                   required: Iterable[str] = (), private_cache: bool = True) -> ReplaySetup:
    """Resolve the device, check the backends and steps, load the backends, open the cache."""
    context = ReplayContext(backends, options, required=required)
    return context.setup(snapshot, steps, private_cache=private_cache)


def replay(snapshot: "Snapshot", backends: Iterable[str] | None = None, options: ReplayOptions | None = None, *,
           steps: Iterable[int] | None = None, required: Iterable[str] = (),
           progress: Callable[[str], None] | None = None) -> ReplayResult:
    """Replay ``snapshot`` through ``backends`` (default: reference, flex, flashinfer_ts, vllm).

    Every step's update is applied in order to a private working cache (opened
    only when a step has one: backends only read), so the ``steps`` chosen are
    replayed against the cache state the engine had then; the caller's
    ``snapshot`` is never modified. The reference always raises when it
    fails (nothing can be compared without it); another backend's failure becomes a
    ``backend_raised`` error finding on its column.
    """
    setup = prepare_replay(snapshot, backends, options, steps=steps, required=required, private_cache=False)
    return run_replay(snapshot, setup, progress=progress)


def run_replay(snapshot: "Snapshot", setup: ReplaySetup, *, progress: Callable[[str], None] | None = None,
               check_inputs: bool = True) -> ReplayResult:
    """Run a prepared replay (see :func:`replay`); ``setup.cache`` receives the steps' updates.

    ``check_inputs`` scans each step's live pages for NaN/Inf and all-zero
    pages (the step's own findings); a caller that judges only the backends'
    outputs and findings (shrink) skips the scan.
    """
    options, device, names, wanted = setup.options, setup.options.device, setup.names, setup.steps
    statuses, instances, specs = setup.statuses, setup.instances, setup.specs
    model_dtype, cache = setup.model_dtype, setup.cache
    results = []
    last = wanted[-1] if wanted else -1
    for step in range(last + 1):
        apply_step_update(snapshot, cache, step)
        if step not in wanted:
            continue
        common = common_metadata(snapshot, step, device)
        found = input_findings(snapshot, step, cache) if check_inputs else []
        query = snapshot.steps[step].query.to(device)
        runs = {}
        for name in names:
            if name not in instances:
                continue
            if progress:
                progress(f"step {step}: {name}")
            runs[name] = run_backend(name, specs[name], instances[name], common, query, cache, model_dtype,
                                     propagate=(name == "reference"))
        found += two_flashinfers(statuses, runs, common)
        captured = snapshot.steps[step].output
        results.append(StepReplay(step=step, common=common, runs=runs,
                                  captured_output=None if captured is None else captured.to(device),
                                  findings=found, fp8_query_allowance=step_fp8_query_allowance(
                                      snapshot, step, cache, common)))
    for st in statuses:  # report what the backends say after running (e.g. compiled or not), on every step
        if st.available:
            ran = [(s.step, s.runs[st.name].info) for s in results
                   if st.name in s.runs and s.runs[st.name].info is not None]
            if ran:
                st.info = steps_run_info(ran)
    return ReplayResult(path=snapshot.path, meta=snapshot.meta, options=options, backends=statuses, steps=results,
                        named=setup.named)


def two_flashinfers(statuses, runs: dict, common: CommonMetadata) -> list[Finding]:
    """Where the vllm column ran vLLM's FLASHINFER (FlashInfer's paged kernels) and the flashinfer_ts column ran
    the prims_ts emulation on the same step: their difference over the decode requests both wrote, said as what it
    is (finding two_flashinfers: two kernels of one attention)."""
    real, emulated = runs.get("vllm"), runs.get("flashinfer_ts")
    engine = next((st.engine_name for st in statuses if st.name == "vllm"), None)
    if engine != "FLASHINFER" or real is None or emulated is None or real.output is None or emulated.output is None:
        return []
    starts = common.query_start_loc.tolist()
    wrote = [run.written.tolist() if run.written is not None else None for run in (real, emulated)]
    decodes = [r for r in range(len(starts) - 1) if starts[r + 1] - starts[r] == 1
               and all(w is None or w[starts[r]] for w in wrote)]  # rows a column left unwritten are no rounding
    if not decodes:
        return []
    rows = torch.tensor([starts[r] for r in decodes], device=real.output.device)
    diff = (real.output[rows].float() - emulated.output[rows].float()).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    if worst != worst:
        return []  # a NaN: each column's own comparison with the reference says so
    return [Finding(code="two_flashinfers", backend="vllm", step=common.step, requests=decodes,
                    message=(f"FlashInfer's paged decode kernel (vllm: vLLM's FLASHINFER) and the FLASHINFER_TS "
                             f"emulation (flashinfer_ts) differ by at most {worst:.1e} over {len(decodes)} decode "
                             "request(s): two kernels of one attention, each held to the reference on its own"),
                    details={"max_abs": worst, "requests": decodes})]


def step_fp8_query_allowance(snapshot: "Snapshot", step: int, cache: torch.Tensor,
                             common: CommonMetadata) -> float | None:
    """The extra atol of a step whose query is FP8, from the values its requests read; None otherwise."""
    from kvdbg.judge.compare import fp8_query_allowance

    if not snapshot.meta.layer.is_fp8 or not holds_fp8(snapshot.steps[step].query):
        return None
    qsl = common.query_start_loc
    magnitudes, keys = read_value_magnitudes(snapshot.meta, cache, common.block_table, common.seq_lens,
                                             qsl[1:] - qsl[:-1])
    return fp8_query_allowance(magnitudes, keys)


def steps_run_info(ran: list[tuple[int, RunInfo]]) -> RunInfo:
    """One backend's RunInfo over the steps it ran (``(step, info)`` in order): the steps' own where they agree.

    A backend may choose its kernel per step (an emulation by batch size, flex compiled or eager by size):
    then the kernel names each one with its steps, ``emulated`` holds when any step was emulated and
    ``compiled`` only when every step was compiled, and a note that not every step has says which steps.
    """
    infos = [info for _, info in ran]
    last = infos[-1]
    if all(info == last for info in infos):
        return last
    by_kernel: dict[str, list[int]] = {}
    for step, info in ran:
        by_kernel.setdefault(info.kernel, []).append(step)
    kernel = last.kernel if len(by_kernel) == 1 else "; ".join(
        f"{name} ({_steps_text(steps)})" for name, steps in by_kernel.items())
    by_note: dict[str, list[int]] = {}
    for step, info in ran:
        for note in info.notes:
            by_note.setdefault(note, []).append(step)
    notes = [note if len(steps) == len(ran) else f"{_steps_text(steps)}: {note}" for note, steps in by_note.items()]

    def joined(values: list[str]) -> str:
        return "/".join(dict.fromkeys(values))

    return replace(last, kernel=kernel, device=joined([i.device for i in infos]),
                   dtype=joined([i.dtype for i in infos]), emulated=any(i.emulated for i in infos),
                   compiled=all(i.compiled for i in infos), notes=notes)


def _steps_text(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else "steps " + ", ".join(map(str, steps))


def save_outputs(result: ReplayResult, path: str, *, overwrite: bool = False) -> str:
    """Write every backend's output (and the captured one) to a safetensors file, atomically.

    Tensor names are ``step.N.<backend>``; the metadata lists what each backend ran.
    """
    import json

    from safetensors.torch import save

    from kvdbg.util.atomic import atomic_write

    tensors = {}
    for step in result.steps:
        for name, run in step.runs.items():
            if run.output is not None:
                tensors[f"step.{step.step}.{name}"] = run.output.detach().cpu().contiguous()
        if step.captured_output is not None:
            tensors[f"step.{step.step}.captured"] = step.captured_output.detach().cpu().contiguous()
    kernels = {st.name: (st.info.kernel if st.info else f"unavailable: {st.reason}") for st in result.backends}
    # Each step's request boundaries and the layer's dtypes, so `kvdbg diff` can compare two such files
    # per request x head with replay's tolerance.
    steps = {str(step.step): {"query_start_loc": step.common.query_start_loc.tolist(),
                              "seq_lens": step.common.seq_lens.tolist()} for step in result.steps}
    layer = {"dtype": result.meta.layer.dtype, "kv_cache_dtype": result.meta.layer.kv_cache_dtype}
    metadata = {OUTPUTS_KEY: json.dumps({"snapshot": result.path, "kernels": kernels, "steps": steps,
                                            "layer": layer})}
    payload = save(tensors, metadata=metadata)
    return atomic_write(path, lambda fh: fh.write(payload), overwrite=overwrite, what="--output")


__all__ = [
    "save_outputs",
    "BackendRun", "BackendStatus", "ReplayContext", "ReplayReport", "ReplayResult", "ReplaySetup", "StepReplay",
    "backend_key", "common_metadata", "input_findings", "load_backends", "prepare_replay", "replay",
    "steps_run_info",
    "resolve_device", "run_backend", "run_replay",
]
