"""Two snapshots of the same step (good vs bad build), or two `replay -o` files, compared.

Inputs are compared as the backends read them: metadata field by field; the
KV cache *by logical position* -- request r's logical page j in A against its
logical page j in B, whatever physical id each capture gave it, over the keys
both requests hold (tokens past ``seq_len`` are never compared), after each
step's cache update as a replay applies it; block-table ids only to count the
entries placed differently; lengths, query, the step's new K/V, and where the
slot mapping writes them (as a logical position). Pages are read a chunk of
page pairs at a time from the memory-mapped files, and a page pair shared by
many requests is compared once.

Outputs (the engine's captured output of each step, or each backend's saved
output) are compared per request × head with kvdbg.judge.compare's rule, A as the
expected side: exit 1 when they differ beyond tolerance, 0 when not.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kvdbg.errors import OptionError, SnapshotError
from kvdbg.snapshot.format import OUTPUTS_KEY

if TYPE_CHECKING:
    import torch

    from kvdbg.judge.compare import Comparison
    from kvdbg.snapshot.store import Snapshot

KIND_SNAPSHOT = "snapshot"
KIND_OUTPUTS = "outputs"
FIRST_LISTED = 5  # differing items named in the text; --json lists up to MAX_LISTED
MAX_LISTED = 256
PAGE_CHUNK = 256  # page pairs read at once
COMPARE_CHUNK_ELEMENTS = 1 << 22  # output elements per comparison chunk (float64 copies stay ~32 MiB each)


class NotComparable(OptionError):
    """The two files do not hold the same step of the same layer (the message names the field)."""


# --------------------------------------------------------------------------- records


@dataclass
class FieldDiff:
    name: str
    a: Any
    b: Any

    def to_json(self) -> dict:
        return {"field": self.name, "a": self.a, "b": self.b}


@dataclass
class PageDiff:
    """One logical page whose live keys differ."""

    request: int
    logical_page: int
    page_a: int  # engine ids
    page_b: int
    tokens: int  # live tokens of the page whose K or V differ
    max_abs: float
    shared_by: int = 1  # (request, logical page) entries that read this same pair of pages

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class TensorDiff:
    """A per-token tensor (query, key, value) of one step: tokens whose values differ."""

    name: str
    tokens: int
    differ: list[int] = field(default_factory=list)  # token rows that differ (all of them)
    max_abs: float = 0.0
    missing: str | None = None  # "A" / "B": the tensor is only in the other file

    @property
    def same(self) -> bool:
        return not self.differ and self.missing is None

    def to_json(self) -> dict:
        return {"name": self.name, "tokens": self.tokens, "tokens_differ": len(self.differ),
                "first_tokens": self.differ[:MAX_LISTED], "max_abs": self.max_abs, "missing": self.missing}


@dataclass
class StepDiff:
    step: int
    requests: int = 0
    seq_lens: list[tuple[int, int, int]] = field(default_factory=list)  # (request, A, B) that differ
    query_lens: list[tuple[int, int, int]] = field(default_factory=list)
    table_width: tuple[int, int] = (0, 0)
    live_entries: int = 0  # (request, logical page) entries both captures hold live
    moved_entries: int = 0  # of those, at another engine id in B (placement only)
    stale_differ: int = 0  # entries past both requests' live pages whose ids differ
    logical_pages: int = 0  # (request, logical page) entries compared by content
    page_pairs: int = 0  # distinct (A page, B page) pairs read
    pages: list[PageDiff] = field(default_factory=list)  # every differing pair (first MAX_LISTED kept)
    pages_differ: int = 0  # (request, logical page) entries whose content differs
    slots_differ: int = 0  # live (page, token) slots that differ, counted once per page pair
    pages_max_abs: float = 0.0
    tensors: list[TensorDiff] = field(default_factory=list)
    slots_moved: list[int] = field(default_factory=list)  # tokens whose new K/V go to another logical position

    @property
    def inputs_differ(self) -> list[str]:
        out = []
        if self.seq_lens:
            out.append("seq_lens")
        if self.query_lens:
            out.append("query_start_loc")
        if self.pages_differ:
            out.append("pages")
        out.extend(t.name for t in self.tensors if not t.same)
        if self.slots_moved:
            out.append("slot_mapping")
        return out

    def to_json(self) -> dict:
        return {"step": self.step, "requests": self.requests,
                "seq_lens": [{"request": r, "a": a, "b": b} for r, a, b in self.seq_lens],
                "query_lens": [{"request": r, "a": a, "b": b} for r, a, b in self.query_lens],
                "table_width": list(self.table_width), "live_entries": self.live_entries,
                "moved_entries": self.moved_entries, "stale_entries_differ": self.stale_differ,
                "logical_pages": self.logical_pages, "page_pairs": self.page_pairs,
                "pages_differ": self.pages_differ, "slots_differ": self.slots_differ,
                "pages_max_abs": self.pages_max_abs, "pages": [p.to_json() for p in self.pages[:MAX_LISTED]],
                "tensors": [t.to_json() for t in self.tensors],
                "slot_mapping_differ": len(self.slots_moved), "slot_mapping_first": self.slots_moved[:MAX_LISTED],
                "inputs_differ": self.inputs_differ}


@dataclass
class SnapDiff:
    kind: str
    path_a: str
    path_b: str
    meta: list[FieldDiff] = field(default_factory=list)  # inputs: layer, backend, layout, cache dtype
    provenance: list[FieldDiff] = field(default_factory=list)  # capture, notes, kernels: never an input
    steps: list[StepDiff] = field(default_factory=list)
    outputs: list["Comparison"] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # outputs that could not be compared, and why

    @property
    def inputs_differ(self) -> list[str]:
        names = [f.name for f in self.meta]
        for s in self.steps:
            names.extend(n for n in s.inputs_differ if n not in names)
        return names

    def to_json(self) -> dict:
        return {"kind": self.kind, "a": self.path_a, "b": self.path_b,
                "meta": [f.to_json() for f in self.meta],
                "provenance": [f.to_json() for f in self.provenance],
                "steps": [s.to_json() for s in self.steps],
                "inputs_differ": self.inputs_differ,
                "outputs": [c.to_json() for c in self.outputs], "notes": self.notes}


# --------------------------------------------------------------------------- kinds and comparability


def file_kind(path: str) -> tuple[str, dict[str, str], dict]:
    """("snapshot" | "outputs", metadata, tensor directory), from the header alone."""
    from kvdbg.snapshot.format import FORMAT_KEY, read_raw_header

    _, _, metadata, tensors = read_raw_header(path)
    if FORMAT_KEY in metadata:
        return KIND_SNAPSHOT, metadata, tensors
    if OUTPUTS_KEY in metadata:
        return KIND_OUTPUTS, metadata, tensors
    raise SnapshotError(f"{path}: neither a kvdbg snapshot nor a `kvdbg replay -o` file "
                        f"(its metadata has no {FORMAT_KEY!r} or {OUTPUTS_KEY!r})")


def _refuse(name: str, a: Any, b: Any) -> NotComparable:
    return NotComparable(f"not comparable: {name} is {a} in A but {b} in B")


def check_comparable(header_a, header_b) -> None:
    """Raise NotComparable naming the first field that makes two snapshots different steps or layers."""
    ma, mb = header_a.meta, header_b.meta
    for name, a, b in (("layer.name", ma.layer.name, mb.layer.name),
                       ("layer.num_heads", ma.layer.num_heads, mb.layer.num_heads),
                       ("layer.num_kv_heads", ma.layer.num_kv_heads, mb.layer.num_kv_heads),
                       ("layer.head_size", ma.layer.head_size, mb.layer.head_size),
                       ("backend.page_size", ma.backend.page_size, mb.backend.page_size),
                       ("num_steps", ma.num_steps, mb.num_steps)):
        if a != b:
            raise _refuse(name, json.dumps(a), json.dumps(b))
    for step in range(ma.num_steps):
        for tensor, what in (("block_table", "rows (requests)"), ("query", "rows (tokens)")):
            ta, tb = header_a.step_tensor(step, tensor), header_b.step_tensor(step, tensor)
            if ta.shape[0] != tb.shape[0]:
                raise _refuse(f"{ma.step_prefix(step)}{tensor} {what}", ta.shape[0], tb.shape[0])


def meta_differences(header_a, header_b) -> tuple[list[FieldDiff], list[FieldDiff]]:
    """(input fields that differ, provenance fields that differ), by dotted name."""
    ma, mb = header_a.meta, header_b.meta
    inputs, provenance = [], []
    for section in ("layer", "backend"):
        da, db = asdict(getattr(ma, section)), asdict(getattr(mb, section))
        for key in sorted(set(da) | set(db)):
            if da.get(key) != db.get(key):
                inputs.append(FieldDiff(f"{section}.{key}", da.get(key), db.get(key)))
    if ma.kv_layout != mb.kv_layout:
        inputs.append(FieldDiff("kv_layout", ma.kv_layout, mb.kv_layout))
    ka, kb = header_a.tensors["kv_cache"].dtype, header_b.tensors["kv_cache"].dtype
    if ka != kb:
        inputs.append(FieldDiff("kv_cache dtype", ka, kb))
    ca, cb = _flatten(ma.capture, "capture"), _flatten(mb.capture, "capture")
    for key in sorted(set(ca) | set(cb)):
        if ca.get(key) != cb.get(key):
            provenance.append(FieldDiff(key, ca.get(key), cb.get(key)))
    if ma.notes != mb.notes:
        provenance.append(FieldDiff("notes", ma.notes, mb.notes))
    return inputs, provenance


def layer_value_differences(snap_a, snap_b) -> list[FieldDiff]:
    """The layer's value tensors (sinks, ALiBi slopes) that differ: absent on one side, or the first head that
    differs and how many do."""
    out = []
    for name in ("sinks", "alibi_slopes"):
        a, b = getattr(snap_a, name), getattr(snap_b, name)
        if a is None and b is None:
            continue
        if a is None or b is None:
            out.append(FieldDiff(name, "absent" if a is None else f"{a.numel()} values",
                                 "absent" if b is None else f"{b.numel()} values"))
            continue
        differ = (a != b).nonzero().flatten().tolist()
        if differ:
            h = differ[0]
            out.append(FieldDiff(name, f"head {h}: {float(a[h]):.6g}",
                                 f"head {h}: {float(b[h]):.6g} ({len(differ)} of {a.numel()} heads differ)"))
    return out


def _flatten(obj: Any, prefix: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        return {prefix: obj}
    out: dict[str, Any] = {}
    for key, value in obj.items():
        out.update(_flatten(value, f"{prefix}.{key}"))
    return out


# --------------------------------------------------------------------------- inputs


def _bits(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _values(t: "torch.Tensor", scale: float) -> "torch.Tensor":
    """Values in fp32, times ``scale``; uint8 holds an FP8 query or cache's bytes."""
    import torch

    from kvdbg.snapshot.layout import dequantize_fp8

    return dequantize_fp8(t, scale, torch.float32)


