"""The sentinel: on a sample of steps, check a layer's attention output against the exact reference.

On a sampled step the engine hands :meth:`Sentinel.check` what its backend
read and wrote: the query, the layer's cache *after* the step's update (what
the kernel read), the engine-level block table, seq lens and query start
locations, and the output. Two checks run:

- the whole output (the step's real tokens) for NaN/inf: one reduction;
- a few random (request, head) pairs against :mod:`kvdbg.backends.reference`,
  computed from the same cache pages through the block table, and compared
  with :func:`kvdbg.judge.compare.compare` under the tolerance replay uses for the
  captured output (:func:`kvdbg.judge.compare.default_tolerance` for the model
  dtype; the FP8 one for an FP8 cache, widened for the e4m3 rounding of P when the engine quantised the
  query)::

      pair (r, h):  the last <= 16 query rows of request r, head h    [q', 1, D]
                    pages block_table[r, :cdiv(L_r, page)]   read through the layer's engine layout,
                                                             KV head h // group only
                    -> a one-head, few-request problem for the reference (sinks, ALiBi, soft cap and
                       the window as the layer has them)

A layer the reference cannot model is said once and never checked. The
shell (:class:`Sentinel`) samples steps, dedupes disagreements by
:attr:`SentinelFinding.signature` and rate-limits them; the vLLM plugin
captures the step through :class:`kvdbg.capture.capturer.Capturer` with
:meth:`SentinelFinding.text` as the snapshot's notes. On CUDA the check runs
in a worker thread on its own stream (:class:`DeferredChecks`), so the
engine's thread launches nothing but a few copies and never waits for it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import queue
import random
import threading
import time
from collections import Counter
from itertools import accumulate, chain
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from kvdbg.backends.base import CommonMetadata
from kvdbg.util.background import confine_torch_to_this_thread
from kvdbg.backends.reference import BACKEND as REFERENCE
from kvdbg.backends.reference import ReferenceBuilder, ReferenceImpl
from kvdbg.snapshot.layout import holds_fp8, page_dim, read_value_magnitudes
from kvdbg.capture.prepare import CaptureLayer, resolve_kv_layout
from kvdbg.judge.compare import HeadDiff, Tolerance, compare, default_tolerance, fp8_query_allowance
from kvdbg.snapshot.format import LAYOUT_VLLM, BackendMeta, SnapshotMeta
from kvdbg.sentinel.config import ENV_INTERVAL, ENV_MAX, ENV_PROCESS, SentinelConfig

logger = logging.getLogger("kvdbg.sentinel")

__all__ = ["CheckResult", "DeferredChecks", "PagesOfLengths", "PairResult", "PassedCheck", "Sentinel", "SentinelFinding",
           "StepInputs", "check_layers", "check_step", "compact", "settle_pages", "unchecked_reason"]

# Query rows of one request held to the reference per pair (its last ones): the whole output is still
# checked for NaN/inf, but a long prefill costs no more than a short one.
MAX_QUERY_ROWS = 16

# Steps whose draw the sampler keeps (layers counting their steps apart, a few steps at most, share them; a full CUDA
# graph's steps are drawn up to 128 ahead, graph_hooks.QUIET_AHEAD, and must outlast other layers' draws till then).
DRAWS_KEPT = 1024

# Backends whose forward leaves rows of the output unwritten by design (a decode-only kernel skips a
# prefill's tokens, a ragged leftover is dropped): their output cannot be held to the reference row by row.
UNCHECKED_BACKENDS = {
    "FLASHINFER_TS": "its builder drops ragged and over-long query blocks, so rows of its output are not written "
                     "by design",
}


class PagesOfLengths(NamedTuple):
    """A staged step's pages per request as the program inside vLLM's graph counted them on the device (graph_staging's
    ``InGraphProgram``): ``ceil(length / page_size)`` pages, at most ``width`` (the block table's columns), the
    requests one after another in at most ``limit`` staged positions. The engine's thread never reads the count back:
    the check works it out from the step's lengths once they are on the host (:func:`settle_pages`)."""

    page_size: int
    width: int
    limit: int


def settle_pages(entries: list) -> list:
    """``entries`` ((layer, StepInputs) each) with every :class:`PagesOfLengths` made the list of pages per request it
    stands for: one list per lengths tensor, shared by the entries that share it (they stay one reference problem,
    :func:`_alike_key`). ValueError when the step's pages overflow the staged positions (the host's bound on its
    lengths at the build was exceeded): nothing past them was staged."""
    settled: dict = {}
    out = []
    for layer, inputs in entries:
        marker = inputs.max_pages
        if marker.__class__ is PagesOfLengths:
            key = (id(inputs.seq_lens), marker)
            pages = settled.get(key)
            if pages is None:
                page, width = marker.page_size, marker.width
                pages = [min(-(-int(n) // page), width) for n in inputs.seq_lens.to("cpu", torch.int64).tolist()]
                if sum(pages) > marker.limit:
                    raise ValueError(f"the step reads {sum(pages)} pages, more than the {marker.limit} that kvdbg's "
                                     "staging inside the CUDA graph holds (the host's bound on the lengths at the "
                                     "build was exceeded)")
                settled[key] = pages
            inputs = dataclasses.replace(inputs, max_pages=pages)
        out.append((layer, inputs))
    return out


@dataclass
class StepInputs:
    """What one layer's backend read and wrote on one step (engine tensors; nothing is copied here)."""

    query: torch.Tensor  # [num_tokens(+padding), Hq, D] or [num_tokens, Hq * D]
    kv_cache: torch.Tensor  # the layer's whole cache in its engine layout, after the step's update
    # [num_reqs, width] engine page ids; None: a staged step's (kvdbg.vllm_plugin.graph_staging), whose requests'
    # pages lie one request after another in the staged copy, ``max_pages[r]`` of them for request r
    block_table: torch.Tensor | None
    seq_lens: torch.Tensor  # [num_reqs]
    query_start_loc: torch.Tensor  # [num_reqs + 1]
    causal: bool
    output: torch.Tensor  # [num_tokens(+padding), Hq, D] or [num_tokens, Hq * D]
    max_model_len: int | None = None
    # Pages each request's row of block_table holds (a staged step's pages per request); a request whose length
    # needs more is refused before anything is read past them. A :class:`PagesOfLengths`: the device counted them
    # from the lengths (a step staged inside vLLM's graph), worked out the same way here once the lengths are on the
    # host (:func:`check_layers`).
    max_pages: "list[int] | PagesOfLengths | None" = None
    # (stack, index): the layer's query, output and pages are ``stack.query[index]`` (its first rows),
    # ``stack.output[index]`` and ``stack.pages[index]`` of buffers that hold several layers' copies of one step along
    # their first axis (a graph step's staging: kvdbg.vllm_plugin.graph_staging.StagedStack). Layers of one stack are
    # read with one gather per kind, not one per layer (check_layers).
    stack: tuple | None = None
    # The rows of query and output that hold the step (None: all theirs): a staged step's copies are buffers of the
    # largest graph's rows, the same for every graph, of which the step's graph wrote the first ``rows``
    rows: int | None = None

    def cut(self) -> "StepInputs":
        """These inputs with query and output cut to their ``rows`` (itself when they are the step's already)."""
        rows = self.rows
        if rows is None:
            return self
        return dataclasses.replace(self, query=self.query[:rows],
                                   output=None if self.output is None else self.output[:rows], rows=None)


@dataclass
class PairResult:
    """One (request, head) pair held to the reference."""

    request: int
    head: int
    diff: HeadDiff | None  # None: within the tolerance everywhere (the statistics were not computed)

    @property
    def passed(self) -> bool:
        return self.diff is None or self.diff.passed


@dataclass
class NonFinite:
    """NaN/inf in the output: how many elements and tokens, and the first (request, head, token)."""

    elements: int
    tokens: int
    request: int
    head: int
    token: int


@dataclass
class CheckResult:
    """One checked step of one layer."""

    layer: str
    step: int | None
    tolerance: Tolerance
    pairs: list[PairResult] = field(default_factory=list)
    nonfinite: NonFinite | None = None
    num_tokens: int = 0

    @property
    def failed_pairs(self) -> list[PairResult]:
        return [p for p in self.pairs if not p.passed]

    @property
    def passed(self) -> bool:
        return self.nonfinite is None and not self.failed_pairs

    @property
    def pair_count(self) -> int:
        return len(self.pairs)

    def finding(self) -> "SentinelFinding | None":
        return None if self.passed else SentinelFinding(self)


class PassedCheck:
    """A :class:`CheckResult` that passed, as the checker process answers it (:mod:`kvdbg.sentinel.remote`): its
    output finite and each of its pairs within the tolerance, with no statistics (``diff`` None). It reads as that
    CheckResult; its pairs are kept as flat ints, (request, head) after (request, head), and made PairResults only
    when read: the engine's thread, which reads the answer, mostly only counts them."""

    __slots__ = ("layer", "step", "tolerance", "num_tokens", "_flat")
    passed = True
    nonfinite = None

    def __init__(self, layer: str, step: int | None, tolerance: Tolerance, num_tokens: int, flat: tuple):
        self.layer, self.step, self.tolerance, self.num_tokens, self._flat = layer, step, tolerance, num_tokens, flat

    @classmethod
    def of(cls, result: CheckResult) -> "PassedCheck | None":
        """``result`` in this form; None when it is not a CheckResult, failed, or kept a pair's statistics (it then
        travels whole)."""
        if not isinstance(result, CheckResult) or not result.passed \
                or any(p.diff is not None for p in result.pairs):
            return None
        return cls(result.layer, result.step, result.tolerance, result.num_tokens,
                   tuple(v for p in result.pairs for v in (p.request, p.head)))

    def __reduce__(self) -> tuple:
        return PassedCheck, (self.layer, self.step, self.tolerance, self.num_tokens, self._flat)

    @property
    def pairs(self) -> list[PairResult]:
        flat = self._flat
        return [PairResult(flat[i], flat[i + 1], None) for i in range(0, len(flat), 2)]

    @property
    def failed_pairs(self) -> list[PairResult]:
        return []

    @property
    def pair_count(self) -> int:
        return len(self._flat) // 2

    def finding(self) -> None:
        return None


def compact(results: list) -> list:
    """A check's results as the checker process answers them: each passed layer's as a :class:`PassedCheck` (8
    layers' answer unpickles in some 23 us as CheckResults, about 5 as PassedChecks, in a loop on a CPU of the
    project's CI; read once between steps, receive included, 1.1-1.6 times faster: bench/sentinel_send.py), a wrong
    one's whole, with its statistics."""
    return [PassedCheck.of(result) or result for result in results]


@dataclass(frozen=True)
class SentinelFinding:
    """A step whose output is non-finite or disagrees with the reference: what the snapshot's notes and the log say."""

    result: CheckResult

    @property
    def kind(self) -> str:
        return "nonfinite" if self.result.nonfinite is not None else "mismatch"

    @property
    def first(self) -> tuple[int, int]:
        """The first failing (request, head)."""
        bad = self.result.nonfinite
        if bad is not None:
            return bad.request, bad.head
        pair = self.result.failed_pairs[0]
        return pair.request, pair.head

    @property
    def signature(self) -> tuple[str, str, int]:
        """(kind, layer, first failing head): a fault repeating on every step is captured once."""
        return self.kind, self.result.layer, self.first[1]

    def text(self) -> str:
        """One paragraph for the snapshot's notes: what was found, against what, and what to run."""
        r = self.result
        where = f"layer {r.layer} step {r.step}"
        parts = []
        if r.nonfinite is not None:
            bad = r.nonfinite
            parts.append(f"the output holds {bad.elements} NaN/inf value(s) in {bad.tokens} of the step's "
                         f"{r.num_tokens} token(s), first at request {bad.request} head {bad.head} (token {bad.token})")
        failed = r.failed_pairs
        if failed:
            worst = failed[0].diff
            shown = ", ".join(f"({p.request}, {p.head})" for p in failed[:8])
            parts.append(
                f"{len(failed)} of {len(r.pairs)} sampled (request, head) pairs disagree with the exact reference "
                f"({shown}); request {failed[0].request} head {failed[0].head}: max |a - e| {worst.max_abs:.4g} at "
                f"query position {worst.worst_position}, {worst.failing} element(s) outside {r.tolerance.rule} "
                f"({r.tolerance.source})"
                + (f", {worst.actual_nonfinite} non-finite in the output" if worst.actual_nonfinite else "")
                + (f", {worst.expected_nonfinite} non-finite in the reference (the pages it reads hold NaN/inf)"
                   if worst.expected_nonfinite else ""))
        elif r.pairs:
            parts.append(f"the {len(r.pairs)} sampled (request, head) pairs agree with the reference")
        return (f"kvdbg sentinel, {where}: " + "; ".join(parts) + ". The reference was computed from the cache "
                "after the step's update, with the block table and seq lens the engine built; `kvdbg replay` on "
                "this file compares the captured output with it.")


def unchecked_reason(layer: CaptureLayer, backend_name: str | None = None) -> str | None:
    """Why the sentinel cannot hold this layer to the reference (None when it can)."""
    if backend_name in UNCHECKED_BACKENDS:
        return f"backend {backend_name}: {UNCHECKED_BACKENDS[backend_name]}"
    meta = SnapshotMeta(layer=layer.meta(causal=layer.attn_type == "decoder"),
                        backend=BackendMeta(backend_name or "engine", 1, 1, 1), kv_layout=LAYOUT_VLLM)
    return REFERENCE.unsupported_reason(meta)


# --------------------------------------------------------------------------- the check


# The most bytes of picked rows and pages (every layer's pairs of one reference call) a check copies to work its
# reference out elsewhere (check_layers' reference_device): a pair's pages cut to its KV head are 512 KiB of
# bfloat16 keys and values a thousand tokens (head size 128), so 4 pairs of 8 layers reach it at 2k tokens. A
# larger pick is worked out where it lies: its copy and the host's arithmetic would grow with it, where the
# device's kernels are as many at any length.
HOST_REFERENCE_BYTES = 32 << 20


def _rows(t: torch.Tensor, num_tokens: int, num_heads: int, head_size: int) -> torch.Tensor:
    return t[:num_tokens].reshape(num_tokens, num_heads, head_size)


def choose_pairs(query_lens: list[int], num_heads: int, count: int, rng: random.Random) -> list[tuple[int, int]]:
    """Up to ``count`` distinct (request, head) pairs, uniform over requests with query tokens and heads."""
    requests = [r for r, q in enumerate(query_lens) if q > 0]
    total = len(requests) * num_heads
    if total == 0:
        return []
    picks = rng.sample(range(total), min(count, total))
    return sorted((requests[i // num_heads], i % num_heads) for i in picks)


def _nonfinite(rows: torch.Tensor, qsl: list[int]) -> NonFinite | None:
    bad = ~torch.isfinite(rows)
    if not bool(bad.any()):
        return None
    per_token_head = bad.any(dim=-1)  # [T, Hq]
    token, head = (int(i) for i in per_token_head.nonzero()[0].tolist())
    request = max(r for r in range(len(qsl) - 1) if qsl[r] <= token)
    return NonFinite(elements=int(bad.sum()), tokens=int(per_token_head.any(dim=-1).sum()), request=request,
                     head=head, token=token)


def check_step(layer: CaptureLayer, inputs: StepInputs, *, pairs: list[tuple[int, int]] | int = 4,
               rng: random.Random | None = None, step: int | None = None) -> CheckResult:
    """The non-finite check of the whole output and ``pairs`` (request, head) pairs against the reference.

    ``pairs`` is a list of pairs, or how many to draw with ``rng``. Raises only
    on inputs that contradict each other (a kvdbg or engine bug the caller reports).
    """
    return check_layers([(layer, inputs)], pairs=pairs, rng=rng, step=step)[0]


def check_layers(entries: list[tuple[CaptureLayer, StepInputs]], *, pairs: list[tuple[int, int]] | int = 4,
                 rng: random.Random | None = None, step: int | None = None,
                 reference_device: "torch.device | str | None" = None) -> list[CheckResult]:
    """:func:`check_step` for several layers of one step, one result each, in ``entries``' order (an int
    ``pairs`` is drawn for each layer).

    ``reference_device``: where the sampled pairs' reference is worked out and compared, when not where the
    inputs lie. The pairs' rows and pages are still picked where they lie (each pair's pages cut to its KV head),
    and the non-finite check of every output row still runs there; only what was picked is copied over, and only
    up to ``HOST_REFERENCE_BYTES`` (past it, as for very long requests, the reference stays where the inputs lie).
    The sentinel's checker process passes the host: its own CUDA context shares the device with the engine's by
    time slices, and the reference on the device is some eighty small kernels, each a turn the engine's graph
    may have to give up.

    Layers alike in all the reference reads but their name, whose inputs are the same metadata tensors (a
    step's layers, as a graph's staging hands them), are held to the reference together: their pairs make one
    problem, so checking a step's layers costs about the operations of one. The tolerance, the non-finite
    check and the comparison stay each layer's own.
    """
    rng = rng or random.Random()
    entries = [entry if entry[1].rows is None else (entry[0], entry[1].cut()) for entry in settle_pages(entries)]
    for layer, inputs in entries:
        if inputs.output is None:
            raise ValueError(f"layer {layer.name}: the step's output was not given to the check")
    results: list[CheckResult | None] = [None] * len(entries)
    groups: list[tuple[tuple, list[int]]] = []
    for index, entry in enumerate(entries):
        key = _alike_key(entry)
        for leader, members in groups:
            if leader == key:
                members.append(index)
                break
        else:
            groups.append((key, [index]))
    for _, members in groups:
        for index, result in zip(members, _check_alike([entries[i] for i in members], pairs, rng, step,
                                                       reference_device)):
            results[index] = result
    return results


def _alike_key(entry: tuple[CaptureLayer, StepInputs]) -> tuple:
    """What two layers' steps must share to be one reference problem (compared with ==): the layers' constants but
    the name, the very same metadata tensors (by identity), and caches, queries and outputs of one shape, type and
    device. Built once per layer, not once per pair of layers: a check's Python holds the interpreter's lock the
    engine's thread wants."""
    layer, inputs = entry
    constants = tuple(getattr(layer, name) for name in _layer_fields())
    same = (id(inputs.block_table), id(inputs.seq_lens), id(inputs.query_start_loc), inputs.causal,
            inputs.max_model_len, inputs.max_pages, None if inputs.stack is None else id(inputs.stack[0]))
    return constants, same, tuple((t.shape, t.dtype, t.device) for t in (inputs.kv_cache, inputs.query, inputs.output))


_LAYER_FIELDS: tuple[str, ...] = ()


def _layer_fields() -> tuple[str, ...]:
    """CaptureLayer's fields but its name, worked out once."""
    global _LAYER_FIELDS
    if not _LAYER_FIELDS:
        _LAYER_FIELDS = tuple(f.name for f in dataclasses.fields(CaptureLayer) if f.name != "name")
    return _LAYER_FIELDS


def _check_alike(entries: list[tuple[CaptureLayer, StepInputs]], pairs: list[tuple[int, int]] | int,
                 rng: random.Random, step: int | None, reference_device: Any = None) -> list[CheckResult]:
    layer, first = entries[0]
    hq, d = layer.num_heads, layer.head_size
    qsl = first.query_start_loc.to("cpu", torch.int64).tolist()
    seq_lens = first.seq_lens.to("cpu", torch.int64).tolist()
    num_tokens = qsl[-1]
    fp8 = layer.kv_cache_dtype.startswith("fp8")
    tolerance = default_tolerance(layer.dtype, fp8=fp8)
    results = [CheckResult(layer=entry[0].name, step=step, tolerance=tolerance, num_tokens=num_tokens)
               for entry in entries]
    if num_tokens == 0:
        return results
    for entry_layer, inputs in entries:  # named, not a reshape's error: a graph's copies shorter than the step
        rows = min(inputs.query.shape[0], inputs.output.shape[0])
        if rows < num_tokens:
            raise ValueError(f"layer {entry_layer.name}: the step has {num_tokens} token(s), its query and output "
                             f"hold {rows} row(s)")
    stacked = _stacked_rows(entries, num_tokens, hq, d)
    if stacked is None:
        outputs = [_rows(inputs.output, num_tokens, hq, d) for _, inputs in entries]
        queries = [_rows(inputs.query, num_tokens, hq, d) for _, inputs in entries]
        nonfinite = _nonfinite_rows(outputs, qsl)
    else:  # [layers, T, Hq, D] each, indexed by entry: one read of the device for the whole check of every layer
        queries, outputs = stacked
        finite = torch.isfinite(outputs).flatten(1).all(dim=1).tolist()
        nonfinite = [None if ok else _nonfinite(outputs[e], qsl) for e, ok in enumerate(finite)]
    for result, bad in zip(results, nonfinite):
        result.nonfinite = bad
    query_lens = [qsl[r + 1] - qsl[r] for r in range(len(qsl) - 1)]
    chosen = [choose_pairs(query_lens, hq, pairs, rng) if isinstance(pairs, int) else list(pairs) for _ in entries]
    # One reference call for all pairs; a layer with per-head values (sinks, ALiBi) needs one per head.
    # Within a call, each layer's pairs are one run of mini-requests (entry order).
    per_head = any(getattr(layer, name, None) is not None for name in ("sinks", "alibi_slopes"))
    calls: dict[int | None, list[list[tuple[int, int]]]] = {}
    for e, layer_pairs in enumerate(chosen):
        for pair in layer_pairs:
            calls.setdefault(pair[1] if per_head else None, [[] for _ in entries])[e].append(pair)
    # The engine quantised the query (an FP8 cache on CUDA): its kernel rounded P to e4m3 before P·V, which
    # the tolerance allows for from the values each layer's sampled pairs read (kvdbg.judge.compare).
    fp8_query = fp8 and holds_fp8(first.query)
    if stacked is None:
        checks = [(split, _reference_pairs(layer, [(entries[e][1], queries[e], outputs[e], split[e])
                                                   for e in range(len(entries))], qsl, seq_lens,
                                           read_values=fp8_query, reference_device=reference_device))
                  for split in calls.values()]
    else:
        checks = [(split, _reference_pairs(layer, [(entries[e][1], None, None, split[e]) for e in range(len(entries))],
                                           qsl, seq_lens, read_values=fp8_query, stacked=stacked,
                                           reference_device=reference_device))
                  for split in calls.values()]
    if fp8_query:
        allowance = [0.0] * len(entries)
        for split, parts in checks:
            max_abs, keys = parts[4]
            start = 0
            for e, mine in enumerate(split):
                if mine:
                    allowance[e] = max(allowance[e], fp8_query_allowance(max_abs[start:start + len(mine)],
                                                                         keys[start:start + len(mine)]))
                start += len(mine)
        for result, extra in zip(results, allowance):
            result.tolerance = default_tolerance(layer.dtype, fp8=fp8, fp8_query=extra)
    for split, (expected, actual, mini_qsl, mini_lens, _) in checks:
        bounds = mini_qsl.tolist()
        ok = _within(actual, expected, bounds, [results[e].tolerance for e, mine in enumerate(split) for _ in mine])
        start = 0
        for e, mine in enumerate(split):
            stop = start + len(mine)
            result = results[e]
            if all(ok[start:stop]):  # the usual case: the per-element statistics are not needed
                result.pairs += [PairResult(r, h, None) for r, h in mine]
            elif mine:
                rows = slice(bounds[start], bounds[stop])
                comparison = compare(actual[rows], expected[rows], mini_qsl[start:stop + 1] - bounds[start],
                                     mini_lens[start:stop], result.tolerance, actual_name="engine",
                                     expected_name="reference", step=0 if step is None else step)
                result.pairs += [PairResult(r, h, diff) for (r, h), diff in zip(mine, comparison.heads)]
            start = stop
    for result in results:
        result.pairs.sort(key=lambda p: (p.request, p.head))
    return results


def _stacked_rows(entries: list[tuple[CaptureLayer, StepInputs]], num_tokens: int, num_heads: int,
                  head_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(queries, outputs), each ``[entries, num_tokens, Hq, D]`` with entry ``e``'s rows at ``e``, when every entry's
    copies lie in one stack (:attr:`StepInputs.stack`) and hold the step's tokens; else None (each layer is then
    read apart, and a step with more tokens than its copies' rows is refused there, as for any layer)."""
    first = entries[0][1].stack
    if first is None or len(entries) < 2 or any(
            inputs.stack is None or inputs.stack[0] is not first[0] or inputs.query.shape[0] < num_tokens
            or inputs.output.shape[0] < num_tokens for _, inputs in entries):
        return None
    stack, at = first[0], [inputs.stack[1] for _, inputs in entries]
    if at == list(range(at[0], at[0] + len(at))):  # consecutive layers: views, nothing gathered
        pick = slice(at[0], at[0] + len(at))
        query, output = stack.query[pick, :num_tokens], stack.output[pick, :num_tokens]
    else:  # the step's rows first: a layer's buffer holds the largest graph's
        index = torch.tensor(at, device=stack.query.device)
        query, output = stack.query[:, :num_tokens].index_select(0, index), \
            stack.output[:, :num_tokens].index_select(0, index)
    shape = (len(at), num_tokens, num_heads, head_size)
    return query.reshape(shape), output.reshape(shape)


def _nonfinite_rows(outputs: list[torch.Tensor], qsl: list[int]) -> list[NonFinite | None]:
    """:func:`_nonfinite` of each layer's output rows, with one read of the device for all of them."""
    if len(outputs) == 1:
        return [_nonfinite(outputs[0], qsl)]
    finite = torch.stack([torch.isfinite(rows).all() for rows in outputs]).tolist()
    return [None if ok else _nonfinite(rows, qsl) for ok, rows in zip(finite, outputs)]


def _within(actual: torch.Tensor, expected: torch.Tensor, bounds: list[int], tolerances: list[Tolerance]) -> list[bool]:
    """Per mini-request: every element finite on both sides and within its tolerance (compare()'s rule)."""
    a, e = actual.float(), expected.float()
    if len(set(tolerances)) <= 1:
        atol, rtol = (tolerances[0].atol, tolerances[0].rtol) if tolerances else (0.0, 0.0)
    else:  # the layers' tolerances differ: each mini-request's rows get their own
        counts = torch.tensor([bounds[i + 1] - bounds[i] for i in range(len(tolerances))])
        shape = (-1,) + (1,) * (a.dim() - 1)
        atol = torch.tensor([t.atol for t in tolerances], dtype=torch.float32).repeat_interleave(counts)
        rtol = torch.tensor([t.rtol for t in tolerances], dtype=torch.float32).repeat_interleave(counts)
        atol, rtol = atol.to(a.device).view(shape), rtol.to(a.device).view(shape)
    good = torch.isfinite(a) & torch.isfinite(e) & ((a - e).abs() <= atol + rtol * e.abs())
    # One read to the host, then Python: a slice and an all() per mini-request would be three torch calls each.
    per_token = good.reshape(good.shape[0], -1).all(dim=1).tolist()
    return [all(per_token[bounds[i]:bounds[i + 1]]) for i in range(len(bounds) - 1)]


def _one_head_per_page(pages: torch.Tensor, layout: str, index: torch.Tensor, kv_heads: torch.Tensor) -> torch.Tensor:
    """Pages of a snapshot ``layout`` with one KV head each: page ``i`` keeps its KV head ``kv_heads[i]``
    (``index``: 0 .. pages - 1)."""
    if page_dim(layout) == 0:  # [pages, Hkv, page, 2*D]
        return pages[index, kv_heads].unsqueeze(1)
    # [2, pages, page, Hkv, D]: the two indexed dimensions come first, [pages, 2, page, D]
    return pages[:, index, :, kv_heads].permute(1, 0, 2, 3).unsqueeze(3)


def _reference_pairs(layer: CaptureLayer, parts: list[tuple[StepInputs, Any, Any, list]],
                     qsl: list[int], seq_lens: list[int], *, read_values: bool = False,
                     stacked: tuple[torch.Tensor, torch.Tensor] | None = None, reference_device: Any = None):
    """(reference, engine output, query_start_loc, seq_lens, read values) of every part's pairs, each pair one
    request of one head; a part: one layer's (inputs, query rows, output rows, pairs), the parts alike
    (:func:`_alike_key`) and sharing ``qsl`` and ``seq_lens``. Read values (with ``read_values``): the largest |v|
    each pair reads and its key count (:func:`kvdbg.snapshot.layout.read_value_magnitudes`), else None.

    The mini-problem has one query head and one KV head: pair ``i`` (the parts' pairs in order) is request
    ``i``, reading its own copies of the pages its request reads in its layer, cut to the pair's KV head.
    Outputs are ``[T, 1, D]``. With ``reference_device`` (:func:`check_layers`), the pairs' rows and pages are
    picked where they lie and copied there, and everything returned lies there.
    """
    first = parts[0][0]
    layout = resolve_kv_layout(layer.kv_layout, first.kv_cache, layer.num_kv_heads, layer.head_size)
    page_size = first.kv_cache.shape[layout.token_dim]
    device = first.kv_cache.device
    group = layer.num_heads // layer.num_kv_heads
    # The pages each pair's request reads, from one read of the rows of the block table the parts need (the
    # parts share it): a check's cost on a busy host is mostly per operation, so the indices are made as
    # lists and each becomes a tensor once.
    needed = sorted({r for *_, mine in parts for r, _ in mine})
    if first.block_table is None:  # a staged step: its requests' pages one request after another, in order
        if needed and needed[-1] >= len(first.max_pages):
            raise ValueError(f"request {needed[-1]} has no count of staged pages (the step's staging counted "
                             f"{len(first.max_pages)} request(s))")
        starts = list(accumulate(first.max_pages, initial=0))
        row_of = {r: range(starts[r], starts[r + 1]) for r in needed}
    else:
        table_rows = first.block_table.index_select(0, torch.tensor(needed, device=first.block_table.device))
        row_of = dict(zip(needed, table_rows.tolist()))
    page_counts, tokens, plans, pairs = [], [], [], []
    for e, (inputs, query, output, mine) in enumerate(parts):
        if not mine:
            continue
        ids, kv_heads, rows, heads = [], [], [], []
        for r, head in mine:
            live = -(-seq_lens[r] // page_size)
            if inputs.max_pages is not None and live > inputs.max_pages[r]:
                raise ValueError(f"request {r} is {seq_lens[r]} tokens long, past the {inputs.max_pages[r]} pages "
                                 "staged for it (the host's bound on its length, or the block table's width)")
            if live > len(row_of[r]):
                raise ValueError(f"request {r} is {seq_lens[r]} tokens long, past the {len(row_of[r])} pages of its "
                                 "block table row")
            ids += row_of[r][:live]
            page_counts.append(live)
            kv_heads += [head // group] * live
            # The last rows of the request's query block: a prefill's cost stays that of a few decode tokens,
            # and the rows kept are still the positions L - q' .. L - 1 the reference masks for.
            first_row = max(qsl[r], qsl[r + 1] - MAX_QUERY_ROWS)
            rows += range(first_row, qsl[r + 1])
            heads += [head] * (qsl[r + 1] - first_row)
            tokens.append(qsl[r + 1] - first_row)
        plans.append((e, inputs, query, output, ids, kv_heads, rows, heads))
        pairs += mine
    width, start, table_list = max(page_counts), 0, []
    for count in page_counts:
        table_list += range(start, start + count)
        table_list += [-1] * (width - count)
        start += count
    # Every index of the check in one tensor, made from one list and cut into views: each torch call in the
    # sentinel's worker is a moment the engine's thread may wait for Python's lock, and each tensor made from a
    # list a small copy to the device.
    lists: list = []
    if stacked is None:
        for _, _, _, _, ids, kv_heads, rows, heads in plans:
            lists += (ids, range(len(ids)), kv_heads, rows, heads)
    else:  # the layers' copies lie in one stack: each kind picked for every layer at once, by (layer, index)
        picks: list[list] = [[], [], [], [], [], []]  # page ids, their layers, KV heads, rows, heads, rows' entries
        for e, inputs, _, _, ids, kv_heads, rows, heads in plans:
            for kept, values in zip(picks, (ids, [inputs.stack[1]] * len(ids), kv_heads, rows, heads,
                                            [e] * len(rows))):
                kept += values
        lists += (picks[0], picks[1], range(len(picks[0])), *picks[2:])
    lists += (table_list, list(accumulate(tokens, initial=0)), [seq_lens[r] for r, _ in pairs])
    pieces = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.int64, device=device).split(
        [len(x) for x in lists])
    if stacked is None:
        all_pages, queries, outputs = [], [], []
        for p, (_, inputs, query, output, *_) in enumerate(plans):
            ids, positions, kv_heads, rows, heads = pieces[5 * p:5 * p + 5]
            # Every pair's pages of a layer in one gather, converted to the snapshot layout at once, then each
            # page's one KV head picked.
            pages = layout.convert(inputs.kv_cache.index_select(layout.page_dim, ids))
            all_pages.append(_one_head_per_page(pages, layout.snapshot_layout, positions, kv_heads))
            if query.device != device:
                rows, heads = rows.to(query.device), heads.to(query.device)
            queries.append(query[rows, heads, None])  # [pairs' rows, 1, D]
            outputs.append(output[rows, heads, None])
        pages = all_pages[0] if len(all_pages) == 1 else torch.cat(all_pages,
                                                                   dim=page_dim(layout.snapshot_layout))
    else:
        ids, at, positions, kv_heads, rows, heads, entries = pieces[:7]
        stack, axis = plans[0][1].stack[0], layout.page_dim
        # The stack's pages [layers, ...] with the page axis second: one gather by (layer, page) is each layer's
        # index_select along its page axis, laid one after another; the page axis then goes back in its place.
        picked = (stack.pages if axis == 0 else stack.pages.movedim(axis + 1, 1))[at, ids]
        picked = picked if axis == 0 else picked.movedim(0, axis)
        pages = _one_head_per_page(layout.convert(picked), layout.snapshot_layout, positions, kv_heads)
        query_rows, output_rows = stacked
        queries = [query_rows[entries, rows, heads, None]]  # [pairs' rows, 1, D]
        outputs = [output_rows[entries, rows, heads, None]]
    q = torch.cat(queries) if len(queries) > 1 else queries[0]
    actual = torch.cat(outputs) if len(outputs) > 1 else outputs[0]
    small = pieces[-3:]
    if reference_device is not None and torch.device(reference_device) != device \
            and sum(t.numel() * t.element_size() for t in (pages, q, actual)) <= HOST_REFERENCE_BYTES:
        # The pairs' few rows and pages over in one go (one wait for the device), the indices made there from
        # their lists: nothing of the check after this line runs on the inputs' device.
        device = torch.device(reference_device)
        lying = {t.device for t in (pages, q, actual) if t.is_cuda}
        pages, q, actual = (t.to(device, non_blocking=True) for t in (pages, q, actual))
        for where in lying:
            torch.cuda.current_stream(where).synchronize()
        tail = lists[-3:]
        small = torch.tensor(list(chain.from_iterable(tail)), dtype=torch.int64, device=device).split(
            [len(x) for x in tail])
    table, mini_qsl, mini_lens = small[0].view(len(page_counts), width), small[1], small[2]
    mini_layer = dataclasses.replace(layer.meta(causal=bool(first.causal)), num_heads=1, num_kv_heads=1)
    meta = SnapshotMeta(layer=mini_layer, backend=BackendMeta("sentinel", page_size, first.max_model_len or
                                                              max(seq_lens), start),
                        kv_layout=layout.snapshot_layout)
    extra = {}
    for name in ("sinks", "alibi_slopes"):
        values = getattr(layer, name, None)
        if values is not None:  # the layer's learned value of this call's one head
            extra[name] = torch.tensor([float(values[pairs[0][1]])], dtype=torch.float32, device=device)
    common = CommonMetadata(
        block_table=table, block_table_engine=table, seq_lens=mini_lens, query_start_loc=mini_qsl,
        num_reqs=len(pairs), num_actual_tokens=sum(tokens),
        max_query_len=max(tokens), max_seq_len=max(seq_lens[r] for r, _ in pairs),
        causal=bool(first.causal), sliding_window=mini_layer.sliding_window, page_size=page_size,
        num_pages=start, null_page=None, **extra)
    compute = torch.float32
    md = ReferenceBuilder(meta, compute).build(common)
    expected = torch.empty((q.shape[0], 1, layer.head_size), dtype=compute, device=device)
    ReferenceImpl(meta, compute).forward(q.to(device), pages, md, expected)
    read = (read_value_magnitudes(meta, pages, table, mini_lens, mini_qsl[1:] - mini_qsl[:-1])
            if read_values else None)
    return expected, actual.to(device), mini_qsl, mini_lens, read


# --------------------------------------------------------------------------- the shell


class Sentinel:
    """Sampling, the once-only lines, dedupe and rate limit around :func:`check_step`. Never raises into the engine."""

    def __init__(self, config: SentinelConfig, *, clock=time.monotonic):
        self.config = config
        self.seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._rng = random.Random(self.seed)
        self._pair_rng = random.Random(self.seed + 1)
        self.staged_checks: Counter = Counter()  # "process" / "thread": where DeferredChecks checked staged steps
        self._clock = clock
        self._draws: dict[int | None, bool] = {}  # the last steps' draws, oldest first
        self._layer_cache: dict[str, bool] = {}
        self._unchecked: dict[str, str | None] = {}
        self._signatures: set[tuple] = set()
        self._last_capture: float | None = None
        self.counts: Counter[str] = Counter()
        self.findings: list[SentinelFinding] = []

    @classmethod
    def from_env(cls, environ=None) -> "Sentinel":
        return cls(SentinelConfig.from_env(environ))

    def describe(self) -> str:
        return self.config.describe(self.seed)

    # ---------------------------------------------------------------- sampling

    def layer_selected(self, layer_name: str) -> bool:
        hit = self._layer_cache.get(layer_name)
        if hit is None:
            hit = self._layer_cache[layer_name] = bool(self.config.layers(layer_name))
        return hit

    def sampled(self, layer_name: str, step: int | None) -> bool:
        """Whether this step of this layer is checked. One draw per step, whichever hook asks first, shared by
        every selected layer: each layer's steps are checked at the rate, and a drawn step on all its selected
        layers at once (a replayed graph's are then staged once and checked as one problem: check_layers)."""
        return self.layer_selected(layer_name) and self.drawn(step)

    def drawn(self, step: int | None) -> bool:
        """The step's draw, whichever layer asks (:meth:`sampled` less the layer filter)."""
        draws = self._draws
        hit = draws.get(step)
        if hit is None:
            hit = draws[step] = self._rng.random() < self.config.rate
            if len(draws) > DRAWS_KEPT:  # layers a few steps apart still share their steps' draws
                del draws[next(iter(draws))]
        return hit

    # ---------------------------------------------------------------- checking

    def can_check(self, layer: CaptureLayer, backend_name: str | None = None) -> bool:
        """False (said once per layer) when the reference cannot model the layer or the backend."""
        key = layer.name
        if key not in self._unchecked:
            reason = unchecked_reason(layer, backend_name)
            self._unchecked[key] = reason
            if reason is not None:
                logger.warning("kvdbg sentinel cannot check layer %s: %s; its steps are not checked", layer.name,
                               reason)
        return self._unchecked[key] is None

    def check(self, layer: CaptureLayer, inputs: StepInputs, step: int | None) -> CheckResult:
        result = check_step(layer, inputs, pairs=self.config.pairs, rng=self._pair_rng, step=step)
        self.record(result)
        return result

    def check_layers(self, entries: list[tuple[CaptureLayer, StepInputs]], step: int | None) -> list[CheckResult]:
        """:meth:`check` for several layers of one step, alike ones as one problem (:func:`check_layers`)."""
        results = check_layers(entries, pairs=self.config.pairs, rng=self._pair_rng, step=step)
        for result in results:
            self.record(result)
        return results

    def record(self, result: CheckResult) -> None:
        self.counts["checked"] += 1
        self.counts["pairs"] += result.pair_count
        if not result.passed:
            self.counts["failed"] += 1
            self.findings.append(result.finding())

    # ---------------------------------------------------------------- capture policy

    def admit(self, finding: SentinelFinding) -> bool:
        """Whether this finding's step is captured: new signature, under the cap, past the interval."""
        config = self.config
        if finding.signature in self._signatures:
            self.counts["duplicate"] += 1
            return False
        if config.max_snapshots is not None and self.counts["captured"] >= config.max_snapshots:
            self.counts["over_max"] += 1
            return False
        now = self._clock()
        if self._last_capture is not None and now - self._last_capture < config.interval:
            self.counts["too_soon"] += 1
            return False
        self._signatures.add(finding.signature)
        self._last_capture = now
        self.counts["captured"] += 1
        return True

    def summary(self) -> str:
        c = self.counts
        line = (f"kvdbg sentinel in pid {os.getpid()}: checked {c['checked']} step(s) ({c['pairs']} (request, head) "
                f"pairs), {c['failed']} wrong, {c['captured']} captured")
        skipped = [(c["duplicate"], "already captured with the same signature"),
                   (c["over_max"], f"past {ENV_MAX}={self.config.max_snapshots}"),
                   (c["too_soon"], f"within {ENV_INTERVAL}={self.config.interval:g}s of the last capture"),
                   (c["errors"], "the check failed (see the warning)")]
        shown = [f"{n} {why}" for n, why in skipped if n]
        if shown:
            line += "; not captured: " + ", ".join(shown)
        unchecked = sorted(name for name, reason in self._unchecked.items() if reason is not None)
        if unchecked:
            line += f"; {len(unchecked)} layer(s) not checkable"
        where = self.staged_checks
        if where:
            line += (f"; staged steps checked in its checker process {where['process']}, in the engine's process "
                     f"{where['thread']}")
        return line


# --------------------------------------------------------------------------- the device path


@dataclass
class _Job:
    entries: list  # (CaptureLayer, StepInputs) of one step: one layer, or a staged step's sampled layers
    step: int | None
    ready: Any  # torch.cuda.Event recorded on the engine's stream after the forward (or the staging)
    staged: bool = False  # kvdbg's staged copies (checked in the checker process when it runs)
    # Host copies of the entries' metadata, issued on the device (kvdbg.capture.buffers.HostCopiesReady each):
    # waited for on the host before the check reads them
    host_ready: list = field(default_factory=list)
    seed: int = 0  # its pairs' seed, drawn when it was handed over (the same pairs in the thread and the process)
    done: threading.Event = field(default_factory=threading.Event)
    results: list | None = None  # a CheckResult per entry (a PassedCheck where the checker process answered one)
    error: BaseException | None = None

    @property
    def result(self) -> CheckResult | None:
        return None if self.results is None else self.results[0]


def _copied(job: _Job) -> bool:
    """Whether a job's inputs are all written: its staging (``ready``) and its metadata's host copies."""
    return (job.ready is None or job.ready.query()) and all(copies.query() for copies in job.host_ready)


def _wait_copied(job: _Job) -> None:
    if job.ready is not None:
        job.ready.synchronize()
    for copies in job.host_ready:
        copies.synchronize()


class DeferredChecks:
    """Checks of device steps in a worker thread on its own CUDA stream, collected on a later hook.

    The engine's thread records an event after the forward and copies the
    step's query and output rows (device-to-device, on its stream); the worker
    waits for the event on a side stream and runs :func:`check_step` there, so
    its host syncs block only the worker. The engine collects the result at
    that layer's next hook (:meth:`collect`), before the next cache update can
    change the pages the check read, by when it has long finished.

    A staged step's check goes to the checker process (:mod:`kvdbg.sentinel.remote`) once it is ready, unless the
    configuration says not to (``process``): there its Python does not hold the lock the engine's thread wants.
    The engine's thread sends it once its staging is done and reads the answer, at its hooks
    (:meth:`poll_remote`), so no thread of the engine's process wakes for it. The process starts with this object,
    in a thread of its own; until it is ready, and if it cannot start or dies (said once, as a warning), the
    worker checks in its own thread.
    """

    def __init__(self, sentinel: Sentinel, device: torch.device, *, process: bool | None = None):
        self.sentinel = sentinel
        self.device = device
        # Its side stream (None on a CPU device, where the checker process's path runs the same: the tests' way in).
        self.stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: dict[str, _Job] = {}
        self.remote: Any = None  # the CheckerProcess, once ready
        # Staged jobs for the checker process, on the engine's thread (poll_remote): waiting for their staging's
        # event before they are sent, then sent and waiting for their answers, in order.
        self._unsent: collections.deque = collections.deque()
        self._sent: collections.deque = collections.deque()
        self._started = threading.Event()  # the checker process ready, or known not to be (set at once without one)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="kvdbg-sentinel", daemon=True)
        self._thread.start()
        if sentinel.config.process if process is None else process:
            threading.Thread(target=self._start_process, name="kvdbg-sentinel-start", daemon=True).start()
        else:
            self._started.set()

    def _start_process(self) -> None:
        from kvdbg.sentinel.remote import CheckerProcess

        try:
            remote = CheckerProcess(self.device, reference=self.sentinel.config.reference)
        except Exception as exc:
            logger.warning("kvdbg sentinel: its checker process did not start (%s); checks run in a thread of the "
                           "engine's process, where their Python holds the lock the engine's thread wants (set %s=0 "
                           "to say so and not try)", exc, ENV_PROCESS)
            self._started.set()
            return
        if self._closed:  # closed while it started: nobody would stop it
            remote.close()
        else:
            self.remote = remote
            logger.info("kvdbg sentinel: checks of staged steps run in a process of their own (pid %d, %s, "
                        "scheduled: %s)", remote.pid, remote.info.get("device"),
                        remote.info.get("scheduling", "not told"))
        self._started.set()

    def process_ready(self, timeout: float | None = None) -> bool:
        """Whether staged steps are checked in the checker process, waiting up to ``timeout`` seconds for it to
        start (False at once when it is not to be started, could not start, or has gone)."""
        self._started.wait(timeout)
        return self.remote is not None

    def submit(self, layer: CaptureLayer, inputs: StepInputs, step: int | None) -> StepInputs:
        """Hand a step to the worker; returns the inputs it checks (query and output are copies)."""
        ready = torch.cuda.Event()
        kept = dataclasses.replace(inputs, query=inputs.query.clone(), output=inputs.output.clone())
        ready.record()
        for t in (kept.query, kept.output, kept.kv_cache, kept.block_table, kept.seq_lens, kept.query_start_loc):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(self.stream)  # the allocator keeps them until the side stream is done
        job = _Job([(layer, kept)], step, ready, seed=self._seed())
        self._pending[layer.name] = job
        self._jobs.put(job)
        return kept

    def submit_staged(self, entries: list[tuple[CaptureLayer, StepInputs]], step: int | None, ready: Any, *,
                      host_ready: list | None = None) -> _Job:
        """Hand the sampled layers of a step staged on the device (kvdbg.vllm_plugin.graph_staging) to the worker,
        as one job (:func:`check_layers`: alike layers make one reference problem): their query, output and pages
        are kvdbg's own copies, which no later step overwrites, so nothing is cloned and the job is collected
        whenever it is done (the caller keeps it; ``ready``: the event after the staging; ``host_ready``: the
        events of host copies among the entries' metadata, which the check waits for before reading them)."""
        seen: set[int] = set()  # a step's layers share its metadata tensors: each marked once (a torch call each)
        for _, inputs in entries:
            for t in (inputs.seq_lens, inputs.query_start_loc, inputs.block_table):
                if isinstance(t, torch.Tensor) and id(t) not in seen and t.is_cuda:
                    seen.add(id(t))
                    t.record_stream(self.stream)
        job = _Job(list(entries), step, ready, staged=True, seed=self._seed(), host_ready=list(host_ready or ()))
        if self.remote is None:
            self._jobs.put(job)
        else:  # sent by the engine's thread itself once its staging is done: no thread of this process takes part
            self._unsent.append(job)
            self.poll_remote()
        return job

    @property
    def remote_out(self) -> bool:
        """Whether staged jobs are with the checker process (or about to be sent to it): :meth:`poll_remote` them."""
        return bool(self._unsent or self._sent)

    def poll_remote(self, wait: float | None = None) -> None:
        """The engine's thread: send the staged jobs whose staging is done on the device, and read the checker
        process's answers that came back (each job then done); with ``wait``, up to that many seconds for every
        job handed over. If the process fails (or anything of this path does), it is said once and ended, and its jobs
        go to the worker thread; a job that cannot be sent fails alone. Never raises."""
        remote = self.remote
        if remote is None:
            return
        from kvdbg.sentinel.remote import CheckerProcessError

        deadline = None if wait is None else time.monotonic() + wait
        try:
            while self._unsent:
                job = self._unsent[0]
                if not _copied(job):
                    if deadline is None:
                        break
                    _wait_copied(job)
                try:
                    remote.submit(job.entries, pairs=self.sentinel.config.pairs, seed=job.seed, step=job.step)
                except CheckerProcessError:
                    raise
                except Exception as exc:  # this job's own failure (its inputs would not go): said when collected
                    self._unsent.popleft()
                    job.error = exc
                    job.done.set()
                    continue
                self._sent.append(self._unsent.popleft())
            if self._sent:  # without a wait, a hook's look (which skips the socket while an answer is unlikely)
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                for kind, value in remote.answers(left):
                    job = self._sent.popleft()
                    if kind == "ok":
                        job.results = value
                        self.sentinel.staged_checks["process"] += 1
                    else:
                        job.error = RuntimeError(f"in the checker process: {value}")
                    job.done.set()
        except Exception as exc:  # noqa: BLE001 - the process given up, never the engine: its jobs to the thread
            self.remote = None
            try:
                remote.close(0.0)
            except Exception:  # noqa: BLE001 - ended or not, it is not asked again
                pass
            cause = exc if isinstance(exc, CheckerProcessError) else f"reading or sending its checks failed " \
                f"({type(exc).__name__}: {exc})"
            logger.warning("kvdbg sentinel: %s; its checks run in a thread of the engine's process from now on, the "
                           "steps it had not answered first", cause)
            while self._sent or self._unsent:
                self._jobs.put((self._sent or self._unsent).popleft())

    def _seed(self) -> int:
        """A job's own seed for its pairs, drawn in the order the jobs are handed over (the engine's thread)."""
        return self.sentinel._pair_rng.getrandbits(64)

    def collect(self, layer_name: str, timeout: float | None = None) -> "_Job | None":
        """The finished job of this layer's last submitted step, waiting for it if needed (None if none)."""
        job = self._pending.pop(layer_name, None)
        if job is None:
            return None
        job.done.wait(timeout)
        return job

    def _loop(self) -> None:
        # Its host-side torch work makes no OpenMP team beside the engine's (see kvdbg.util.background).
        logger.debug("kvdbg sentinel worker: %s", confine_torch_to_this_thread())
        while True:
            job = self._jobs.get()
            try:
                stream = self.stream
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    try:
                        if job.ready is not None:
                            stream.wait_event(job.ready)
                        for copies in job.host_ready:  # read on the host
                            copies.synchronize()
                        job.results = check_layers(job.entries, pairs=self.sentinel.config.pairs,
                                                   rng=random.Random(job.seed), step=job.step)
                    finally:  # a done job has no read left on the device, whether it passed, failed or raised
                        if stream is not None:
                            stream.synchronize()
                if job.staged:
                    self.sentinel.staged_checks["thread"] += 1
            except BaseException as exc:  # reported by the engine's thread when it collects the job
                job.error = exc
            finally:
                job.done.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the checker process, if one runs (the worker thread ends with the process)."""
        self._closed = True
        remote, self.remote = self.remote, None
        while self._sent or self._unsent:  # handed over and never answered: said so where they are collected
            job = (self._sent or self._unsent).popleft()
            job.error = RuntimeError("the sentinel closed before its checker process answered this check")
            job.done.set()
        if remote is not None:
            remote.close(timeout)
            # The buffers the child held are let go here now, not in a warning of torch's at exit ("Producer process
            # has been terminated before all shared CUDA tensors released").
            if self.stream is not None:
                torch.cuda.ipc_collect()
