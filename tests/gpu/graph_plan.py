"""What tests/gpu/graph_stage.py serves and how it compares, as plain logic that runs anywhere (no vLLM, no GPU).

- the workloads: requests that arrive at chosen engine steps, so that the batches are decode and mixed batches
  of the sizes the proof needs (3, 5, 6, 7 requests padded to 4 and 8; mixed batches padded up to 4, 8, 16);
- :func:`simulate`, a small model of vLLM's V1 scheduler for them (first come first served, running requests
  first, chunked prefill under one token budget): the batches each step should hold, so that a unit test can
  hold the workloads to what they are for without an engine (the stage compares it with what the engine ran);
- the steps wanted of capture, written in ``KVDBG_CAPTURE_STEPS``'s grammar;
- the comparison of a float tensor of two snapshots of one batch in units in the last place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Padded batch sizes vLLM records a full CUDA graph for, in this stage's engines.
CAPTURE_SIZES = (1, 2, 4, 8, 16)
# The engines' token budget per step and their most requests per step: every batch fits a graph.
MAX_NUM_BATCHED_TOKENS = 16
MAX_NUM_SEQS = 8


@dataclass(frozen=True)
class Arrival:
    """One request: added to the engine before engine step ``at`` (its name is its request id)."""

    name: str
    prompt_len: int
    max_tokens: int
    at: int
    seed: int


# The comparison workload (plain, sliding and FP8 engines, eager and graphs alike). Read with simulate():
# A's 30-token prompt takes steps 0-1 (16 + 14 tokens, B's first 2 tokens beside it), step 2 is a mixed batch of
# 3 tokens (padded to 4), D arrives into a batch of 3 decodes (5 tokens, padded to 8), E and F into 4 decodes
# (14 tokens, padded to 16), G's 20 tokens run in two chunks beside 6 decodes; then 7 decodes (padded to 8) until
# requests finish one by one: 6, 5 (padded to 8), 4, 3 (padded to 4), 2, 1. A reaches 56 tokens: past the
# sliding model's window (32) by more than a page (16), so its first page leaves the window.
# E's prompt is longer than 8 tokens on purpose: vLLM's Triton kernel then takes the same path (2D) eager as in the
# 16-token graph, so the two engines' numbers have no reason to part.
COMPARE_PLAN = (
    Arrival("A", 30, 26, 0, 11),
    Arrival("B", 3, 28, 0, 12),
    Arrival("C", 1, 30, 0, 13),
    Arrival("D", 2, 20, 5, 14),
    Arrival("E", 9, 14, 7, 15),
    Arrival("F", 1, 12, 7, 16),
    Arrival("G", 20, 10, 9, 17),
)
# Steps of the comparison workload (counted from the first served step) that capture is not asked for: one in
# each phase, so that an unwanted step replayed from a graph sits between wanted ones.
COMPARE_UNWANTED = (4, 13, 23, 30, 31)

# The graph-only fault's workload: one 16-token prefill of 7 requests, then decode batches of 7, 6, 5 requests
# (all padded to 8: the faulty graph), then 4, 3 (the 4-token graph), 2 and 1: the other graphs.
FAULT_PLAN = (
    Arrival("P", 4, 6, 0, 21),
    Arrival("Q", 3, 8, 0, 22),
    Arrival("R", 2, 10, 0, 23),
    Arrival("S", 2, 12, 0, 24),
    Arrival("T", 2, 14, 0, 25),
    Arrival("U", 2, 16, 0, 26),
    Arrival("V", 1, 18, 0, 27),
)
# The graph whose recording the fault wrapper gives a private, never refreshed seq_lens buffer.
FAULT_GRAPH_SIZE = 8
FAULT_UNWANTED = (5, 11)

PLANS = {"compare": (COMPARE_PLAN, COMPARE_UNWANTED), "fault": (FAULT_PLAN, FAULT_UNWANTED)}


@dataclass(frozen=True)
class Row:
    """One request of one step's batch: how many tokens it runs and its length after them."""

    name: str
    tokens: int
    seq_len: int
    decode: bool  # its prompt was complete before the step (it runs its last sampled token)


