"""The working cache a replay reads and writes: a private copy-on-write map of the stored pages, and the
step's cache update written into it as the engine's cache write does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from kvdbg.errors import OptionError
from kvdbg.snapshot.layout import kv_views, quantize_fp8, stored_index

if TYPE_CHECKING:
    from kvdbg.snapshot.store import Snapshot, Step

__all__ = ["apply_step_update", "replay_cache", "step_writes", "working_cache"]


# --------------------------------------------------------------------------- the working cache


def working_cache(snapshot: "Snapshot", device: str = "cpu") -> torch.Tensor:
    """A private cache of the stored pages that step updates may write into; ``snapshot`` is never written.

    On CPU, a snapshot loaded from a file gets a second private mapping of the
    file rather than a copy: a copy would double the memory of a multi-GB
    replay, while the mapping costs only the pages a step writes.
    """
    if torch.device(device).type == "cpu":
        mapped = snapshot.remap_kv_cache()
        if mapped is not None:
            return mapped
    return snapshot.kv_cache.to(device, copy=True).contiguous()


def step_writes(step: "Step") -> bool:
    """Whether :func:`apply_step_update` writes anything for ``step``: new K/V and one valid slot at least."""
    if step.slot_mapping is None or step.key is None or step.value is None:
        return False
    return bool((step.slot_mapping >= 0).any())


def replay_cache(snapshot: "Snapshot", device: str, steps: Iterable[int], *, private: bool = False) -> torch.Tensor:
    """The cache a replay reads while it applies the updates of ``steps`` in order.

    Backends only read the cache; a step's update is the one write. So the
    private :func:`working_cache` is opened only when one of ``steps`` writes,
    or with ``private`` (a caller that writes itself, as poison writes NaN
    regions). Otherwise the backends read the snapshot's own pages, copied
    only to reach ``device`` or to be contiguous: a one-step snapshot without
    new K/V (a shrink candidate, a capture without the update) costs no second
    cache.
    """
    if private or any(step_writes(snapshot.steps[s]) for s in steps):
        return working_cache(snapshot, device)
    return snapshot.kv_cache.to(device).contiguous()


def apply_step_update(snapshot: "Snapshot", cache: torch.Tensor, step: int) -> int:
    """Write step ``step``'s new key/value into ``cache`` at its slots, as the engine's cache update does.

    FP8 caches store ``x / scale`` saturated to e4m3. Returns the number of tokens written.
    """
    s = snapshot.steps[step]
    if s.slot_mapping is None or s.key is None or s.value is None:
        return 0
    ps = snapshot.page_size
    device = cache.device
    slots = s.slot_mapping.to(torch.int64).to(device)
    keep = slots >= 0
    slots = slots[keep]
    if slots.numel() == 0:
        return 0
    stored = stored_index(snapshot.page_ids, slots.cpu() // ps).to(device)
    if (stored < 0).any():
        bad = int(slots[stored < 0][0])
        raise OptionError(f"step {step}: slot_mapping writes slot {bad}, whose page is not stored")
    offset = slots % ps
    k_view, v_view = kv_views(snapshot.meta, cache)
    layer = snapshot.meta.layer
    for view, new, scale in ((k_view, s.key, layer.k_scale), (v_view, s.value, layer.v_scale)):
        new = new.to(device)[keep.to(device)]
        if layer.is_fp8:
            # Write bytes: index_put_ is not implemented for float8 on every device.
            view.view(torch.uint8)[stored, :, offset] = quantize_fp8(new, scale).view(torch.uint8)
        else:
            view[stored, :, offset] = new.to(view.dtype)
    return int(slots.numel())
