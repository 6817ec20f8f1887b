"""Minimise a failing snapshot (delta debugging) while the same backend keeps failing on the same heads.

The failure signature (see :class:`Signature`) is taken from one step of the
input: the last step where the chosen backend fails against the exact
reference. It is the set of (request, query head) pairs that backend fails on,
plus the set of its error findings (code, request). A candidate reproduces the
failure when, replayed through the reference and that backend only, it fails on
the signature's pairs and findings that survive the candidate's
removals (mapped back to the input's numbering), and on at least one of them
(:func:`same_failure` has the exact rule: no kept failing head stops failing, no
error finding appears or disappears, no request that passed starts failing).

Passes, each verified by replaying every candidate:

1. steps: earlier steps' cache updates are baked into the cache, later steps
   dropped, so one step remains;
2. requests: ddmin over the requests of that step (rows renumbered);
3. heads: ddmin over KV heads, each dropped with its group of query heads;
4. sequences: per request, ddmin over whole pages lying before its query block
   (the row and seq_len shrink; positions shift by whole pages, so the
   page-aligned structure backends depend on is kept);
5. table width: stale block-table columns trimmed.

After every change the cache keeps only the pages the step still reads or writes.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import torch

from kvdbg.util.atomic import check_output
from kvdbg.backends.base import ReplayOptions
from kvdbg.backends import DEFAULT_ORDER
from kvdbg.snapshot.cache import apply_step_update, working_cache
from kvdbg.snapshot.layout import kv_head_dim
from kvdbg.judge.compare import compare_step
from kvdbg.judge.verdict import fails
from kvdbg.errors import KvdbgError, OptionError
from kvdbg.replayer.runner import ReplayContext, replay, run_replay
from kvdbg.snapshot.store import compact_cache, referenced_pages, save_snapshot, validate

if TYPE_CHECKING:
    from kvdbg.snapshot.store import Snapshot

__all__ = ["Signature", "Observation", "PassRecord", "ShrinkResult", "ddmin", "failure_signature", "shrink",
           "observe"]


@dataclass(frozen=True)
class Signature:
    """What "the same failure" means, in the input's numbering."""

    backend: str
    step: int  # the input step the failure is taken from (the last one where the backend fails)
    failing_heads: frozenset[tuple[int, int]]  # (request, query head) failing against the reference
    error_findings: frozenset[tuple[str, int | None]]  # (code, request) of the backend's error findings

    def restricted(self, requests: Sequence[int], heads: Sequence[int]) -> tuple[frozenset, frozenset]:
        """The part of the signature a candidate keeping ``requests`` and ``heads`` (input ids) must show."""
        kept_r, kept_h = set(requests), set(heads)
        pairs = frozenset(p for p in self.failing_heads if p[0] in kept_r and p[1] in kept_h)
        finds = frozenset(f for f in self.error_findings if f[1] is None or f[1] in kept_r)
        return pairs, finds

    def to_json(self) -> dict:
        return {"backend": self.backend, "step": self.step,
                "failing_heads": [list(p) for p in sorted(self.failing_heads)],
                "error_findings": [{"code": c, "request": r}
                                   for c, r in sorted(self.error_findings, key=lambda f: (f[0], f[1] is None, f[1] or 0))]}


class NothingToShrink(OptionError):
    """Every backend that could run passes: no failure to keep (the snapshot's verdict then says PASS)."""


@dataclass(frozen=True)
class Observation:
    """One backend on one replayed step, in the replayed snapshot's own numbering."""

    available: bool
    failing_heads: frozenset[tuple[int, int]]
    error_findings: frozenset[tuple[str, int | None]]

    @property
    def fails(self) -> bool:
        return bool(self.failing_heads or self.error_findings)


@dataclass
class PassRecord:
    name: str
    candidates: int  # replays this pass ran
    removed: str  # what it removed, in words ("" when nothing)
    bytes_after: int  # tensor bytes after the pass


