"""`kvdbg conform`: a backend's cells run, judged, explained (float32 re-run), minimised and written out.

The driver (:func:`conform_backend`) knows nothing of vLLM: it asks a *runner*
(anything with ``backend``, ``refusal(row)`` and ``run(row, kind)``) to judge
cells. :class:`EngineRunner` is the real one: it synthesises the cell's step
(kvdbg.moves.conform.matrix), replays it through the ``vllm`` column (the
installed vLLM's own builder, cache write and impl for the backend) and the
exact reference, and compares them with replay's rule and tolerances.

Steps for one backend:

1. each non-baseline level alone is offered to the backend; a level it refuses
   is left out of the matrix, and its row is a refused cell with the reason;
2. the rows: a pairwise covering array of what is left (or the whole product);
3. every row in every batch kind is a cell: pass, FAIL, or refused (a
   combination the backend refuses, in its words);
4. a failing cell is run again on the float32 path (model dtype float32):
   passing there makes the failure *rounding*, failing there *semantic*; a
   backend without that path leaves it *unknown*;
5. a failing cell's features are dropped one at a time (back to baseline)
   while it keeps failing: the smallest combination that still fails;
6. with an output directory, the failing cell's snapshot and the minimal one's
   are written there, each holding the backend's output as the engine's (so
   `kvdbg report` shows the failure without vLLM, too).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol

from kvdbg.errors import BackendUnavailable, OptionError
from kvdbg.moves.conform.covering import Factor, full_product, pairwise, product_size
from kvdbg.moves.conform.matrix import FACTORS, KINDS, allowed, completed, full_row, label, spec_for

if TYPE_CHECKING:
    from kvdbg.judge.verdict import Verdict

PASS, FAIL, REFUSED = "pass", "fail", "refused"
MAX_FULL = 512  # rows of --full: the whole product beyond this is not "small"
FLOAT32 = "float32"
FILE_PREFIX = "conform-"


@dataclass
class Outcome:
    """A runner's answer for one cell."""

    status: str  # pass | fail | refused
    max_abs: float | None = None  # the largest error (of the failing heads, for a FAIL)
    first: dict | None = None  # the first wrong (step, request, head) and its worst token, for a FAIL
    reason: str | None = None  # refused: the backend's words; FAIL: what failed when no error is measured
    tolerance: str | None = None  # the rule and where it comes from
    kernel: str | None = None  # what ran
    snapshot: Any = None  # the cell's snapshot, the backend's output stored as the engine's (written on a FAIL)


class Runner(Protocol):
    backend: str

    def refusal(self, row: Mapping[str, str]) -> str | None: ...

    def run(self, row: Mapping[str, str], kind: str) -> Outcome: ...


@dataclass
class Cell:
    row_id: int  # index of the row in the backend's table
    row: dict  # every factor's level
    kind: str  # decode | prefill | mixed
    status: str
    max_abs: float | None = None
    first: dict | None = None
    reason: str | None = None
    tolerance: str | None = None
    kernel: str | None = None
    cause: str | None = None  # FAIL: semantic | rounding | unknown
    cause_detail: str | None = None
    minimal: dict | None = None  # FAIL: the smallest row that still fails in this kind
    snapshot_path: str | None = None
    minimal_path: str | None = None
    probe: bool = False  # a refused level alone (left out of the matrix)

    @property
    def label(self) -> str:
        return label(self.row)

    def to_json(self) -> dict:
        return {"row": self.row_id, "combination": self.label, "features": dict(self.row), "kind": self.kind,
                "status": self.status, "max_abs": self.max_abs, "first_wrong": self.first, "reason": self.reason,
                "tolerance": self.tolerance, "kernel": self.kernel, "cause": self.cause,
                "cause_detail": self.cause_detail,
                "minimal": None if self.minimal is None else label(self.minimal),
                "minimal_features": self.minimal, "snapshot": self.snapshot_path,
                "minimal_snapshot": self.minimal_path, "level_probe": self.probe}


