"""Where the attention went: one query token's weights over the key positions, the reference against each backend.

For one (step, request, query head, query token), the exact logits
``scale · q·k`` (soft-capped where the layer caps them) are computed in
float64 over the request's logical keys, gathered through the block table
from the cache as the step saw it (earlier steps' updates applied). Each
column then gets the softmax over the keys *it* attends to:

- ``reference``: the exact mask (kvdbg.ts.window.exact_visible_range);
- ``flashinfer_ts``: the keys the prims_ts kernel attends to after the
  builder's page-aligned window restriction (kvdbg.moves.picture.flashinfer_ts_grid);
- ``flex`` and ``vllm_flex``: the keys flex's BlockMask tiles list and its
  mask_mod keeps through the physical-to-logical map (kvdbg.moves.picture.flex_grid):
  the null block (engine page 0) and the earlier entry of a page listed twice
  get no weight.

These are the weights each backend effectively applied *if* it computed the
softmax the attended set implies; the picture checks that claim: ``Σ w·v`` is
held against the output the backend really produced in the replay, token and
head, under the replay's own tolerance, and a column whose output the weights
do not reproduce says so. The mass on keys the exact mask hides (weights a
backend must not give) and the reference's mass on keys a backend skipped are
numbers, with the keys that carry them.

A key whose K holds NaN or Inf gives every column that attends to it NaN
weights (its logit is NaN, and so is the softmax); one whose V does gives NaN
to Σ w·v. The keys are listed, each column says which of them it reads, and
the masses over NaN weights stay NaN: never a number that looks clean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from kvdbg.errors import OptionError
from kvdbg.moves.picture import EXTRA, MISSED, SEEN, StepTables, flashinfer_ts_grid, flex_grid, reference_grid
from kvdbg.ts.window import cdiv, exact_visible_range

if TYPE_CHECKING:
    from kvdbg.replayer.runner import ReplayReport
    from kvdbg.snapshot.store import Snapshot

MAX_LISTED_KEYS = 16  # keys listed by name per column (the largest weights first); the mass counts every key
# kvdbg backends whose attended keys kvdbg.moves.picture models, by the rule that models them.
MODELLED = {"reference": "reference", "flashinfer_ts": "flashinfer_ts", "flex": "flex", "vllm_flex": "flex"}
RULES = {
    "reference": "the exact mask",
    "flashinfer_ts": "the keys the prims_ts kernel attends to after the builder's page-aligned restriction",
    "flex": "the keys flex's BlockMask tiles list and its mask_mod keeps (physical -> logical map)",
}


@dataclass
class ColumnWeights:
    """One column's weights over the picture's key span, and what they mean."""

    backend: str
    rule: str  # which keys it attends to, in words
    attended: list[tuple[int, int]]  # [lo, hi) key intervals the column gives weight to
    weights: list[float] | None  # over [span_lo, span_hi); None when the column has none (note says why)
    forbidden_mass: float = 0.0  # weight on keys the exact mask hides
    forbidden_keys: list[tuple[int, float]] = field(default_factory=list)  # (key, weight), largest first
    forbidden_count: int = 0
    missed_mass: float = 0.0  # the reference's weight on exact keys this column skips
    missed_keys: list[tuple[int, float]] = field(default_factory=list)  # (key, reference weight), largest first
    missed_count: int = 0
    max_weight_diff: float = 0.0  # max |w - w_reference| over the span
    output_diff: float | None = None  # max |Σ w·v - the column's replayed output| over the head dimension
    output_allowed: float | None = None  # the replay's tolerance at the element closest to failing it
    reproduces: bool | None = None  # Σ w·v is the output the backend produced, within the replay's tolerance
    exact_output_diff: float | None = None  # max |Σ w_reference·v - the column's output|: its error at this token
    output_nonfinite: bool = False  # Σ w·v holds NaN/Inf (reproduces then says whether the output does too)
    nonfinite_k_read: list[int] = field(default_factory=list)  # attended keys whose K holds NaN/Inf (first ones)
    nonfinite_v_read: list[int] = field(default_factory=list)  # attended keys whose V holds NaN/Inf (first ones)
    nonfinite_k_count: int = 0
    nonfinite_v_count: int = 0
    note: str = ""
    # Of the forbidden keys, those the backend's documented behaviour shows (FLASHINFER_TS's page-aligned window
    # restriction): never a failure by themselves (kvdbg.judge.verdict), stated with their share of the weight.
    documented_mass: float = 0.0
    documented_count: int = 0

    @property
    def reads_nonfinite(self) -> bool:
        """It attends to a key holding NaN/Inf in K (its weights are NaN) or V (its Σ w·v is)."""
        return bool(self.nonfinite_k_count or self.nonfinite_v_count)

    def to_json(self) -> dict[str, Any]:
        return {"backend": self.backend, "rule": self.rule, "attended": [list(x) for x in self.attended],
                "forbidden_mass": self.forbidden_mass, "forbidden_count": self.forbidden_count,
                "forbidden_keys": [{"key": k, "weight": w} for k, w in self.forbidden_keys],
                "missed_mass": self.missed_mass, "missed_count": self.missed_count,
                "missed_keys": [{"key": k, "reference_weight": w} for k, w in self.missed_keys],
                "max_weight_diff": self.max_weight_diff, "output_diff": self.output_diff,
                "output_allowed": self.output_allowed, "reproduces_output": self.reproduces,
                "exact_output_diff": self.exact_output_diff, "output_nonfinite": self.output_nonfinite,
                "nonfinite_k_keys_read": self.nonfinite_k_read, "nonfinite_k_count": self.nonfinite_k_count,
                "nonfinite_v_keys_read": self.nonfinite_v_read, "nonfinite_v_count": self.nonfinite_v_count,
                "documented_mass": self.documented_mass, "documented_count": self.documented_count,
                "note": self.note, "weights": self.weights}


@dataclass
class AttentionPicture:
    """One query token's attention, the reference's and each backend's, over the request's keys."""

    snapshot: str | None
    step: int
    request: int
    head: int
    kv_head: int
    token: int  # within the request's query block
    position: int  # p = L - q + token
    seq_len: int
    query_len: int
    page_size: int
    window: int | None
    causal: bool
    exact: tuple[int, int]  # [lo, hi) keys the exact mask shows this token
    span: tuple[int, int]  # [lo, hi) keys the weights cover (every column's attended keys and the null block's)
    focus: int  # a key worth the zoom: the first the columns disagree on, else the window's edge
    null_block: list[tuple[int, int]]  # [lo, hi) keys of live table entries holding engine page 0
    hidden: list[tuple[int, int]]  # keys of live entries the physical -> logical map does not point back to
    stale_entries: list[int]  # table columns past the live pages that hold a page id (never read)
    chosen: str  # why this token
    columns: list[ColumnWeights]
    notes: list[str] = field(default_factory=list)
    nonfinite_k: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) keys whose K holds NaN/Inf
    nonfinite_v: list[tuple[int, int]] = field(default_factory=list)  # [lo, hi) keys whose V holds NaN/Inf
    query_nonfinite: bool = False  # the query token itself holds NaN/Inf: every logit is NaN

    def column(self, backend: str) -> ColumnWeights | None:
        return next((c for c in self.columns if c.backend == backend), None)

    def to_json(self) -> dict[str, Any]:
        return {"snapshot": self.snapshot, "step": self.step, "request": self.request, "head": self.head,
                "kv_head": self.kv_head, "token": self.token, "position": self.position, "seq_len": self.seq_len,
                "query_len": self.query_len, "page_size": self.page_size, "window": self.window,
                "causal": self.causal, "exact_keys": list(self.exact), "span": list(self.span), "focus": self.focus,
                "null_block_keys": [list(x) for x in self.null_block], "hidden_keys": [list(x) for x in self.hidden],
                "stale_table_columns": self.stale_entries, "chosen": self.chosen, "notes": self.notes,
                "nonfinite_k_keys": [list(x) for x in self.nonfinite_k],
                "nonfinite_v_keys": [list(x) for x in self.nonfinite_v], "query_nonfinite": self.query_nonfinite,
                "columns": [c.to_json() for c in self.columns]}


# --------------------------------------------------------------------------- choosing the token


@dataclass(frozen=True)
class Choice:
    step: int
    request: int
    head: int
    token: int
    why: str


def choose(snapshot: "Snapshot", report: "ReplayReport | None", *, step: int | None, request: int | None,
           head: int | None, token: int | None, backends: list[str] | None = None) -> Choice:
    """The token to picture: what was asked for; what was not comes from the worst failing head (else the worst)."""
    from kvdbg.judge.errormap import error_pictures, worst_failing

    worst = None
    if report is not None and None in (step, request, head, token):
        pictures = error_pictures(report)
        found = worst_failing(pictures, backends)
        if found is not None:
            m, cell = found
            # Only a worst cell inside what was asked for decides the rest.
            if (step in (None, cell.step) and request in (None, cell.request) and head in (None, cell.head)):
                worst = (m, cell)
    num_steps = len(snapshot.steps)
    if worst is not None:
        m, cell = worst
        state = "fails" if cell.failed else "no head fails; the largest error"
        why = (f"the worst head of {m.actual} vs {m.expected} ({state}: max abs {cell.max_abs:.2e} at this token)")
        step = cell.step if step is None else step
        request = cell.request if request is None else request
        head = cell.head if head is None else head
        token = cell.worst_token if token is None else token
    else:
        why = "as asked" if None not in (step, request, head, token) else \
            "nothing compared to choose from: the longest request, head 0, its last query token"
    step = 0 if step is None else step
    if not 0 <= step < num_steps:
        raise OptionError(f"--step {step} is out of range: the snapshot has {num_steps} step(s)")
    s = snapshot.steps[step]
    lens = [int(x) for x in s.seq_lens.tolist()]
    if request is None:
        request = max(range(len(lens)), key=lambda r: (lens[r], -r)) if lens else 0
    if not 0 <= request < len(lens):
        raise OptionError(f"--request {request} is out of range: step {step} has {len(lens)} request(s)")
    heads = snapshot.meta.layer.num_heads
    head = 0 if head is None else head
    if not 0 <= head < heads:
        raise OptionError(f"--head {head} is out of range: the layer has {heads} heads")
    starts = [int(x) for x in s.query_start_loc.tolist()]
    qlen = starts[request + 1] - starts[request]
    if qlen <= 0:
        raise OptionError(f"request {request} of step {step} has no query token")
    token = qlen - 1 if token is None else token
    if not 0 <= token < qlen:
        raise OptionError(f"--token {token} is out of range: request {request} has {qlen} query token(s)")
    return Choice(step, request, head, token, why)


# --------------------------------------------------------------------------- the weights


def attention_picture(snapshot: "Snapshot", choice: Choice, report: "ReplayReport | None" = None, *,
                      backends: list[str] | None = None,
                      progress: Callable[[str], None] | None = None) -> AttentionPicture:
    """The weights of ``choice``'s token; ``report`` (a replay of its step) supplies the outputs to check against."""
    import torch

    from kvdbg.snapshot.cache import apply_step_update, replay_cache

    from kvdbg.snapshot.layout import as_fp8, dequantize_fp8, kv_views
    from kvdbg.ts.window import analyze_window

    meta, layer = snapshot.meta, snapshot.meta.layer
    ps = snapshot.page_size
    step, request, head, token = choice.step, choice.request, choice.head, choice.token
    s = snapshot.steps[step]
    lens = [int(x) for x in s.seq_lens.tolist()]
    starts = [int(x) for x in s.query_start_loc.tolist()]
    length, qlen = lens[request], starts[request + 1] - starts[request]
    position = length - qlen + token
    kv_head = head // (layer.num_heads // layer.num_kv_heads)
    if progress:
        progress(f"gathering request {request}'s keys (step {step})")
    cache = replay_cache(snapshot, "cpu", range(step + 1))
    for earlier in range(step + 1):
        apply_step_update(snapshot, cache, earlier)
    k_pages, v_pages = kv_views(meta, cache)
    live = cdiv(length, ps)
    table = snapshot.stored_block_table(step)[request, :live].to(torch.int64)
    present = table >= 0
    index = table.clamp_min(0)

    def gather(pages, scale):
        picked = pages[index, kv_head]  # [live, ps, D]
        values = dequantize_fp8(picked, scale, torch.float64) if layer.is_fp8 else picked.to(torch.float64)
        values = values.masked_fill(~present.view(-1, 1, 1), float("nan"))
        return values.reshape(live * ps, -1)[:length]

    keys, values = gather(k_pages, layer.k_scale), gather(v_pages, layer.v_scale)
    q = s.query[starts[request] + token, head]
    q = dequantize_fp8(as_fp8(q), layer.q_scale, torch.float64) if layer.is_fp8 and q.dtype in (
        torch.uint8, torch.float8_e4m3fn) else q.to(torch.float64)
    logits = (keys @ q) * layer.scale
    # NaN/Inf in the cache is what a user chases: which keys hold it, so that each column can say which it reads.
    bad_k = ~torch.isfinite(keys).all(dim=1)
    bad_v = ~torch.isfinite(values).all(dim=1)
    query_nonfinite = not bool(torch.isfinite(q).all())
    if layer.logits_soft_cap:
        logits = torch.tanh(logits / layer.logits_soft_cap) * layer.logits_soft_cap
    # The layer's own terms, as the reference applies them: the ALiBi bias after the soft cap, and the head's
    # sink logit in the softmax's denominator (it takes weight from every key, and holds no value).
    if layer.has_alibi and snapshot.alibi_slopes is not None:
        from kvdbg.backends.reference import _alibi_offsets

        distance = position - torch.arange(length, dtype=torch.float64)
        logits = logits + float(snapshot.alibi_slopes[head]) * _alibi_offsets(distance, layer.alibi_sqrt,
                                                                               torch.float64)
    sink = float(snapshot.sinks[head]) if layer.has_sinks and snapshot.sinks is not None else None

    # Who attends to which keys: kvdbg.moves.picture's grids, one row per query token.
    exact = exact_visible_range(length, qlen, token, layer.sliding_window, layer.causal)
    tables = _step_tables(snapshot, step)
    notes: list[str] = []
    try:
        analysis = analyze_window(length, layer.sliding_window, query_len=qlen, page_size=ps, causal=layer.causal,
                                  max_model_len=meta.backend.max_model_len,
                                  max_decode_query_len=meta.backend.max_decode_query_len)
    except OptionError as exc:
        analysis = None
        notes.append(f"FLASHINFER_TS's builder cannot be modelled for this request: {exc}")
    rows: dict[str, list] = {"reference": [(exact[0], exact[1], SEEN)]}
    if analysis is not None:
        rows["reference"] = reference_grid(analysis).rows[token]
        rows["flashinfer_ts"] = flashinfer_ts_grid(analysis).rows[token]
        rows["flex"] = flex_grid(analysis, tables, request).rows[token]
    runs = _runs(report, step)
    names = ["reference"] + [n for n in (backends or list(runs) or ["flex", "flashinfer_ts"]) if n != "reference"]

    # Every column's attended keys, the null block's, and the exact window decide the span of the arrays.
    columns: list[ColumnWeights] = []
    attended_by: dict[str, list[tuple[int, int]]] = {}
    for name in names:
        rule = MODELLED.get(name)
        if rule is None or rule not in rows:
            continue
        attended_by[name] = [(lo, hi) for lo, hi, kind in rows[rule] if kind in (SEEN, EXTRA)]
    null_block, hidden = _null_and_hidden(tables, request, ps, length)
    edges = [x for spans in attended_by.values() for a, b in spans for x in (a, b)] + \
        [x for a, b in null_block + hidden for x in (a, b)] + list(exact)
    span = (max(0, min(edges)), min(length, max(edges))) if edges else (0, length)
    ref_w = _softmax(logits, attended_by.get("reference", [exact]), length, sink)
    for name in names:
        rule = MODELLED.get(name)
        status = runs.get(name)
        if rule is None:
            columns.append(ColumnWeights(name, "", [], None, note=f"kvdbg does not model {name}'s attended keys"))
            continue
        if name not in attended_by:
            columns.append(ColumnWeights(name, RULES[rule], [], None, note=notes[0] if notes else "not modelled"))
            continue
        col = ColumnWeights(name, RULES[rule] + ("; vLLM's own flex code, by flex's rule" if name == "vllm_flex"
                                                 else ""), attended_by[name], None)
        reason = _not_run(status, name, starts[request] + token)
        if reason:
            col.note = reason
        w = ref_w if name == "reference" else _softmax(logits, attended_by[name], length, sink)
        col.weights = [float(x) for x in w[span[0]:span[1]]]
        keys_all = torch.arange(length)
        inside = (keys_all >= exact[0]) & (keys_all < exact[1])
        attended = torch.zeros(length, dtype=torch.bool)
        for lo, hi in attended_by[name]:
            attended[lo:hi] = True
        col.nonfinite_k_count, col.nonfinite_k_read = _listed(attended & bad_k)
        col.nonfinite_v_count, col.nonfinite_v_read = _listed(attended & bad_v)
        # A NaN weight is a weight given (of unknown size): outside the mask it is never "no weight".
        forbidden = ((w > 0) | w.isnan()) & ~inside
        col.forbidden_mass = float(w[forbidden].sum()) if bool(forbidden.any()) else 0.0
        col.forbidden_count = int(sum(hi - lo for lo, hi in attended_by[name]) - _overlap(attended_by[name], exact))
        col.forbidden_keys = _top(w, forbidden)
        if rule == "flashinfer_ts" and analysis is not None and analysis.applies:
            # The extra keys of the ts grid are the page-aligned restriction's, computed from the builder's
            # documented rule (kvdbg.ts.window): FLASHINFER_TS's behaviour, not a deviation from it.
            documented = torch.zeros(length, dtype=torch.bool)
            for lo, hi, kind in rows["flashinfer_ts"]:
                if kind == EXTRA:
                    documented[lo:hi] = True
            col.documented_count = int((documented & ~inside).sum())
            by_design = forbidden & documented
            col.documented_mass = float(w[by_design].sum()) if bool(by_design.any()) else 0.0
        if name != "reference":
            seen = torch.zeros(length, dtype=torch.bool)
            for lo, hi in attended_by[name]:
                seen[lo:hi] = True
            missed = inside & ~seen
            col.missed_count = int(missed.sum())
            col.missed_mass = float(ref_w[missed].sum()) if col.missed_count else 0.0
            col.missed_keys = _top(ref_w, missed)
        diff = (w - ref_w).abs()
        col.max_weight_diff = float(diff.max()) if diff.numel() else 0.0
        if status is not None and not reason:
            col.output_diff, col.output_allowed, col.reproduces, col.output_nonfinite = _output_check(
                w, values, status, starts[request] + token, head, snapshot, report)
            if name != "reference":
                col.exact_output_diff = _output_check(ref_w, values, status, starts[request] + token, head, snapshot,
                                                      report)[0]
        columns.append(col)
    stale = [c for c, page in enumerate(tables.block_table[request][live:], start=live) if page > 0]
    focus = _focus(columns, exact)
    return AttentionPicture(
        snapshot=snapshot.path, step=step, request=request, head=head, kv_head=kv_head, token=token,
        position=position, seq_len=length, query_len=qlen, page_size=ps, window=layer.sliding_window,
        causal=layer.causal, exact=exact, span=span, focus=focus, null_block=null_block, hidden=hidden,
        stale_entries=stale, chosen=choice.why, columns=columns, notes=notes, nonfinite_k=_intervals(bad_k),
        nonfinite_v=_intervals(bad_v), query_nonfinite=query_nonfinite)


