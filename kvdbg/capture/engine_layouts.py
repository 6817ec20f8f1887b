"""How an engine's per-layer KV-cache tensor holds K and V, taken from what the engine declares for that layer.

A snapshot stores pages in one of the format's layouts (``kvdbg.snapshot.format.LAYOUTS``).
Which bytes of an engine cache are K and V is never inferred from a shape: two
caches of one shape can mean different things. vLLM >= 0.32 declares it, and
:func:`declared_layout` reads those declarations (at run time, from the
installed engine's own objects) into an :class:`EngineLayout`::

    cache_config.kv_cache_layout   one KVCacheLayout member, resolved once by the engine core: the order in
                                   memory of the logical axes [L, B, H, N, C] (layers, blocks, heads, tokens,
                                   content); its ``layer_view_order`` orders one layer's [B, H, N, C]
    the layer's AttentionSpec      what C holds: head_size (K) + head_size_v (V) elements of ``dtype``,
                                   unless the backend packed it (num_head_slots, state_content_bytes) or
                                   quantised it otherwise (kv_quant_mode), ...

    the tensor a layer receives    the logical view [B, H, N, C] with strides in the declared order;
                                   C = | K: head_size | V: head_size_v |  (dense content)

    kvdbg's pages,heads,tokens,2*dim is that logical view: pages are copied by logical index, whatever
    the strides, and the tensor's strides are checked against the declared order first.

CPU_ATTN (vLLM 0.32, kernel variants ``vec`` and ``vec16``) declares dense
content but stores it otherwise, the one known case (checked by writing known
K/V with vLLM's ``cpu_attn_reshape_and_cache`` and reading the bytes back)::

    one (page, head) slot of the cache: 2 * page_size * D elements, in memory order

    | K transposed: D rows of page_size keys | V: page_size rows of D values |
    |  k[0][d=0] k[1][d=0] ... k[N-1][d=0]   |  v[0][0..D-1]                |
    |  ...                                   |  ...                         |

so capture converts its pages. Its ``amx`` variant packs keys and values
differently (not decoded by kvdbg) and is refused, as is every variant not in
:data:`CPU_ATTN_VERIFIED`.

What a declaration says is also checked against the bytes: :func:`check_written_kv`
reads the slots the engine's cache update has just written back through the
layout and compares them with the K/V it was given (:func:`check_written_pages`
on pages already copied: a capture's writer does it on the snapshot's pages).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvdbg.snapshot.layout import CPU_ATTN_K_TRANSPOSED, FP8_MAX, as_fp8, join_kv, split_kv
from kvdbg.errors import KvdbgError
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM

# CPU_ATTN kernel variants ("isa", set by vLLM's CPU_ATTN builder on every layer)
# whose page layout kvdbg has verified against the engine's own cache writer.
CPU_ATTN_VERIFIED = {"vec": CPU_ATTN_K_TRANSPOSED, "vec16": CPU_ATTN_K_TRANSPOSED}

# The prefix of the names of layouts read from vLLM's KVCacheLayout ("vllm:LBNHC").
VLLM_LAYOUT_PREFIX = "vllm:"

# KVQuantMode members (by name) whose cache content kvdbg reads: dense values in the
# model dtype, or FP8 e4m3 bytes with one scale per tensor (the layer's k/v scales).
READABLE_QUANT_MODES = ("NONE", "FP8_PER_TENSOR")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3")
UNQUANTISED_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "half", "float")


class LayoutError(KvdbgError):
    """The engine's KV layout is unknown to kvdbg, declared as something kvdbg cannot store, or not the tensor's."""


# --------------------------------------------------------------------------- one engine layout


def strides_follow(tensor: torch.Tensor, order: tuple[int, ...]) -> bool:
    """Whether ``tensor``'s axes lie in memory in ``order`` (outermost first), without overlapping.

    Walking from the innermost axis outwards, each axis must step over the
    whole extent of the axis inside it (padding between steps is allowed, as
    vLLM pads pages)::

        order (0, 2, 1, 3) on [B, H, N, C]:   C stride 1,  H stride >= C,  N stride >= H * stride(H),
                                              B stride >= N * stride(N)

    Axes of length 1 are skipped: their stride is arbitrary (vLLM rewrites
    such strides for TMA).
    """
    if sorted(order) != list(range(tensor.ndim)):
        return False
    extent = 1
    innermost = True
    for axis in reversed(order):
        size, stride = tensor.shape[axis], tensor.stride(axis)
        if size == 1:
            continue
        if (innermost and stride != 1) or stride < extent:
            return False
        innermost = False
        extent = stride * size
    return True


@dataclass(frozen=True)
class EngineLayout:
    """How an engine cache tensor holds its pages, and how to turn copied pages into a snapshot layout."""

    name: str
    snapshot_layout: str  # the format layout the converted pages are in
    page_dim: int  # dimension of the engine tensor that indexes pages
    token_dim: int  # dimension whose length is the page size
    to_snapshot: Callable[[torch.Tensor], torch.Tensor] | None  # None: the pages are stored as they are
    description: str
    # Memory order of the tensor's axes, outermost first, that its strides must follow; None: not checked.
    physical_order: tuple[int, ...] | None = field(default=None)

    def expected_shape(self, num_kv_heads: int, head_size: int) -> str:
        if self.page_dim == 0:
            return f"[pages, {num_kv_heads}, page_size, {2 * head_size}]"
        return f"[2, pages, page_size, {num_kv_heads}, {head_size}]"

    def check(self, kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
        """Raise LayoutError unless ``kv_cache`` has this layout's shape and strides."""
        shape = tuple(kv_cache.shape)
        if self.page_dim == 0:
            ok = len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size
        else:
            ok = len(shape) == 5 and shape[0] == 2 and shape[3] == num_kv_heads and shape[4] == head_size
        if not ok:
            raise LayoutError(f"kv_cache has shape {list(shape)}, not {self.expected_shape(num_kv_heads, head_size)} "
                              f"as layout {self.name!r} requires")
        if self.physical_order is not None and not strides_follow(kv_cache, self.physical_order):
            raise LayoutError(f"kv_cache strides {list(kv_cache.stride())} (shape {list(shape)}) do not lay its axes "
                              f"out in the order {list(self.physical_order)} that layout {self.name!r} declares")
        if self.to_snapshot is not None:
            # The conversion reads each (page, head) slot in memory order, as the kernel does.
            tokens, width = shape[2], shape[3]
            if kv_cache.stride(3) != 1 or kv_cache.stride(2) != width:
                raise LayoutError(f"kv_cache strides {list(kv_cache.stride())}: layout {self.name!r} needs each "
                                  f"(page, head) slot of {tokens}x{width} elements contiguous")

    def convert(self, pages: torch.Tensor) -> torch.Tensor:
        """Pages copied out of the engine cache (engine layout) → the same pages in :attr:`snapshot_layout`."""
        return pages if self.to_snapshot is None else self.to_snapshot(pages)


