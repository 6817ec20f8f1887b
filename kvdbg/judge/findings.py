"""Every finding kvdbg reports: one record type and one registry of codes (no torch).

A *finding* is something a user must know about a snapshot or about how a
backend handles it: a kernel precondition broken, a key a mask must show that a
backend hides, NaN in a live page. Each has a code from :data:`CODES`, which
holds, once per condition: the code's name, its severity rule, a title, and
what it means, when it fires and what to do. Producers build findings with
registered codes only (:class:`Finding` refuses any other); renderers read the
severity order and styles here; ``kvdbg explain CODE`` and docs/findings.md
(``python -m kvdbg.judge.findings --markdown``) print the registry.

Severity: an *error* fails the command (exit 1); a *warning* (worth a look) and
an *info* note (a condition vLLM produces by design) never change the exit code.
A code's severity is fixed, or depends on a named context (whether the keys are
hidden, which backend cannot take the input); the producer names the context.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CODES", "Code", "Context", "Finding", "SEVERITIES", "SEVERITY_STYLES", "UnknownCode", "by_severity",
           "explain_command", "explain_hint", "lookup", "markdown", "severity_rank"]

SEVERITIES = ("error", "warning", "info")  # most severe first: the order every table lists findings in
SEVERITY_STYLES = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def severity_rank(severity: str) -> int:
    """0 for an error, 1 for a warning, 2 for a note (sort key, most severe first)."""
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)


def by_severity(findings: list) -> list:
    """``findings`` most severe first, keeping their order within a severity."""
    return sorted(findings, key=lambda f: severity_rank(f.severity))


@dataclass(frozen=True)
class Context:
    """One case of a code whose severity depends on context."""

    name: str  # what a producer passes as ``Finding(context=...)``
    severity: str
    when: str  # the case, in words


@dataclass(frozen=True)
class Code:
    """One condition: its name, its severity rule, and what to tell a user about it."""

    name: str
    topic: str  # paging, inputs, replay, observed, flex, flashinfer_ts, prims_ts
    title: str  # one line
    means: str  # what it means
    fires: str  # when it fires
    action: str  # what to do
    reported_by: str  # the commands that show it
    severity: str | None = None  # a fixed severity, or None when ``contexts`` decide
    contexts: tuple[Context, ...] = ()
    rule: str = ""  # prims_ts preconditions: the rule the wrapper checks ...
    source: str = ""  # ... and where (flashinfer-python's BatchDecodePagedTSWrapper validation)
    formerly: tuple[str, ...] = ()  # names earlier kvdbg releases gave this condition (explain still knows them)

    def severity_in(self, context: str | None) -> str:
        """The severity of this code in ``context`` (None for a code with one severity)."""
        if not self.contexts:
            if context is not None:
                raise ValueError(f"finding code {self.name!r} has one severity; got context {context!r}")
            return self.severity  # type: ignore[return-value]
        for case in self.contexts:
            if case.name == context:
                return case.severity
        raise ValueError(f"finding code {self.name!r} needs a context, one of "
                         f"{', '.join(c.name for c in self.contexts)}; got {context!r}")

    @property
    def severity_rule(self) -> str:
        """The severity rule in words: ``error`` or ``error when ...; info when ...``."""
        if not self.contexts:
            return self.severity  # type: ignore[return-value]
        return "; ".join(f"{c.severity} when {c.when}" for c in self.contexts)

    @property
    def severities(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.severity for c in self.contexts)) if self.contexts else (self.severity,)

    @property
    def explanation(self) -> str:
        """The one-paragraph explanation: what it means, when it fires, what to do."""
        return f"{self.means} {self.fires} {self.action}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.name, "topic": self.topic, "title": self.title,
                               "severity": self.severity_rule, "severities": list(self.severities),
                               "contexts": [{"name": c.name, "severity": c.severity, "when": c.when}
                                            for c in self.contexts],
                               "means": self.means, "fires": self.fires, "action": self.action,
                               "reported_by": self.reported_by}
        if self.rule:
            out["rule"], out["source"] = self.rule, self.source
        if self.formerly:
            out["formerly"] = list(self.formerly)
        return out


class UnknownCode(KeyError):
    """A code that is not registered; ``suggestion`` is the closest registered one, if any."""

    def __init__(self, name: str):
        import difflib  # only for this message: kvdbg window and info import the registry

        close = difflib.get_close_matches(name, list(CODES), n=1, cutoff=0.6)
        self.name, self.suggestion = name, (close[0] if close else None)
        super().__init__(name)

    def __str__(self) -> str:
        hint = f"; did you mean {self.suggestion}?" if self.suggestion else ""
        return f"unknown finding code {self.name!r}{hint} (kvdbg explain lists them all)"


def lookup(name: str, *, former: bool = False) -> Code:
    """The registered code ``name``; with ``former``, also a name an earlier release used for it."""
    if name in CODES:
        return CODES[name]
    if former and name in FORMER_NAMES:
        return CODES[FORMER_NAMES[name]]
    raise UnknownCode(name)


def explain_command(codes) -> str:
    """``kvdbg explain CODE``, naming the code when there is only one."""
    codes = sorted(set(codes))
    return f"kvdbg explain {codes[0]}" if len(codes) == 1 else "kvdbg explain CODE"


def explain_hint(codes) -> str:
    """The line under a findings table that points to ``kvdbg explain``."""
    command = explain_command(codes)
    return f"{command}: what {'it' if command != 'kvdbg explain CODE' else 'a code'} means and what to do"


@dataclass
class Finding:
    """One finding: a registered code, the numbers in one line, and where it was found.

    The severity comes from the code's rule (and ``context`` where the rule has
    several cases): a producer cannot give a code a severity of its own.
    """

    code: str
    message: str  # one line with the numbers
    backend: str = ""  # who found it: a backend, "replay" (the inputs a replay reads) or "map"
    step: int | None = None
    request: int | None = None  # None when it concerns several requests (``requests``) or none
    requests: list[int] = field(default_factory=list)  # every request involved
    pages: list[int] = field(default_factory=list)  # engine page ids involved
    details: dict[str, Any] = field(default_factory=dict)
    context: str | None = None  # picks the severity of a code whose severity depends on context
    severity: str = field(init=False)  # "error" fails the command (exit 1); "warning" and "info" do not

    def __post_init__(self) -> None:
        self.severity = lookup(self.code).severity_in(self.context)
        if self.request is not None and not self.requests:
            self.requests = [self.request]

    def to_json(self) -> dict[str, Any]:
        """The finding as JSON: the same keys wherever it appears (a backend's traceback is left out)."""
        return {"backend": self.backend, "code": self.code, "severity": self.severity, "step": self.step,
                "request": self.request, "requests": list(self.requests), "pages": list(self.pages),
                "message": self.message, "details": {k: v for k, v in self.details.items() if k != "traceback"}}


# --------------------------------------------------------------------------- the registry

_HIDES = (Context("hides_keys", "error", "some query token's mask shows a key in the blocks FLEX_ATTENTION masks"),
          Context("before_window", "info",
                  "every key of those blocks lies before the first key any query token sees (the sliding window)"))
_PRIMS_TS = "FLASHINFER_TS runs prims_ts with validate=False, so nothing checks this at run time:"
_REPORTED_TS = "replay (flashinfer_ts), window, report"


def _precondition(name: str, title: str, rule: str, source: str, fires: str, action: str,
                  reported_by: str = _REPORTED_TS) -> Code:
    """A prims_ts BatchDecodePagedTSWrapper precondition: an error wherever kvdbg finds it broken."""
    if source.startswith("plan"):
        means = (f"The layer breaks a precondition of FlashInfer's prims_ts decode kernel ({rule}): "
                 f"flashinfer-python's {source} refuses the plan, so FLASHINFER_TS cannot run this layer. "
                 "kvdbg's flashinfer_ts column is unavailable, and this finding is its error: a snapshot "
                 "captured from FLASHINFER_TS fails, whatever its output (`kvdbg window` checks the rules it "
                 "can see).")
    else:
        means = (f"The batch breaks a precondition of FlashInfer's prims_ts decode kernel ({rule}). {_PRIMS_TS} "
                 f"the real kernel's output is undefined (flashinfer-python's {source} refuses the input when "
                 "validate=True). kvdbg leaves the tokens concerned unwritten, so they never pass.")
    return Code(name, "prims_ts", title, means, fires, action, reported_by, severity="error", rule=rule,
                source=source)


_PLAN_ACTION = ("FLASHINFER_TS cannot serve this layer as configured: vLLM should not pick it. Use another "
                "attention backend for the layer, or change the model configuration the rule names.")
_PLAN_REPORTED = "replay (why flashinfer_ts is unavailable), window"
_VIEW_ACTION = ("The K/V cache views handed to the kernel are not ones its TMA descriptors can describe; check the "
                "cache layout the engine allocated (`kvdbg info SNAP` shows kv_layout and the tensors).")

_ALL = [
    # ---------------------------------------------------------------- paging (map, flex)
    Code("live_page_zero", "paging", "a live block-table entry holds engine page 0, vLLM's null block",
         means=("A block-table entry the request's seq_len reaches holds engine page 0, which vLLM reserves as the "
                "null block. FLEX_ATTENTION's physical->logical map resets page 0 to 'no block', so every key of "
                "those logical blocks is masked."),
         fires=("It is an error when some query token's mask must see one of those keys: a real page was replaced "
                "by the null block, and flex silently drops keys. It is a note when all of them lie before the "
                "sliding window: vLLM's sliding-window manager puts the null block in entries that left the "
                "window, by design."),
         action=("For an error, find who wrote the entry: `kvdbg map SNAP --step S --request R` shows the table; "
                 "suspect the block allocator, a prefix-cache hit that returned a freed block, or a capture taken "
                 "before the table was filled. A note needs nothing."),
         reported_by="map, info --check, replay (flex), report", contexts=_HIDES,
         formerly=("null_page_masked", "null_block_outside_window")),
    Code("page_mapped_twice", "paging", "one physical page sits at several logical blocks of one request",
         means=("One engine page is listed at two or more live logical blocks of the same request. "
                "FLEX_ATTENTION's physical->logical map keeps one logical block per physical page (the last), so "
                "the keys of the other blocks are masked."),
         fires=("It is an error when some query token's mask must see a key of a masked block. It is a note when "
                "the masked blocks all lie before the sliding window: the page left the window, was freed and "
                "handed out again, which vLLM's block pool does by design."),
         action=("For an error, the block table aliases one page: look for a double free or a block handed out "
                 "twice (`kvdbg map SNAP --request R` shows both positions). A note needs nothing."),
         reported_by="map, info --check, replay (flex), report", contexts=_HIDES,
         formerly=("page_reused_outside_window",)),
    Code("stale_tail_aliases_live", "paging", "stale block-table entries repeat a live page of the request",
         means=("Entries past the request's live pages (past cdiv(seq_len, page_size)) are not zero and repeat "
                "one of its live pages. Current vLLM ignores entries past the live ones; a consumer that maps the "
                "whole row (as FLEX_ATTENTION once did) gives the live page the stale entry's logical index."),
         fires="It fires for each request whose stale tail holds a page it also reads live.",
         action=("Nothing is wrong with current vLLM. If a kernel of your own reads the whole block-table row, "
                 "clip it at cdiv(seq_len, page_size) or zero the tail."),
         reported_by="map, report", severity="warning"),
    Code("stale_tail", "paging", "stale non-zero block-table entries past the live pages",
         means=("Entries past the request's live pages hold old page ids: the engine leaves them when a request "
                "shrinks or a row is reused. Current vLLM ignores them."),
         fires="It fires for each request with a non-zero entry past cdiv(seq_len, page_size).",
         action="Nothing to do; `kvdbg poison SNAP` shows whether a backend reads them anyway (region stale_tail).",
         reported_by="map, report", severity="info"),
    Code("shared_pages", "paging", "pages shared by several requests (prefix sharing)",
         means="The same engine pages are live in several requests' tables: vLLM's prefix caching shares them.",
         fires="It fires once per group of requests sharing pages (the null block is left out).",
         action=("Nothing to do. If one of the requests fails, check that the shared pages' keys are right for "
                 "every request (`kvdbg replay --request R`)."),
         reported_by="map, report", severity="info"),
    Code("unreferenced_pages", "paging", "stored pages no live table entry of the step references",
         means=("The snapshot stores pages that no live block-table entry of this step reads: pages of an earlier "
                "or later step, or pages the capture kept for context."),
         fires="It fires once per step that leaves some stored page unreferenced.",
         action="Nothing to do; a backend that reads them misbehaves, which `kvdbg poison SNAP` shows.",
         reported_by="map, report", severity="info"),
    # ---------------------------------------------------------------- the inputs' values
    Code("nonfinite_kv", "inputs", "a live page holds NaN or Inf in K or V",
         means=("A page some query token reads holds NaN or Inf in its keys or values. Kernels load whole pages "
                "and 0 x NaN is NaN, so any attention over the page yields NaN, even for a masked slot."),
         fires=("It fires for each request with such a page among the pages its masks reach (pages wholly before "
                "a sliding window are left out), checked on the cache as the step reads it."),
         action=("Find what wrote the page: an overflow in the previous layer, an FP8 scale of zero, or a kernel "
                 "writing outside its slots. `kvdbg map SNAP` lists the pages; `kvdbg poison SNAP` shows whether "
                 "a backend reads slots it must not."),
         reported_by="map, info --check, replay, report", severity="error"),
    Code("zero_page", "inputs", "a live page is all zeros over the request's tokens",
         means=("Every key and value of a live page is zero over the tokens the request's length reaches: the page "
                "was never written, or was wiped."),
         fires="It fires for each request with such a page its masks reach.",
         action=("Check the cache update of the step that should have written it (slot_mapping), and whether a "
                 "freed block was reused before it was filled. A true all-zero K/V is rare but possible."),
         reported_by="map, info --check, replay, report", severity="warning"),
    # ---------------------------------------------------------------- replay
    Code("backend_raised", "replay", "a backend raised while replaying a step",
         means="A backend raised an exception while building its metadata or running; nothing of it is compared.",
         fires="It fires once per backend and step that raised (the reference raising stops the replay instead).",
         action=("Read the message; run `kvdbg replay SNAP --backend NAME` to replay it alone. A missing optional "
                 "package or an unsupported device is the usual cause; otherwise it is a bug worth reporting with "
                 "`kvdbg report`."),
         reported_by="replay, report", severity="error"),
    Code("two_flashinfers", "replay", "FlashInfer's real paged kernel beside the FLASHINFER_TS emulation",
         means=("The vllm column ran vLLM's FLASHINFER backend, whose FlashInfer wrappers run FlashInfer's paged "
                "decode/prefill kernels, and the flashinfer_ts column ran kvdbg's emulation of FlashInfer's prims_ts "
                "kernel (FLASHINFER_TS, which needs a Blackwell GPU): two different kernels computing the same "
                "attention. Their difference is two kernels' rounding, not a finding: each is held to the exact "
                "reference on its own. The emulation claims prims_ts's contract (its preconditions, the rows it "
                "writes, its window and page rules), not the paged kernels' arithmetic nor prims_ts's own."),
         fires="It fires once per step where both columns wrote the same decode requests' outputs.",
         action=("Nothing to do. A column that fails the reference fails on its own line; a snapshot from a "
                 "Blackwell engine on FLASHINFER_TS is the place to hold the real prims_ts kernel."),
         reported_by="replay, report", severity="info"),
    # ---------------------------------------------------------------- flex
    Code("fp8_dequantised", "flex", "FP8 KV cache replayed on dequantised values",
         means=("vLLM's FLEX_ATTENTION refuses quantized KV caches; kvdbg dequantises query, K and V with the "
                "captured scales and runs flex on that, so the flex column shows what flex would compute, not "
                "what vLLM runs."),
         fires="It fires on every step of an FP8 snapshot that flex replays.",
         action="Read the flex column as a what-if; judge the engine by its own backend's column.",
         reported_by="replay (flex), report", severity="warning"),
    # ---------------------------------------------------------------- what attention and poison observe
    Code("weights_outside_mask", "observed", "a backend weights keys its mask must hide",
         means=("The keys a backend attends to for one query token, as its own rules give them, include keys the "
                "exact mask hides, beyond what the backend documents (FLASHINFER_TS's page-aligned window "
                "restriction is documented: window_restriction_extra_keys)."),
         fires="It fires in `kvdbg attention` for each column that gives such keys a weight.",
         action="`kvdbg attention SNAP --json` lists the keys and their weight; `kvdbg map SNAP` shows the pages.",
         reported_by="attention", severity="error"),
    Code("skips_mask_keys", "observed", "a backend skips keys its mask must show",
         means="A backend never attends to keys the exact mask shows one query token: their weight is lost.",
         fires="It fires in `kvdbg attention` for each column that skips such keys.",
         action=("`kvdbg attention SNAP --json` lists the keys and the reference's weight on them; a null block or "
                 "a page mapped twice is the usual cause (`kvdbg map SNAP`)."),
         reported_by="attention", severity="error"),
    Code("reads_nonfinite", "observed", "a backend's weights read NaN/Inf",
         means="A key a column attends to holds NaN/Inf in K or V, or the query token itself does: its output is NaN.",
         fires="It fires in `kvdbg attention` for each column that reads such a key, and once for a NaN query.",
         action="Find who wrote the values (`kvdbg map SNAP` checks live pages; `kvdbg poison SNAP` who reads them).",
         reported_by="attention", severity="error"),
    Code("weights_miss_output", "observed", "a backend's weights do not reproduce its output",
         means=("The weights kvdbg derives from a column's rules, applied to the values (Σ w·v), do not give the "
                "output the backend produced, within the replay's tolerance: it attends to other keys than its "
                "rules say."),
         fires="It fires in `kvdbg attention` for each column whose output differs from its Σ w·v.",
         action="`kvdbg replay SNAP --builder` shows what the backend was handed.",
         reported_by="attention", severity="error"),
    Code("reads_poisoned_slot", "observed", "a backend weights a cache slot it must not read",
         means=("With NaN written into slots no request may see (and the backend's documented extra keys left "
                "out), an output of the backend turns NaN: it gives such a slot a weight."),
         fires="It fires in `kvdbg poison` for each backend and region it reads.",
         action="The table names the slots (page, token, request key); `kvdbg attention` shows one token's weights.",
         reported_by="poison", severity="error"),
    # ---------------------------------------------------------------- FLASHINFER_TS builder
    Code("buffer_overflow", "flashinfer_ts", "more requests than FLASHINFER_TS's persistent metadata buffers hold",
         means=("FLASHINFER_TS sizes its metadata buffers once, from max_num_seqs and max_num_batched_tokens. A "
                "batch with more requests than rows makes vLLM's builder fail: no token is computed."),
         fires="It fires when the step's request count exceeds the buffer rows the snapshot's engine config gives.",
         action=("Check max_num_seqs and max_num_batched_tokens in the engine config the snapshot records "
                 "(`kvdbg info SNAP`); a scheduler that exceeds them is the bug."),
         reported_by="replay (flashinfer_ts), report", severity="error"),
    Code("noop_batch", "flashinfer_ts", "a batch FLASHINFER_TS plans as a no-op: no token is computed",
         means=("The query length per request exceeds max_decode_query_len (or rounds down to zero), so "
                "FLASHINFER_TS's builder treats the batch as one it never runs and writes no output."),
         fires=("It fires on such a step when the engine's own backend is FLASHINFER_TS and it produced an output "
                "(otherwise the step is 'not applicable'), and in `kvdbg window` when --query-len exceeds "
                "--max-decode-query-len."),
         action=("The engine ran a prefill-shaped batch through a decode-only backend: check the engine's "
                 "speculative-decoding settings (num_speculative_tokens) against max_decode_query_len."),
         reported_by="replay (flashinfer_ts), window, report", severity="error"),
    Code("non_uniform_query_blocks", "flashinfer_ts", "query lengths differ, so requests get other requests' tokens",
         means=("The kernel views the flat query as num_reqs blocks of one query length. With unequal query "
                "lengths, the blocks straddle requests: some requests are computed on another request's tokens."),
         fires="It fires when a request's query tokens are not exactly block r of the uniform split.",
         action=("FLASHINFER_TS runs uniform draft blocks only; a mixed batch reaching it is a scheduling bug "
                 "(`kvdbg replay --builder` shows the split)."),
         reported_by="replay (flashinfer_ts), report", severity="error"),
    Code("ragged_leftover_tokens", "flashinfer_ts", "tokens past the uniform query blocks are never written",
         means=("The step's tokens do not divide into num_reqs blocks of the query length; the builder rounds down "
                "and the tokens past the last block get no output."),
         fires="It fires when num_tokens is larger than num_reqs x query_len.",
         action="As for non_uniform_query_blocks: the batch is not one FLASHINFER_TS can run.",
         reported_by="replay (flashinfer_ts), report", severity="error"),
    Code("inactive_request", "flashinfer_ts", "seq_len <= 0 marks a request the kernel leaves untouched",
         means=("From flashinfer 0.7.4 on, a request with seq_len <= 0 is inactive: the kernel leaves its output "
                "as it was, so none of its tokens is computed."),
         fires="It fires for each such request under the 0.7.4+ API (older releases make it seq_len_not_positive).",
         action=("Harmless for a padding row; for a real request, its length was lost before the kernel: check "
                 "the seq_lens the engine handed the builder."),
         reported_by="replay (flashinfer_ts), report", severity="warning"),
    Code("window_restriction_extra_keys", "flashinfer_ts", "the page-aligned window restriction shows keys outside "
         "the exact window",
         means=("For a dense (non-causal) mask with a sliding window, FLASHINFER_TS drops whole pages before the "
                "window and hands the kernel one shared start: query tokens then see keys that their exact window "
                "|p - k| < W excludes, up to a page's worth."),
         fires="It fires for each request where some query token sees at least one key outside its exact window.",
         action=("Documented FLASHINFER_TS behaviour (vLLM's backend states both consequences of the page-aligned "
                 "restriction), so never a failure by itself: it fails only through the output comparison, when "
                 "those keys move the output beyond tolerance. `kvdbg window SNAP --request R` draws which keys "
                 "each token sees; `kvdbg attention` states their share of the weight."),
         reported_by="replay (flashinfer_ts), report, map, window, attention, poison", severity="warning"),
    Code("tokens_missed", "flashinfer_ts", "the kernel misses keys of the exact windows",
         means=("With the builder's restricted table and lengths, some keys that a query token's exact window "
                "holds are never handed to the kernel."),
         fires="It fires in `kvdbg window` when any query token misses a key of its exact window.",
         action="Check the window, page size and max_model_len against the builder's table width (`kvdbg window`).",
         reported_by="window", severity="error"),
    Code("q_rank_sq1_unverified", "flashinfer_ts", "query length 1 is passed in a shape the wrapper would reject",
         means=("For a query length of 1, FLASHINFER_TS passes q and out as [B, 1, Hq, D] with validate=False, "
                "where the wrapper's checks expect [B, Hq, D]. The memory layout is the same; whether the kernel "
                "reads it right has not been verified on a GPU."),
         fires="It fires on every FLASHINFER_TS step with one query token per request.",
         action="Nothing to do unless the real kernel's output disagrees with the reference on such steps.",
         reported_by="replay (flashinfer_ts), report", severity="info"),
    Code("page_size_unsupported", "flashinfer_ts", "the page size is not one the engine's backend accepts",
         means=("FLASHINFER_TS's prims_ts kernel takes page sizes 4, 8, 16, 32, 64 and 128 only; vLLM's "
                "FLEX_ATTENTION needs a page size that is a multiple of 16."),
         fires=("It fires when the snapshot's page size breaks the rule of the backend named in the finding."),
         action=("prims_ts: the real kernel refuses the plan, and kvdbg's emulation of it is not the engine's "
                 "answer; configure a supported block_size. flex: torch flex runs the size anyway, but vLLM "
                 "would not: read the column as a what-if."),
         reported_by="replay (flashinfer_ts, flex), window, report",
         contexts=(Context("flashinfer_ts", "error", "prims_ts would refuse it (FLASHINFER_TS)"),
                   Context("flex", "warning", "vLLM's FLEX_ATTENTION would refuse it; kvdbg replays it anyway")),
         rule="page_size in 4..128 (powers of two)", source="plan: _validate_page_size"),
    # ---------------------------------------------------------------- prims_ts preconditions
    _precondition("head_dim_unsupported", "head_dim is not one prims_ts supports", "head_dim is a supported size",
                  "plan: _validate_head_dim", "It fires when the layer's head_size is not among the release's sizes.",
                  _PLAN_ACTION, _PLAN_REPORTED),
    _precondition("heads_not_divisible", "query heads are not a multiple of KV heads", "Hq is a multiple of Hkv",
                  "plan: _validate_head_geometry", "It fires when num_heads % num_kv_heads != 0.", _PLAN_ACTION,
                  _PLAN_REPORTED),
    _precondition("head_ratio_unsupported", "too many query heads per KV head", "1 <= Hq/Hkv <= 128",
                  "plan: _validate_head_geometry", "It fires when num_heads / num_kv_heads exceeds 128.",
                  _PLAN_ACTION, _PLAN_REPORTED),
    _precondition("q_dtype_unsupported", "the query dtype is not fp16, bf16 or fp8 e4m3",
                  "q dtype fp16, bf16 or fp8 e4m3", "plan: _validate_dtype_pair",
                  "It fires when the query dtype is any other.", _PLAN_ACTION, _PLAN_REPORTED),
    _precondition("kv_dtype_unsupported", "the KV cache dtype is not fp16, bf16 or fp8 e4m3",
                  "kv dtype fp16, bf16 or fp8 e4m3", "plan: _validate_dtype_pair",
                  "It fires when the KV cache dtype is any other.", _PLAN_ACTION, _PLAN_REPORTED),
    _precondition("dtype_mismatch", "query and KV dtypes differ", "q and kv dtypes form a supported pair",
                  "plan: _validate_dtype_pair", "It fires when the query and KV dtypes are not equal.",
                  _PLAN_ACTION, _PLAN_REPORTED),
    _precondition("mask_type_unknown", "mask_type is neither dense nor causal", "mask_type dense or causal",
                  "plan: _validate_mask", "It fires when the plan's mask type is any other.",
                  "A builder bug: FLASHINFER_TS derives the mask type from the layer's causal flag.",
                  _PLAN_REPORTED),
    _precondition("window_left_invalid", "window_left below -1", "window_left -1 or >= 0",
                  "plan: _validate_window_left", "It fires when the plan's window_left is below -1.",
                  "Check the layer's sliding_window: it must be positive or absent.", _PLAN_REPORTED),
    _precondition("window_needs_causal", "a window_left with a dense mask", "window_left >= 0 only with mask_type "
                  "causal", "plan: _validate_window_left",
                  "It fires when the plan has window_left >= 0 and mask_type dense.",
                  "A builder bug: for a dense mask FLASHINFER_TS restricts the table instead of passing a window.",
                  _PLAN_REPORTED),
    _precondition("seq_len_not_positive", "seq_len is not positive", "seq_len >= 1",
                  "run: _validate_decode_run_metadata_values",
                  "It fires for each request with seq_len <= 0 under the 0.7.1-0.7.2 API.",
                  "Check the seq_lens the engine handed the builder; padding rows need a length of at least 1 "
                  "there."),
    _precondition("seq_len_over_max_kv_len", "seq_len exceeds the plan's max_kv_len",
                  "seq_len <= the plan's max_kv_len", "run: _validate_decode_run_metadata_values",
                  "It fires for each request whose (restricted) seq_len is longer than the max_kv_len the builder "
                  "planned for.",
                  "The builder sized the plan for a shorter context than the request has: compare max_model_len "
                  "and the window with the request's length (`kvdbg window SNAP --request R`)."),
    _precondition("seq_len_below_query_len", "a causal request has fewer keys than query tokens",
                  "causal: query_len <= seq_len", "run: _validate_decode_run_metadata_values",
                  "It fires for each request of a causal batch whose seq_len is shorter than its query tokens.",
                  "The lengths are inconsistent: seq_len must count the step's own query tokens."),
    _precondition("table_too_narrow", "the block table has fewer columns than the request's pages",
                  "block table has cdiv(seq_len, page_size) columns", "run: _validate_decode_run_metadata_values",
                  "It fires for each request needing more pages than the table the builder hands the kernel has.",
                  "The builder's table width (from the window and max_model_len) is too small for the request: "
                  "`kvdbg window SNAP --request R` shows the widths."),
    _precondition("page_outside_cache", "a live block-table entry points outside the cache",
                  "live page ids index the cache", "run: _validate_decode_run_metadata_values",
                  "It fires for each request with a live entry that is negative, not stored in the snapshot, or "
                  "past the stored pages.",
                  "A page id the cache does not have: check the block table (`kvdbg map SNAP --request R`) and "
                  "whether the capture stored every live page."),
    _precondition("kv_view_shape", "K and V views are not rank-4 HND views of one shape",
                  "K and V are rank-4 HND views of one logical shape", "run: _normalize_paged_kv_cache_views",
                  "It fires when the K or V view is not [pages, Hkv, page_size, head_dim], or the two differ.",
                  _VIEW_ACTION),
    _precondition("kv_head_dim_not_contiguous", "the K/V head dimension is not contiguous",
                  "K/V head-dimension stride 1", "run: _validate_native_hnd_tma_strides",
                  "It fires when a view's last stride is not 1.", _VIEW_ACTION),
    _precondition("kv_stride_not_positive", "a K/V page, head or token stride is not positive",
                  "K/V page, head and token strides positive", "run: _validate_native_hnd_tma_strides",
                  "It fires when a view has a zero or negative stride.", _VIEW_ACTION),
    _precondition("kv_stride_misaligned", "a K/V stride is not a 16-byte multiple",
                  "K/V page, head and token strides 16-byte aligned", "run: _validate_native_hnd_tma_strides",
                  "It fires when a page, head or token stride in bytes is not a multiple of 16.", _VIEW_ACTION),
    _precondition("kv_base_misaligned", "the K/V base address is not 16-byte aligned",
                  "K/V base address 16-byte aligned", "run: _validate_native_hnd_tma_strides",
                  "It fires when a view starts off a 16-byte boundary.", _VIEW_ACTION),
    _precondition("kv_dims_overlap", "K/V view dimensions overlap", "K/V dimensions do not overlap",
                  "run: _validate_native_hnd_tma_strides",
                  "It fires when, from the smallest stride up, a dimension's stride does not reach past what the "
                  "smaller ones span.", _VIEW_ACTION),
]

CODES: dict[str, Code] = {c.name: c for c in _ALL}
FORMER_NAMES: dict[str, str] = {old: c.name for c in _ALL for old in c.formerly}
assert len(CODES) == len(_ALL), "a finding code is registered twice"
assert not set(FORMER_NAMES) & set(CODES), "a former name is a code again"
TOPICS = ("paging", "inputs", "replay", "observed", "flex", "flashinfer_ts", "prims_ts")


# --------------------------------------------------------------------------- docs/findings.md


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    """docs/findings.md: every code, generated from the registry (``python -m kvdbg.judge.findings --markdown``)."""
    lines = ["# Finding codes", "",
             "<!-- Generated by `python -m kvdbg.judge.findings --markdown > docs/findings.md`; do not edit. -->", "",
             "Every finding kvdbg reports has one of these codes. An **error** fails the command (exit 1); a "
             "**warning** or an **info** note never changes the exit code. Where a severity depends on the case, "
             "the rule says which. `kvdbg explain CODE` prints one entry; `kvdbg explain` lists them all.", "",
             "| code | severity | what |", "| --- | --- | --- |"]
    ordered = sorted(_ALL, key=lambda c: (TOPICS.index(c.topic), c.name))
    for c in ordered:
        lines.append(f"| [`{c.name}`](#{c.name}) | {' / '.join(c.severities)} | {_md(c.title)} |")
    for c in ordered:
        lines += ["", f"## {c.name}", "", f"**{c.title[0].upper()}{c.title[1:]}.** Severity: {c.severity_rule}. "
                  f"Reported by: {c.reported_by}.", ""]
        if c.rule:
            lines += [f"Kernel rule: {c.rule} (flashinfer-python, {c.source}).", ""]
        if c.formerly:
            lines += [f"Formerly reported as {', '.join(f'`{n}`' for n in c.formerly)}.", ""]
        lines += [f"- **What it means.** {c.means}", f"- **When it fires.** {c.fires}",
                  f"- **What to do.** {c.action}"]
    return "\n".join(lines) + "\n"


def _main(argv: list[str]) -> int:
    if argv != ["--markdown"]:
        print("usage: python -m kvdbg.judge.findings --markdown > docs/findings.md", file=sys.stderr)
        return 2
    sys.stdout.write(markdown())
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
