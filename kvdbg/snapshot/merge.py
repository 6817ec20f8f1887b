"""Join the tensor-parallel ranks of one captured step into one snapshot of all heads.

Under tensor parallelism vLLM gives rank ``r`` of ``T`` the query heads
``[r*Hq/T, (r+1)*Hq/T)`` and, when the layer has at least ``T`` KV heads, the
KV heads ``[r*Hkv/T, (r+1)*Hkv/T)``; with fewer KV heads than ranks each KV
head is replicated on ``T/Hkv`` consecutive ranks (rank ``r`` holds KV head
``r*Hkv//T``). Every rank runs the same batch, so its block table, lengths,
slots and page ids are the same; only the per-head tensors differ::

    rank 0: query [T, Hq/2, D]   kv_cache [P, Hkv/2, page, 2D]   output [T, Hq/2, D]
    rank 1: query [T, Hq/2, D]   kv_cache [P, Hkv/2, page, 2D]   output [T, Hq/2, D]
    merged: query [T, Hq,   D]   kv_cache [P, Hkv,   page, 2D]   output [T, Hq,   D]   (rank 0's heads first)

The layer's per-query-head values (``sinks``, ``alibi_slopes``) are joined like the query heads.

The merged file's metadata is rank 0's with ``layer.num_heads`` and
``layer.num_kv_heads`` the totals, and in ``capture``: ``rank`` and
``tp_rank`` null, ``merged_from`` (per rank: file, tp_rank, global rank, pid,
the query and KV heads it gave) and ``merged_by``. Anything that is not the
same step (another layer, step, engine, batch, page, dtype, scale, ...) is
refused with a :class:`MergeError` naming the field (:func:`kvdbg.snapshot.ranks.check_step`,
the rule ``kvdbg replay DIR`` holds its rows to as well), as is a tensor kvdbg
does not know how to join: nothing is ever joined by guess. That covers a
tensor each rank stores in another legal dtype (uint8 and float8_e4m3fn, say):
``torch.cat`` would turn one rank's raw FP8 bytes into numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Sequence

import torch

from kvdbg._version import __version__
from kvdbg.snapshot.layout import kv_head_dim
from kvdbg.snapshot.format import LAYER_VALUE_TENSORS
from kvdbg.snapshot.ranks import MergeError, RankInfo, StepFacts, check_step, rank_info
from kvdbg.snapshot.store import Snapshot, Step, dtype_name

# Per-step tensors every rank holds identically (the engine-level metadata of the batch).
SHARED_STEP_TENSORS = ("block_table", "seq_lens", "query_start_loc", "slot_mapping")
QUERY_HEAD_TENSORS = ("query", "output")  # [T, Hq_rank, D]: joined along the heads
KV_HEAD_TENSORS = ("key", "value")  # [T, Hkv_rank, D]: joined along the KV heads
# The layer's values, one per query head ([Hq_rank]; vLLM slices them per rank as it slices the heads): joined.
# capture fields that may differ between the ranks of one step (everything else must agree)
PER_RANK_CAPTURE = frozenset({"rank", "rank_source", "tp_rank", "pid", "time", "device", "gpu", "gpu_error",
                              "kv_cache_engine_shape", "kv_cache_engine_stride"})


@dataclasses.dataclass(frozen=True)
class RankShare:
    """What one rank's file gives to the merged snapshot."""

    path: str
    info: RankInfo
    heads: tuple[int, int]  # query heads [start, stop) in the merged layer
    kv_heads: tuple[int, ...]  # KV heads of the merged layer this rank holds
    replica: bool  # its KV heads are already given by a lower rank


def _label(snapshot: Snapshot, index: int) -> str:
    return os.path.basename(snapshot.path) if snapshot.path else f"snapshot {index}"


