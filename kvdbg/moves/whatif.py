"""What a wrong output is instead: exact attention with one or two of the layer's features taken away.

A backend that accepts a feature and then ignores it returns exact attention of another layer. vLLM 0.33's
FLASHINFER does this: it keeps a layer's ALiBi slopes and never hands them to FlashInfer. So does one that
applies a scale twice, as the same backend does to an FP8 decode's logits. Such an output fails against the
reference by a wide margin, yet it is exact for the layer the backend really ran. When a backend has no float32
path to tell rounding from semantics (FLASHINFER takes float16 and bfloat16 only), this is what names the cause.

:func:`explain_output` replays the snapshot's reference on variants of its layer: without ALiBi, without the
soft cap, without the sliding window, a non-causal window bounding keys on the left only (FlashInfer's
``window_left``), without the sinks, with the logits scaled by an FP8 layer's query scale once more. It tries
each variant alone and each pair of them, and holds the engine's output to each with the tolerance the failing
comparison used. Of the variants under which every compared head passes, the closest is the answer, a pair
only when its largest error is under a quarter of the best single one's: an FP8 cell's tolerance is wide
enough that a change that is half the story can pass too.
Only the layer's own features are taken away, so a match says which feature the backend did not apply, not
why.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING, Callable

from kvdbg.errors import KvdbgError

if TYPE_CHECKING:
    from kvdbg.snapshot.meta import LayerMeta
    from kvdbg.snapshot.store import Snapshot


@dataclass(frozen=True)
class WhatIf:
    """One change of the layer: what it takes away, what a match says the backend did, when it applies."""

    what: str  # "without ALiBi"
    meaning: str  # "ignores the layer's ALiBi slopes"
    applies: Callable[["LayerMeta"], bool]
    change: Callable[["Snapshot"], "Snapshot"] = lambda snapshot: snapshot
    options: tuple[tuple[str, object], ...] = ()  # the reference's ReplayOptions changed (a what-if of its own)


def _layer(snapshot: "Snapshot", **changes) -> "Snapshot":
    meta = dataclasses.replace(snapshot.meta, layer=dataclasses.replace(snapshot.meta.layer, **changes))
    return dataclasses.replace(snapshot, meta=meta, path=None, kv_source=None, header=None)


def _no_alibi(snapshot: "Snapshot") -> "Snapshot":
    out = _layer(snapshot, has_alibi=False, alibi_sqrt=False)
    out.alibi_slopes = None
    return out


def _no_sinks(snapshot: "Snapshot") -> "Snapshot":
    out = _layer(snapshot, has_sinks=False)
    out.sinks = None
    return out


WHAT_IFS: tuple[WhatIf, ...] = (
    WhatIf("without ALiBi", "ignores the layer's ALiBi slopes", lambda layer: layer.has_alibi, _no_alibi),
    WhatIf("without the soft cap", "ignores the logit soft cap", lambda layer: bool(layer.logits_soft_cap),
           lambda snap: _layer(snap, logits_soft_cap=None)),
    WhatIf("without the sliding window", "ignores the sliding window",
           lambda layer: layer.sliding_window is not None and layer.chunk_lookback is None,
           lambda snap: _layer(snap, sliding_window=None)),
    WhatIf("with the window bounding keys on the left only",
           "applies a non-causal layer's sliding window to the keys before each token only (FlashInfer's "
           "window_left), not on both sides",
           lambda layer: not layer.causal and layer.sliding_window is not None and layer.chunk_lookback is None,
           options=(("dense_window", "left"),)),
    WhatIf("without the sinks", "ignores the attention sinks", lambda layer: layer.has_sinks, _no_sinks),
    WhatIf("with the logits scaled by the query scale once more",
           "applies the FP8 query scale to logits whose query was not quantised with it",
           lambda layer: layer.is_fp8 and layer.q_scale != 1.0,
           lambda snap: _layer(snap, scale=snap.meta.layer.scale * snap.meta.layer.q_scale)),
)


@dataclass(frozen=True)
class OutputExplained:
    """The engine's output equals exact attention of the layer changed by ``what_ifs``, within tolerance."""

    what_ifs: tuple[WhatIf, ...]
    max_abs: float
    tolerance: str

    @property
    def what(self) -> str:
        return " and ".join(w.what for w in self.what_ifs)

    @property
    def meaning(self) -> str:
        return "; ".join(w.meaning for w in self.what_ifs)

    def sentence(self) -> str:
        return (f"the output is exact attention {self.what} (max abs {self.max_abs:.2e} under {self.tolerance}): "
                f"the backend {self.meaning}")

    def to_json(self) -> dict:
        return {"what": self.what, "meaning": self.meaning, "max_abs": self.max_abs, "tolerance": self.tolerance,
                "sentence": self.sentence()}


def explain_output(snapshot: "Snapshot", *, atol: float | None = None, rtol: float | None = None,
                   pairs: bool = True) -> OutputExplained | None:
    """The closest change of the layer (alone, or two together) under which the snapshot's captured output passes
    against the reference on every step and head; None when none does, or the snapshot holds no output."""
    if not any(step.output is not None for step in snapshot.steps):
        return None
    applicable = [w for w in WHAT_IFS if w.applies(snapshot.meta.layer)]
    groups = [(w,) for w in applicable] + (list(combinations(applicable, 2)) if pairs else [])
    best = None
    for group in groups:
        variant, options = snapshot, {}
        for what_if in group:
            variant = what_if.change(variant)
            options.update(what_if.options)
        try:
            held = _held(variant, options, atol, rtol)
        except KvdbgError:  # a layer the reference refuses without that feature cannot be what the engine ran
            held = None
        # The closest match wins; a pair must be four times closer than a single (len(group) ** 2).
        if held is not None and (best is None or held[0] * len(group) ** 2 < best.max_abs * len(best.what_ifs) ** 2):
            best = OutputExplained(group, *held)
    return best


def _held(snapshot: "Snapshot", options: dict, atol: float | None, rtol: float | None) -> tuple[float, str] | None:
    """(max abs, tolerance) when the captured output passes against the snapshot's reference everywhere."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.judge.compare import compare_step
    from kvdbg.replayer.runner import replay

    result = replay(snapshot, ["reference"], ReplayOptions(device="cpu", **options))
    comparisons = [c for step in result.steps for c in compare_step(step, snapshot.meta, atol=atol, rtol=rtol)
                   if c.actual == "captured" and c.expected == "reference"]
    if not comparisons or not all(c.passed for c in comparisons):
        return None
    tolerance = comparisons[0].tolerance
    return max(c.max_abs for c in comparisons), tolerance.rule


__all__ = ["OutputExplained", "WHAT_IFS", "WhatIf", "explain_output"]