@dataclass
class ShrinkResult:
    input_path: str | None
    output_path: str | None
    input_bytes: int
    output_bytes: int
    backend: str
    signature: Signature
    kept_requests: list[int]  # input request index of each output request
    kept_heads: list[int]  # input query head of each output query head
    kept_kv_heads: list[int]
    steps_before: int
    pages_before: int
    pages_after: int
    tokens_before: int  # total keys (sum of seq_lens) of the failing step
    tokens_after: int
    failing_heads_after: list[tuple[int, int]]  # in the output's numbering
    passes: list[PassRecord]
    replays: int
    seconds: float
    snapshot: "Snapshot | None" = field(default=None, repr=False)

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("snapshot", "signature")}
        out["signature"] = self.signature.to_json()
        out["failing_heads_after"] = [list(p) for p in self.failing_heads_after]
        return out


# --------------------------------------------------------------------------- ddmin


def ddmin(items: Sequence, test: Callable[[list], bool], *, allow_empty: bool = False) -> list:
    """Zeller's ddmin: a 1-minimal subset of ``items`` for which ``test`` holds (``test(items)`` is assumed)."""
    items = list(items)
    if allow_empty and items and test([]):
        return []
    n = 2
    while len(items) >= 2:
        chunks = _split(items, n)
        for chunk in chunks:
            if test(chunk):
                items, n = chunk, 2
                break
        else:
            for chunk in chunks:
                rest = [x for x in items if x not in chunk]
                if test(rest):
                    items, n = rest, max(n - 1, 2)
                    break
            else:
                if n >= len(items):
                    break
                n = min(len(items), 2 * n)
    return items


def _split(items: list, n: int) -> list[list]:
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        if end > start:
            out.append(items[start:end])
        start = end
    return out


# --------------------------------------------------------------------------- observing a failure


def observe(snapshot: "Snapshot", backend: str, step: int, *, device: str = "cpu",
            context: ReplayContext | None = None) -> Observation:
    """Replay one step through the reference and ``backend``; what fails there.

    ``context`` (made for exactly those two backends) lends backends already
    created for the layer; the shrinker passes one for every candidate.
    """
    context = context or ReplayContext(["reference", backend], ReplayOptions(device=device))
    # The observation reads the backend's outputs and findings only, not the scan of the inputs.
    result = run_replay(snapshot, context.setup(snapshot, [step], private_cache=False), check_inputs=False)
    return _observation(result, backend)


def _observation(result, backend: str, step_index: int = -1) -> Observation:
    status = next(st for st in result.backends if st.name == backend)
    if not status.available or not result.steps:
        return Observation(False, frozenset(), frozenset())
    step = result.steps[step_index]
    pairs = set()
    for comp in compare_step(step, result.meta):
        if comp.actual == backend and comp.expected == "reference":
            pairs |= {(h.request, h.head) for h in comp.failed}
    run = step.runs.get(backend)
    # "still fails" is kvdbg.judge.verdict's rule: a failing head, or an error finding (never a warning such as
    # FLASHINFER_TS's documented window_restriction_extra_keys).
    finds = frozenset((f.code, f.request) for f in (run.findings if run else []) if fails(f))
    return Observation(True, frozenset(pairs), finds)


def failure_signature(snapshot: "Snapshot", backend: str | None = None, *, device: str = "cpu",
                      progress: Callable[[str], None] | None = None) -> Signature:
    """Replay the input and take the failure to preserve; OptionError when it does not fail.

    Without ``backend``, the first backend (in replay's default order) that fails is chosen.
    """
    candidates = [backend] if backend else [b for b in DEFAULT_ORDER if b != "reference"]
    if backend == "reference":
        raise OptionError("--backend reference: the reference defines correctness; choose a backend to shrink for")
    quick = _last_step_signature(snapshot, candidates, device, progress)
    if quick is not None:
        return quick
    if progress:
        progress(f"replaying the input through reference, {', '.join(candidates)}")
    result = replay(snapshot, ["reference", *candidates], ReplayOptions(device=device),
                    required=[backend] if backend else [])
    unavailable = {st.name: st.reason for st in result.backends if not st.available}
    for name in candidates:
        if name in unavailable:
            continue
        for index in range(len(result.steps) - 1, -1, -1):
            obs = _observation(result, name, index)
            if obs.fails:
                return Signature(name, result.steps[index].step, obs.failing_heads, obs.error_findings)
    if backend and backend in unavailable:
        raise OptionError(f"backend {backend} cannot run here ({unavailable[backend]}); there is nothing to shrink")
    which = f"backend {backend} passes" if backend else f"every backend ({', '.join(candidates)}) passes"
    raise NothingToShrink(f"{snapshot.path or 'the snapshot'}: {which} against the reference "
                          "(no failing head, no error finding); there is nothing to shrink")


