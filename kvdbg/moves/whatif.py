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

A backend may run one batch's requests through different kernels: vLLM's FLASHINFER sends a mixed batch's decode
requests to the decode wrapper and its prefills to the prefill wrapper, and each may drop a different feature.
When no one change explains every request, :func:`explain_output` names the closest change for each request
(:class:`SplitExplained`), from the same replays; a request that passes as the layer is needs no change.
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
                   pairs: bool = True, requests: list[int] | None = None
                   ) -> "OutputExplained | SplitExplained | None":
    """The closest change of the layer (alone, or two together) under which the snapshot's captured output passes
    against the reference on every step and head of ``requests`` (all by default); failing that, the closest
    change for each request when every request has one (:class:`SplitExplained`); None when neither, or the
    snapshot holds no output."""
    if not any(step.output is not None for step in snapshot.steps):
        return None
    applicable = [w for w in WHAT_IFS if w.applies(snapshot.meta.layer)]
    groups = [(w,) for w in applicable] + (list(combinations(applicable, 2)) if pairs else [])
    best = None
    per_request: dict[tuple[int, int], list[tuple[tuple[WhatIf, ...], float, str]]] = {}
    compared: set[tuple[int, int]] = set()  # (step, request) of every request compared
    for group in [()] + groups:
        variant, options = snapshot, {}
        for what_if in group:
            variant = what_if.change(variant)
            options.update(what_if.options)
        try:
            comparisons = _compared(variant, options, atol, rtol, requests)
        except KvdbgError:  # a layer the reference refuses without that feature cannot be what the engine ran
            continue
        for key, (passed, max_abs, rule) in _by_request(comparisons).items():
            compared.add(key)
            if passed:
                per_request.setdefault(key, []).append((group, max_abs, rule))
        if group and comparisons and all(c.passed for c in comparisons):
            held = max(c.max_abs for c in comparisons), comparisons[0].tolerance.rule
            if best is None or held[0] * len(group) ** 2 < best.max_abs * len(best.what_ifs) ** 2:
                best = OutputExplained(group, *held)
    if best is not None:
        return best
    return _split(per_request, sorted(compared), multi_step=len(snapshot.steps) > 1)


def _compared(snapshot: "Snapshot", options: dict, atol: float | None, rtol: float | None,
              requests: list[int] | None) -> list:
    """The captured-vs-reference comparisons of every step, each over ``requests`` (all when None)."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.judge.compare import compare_step
    from kvdbg.replayer.runner import replay

    result = replay(snapshot, ["reference"], ReplayOptions(device="cpu", **options))
    return [c for step in result.steps
            for c in compare_step(step, snapshot.meta, atol=atol, rtol=rtol, requests=requests)
            if c.actual == "captured" and c.expected == "reference" and c.heads]


def _by_request(comparisons: list) -> dict[tuple[int, int], tuple[bool, float, str]]:
    """(step, request) -> (every head passed, the largest error, the tolerance's rule)."""
    out: dict[tuple[int, int], tuple[bool, float, str]] = {}
    for comp in comparisons:
        for head in comp.heads:
            key = (comp.step, head.request)
            passed, max_abs, _ = out.get(key, (True, 0.0, ""))
            worst = max(max_abs, head.max_abs) if head.compared else max_abs
            out[key] = (passed and head.passed, worst, comp.tolerance.rule)
    return out


@dataclass(frozen=True)
class SplitExplained:
    """No one change explains every request, but each request's output is exact attention of the layer changed in
    its own way (``parts``: the requests, keyed by (step, request), with the change that explains them)."""

    parts: tuple[tuple[tuple[tuple[int, int], ...], OutputExplained], ...]
    multi_step: bool

    @property
    def what_ifs(self) -> tuple[WhatIf, ...]:
        return tuple(dict.fromkeys(w for _, found in self.parts for w in found.what_ifs))

    @property
    def max_abs(self) -> float:
        return max(found.max_abs for _, found in self.parts)

    @property
    def tolerance(self) -> str:
        return self.parts[0][1].tolerance

    def _who(self, keys) -> str:
        from kvdbg.util.ranges import ranges_text as ranges

        if not self.multi_step:
            numbers = [request for _, request in keys]
            return f"request{'s' if len(numbers) > 1 else ''} {ranges(numbers)}"
        steps: dict[int, list[int]] = {}
        for step, request in keys:
            steps.setdefault(step, []).append(request)
        return "; ".join(f"step {step} request{'s' if len(r) > 1 else ''} {ranges(r)}" for step, r in steps.items())

    @property
    def what(self) -> str:
        return "per request: " + "; ".join(
            f"{self._who(keys)} {found.what if found.what_ifs else 'as the layer is'}" for keys, found in self.parts)

    @property
    def meaning(self) -> str:
        return ("runs the batch's requests differently (a mixed batch split between a decode and a prefill "
                "kernel, say); " + "; ".join(f"for {self._who(keys)} {found.meaning}"
                                             for keys, found in self.parts if found.what_ifs))

    def sentence(self) -> str:
        said = "; ".join(f"{self._who(keys)} "
                         f"{found.what if found.what_ifs else 'of the layer as it is'} (max abs {found.max_abs:.2e})"
                         for keys, found in self.parts)
        return (f"no one change of the layer explains every request, but per request the output is exact attention: "
                f"{said}, under {self.tolerance}: the backend {self.meaning}")

    def to_json(self) -> dict:
        return {"what": self.what, "meaning": self.meaning, "max_abs": self.max_abs, "tolerance": self.tolerance,
                "sentence": self.sentence(),
                "requests": [{"step_requests": [list(key) for key in keys], **found.to_json()}
                             for keys, found in self.parts]}


def _split(per_request: dict, keys: list[tuple[int, int]], *, multi_step: bool) -> SplitExplained | None:
    """Each compared request's closest passing change, grouped; None when a request has none, or when one change
    would do for all (then the whole-batch search already found it, or no request needed any)."""
    chosen: dict[tuple, list] = {}
    found_for: dict[tuple, OutputExplained] = {}
    for key in keys:
        options = per_request.get(key)
        if not options:
            return None
        # The layer as it is wins whenever the request passes so; otherwise the closest change, as for the batch.
        group, max_abs, rule = min(options, key=lambda o: (bool(o[0]), o[1] * len(o[0]) ** 2))
        chosen.setdefault(group, []).append(key)
        previous = found_for.get(group)
        found_for[group] = OutputExplained(group, max(max_abs, previous.max_abs if previous else 0.0), rule)
    if len(chosen) < 2:  # one change for all is the batch's answer (or none was needed)
        return None
    parts = tuple((tuple(chosen[g]), found_for[g]) for g in sorted(chosen, key=lambda g: chosen[g][0]))
    return SplitExplained(parts, multi_step=multi_step)


__all__ = ["OutputExplained", "SplitExplained", "WHAT_IFS", "WhatIf", "explain_output"]
