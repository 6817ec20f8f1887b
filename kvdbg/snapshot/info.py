"""`kvdbg info`: a header-only summary of a snapshot (no torch, no tensor data beyond lengths)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from kvdbg.snapshot.format import Header, read_header, read_index_tensor

# Per-request lengths are read for at most this many requests per step.
MAX_REQUESTS_READ = 65536


@dataclass
class TensorRow:
    """One tensor of the file, from the header."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass
class RequestRow:
    """One request's lengths at one step."""

    index: int
    seq_len: int
    query_len: int
    live_pages: int


@dataclass
class StepSummary:
    """One step's batch shape and, for reasonable batches, each request's lengths."""

    step: int
    num_reqs: int
    num_tokens: int
    table_width: int
    has_update: bool
    has_output: bool
    requests: list[RequestRow] = field(default_factory=list)
    requests_omitted: bool = False


@dataclass
class InfoSummary:
    """Everything `kvdbg info` shows, read from the header and the small index tensors."""

    path: str
    file_size: int
    format_version: str
    kv_layout: str
    layer: dict[str, Any]
    backend: dict[str, Any]
    num_steps: int
    capture: dict[str, Any]
    notes: str
    stored_pages: int
    page_bytes: int
    referenced_page_bytes: int
    kv_cache_dtype_stored: str
    tensors: list[TensorRow]
    steps: list[StepSummary]

    @property
    def overhead_bytes(self) -> int:
        return self.file_size - self.referenced_page_bytes

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["overhead_bytes"] = self.overhead_bytes
        return out


def layer_features(layer: dict[str, Any], tensor_names: set[str]) -> list[str]:
    """The layer's attention features beyond the mask, one short phrase each (empty: none)."""
    out = []
    if layer.get("attn_type", "decoder") != "decoder":
        out.append(f"attn_type {layer['attn_type']}")
    if layer.get("logits_soft_cap"):
        out.append(f"soft cap {layer['logits_soft_cap']:g}")
    for flag, tensor, what in (("has_sinks", "sinks", "sinks"), ("has_alibi", "alibi_slopes", "ALiBi")):
        if layer.get(flag):
            sqrt = " (square root)" if flag == "has_alibi" and layer.get("alibi_sqrt") else ""
            out.append(f"{what}{sqrt}" + ("" if tensor in tensor_names else " (flag only: values not stored)"))
    if layer.get("chunk_lookback") is not None:
        out.append(f"chunk lookback {layer['chunk_lookback']}")
    if layer.get("kv_sharing_target"):
        out.append(f"KV shared with {layer['kv_sharing_target']}")
    if layer.get("mm_prefix"):
        out.append("PrefixLM multimodal ranges (not stored)")
    if layer.get("rswa_window"):
        out.append(f"R-SWA window {layer['rswa_window']} (prefix lengths not stored)")
    return out


def summarize(path: str | os.PathLike) -> InfoSummary:
    header = read_header(path)
    return summarize_header(header)


def summarize_snapshot(snapshot) -> InfoSummary:
    """The summary of a snapshot load_snapshot read: its parsed header and its loaded lengths, no file access."""
    if snapshot.header is None or snapshot.header.meta is not snapshot.meta:
        raise ValueError("summarize_snapshot needs a snapshot as load_snapshot returned it")
    lengths = [(step.seq_lens.tolist(), step.query_start_loc.tolist()) for step in snapshot.steps]
    return summarize_header(snapshot.header, lengths)


def summarize_header(header: Header, lengths: list[tuple[list[int], list[int]]] | None = None) -> InfoSummary:
    """The summary from the header; ``lengths`` (seq_lens, query_start_loc per step), when already loaded,
    spare reading them from the file."""
    meta = header.meta
    kv = header.tensors["kv_cache"]
    stored_pages = header.tensors["page_ids"].shape[0]
    page_bytes = kv.nbytes // stored_pages if stored_pages else 0
    ps = meta.backend.page_size
    steps = []
    for i in range(meta.num_steps):
        bt = header.step_tensor(i, "block_table")
        q = header.step_tensor(i, "query")
        summary = StepSummary(
            step=i,
            num_reqs=bt.shape[0],
            num_tokens=q.shape[0],
            table_width=bt.shape[1],
            has_update=header.step_tensor(i, "slot_mapping") is not None,
            has_output=header.step_tensor(i, "output") is not None,
        )
        if bt.shape[0] <= MAX_REQUESTS_READ:
            prefix = meta.step_prefix(i)
            lens, qsl = lengths[i] if lengths is not None else (
                read_index_tensor(header, prefix + "seq_lens"), read_index_tensor(header, prefix + "query_start_loc"))
            for r, length in enumerate(lens):
                summary.requests.append(
                    RequestRow(r, length, qsl[r + 1] - qsl[r], -(-length // ps) if length > 0 else 0)
                )
        else:
            summary.requests_omitted = True
        steps.append(summary)
    return InfoSummary(
        path=header.path,
        file_size=header.file_size,
        format_version=header.metadata.get("kvdbg.format", "?"),
        kv_layout=meta.kv_layout,
        layer=asdict(meta.layer),
        backend=asdict(meta.backend),
        num_steps=meta.num_steps,
        capture=meta.capture,
        notes=meta.notes,
        stored_pages=stored_pages,
        page_bytes=page_bytes,
        referenced_page_bytes=kv.nbytes,
        kv_cache_dtype_stored=kv.dtype,
        tensors=[TensorRow(t.name, t.dtype, list(t.shape), t.nbytes) for t in
                 sorted(header.tensors.values(), key=lambda t: t.name)],
        steps=steps,
    )


__all__ = ["InfoSummary", "summarize", "summarize_header", "summarize_snapshot"]
