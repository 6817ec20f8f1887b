"""Tables for `kvdbg import`: every dumped call, what became of it, and the snapshots written."""

from __future__ import annotations

import os
import re

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.importers.session import IMPORTED, REFUSED, SKIPPED, USED, ImportReport

_STATUS_STYLE = {IMPORTED: "green", USED: "dim", SKIPPED: "yellow", REFUSED: "red"}
_CALL_NAME = re.compile(r"_call(\d+)$")


def short_call(call: str, function: str) -> str:
    """``BatchDecodeWithPagedKVCacheWrapper.run`` call 3 as ``BatchDecode.run #3`` (fits 80 columns)."""
    match = _CALL_NAME.search(call)
    cls, dot, method = function.rpartition(".")
    cls = cls.removesuffix("WithPagedKVCacheWrapper")
    name = f"{cls}{dot}{method}" if cls else method
    return f"{name} #{int(match.group(1))}" if match else name


def _detail(item, rows: dict[str, int], in_dir: bool) -> str:
    if item.status == USED and item.used_by in rows:
        return f"read for #{rows[item.used_by]}"
    if item.status != IMPORTED:
        return item.reason
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
    if not f["output"]:
        text += "; " + item.reason
    if item.output:
        text += f" -> {os.path.basename(item.output) if in_dir else item.output}"
    return text


def render_import(report: ImportReport, *, written: bool) -> Group:
    table = Table(title=f"FlashInfer dump {report.source}", title_justify="left", expand=False)
    table.add_column("#", justify="right")
    table.add_column("call", overflow="fold")
    table.add_column("status")
    table.add_column("what", overflow="fold")
    written_to = {os.path.dirname(item.output) for item in report.items if item.output}
    in_dir = len([item for item in report.items if item.output]) > 1
    rows = {item.call: index for index, item in enumerate(report.items)}
    for index, item in enumerate(report.items):
        table.add_row(str(index), short_call(item.call, item.function),
                      Text(item.status, style=_STATUS_STYLE.get(item.status, "")), _detail(item, rows, in_dir))
    counts = ", ".join(f"{report.count(s)} {s}" for s in (IMPORTED, USED, SKIPPED, REFUSED) if report.count(s))
    n = report.count(IMPORTED)
    where = f" into {next(iter(written_to))}" if in_dir and len(written_to) == 1 else ""
    tail = (f"{n} snapshot(s) written{where}; replay each with `kvdbg replay`" if written else
            f"{n} snapshot(s) to write: give -o to write them") if n else "nothing imported"
    return Group(table, Text(f"{len(report.items)} call(s): {counts}. {tail}."))