def _step_tables(snapshot: "Snapshot", step: int) -> StepTables:
    s = snapshot.steps[step]
    return StepTables(block_table=[[int(x) for x in row] for row in s.block_table.tolist()],
                      seq_lens=[int(x) for x in s.seq_lens.tolist()],
                      query_start_loc=[int(x) for x in s.query_start_loc.tolist()],
                      page_ids=[int(x) for x in snapshot.page_ids.tolist()])


def _null_and_hidden(tables: StepTables, request: int, ps: int, length: int):
    """Keys of live entries holding engine page 0, and of live entries flex's map does not point back to."""
    row = tables.block_table[request][:cdiv(length, ps)]
    last: dict[int, int] = {}
    for col, page in enumerate(row):
        last[page] = col
    null, hidden = [], []
    for col, page in enumerate(row):
        keys = (col * ps, min(length, (col + 1) * ps))
        if page == 0:
            null.append(keys)
        elif last[page] != col:
            hidden.append(keys)
    return _merge(null), _merge(hidden)


def _merge(intervals):
    out = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _overlap(intervals, exact) -> int:
    return sum(max(0, min(hi, exact[1]) - max(lo, exact[0])) for lo, hi in intervals)


def _softmax(logits, attended, length, sink: float | None = None):
    """The weights of the attended keys; ``sink``: a logit that joins the denominator with no key (sinks)."""
    import torch

    mask = torch.zeros(length, dtype=torch.bool)
    for lo, hi in attended:
        mask[lo:hi] = True
    out = torch.zeros(length, dtype=torch.float64)
    if not bool(mask.any()):
        return out
    picked = logits[mask]
    if sink is None:
        out[mask] = torch.softmax(picked, dim=0)
    else:
        with_sink = torch.softmax(torch.cat([picked, picked.new_tensor([sink])]), dim=0)
        out[mask] = with_sink[:-1]
    return out