def _last_step_signature(snapshot: "Snapshot", candidates: Sequence[str], device: str,
                         progress: Callable[[str], None] | None) -> Signature | None:
    """The signature the whole replay would give, found on the last step alone, or None to replay it all.

    The whole replay picks the first candidate that fails, at the last step where
    it fails. When the first candidate that can run fails at the last step, that
    is its answer, and no other step or backend needs replaying (earlier steps'
    updates are still applied to the cache). Otherwise this says nothing.
    """
    last = len(snapshot.steps) - 1
    if last < 0:
        return None
    for name in candidates:
        if progress:
            progress(f"replaying the input's last step (step {last}) through reference, {name}")
        result = replay(snapshot, ["reference", name], ReplayOptions(device=device), steps=[last])
        if not next(st for st in result.backends if st.name == name).available:
            continue
        obs = _observation(result, name)
        return Signature(name, last, obs.failing_heads, obs.error_findings) if obs.fails else None
    return None


# --------------------------------------------------------------------------- snapshot surgery


def tensor_bytes(snapshot: "Snapshot") -> int:
    return sum(t.numel() * t.element_size() for t in snapshot.tensors().values())


def _compact(snapshot: "Snapshot") -> "Snapshot":
    """Keep only the stored pages the steps still read or write.

    Every candidate is compacted before it is replayed, not only the ones kept:
    backends see the stored-page count and numbering (flex scans, and compiled
    reads, the whole physical cache; vLLM renumbers it), so an uncompacted
    candidate would cost more to replay and need not give the same bits.
    """
    ids = referenced_pages(snapshot.steps, snapshot.page_size)
    stored = snapshot.to_stored_index(ids)
    kv = compact_cache(snapshot.kv_cache, snapshot.meta.kv_layout, stored)
    return replace(snapshot, kv_cache=kv, page_ids=ids.to(snapshot.page_ids.dtype), path=None)


def bake_step(snapshot: "Snapshot", step: int) -> "Snapshot":
    """A one-step snapshot of ``step`` whose cache already holds every earlier step's update."""
    cache = working_cache(snapshot)
    for earlier in range(step):
        apply_step_update(snapshot, cache, earlier)
    baked = replace(snapshot, kv_cache=cache, steps=[snapshot.steps[step]], meta=replace(snapshot.meta, num_steps=1),
                    path=None)
    return _compact(baked)


def select_requests(snapshot: "Snapshot", keep: Sequence[int]) -> "Snapshot":
    """Keep the requests ``keep`` (in this order) of a one-step snapshot, renumbering rows and tokens."""
    step = snapshot.steps[0]
    qsl = step.query_start_loc.to(torch.int64).tolist()
    rows = torch.tensor(list(keep), dtype=torch.int64)
    tokens = torch.tensor([t for r in keep for t in range(qsl[r], qsl[r + 1])], dtype=torch.int64)
    lens = [qsl[r + 1] - qsl[r] for r in keep]
    new_qsl = torch.tensor([0] + _running(lens), dtype=step.query_start_loc.dtype)

    def rows_of(t: "torch.Tensor | None") -> "torch.Tensor | None":
        return None if t is None else t.index_select(0, tokens)

    new = replace(step, block_table=step.block_table.index_select(0, rows), seq_lens=step.seq_lens.index_select(0, rows),
                  query_start_loc=new_qsl, query=rows_of(step.query), key=rows_of(step.key),
                  value=rows_of(step.value), slot_mapping=rows_of(step.slot_mapping), output=rows_of(step.output))
    return _compact(replace(snapshot, steps=[new]))