def _token_rows(ta: "torch.Tensor", tb: "torch.Tensor", scale_a: float, scale_b: float):
    """[T] bool rows that differ (bitwise when both are stored alike) and the max abs of finite differences."""
    import torch

    # The width spelled out, not -1: a step of no tokens has rows of some width all the same.
    a, b = ta.reshape(ta.shape[0], math.prod(ta.shape[1:])), tb.reshape(tb.shape[0], math.prod(tb.shape[1:]))
    if a.dtype == b.dtype and scale_a == scale_b:
        rows = (_bits(a) != _bits(b)).any(dim=1)
    else:
        va, vb = _values(a, scale_a), _values(b, scale_b)
        rows = ((va != vb) & ~(va.isnan() & vb.isnan())).any(dim=1)
    if not bool(rows.any()):
        return rows, 0.0
    delta = (_values(a[rows], scale_a) - _values(b[rows], scale_b)).abs()
    finite = delta[torch.isfinite(delta)]
    return rows, float(finite.max()) if finite.numel() else float("nan")


def _compare_pages(snap_a, snap_b, cache_a, cache_b, pairs: dict, ps: int, diff: StepDiff) -> None:
    """Compare each (stored A, stored B) pair over its first ``tokens`` slots, a chunk of pairs at a time."""
    import torch

    la, lb = snap_a.meta.layer, snap_b.meta.layer
    ka, va = snap_a.kv_views(cache_a)
    kb, vb = snap_b.kv_views(cache_b)
    scales = ((la.k_scale if la.is_fp8 else 1.0, lb.k_scale if lb.is_fp8 else 1.0),
              (la.v_scale if la.is_fp8 else 1.0, lb.v_scale if lb.is_fp8 else 1.0))
    items = list(pairs.items())
    ids_a, ids_b = snap_a.page_ids.tolist(), snap_b.page_ids.tolist()
    for lo in range(0, len(items), PAGE_CHUNK):
        chunk = items[lo:lo + PAGE_CHUNK]
        index_a = torch.tensor([p[0] for p, _ in chunk], dtype=torch.int64)
        index_b = torch.tensor([p[1] for p, _ in chunk], dtype=torch.int64)
        tokens = torch.tensor([info[0] for _, info in chunk], dtype=torch.int64)
        live = torch.arange(ps).unsqueeze(0) < tokens.unsqueeze(1)  # [n, ps]
        differ = torch.zeros(len(chunk), ps, dtype=torch.bool)
        worst = torch.zeros(len(chunk), dtype=torch.float64)
        for (view_a, view_b), (scale_a, scale_b) in zip(((ka, kb), (va, vb)), scales):
            pa = view_a.index_select(0, index_a).permute(0, 2, 1, 3)  # [n, ps, Hkv, D]
            pb = view_b.index_select(0, index_b).permute(0, 2, 1, 3)
            n = pa.shape[0]
            rows, _ = _token_rows(pa.reshape(n * ps, -1), pb.reshape(n * ps, -1), scale_a, scale_b)
            rows = rows.view(n, ps) & live
            differ |= rows
            if bool(rows.any()):
                delta = (_values(pa, scale_a) - _values(pb, scale_b)).abs().amax(dim=(2, 3))  # [n, ps]
                delta = torch.where(rows & torch.isfinite(delta), delta, torch.zeros_like(delta))
                worst = torch.maximum(worst, delta.amax(dim=1).double())
        counts = differ.sum(dim=1).tolist()
        for (pair, (_, first, refs)), count, w in zip(chunk, counts, worst.tolist()):
            if not count:
                continue
            diff.pages_differ += refs
            diff.slots_differ += count
            diff.pages_max_abs = max(diff.pages_max_abs, w)
            if len(diff.pages) < MAX_LISTED:
                diff.pages.append(PageDiff(first[0], first[1], int(ids_a[pair[0]]), int(ids_b[pair[1]]), count, w,
                                           refs))


