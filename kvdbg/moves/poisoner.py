"""Poisoning: NaN in every cache slot a correct backend must not read, region by region, and who reads it.

A *slot* is one token of one stored page (K and V of every KV head). For one
step, the slots a correct backend must read are the *protected* ones: for each
request and each live table entry, the keys from ``first_visible_key`` to
``seq_len`` (the union of the request's exact windows). Every other slot of a
stored page falls in one of five regions, each poisoned on its own:

================  ==============================================================
region            slots
================  ==============================================================
unreferenced      stored pages no table entry of the step references
stale_tail        pages in table entries past a request's live pages
past_seq_len      tokens past ``seq_len`` in a request's last live page
before_window     keys before ``first_visible_key`` in pages a request reads
null_block        engine page 0 (vLLM's null block), where it is stored
================  ==============================================================

Page 0 belongs only to ``null_block``. A protected slot is never poisoned,
whatever region it also lies in (a page live for another request, a shared
prefix, page 0 holding visible keys).

Each region is poisoned twice. With NaN *keys*, an output turns non-finite only
when the backend gives one of those keys a weight: it attends to a key it must
not ("reads poisoned", a finding), and the region is then bisected by halves
(bounded) to name the slots. With NaN *values*, an output also turns
non-finite when the backend loads the slot and multiplies it by a zero weight
(0 x NaN = NaN), as a tiled kernel does in a partly masked tile ("loads
masked"): a hazard when the engine leaves NaN in such slots, not a wrong
weight, so it is reported apart and is not a finding.

A backend that follows FLASHINFER_TS's rule reads, by design, the keys its
page-aligned window restriction keeps before a request's exact windows (up to
``page_size - 1`` of them, vLLM's documented behaviour; see
kvdbg.judge.verdict). When every slot the bisection names holds such keys of
the requests whose outputs turned NaN, the region's status is "reads by
design" (a warning with the slots' count), not "reads poisoned".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterable

import torch

from kvdbg.errors import OptionError
from kvdbg.ts.window import cdiv, first_visible_key, restrict_to_window

if TYPE_CHECKING:
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.replayer.runner import BackendStatus
    from kvdbg.snapshot.store import Snapshot

NULL_PAGE = 0
REGIONS = ("unreferenced", "stale_tail", "past_seq_len", "before_window", "null_block")
REGION_MEANING = {
    "unreferenced": "stored pages no table entry references",
    "stale_tail": "pages of table entries past the live ones",
    "past_seq_len": "tokens past seq_len in the last live page",
    "before_window": "keys before the first any query token sees",
    "null_block": "engine page 0, the null block",
}
# Backend runs one bisection of one region may spend; what is left unsplit is named as a range.
BISECT_BUDGET = 48
# Outputs listed per region in JSON (the counts are always complete).
MAX_OUTPUTS_LISTED = 256


@dataclass(frozen=True)
class SlotRun:
    """Tokens ``[lo, hi)`` of one stored page."""

    page: int  # engine page id
    stored: int  # index into the snapshot's stored pages
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo

    def to_json(self) -> dict:
        return {"page": self.page, "tokens": [self.lo, self.hi]}


@dataclass
class Region:
    name: str
    runs: list[SlotRun]

    @property
    def slots(self) -> int:
        return sum(r.size for r in self.runs)


@dataclass
class Culprit:
    """Slots the bisection narrowed a region's reads down to, with the request keys they hold."""

    run: SlotRun
    keys: list[tuple[int, int, int]]  # (request, first key, last key + 1) the slots hold as live entries

    @property
    def label(self) -> str:
        tokens = f"token {self.run.lo}" if self.run.size == 1 else f"tokens {self.run.lo}-{self.run.hi - 1}"
        where = f"page {self.run.page} {tokens}"
        if self.keys:
            where += " = " + ", ".join(f"request {r} key {a}" if b - a == 1 else f"request {r} keys {a}-{b - 1}"
                                       for r, a, b in self.keys)
        return where

    def to_json(self) -> dict:
        return {**self.run.to_json(), "keys": [{"request": r, "first": a, "last": b - 1} for r, a, b in self.keys]}


