"""Which snapshots are the tensor-parallel ranks of one engine step, read from their capture metadata (no torch).

Under tensor parallelism every rank runs the same batch on its share of the
heads, and capture writes one file per rank (its heads). The vLLM plugin
records in ``meta.capture`` what tells them together::

    engine_instance   vLLM's id of the engine (the same in all its worker processes)
    dp_rank           the data-parallel replica (replicas run different batches)
    layer, step       the layer and the plugin's step number (the same on every rank)
    tp_rank, tp_size  which share of the heads this file holds

Files agreeing on the first three are one step of one layer; they form a
group when their ``tp_rank`` values are distinct. A file without ``tp_size``
(or with 1) stands alone. :mod:`kvdbg.snapshot.merge` joins a group into one snapshot;
``kvdbg replay DIR`` shows a group as one row (:mod:`kvdbg.replayer.batch`). Both hold
a group to one rule, :func:`check_step`: the same step, the same
:class:`StepFacts`, and the ranks ``0 .. tp_size-1`` once each.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

from kvdbg.errors import SnapshotError

T = TypeVar("T")

SHOWN_RANKS = 5  # a message lists this many ranks, then how many in all (tp_size is the file's claim, any size)


class MergeError(SnapshotError):
    """The files are not the ranks of one step (the message names the field), or cannot be joined safely."""


@dataclass(frozen=True)
class RankInfo:
    """Where one snapshot sits among an engine's ranks (from ``meta.capture``; None where not recorded)."""

    layer: str
    step: int | None
    tp_rank: int | None
    tp_size: int | None
    engine_instance: str | None = None
    dp_rank: int | None = None
    rank: int | None = None  # the process's global rank
    total_num_kv_heads: int | None = None

    @property
    def is_shard(self) -> bool:
        """Whether this file holds one rank's share of a tensor-parallel layer."""
        return self.tp_size is not None and self.tp_size > 1 and self.tp_rank is not None

    def step_key(self) -> tuple:
        """What the ranks of one step share."""
        return (self.engine_instance, self.dp_rank, self.layer, self.step, self.tp_size)


@dataclass(frozen=True)
class StepFacts:
    """What one rank's file must share with every other rank of its step, as plain data (no torch).

    :func:`kvdbg.snapshot.merge.step_facts` reads them from a snapshot; a worker of
    ``kvdbg replay DIR`` sends them back with its row, so the parent compares
    files it never loaded.
    """

    fields: dict[str, Any]  # "layer.head_size", "backend.name", "kv_layout", "capture.step", ... -> value
    dtypes: dict[str, str]  # every tensor the file holds -> its dtype (one dtype per tensor on every rank)
    digests: dict[str, str]  # the tensors every rank holds identically (page_ids, block_table, ...) -> shape and bytes


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def rank_info(layer_name: str, capture: Mapping[str, Any]) -> RankInfo:
    """The rank facts of a snapshot, from its layer name and ``meta.capture``."""
    instance = capture.get("engine_instance")
    return RankInfo(
        layer=layer_name,
        step=_int_or_none(capture.get("step")),
        tp_rank=_int_or_none(capture.get("tp_rank")),
        tp_size=_int_or_none(capture.get("tp_size")),
        engine_instance=str(instance) if instance not in (None, "") else None,
        dp_rank=_int_or_none(capture.get("dp_rank")),
        rank=_int_or_none(capture.get("rank")),
        total_num_kv_heads=_int_or_none(capture.get("total_num_kv_heads")),
    )


def group_by_step(items: Iterable[T], info: Callable[[T], RankInfo | None]) -> list[list[T]]:
    """Items in groups: the ranks of one step together (ordered by ``tp_rank``), every other item alone.

    Groups keep the order of their first item. Shards of one step whose
    ``tp_rank`` repeats (two runs without an engine id, say) are not grouped:
    each stands alone rather than be joined with the wrong partner.
    """
    order: list[tuple] = []
    groups: dict[tuple, list[tuple[RankInfo, T]]] = {}
    for index, item in enumerate(items):
        found = info(item)
        key = ("step", found.step_key()) if found is not None and found.is_shard else ("alone", index)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append((found, item))
    out: list[list[T]] = []
    for key in order:
        members = groups[key]
        ranks = [found.tp_rank for found, _ in members] if key[0] == "step" else []
        if key[0] == "step" and len(set(ranks)) == len(ranks):
            out.append([item for _, item in sorted(members, key=lambda m: m[0].tp_rank)])
        else:
            out.extend([item] for _, item in members)
    return out