def _cpu_attn_to_vllm(pages: torch.Tensor) -> torch.Tensor:
    keys, values = split_kv(pages.contiguous(), CPU_ATTN_K_TRANSPOSED, pages.shape[-1] // 2)
    return join_kv(keys, values, LAYOUT_VLLM)


def vllm_to_cpu_attn(pages: torch.Tensor) -> torch.Tensor:
    """The inverse of the CPU_ATTN conversion: ``pages,heads,tokens,2*dim`` pages as CPU_ATTN's kernel stores them."""
    keys, values = split_kv(pages, LAYOUT_VLLM, pages.shape[-1] // 2)
    return join_kv(keys, values, CPU_ATTN_K_TRANSPOSED)


_CPU_ATTN_DESCRIPTION = ("vLLM CPU_ATTN (vec, vec16): per (page, head), K transposed [D, page_size] then V "
                         "[page_size, D]; converted to pages,heads,tokens,2*dim at capture")

# Layouts the capture API accepts by name (the vLLM plugin builds its own from the engine's declarations).
ENGINE_LAYOUTS: dict[str, EngineLayout] = {
    LAYOUT_VLLM: EngineLayout(LAYOUT_VLLM, LAYOUT_VLLM, 0, 2, None, "token rows of [K | V] per (page, head)"),
    LAYOUT_KV_PLANES: EngineLayout(LAYOUT_KV_PLANES, LAYOUT_KV_PLANES, 1, 2, None, "K and V planes of [page, token, head, dim]"),
    CPU_ATTN_K_TRANSPOSED: EngineLayout(CPU_ATTN_K_TRANSPOSED, LAYOUT_VLLM, 0, 2, _cpu_attn_to_vllm,
                                        _CPU_ATTN_DESCRIPTION),
}


def vllm_layout(member: Any) -> EngineLayout:
    """The layout of a vLLM layer cache of dense K/V content, stored in ``member``'s order (a ``KVCacheLayout``).

    The layer's tensor is vLLM's logical view ``[blocks, heads, tokens, K | V]``,
    which is kvdbg's ``pages,heads,tokens,2*dim``: only its strides depend on ``member``.
    """
    order = tuple(int(axis) for axis in member.layer_view_order)
    return EngineLayout(
        f"{VLLM_LAYOUT_PREFIX}{member.name}", LAYOUT_VLLM, 0, 2, None,
        f"vLLM's logical [blocks, heads, tokens, K|V] view, stored in {member.name} order "
        f"(layer axes in memory: {_axes(order)})", physical_order=order,
    )


def cpu_attn_layout(member: Any, kernel_variant: str | None) -> EngineLayout:
    """CPU_ATTN's layout for a cache stored in ``member``'s order by the kernel ``kernel_variant``.

    Raises LayoutError (one line) for a variant kvdbg has not verified.
    """
    if kernel_variant not in CPU_ATTN_VERIFIED:
        raise LayoutError(
            f"CPU_ATTN's {kernel_variant!r} kernel variant stores pages in a layout kvdbg has not verified "
            f"(verified: {', '.join(CPU_ATTN_VERIFIED)}); nothing is captured from it"
            + (" (a bfloat16 model with a block size multiple of 32 on an AMX CPU selects 'amx'; "
               "a float16 model selects 'vec')" if kernel_variant == "amx" else "")
        )
    order = tuple(int(axis) for axis in member.layer_view_order)
    return EngineLayout(CPU_ATTN_K_TRANSPOSED, LAYOUT_VLLM, 0, 2, _cpu_attn_to_vllm,
                        f"{_CPU_ATTN_DESCRIPTION}; stored in {member.name} order", physical_order=order)


def _axes(order: tuple[int, ...]) -> str:
    return ",".join("BHNC"[axis] for axis in order)


def engine_layout(name: str) -> EngineLayout:
    """The layout registered under ``name``, or ``vllm:<member>`` read from the installed vLLM's KVCacheLayout.

    LayoutError listing the known names otherwise.
    """
    layout = ENGINE_LAYOUTS.get(name)
    if layout is not None:
        return layout
    if isinstance(name, str) and name.startswith(VLLM_LAYOUT_PREFIX):
        member_name = name[len(VLLM_LAYOUT_PREFIX):]
        try:
            members = importlib.import_module("vllm.v1.kv_cache_layout").KVCacheLayout
        except Exception as exc:
            raise LayoutError(f"kv_layout {name!r} names a vLLM KVCacheLayout, but vllm.v1.kv_cache_layout does not "
                              f"import here ({type(exc).__name__}: {str(exc)[:120]})") from None
        if member_name not in members.__members__:
            raise LayoutError(f"kv_layout {name!r}: this vLLM's KVCacheLayout has no member {member_name!r} "
                              f"(it has {', '.join(members.__members__)})")
        return vllm_layout(members[member_name])
    raise LayoutError(f"kv_layout {name!r} is not a layout kvdbg knows; known: {', '.join(ENGINE_LAYOUTS)}, "
                      f"or {VLLM_LAYOUT_PREFIX}<KVCacheLayout member> with vLLM installed")


# --------------------------------------------------------------------------- what vLLM declares for a layer


@dataclass(frozen=True)
class LayerCacheDeclaration:
    """What a vLLM engine declares about one attention layer's KV cache (its own objects, read at run time)."""

    backend: str  # the backend's get_name()
    layout: Any  # the KVCacheLayout member the engine resolved (cache_config.get_resolved_kv_cache_layout())
    spec: Any  # the layer's KV cache spec, as the backend's metadata builder holds it (builder.kv_cache_spec)
    kv_cache_dtype: str  # the impl's kv_cache_dtype string
    supported_layouts: tuple[Any, ...] | None = None  # backend.supported_kv_cache_layouts(); None: any layout
    kernel_variant: str | None = None  # CPU_ATTN's "isa" on the layer
    decode_context_parallel_size: int = 1
    per_head_scales: bool = False  # the layer's q/k/v scales are tensors of more than one value


def declared_layout(decl: LayerCacheDeclaration, *, num_kv_heads: int, head_size: int) -> EngineLayout:
    """The layout a layer's declarations describe, or LayoutError saying in one line why kvdbg cannot store it.

    ``num_kv_heads`` and ``head_size`` are the layer impl's: the spec must agree with them.
    """
    spec, backend = decl.spec, decl.backend
    spec_name = type(spec).__name__
    lead = f"{backend} layers with {spec_name}"
    if not all(hasattr(spec, a) for a in ("num_kv_heads", "head_size", "dtype")):
        raise LayoutError(f"{backend}: the layer's KV cache spec is {spec_name}, not an attention cache of K and V")
    if any("MLA" in cls.__name__ for cls in type(spec).__mro__):
        raise LayoutError(f"{lead}: MLA's latent cache holds one compressed vector per token, not K and V; "
                          "a snapshot cannot hold it, nothing is captured")
    mode = getattr(spec, "kv_quant_mode", None)
    mode_name = getattr(mode, "name", "NONE" if mode is None else str(mode))
    if mode_name not in READABLE_QUANT_MODES:
        if getattr(mode, "is_per_token_head", False):
            what = "keeps a scale per token and head inside the cache, which the snapshot format does not hold"
        else:
            what = "packs or quantises K and V in a way kvdbg does not decode"
        raise LayoutError(f"{lead}: kv_quant_mode {mode_name} (kv_cache_dtype {decl.kv_cache_dtype!r}) {what}; "
                          f"kvdbg reads {' and '.join(READABLE_QUANT_MODES)} only, nothing is captured")
    if mode_name == "NONE" and decl.kv_cache_dtype not in UNQUANTISED_CACHE_DTYPES:
        raise LayoutError(f"{lead}: the spec declares kv_quant_mode NONE but the layer's kv_cache_dtype is "
                          f"{decl.kv_cache_dtype!r}; the declarations disagree, nothing is captured")
    if mode_name == "FP8_PER_TENSOR" and decl.kv_cache_dtype not in FP8_CACHE_DTYPES:
        raise LayoutError(f"{lead}: kv_cache_dtype {decl.kv_cache_dtype!r} is an FP8 format the snapshot format does "
                          f"not hold (it holds {' and '.join(FP8_CACHE_DTYPES)}: e4m3); nothing is captured")
    if mode_name == "FP8_PER_TENSOR" and decl.per_head_scales:
        raise LayoutError(f"{lead}: the FP8 scales are per head; a snapshot holds one k and one v scale per layer, "
                          "nothing is captured")
    packed = {a: getattr(spec, a, None) for a in ("num_head_slots", "state_content_bytes")}
    if any(v is not None for v in packed.values()):
        said = ", ".join(f"{a}={v}" for a, v in packed.items() if v is not None)
        raise LayoutError(f"{lead}: the backend packs the cache content ({said}), not dense K|V rows; "
                          "nothing is captured")
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    if head_size_v != spec.head_size:
        raise LayoutError(f"{lead}: head_size_v {head_size_v} differs from head_size {spec.head_size}; the snapshot "
                          "format holds K and V of one head size, nothing is captured")
    tokens_per_state = getattr(spec, "tokens_per_state", 1)
    if tokens_per_state != 1:
        raise LayoutError(f"{lead}: one cache state covers {tokens_per_state} tokens, not one; nothing is captured")
    for attr, what in (("attention_chunk_size", "chunked local attention"), ("rswa_window", "reference sliding "
                       "window attention (R-SWA)"), ("sink_len", "static attention-sink tokens")):
        if getattr(spec, attr, None) is not None:
            raise LayoutError(f"{lead}: {what} ({attr}={getattr(spec, attr)}) is a mask kvdbg's reference does not "
                              "model; nothing is captured")
    if spec_name in ("CrossAttentionSpec", "EncoderOnlyAttentionSpec") or not getattr(spec, "uses_slot_mapping", True):
        raise LayoutError(f"{lead}: this cache is not one paged decoder cache indexed by the step's block table and "
                          "lengths (cross-attention, encoder-only or self-addressed); nothing is captured")
    if getattr(spec, "dcp_sharded", False) and decl.decode_context_parallel_size > 1:
        raise LayoutError(f"{lead}: decode context parallelism ({decl.decode_context_parallel_size} ranks) shards "
                          "each request's tokens across ranks; a snapshot holds one whole cache, nothing is captured")
    if (spec.num_kv_heads, spec.head_size) != (num_kv_heads, head_size):
        raise LayoutError(f"{lead}: the spec declares {spec.num_kv_heads} KV heads of size {spec.head_size}, the "
                          f"layer has {num_kv_heads} of size {head_size}; nothing is captured")
    layout = decl.layout
    if decl.supported_layouts is not None and layout not in decl.supported_layouts:
        raise LayoutError(f"{backend}: the engine resolved the KV-cache layout {layout.name}, which the backend does "
                          f"not declare it reads ({', '.join(m.name for m in decl.supported_layouts)}); "
                          "nothing is captured")
    if backend == "CPU_ATTN":
        if str(decl.kv_cache_dtype) not in UNQUANTISED_CACHE_DTYPES:
            raise LayoutError(f"CPU_ATTN with kv_cache_dtype {decl.kv_cache_dtype!r}: kvdbg has verified its page "
                              "layout only for caches in the model dtype; nothing is captured from it")
        return cpu_attn_layout(layout, decl.kernel_variant)
    return vllm_layout(layout)


# --------------------------------------------------------------------------- the bytes agree


def check_written_kv(layout: EngineLayout, kv_cache: torch.Tensor, *, key: torch.Tensor, value: torch.Tensor,
                     slot_mapping: torch.Tensor, head_size: int, kv_cache_dtype: str = "auto",
                     k_scale: float = 1.0, v_scale: float = 1.0) -> int:
    """Read the slots an engine's cache update has just written back through ``layout``; they must be ``key``/``value``.

    ``key``/``value`` are ``[>= tokens, Hkv, D]`` as given to the update and
    ``slot_mapping`` ``[tokens]`` (negative: not written). A cache in the model
    dtype must hold them exactly; an FP8 cache their e4m3 rounding of
    ``x / scale`` (within the rounding). Returns how many tokens were compared;
    raises LayoutError naming the first slot that disagrees.
    """
    from kvdbg.snapshot.store import compact_cache

    slots = slot_mapping.detach().reshape(-1).to("cpu", torch.int64)
    written = slots[slots >= 0]
    if written.numel() == 0:
        return 0
    page_size = int(kv_cache.shape[layout.token_dim])
    page_ids = torch.unique(written // page_size)
    index_layout = LAYOUT_VLLM if layout.page_dim == 0 else LAYOUT_KV_PLANES
    pages = layout.convert(compact_cache(kv_cache, index_layout, page_ids.to(kv_cache.device)).to("cpu").contiguous())
    return check_written_pages(layout, pages, page_ids, page_size=page_size, key=key, value=value,
                               slot_mapping=slot_mapping, head_size=head_size, kv_cache_dtype=kv_cache_dtype,
                               k_scale=k_scale, v_scale=v_scale)


def check_written_pages(layout: EngineLayout, pages: torch.Tensor, page_ids: torch.Tensor, *, page_size: int,
                        key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, head_size: int,
                        kv_cache_dtype: str = "auto", k_scale: float = 1.0, v_scale: float = 1.0) -> int:
    """:func:`check_written_kv` on pages already copied out of the cache after its update.

    ``pages`` are in ``layout.snapshot_layout`` (converted), ``page_ids`` their
    sorted engine ids, which must include every page a slot of ``slot_mapping``
    lies in. A capture's writer calls this on the pages it copied for the
    snapshot, so that the engine's thread does not compare anything.
    """
    slots = slot_mapping.detach().reshape(-1).to("cpu", torch.int64)
    written = (slots >= 0).nonzero().reshape(-1)
    if written.numel() == 0:
        return 0
    slot_ids = slots[written]
    ids = page_ids.to("cpu", torch.int64)
    wanted = slot_ids // page_size
    if ids.numel() == 0:
        raise LayoutError(f"page {int(wanted[0])}, written by the cache update, is not among the pages read back")
    position = torch.searchsorted(ids, wanted).clamp(max=ids.numel() - 1)
    absent = ids[position] != wanted
    if bool(absent.any()):
        raise LayoutError(f"page {int(wanted[absent.nonzero()[0, 0]])}, written by the cache update, is not among "
                          "the pages read back")
    fp8 = kv_cache_dtype in FP8_CACHE_DTYPES
    cached_k, cached_v = split_kv(pages, layout.snapshot_layout, head_size, fp8=fp8)
    offsets = slot_ids % page_size
    for what, cached, given, scale in (("K", cached_k, key, k_scale), ("V", cached_v, value, v_scale)):
        got = cached[position, :, offsets, :]  # [tokens, Hkv, D]
        rows = given.detach().reshape(given.shape[0], -1, head_size)  # [T, Hkv*D] or [T, Hkv, D]
        want = rows[written.to(given.device)].to("cpu")
        if fp8:
            got = as_fp8(got).float() * scale
            want = (want.float() / scale).clamp(-FP8_MAX, FP8_MAX) * scale
            # e4m3 keeps 3 mantissa bits: within 1/16 relative, or half its smallest step (2^-10) near zero.
            bad = (got - want).abs() > want.abs() / 16 + scale * 2.0 ** -10
        else:
            bad = got.float() != want.to(got.dtype).float()
            bad |= got.isnan() != want.isnan()
        if bool(bad.any()):
            token, head, dim = (int(i) for i in bad.nonzero()[0])
            slot = int(slot_ids[token])
            raise LayoutError(
                f"read through layout {layout.name!r}, slot {slot} (page {slot // page_size}, token "
                f"{slot % page_size}) head {head} holds {what}[{dim}] = {float(got[token, head, dim]):.6g} where the "
                f"engine wrote {float(want[token, head, dim]):.6g}: the cache does not hold its content as declared"
            )
    return int(written.numel())


__all__ = ["CPU_ATTN_K_TRANSPOSED", "CPU_ATTN_VERIFIED", "ENGINE_LAYOUTS", "EngineLayout", "LayerCacheDeclaration",
           "LayoutError", "READABLE_QUANT_MODES", "VLLM_LAYOUT_PREFIX", "check_written_kv", "check_written_pages",
           "cpu_attn_layout", "declared_layout", "engine_layout", "strides_follow", "vllm_layout", "vllm_to_cpu_attn"]