def kv_head_assignment(tp_rank: int, tp_size: int, rank_kv_heads: int, total_kv_heads: int) -> tuple[int, ...]:
    """The merged layer's KV heads that ``tp_rank`` holds (vLLM's rule: split, or replicate when fewer than ranks)."""
    if total_kv_heads >= tp_size:
        return tuple(range(tp_rank * rank_kv_heads, (tp_rank + 1) * rank_kv_heads))
    return (tp_rank * total_kv_heads // tp_size,)


def plan_merge(snapshots: Sequence[Snapshot], *, total_kv_heads: int | None = None) -> list[RankShare]:
    """Check that ``snapshots`` are every rank of one step and say which heads each gives; MergeError otherwise."""
    if len(snapshots) < 2:
        raise MergeError("merge needs the files of at least two ranks of one step")
    infos = [rank_info(s.meta.layer.name, s.meta.capture) for s in snapshots]
    labels = [_label(s, i) for i, s in enumerate(snapshots)]
    for label, info in zip(labels, infos):
        if info.tp_size is None or info.tp_rank is None:
            raise MergeError(f"{label}: capture.tp_size and capture.tp_rank are not recorded, so which heads it holds "
                             "is unknown (captured by a kvdbg that did not record them, or without tensor parallelism)")
    for label, snap in zip(labels, snapshots):
        known = {"kv_cache", "page_ids", *LAYER_VALUE_TENSORS} | {
            snap.meta.step_prefix(i) + name for i in range(snap.meta.num_steps)
            for name in (*SHARED_STEP_TENSORS, *QUERY_HEAD_TENSORS, *KV_HEAD_TENSORS)}
        unknown = sorted(set(snap.tensors()) - known)
        if unknown:
            raise MergeError(f"{label}: tensor {unknown[0]!r} is not one kvdbg merge knows how to join across ranks")
    check_step(labels, infos, [step_facts(s) for s in snapshots])
    tp_size = infos[0].tp_size
    layer = snapshots[0].meta.layer
    recorded = {info.total_num_kv_heads for info in infos} - {None}
    if len(recorded) > 1:
        raise MergeError(f"capture.total_num_kv_heads differs between the files: {sorted(recorded)}")
    total = total_kv_heads or (recorded.pop() if recorded else None)
    if total is None:
        if layer.num_kv_heads == 1 and tp_size > 1:
            raise MergeError("capture.total_num_kv_heads is not recorded and each rank holds one KV head, so a split "
                             "cannot be told from a replicated head; give the layer's KV heads (--num-kv-heads)")
        total = layer.num_kv_heads * tp_size
    expected = max(1, total // tp_size)
    if layer.num_kv_heads != expected or (total >= tp_size and total % tp_size):
        raise MergeError(f"layer.num_kv_heads is {layer.num_kv_heads} per rank, but {total} KV heads over {tp_size} "
                         f"ranks give {expected} per rank")
    shares, given = [], set()
    order = sorted(range(len(snapshots)), key=lambda i: infos[i].tp_rank)
    for i in order:
        info = infos[i]
        kv = kv_head_assignment(info.tp_rank, tp_size, layer.num_kv_heads, total)
        shares.append(RankShare(path=snapshots[i].path or labels[i], info=info,
                                heads=(info.tp_rank * layer.num_heads, (info.tp_rank + 1) * layer.num_heads),
                                kv_heads=kv, replica=set(kv) <= given))
        given |= set(kv)
    return shares


def step_facts(snapshot: Snapshot) -> StepFacts:
    """What ``snapshot`` must share with the other ranks of its step (compared by kvdbg.snapshot.ranks.check_step).

    Every metadata field but the per-rank ones (PER_RANK_CAPTURE), every
    tensor's dtype, and a digest of each tensor every rank holds identically.
    """
    meta = snapshot.meta
    heads = ("num_heads", "num_kv_heads")  # per rank, listed last: a field that differs is named before them
    fields = {f"layer.{f.name}": getattr(meta.layer, f.name) for f in dataclasses.fields(meta.layer)
              if f.name not in heads}
    fields.update({f"layer.{name}": getattr(meta.layer, name) for name in heads})
    fields.update({f"backend.{f.name}": getattr(meta.backend, f.name) for f in dataclasses.fields(meta.backend)})
    fields.update(kv_layout=meta.kv_layout, num_steps=meta.num_steps)
    fields.update({f"capture.{key}": value for key, value in sorted(meta.capture.items())
                   if key not in PER_RANK_CAPTURE})
    tensors = snapshot.tensors()
    shared = ["page_ids", *(meta.step_prefix(i) + name for i in range(meta.num_steps) for name in SHARED_STEP_TENSORS)]
    # As JSON has them (a tuple is a list): a results file keeps them, and a resumed run compares them with new ones.
    fields = {key: _as_json(value) for key, value in fields.items()}
    return StepFacts(fields=fields, dtypes={name: dtype_name(t.dtype) for name, t in tensors.items()},
                     digests={name: _digest(tensors[name]) for name in shared if name in tensors})


def _as_json(value):
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _as_json(v) for k, v in value.items()}
    return value


def _digest(tensor: torch.Tensor) -> str:
    data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{list(tensor.shape)} {hashlib.sha256(data).hexdigest()}"


def merge_ranks(snapshots: Sequence[Snapshot], *, total_kv_heads: int | None = None) -> Snapshot:
    """One snapshot of all heads from every rank of one step (any order); MergeError naming what is not the same."""
    shares = plan_merge(snapshots, total_kv_heads=total_kv_heads)
    by_rank = {rank_info(s.meta.layer.name, s.meta.capture).tp_rank: s for s in snapshots}
    ordered = [by_rank[share.info.tp_rank] for share in shares]
    first = ordered[0]
    meta = first.meta
    kv_dim = kv_head_dim(meta.kv_layout)
    givers = [(share, snap) for share, snap in zip(shares, ordered) if not share.replica]
    for share, snap in zip(shares, ordered):
        if share.replica:  # the same KV head on two ranks must hold the same bytes
            source = next(s for sh, s in givers if set(share.kv_heads) <= set(sh.kv_heads))
            if not _same_bytes(snap.kv_cache, source.kv_cache):
                raise MergeError(f"{_label(snap, 0)}: kv_cache differs from {_label(source, 0)}'s, though both hold "
                                 f"the replicated KV head {share.kv_heads[0]}")
            # So must the step's new K/V of that head, which the merged file takes from one of them only.
            for i, (mine, theirs) in enumerate(zip(snap.steps, source.steps)):
                for name in KV_HEAD_TENSORS:
                    a, b = getattr(mine, name), getattr(theirs, name)
                    if (a is None) != (b is None) or a is not None and not _same_bytes(a, b):
                        raise MergeError(f"{_label(snap, 0)}: step {i} {name} differs from {_label(source, 0)}'s, "
                                         f"though both hold the replicated KV head {share.kv_heads[0]}")
    kv_cache = torch.cat([snap.kv_cache for _, snap in givers], dim=kv_dim)
    steps = []
    for i in range(meta.num_steps):
        parts = [snap.steps[i] for snap in ordered]
        kv_parts = [snap.steps[i] for _, snap in givers]
        step = Step(**{name: getattr(parts[0], name) for name in SHARED_STEP_TENSORS + ("query",)})
        for name in QUERY_HEAD_TENSORS:
            if getattr(parts[0], name) is not None:
                setattr(step, name, torch.cat([getattr(p, name) for p in parts], dim=1))
        for name in KV_HEAD_TENSORS:
            if getattr(parts[0], name) is not None:
                setattr(step, name, torch.cat([getattr(p, name) for p in kv_parts], dim=1))
        steps.append(step)
    capture = dict(meta.capture)
    capture.update(
        rank=None, tp_rank=None, rank_source=None, pid=None,
        merged_by=f"kvdbg merge {__version__}",
        merged_from=[{"file": os.path.basename(share.path), "tp_rank": share.info.tp_rank, "rank": share.info.rank,
                      "pid": snap.meta.capture.get("pid"), "heads": list(share.heads),
                      "kv_heads": list(share.kv_heads), "kv_replica": share.replica}
                     for share, snap in zip(shares, ordered)],
    )
    layer = dataclasses.replace(meta.layer, num_heads=meta.layer.num_heads * len(ordered),
                                num_kv_heads=kv_cache.shape[kv_dim])
    merged_meta = dataclasses.replace(meta, layer=layer, capture=capture)
    values = {name: torch.cat([getattr(snap, name) for snap in ordered]) for name in LAYER_VALUE_TENSORS
              if getattr(first, name) is not None}
    return Snapshot(meta=merged_meta, kv_cache=kv_cache, page_ids=first.page_ids, steps=steps, **values)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


__all__ = ["MergeError", "RankShare", "kv_head_assignment", "merge_ranks", "plan_merge", "step_facts"]