def _logical_slots(slots: list[int], table: list[list[int]], qsl: list[int], ps: int) -> list[tuple[int, int]]:
    """(logical page in its request's table, offset) each token's new K/V is written to; (-1, -1) for none."""
    out = []
    for r, (a, b) in enumerate(zip(qsl, qsl[1:])):
        row = table[r]
        where = {}
        for j, page in enumerate(row):
            where.setdefault(page, j)
        for t in range(a, b):
            slot = slots[t]
            out.append((-1, -1) if slot < 0 else (where.get(slot // ps, -2), slot % ps))
    return out


def step_inputs(snap_a: "Snapshot", snap_b: "Snapshot", cache_a, cache_b, step: int) -> StepDiff:
    """One step's input differences; the caches hold the state the step's backends read."""
    import torch

    from kvdbg.ts.window import cdiv

    ps = snap_a.page_size
    sa, sb = snap_a.steps[step], snap_b.steps[step]
    diff = StepDiff(step, requests=sa.num_reqs, table_width=(int(sa.block_table.shape[1]), int(sb.block_table.shape[1])))
    lens_a, lens_b = [int(x) for x in sa.seq_lens.tolist()], [int(x) for x in sb.seq_lens.tolist()]
    diff.seq_lens = [(r, a, b) for r, (a, b) in enumerate(zip(lens_a, lens_b)) if a != b]
    diff.query_lens = [(r, a, b) for r, (a, b) in enumerate(zip(sa.query_lens, sb.query_lens)) if a != b]
    table_a, table_b = sa.block_table.tolist(), sb.block_table.tolist()
    stored_a, stored_b = snap_a.stored_block_table(step).tolist(), snap_b.stored_block_table(step).tolist()
    pairs: dict[tuple[int, int], list] = {}  # (stored A, stored B) -> [tokens, first (request, page), refs]
    for r, (length_a, length_b) in enumerate(zip(lens_a, lens_b)):
        common = min(length_a, length_b)
        live = min(cdiv(length_a, ps), cdiv(length_b, ps))
        for j in range(live):
            diff.live_entries += 1
            if table_a[r][j] != table_b[r][j]:
                diff.moved_entries += 1
        for j in range(max(cdiv(length_a, ps), cdiv(length_b, ps)), min(len(table_a[r]), len(table_b[r]))):
            if table_a[r][j] != table_b[r][j]:
                diff.stale_differ += 1
        for j in range(cdiv(common, ps)):
            key = (stored_a[r][j], stored_b[r][j])
            tokens = min(ps, common - j * ps)
            diff.logical_pages += 1
            if key in pairs:
                pairs[key][0] = max(pairs[key][0], tokens)
                pairs[key][2] += 1
            else:
                pairs[key] = [tokens, (r, j), 1]
    diff.page_pairs = len(pairs)
    _compare_pages(snap_a, snap_b, cache_a, cache_b, pairs, ps, diff)
    la, lb = snap_a.meta.layer, snap_b.meta.layer
    for name in ("query", "key", "value"):
        ta, tb = getattr(sa, name), getattr(sb, name)
        if ta is None and tb is None:
            continue
        if ta is None or tb is None:
            diff.tensors.append(TensorDiff(name, int((tb if ta is None else ta).shape[0]),
                                           missing="A" if ta is None else "B"))
            continue
        fp8_query = name == "query"
        scale_a = la.q_scale if fp8_query and la.is_fp8 and ta.dtype == torch.uint8 else 1.0
        scale_b = lb.q_scale if fp8_query and lb.is_fp8 and tb.dtype == torch.uint8 else 1.0
        if ta.shape[1:] != tb.shape[1:]:
            raise _refuse(f"{snap_a.meta.step_prefix(step)}{name} shape", list(ta.shape), list(tb.shape))
        rows, worst = _token_rows(ta, tb, scale_a, scale_b)
        diff.tensors.append(TensorDiff(name, int(ta.shape[0]), rows.nonzero().flatten().tolist(), worst))
    if sa.slot_mapping is not None and sb.slot_mapping is not None:
        qa, qb = [int(x) for x in sa.query_start_loc.tolist()], [int(x) for x in sb.query_start_loc.tolist()]
        where_a = _logical_slots(sa.slot_mapping.tolist(), table_a, qa, ps)
        where_b = _logical_slots(sb.slot_mapping.tolist(), table_b, qb, ps)
        diff.slots_moved = [t for t, (a, b) in enumerate(zip(where_a, where_b)) if a != b]
    elif (sa.slot_mapping is None) != (sb.slot_mapping is None):
        diff.tensors.append(TensorDiff("slot_mapping", int(sa.num_tokens),
                                       missing="A" if sa.slot_mapping is None else "B"))
    return diff


# --------------------------------------------------------------------------- outputs


def compare_chunked(actual: "torch.Tensor", expected: "torch.Tensor", query_start_loc, seq_lens, tolerance, *,
                    actual_name: str, expected_name: str, step: int) -> "Comparison":
    """kvdbg.judge.compare.compare over groups of whole requests, so no float64 copy of a large output is made at once."""
    import torch

    from kvdbg.judge.compare import Comparison, compare

    qsl = [int(x) for x in query_start_loc.tolist()]
    lens = seq_lens.to(torch.int64)
    per_token = max(1, actual[0].numel() if actual.shape[0] else 1)
    out = Comparison(actual=actual_name, expected=expected_name, step=step, tolerance=tolerance)
    first = 0
    num_reqs = len(qsl) - 1
    while first < num_reqs:
        last = first + 1
        while last < num_reqs and (qsl[last + 1] - qsl[first]) * per_token <= COMPARE_CHUNK_ELEMENTS:
            last += 1
        lo, hi = qsl[first], qsl[last]
        part = compare(actual[lo:hi], expected[lo:hi], torch.tensor(qsl[first:last + 1]) - lo, lens[first:last],
                       tolerance, actual_name=actual_name, expected_name=expected_name, step=step)
        out.heads.extend(replace(h, request=h.request + first, worst_token=h.worst_token + lo) for h in part.heads)
        first = last
    return out


def _output_tolerance(dtype, fp8: bool, atol, rtol, fp8_query: float | None = None):
    from kvdbg.judge.compare import default_tolerance

    return default_tolerance(str(dtype).removeprefix("torch."), fp8=fp8, fp8_query=fp8_query, atol=atol, rtol=rtol)


def step_fp8_query_allowance(snapshots, caches, step: int) -> float | None:
    """The FP8-query allowance of a step (kvdbg.judge.compare): the larger of the snapshots whose query is FP8
    at this step, from the values each reads in its cache as the step sees it; None when neither is."""
    import torch

    from kvdbg.judge.compare import fp8_query_allowance
    from kvdbg.snapshot.layout import holds_fp8, read_value_magnitudes

    allowances = []
    for snap, cache in zip(snapshots, caches):
        s = snap.steps[step]
        if snap.meta.layer.is_fp8 and holds_fp8(s.query):
            qsl = s.query_start_loc.to(torch.int64)
            allowances.append(fp8_query_allowance(*read_value_magnitudes(
                snap.meta, cache, snap.stored_block_table(step), s.seq_lens, qsl[1:] - qsl[:-1])))
    return max(allowances) if allowances else None


def snapshot_outputs(snap_a, snap_b, result: SnapDiff, atol, rtol,
                     fp8_query: dict[int, float | None] | None = None) -> None:
    """The two snapshots' captured outputs, step by step; ``fp8_query``: step -> its FP8-query allowance."""
    fp8 = snap_a.meta.layer.is_fp8 or snap_b.meta.layer.is_fp8
    for step, (sa, sb) in enumerate(zip(snap_a.steps, snap_b.steps)):
        if sa.output is None or sb.output is None:
            which = "neither file" if sa.output is None and sb.output is None else \
                ("only B" if sa.output is None else "only A")
            result.notes.append(f"step {step}: {which} holds the engine's output: not compared")
            continue
        tol = _output_tolerance(sa.output.dtype, fp8, atol, rtol, (fp8_query or {}).get(step))
        result.outputs.append(compare_chunked(sb.output, sa.output, sa.query_start_loc, sa.seq_lens, tol,
                                              actual_name="B captured", expected_name="A captured", step=step))


# --------------------------------------------------------------------------- entry points


def diff_snapshots(path_a: str, path_b: str, *, atol: float | None = None, rtol: float | None = None,
                   progress=None) -> SnapDiff:
    from kvdbg.snapshot.cache import apply_step_update, working_cache
    from kvdbg.snapshot.store import load_snapshot, open_snapshot

    header_a, header_b = open_snapshot(path_a), open_snapshot(path_b)
    check_comparable(header_a, header_b)
    result = SnapDiff(KIND_SNAPSHOT, header_a.path, header_b.path)
    result.meta, result.provenance = meta_differences(header_a, header_b)
    snap_a, snap_b = load_snapshot(path_a), load_snapshot(path_b)
    result.meta.extend(layer_value_differences(snap_a, snap_b))
    cache_a, cache_b = working_cache(snap_a, "cpu"), working_cache(snap_b, "cpu")
    fp8_query = {}
    for step in range(len(snap_a.steps)):
        if progress:
            progress(f"step {step}: inputs")
        apply_step_update(snap_a, cache_a, step)
        apply_step_update(snap_b, cache_b, step)
        result.steps.append(step_inputs(snap_a, snap_b, cache_a, cache_b, step))
        fp8_query[step] = step_fp8_query_allowance((snap_a, snap_b), (cache_a, cache_b), step)
    if progress:
        progress("outputs")
    snapshot_outputs(snap_a, snap_b, result, atol, rtol, fp8_query)
    return result


def _outputs_meta(path: str, metadata: dict[str, str]) -> dict:
    try:
        meta = json.loads(metadata[OUTPUTS_KEY])
    except ValueError:
        raise SnapshotError(f"{path}: __metadata__[{OUTPUTS_KEY!r}] is not JSON") from None
    if not isinstance(meta, dict):
        raise SnapshotError(f"{path}: __metadata__[{OUTPUTS_KEY!r}] is not a JSON object")
    # The fields save_outputs writes; absent or null in a file of an older kvdbg, never another type.
    scalar = (str, int, float, bool, type(None))
    for key, what, valid in (
            ("snapshot", "a string", lambda v: isinstance(v, str)),
            ("kernels", "an object of strings (backend -> kernel)",
             lambda v: isinstance(v, dict) and all(isinstance(x, str) for x in v.values())),
            ("layer", "an object of plain values", lambda v: isinstance(v, dict)
             and all(isinstance(x, scalar) for x in v.values())),
            ("steps", "an object of objects (step -> lengths)",
             lambda v: isinstance(v, dict) and all(isinstance(x, dict) for x in v.values()))):
        value = meta.get(key)
        if value is not None and not valid(value):
            shown = json.dumps(value)[:60] if isinstance(value, scalar) else type(value).__name__
            raise SnapshotError(f"{path}: __metadata__[{OUTPUTS_KEY!r}] field {key} must be {what}, got {shown}")
    return meta


def _lengths(meta: dict, step: str, tokens: int):
    """(query_start_loc, seq_lens, known) of a step in an outputs file; unknown: one row per token."""
    import torch

    info = (meta.get("steps") or {}).get(step)
    try:
        qsl = torch.tensor([int(x) for x in info["query_start_loc"]], dtype=torch.int64)
        lens = torch.tensor([int(x) for x in info["seq_lens"]], dtype=torch.int64)
        if len(qsl) == len(lens) + 1 and int(qsl[-1]) == tokens and int(qsl[0]) == 0:
            return qsl, lens, True
    except (TypeError, KeyError, ValueError):
        pass
    return torch.arange(tokens + 1, dtype=torch.int64), torch.ones(tokens, dtype=torch.int64), False


def diff_outputs(path_a: str, path_b: str, metadata_a, metadata_b, tensors_a, tensors_b, *,
                 atol: float | None = None, rtol: float | None = None) -> SnapDiff:
    from safetensors import safe_open

    result = SnapDiff(KIND_OUTPUTS, path_a, path_b)
    meta_a, meta_b = _outputs_meta(path_a, metadata_a), _outputs_meta(path_b, metadata_b)
    kernels_a, kernels_b = meta_a.get("kernels") or {}, meta_b.get("kernels") or {}
    for name in sorted(set(kernels_a) | set(kernels_b)):
        if kernels_a.get(name) != kernels_b.get(name):
            result.provenance.append(FieldDiff(f"kernel of {name}", kernels_a.get(name), kernels_b.get(name)))
    if meta_a.get("snapshot") != meta_b.get("snapshot"):
        result.provenance.append(FieldDiff("snapshot", meta_a.get("snapshot"), meta_b.get("snapshot")))
    layer_a, layer_b = meta_a.get("layer") or {}, meta_b.get("layer") or {}
    for key in sorted(set(layer_a) | set(layer_b)):
        if layer_a.get(key) != layer_b.get(key):
            result.meta.append(FieldDiff(f"layer.{key}", layer_a.get(key), layer_b.get(key)))
    common = [n for n in tensors_a if n in tensors_b]
    for name in common:
        if tensors_a[name].shape != tensors_b[name].shape:
            raise _refuse(f"tensor {name}", list(tensors_a[name].shape), list(tensors_b[name].shape))
    for name in sorted(set(tensors_a) ^ set(tensors_b)):
        result.notes.append(f"{name}: only in {'A' if name in tensors_a else 'B'}: not compared")
    fp8 = bool(str(layer_a.get("kv_cache_dtype", "")).startswith("fp8")
               or str(layer_b.get("kv_cache_dtype", "")).startswith("fp8"))
    unknown = set()

    def order(name: str):
        parts = name.split(".", 2)
        return (int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else -1, name)

    with safe_open(path_a, framework="pt", device="cpu") as fa, safe_open(path_b, framework="pt", device="cpu") as fb:
        for name in sorted(common, key=order):
            parts = name.split(".", 2)
            step = parts[1] if len(parts) == 3 else "0"
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
            if ta.dim() != 3:
                result.notes.append(f"{name}: not a [tokens, heads, head_size] output: not compared")
                continue
            qsl, lens, known = _lengths(meta_a, step, ta.shape[0])
            if not known:
                unknown.add(step)
            tol = _output_tolerance(ta.dtype, fp8, atol, rtol)
            label = parts[2] if len(parts) == 3 else name
            result.outputs.append(compare_chunked(tb, ta, qsl, lens, tol, actual_name=f"B {label}",
                                                  expected_name=f"A {label}",
                                                  step=int(step) if step.isdigit() else 0))
    for step in sorted(unknown):
        result.notes.append(f"step {step}: A does not record its requests' lengths (written by an older kvdbg): "
                            "each token is its own row")
    return result


def diff_files(path_a: str, path_b: str, *, atol: float | None = None, rtol: float | None = None,
               progress=None) -> SnapDiff:
    """Compare two snapshots, or two `replay -o` files; NotComparable when they are not alike."""
    import os

    kind_a, metadata_a, tensors_a = file_kind(os.fspath(path_a))
    kind_b, metadata_b, tensors_b = file_kind(os.fspath(path_b))
    if kind_a != kind_b:
        words = {KIND_SNAPSHOT: "a snapshot", KIND_OUTPUTS: "a replay -o file"}
        raise NotComparable(f"not comparable: A is {words[kind_a]} but B is {words[kind_b]}")
    if kind_a == KIND_SNAPSHOT:
        return diff_snapshots(path_a, path_b, atol=atol, rtol=rtol, progress=progress)
    return diff_outputs(os.fspath(path_a), os.fspath(path_b), metadata_a, metadata_b, tensors_a, tensors_b,
                        atol=atol, rtol=rtol)


def diff_verdict(result: SnapDiff):
    """Fail (exit 1) when an output differs beyond tolerance; pass when every compared output agrees; exit 3
    when no output could be compared. Input differences are reported, never counted."""
    from kvdbg.judge.verdict import simple_verdict
    from kvdbg.judge.verdict import EXIT_FINDING, EXIT_NOTHING_VERIFIED, EXIT_OK

    inputs = result.inputs_differ
    moved = sum(s.moved_entries for s in result.steps)
    if inputs:
        aside = f"; inputs differ: {', '.join(inputs)}"
    elif result.kind == KIND_SNAPSHOT:
        aside = "; inputs the same" + (" (placement aside)" if moved else "")
    else:
        aside = ""
    compared = [c for c in result.outputs if c.heads]
    failed = [c for c in compared if not c.passed]
    counts = {"comparisons": len(compared), "failed_comparisons": len(failed)}
    if failed:
        heads = sum(len(c.failed) for c in failed)
        total = sum(len(c.heads) for c in compared)
        names = ", ".join(dict.fromkeys(f"step {c.step} {c.expected.removeprefix('A ')}" for c in failed))
        # Elements outside the tolerance, apart from those with no finite value on a side (NaN, inf or a token
        # not written), which fail whatever the tolerance: the line says which of the two made heads differ.
        beyond = sum(h.failing - h.not_compared for c in failed for h in c.failed)
        in_a = sum(c.counts()["expected_nonfinite"] for c in failed)
        in_b = sum(c.counts()["actual_nonfinite"] + c.counts()["unwritten"] for c in failed)
        causes = []
        if beyond:
            worst = max((c.max_abs for c in failed if c.max_abs == c.max_abs), default=float("nan"))
            causes.append(f"{beyond} element(s) beyond tolerance" + (f", max abs {worst:.2e}" if worst == worst else ""))
        if in_a or in_b:
            causes.append("no finite value in " + " and ".join(
                f"{side} on {n} element(s)" for side, n in (("A", in_a), ("B", in_b)) if n) + " (NaN, inf or unwritten)")
        return simple_verdict("fail", EXIT_FINDING, f"FAIL: outputs differ on {heads} of {total} heads ({names}: "
                                                    f"{'; '.join(causes)}){aside}", **counts)
    if not compared:
        return simple_verdict("unverified", EXIT_NOTHING_VERIFIED,
                              f"NOTHING VERIFIED: no output held by both files{aside}", **counts)
    total = sum(len(c.heads) for c in compared)
    return simple_verdict("pass", EXIT_OK, f"PASS: outputs agree within tolerance ({total} heads){aside}", **counts)


__all__ = ["FieldDiff", "KIND_OUTPUTS", "KIND_SNAPSHOT", "NotComparable", "PageDiff", "SnapDiff", "StepDiff",
           "TensorDiff", "check_comparable", "compare_chunked", "diff_files", "diff_outputs", "diff_snapshots",
           "diff_verdict", "file_kind", "meta_differences", "step_inputs"]
