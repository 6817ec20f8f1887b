"""A FlashInfer dump session read whole: every call listed, each paged-attention ``run`` paired with its
wrapper's ``__init__`` and latest ``plan`` (by the instance the records name), converted, and written.

A run pairs with the ``plan`` of the same wrapper instance -- the record's ``(process_id, self_id)``, the key
FlashInfer's own replay uses -- made last before it, in session order; an ``__init__`` of that key starts
a new wrapper (an id the process reused), so a plan before it no longer counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdbg.errors import OptionError
from kvdbg.importers.dumpdir import DumpCall, DumpError, read_session
from kvdbg.importers.flashinfer_paged import ONE_SHOT, from_one_shot, from_wrapper, to_snapshot, wrapper_class

IMPORTED, USED, SKIPPED, REFUSED = "imported", "used", "skipped", "refused"
_ATTENTION_WORDS = ("attention", "decode", "prefill", "mla", "context", "fmha", "xqa")


@dataclass
class ImportItem:
    """One dumped call and what became of it."""

    call: str  # the call's directory name
    function: str
    status: str  # imported | used (a wrapper's __init__/plan a run read) | skipped | refused
    reason: str = ""
    output: str | None = None  # the snapshot written (imported)
    facts: dict[str, Any] = field(default_factory=dict)  # requests, tokens, heads, layout, ... (imported)
    used_by: str | None = None  # the run (its call directory) that read this __init__ or plan

    def to_json(self) -> dict[str, Any]:
        return {"call": self.call, "function": self.function, "status": self.status, "reason": self.reason,
                "output": self.output, "used_by": self.used_by, **({"snapshot": self.facts} if self.facts else {})}


FLASHINFER_DUMP, FLASHINFER_BENCH = "flashinfer_dump", "flashinfer_bench"


@dataclass
class ImportReport:
    """What an import found: one item per dumped call (a FlashInfer dump) or per workload (flashinfer-bench)."""

    source: str
    items: list[ImportItem]
    kind: str = FLASHINFER_DUMP

    def count(self, status: str) -> int:
        return sum(1 for item in self.items if item.status == status)

    @property
    def imported(self) -> list[ImportItem]:
        return [item for item in self.items if item.status == IMPORTED]

    @property
    def unit(self) -> str:
        return "workload" if self.kind == FLASHINFER_BENCH else "call"

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, f"{self.unit}s": len(self.items),
                "totals": {s: self.count(s) for s in (IMPORTED, USED, SKIPPED, REFUSED)},
                "items": [item.to_json() for item in self.items]}


def _skip_reason(function: str) -> str:
    lowered = function.lower()
    if any(word in lowered for word in _ATTENTION_WORDS):
        return ("attention, but not a call kvdbg imports (it reads the paged decode and prefill wrappers' "
                "plan + run, and trtllm_batch_decode/context_with_kv_cache)")
    return "not paged attention"


def snapshot_facts(snapshot) -> dict[str, Any]:
    meta, step = snapshot.meta, snapshot.steps[0]
    return {"requests": step.num_reqs, "tokens": step.num_tokens, "num_heads": meta.layer.num_heads,
            "num_kv_heads": meta.layer.num_kv_heads, "head_size": meta.layer.head_size,
            "page_size": meta.backend.page_size, "kv_layout": meta.capture.get("kv_layout"),
            "causal": meta.layer.causal, "sliding_window": meta.layer.sliding_window,
            "logits_soft_cap": meta.layer.logits_soft_cap, "sinks": meta.layer.has_sinks,
            "dtype": meta.layer.dtype, "kv_cache_dtype": meta.layer.kv_cache_dtype,
            "output": step.output is not None}


def _convert(call: DumpCall, read) -> tuple[ImportItem, Any]:
    """``call`` imported (``read()`` gives its PagedCall) with its snapshot, or refused with the reason."""
    try:
        snapshot = to_snapshot(read(), layer_name=f"{call.function} ({call.name})")
    except DumpError as exc:
        if "refused:" in str(exc) and "pickle" in str(exc):
            raise  # a hostile file stops the import; it is never one call's problem
        return ImportItem(call.name, call.function, REFUSED, str(exc)), None
    note = "" if snapshot.steps[0].output is not None else \
        "no recorded output (the call did not complete, or ran under a CUDA graph not replayed yet)"
    return ImportItem(call.name, call.function, IMPORTED, note, facts=snapshot_facts(snapshot)), snapshot


@dataclass
class _Candidate:
    """A paged-attention call to import: the call, how to read it, and the wrapper calls it reads."""

    call: DumpCall
    read: Any
    used: tuple[DumpCall, ...] = ()


def _pair(calls: list[DumpCall], only: str | None, kv_layout: str | None):
    """Every call's item (skipped, or refused before reading a tensor) and the candidates to import, in order."""
    items: dict[str, ImportItem] = {}
    candidates: list[_Candidate] = []
    inits: dict[Any, DumpCall] = {}
    plans: dict[Any, DumpCall] = {}
    for call in calls:
        cls = wrapper_class(call.function)
        method = call.function.partition(".")[2]
        if cls is None and call.function in ONE_SHOT:
            if only is None or call.name == only:
                candidates.append(_Candidate(call, lambda call=call: from_one_shot(call)))
            continue
        if cls is None:
            items[call.name] = ImportItem(call.name, call.function, SKIPPED, _skip_reason(call.function))
            continue
        key = call.instance
        if key is None:
            items[call.name] = ImportItem(call.name, call.function, REFUSED,
                                          "the record names no wrapper instance (self_id)")
            continue
        if method == "__init__":
            inits[key] = call
            plans.pop(key, None)
            items[call.name] = ImportItem(call.name, call.function, SKIPPED, "wrapper never planned and run")
        elif method == "plan":
            plans[key] = call
            items[call.name] = ImportItem(call.name, call.function, SKIPPED, "plan never run")
        elif method == "run":
            if only is not None and call.name != only:
                continue
            plan = plans.get(key)
            if plan is None:
                items[call.name] = ImportItem(call.name, call.function, REFUSED,
                                              "no plan of this wrapper before the run in the dump (the plan "
                                              "holds the page table)")
                continue
            init = inits.get(key)
            candidates.append(_Candidate(call, lambda call=call, init=init, plan=plan:
                                         from_wrapper(init, plan, call, kv_layout),
                                         tuple(c for c in (plan, init) if c is not None)))
        else:
            items[call.name] = ImportItem(call.name, call.function, SKIPPED, f"wrapper method {method} "
                                          "(kvdbg reads __init__, plan and run)")
    return items, candidates


