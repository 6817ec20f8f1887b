"""What the plugin reads from vLLM: where its classes live, the facts of its configuration and batches,
and the constants the hooks share. No state; imports vLLM only inside the functions that ask it."""

from __future__ import annotations

import enum
import importlib
import importlib.util
import logging
import time
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("kvdbg.capture")
# The hooks' clock: wall time, what the engine waited for (a thread's CPU clock is a system call).
_clock = time.perf_counter_ns


@dataclass(frozen=True)
class KnownBackend:
    module: str
    impl: str
    builder: str


# Where vLLM 0.33 defines the classes of the backends kvdbg replays. Used when
# the backend registry (vllm.v1.attention.backends.registry) has no entry of
# that name; the registry is asked first because it honours overrides.
KNOWN_BACKENDS = {
    "FLASHINFER_TS": KnownBackend(
        "vllm.v1.attention.backends.flashinfer_ts", "FlashInferTSImpl", "FlashInferTSMetadataBuilder"
    ),
    "FLEX_ATTENTION": KnownBackend(
        "vllm.v1.attention.backends.flex_attention", "FlexAttentionImpl", "FlexAttentionMetadataBuilder"
    ),
    "CPU_ATTN": KnownBackend(
        "vllm.v1.attention.backends.cpu_attn", "CPUAttentionBackendImpl", "CPUAttentionMetadataBuilder"
    ),
}

# Where vLLM defines the per-process worker wrapper whose shutdown the writer drains in.
WORKER_MODULE = "vllm.v1.worker.worker_base"

# Where vLLM defines the attention layers whose backends the plugin wraps (or names when it does not):
# (module, class); the first importable module of each class name wins.
ATTENTION_LAYER_CLASSES = (
    ("vllm.model_executor.layers.attention.attention", "Attention"),
    ("vllm.attention.layer", "Attention"),
    ("vllm.model_executor.layers.attention.mla_attention", "MLAAttention"),
)

# How to see decode steps that full CUDA graphs hide from Python.
CUDAGRAPH_ADVICE = ("start vLLM with --enforce-eager, or with --compilation-config '{\"cudagraph_mode\": "
                    "\"PIECEWISE\"}' (attention then runs eagerly between the graph pieces)")

# Snapshot lines at INFO per process; later ones go to DEBUG (KVDBG_CAPTURE_MAX bounds them anyway).
INFO_SNAPSHOT_LINES = 8

_ENGINE_ATTR = "_kvdbg_engine"
_SIDE_TABLE_SIZE = 256



# Host slot mappings kept for do_kv_cache_update (one per KV-cache group of the latest builds).
_HOST_SLOTS_KEPT = 16


def _tensor_key(t: Any) -> tuple:
    """A device tensor's identity for :meth:`_PluginState.host_slots`: the same memory, seen the same way."""
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)


def _rows(t: Any, n: int) -> Any:
    """``t[:n]``, sliced only when it holds more rows (a runner's padded buffer): a slice is a torch call."""
    return t if t.shape[0] == n else t[:n]


def _parallel_facts(vllm_config: Any) -> dict[str, Any]:
    """This process's place among the engine's ranks, for kvdbg's replay and merge of a step's ranks.

    ``engine_instance`` is the id vLLM gives one engine's configuration (the
    same in all its worker processes); tensor-parallel rank and size say which
    heads this rank holds; ``total_num_kv_heads`` tells a split of the KV heads
    from their replication (fewer KV heads than ranks).
    """
    parallel = getattr(vllm_config, "parallel_config", None)
    model_config = getattr(vllm_config, "model_config", None)
    facts: dict[str, Any] = {
        "engine_instance": str(getattr(vllm_config, "instance_id", "") or "") or None,
        "tp_size": getattr(parallel, "tensor_parallel_size", None),
        "pp_size": getattr(parallel, "pipeline_parallel_size", None),
        "dp_rank": getattr(parallel, "data_parallel_rank", None),
    }
    try:
        from vllm.distributed import parallel_state

        facts["tp_rank"] = parallel_state.get_tensor_model_parallel_rank()
    except Exception:  # not initialised (a single process): the only rank
        facts["tp_rank"] = 0 if facts["tp_size"] in (None, 1) else None
    try:
        facts["total_num_kv_heads"] = int(model_config.get_total_num_kv_heads())
    except Exception:
        facts["total_num_kv_heads"] = None
    return facts


