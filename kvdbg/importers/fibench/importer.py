"""A flashinfer-bench dataset imported whole: every workload listed, each one of a paged GQA decode or prefill
definition converted, and written.

A workload becomes a snapshot when all its inputs are stored (safetensors, and ``sm_scale`` as a scalar or a
tensor). flashinfer-bench records no output tensor (a trace holds an evaluation: status, errors, latency), so
the snapshot holds no captured output: `kvdbg replay` compares its backends with the reference and says so.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvdbg.errors import OptionError
from kvdbg.importers.dumpdir import DumpError
from kvdbg.importers.fibench.dataset import Dataset, DatasetError, WorkloadLine
from kvdbg.importers.fibench.gqa_paged import (InputPlan, PagedDefinition, classify, plan_inputs, read_definition,
                                               workload_call)
from kvdbg.importers.flashinfer_paged import to_snapshot
from kvdbg.importers.session import (FLASHINFER_BENCH, IMPORTED, REFUSED, SKIPPED, ImportItem, ImportReport,
                                     output_targets, snapshot_facts, write_snapshot)

NO_OUTPUT = ("no recorded output (flashinfer-bench records a workload's inputs only): replay compares the "
             "backends with the reference")


@dataclass
class WorkloadItem(ImportItem):
    """One workload line and what became of it (``call`` is its uuid, ``function`` its definition's name)."""

    where: str = ""  # workloads/<file>.jsonl:<line>

    def to_json(self) -> dict[str, Any]:
        return {"workload": self.call, "definition": self.function, "where": self.where, "status": self.status,
                "reason": self.reason, "output": self.output, **({"snapshot": self.facts} if self.facts else {})}


def _safe(text: str, limit: int) -> str:
    """``text`` as part of a file name: letters, digits, ``_``, ``-`` and ``.`` only (it comes from the dataset)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)[:limit].lstrip(".") or "x"


def snapshot_file_name(index: int, definition: str, uuid: str) -> str:
    """``002_gqa_paged_decode_h32_kv8_d128_ps16_6120f144.safetensors``: the index keeps names unique."""
    return f"{index:03d}_{_safe(definition, 100)}_{_safe(uuid, 8)}.safetensors"


def _select(lines: list[WorkloadLine], workload: str | None) -> list[WorkloadLine]:
    """The lines of ``workload`` (a uuid, or a prefix only one uuid has); all lines when None."""
    if workload is None:
        return lines
    exact = [line for line in lines if line.uuid == workload]
    if exact:
        return exact
    prefixed = {line.uuid for line in lines if line.uuid.startswith(workload)}
    if len(prefixed) == 1:
        return [line for line in lines if line.uuid in prefixed]
    if prefixed:
        raise OptionError(f"--workload {workload}: {len(prefixed)} workloads' uuids start with it; give more of it")
    raise OptionError(f"--workload {workload}: no workload has this uuid among the {len(lines)} read")


def import_dataset(root: str | os.PathLike, only: Path | None = None, *, workload: str | None = None,
                   output: str | os.PathLike | None = None, overwrite: bool = False) -> ImportReport:
    """Import the flashinfer-bench dataset at ``root`` (its every ``workloads/**/*.jsonl``, or the one file
    ``only``): list every workload, convert each of a paged GQA decode or prefill definition, and write its
    snapshot when ``output`` is given (a file for one workload, else a directory made on first write).

    Every workload is checked before any tensor is read (its axes, its inputs' kinds, its blobs' paths), and
    every target before anything is written; then one workload at a time is read, converted, written and let
    go, so that a large dataset never holds more than one snapshot in memory.
    """
    dataset = Dataset(root)
    lines = _select(list(dataset.workloads(only)), workload)
    items: list[WorkloadItem] = []
    candidates: list[tuple[int, WorkloadLine, PagedDefinition, InputPlan]] = []
    read: dict[str, PagedDefinition | str] = {}  # a definition's name -> it read, or why it is refused
    for line in lines:
        def item(status: str, reason: str = "") -> WorkloadItem:
            return WorkloadItem(line.uuid or "?", line.definition or "?", status, reason, where=line.where)

        if line.error:
            items.append(item(REFUSED, line.error))
            continue
        try:
            definition = dataset.definition(line.definition)
        except DatasetError as exc:
            items.append(item(REFUSED, f"{line.where}: {exc}"))
            continue
        skip = classify(definition)
        if skip is not None:
            items.append(item(SKIPPED, skip))
            continue
        if line.definition not in read:
            try:
                read[line.definition] = read_definition(definition)
            except DatasetError as exc:
                read[line.definition] = str(exc)
        pdef = read[line.definition]
        if isinstance(pdef, str):
            items.append(item(REFUSED, pdef))
            continue
        try:
            plan = plan_inputs(dataset, pdef, line)
        except DatasetError as exc:
            items.append(item(REFUSED, str(exc)))
            continue
        candidates.append((len(items), line, pdef, plan))
        items.append(item(IMPORTED))  # until converted

    names = [snapshot_file_name(i, line.definition, line.uuid) for i, (_, line, _, _) in enumerate(candidates)]
    targets = output_targets(names, output, overwrite, f"the dataset holds {len(candidates)} paged GQA "
                                                       "workloads") if output is not None and candidates else []
    for number, (index, line, pdef, plan) in enumerate(candidates):
        item = items[index]
        try:
            call = workload_call(dataset, pdef, line, plan)
            snapshot = to_snapshot(call, layer_name=f"{pdef.name} (workload {line.uuid})",
                                   notes=f"imported by kvdbg from flashinfer-bench workload {line.uuid} of "
                                         f"{pdef.name} ({line.where}); no output was recorded")
        except (DatasetError, DumpError) as exc:
            item.status, item.reason = REFUSED, str(exc)
            continue
        item.reason, item.facts = NO_OUTPUT, snapshot_facts(snapshot)
        if targets:
            item.output = write_snapshot(snapshot, targets[number], output, overwrite)
        del snapshot, call
    return ImportReport(str(only or root), list(items), FLASHINFER_BENCH)
