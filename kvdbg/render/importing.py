"""Tables for `kvdbg import`: every dumped call or dataset workload, what became of it, and the snapshots written."""

from __future__ import annotations

import os
import re

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.importers.session import FLASHINFER_BENCH, IMPORTED, REFUSED, SKIPPED, USED, ImportReport

_STATUS_STYLE = {IMPORTED: "green", USED: "dim", SKIPPED: "yellow", REFUSED: "red"}
_CALL_NAME = re.compile(r"_call(\d+)$")


def short_call(call: str, function: str) -> str:
    """``BatchDecodeWithPagedKVCacheWrapper.run`` call 3 as ``BatchDecode.run #3`` (fits 80 columns)."""
    match = _CALL_NAME.search(call)
    cls, dot, method = function.rpartition(".")
    cls = cls.removesuffix("WithPagedKVCacheWrapper")
    name = f"{cls}{dot}{method}" if cls else method
    return f"{name} #{int(match.group(1))}" if match else name


def _detail(item, rows: dict[str, int], in_dir: bool, bench: bool) -> str:
    if item.status == USED and item.used_by in rows:
        return f"read for #{rows[item.used_by]}"
    if item.status != IMPORTED:
        # a workload's reason starts with its file, line and uuid, for the one-line error; the row names it
        return item.reason.removeprefix(f"{getattr(item, 'where', '')} ({item.call}): ") if bench else item.reason
    f = item.facts
    parts = [f"{f['requests']} req, {f['tokens']} tok", f"Hq {f['num_heads']}/Hkv {f['num_kv_heads']} x {f['head_size']}",
             f"{f['kv_layout']} page {f['page_size']}", "causal" if f["causal"] else "not causal"]
    if f["sliding_window"]:
        parts.append(f"window {f['sliding_window']}")
    if f["logits_soft_cap"]:
        parts.append(f"soft cap {f['logits_soft_cap']:g}")
    if f["sinks"]:
        parts.append("sinks")
    parts.append(f["dtype"] if f["kv_cache_dtype"] == "auto" else f"{f['dtype']}, kv {f['kv_cache_dtype']}")
    text = ", ".join(parts)
    if not f["output"] and not bench:  # every workload lacks one: the closing line says it once
        text += "; " + item.reason
    if item.output:
        text += f" -> {os.path.basename(item.output) if in_dir else item.output}"
    return text


def render_import(report: ImportReport, *, written: bool) -> Group:
    bench = report.kind == FLASHINFER_BENCH
    title = f"flashinfer-bench dataset {report.source}" if bench else f"FlashInfer dump {report.source}"
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("#", justify="right")
    table.add_column("workload" if bench else "call", overflow="fold")
    table.add_column("status")
    table.add_column("what", overflow="fold")
    written_to = {os.path.dirname(item.output) for item in report.items if item.output}
    in_dir = len([item for item in report.items if item.output]) > 1
    rows = {item.call: index for index, item in enumerate(report.items)}
    for index, item in enumerate(report.items):
        label = f"{item.function} {item.call[:8]}" if bench else short_call(item.call, item.function)
        table.add_row(str(index), label,
                      Text(item.status, style=_STATUS_STYLE.get(item.status, "")), _detail(item, rows, in_dir, bench))
    counts = ", ".join(f"{report.count(s)} {s}" for s in (IMPORTED, USED, SKIPPED, REFUSED) if report.count(s))
    n = report.count(IMPORTED)
    where = f" into {next(iter(written_to))}" if in_dir and len(written_to) == 1 else ""
    tail = (f"{n} snapshot(s) written{where}; replay each with `kvdbg replay`" if written else
            f"{n} snapshot(s) to write: give -o to write them") if n else "nothing imported"
    if bench and n:
        tail += (". flashinfer-bench records no output tensor, so a replay compares the backends with the "
                 "reference (name the one to judge with --backend)")
    return Group(table, Text(f"{len(report.items)} {report.unit}(s): {counts}. {tail}."))