def check_step(labels: Sequence[str], infos: Sequence[RankInfo], facts: Sequence[StepFacts], *,
               complete: bool = True) -> None:
    """MergeError naming the field unless the files are every rank of one step (with ``complete=False``:
    some ranks of one step).

    The files must agree on the step (layer, step, engine, data-parallel rank,
    tp_size) and on every :class:`StepFacts` entry, compared with the first
    file's; then their ``tp_rank`` values must be ``0 .. tp_size-1``, once each
    (at most once each, without ``complete``).
    """
    base = infos[0]
    for label, info in zip(labels[1:], infos[1:]):
        _same(label, "layer.name", base.layer, info.layer)
        _same(label, "capture.step", base.step, info.step)
        _same(label, "capture.engine_instance", base.engine_instance, info.engine_instance)
        _same(label, "capture.dp_rank", base.dp_rank, info.dp_rank)
        _same(label, "capture.tp_size", base.tp_size, info.tp_size)
    first = facts[0]
    for label, other in zip(labels[1:], facts[1:]):
        for key in dict.fromkeys([*first.fields, *other.fields]):
            _same(label, key, first.fields.get(key), other.fields.get(key))
        for name in dict.fromkeys([*first.dtypes, *other.dtypes]):
            want, got = first.dtypes.get(name), other.dtypes.get(name)
            if (want is None) != (got is None):
                raise MergeError(f"{label}: tensor {name!r} is in one file and not in the other")
            if want != got:
                # torch.cat would promote one rank's raw FP8 bytes to numbers: refuse rather than join
                raise MergeError(f"{label}: tensor {name!r} is stored as {got} but the first file's as {want}: the "
                                 "ranks of one step must store each tensor in one dtype")
        for name, digest in first.digests.items():
            if other.digests.get(name) != digest:
                verb = "differ" if name == "page_ids" else "differs"
                raise MergeError(f"{label}: {name} {verb} from the first file's: not the same step")
    check_ranks(infos, complete=complete)


def check_ranks(infos: Sequence[RankInfo], *, complete: bool = True) -> None:
    """MergeError unless the files' ``tp_rank`` values are ``0 .. tp_size-1`` (the first file's), once each
    (``complete=False``: some of them, at most once each)."""
    tp_size = infos[0].tp_size
    ranks = [info.tp_rank for info in infos]
    # The count first: no range of a claimed tp_size (10**9, say) is built before it matches the files given.
    if len(ranks) == tp_size and sorted(ranks) == list(range(tp_size)):
        return
    counts = Counter(ranks)
    repeated = sorted(r for r, n in counts.items() if n > 1)
    if repeated:
        what = f"tp_rank {_listed(repeated, len(repeated))} given twice"
    else:
        present = {r for r in counts if 0 <= r < tp_size}
        beyond = sorted(set(counts) - present)
        parts = [f"tp_rank {_listed(beyond, len(beyond))} not below capture.tp_size"] if beyond else []
        if not complete and not parts:
            return
        if tp_size > len(present):
            missing = (r for r in range(tp_size) if r not in present)  # lazy: only the first few are listed
            parts.append(f"tp_rank {_listed(missing, tp_size - len(present))} missing")
        what = "; ".join(parts)
    raise MergeError(f"capture.tp_rank: the files are not every rank of one step ({what}; capture.tp_size is "
                     f"{tp_size})")


def _listed(ranks: Iterable[int], count: int) -> str:
    shown = list(itertools.islice(ranks, SHOWN_RANKS))
    return ", ".join(map(str, shown)) + (f", … ({count} in all)" if count > len(shown) else "")


def _same(label: str, field: str, want: Any, got: Any) -> None:
    if want != got:
        raise MergeError(f"{label}: {field} is {got!r} but the first file's is {want!r}: not the same step")


__all__ = ["MergeError", "RankInfo", "StepFacts", "check_ranks", "check_step", "group_by_step", "rank_info"]