@dataclass
class RegionResult:
    """One backend with one region poisoned."""

    region: str
    slots: int
    status: str  # "reads poisoned" | "reads by design" | "loads masked" | "clean" | "empty" | "not run"
    outputs: list[tuple[int, int, int]] = field(default_factory=list)  # (request, head, query token in request)
    # Outputs that turn NaN only when the values are poisoned: the backend loads the slots and multiplies
    # them by a zero weight (0 x NaN = NaN), as a tile-based kernel does with a partly masked tile.
    masked_outputs: list[tuple[int, int, int]] = field(default_factory=list)
    culprits: list[Culprit] = field(default_factory=list)
    bisect_runs: int = 0
    bisect_complete: bool = True
    note: str | None = None

    @property
    def requests(self) -> int:
        return len({r for r, _, _ in self.outputs})

    @property
    def heads(self) -> int:
        return len({(r, h) for r, h, _ in self.outputs})

    @property
    def tokens(self) -> int:
        return len({(r, t) for r, _, t in self.outputs})

    def to_json(self) -> dict:
        def listed(outputs):
            return [{"request": r, "head": h, "token": t} for r, h, t in outputs[:MAX_OUTPUTS_LISTED]]

        return {"region": self.region, "slots": self.slots, "status": self.status,
                "requests": self.requests, "heads": self.heads, "tokens": self.tokens,
                "outputs": listed(self.outputs), "outputs_listed_all": len(self.outputs) <= MAX_OUTPUTS_LISTED,
                "masked_outputs": listed(self.masked_outputs),
                "masked_requests": len({r for r, _, _ in self.masked_outputs}),
                "masked_heads": len({(r, h) for r, h, _ in self.masked_outputs}),
                "masked_tokens": len({(r, t) for r, _, t in self.masked_outputs}),
                "masked_outputs_listed_all": len(self.masked_outputs) <= MAX_OUTPUTS_LISTED,
                "culprits": [c.to_json() for c in self.culprits], "bisect_runs": self.bisect_runs,
                "bisect_complete": self.bisect_complete, "note": self.note}


@dataclass
class BackendPoison:
    """One backend on one step: its unpoisoned baseline and each region's result."""

    backend: str
    step: int
    ran: bool
    reason: str | None = None  # why it did not run
    baseline_nonfinite: int = 0  # (token, head) outputs already non-finite or unwritten unpoisoned
    regions: list[RegionResult] = field(default_factory=list)
    outputs: int = 0  # (token, head) outputs of the step: a read shows only in those finite unpoisoned

    @property
    def observed(self) -> bool:
        """It ran and some output was finite unpoisoned: a poisoned read could show there."""
        return self.ran and self.baseline_nonfinite < self.outputs

    @property
    def reads_poisoned(self) -> bool:
        return any(r.status == "reads poisoned" for r in self.regions)

    @property
    def reads_by_design(self) -> bool:
        return any(r.status == "reads by design" for r in self.regions)

    @property
    def loads_masked(self) -> bool:
        return any(r.masked_outputs for r in self.regions)

    def to_json(self) -> dict:
        return {"backend": self.backend, "step": self.step, "ran": self.ran, "reason": self.reason,
                "baseline_nonfinite": self.baseline_nonfinite, "outputs": self.outputs, "observed": self.observed,
                "reads_poisoned": self.reads_poisoned, "reads_by_design": self.reads_by_design,
                "loads_masked": self.loads_masked,
                "regions": [r.to_json() for r in self.regions]}


@dataclass
class PoisonStep:
    step: int
    regions: list[Region]
    backends: list[BackendPoison]


@dataclass
class PoisonResult:
    path: str | None
    backends: list["BackendStatus"]
    steps: list[PoisonStep]

    def to_json(self) -> dict:
        return {"snapshot": self.path,
                "backends": [{"name": b.name, "available": b.available, "reason": b.reason} for b in self.backends],
                "steps": [{"step": s.step,
                           "regions": [{"region": r.name, "slots": r.slots,
                                        "pages": len({x.page for x in r.runs})} for r in s.regions],
                           "results": [b.to_json() for b in s.backends]} for s in self.steps]}


# --------------------------------------------------------------------------- regions


def _bits(lo: int, hi: int) -> int:
    return ((1 << hi) - 1) ^ ((1 << lo) - 1) if hi > lo else 0