def output_targets(file_names: list[str], given: str | os.PathLike, overwrite: bool, holds: str) -> list[Path]:
    """Where each snapshot goes (``file_names`` inside a directory), every one checked before anything is read
    or written. One snapshot goes to ``given`` itself unless it is a directory or ends with a slash; ``holds``
    says what the source holds ("the dump holds 3 paged-attention calls"), for the refusal of a file."""
    from kvdbg.util.atomic import check_output

    output = Path(given)
    if len(file_names) == 1 and not output.is_dir() and not os.fspath(given).endswith(("/", os.sep)):
        targets = [output]
    else:
        if output.exists() and not output.is_dir():
            raise OptionError(f"-o {output}: {holds}; give a directory to write one snapshot each into")
        targets = [output / name for name in file_names]
    for target in targets:
        check_output(target, overwrite=overwrite, what="-o")
    return targets


def write_snapshot(snapshot, target: Path, given: str | os.PathLike, overwrite: bool) -> str:
    """Write ``snapshot`` to ``target``, making ``-o``'s directory on the first write when it is one."""
    from kvdbg.snapshot.store import save_snapshot

    directory = Path(given)
    if target != directory and not directory.is_dir():
        try:
            directory.mkdir()
        except OSError as exc:
            raise OptionError(f"cannot create -o {given}: {exc.strerror or exc}") from None
    return save_snapshot(snapshot, target, overwrite=overwrite)


def import_session(path: str | os.PathLike, *, kv_layout: str | None = None, output: str | os.PathLike | None = None,
                   overwrite: bool = False) -> ImportReport:
    """Import the dump at ``path`` (a session or one call): list every call, convert each paged-attention call,
    and write its snapshot when ``output`` is given (a file for one call, else a directory made on first write).

    Every target is checked, and every tensor file the import will read is opened (``weights_only``,
    memory-mapped), before the first snapshot is written: a hostile file or a name taken stops the import
    with nothing written. Then one call at a time is converted, written and let go, so that a long session
    never holds more than one snapshot in memory.
    """
    calls, only = read_session(path)
    items, candidates = _pair(calls, only, kv_layout)
    targets = output_targets([snapshot_file_name(i, c.call.name, c.call.function) for i, c in enumerate(candidates)],
                             output, overwrite, f"the dump holds {len(candidates)} paged-attention calls") \
        if output is not None and candidates else []
    for candidate in candidates:  # a hostile pickle anywhere refuses the whole import, before any write
        for kind in ("inputs", "outputs"):
            candidate.call.tensors(kind)
        candidate.call.drop_tensors()
    for index, candidate in enumerate(candidates):
        call = candidate.call
        item, snapshot = _convert(call, candidate.read)
        items[call.name] = item
        if snapshot is not None:
            for used in candidate.used:
                items[used.name] = ImportItem(used.name, used.function, USED, f"read for {call.name}",
                                              used_by=call.name)
            if targets:
                item.output = write_snapshot(snapshot, targets[index], output, overwrite)
        del snapshot
        call.drop_tensors()
    ordered = [items[c.name] for c in calls if c.name in items]
    if only is not None:
        ordered = [item for item in ordered if item.call == only]
        if not ordered or (ordered[0].status == SKIPPED and wrapper_class(ordered[0].function)):
            call = next(c for c in calls if c.name == only)
            reason = (f"a wrapper's {call.function.partition('.')[2]}: give the directory of the run that used it, "
                      "or the whole dump" if wrapper_class(call.function) else _skip_reason(call.function))
            ordered = [ImportItem(call.name, call.function, SKIPPED, reason)]
    return ImportReport(str(path), ordered, FLASHINFER_DUMP)


def snapshot_file_name(index: int, call: str, function: str) -> str:
    """``003_BatchDecode.run_call0003.safetensors``: the index keeps names unique across processes."""
    cls, _, method = function.partition(".")
    sequence = call.rpartition("_call")[2]
    sequence = sequence if sequence.isdigit() else str(index)
    name = cls.removesuffix("WithPagedKVCacheWrapper") + (f".{method}" if method else "")
    return f"{index:03d}_{name}_call{sequence}.safetensors"