@dataclass
class _State:
    arrival: Arrival
    computed: int = 0
    generated: int = 0

    @property
    def known(self) -> int:
        return self.arrival.prompt_len + self.generated


@dataclass
class StepShape:
    rows: list[Row] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.tokens for r in self.rows)

    @property
    def kind(self) -> str:
        return step_kind(self.rows)


def step_kind(rows) -> str:
    """``decode`` (every request runs its last sampled token), ``prefill`` (none does) or ``mixed``."""
    decodes = sum(1 for r in rows if r.decode)
    return "decode" if decodes == len(rows) else "prefill" if decodes == 0 else "mixed"


def simulate(plan, budget: int = MAX_NUM_BATCHED_TOKENS, max_seqs: int = MAX_NUM_SEQS,
             limit: int = 1000) -> list[StepShape]:
    """The batches vLLM's V1 scheduler makes of ``plan`` (synchronous scheduling, chunked prefill, no prefix
    cache, greedy with ``ignore_eos``: the batches do not depend on the tokens sampled)."""
    arrivals = sorted(plan, key=lambda a: a.at)
    waiting: list[_State] = []
    running: list[_State] = []
    steps: list[StepShape] = []
    step = 0
    while arrivals or waiting or running:
        while arrivals and arrivals[0].at <= step:
            waiting.append(_State(arrivals.pop(0)))
        left = budget
        scheduled: list[tuple[_State, int]] = []
        for state in running:
            n = min(state.known - state.computed, left)
            if n > 0:
                scheduled.append((state, n))
                left -= n
        while waiting and left > 0 and len(running) < max_seqs:
            state = waiting.pop(0)
            n = min(state.known - state.computed, left)
            running.append(state)
            scheduled.append((state, n))
            left -= n
        shape = StepShape()
        for state, n in scheduled:
            decode = state.computed >= state.arrival.prompt_len
            state.computed += n
            shape.rows.append(Row(state.arrival.name, n, state.computed, decode))
            if state.computed == state.known:
                state.generated += 1
        running = [s for s in running if s.generated < s.arrival.max_tokens]
        if shape.rows:
            steps.append(shape)
        step += 1
        if step > limit:
            raise RuntimeError("the plan does not finish")
    return steps


def padded(num_tokens: int, sizes=CAPTURE_SIZES) -> int | None:
    """The graph size vLLM pads a batch of ``num_tokens`` to (None: larger than every graph, run eagerly)."""
    return next((s for s in sorted(sizes) if s >= num_tokens), None)


def wanted_steps(plan_name: str) -> list[int]:
    """The steps of a workload capture is asked for (counted from its first step)."""
    plan, unwanted = PLANS[plan_name]
    return [s for s in range(len(simulate(plan))) if s not in unwanted]


def ranges_text(numbers, offset: int = 0) -> str:
    """``numbers + offset`` in kvdbg's range grammar (``KVDBG_CAPTURE_STEPS``): ``3-5,8,10-12``."""
    values = sorted({n + offset for n in numbers})
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:
            prev = v
        else:
            parts.append(f"{start}-{prev}" if prev > start else str(start))
            start = prev = v
    if start is not None:
        parts.append(f"{start}-{prev}" if prev > start else str(start))
    return ",".join(parts)


def coverage(shapes) -> dict:
    """What a list of batches holds, as the proof asks: decode batches by request count and the graph they are
    padded to, mixed batches padded to a larger graph."""
    decode_sizes = sorted({len(s.rows) for s in shapes if s.kind == "decode"})
    padded_decodes = sorted({len(s.rows) for s in shapes if s.kind == "decode"
                             and padded(s.num_tokens) not in (None, s.num_tokens)})
    mixed_padded = [(s.num_tokens, padded(s.num_tokens)) for s in shapes
                    if s.kind == "mixed" and padded(s.num_tokens) not in (None, s.num_tokens)]
    return {"decode_sizes": decode_sizes, "padded_decode_sizes": padded_decodes,
            "mixed_padded": sorted(set(mixed_padded)), "mixed": sum(1 for s in shapes if s.kind == "mixed"),
            "steps": len(shapes)}