def _top(weights, where, most: int = MAX_LISTED_KEYS) -> list[tuple[int, float]]:
    import torch

    keys = where.nonzero().flatten()
    if keys.numel() == 0:
        return []
    values = weights[keys]
    order = torch.argsort(values, descending=True, stable=True)[:most]
    return [(int(keys[i]), float(values[i])) for i in order]


def _focus(columns: list[ColumnWeights], exact: tuple[int, int]) -> int:
    """The first key holding NaN/Inf that a column reads; else the first key a column attends to outside the exact
    mask or skips inside it; else the window's edge."""
    poisoned = [k for c in columns for k in c.nonfinite_k_read + c.nonfinite_v_read]
    if poisoned:
        return min(poisoned)
    keys = [k for c in columns for k, _ in c.forbidden_keys + c.missed_keys]
    return min(keys) if keys else exact[0]


def _listed(where, most: int = MAX_LISTED_KEYS) -> tuple[int, list[int]]:
    """How many keys ``where`` marks, and the first ``most`` of them."""
    keys = where.nonzero().flatten()
    return int(keys.numel()), [int(k) for k in keys[:most]]


def _intervals(where) -> list[tuple[int, int]]:
    """The [lo, hi) runs of keys ``where`` marks."""
    return _merge([(int(k), int(k) + 1) for k in where.nonzero().flatten()])