@dataclass
class BackendConform:
    """One backend's matrix and cells (``reason`` when it could not be run at all)."""

    backend: str
    matrix: str  # "pairwise" | "full"
    kinds: tuple[str, ...]
    factors: list[Factor] = field(default_factory=list)  # the levels the backend took alone
    rows: list[dict] = field(default_factory=list)
    cells: list[Cell] = field(default_factory=list)
    reason: str | None = None
    seconds: float = 0.0
    runs: int = 0  # cells run, float32 re-runs and minimisation runs included

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.cells) for s in (PASS, FAIL, REFUSED)}

    def to_json(self) -> dict:
        return {"backend": self.backend, "matrix": self.matrix, "kinds": list(self.kinds), "reason": self.reason,
                "factors": [{"name": f.name, "levels": list(f.levels)} for f in self.factors],
                "rows": [{"row": i, "combination": label(r), "features": r} for i, r in enumerate(self.rows)],
                "counts": self.counts(), "seconds": self.seconds, "runs": self.runs}


@dataclass
class ConformResult:
    backends: list[BackendConform]
    out_dir: str | None = None

    @property
    def cells(self) -> list[Cell]:
        return [c for b in self.backends for c in b.cells]

    def to_json(self) -> dict:
        cells = []
        for b in self.backends:
            cells.extend({"backend": b.backend, **c.to_json()} for c in b.cells)
        return {"backends": [b.to_json() for b in self.backends], "out_dir": self.out_dir, "cells": cells}


def conform_verdict(result: ConformResult) -> "Verdict":
    """Exit 1 when a cell fails, 3 when no cell ran (every one refused, or no backend could run), else 0."""
    from kvdbg.judge.verdict import EXIT_FINDING, EXIT_NOTHING_VERIFIED, EXIT_OK, simple_verdict

    cells = result.cells
    failed = [c for c in cells if c.status == FAIL]
    ran = [c for c in cells if c.status in (PASS, FAIL)]
    refused = sum(c.status == REFUSED for c in cells)
    names = ", ".join(b.backend for b in result.backends) or "no backend"
    aside = f"; {refused} refused by the backend" if refused else ""
    if failed:
        by_cause = {}
        for c in failed:
            by_cause[c.cause or "unknown"] = by_cause.get(c.cause or "unknown", 0) + 1
        causes = ", ".join(f"{n} {cause}" for cause, n in sorted(by_cause.items()))
        return simple_verdict("fail", EXIT_FINDING, f"FAIL: {len(failed)} of {len(ran)} cell(s) of {names} differ "
                              f"from the exact reference ({causes}){aside}", comparisons=len(ran),
                              failed_comparisons=len(failed))
    if not ran:
        why = "; ".join(f"{b.backend}: {b.reason}" for b in result.backends if b.reason)
        what = why or (f"every cell was refused by {names}" if cells else "no backend of the engine can run here")
        return simple_verdict("unverified", EXIT_NOTHING_VERIFIED, f"NOTHING VERIFIED: {what}")
    return simple_verdict("pass", EXIT_OK, f"PASS: {len(ran)} cell(s) of {names} agree with the exact reference "
                          f"within tolerance{aside}", comparisons=len(ran))


# --------------------------------------------------------------------------- the driver


def matrix_rows(factors: list[Factor], full: bool) -> list[dict]:
    """The rows of the matrix: the whole product (refused beyond MAX_FULL) or a pairwise covering array."""
    if full:
        size = product_size(factors)
        if size > MAX_FULL:
            raise OptionError(f"--full: the whole product of these features is {size} combinations (at most "
                              f"{MAX_FULL}); name fewer with --features, or leave out --full for pairwise")
        return [full_row(r) for r in full_product(factors, allowed)]
    return [full_row(r) for r in pairwise(factors, allowed)]


class _Cached:
    """A runner's outcomes by (row, kind): minimisation and re-runs meet cells already run."""

    def __init__(self, runner: Runner):
        self.runner, self.outcomes, self.runs = runner, {}, 0

    def run(self, row: Mapping[str, str], kind: str) -> Outcome:
        key = (tuple(sorted(full_row(row).items())), kind)
        if key not in self.outcomes:
            self.runs += 1
            self.outcomes[key] = self.runner.run(full_row(row), kind)
        return self.outcomes[key]


