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
(or with 1) stands alone. :mod:`kvdbg.merge` joins a group into one snapshot;
``kvdbg replay DIR`` shows a group as one row (:mod:`kvdbg.batch`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TypeVar

T = TypeVar("T")


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


__all__ = ["RankInfo", "group_by_step", "rank_info"]