def _backend_in_use(layer: Any, fallback: str) -> str:
    """The name of the backend the layer was built with (what the engine really runs)."""
    backend = getattr(layer, "attn_backend", None)
    try:
        return str(backend.get_name())
    except Exception:
        return fallback


def _is_mla(backend_cls: Any, impl_cls: Any) -> bool:
    """Whether a backend serves MLA layers (its own ``is_mla()``, else the class names say so)."""
    is_mla = getattr(backend_cls, "is_mla", None)
    if callable(is_mla):
        try:
            return bool(is_mla())
        except Exception:
            pass
    return any("MLA" in getattr(c, "__name__", "") for c in (backend_cls, impl_cls) if c is not None)


def _per_head_scales(layer: Any) -> bool:
    """Whether any of the layer's q/k/v scales holds more than one value (per-head FP8 scales)."""
    for attr in ("_q_scale", "_k_scale", "_v_scale"):
        numel = getattr(getattr(layer, attr, None), "numel", None)
        if callable(numel) and numel() > 1:
            return True
    return False


_SUPPORTED_LAYOUTS: dict[Any, Any] = {}


def _supported_layouts(backend_cls: Any) -> "tuple[Any, ...] | None":
    """The layouts a backend declares its kernels read (``supported_kv_cache_layouts()``); None: any or unknown."""
    if backend_cls is None or not hasattr(backend_cls, "supported_kv_cache_layouts"):
        return None
    if backend_cls not in _SUPPORTED_LAYOUTS:
        try:
            layouts = backend_cls.supported_kv_cache_layouts()
        except Exception:
            layouts = None
        _SUPPORTED_LAYOUTS[backend_cls] = None if layouts is None else tuple(layouts)
    return _SUPPORTED_LAYOUTS[backend_cls]


def _step_refusal(common: Any) -> str | None:
    """Why this batch's attention mask is more than a snapshot holds (None: it is not)."""
    if getattr(common, "encoder_seq_lens", None) is not None:
        return "encoder_seq_lens set (cross-attention reads encoder lengths, not seq_lens)"
    if getattr(common, "dcp_local_seq_lens", None) is not None:
        return "dcp_local_seq_lens set (decode context parallelism splits each request's tokens across ranks)"
    if getattr(common, "rswa_prefix_lens", None) is not None:
        return "rswa_prefix_lens set (reference sliding window attention keeps the prompt visible)"
    if getattr(common, "mm_req_doc_ranges", None):
        return "mm_req_doc_ranges set (bidirectional multimodal prefix ranges)"
    return None


def _spec_record(spec: Any) -> dict[str, Any] | None:
    """The spec's declared fields as JSON values (the class name, enums by name, dtypes by name)."""
    if spec is None:
        return None
    record: dict[str, Any] = {"class": type(spec).__name__}
    fields = getattr(spec, "__dataclass_fields__", {})
    for name in fields:
        value = getattr(spec, name, None)
        if isinstance(value, enum.Enum):
            value = value.name
        elif isinstance(value, (bool, int, float, str)) or value is None:
            pass
        else:
            value = str(value)
        record[name] = value
    return record