def conform_backend(runner: Runner, factors: Iterable[Factor] = FACTORS, *, kinds: Iterable[str] = KINDS,
                    full: bool = False, out_dir: str | None = None, force: bool = False,
                    progress: Callable[[int, int, str], None] | None = None) -> BackendConform:
    """Every cell of ``runner``'s backend over ``factors`` (the others at baseline); see the module doc."""
    started = time.perf_counter()
    kinds = tuple(kinds)
    factors = list(factors)
    result = BackendConform(runner.backend, "full" if full else "pairwise", kinds)
    cached = _Cached(runner)

    # 1. each level alone: a level the backend refuses leaves the matrix and shows as one refused row
    kept, probes = [], []
    offered, asked = sum(len(f.levels) - 1 for f in factors), 0
    for factor in factors:
        levels = [factor.baseline]
        for level in factor.levels[1:]:
            alone = completed(full_row({factor.name: level}))  # with the window it needs, if any
            if progress:
                progress(asked, offered, f"{runner.backend} takes {label(alone)}?")
            asked += 1
            reason = runner.refusal(alone)
            if reason is None:
                levels.append(level)
            else:
                probes.append((alone, reason))
        kept.append(Factor(factor.name, tuple(levels)))
    result.factors = kept
    rows = matrix_rows(kept, full)
    result.rows = rows + [alone for alone, _ in probes]

    total = len(rows) * len(kinds)
    done = 0
    for row_id, row in enumerate(rows):
        for kind in kinds:
            if progress:
                progress(done, total, f"{runner.backend} {label(row)} ({kind})")
            outcome = cached.run(row, kind)
            cell = _cell(row_id, row, kind, outcome)
            if cell.status == FAIL:
                _explain(cell, cached, kept, outcome, out_dir, force, runner.backend)
            result.cells.append(cell)
            done += 1
    for offset, (alone, reason) in enumerate(probes):
        for kind in kinds:
            result.cells.append(Cell(len(rows) + offset, alone, kind, REFUSED, reason=reason, probe=True))
    if progress:
        progress(total, total, f"{runner.backend} done")
    result.runs = cached.runs
    result.seconds = time.perf_counter() - started
    return result


def _cell(row_id: int, row: dict, kind: str, outcome: Outcome) -> Cell:
    return Cell(row_id, dict(row), kind, outcome.status, max_abs=outcome.max_abs, first=outcome.first,
                reason=outcome.reason, tolerance=outcome.tolerance, kernel=outcome.kernel)


def _explain(cell: Cell, cached: _Cached, factors: list[Factor], outcome: Outcome, out_dir: str | None,
             force: bool, backend: str) -> None:
    """The float32 re-run, the minimal combination, and the snapshots written (see the module doc)."""
    row, kind = cell.row, cell.kind
    if row.get("dtype") == FLOAT32:
        cell.cause, cell.cause_detail = "semantic", "fails on the float32 path itself"
    else:
        again = cached.run({**row, "dtype": FLOAT32}, kind)
        if again.status == PASS:
            cell.cause = "rounding"
            cell.cause_detail = f"passes on the float32 path (max abs {_num(again.max_abs)} under {again.tolerance})"
        elif again.status == FAIL:
            cell.cause = "semantic"
            cell.cause_detail = f"fails on the float32 path too (max abs {_num(again.max_abs)})"
        else:
            cell.cause = "unknown"
            cell.cause_detail = f"no float32 path: {again.reason}"
    minimal = minimise(cached, row, kind, factors)
    cell.minimal = minimal
    if out_dir is not None:
        stem = f"{FILE_PREFIX}{_file_name(backend)}-{cell.row_id:02d}-{kind}"
        cell.snapshot_path = _write(outcome.snapshot, os.path.join(out_dir, f"{stem}.safetensors"), force)
        if minimal != row:
            smallest = cached.run(minimal, kind)
            cell.minimal_path = _write(smallest.snapshot, os.path.join(out_dir, f"{stem}-minimal.safetensors"), force)


def minimise(cached, row: Mapping[str, str], kind: str, factors: Iterable[Factor]) -> dict:
    """Drop features one at a time (each back to its baseline) while the cell keeps failing, until none can go."""
    current = full_row(row)
    factors = list(factors)
    changed = True
    while changed:
        changed = False
        for factor in factors:
            if current[factor.name] == factor.baseline:
                continue
            trial = {**current, factor.name: factor.baseline}
            if not allowed(trial):
                continue
            if cached.run(trial, kind).status == FAIL:
                current, changed = trial, True
    return current


def _write(snapshot, path: str, force: bool) -> str | None:
    if snapshot is None:
        return None
    from kvdbg.snapshot.store import save_snapshot

    os.makedirs(os.path.dirname(path), exist_ok=True)
    return save_snapshot(snapshot, path, overwrite=force)


def _file_name(backend: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in backend)


def _num(value: float | None) -> str:
    return "nan" if value is None or value != value else format(value, ".2e")