def poison_regions(snapshot: "Snapshot", step: int) -> list[Region]:
    """The five regions of one step, each without a protected slot (see the module docstring)."""
    if not 0 <= step < len(snapshot.steps):
        raise OptionError(f"--step {step} is out of range: the snapshot has {len(snapshot.steps)} step(s)")
    s = snapshot.steps[step]
    ps = snapshot.page_size
    window = snapshot.meta.layer.sliding_window
    table = s.block_table.tolist()
    seq_lens = [int(x) for x in s.seq_lens.tolist()]
    query_lens = s.query_lens
    stored_ids = [int(p) for p in snapshot.page_ids.tolist()]
    stored_of = {p: i for i, p in enumerate(stored_ids)}
    full = _bits(0, ps)

    protected: dict[int, int] = {}
    referenced: set[int] = set()
    stale: dict[int, int] = {}
    past: dict[int, int] = {}
    before: dict[int, int] = {}
    for row, length, qlen in zip(table, seq_lens, query_lens):
        live_count = cdiv(length, ps)
        first = first_visible_key(length, qlen, window)
        referenced.update(int(p) for p in row)
        for j, page in enumerate(row[:live_count]):
            lo, hi = j * ps, min(length, (j + 1) * ps)
            protected[page] = protected.get(page, 0) | _bits(max(first, lo) - lo, hi - lo)
            if first > lo:
                before[page] = before.get(page, 0) | _bits(0, min(first, hi) - lo)
        if live_count:
            last = row[live_count - 1]
            past[last] = past.get(last, 0) | _bits(length - (live_count - 1) * ps, ps)
        for page in row[live_count:]:
            stale[page] = full

    unreferenced = {p: full for p in stored_ids if p not in referenced}
    masks = {"unreferenced": unreferenced, "stale_tail": stale, "past_seq_len": past, "before_window": before,
             "null_block": {NULL_PAGE: full}}
    regions = []
    for name in REGIONS:
        runs = []
        for page in sorted(masks[name]):
            if (page == NULL_PAGE) != (name == "null_block") or page not in stored_of:
                continue
            bits = masks[name][page] & ~protected.get(page, 0)
            runs.extend(_runs_of(bits, page, stored_of[page], ps))
        regions.append(Region(name, runs))
    return regions


def documented_keys(snapshot: "Snapshot", step: int) -> dict[int, tuple[int, int]]:
    """Per request, the keys ``[lo, hi)`` before its exact windows that FLASHINFER_TS's page-aligned window
    restriction shows by design (dense windowed layers only; requests where it drops nothing have none)."""
    layer = snapshot.meta.layer
    window = layer.sliding_window
    if window is None or layer.causal:
        return {}
    s = snapshot.steps[step]
    out = {}
    for r, (length, qlen) in enumerate(zip((int(x) for x in s.seq_lens.tolist()), s.query_lens)):
        if qlen <= 0 or qlen > length:
            continue
        first = first_visible_key(length, qlen, window)
        kept = restrict_to_window(length, window, qlen, snapshot.page_size).first_kept_token
        if kept < first:
            out[r] = (kept, first)
    return out


def follows_ts_rule(snapshot: "Snapshot", name: str) -> bool:
    """Whether backend column ``name`` runs FLASHINFER_TS's builder (kvdbg's, or vLLM's own on such a snapshot)."""
    return name == "flashinfer_ts" or (name == "vllm" and snapshot.meta.backend.name == "FLASHINFER_TS")


def _by_design(result: RegionResult, documented: dict[int, tuple[int, int]]) -> bool:
    """Every slot the bisection named holds only documented keys, of the requests whose outputs turned NaN."""
    if not result.culprits or not result.bisect_complete:
        return False
    readers = {r for r, _, _ in result.outputs}
    for culprit in result.culprits:
        if not culprit.keys:
            return False
        for request, first, last in culprit.keys:
            lo, hi = documented.get(request, (0, 0))
            if not lo <= first < last <= hi:
                return False
    return readers <= set(documented)


def _runs_of(bits: int, page: int, stored: int, ps: int) -> list[SlotRun]:
    out, lo = [], None
    for t in range(ps + 1):
        on = t < ps and bits >> t & 1
        if on and lo is None:
            lo = t
        elif not on and lo is not None:
            out.append(SlotRun(page, stored, lo, t))
            lo = None
    return out


def live_keys(snapshot: "Snapshot", step: int, run: SlotRun) -> list[tuple[int, int, int]]:
    """The (request, first key, end key) that ``run``'s slots hold as live table entries of ``step``."""
    s = snapshot.steps[step]
    ps = snapshot.page_size
    out = []
    for r, (row, length) in enumerate(zip(s.block_table.tolist(), s.seq_lens.tolist())):
        for j, page in enumerate(row[:cdiv(int(length), ps)]):
            if page == run.page:
                out.append((r, j * ps + run.lo, j * ps + run.hi))
    return out


