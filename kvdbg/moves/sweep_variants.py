"""The knobs of ``kvdbg sweep`` and the variant snapshots each makes: pages relabelled, the cache re-typed or
re-scaled, the window moved, queries shortened, flex's block, compile and device (kvdbg.moves.sweeper runs
and judges them; its docstring says what each variant is held against)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Iterable

from kvdbg.errors import KvdbgError, OptionError

if TYPE_CHECKING:
    import torch

    from kvdbg.backends.base import ReplayOptions
    from kvdbg.snapshot.store import Snapshot

KNOBS = ("placement", "kv-dtype", "scales", "window", "query-len", "flex-block", "compile", "device")
KNOB_MEANING = {
    "placement": "stored pages moved to other engine ids; page 0 (vLLM's null block) kept unless the row moves it",
    "kv-dtype": "the cache re-stored in another dtype from its dequantised values",
    "scales": "an FP8 cache's q/k/v scales replaced, its bytes unchanged",
    "window": "the layer's sliding window changed",
    "query-len": "each request keeps only its last n query tokens",
    "flex-block": "flex's BlockMask query block (BLOCK_M); the KV block stays one page",
    "compile": "flex eager vs torch.compile",
    "device": "replayed on the other device",
}
NULL_PAGE = 0
FLEX_Q_BLOCKS = (32, 64, 128)  # vLLM's direct build uses 16; torch's own default is 128
# Pages converted at once by a kv-dtype variant: bounds the float32 staging copy.
RETYPE_CHUNK_PAGES = 1024
MODEL_DTYPE_LABEL = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def parse_knobs(value: str | Iterable[str] | None, option: str = "--vary") -> list[str]:
    """``"placement,kv-dtype"`` → the knobs in KNOBS order; None or "all" → every knob. ``option`` is the name the
    user gave them under (``sweep --vary``, ``report --sweep``), for the error."""
    if value is None:
        return list(KNOBS)
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in v.split(",")]
    wanted = []
    for part in parts:
        key = part.strip().lower().replace("_", "-")
        if not key:
            continue
        if key == "all":
            wanted.extend(KNOBS)
            continue
        if key not in KNOBS:
            close = difflib.get_close_matches(key, KNOBS, n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise OptionError(f"{option}: unknown knob {part.strip()!r}{hint} (choose from: {', '.join(KNOBS)}, all)")
        wanted.append(key)
    if not wanted:
        raise OptionError(f"{option}: give at least one knob ({', '.join(KNOBS)}, all)")
    return [k for k in KNOBS if k in wanted]


# --------------------------------------------------------------------------- variants


@dataclass
class Variant:
    """One row of the matrix: what changes, and what its results are held against."""

    knob: str  # "baseline" for the captured configuration
    label: str
    description: str
    captured_applies: bool = True  # the engine's output still answers these inputs
    same_answer: bool = True  # the exact answer must equal the baseline's (else it moves: shown, not judged)
    skipped: str | None = None  # why the row is not run (not a failure)
    unavailable_here: bool = False  # skipped for want of something this machine lacks (a CUDA device)
    build: Callable[[], tuple["Snapshot", "ReplayOptions", dict[int, "torch.Tensor"] | None]] | None = \
        field(default=None, repr=False)

    @property
    def name(self) -> str:
        return "baseline" if self.knob == "baseline" else f"{self.knob}: {self.label}"

    def to_json(self) -> dict:
        return {"knob": self.knob, "label": self.label, "description": self.description,
                "captured_applies": self.captured_applies, "same_answer": self.same_answer,
                "skipped": self.skipped, "unavailable_here": self.unavailable_here}


def variants_for(snapshot: "Snapshot", knob: str, options: "ReplayOptions", backends: list[str]) -> list[Variant]:
    """The deterministic variants of one knob for this snapshot (rows that cannot apply say why)."""
    return {"placement": _placement_variants, "kv-dtype": _kv_dtype_variants, "scales": _scale_variants,
            "window": _window_variants, "query-len": _query_len_variants, "flex-block": _flex_block_variants,
            "compile": _compile_variants, "device": _device_variants}[knob](snapshot, options, backends)


def _same(snapshot, options):
    return lambda: (snapshot, options, None)


# -- placement


def stored_ids(snapshot: "Snapshot") -> list[int]:
    return sorted(int(p) for p in snapshot.page_ids.tolist())


def free_page_id(snapshot: "Snapshot") -> int | None:
    """The smallest engine id above 0 that no stored page, table entry or slot uses."""
    import torch

    ps = snapshot.page_size
    used = set(stored_ids(snapshot))
    for s in snapshot.steps:
        used.update(int(p) for p in torch.unique(s.block_table.to(torch.int64)).tolist())
        if s.slot_mapping is not None:
            slots = s.slot_mapping.to(torch.int64)
            used.update(int(p) for p in torch.unique(slots[slots >= 0] // ps).tolist())
    for candidate in range(1, snapshot.meta.backend.num_gpu_blocks):
        if candidate not in used:
            return candidate
    return None


def relabel_pages(snapshot: "Snapshot", mapping: dict[int, int]) -> "Snapshot":
    """The snapshot with engine page ``p`` renamed ``mapping[p]`` everywhere (pages, tables, slots).

    The stored pages are re-stored in the order of their new ids, so a page's
    physical neighbours change as they would in an engine cache laid out by id.
    Ids of pages that are not stored (stale entries) are left as they are:
    ``mapping`` must not rename a page onto one of them.
    """
    import torch

    from kvdbg.snapshot.layout import page_dim
    from kvdbg.snapshot.store import Snapshot

    ps = snapshot.page_size
    lookup = torch.arange(snapshot.meta.backend.num_gpu_blocks, dtype=torch.int64)
    for old, new in mapping.items():
        lookup[old] = new
    new_ids = lookup[snapshot.page_ids.to(torch.int64)]
    order = torch.argsort(new_ids)
    kv = snapshot.kv_cache.index_select(page_dim(snapshot.meta.kv_layout), order)
    steps = []
    for s in snapshot.steps:
        table = lookup[s.block_table.to(torch.int64)].to(s.block_table.dtype)
        slots = s.slot_mapping
        if slots is not None:
            wide = slots.to(torch.int64)
            moved = lookup[(wide // ps).clamp_min(0)] * ps + wide % ps
            slots = torch.where(wide >= 0, moved, wide).to(slots.dtype)
        steps.append(replace(s, block_table=table, slot_mapping=slots))
    return Snapshot(meta=snapshot.meta, kv_cache=kv, page_ids=new_ids[order].to(snapshot.page_ids.dtype),
                    steps=steps, path=snapshot.path, **snapshot.layer_tensors())


def _placement_variants(snapshot, options, backends) -> list[Variant]:
    ids = stored_ids(snapshot)
    movable = [p for p in ids if p != NULL_PAGE]
    out = []
    for label, perm in (("reversed, page 0 kept", movable[::-1]), ("rotated by 1, page 0 kept", movable[1:] + movable[:1])):
        mapping = {a: b for a, b in zip(movable, perm) if a != b}
        desc = (f"the {len(movable)} stored pages other than page 0 take each other's ids ({label.split(',')[0]} "
                "order); page data, block tables and slot mapping move together")
        variant = Variant("placement", label, desc)
        if not mapping:
            variant.skipped = f"{len(movable)} movable page(s): nothing to permute"
        else:
            variant.build = (lambda m=mapping: (relabel_pages(snapshot, m), options, None))
        out.append(variant)
    free = free_page_id(snapshot)
    label = f"page 0 moved to {free}" if free is not None and NULL_PAGE in ids else "page 0 moved"
    variant = Variant("placement", label, "engine page 0 (vLLM's null block) renamed to a free id, everything "
                      "else as captured: a backend that treats page 0 specially must not change a correct result "
                      "unless page 0 holds keys a request reads")
    if NULL_PAGE not in ids:
        variant.skipped = "page 0 is not stored"
    elif free is None:
        variant.skipped = "no free engine page id to move page 0 to"
    else:
        variant.build = lambda: (relabel_pages(snapshot, {NULL_PAGE: free}), options, None)
    out.append(variant)
    return out


# -- kv-dtype and scales


def retype_snapshot(snapshot: "Snapshot", model_dtype: str, fp8: bool,
                    scales: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> "Snapshot":
    """The snapshot with its cache re-stored from its dequantised values, as ``model_dtype`` or FP8 e4m3.

    ``scales`` (q, k, v) quantise the FP8 cache (``x / scale``, saturated as the
    engine's cache write does); a cache that is not FP8 has unit scales. An FP8
    query is dequantised; the engine's output is dropped (it answers another cache).
    """
    import torch

    from kvdbg.snapshot.layout import dequantize_fp8, quantize_fp8
    from kvdbg.snapshot.store import Snapshot

    layer = snapshot.meta.layer
    target = getattr(torch, model_dtype)
    q_scale, k_scale, v_scale = scales if fp8 else (1.0, 1.0, 1.0)
    new_layer = replace(layer, dtype=model_dtype, kv_cache_dtype="fp8_e4m3" if fp8 else "auto",
                        q_scale=q_scale, k_scale=k_scale, v_scale=v_scale)
    meta = replace(snapshot.meta, layer=new_layer)
    kv = torch.empty(snapshot.kv_cache.shape, dtype=torch.uint8 if fp8 else target)
    new = Snapshot(meta=meta, kv_cache=kv, page_ids=snapshot.page_ids, steps=[], path=snapshot.path,
                   **snapshot.layer_tensors())
    for (src, old_scale), (dst, new_scale) in zip(
            zip(snapshot.kv_views(), (layer.k_scale, layer.v_scale) if layer.is_fp8 else (1.0, 1.0)),
            zip(new.kv_views(), (k_scale, v_scale))):
        for lo in range(0, src.shape[0], RETYPE_CHUNK_PAGES):
            values = dequantize_fp8(src[lo:lo + RETYPE_CHUNK_PAGES], old_scale, torch.float32)
            if fp8:
                quant = quantize_fp8(values, new_scale)
                dst.view(torch.uint8)[lo:lo + RETYPE_CHUNK_PAGES] = quant.view(torch.uint8)
            else:
                dst[lo:lo + RETYPE_CHUNK_PAGES] = values.to(target)
    steps = []
    for s in snapshot.steps:
        query = s.query
        if layer.is_fp8 and query.dtype in (torch.uint8, torch.float8_e4m3fn):
            query = dequantize_fp8(query, layer.q_scale, torch.float32)
        steps.append(replace(s, query=query.to(target),
                             key=None if s.key is None else s.key.to(target),
                             value=None if s.value is None else s.value.to(target), output=None))
    new.steps = steps
    return new


def _kv_config(layer) -> tuple[str, bool, tuple[float, float, float]]:
    scales = (layer.q_scale, layer.k_scale, layer.v_scale) if layer.is_fp8 else (1.0, 1.0, 1.0)
    return layer.dtype, layer.is_fp8, scales


def _kv_dtype_variants(snapshot, options, backends) -> list[Variant]:
    layer = snapshot.meta.layer
    captured = _kv_config(layer)
    scales = (layer.q_scale, layer.k_scale, layer.v_scale)
    unit = (1.0, 1.0, 1.0)
    configs = [("bf16", ("bfloat16", False, unit)), ("fp16", ("float16", False, unit)),
               ("fp8, captured scales" if scales != unit else "fp8, unit scales (as captured)",
                (layer.dtype, True, scales)),
               ("fp8, unit scales", (layer.dtype, True, unit))]
    out, seen = [], {captured}
    for label, config in configs:
        if config in seen:
            continue
        seen.add(config)
        model_dtype, fp8, chosen = config
        if fp8:
            desc = (f"cache re-stored as fp8 e4m3 with q/k/v scales {_scales_text(chosen)} (model "
                    f"{model_dtype}); backends against this variant's reference only")
        else:
            desc = (f"cache and model in {model_dtype} (kv_cache_dtype auto follows the model), from the "
                    "dequantised values; backends against this variant's reference only")
        out.append(Variant("kv-dtype", label, desc, captured_applies=False, same_answer=False,
                           build=lambda c=config: (retype_snapshot(snapshot, *c), options, None)))
    return out


def _scales_text(scales) -> str:
    return "/".join(f"{s:g}" for s in scales)


def _rescaled(snapshot, q: float, k: float, v: float):
    from kvdbg.snapshot.store import with_meta

    layer = replace(snapshot.meta.layer, q_scale=q, k_scale=k, v_scale=v)
    out = with_meta(snapshot, layer=layer)
    return replace(out, steps=[replace(s, output=None) for s in snapshot.steps])


def _scale_variants(snapshot, options, backends) -> list[Variant]:
    layer = snapshot.meta.layer
    q, k, v = layer.q_scale, layer.k_scale, layer.v_scale
    candidates = [("unit (q, k, v = 1)", (1.0, 1.0, 1.0)), ("k and v swapped", (q, v, k)), ("q = 1", (1.0, k, v))]
    if not layer.is_fp8:
        return [Variant("scales", "any", "", captured_applies=False, same_answer=False,
                        skipped=f"the cache is {layer.dtype}: scales apply only to an FP8 cache")]
    out, seen = [], {(q, k, v)}
    for label, chosen in candidates:
        if chosen in seen:
            continue
        seen.add(chosen)
        out.append(Variant("scales", label, f"the same FP8 bytes read with q/k/v scales {_scales_text(chosen)} "
                           f"instead of {_scales_text((q, k, v))}; backends against this variant's reference only",
                           captured_applies=False, same_answer=False,
                           build=lambda c=chosen: (_rescaled(snapshot, *c), options, None)))
    if not out:
        out.append(Variant("scales", "unit (q, k, v = 1)", "", captured_applies=False, same_answer=False,
                           skipped="the captured scales are already 1"))
    return out


# -- window


def _windowed(snapshot, window: int | None):
    from kvdbg.snapshot.store import with_meta

    out = with_meta(snapshot, layer=replace(snapshot.meta.layer, sliding_window=window))
    return replace(out, steps=[replace(s, output=None) for s in snapshot.steps])


def _window_variants(snapshot, options, backends) -> list[Variant]:
    window = snapshot.meta.layer.sliding_window
    out = []
    if window is None:
        return [Variant("window", "captured ± 1", "", captured_applies=False, same_answer=False,
                        skipped="the layer has no sliding window")]
    if snapshot.meta.layer.chunk_lookback is not None:
        return [Variant("window", "captured ± 1", "", captured_applies=False, same_answer=False,
                        skipped="the layer's chunk lookback replaces its window (the window only sizes the chunks)")]
    for label, value in (("none", None), (f"{window - 1}", window - 1), (f"{window + 1}", window + 1)):
        variant = Variant("window", label, f"sliding window {value if value is not None else 'none'} instead of "
                          f"{window}; backends against this variant's reference only",
                          captured_applies=False, same_answer=False)
        if value is not None and value < 1:
            variant.skipped = "a window must hold at least one key"
        else:
            variant.build = lambda w=value: (_windowed(snapshot, w), options, None)
        out.append(variant)
    return out


# -- query length


def shorten_queries(snapshot: "Snapshot", keep: int) -> tuple["Snapshot", dict[int, "torch.Tensor"]]:
    """Each request keeps its last ``min(keep, q)`` query tokens; seq_lens, tables and the step update stay.

    Returns the snapshot and, per step, the baseline rows of the kept tokens (the
    engine's output is sliced to them: a token's exact output depends only on its
    own position, the request's length and the mask).
    """
    import torch

    kept_rows: dict[int, torch.Tensor] = {}
    steps = []
    for i, s in enumerate(snapshot.steps):
        qsl = [int(x) for x in s.query_start_loc.tolist()]
        rows, starts = [], [0]
        for a, b in zip(qsl, qsl[1:]):
            n = min(keep, b - a)
            rows.extend(range(b - n, b))
            starts.append(starts[-1] + n)
        index = torch.tensor(rows, dtype=torch.int64)
        kept_rows[i] = index
        steps.append(replace(s, query=s.query.index_select(0, index),
                             query_start_loc=torch.tensor(starts, dtype=s.query_start_loc.dtype),
                             output=None if s.output is None else s.output.index_select(0, index)))
    return replace(snapshot, steps=steps), kept_rows


def _query_len_variants(snapshot, options, backends) -> list[Variant]:
    longest = max((max(s.query_lens, default=0) for s in snapshot.steps), default=0)
    lengths = sorted({n for n in (1, longest // 2) if 1 <= n < longest})
    if not lengths:
        return [Variant("query-len", "shorter", "", skipped=f"every request has {longest} query token(s): nothing "
                        "shorter, and a longer query has no captured query vectors")]
    out = []
    for n in lengths:
        desc = (f"each request keeps its last {n} query token(s) (seq_len, table and the step's new K/V as "
                "captured); the engine's output and the baseline reference are compared on those rows")
        out.append(Variant("query-len", f"last {n}", desc, build=lambda n=n: _shortened(snapshot, n, options)))
    return out


def _shortened(snapshot, keep, options):
    shortened, kept = shorten_queries(snapshot, keep)
    return shortened, options, kept


# -- flex, compile, device


def _flex_block_variants(snapshot, options, backends) -> list[Variant]:
    out = []
    for block in FLEX_Q_BLOCKS:
        variant = Variant("flex-block", f"q block {block}", f"flex's BlockMask query block {block} tokens "
                          "instead of vLLM's 16 (the KV block stays one page)")
        if "flex" not in backends:
            variant.skipped = "flex is not among the backends"
        else:
            variant.build = lambda b=block: (snapshot, replace(options, flex_q_block=b), None)
        out.append(variant)
    return out


def _compile_variants(snapshot, options, backends) -> list[Variant]:
    """The other mode; both when the baseline lets flex choose by size (on CUDA, without --compile)."""
    if options.compile is not None:
        baseline, modes = ("compiled" if options.compile else "eager"), [not options.compile]
    elif options.device.startswith("cuda"):
        baseline, modes = "chosen by size", [False, True]
    else:
        baseline, modes = "eager", [True]
    out = []
    for compiled in modes:
        label = "compiled" if compiled else "eager"
        variant = Variant("compile", label, f"flex run {label} instead of {baseline}")
        if "flex" not in backends:
            variant.skipped = "flex is not among the backends"
        else:
            variant.build = lambda c=compiled: (snapshot, replace(options, compile=c), None)
        out.append(variant)
    return out


def _device_variants(snapshot, options, backends) -> list[Variant]:
    from kvdbg.replayer.runner import resolve_device

    other = "cpu" if options.device.startswith("cuda") else "cuda"
    variant = Variant("device", other, f"replayed on {other} instead of {options.device}")
    try:
        resolve_device(other)
    except KvdbgError as exc:
        variant.skipped = str(exc).removeprefix("--device cuda: ")
        variant.unavailable_here = True
    else:
        variant.build = lambda: (snapshot, replace(options, device=other), None)
    return [variant]


__all__ = ["KNOBS", "KNOB_MEANING", "Variant", "free_page_id", "parse_knobs", "relabel_pages", "retype_snapshot",
           "shorten_queries", "stored_ids", "variants_for"]