def select_kv_heads(snapshot: "Snapshot", keep: Sequence[int]) -> "Snapshot":
    """Keep KV heads ``keep`` and their query-head groups; the layer's head counts shrink accordingly."""
    layer = snapshot.meta.layer
    group = layer.group_size
    kv_idx = torch.tensor(list(keep), dtype=torch.int64)
    q_idx = torch.tensor([k * group + g for k in keep for g in range(group)], dtype=torch.int64)
    kv = snapshot.kv_cache.index_select(kv_head_dim(snapshot.meta.kv_layout), kv_idx).contiguous()
    step = snapshot.steps[0]

    def pick(t, idx):
        return None if t is None else t.index_select(1, idx).contiguous()

    new = replace(step, query=pick(step.query, q_idx), key=pick(step.key, kv_idx), value=pick(step.value, kv_idx),
                  output=pick(step.output, q_idx))
    meta = replace(snapshot.meta, layer=replace(layer, num_heads=len(q_idx), num_kv_heads=len(kv_idx)))
    # A query head's sink logit and ALiBi slope go with it.
    values = {name: t.index_select(0, q_idx) for name, t in snapshot.layer_tensors().items()}
    return replace(snapshot, meta=meta, kv_cache=kv, steps=[new], path=None, **values)


def drop_pages(snapshot: "Snapshot", request: int, logical_pages: Iterable[int]) -> "Snapshot":
    """Remove whole logical pages (before the query block) from one request: its row and seq_len shrink."""
    drop = set(logical_pages)
    if not drop:
        return snapshot
    step = snapshot.steps[0]
    ps = snapshot.page_size
    table = step.block_table.clone()
    row = table[request].tolist()
    length = int(step.seq_lens[request])
    live = -(-length // ps)
    kept = [p for j, p in enumerate(row[:live]) if j not in drop]
    table[request] = torch.tensor(kept + row[live:] + [0] * len(drop), dtype=table.dtype)
    lens = step.seq_lens.clone()
    lens[request] = length - ps * len(drop)
    return _compact(replace(snapshot, steps=[replace(step, block_table=table, seq_lens=lens)]))


def trim_table(snapshot: "Snapshot") -> "Snapshot":
    """Drop block-table columns past every request's live pages (their stale tails)."""
    step = snapshot.steps[0]
    ps = snapshot.page_size
    width = max([-(-int(n) // ps) for n in step.seq_lens.tolist()] + [1])
    if width >= step.block_table.shape[1]:
        return snapshot
    table = step.block_table[:, :width].contiguous()
    return replace(snapshot, steps=[replace(step, block_table=table)], path=None)


def droppable_pages(snapshot: "Snapshot", request: int) -> list[int]:
    """Logical pages of ``request`` lying wholly before its query block (no query token, no new K/V)."""
    step = snapshot.steps[0]
    length = int(step.seq_lens[request])
    qlen = step.query_lens[request]
    return list(range((length - qlen) // snapshot.page_size))


def _running(values: Iterable[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out


# --------------------------------------------------------------------------- the shrinker


def same_failure(seen_pairs: frozenset, seen_finds: frozenset, want_pairs: frozenset, want_finds: frozenset) -> bool:
    """The rule a candidate must meet (all in the input's numbering).

    Error findings must be exactly the kept ones: a new error code is a different bug. Every kept
    failing head must still fail; other heads of an already failing request may start failing too,
    because removing context (dropped pages, other requests' tokens) only makes the same error weigh
    more in each softmax. A head of a request that did not fail must not start failing.
    """
    if not (want_pairs or want_finds) or seen_finds != want_finds or not want_pairs <= seen_pairs:
        return False
    failing_requests = {r for r, _ in want_pairs}
    return all(r in failing_requests for r, _ in seen_pairs)


class _Shrinker:
    def __init__(self, signature: Signature, device: str, progress: Callable[[str], None] | None):
        self.signature = signature
        self.progress = progress
        self.replays = 0
        # One context for every candidate: its backends are made once per layer (the head pass changes it).
        self.context = ReplayContext(["reference", signature.backend], ReplayOptions(device=device))

    def observe(self, candidate: "Snapshot") -> Observation:
        return observe(candidate, self.signature.backend, 0, context=self.context)

    def reproduces(self, candidate: "Snapshot", requests: Sequence[int], heads: Sequence[int]) -> bool:
        """Does ``candidate`` (keeping input requests/heads ``requests``/``heads``) fail the same way?"""
        try:
            validate(candidate)
        except KvdbgError:
            return False
        self.replays += 1
        try:
            obs = self.observe(candidate)
        except KvdbgError:
            return False
        if not obs.available:
            return False
        seen_pairs = frozenset((requests[r], heads[h]) for r, h in obs.failing_heads)
        seen_finds = frozenset((c, None if r is None else requests[r]) for c, r in obs.error_findings)
        want_pairs, want_finds = self.signature.restricted(requests, heads)
        # Each part of the signature that the input showed must survive: otherwise dropping the failing
        # heads would leave a "failure" made of findings alone, or the other way round.
        if (self.signature.failing_heads and not want_pairs) or (self.signature.error_findings and not want_finds):
            return False
        return same_failure(seen_pairs, seen_finds, want_pairs, want_finds)


def shrink(snapshot: "Snapshot", backend: str | None = None, *, device: str = "cpu",
           progress: Callable[[str], None] | None = None, output_path: str | None = None,
           overwrite: bool = False, same_heads: bool = True) -> ShrinkResult:
    """Reduce ``snapshot`` while its failure keeps reproducing; write it to ``output_path`` if given.

    With ``same_heads`` every failing head of the requests kept stays in the output (and still
    fails); without it the head pass may drop failing heads too, keeping at least one.
    """
    import os

    started = time.perf_counter()
    if output_path is not None:  # refused before minutes of replays, not after
        check_output(output_path, overwrite=overwrite)
    say = progress or (lambda message: None)
    signature = failure_signature(snapshot, backend, device=device, progress=progress)
    shrinker = _Shrinker(signature, device, progress)
    shrinker.replays = 1
    step = signature.step
    before_bytes = tensor_bytes(snapshot)
    input_step = snapshot.steps[step]
    tokens_before = int(input_step.seq_lens.sum())
    passes: list[PassRecord] = []
    layer = snapshot.meta.layer
    requests = list(range(input_step.num_reqs))
    heads = list(range(layer.num_heads))
    kv_heads = list(range(layer.num_kv_heads))

    def record(name: str, count: int, removed: str) -> None:
        passes.append(PassRecord(name, count, removed, tensor_bytes(current)))
        say(f"{name}: {count} candidate(s); {removed or 'nothing removed'}")

    # 1. steps
    say(f"failure: {signature.backend} at step {step} ({len(signature.failing_heads)} failing head(s), "
        f"{len(signature.error_findings)} error finding(s)); shrinking")
    current = bake_step(snapshot, step)
    count = shrinker.replays
    if not shrinker.reproduces(current, requests, heads):
        raise OptionError(f"the failure of {signature.backend} at step {step} does not reproduce once earlier "
                          "steps' updates are baked into the cache; cannot shrink this snapshot")
    dropped_steps = len(snapshot.steps) - 1
    record("steps", shrinker.replays - count,
           f"{dropped_steps} step(s) (earlier updates baked into the cache)" if dropped_steps else "")

    # 2. requests
    count = shrinker.replays
    base = current

    def test_requests(subset: list[int]) -> bool:
        return bool(subset) and shrinker.reproduces(select_requests(base, subset), [requests[i] for i in subset], heads)

    kept = ddmin(range(len(requests)), test_requests)
    if len(kept) < len(requests):
        current = select_requests(base, kept)
    record("requests", shrinker.replays - count,
           f"{len(requests) - len(kept)} of {len(requests)} requests" if len(kept) < len(requests) else "")
    requests = [requests[i] for i in kept]

    # 3. heads (KV heads with their query groups)
    count = shrinker.replays
    base = current
    group = layer.group_size

    def heads_of(kv_subset: list[int]) -> list[int]:
        return [heads[k * group + g] for k in kv_subset for g in range(group)]

    # KV heads holding a failing query head of a kept request stay: the shrunk file must fail on the
    # same heads as the input, so only the other KV heads are candidates for removal.
    required = sorted({heads.index(h) // group for r, h in signature.failing_heads if r in requests}) \
        if same_heads else []

    def with_required(subset: list[int]) -> list[int]:
        return sorted(set(subset) | set(required))

    def test_heads(subset: list[int]) -> bool:
        chosen = with_required(subset)
        return bool(chosen) and shrinker.reproduces(select_kv_heads(base, chosen), requests, heads_of(chosen))

    optional = [k for k in range(len(kv_heads)) if k not in required]
    kept = with_required(ddmin(optional, test_heads, allow_empty=bool(required)))
    if len(kept) < len(kv_heads):
        current = select_kv_heads(base, kept)
        removed = f"{len(kv_heads) - len(kept)} of {len(kv_heads)} KV heads (with their query heads)"
    else:
        removed = ""
    heads, kv_heads = heads_of(kept), [kv_heads[k] for k in kept]
    record("heads", shrinker.replays - count, removed)

    # 4. sequences: whole pages before each request's query block
    count = shrinker.replays
    pages_removed = 0
    for r in range(len(requests)):
        base = current
        candidates = droppable_pages(base, r)
        if not candidates:
            continue

        def test_pages(keep_pages: list[int], base=base, r=r, candidates=candidates) -> bool:
            drop = set(candidates) - set(keep_pages)
            return shrinker.reproduces(drop_pages(base, r, drop), requests, heads)

        keep_pages = ddmin(candidates, test_pages, allow_empty=True)
        drop = set(candidates) - set(keep_pages)
        if drop:
            current = drop_pages(base, r, drop)
            pages_removed += len(drop)
        say(f"sequences: request {r}: {len(drop)} of {len(candidates)} leading pages dropped")
    record("sequences", shrinker.replays - count,
           f"{pages_removed} whole page(s) before query blocks ({pages_removed * snapshot.page_size} tokens)"
           if pages_removed else "")

    # 5. stale table columns
    count = shrinker.replays
    trimmed = trim_table(current)
    removed = ""
    if trimmed is not current and shrinker.reproduces(trimmed, requests, heads):
        removed = (f"{current.steps[0].block_table.shape[1] - trimmed.steps[0].block_table.shape[1]} "
                   "stale block-table column(s)")
        current = trimmed
    record("table width", shrinker.replays - count, removed)

    final = shrinker.replays
    obs = shrinker.observe(current)
    shrinker.replays = final + 1
    capture = dict(current.meta.capture)
    capture["shrink"] = {"source": snapshot.path, "backend": signature.backend, "step": step,
                         "requests": requests, "heads": heads, "kv_heads": kv_heads}
    note = (f"shrunk by kvdbg shrink from {snapshot.path or 'a snapshot'} (step {step}); failure kept: "
            f"{signature.backend}")
    notes = f"{current.meta.notes}\n{note}" if current.meta.notes else note
    current = replace(current, meta=replace(current.meta, capture=capture, notes=notes))
    output_bytes = tensor_bytes(current)
    if output_path is not None:
        save_snapshot(current, output_path, overwrite=overwrite)
        output_bytes = os.path.getsize(output_path)
        current = replace(current, path=output_path)
    input_bytes = before_bytes
    if snapshot.path is not None:
        input_bytes = os.path.getsize(snapshot.path)
    return ShrinkResult(
        input_path=snapshot.path, output_path=output_path, input_bytes=input_bytes, output_bytes=output_bytes,
        backend=signature.backend, signature=signature, kept_requests=requests, kept_heads=heads,
        kept_kv_heads=kv_heads, steps_before=len(snapshot.steps), pages_before=snapshot.num_pages,
        pages_after=current.num_pages, tokens_before=tokens_before, tokens_after=int(current.steps[0].seq_lens.sum()),
        failing_heads_after=sorted(obs.failing_heads), passes=passes, replays=shrinker.replays,
        seconds=time.perf_counter() - started, snapshot=current)