# --------------------------------------------------------------------------- poisoning


def _nan_of(view: torch.Tensor) -> tuple[torch.Tensor, float | int]:
    """A writable view and the NaN to write: float8 e4m3 has no torch NaN literal path on every device."""
    if view.dtype in (torch.float8_e4m3fn, torch.uint8):
        return view.view(torch.uint8), 0x7F  # e4m3fn NaN
    return view, float("nan")


class PoisonedCache:
    """Writes NaN into a set of slots of a private cache and restores what was there on exit."""

    def __init__(self, meta, cache: torch.Tensor, runs: Iterable[SlotRun], which: str = "k"):
        from kvdbg.snapshot.layout import kv_views

        keys, values = kv_views(meta, cache)
        self.views = {"k": (keys,), "v": (values,), "kv": (keys, values)}[which]
        self.runs = list(runs)
        self.saved: list[tuple[torch.Tensor, SlotRun, torch.Tensor]] = []

    def __enter__(self):
        for view in self.views:
            target, nan = _nan_of(view)
            for run in self.runs:
                self.saved.append((target, run, target[run.stored, :, run.lo:run.hi].clone()))
                target[run.stored, :, run.lo:run.hi] = nan
        return self

    def __exit__(self, *exc):
        for target, run, values in reversed(self.saved):
            target[run.stored, :, run.lo:run.hi] = values
        self.saved.clear()
        return False


# --------------------------------------------------------------------------- running


def _nonfinite(run) -> torch.Tensor | None:
    """[tokens, Hq] True where the output is non-finite or the backend did not write; None when it did not run."""
    if run.error is not None or run.output is None or run.not_applicable is not None:
        return None
    bad = ~torch.isfinite(run.output.float()).all(dim=-1)
    if run.written is not None:
        bad |= ~run.written.to(bad.device).unsqueeze(1)
    return bad.cpu()


def _token_owner(query_start_loc: list[int]) -> list[tuple[int, int]]:
    out = []
    for r, (a, b) in enumerate(zip(query_start_loc, query_start_loc[1:])):
        out.extend((r, t - a) for t in range(a, b))
    return out


def poison(snapshot: "Snapshot", backends: Iterable[str] | None = None, options: "ReplayOptions | None" = None, *,
           steps: Iterable[int] | None = None, required: Iterable[str] = (),
           progress: Callable[[str], None] | None = None, bisect_budget: int = BISECT_BUDGET) -> PoisonResult:
    """Replay each step with each region poisoned in turn; see the module docstring.

    The cache is the replay's private working cache (the snapshot is never
    written); each region is written as NaN before a backend runs and restored
    after, so every run sees exactly one region (or one part of it) poisoned.
    """
    from kvdbg.snapshot.cache import apply_step_update
    from kvdbg.replayer.runner import common_metadata, prepare_replay, run_backend

    setup = prepare_replay(snapshot, backends, options, steps=steps, required=required)
    options, device, wanted = setup.options, setup.options.device, setup.steps
    statuses, instances, specs = setup.statuses, setup.instances, setup.specs
    model_dtype, cache = setup.model_dtype, setup.cache
    out_steps = []
    for step in range(wanted[-1] + 1 if wanted else 0):
        apply_step_update(snapshot, cache, step)
        if step not in wanted:
            continue
        common = common_metadata(snapshot, step, device)
        query = snapshot.steps[step].query.to(device)
        owner = _token_owner(snapshot.steps[step].query_start_loc.tolist())
        regions = poison_regions(snapshot, step)
        results = []
        for status in statuses:
            name = status.name
            if name not in instances:
                results.append(BackendPoison(name, step, False, status.reason))
                continue

            def run_with(runs: list[SlotRun], which: str = "k", name=name) -> torch.Tensor | None:
                with PoisonedCache(snapshot.meta, cache, runs, which):
                    return _nonfinite(run_backend(name, specs[name], instances[name], common, query, cache,
                                                  model_dtype))

            if progress:
                progress(f"step {step}: {name}, unpoisoned")
            base_run = run_backend(name, specs[name], instances[name], common, query, cache, model_dtype)
            baseline = _nonfinite(base_run)
            if baseline is None:
                why = base_run.not_applicable or base_run.error or "produced no output"
                results.append(BackendPoison(name, step, False, f"did not run step {step}: {why}"))
                continue
            record = BackendPoison(name, step, True, baseline_nonfinite=int(baseline.sum()),
                                   outputs=baseline.numel())
            for region in regions:
                if not region.runs:
                    record.regions.append(RegionResult(region.name, 0, "empty"))
                    continue
                if progress:
                    progress(f"step {step}: {name}, {region.name} poisoned ({region.slots} slots)")
                bad = run_with(region.runs, "k")
                bad_values = run_with(region.runs, "v")
                if bad is None or bad_values is None:
                    record.regions.append(RegionResult(region.name, region.slots, "not run",
                                                       note="the backend failed with this region poisoned"))
                    continue
                new = bad & ~baseline
                masked = bad_values & ~baseline & ~new
                hits = [(owner[t][0], h, owner[t][1]) for t, h in new.nonzero().tolist()]
                masked_hits = [(owner[t][0], h, owner[t][1]) for t, h in masked.nonzero().tolist()]
                status = "reads poisoned" if hits else "loads masked" if masked_hits else "clean"
                result = RegionResult(region.name, region.slots, status, hits, masked_hits)
                if hits:
                    _bisect(snapshot, step, region, new, baseline, run_with, result, bisect_budget)
                    if follows_ts_rule(snapshot, name) and _by_design(result, documented_keys(snapshot, step)):
                        result.status = "reads by design"
                        result.note = ("FLASHINFER_TS's page-aligned window restriction shows these keys by design "
                                       "(window_restriction_extra_keys): not a finding")
                record.regions.append(result)
            results.append(record)
        out_steps.append(PoisonStep(step, regions, results))
    return PoisonResult(snapshot.path, statuses, out_steps)