def cudagraph_note(mode: Any, max_size: int | None, *, recorded: bool = False) -> list[tuple[int, str]]:
    """What to say of a process running under ``mode`` (vLLM's CUDAGraphMode): (log level, line) pairs, none
    when every step reaches Python.

    Full CUDA graphs replay the whole forward, attention included, without Python;
    piecewise graphs leave attention eager between their pieces::

        NONE, PIECEWISE        every step reaches Python
        FULL_DECODE_ONLY       decode batches up to the largest graph size: replayed
        FULL_AND_PIECEWISE     decode batches up to it: replayed; mixed and prefill batches: seen
        FULL                   every batch up to it: replayed

    ``recorded``: vLLM's graph wrapper is watched, so the copies capture and the sentinel need are recorded into
    those graphs and their steps are captured and checked (``graph_hooks``); otherwise they stay unseen.
    """
    def full(part: Any) -> bool:
        return getattr(part, "name", str(part)) == "FULL"

    try:
        decode, mixed = mode.decode_mode(), mode.mixed_mode()
    except Exception:
        decode = mixed = mode
    if not full(decode) and not full(mixed):
        return []
    name = getattr(mode, "name", mode)
    bound = f"of up to {max_size} tokens" if max_size else "of the sizes vLLM records graphs for"
    replayed = f"every batch {bound}" if full(mixed) else f"uniform decode batches {bound}"
    if recorded:
        return [(logging.INFO, f"cudagraph_mode is {name}: {replayed} run as full CUDA graphs; the copies kvdbg "
                               "needs of each selected layer are recorded into them, so those steps are captured "
                               "and checked too")]
    seen = "only larger batches" if full(mixed) else "prefill and mixed batches (and larger decode batches)"
    return [(logging.WARNING, f"cudagraph_mode is {name}: {replayed} run as full CUDA graphs, replayed without "
                              f"Python, so kvdbg cannot see or capture those steps; it sees {seen}. To capture "
                              f"decode steps, {CUDAGRAPH_ADVICE}")]


def _max_graph_size(compilation: Any) -> int | None:
    size = getattr(compilation, "max_cudagraph_capture_size", None)
    if isinstance(size, int) and size > 0:
        return size
    sizes = getattr(compilation, "cudagraph_capture_sizes", None)
    try:
        return max(int(x) for x in sizes) if sizes else None
    except (TypeError, ValueError):
        return None


def _requests_with_tokens(common: Any) -> int:
    """The batch's requests, less the padding rows vLLM adds after them for a full CUDA graph's batch size
    (rows of no tokens, read from the host copy of the query offsets; without one, every row)."""
    num_reqs = int(common.num_reqs)
    offsets = getattr(common, "query_start_loc_cpu", None)
    # A tensor's shape, not len(): len() of a tensor is a torch call in Python (a build runs on every step).
    if num_reqs == 0 or offsets is None or (offsets.shape[0] if hasattr(offsets, "shape") else len(offsets)) \
            < num_reqs + 1:
        return num_reqs
    import numpy as np

    # numpy's view of the host tensor: an index of a torch tensor is a torch call (a build runs on every step).
    return requests_in_offsets(offsets.numpy() if hasattr(offsets, "numpy") else np.asarray(offsets), num_reqs)


def requests_in_offsets(values: Any, rows: int) -> int:
    """The requests among a batch's first ``rows`` rows, from its query offsets (``values``: a numpy array of at
    least ``rows + 1``): the rows before the first of the padding rows of no tokens that vLLM puts after them."""
    if rows <= 0:
        return 0
    total = values[rows]
    if values[rows - 1] != total:  # the last row has tokens: no padding (every eager step)
        return rows
    return int(values[: rows + 1].searchsorted(total))  # the first row that ends where the batch does


def _graph_capturing(t: Any) -> bool:
    if not getattr(t, "is_cuda", False):  # asked on every hook call: a host tensor needs nothing more
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def _resolve_backend(name: str) -> tuple[type, type, type | None, str]:
    """(impl class, builder class, backend class or None, where they were found)."""
    registry_error = None
    try:
        registry = importlib.import_module("vllm.v1.attention.backends.registry")
        member = registry.AttentionBackendEnum[name]
        backend_cls = member.get_class()
        return backend_cls.get_impl_cls(), backend_cls.get_builder_cls(), backend_cls, f"registry {member.get_path()}"
    except Exception as exc:  # an unknown name raises ValueError there; fall through to the known modules
        registry_error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    known = KNOWN_BACKENDS.get(name)
    if known is None:
        raise LookupError(f"the vLLM backend registry does not resolve it ({registry_error}) and kvdbg knows no "
                          f"module for it (known: {', '.join(KNOWN_BACKENDS)})")
    module = importlib.import_module(known.module)
    return getattr(module, known.impl), getattr(module, known.builder), None, f"module {known.module}"