def check_out_dir(out_dir: str | None, force: bool) -> None:
    """Refuse, before any work, an --out that is a file, whose parent does not exist, or that already holds
    conform snapshots (unless --force). The directory itself is made when the first snapshot is written."""
    if out_dir is None:
        return
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise OptionError(f"--out {out_dir}: exists and is not a directory")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise OptionError(f"--out {out_dir}: its parent directory {parent} does not exist")
    if os.path.isdir(out_dir) and not force:
        taken = sorted(n for n in os.listdir(out_dir) if n.startswith(FILE_PREFIX) and n.endswith(".safetensors"))
        if taken:
            raise OptionError(f"--out {out_dir}: already holds {len(taken)} conform snapshot(s) ({taken[0]}, ...); "
                              "give another directory, or --force to replace them")


# --------------------------------------------------------------------------- the real runner


ENGINE_ALIASES = {"FLEX": "FLEX_ATTENTION", "CPU": "CPU_ATTN"}


def engine_backend_name(name: str) -> str:
    key = name.strip().upper().replace("-", "_")
    return ENGINE_ALIASES.get(key, key)


def engine_backends(device: str) -> tuple[list[str], str | None]:
    """The backends of the installed vLLM's registry that can run on ``device`` here, and why none can."""
    from kvdbg.backends._vllm_engine import platform_reason, vllm_installed

    if not vllm_installed():
        return [], ("vLLM is not installed in this environment: conform runs an installed engine's backends "
                    "(install kvdbg into the engine's environment)")
    import importlib

    from kvdbg.backends._vllm_engine import REGISTRY_MODULE, _quiet_vllm, _vllm_warnings_off

    _quiet_vllm()
    try:
        with _vllm_warnings_off():
            registry = importlib.import_module(REGISTRY_MODULE)
    except Exception as exc:
        return [], f"vLLM's backend registry does not import: {type(exc).__name__}: {str(exc)[:200]}"
    names = [n for n in registry.AttentionBackendEnum.__members__ if platform_reason(n, device) is None]
    return names, None if names else f"no backend of vLLM's registry runs on {device} here"


class EngineRunner:
    """Cells through the ``vllm`` column (the installed vLLM's own code for ``backend``) and the reference."""

    def __init__(self, backend: str, device: str = "cpu", *, seed: int = 0, atol: float | None = None,
                 rtol: float | None = None):
        from kvdbg.backends._vllm_engine import backend_class, platform_reason, registered, vllm_installed
        from kvdbg.replayer.runner import resolve_device

        self.backend, self.seed, self.atol, self.rtol = engine_backend_name(backend), seed, atol, rtol
        self.device = resolve_device(device)
        if not vllm_installed():
            raise BackendUnavailable(f"--backend {backend}: vLLM is not installed in this environment, so its "
                                     "backends cannot run here")
        registered(self.backend)
        reason = platform_reason(self.backend, self.device)
        if reason is not None:
            raise BackendUnavailable(f"--backend {backend}: {reason}")
        backend_class(self.backend)

    def _replay(self, row: Mapping[str, str], kind: str):
        from kvdbg.backends.base import ReplayOptions
        from kvdbg.moves.synth import synth_snapshot
        from kvdbg.replayer.runner import replay

        snap = synth_snapshot(spec_for(self.backend, row, kind, self.seed))
        return snap, replay(snap, ["reference", "vllm"], ReplayOptions(device=self.device), required=["vllm"])

    def refusal(self, row: Mapping[str, str]) -> str | None:
        """What the backend says against ``row`` when the vllm column is set up for it (vLLM's own checks)."""
        from kvdbg.backends.base import ReplayOptions
        from kvdbg.moves.synth import synth_snapshot
        from kvdbg.replayer.runner import load_backends

        snap = synth_snapshot(spec_for(self.backend, row, KINDS[0], self.seed))
        statuses = load_backends(["vllm"], snap.meta, ReplayOptions(device=self.device))[0]
        return None if statuses[0].available else statuses[0].reason

    def run(self, row: Mapping[str, str], kind: str) -> Outcome:
        from kvdbg.judge.compare import compare_step
        from kvdbg.judge.verdict import EXIT_OK, judge
        from kvdbg.snapshot.store import torch_dtype

        try:
            snap, result = self._replay(row, kind)
        except BackendUnavailable as exc:
            return Outcome(REFUSED, reason=_refusal_text(str(exc)))
        vllm = next(st for st in result.backends if st.name == "vllm")
        kernel = vllm.info.kernel if vllm.info else None
        comparisons, errors = [], []
        for step in result.steps:
            run = step.runs.get("vllm")
            if run is not None and run.error:
                errors.append(f"step {step.step}: raised {run.error}")
            comparisons += [c for c in compare_step(step, snap.meta, atol=self.atol, rtol=self.rtol)
                            if c.actual == "vllm" and c.expected == "reference"]
        tolerance = comparisons[0].tolerance if comparisons else None
        rule = f"{tolerance.rule} ({tolerance.source})" if tolerance else None
        for step in result.steps:  # the backend's output, stored as the engine's: the snapshot shows the failure
            run = step.runs.get("vllm")
            if run is not None and run.output is not None:
                snap.steps[step.step].output = run.output.detach().cpu().to(torch_dtype(snap.meta.layer.dtype))
        failed = [(c.step, h) for c in comparisons for h in c.failed]
        # The one verdict rule: the column's comparisons with the reference, its error findings (a raise is one)
        # and those about the step's inputs.
        findings = [f for f in result.findings if f.backend in ("vllm", "replay")]
        verdict = judge(comparisons, findings)
        if verdict.exit_code != EXIT_OK:
            first = None
            if failed:
                step, head = min(failed, key=lambda sh: (sh[0], sh[1].request, sh[1].head))
                starts = next(s.common.query_start_loc for s in result.steps if s.step == step)
                first = {"step": step, "request": head.request, "head": head.head,
                         "token": head.worst_token - int(starts[head.request]),
                         "max_abs": _finite(head.max_abs)}
            worst = [c.failed_max_abs for c in comparisons if c.failed and c.failed_max_abs == c.failed_max_abs]
            reason = "; ".join(errors) or (None if failed else verdict.summary)
            if failed and not worst:
                reason = "the failing heads hold no finite number (NaN/inf, or tokens the backend did not write)"
            return Outcome(FAIL, max_abs=max(worst) if worst else None, first=first, reason=reason, tolerance=rule,
                           kernel=kernel, snapshot=snap)
        return Outcome(PASS, max_abs=_finite(max(c.max_abs for c in comparisons)), tolerance=rule, kernel=kernel)