def _split(runs: list[SlotRun]) -> tuple[list[SlotRun], list[SlotRun]]:
    """Two halves by slot count (a single run is cut inside its page)."""
    if len(runs) == 1:
        r = runs[0]
        mid = r.lo + r.size // 2
        return [SlotRun(r.page, r.stored, r.lo, mid)], [SlotRun(r.page, r.stored, mid, r.hi)]
    total, acc = sum(r.size for r in runs), 0
    for i, r in enumerate(runs):
        acc += r.size
        if acc * 2 >= total:
            cut = max(1, min(i + 1, len(runs) - 1))
            return runs[:cut], runs[cut:]
    return runs[:1], runs[1:]


def _bisect(snapshot, step, region: Region, target: torch.Tensor, baseline: torch.Tensor, run_with,
            result: RegionResult, budget: int) -> None:
    """Halve the region while a half still turns some of ``target``'s outputs non-finite; name what is left."""
    pending = [region.runs]
    found: list[list[SlotRun]] = []
    while pending:
        group = pending.pop(0)
        if sum(r.size for r in group) == 1:
            found.append(group)
            continue
        halves = _split(group)
        narrowed = False
        for half in halves:
            if result.bisect_runs >= budget:
                result.bisect_complete = False
                found.append(half)
                narrowed = True
                continue
            result.bisect_runs += 1
            bad = run_with(half)
            if bad is not None and bool((bad & ~baseline & target).any()):
                pending.append(half)
                narrowed = True
        if not narrowed:
            # Neither half alone turns an output NaN (the backend fails on one, or reads only both together):
            # the group is what can be named.
            found.append(group)
    merged: list[SlotRun] = []
    for run in sorted((r for g in found for r in g), key=lambda r: (r.stored, r.lo)):
        if merged and merged[-1].stored == run.stored and merged[-1].hi == run.lo:
            merged[-1] = SlotRun(run.page, run.stored, merged[-1].lo, run.hi)
        else:
            merged.append(run)
    result.culprits = [Culprit(run, live_keys(snapshot, step, run)) for run in merged]
    if not result.bisect_complete:
        result.note = f"bisection stopped after {budget} runs: some culprits are ranges, not single slots"


__all__ = ["BISECT_BUDGET", "BackendPoison", "Culprit", "documented_keys", "follows_ts_rule", "PoisonResult", "PoisonStep", "PoisonedCache", "REGIONS",
           "REGION_MEANING", "Region", "RegionResult", "SlotRun", "live_keys", "poison", "poison_regions"]
