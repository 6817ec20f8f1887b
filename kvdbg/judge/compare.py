"""Per request × head comparison of a backend's output against the reference (or the engine's output).

An element passes when ``|a - e| <= atol + rtol * |e|`` (e: expected). Default
tolerances depend on the dtype the compared backend computes in, because its
output is rounded to that dtype:

=============  ======  ======  ==========================================
dtype          atol    rtol    why
=============  ======  ======  ==========================================
float64        1e-10   1e-10   round-off only
float32        1e-5    1e-5    a few fp32 ulps of accumulated round-off
float16        2e-3    2e-3    2 ulps of the fp16 output (eps 9.8e-4)
bfloat16       1.6e-2  1.6e-2  2 ulps of the bf16 output (eps 7.8e-3)
fp8 KV cache   3e-2    3e-2    bf16/fp16 rounding of dequantised values, and
                               FLASHINFER_TS's e4m3 rounding of P (see below)
=============  ======  ======  ==========================================

FLASHINFER_TS's FP8 kernel rounds the unnormalised probabilities (x448) to
e4m3 before P·V; kvdbg's emulation models that at split count 1. The real
planner may split the keys further, which moves where P is rounded; every P
stays within half an e4m3 step (1/16 relative) of exact either way. Measured:
the emulated column stays within 0.026 of the exact reference on kvdbg's FP8
fixture and within 0.027 on twelve synthetic FP8 snapshots (lengths 50-2000,
default scales) -- inside this tolerance, but not by much: values far larger
than the scales make here can exceed it through P rounding alone.

A step whose attention ran with an FP8 query (vLLM 0.33 on CUDA quantises the
query when the cache is FP8, and TRITON_ATTN then takes P·V on FP8 operands)
has its P rounded too: the kernel scales the unnormalised weights (each <= 1)
by 256, rounds them to e4m3 and divides by 256 after the product. Every
comparison of such a step with the engine's kernels on one side (the captured
output, the ``vllm`` column) widens atol by :func:`fp8_query_allowance`::

    |Σ (p̃_k - p_k) v_k| / Σ p_k  <=  2^-4 · max|v|            e4m3 round to nearest, normal P·256 (P >= 2^-14)
                                    + n · 2^-18 · max|v|       P·256 subnormal or flushed: at most 2^-10/256 each
                                                               (n keys; Σ p_k >= 1, the largest weight being 1)

with max|v| the largest dequantised |v| the step's requests read and n the
most keys one request reads. The bound holds per split of the keys too (each
split's error is bounded by its own weights), so a split-KV launch stays
inside it. The reference stays exact: the allowance widens the judgement,
never the computation.

Non-finite values are counted, never raised, and never pass: an element is
compared only where both sides hold finite numbers, and every other element
fails its head under one cause -- the compared side produced NaN/inf, the
compared side did not write that token (a request its kernel cannot run), or
the expected side is non-finite (nothing there can be verified).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

DEFAULT_TOLERANCES = {
    "float64": (1e-10, 1e-10),
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 2e-3),
    "bfloat16": (1.6e-2, 1.6e-2),
    "fp8": (3e-2, 3e-2),
}


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    source: str  # "default for bfloat16", "--atol/--rtol"

    @property
    def rule(self) -> str:
        return f"|a - e| <= {self.atol:g} + {self.rtol:g}·|e|"


# An FP8 query's P·V (see the module docstring): e4m3 keeps 3 mantissa bits, so rounding to nearest moves a
# normal value by at most 2^-4 of itself; P is scaled by 256 first, and a weight whose scaled value falls below
# e4m3's smallest normal (2^-6) moves by at most half the subnormal step, 2^-10, i.e. 2^-10 / 256 unscaled.
FP8_P_RELATIVE = 2.0 ** -4
FP8_P_SCALE = 256.0
FP8_P_UNDERFLOW = 2.0 ** -10 / FP8_P_SCALE


def fp8_query_allowance(max_abs_v, num_keys) -> float:
    """The extra atol of a step whose P·V ran on FP8 operands: the largest ``(2^-4 + n·2^-18)·max|v|``.

    ``max_abs_v``: the largest dequantised |v| each request reads (a tensor ``[num_reqs, ...]``, e.g. per KV
    head, or a number); ``num_keys``: the keys each request reads (``[num_reqs]`` or a number). Only finite
    values count (a NaN value poisons the output, which is then not compared anyway).
    """
    v = torch.as_tensor(max_abs_v, dtype=torch.float64).detach().cpu()
    n = torch.as_tensor(num_keys, dtype=torch.float64).detach().cpu()
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    if v.dim() > 1:
        v = v.flatten(1).amax(1)
    per_request = (FP8_P_RELATIVE + n * FP8_P_UNDERFLOW) * v
    return float(per_request.max()) if per_request.numel() else 0.0


def default_tolerance(dtype: str, *, fp8: bool = False, fp8_query: float | None = None, atol: float | None = None,
                      rtol: float | None = None) -> Tolerance:
    """The tolerance for a backend computing in ``dtype``; ``atol``/``rtol`` override either part.

    ``fp8_query``: the step's attention ran with an FP8 query; the :func:`fp8_query_allowance` of the values
    it read, added to the default atol (an explicit ``atol`` stays as given).
    """
    key = "fp8" if fp8 else dtype
    base_atol, base_rtol = DEFAULT_TOLERANCES.get(key, DEFAULT_TOLERANCES["bfloat16"])
    source = ("default for fp8 KV cache (dequantisation rounding; FLASHINFER_TS's e4m3 P rounding modelled at "
              "split count 1, other split counts move it by < 1/16 relative per P)") if fp8 else f"default for {dtype}"
    if fp8_query is not None and atol is None:
        base_atol += fp8_query
        source += (f"; FP8 query: the kernel's P·V on FP8 operands, P rounded to e4m3: + 2^-4·max|v| "
                   f"(+ 2^-18 per key) = {fp8_query:.4g}")
    if atol is not None or rtol is not None:
        source = "--atol/--rtol" if atol is not None and rtol is not None else source + " with --atol/--rtol"
    return Tolerance(base_atol if atol is None else atol, base_rtol if rtol is None else rtol, source)


@dataclass
class HeadDiff:
    """One request × query head. Error statistics cover only the elements both sides hold as finite numbers.

    A head never passes when either side has a non-finite element or the
    backend left one unwritten: those elements are counted apart, by cause, and
    the statistics they would falsify are NaN (null in JSON), never 0 or 1.0.
    """

    request: int
    head: int
    num_tokens: int
    compared: int  # elements where both sides are finite (the statistics below are over these)
    max_abs: float  # NaN when nothing was compared
    mean_abs: float
    max_rel: float  # |a - e| / max(|e|, atol), so near-zero expected values do not explode it
    cosine: float  # NaN when any element is non-finite or unwritten
    worst_token: int  # index into the step's query tokens
    worst_position: int  # absolute position of that token in its request (L - q + i)
    actual_nonfinite: int  # NaN/inf the compared side produced (in tokens it wrote)
    unwritten: int  # elements of tokens the compared side did not write (e.g. a request a kernel cannot run)
    expected_nonfinite: int  # NaN/inf on the expected side: nothing there can be verified
    not_compared: int  # elements skipped for any of the three causes above (a side may have several)
    failing: int  # elements outside the tolerance, plus every non-finite or unwritten one
    passed: bool

    def to_json(self) -> dict:
        return {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(self).items()}


@dataclass
class Comparison:
    """One backend against one expectation (the reference, or the engine's captured output)."""

    actual: str  # backend name, or "captured"
    expected: str  # "reference" or "captured"
    step: int
    tolerance: Tolerance
    heads: list[HeadDiff] = field(default_factory=list)

    @property
    def failed(self) -> list[HeadDiff]:
        return [h for h in self.heads if not h.passed]

    @property
    def passed(self) -> bool:
        """Every compared head passed, and at least one head was compared."""
        return bool(self.heads) and not self.failed

    @property
    def max_abs(self) -> float:
        """The largest finite error over the heads; NaN when no element was compared."""
        finite = [h.max_abs for h in self.heads if h.compared]
        return max(finite) if finite else float("nan")

    @property
    def failed_max_abs(self) -> float:
        """The largest finite error over the failing heads; NaN when none of them has an element compared."""
        finite = [h.max_abs for h in self.failed if h.compared]
        return max(finite) if finite else float("nan")

    @property
    def shown_max_abs(self) -> float:
        """The error a row or title of this comparison states: a failing comparison's comes from its failing
        heads (a passing head's error says nothing about the failure, and quoting it would make a failure whose
        heads hold no finite number look measured); a passing one's from every head. NaN: none to state."""
        return self.failed_max_abs if self.failed else self.max_abs

    @property
    def nonfinite(self) -> int:
        """Elements not compared because a side holds no finite value there."""
        return sum(h.not_compared for h in self.heads)

    def counts(self) -> dict[str, int]:
        """Elements not compared, by cause."""
        return {"actual_nonfinite": sum(h.actual_nonfinite for h in self.heads),
                "unwritten": sum(h.unwritten for h in self.heads),
                "expected_nonfinite": sum(h.expected_nonfinite for h in self.heads)}

    def to_json(self) -> dict:
        max_abs = self.max_abs
        return {
            "actual": self.actual, "expected": self.expected, "step": self.step,
            "tolerance": {"atol": self.tolerance.atol, "rtol": self.tolerance.rtol, "source": self.tolerance.source,
                          "rule": self.tolerance.rule},
            "passed": self.passed, "failed_heads": len(self.failed), "heads_compared": len(self.heads),
            "max_abs": None if max_abs != max_abs else max_abs,
            "failed_max_abs": None if not self.failed or self.failed_max_abs != self.failed_max_abs
            else self.failed_max_abs, "nonfinite": self.nonfinite, **self.counts(),
            "heads": [h.to_json() for h in self.heads],
        }


def compare(actual: torch.Tensor, expected: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            tolerance: Tolerance, *, requests: list[int] | None = None, heads: list[int] | None = None,
            actual_name: str = "actual", expected_name: str = "expected", step: int = 0,
            written: torch.Tensor | None = None) -> Comparison:
    """Compare ``actual`` to ``expected`` ([num_tokens, Hq, D]) per request × head, vectorised over tokens.

    ``written`` [num_tokens] bool marks the tokens the actual side wrote (default: all); the
    others count as unwritten, apart from non-finite values the side produced.
    """
    if actual.shape != expected.shape:
        raise ValueError(f"{actual_name} has shape {tuple(actual.shape)} but {expected_name} {tuple(expected.shape)}")
    qsl = query_start_loc.to(torch.int64).cpu()
    lens = seq_lens.to(torch.int64).cpu()
    num_reqs = len(qsl) - 1
    num_tokens, num_heads, _ = actual.shape
    a = actual.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    head_ids = list(range(num_heads)) if heads is None else [h for h in heads if 0 <= h < num_heads]
    req_ids = list(range(num_reqs)) if requests is None else [r for r in requests if 0 <= r < num_reqs]
    a, e = a[:, head_ids], e[:, head_ids]
    if written is None:
        wrote = torch.ones_like(a, dtype=torch.bool)
    else:
        wrote = written.detach().to("cpu", torch.bool).view(num_tokens, 1, 1).expand_as(a)
    finite_e, finite_a = torch.isfinite(e), torch.isfinite(a)
    unwritten = ~wrote
    bad_actual = wrote & ~finite_a
    bad_expected = ~finite_e  # counted whatever the other side holds: each side is reported on its own
    both = finite_e & finite_a & wrote
    zero = torch.zeros_like(a)
    err = torch.where(both, (a - e).abs(), zero)
    e_abs = torch.where(both, e.abs(), zero)
    limit = tolerance.atol + tolerance.rtol * e_abs
    outside = (both & (err > limit)) | ~both
    rel = err / torch.clamp(e_abs, min=max(tolerance.atol, 1e-30))

    doc = torch.repeat_interleave(torch.arange(num_reqs), qsl[1:] - qsl[:-1])
    pos = torch.arange(num_tokens) - qsl[doc] + (lens - (qsl[1:] - qsl[:-1]))[doc]
    # Per token × head reductions over the head dimension D, then per request with segment sums.
    tok_max = torch.where(both.any(-1), err.amax(-1), torch.full_like(err[..., 0], -1.0))  # [T, H]
    tok_sum = err.sum(-1)
    tok_rel = rel.amax(-1)
    tok_counts = [x.sum(-1) for x in (both, bad_actual, unwritten, bad_expected, outside, ~both)]
    dot = torch.where(both, a * e, zero).sum(-1)
    aa = torch.where(both, a * a, zero).sum(-1)
    ee = torch.where(both, e * e, zero).sum(-1)

    nh = len(head_ids)

    def seg_sum(x):
        return torch.zeros(num_reqs, nh, dtype=x.dtype).index_add_(0, doc, x)

    index = doc.unsqueeze(1).expand(-1, nh)
    req_max = torch.full((num_reqs, nh), -1.0, dtype=torch.float64).scatter_reduce_(0, index, tok_max, "amax")
    req_rel = torch.zeros(num_reqs, nh, dtype=torch.float64).scatter_reduce_(0, index, tok_rel, "amax")
    sums = seg_sum(tok_sum)
    compared, bads, unwr, exp_bad, outs, skipped = (seg_sum(x) for x in tok_counts)
    dots, aas, ees = seg_sum(dot), seg_sum(aa), seg_sum(ee)
    # Worst token: the first token of the request whose error equals the request's maximum; a token
    # with nothing to compare is "worst" when no token of the request could be compared.
    is_worst = tok_max == req_max[doc]
    big = num_tokens + 1
    worst = torch.full((num_reqs, nh), big, dtype=torch.int64).scatter_reduce_(
        0, index, torch.where(is_worst, torch.arange(num_tokens).unsqueeze(1).expand(-1, nh), big), "amin")
    comp = Comparison(actual=actual_name, expected=expected_name, step=step, tolerance=tolerance)
    nan = float("nan")
    for r in req_ids:
        if int(qsl[r + 1] - qsl[r]) == 0:
            continue
        for j, h in enumerate(head_ids):
            count = int(compared[r, j])
            missing = int(skipped[r, j])
            w = int(worst[r, j]) if int(worst[r, j]) < big else int(qsl[r])
            denom = float(aas[r, j].sqrt() * ees[r, j].sqrt())
            if missing or not count:
                cosine = nan
            elif denom > 0:
                cosine = float(dots[r, j]) / denom
            else:  # both sides all zeros: identical; one side zero: nothing alike
                cosine = 1.0 if float(aas[r, j]) == float(ees[r, j]) else 0.0
            comp.heads.append(HeadDiff(
                request=r, head=h, num_tokens=int(qsl[r + 1] - qsl[r]), compared=count,
                max_abs=float(req_max[r, j]) if count else nan,
                mean_abs=float(sums[r, j]) / count if count else nan,
                max_rel=float(req_rel[r, j]) if count else nan, cosine=cosine, worst_token=w,
                worst_position=int(pos[w]), actual_nonfinite=int(bads[r, j]), unwritten=int(unwr[r, j]),
                expected_nonfinite=int(exp_bad[r, j]), not_compared=missing, failing=int(outs[r, j]),
                passed=int(outs[r, j]) == 0 and count > 0))
    return comp


# The column that runs the engine's own backend code (backends/vllm_native.py): with an FP8 query it takes the
# kernel's P·V on FP8 operands as the engine did.
ENGINE_COLUMN = "vllm"


def compare_step(step_replay, meta, *, atol: float | None = None, rtol: float | None = None,
                 requests: list[int] | None = None, heads: list[int] | None = None) -> list[Comparison]:
    """Every backend of one replayed step against the reference, and against the captured output if any.

    The captured output itself is also compared with the reference (``captured`` vs ``reference``). A step
    whose query is FP8 (``step_replay.fp8_query_allowance`` set) widens by it the atol of every comparison with
    the engine's own kernels on one side: the captured output, and the ``vllm`` column (vLLM's code, given the
    FP8 query). kvdbg's own columns against the reference keep theirs: they do not take P·V on FP8 operands.
    """
    common = step_replay.common
    fp8 = meta.layer.is_fp8
    fp8_query = getattr(step_replay, "fp8_query_allowance", None)
    out = []
    ref = step_replay.runs.get("reference")
    expected_sets = []
    if ref is not None and ref.output is not None:
        expected_sets.append(("reference", ref.output))
    if step_replay.captured_output is not None:
        expected_sets.append(("captured", step_replay.captured_output))
    for expected_name, expected in expected_sets:
        for name, run in step_replay.runs.items():
            if name == "reference" or run.output is None or run.not_applicable is not None:
                continue
            dtype = run.info.dtype if run.info is not None else meta.layer.dtype
            engine_side = expected_name == "captured" or name == ENGINE_COLUMN
            tol = default_tolerance(dtype, fp8=fp8, fp8_query=fp8_query if engine_side else None, atol=atol,
                                    rtol=rtol)
            out.append(compare(run.output, expected, common.query_start_loc, common.seq_lens, tol,
                               requests=requests, heads=heads, actual_name=name, expected_name=expected_name,
                               step=step_replay.step, written=run.written))
        if expected_name == "reference" and step_replay.captured_output is not None:
            tol = default_tolerance(meta.layer.dtype, fp8=fp8, fp8_query=fp8_query, atol=atol, rtol=rtol)
            out.append(compare(step_replay.captured_output, expected, common.query_start_loc, common.seq_lens, tol,
                               requests=requests, heads=heads, actual_name="captured", expected_name="reference",
                               step=step_replay.step))
    return out


__all__ = ["Comparison", "DEFAULT_TOLERANCES", "FP8_P_RELATIVE", "FP8_P_SCALE", "FP8_P_UNDERFLOW", "HeadDiff",
           "Tolerance", "compare", "compare_step", "default_tolerance", "fp8_query_allowance"]