def _runs(report: "ReplayReport | None", step: int) -> dict[str, Any]:
    if report is None:
        return {}
    for s in report.result.steps:
        if s.step == step:
            return dict(s.runs)
    return {}


def _not_run(run, name: str, token_row: int) -> str:
    """Why a column has no output to hold its weights against (empty when it has one)."""
    if run is None:
        return f"{name} did not run in this replay: the weights are its rule's, not checked against an output"
    if run.error:
        return f"{name} raised: {run.error}"
    if run.not_applicable is not None:
        return f"{name} does not run this step: {run.not_applicable}"
    if run.output is None:
        return f"{name} produced no output"
    if run.written is not None and not bool(run.written[token_row]):
        return (f"{name} did not write this token (what its kernel would do is undefined): the weights are its "
                "rule's, not what ran")
    return ""


def _output_check(weights, values, run, row: int, head: int, snapshot, report) -> tuple[float, float, bool, bool]:
    """max |Σ w·v - output| over the head dimension, the replay's tolerance where it is tightest, whether every
    element is within it, and whether Σ w·v holds NaN/Inf.

    An element that is NaN/Inf in both Σ w·v and the output agrees (the weights predict the NaN the backend
    wrote); then the difference is NaN, since there is no number to state. One non-finite on one side only
    differs."""
    import torch

    from kvdbg.judge.compare import default_tolerance, fp8_query_allowance
    from kvdbg.snapshot.layout import holds_fp8

    mixed = torch.where(weights.unsqueeze(1) > 0, values, torch.zeros_like(values))  # NaN keys it skips stay out
    predicted = weights @ mixed
    actual = run.output[row, head].detach().to("cpu", torch.float64)
    dtype = run.info.dtype if run.info is not None else snapshot.meta.layer.dtype
    fp8_query = None
    if snapshot.meta.layer.is_fp8 and holds_fp8(snapshot.steps[run.step].query):
        # The step's P·V ran on FP8 operands: the values here are the ones this head's request reads.
        read = mixed.abs()
        read = torch.where(torch.isfinite(read), read, torch.zeros_like(read))
        fp8_query = fp8_query_allowance(read.max() if read.numel() else 0.0, values.shape[0])
    tol = default_tolerance(dtype, fp8=snapshot.meta.layer.is_fp8, fp8_query=fp8_query)
    if report is not None:
        for c in report.comparisons:
            if c.actual == run.backend and c.expected == "reference":
                tol = c.tolerance
                break
    predicted_bad, actual_bad = ~torch.isfinite(predicted), ~torch.isfinite(actual)
    both_bad = predicted_bad & actual_bad
    diff = torch.where(both_bad, torch.zeros_like(predicted), (predicted - actual).abs())
    allowed = tol.atol + tol.rtol * actual.abs().nan_to_num(nan=0.0, posinf=0.0)
    closest = int((diff - allowed).nan_to_num(nan=float("inf")).argmax())
    ok = bool(torch.isfinite(diff).all() and (diff <= allowed).all())
    nonfinite = bool(predicted_bad.any())
    stated = float("nan") if nonfinite or bool(actual_bad.any()) else float(diff.max())
    return stated, float(allowed[closest]), ok, nonfinite


__all__ = ["AttentionPicture", "Choice", "ColumnWeights", "attention_picture", "choose"]