def _finite(value: float | None) -> float | None:
    return None if value is None or value != value else float(value)


def _refusal_text(text: str) -> str:
    for prefix in ("backend vllm cannot run: ",):
        if text.startswith(prefix):
            return text[len(prefix):]
    return text


def conform(backends: Iterable[str] | None = None, device: str = "cpu", *, features: Iterable[str] | None = None,
            kinds: Iterable[str] = KINDS, full: bool = False, out_dir: str | None = None, force: bool = False,
            seed: int = 0, atol: float | None = None, rtol: float | None = None,
            progress: Callable[[int, int, str], None] | None = None) -> ConformResult:
    """Conform the named backends (default: every backend of the installed engine that runs on ``device``)."""
    from kvdbg.moves.conform.matrix import factors_named

    factors = list(FACTORS if features is None else factors_named(features))
    kinds = tuple(dict.fromkeys(kinds))
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise OptionError(f"--batch: unknown batch kind {bad[0]!r} (choose from: {', '.join(KINDS)})" if bad
                          else "--batch: give at least one batch kind")
    if full:
        matrix_rows(factors, True)  # refuse a product that is not small before any work
    check_out_dir(out_dir, force)
    result = ConformResult([], out_dir)
    if backends is None:
        from kvdbg.replayer.runner import resolve_device

        names, reason = engine_backends(resolve_device(device))
        if not names:
            result.backends.append(BackendConform("engine", "full" if full else "pairwise", kinds, reason=reason))
            return result
    else:
        names = [engine_backend_name(n) for n in backends]
    runners = []
    for name in dict.fromkeys(names):
        if progress:
            progress(0, 0, f"{name} loading the engine")
        try:
            runners.append(EngineRunner(name, device, seed=seed, atol=atol, rtol=rtol))
        except BackendUnavailable as exc:
            if backends is not None:
                raise
            result.backends.append(BackendConform(name, "full" if full else "pairwise", kinds, reason=str(exc)))
    for runner in runners:
        result.backends.append(conform_backend(runner, factors, kinds=kinds, full=full, out_dir=out_dir,
                                               force=force, progress=progress))
    return result


__all__ = ["BackendConform", "Cell", "ConformResult", "EngineRunner", "Outcome", "conform", "conform_backend",
           "conform_verdict", "engine_backend_name", "engine_backends", "matrix_rows", "minimise", "check_out_dir"]