REQUIRED_PADDED_DECODES = (3, 5, 6, 7)


def coverage_gaps(shapes) -> list[str]:
    """What the proof needs that the batches lack (empty: none)."""
    cov = coverage(shapes)
    gaps = [f"no decode batch of {n} requests padded to a larger graph" for n in REQUIRED_PADDED_DECODES
            if n not in cov["padded_decode_sizes"]]
    if not cov["mixed_padded"]:
        gaps.append("no mixed batch padded to a larger graph")
    return gaps


def first_divergence(a, b) -> int | None:
    """The first index where two token lists differ (the shorter one's length when one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# --------------------------------------------------------------------------- floats in units in the last place

# (mantissa bits, smallest subnormal exponent) of the float formats a snapshot holds
_FORMATS = {"float16": (10, -24), "bfloat16": (7, -133), "float8_e4m3fn": (3, -9), "float32": (23, -149)}


def _format_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def ulp_of(x, dtype):
    """The spacing of ``dtype`` at ``|x|`` (float32 tensor in, float32 tensor out)."""
    import torch

    mantissa, tiny = _FORMATS[_format_name(dtype)]
    x = x.abs().clamp_min(2.0 ** (tiny + mantissa))
    return torch.exp2(torch.floor(torch.log2(x)) - mantissa)


@dataclass
class FloatComparison:
    """Two float tensors of one batch: the largest difference in units in the last place of the values (below
    ``floor``, at the floor: a near-zero value is judged at the tensor's scale), how many elements are equal."""

    elements: int = 0
    equal: int = 0
    max_ulps: float = 0.0
    max_abs: float = 0.0

    def add(self, other: "FloatComparison") -> None:
        self.elements += other.elements
        self.equal += other.equal
        self.max_ulps = max(self.max_ulps, other.max_ulps)
        self.max_abs = max(self.max_abs, other.max_abs)

    def to_json(self) -> dict:
        return {"elements": self.elements, "bit_equal": self.equal, "max_ulps": round(self.max_ulps, 2),
                "max_abs": self.max_abs}


# Values below the tensor's largest magnitude times this are judged at that scale.
ULP_FLOOR = 2.0 ** -8


def compare_floats(actual, expected, dtype=None) -> FloatComparison:
    """``actual`` against ``expected`` (same shape; FP8 may come as uint8 bytes: pass ``dtype``)."""
    import torch

    if dtype is None:
        dtype = expected.dtype
    if actual.dtype == torch.uint8:
        actual = actual.view(torch.float8_e4m3fn)
    if expected.dtype == torch.uint8:
        expected = expected.view(torch.float8_e4m3fn)
    if _format_name(dtype) == "uint8":
        dtype = torch.float8_e4m3fn
    a, e = actual.float().reshape(-1), expected.float().reshape(-1)
    result = FloatComparison(elements=int(e.numel()))
    if e.numel() == 0:
        return result
    same = (a == e) | (torch.isnan(a) & torch.isnan(e))
    result.equal = int(same.sum())
    if result.equal == result.elements:
        return result
    finite = torch.isfinite(a) & torch.isfinite(e)
    if not bool(finite[~same].all()):
        result.max_ulps = result.max_abs = float("inf")
        return result
    diff = (a - e).abs()
    scale = e[finite].abs().max() * ULP_FLOOR
    at = torch.maximum(torch.maximum(a.abs(), e.abs()), scale.expand_as(e))
    result.max_ulps = float((diff / ulp_of(at, dtype)).max())
    result.max_abs = float(diff.max())
    return result
