"""Tables for `kvdbg info`."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table

from kvdbg.render.fit import Column, FitTable
from kvdbg.render.util import human_bytes
from kvdbg.snapshot.info import InfoSummary, layer_features

MAX_REQUEST_ROWS = 32


def render_info(s: InfoSummary, *, full: bool = False) -> Group:
    parts = []
    overview = Table(title=f"snapshot {s.path}", show_header=False, title_justify="left")
    overview.add_column("field", style="bold")
    overview.add_column("value")
    layer, backend = s.layer, s.backend
    overview.add_row("format", f"kvdbg v{s.format_version}, layout {s.kv_layout}")
    overview.add_row("layer", f"{layer['name']}")
    overview.add_row(
        "heads",
        f"Hq {layer['num_heads']} / Hkv {layer['num_kv_heads']} (group {layer['num_heads'] // layer['num_kv_heads']}), "
        f"head_size {layer['head_size']}, scale {layer['scale']:.6g}",
    )
    window = layer["sliding_window"]
    overview.add_row(
        "mask",
        f"{'causal' if layer['causal'] else 'dense (non-causal)'}, "
        + (f"sliding window {window}" if window else "no sliding window"),
    )
    features = layer_features(layer, {t.name for t in s.tensors})
    if features:
        overview.add_row("features", ", ".join(features))
    dtype = f"model {layer['dtype']}, kv cache {layer['kv_cache_dtype']} (stored {s.kv_cache_dtype_stored})"
    if layer["kv_cache_dtype"] != "auto":
        dtype += f", scales q {layer['q_scale']:.6g} k {layer['k_scale']:.6g} v {layer['v_scale']:.6g}"
    overview.add_row("dtypes", dtype)
    overview.add_row(
        "backend",
        f"{backend['name']}: page_size {backend['page_size']}, max_model_len {backend['max_model_len']}, "
        f"max_decode_query_len {backend['max_decode_query_len']}, engine pages {backend['num_gpu_blocks']}",
    )
    overview.add_row("steps", str(s.num_steps))
    ratio = s.file_size / s.referenced_page_bytes if s.referenced_page_bytes else float("inf")
    overview.add_row(
        "size",
        f"file {human_bytes(s.file_size)}; {s.stored_pages} stored pages × {human_bytes(s.page_bytes)} = "
        f"{human_bytes(s.referenced_page_bytes)}; overhead {human_bytes(s.overhead_bytes)} ({ratio:.3f}×)",
    )
    if s.capture:
        shown = ", ".join(f"{k}={v}" for k, v in sorted(s.capture.items()) if not isinstance(v, (dict, list)))
        overview.add_row("capture", shown or "-")
    if s.notes:
        overview.add_row("notes", s.notes)
    parts.append(overview)

    tensors = FitTable([Column("name", priority=10, min_width=28), Column("dtype", priority=8),
                        Column("shape", whole=True, priority=9), Column("bytes", whole=True, priority=7)],
                       title="tensors")
    for t in s.tensors:
        tensors.add_row(t.name, t.dtype, "×".join(map(str, t.shape)) or "scalar", human_bytes(t.nbytes))
    parts.append(tensors)

    for step in s.steps:
        title = (
            f"step {step.step}: {step.num_reqs} requests, {step.num_tokens} query tokens, table width "
            f"{step.table_width}{', new K/V + slot_mapping' if step.has_update else ''}"
            f"{', engine output' if step.has_output else ''}"
        )
        table = FitTable([Column(col, whole=True, priority=10 - n)
                          for n, col in enumerate(("request", "seq_len", "query_len", "live pages"))], title=title)
        rows = step.requests if full else step.requests[:MAX_REQUEST_ROWS]
        for r in rows:
            table.add_row(str(r.index), str(r.seq_len), str(r.query_len), str(r.live_pages))
        if len(rows) < len(step.requests):
            table.add_row("…", f"{len(step.requests) - len(rows)} more (--full)", "", "")
        if step.requests_omitted:
            table.add_row("…", "too many requests to list", "", "")
        parts.append(table)
    return Group(*parts)
