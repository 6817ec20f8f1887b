"""The backend instance: builder and impl for one layer, what ran, findings (every broken precondition), explain."""

from __future__ import annotations

from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.backends.base import CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.snapshot.layout import split_kv
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.ts.window import cdiv, restrict_to_window, ts_batch_not_run, ts_mask_type, ts_window_left, visibility_table
from kvdbg.ts.contract import PRECONDITIONS, check_request, request_inactive
from kvdbg.backends.flashinfer_ts.gate import KernelGate, kernel_gate
from kvdbg.backends.flashinfer_ts.builder import (
    FlashInferTSBuilder,
    FlashInferTSMetadata,
    _dtype_name,
    _plan_violations,
    ts_output_dtype,
)
from kvdbg.backends.flashinfer_ts.impl import FP8_P_CAVEAT, FlashInferTSImpl, undefined_requests, view_violations

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

NAME = "flashinfer_ts"
ENGINE_NAME = "FLASHINFER_TS"
EMULATED_KERNEL = "prims_ts contract, emulated in torch"
EMULATED_KERNEL_TRITON = "prims_ts contract, emulated in Triton"

# For query length 1 the wrapper documents q and out as [B, Hq, D] (_validate_q, _validate_out: rank 3),
# while FLASHINFER_TS always passes [B, SQ, Hq, D]; only validate=False lets that through.
SQ1_RANK_NOTE = ("query length 1: FLASHINFER_TS passes q and out as [B, 1, Hq, D] with validate=False, where "
                 "the wrapper's _validate_q/_validate_out expect [B, Hq, D] for a length-1 query; the memory "
                 "layout is the same, but whether the kernel reads it right is unverified (no Blackwell GPU "
                 "has run it for kvdbg)")


# --------------------------------------------------------------------------- the backend instance


class FlashInferTSInstance:
    def __init__(self, meta: "SnapshotMeta", options: ReplayOptions, gate: KernelGate | None = None):
        self.meta = meta
        self.options = options
        gate = gate or kernel_gate(options.device, force_emulation=options.force_emulation)
        layer = meta.layer
        self.gate = gate
        self.output_dtype = getattr(torch, layer.dtype)
        self.builder = FlashInferTSBuilder(meta, options.device, gate)
        self.impl = FlashInferTSImpl(meta, self.builder)

    def reset(self) -> None:
        """Before a replay of another snapshot of the same layer, as vLLM's next step: the builder keeps its
        plans (a plan depends only on its key and the layer) and its persistent buffers (each build rewrites
        the rows it hands over; build ids keep counting, pairing each build with its forward); the impl forgets.
        """
        self.impl.reset()

    # ------------------------------------------------------------------ what ran

    def describe(self) -> RunInfo:
        layer = self.meta.layer
        plan_out = ts_output_dtype(self.builder.q_dtype, self.output_dtype)
        dtype = layer.dtype if plan_out == self.output_dtype else \
            f"{layer.dtype} (kernel writes {_dtype_name(plan_out)}, converted)"
        notes = []
        if not self.builder.rows_known:
            notes.append("the snapshot does not record max_num_seqs / max_num_batched_tokens: metadata buffers "
                         "are sized to the largest batch, so buffer overflow cannot be checked")
        if layer.is_fp8:
            notes.append(f"FP8: bmm1_scale = scale*q_scale*k_scale = {self.impl.bmm1_scale:.6g}, bmm2_scale = "
                         f"v_scale = {self.impl.bmm2_scale:.6g}; a model-dtype query is quantised with q_scale "
                         "first, as vLLM's layer does")
        if self.gate.available:
            cap = self.gate.capability
            return RunInfo(backend=NAME, kernel=f"prims_ts BatchDecodePagedTSWrapper on sm{cap[0]}{cap[1]}",
                           device=self.options.device, dtype=dtype, emulated=False,
                           notes=[f"{self.gate.path}, run(validate=False)"] + notes)
        notes = [f"real kernel not run: {self.gate.reason}",
                 "emulated: the same builder output (restricted table, lengths, plan), then attention by the "
                 "kernel's documented contract in fp32; requests whose inputs break a precondition are left "
                 "unwritten (undefined on the real kernel, see findings)",
                 f"contract: {self.gate.path}"] + notes
        if layer.is_fp8:
            notes.append(f"FP8 emulation: {FP8_P_CAVEAT}")
            for text in dict.fromkeys(p.describe() for p in self.builder.fp8_profiles.values()):
                notes.append(f"FP8 plan: flashinfer 0.7.4's planner picks the {text}")
        if getattr(self.impl, "emulator_note", None):
            notes.append(self.impl.emulator_note)
        kernel = EMULATED_KERNEL_TRITON if getattr(self.impl, "emulator", "torch") == "triton" else EMULATED_KERNEL
        return RunInfo(backend=NAME, kernel=kernel, device=self.options.device, dtype=dtype,
                       emulated=True, notes=notes)

    # ------------------------------------------------------------------ findings

    def _finding(self, common: CommonMetadata, code: str, message: str, request: int | None = None,
                 details: dict | None = None) -> Finding:
        return Finding(backend=NAME, code=code, message=message, step=common.step, request=request,
                       details=details or {})

    def _from_violations(self, common: CommonMetadata, violations: list[Finding]) -> list[Finding]:
        return [replace(v, step=common.step) for v in violations]

    def not_applicable(self, common: CommonMetadata, md: FlashInferTSMetadata) -> str | None:
        """Why this step is not a batch FLASHINFER_TS runs, or None.

        The backend runs uniform draft blocks only: every request brings the same
        number of query tokens, at most max_decode_query_len. vLLM's model runner
        also builds its metadata for the target's prefill and mixed batches, and
        never runs them (the builder plans a no-op). Such a step says nothing about
        FLASHINFER_TS -- unless the engine's own backend is FLASHINFER_TS and the
        snapshot holds the output it produced: then the engine did run this batch
        and its output depended on it, and the findings say what went wrong.
        """
        if self.meta.backend.name == ENGINE_NAME and common.has_engine_output:
            return None
        if md.overflow is not None:
            return None
        return ts_batch_not_run(common.query_lens.to("cpu").tolist(), self.builder.query_len)

    def written_tokens(self, common: CommonMetadata, md: FlashInferTSMetadata) -> "torch.Tensor":
        """[num_tokens] bool: the tokens whose output this backend produced (emulated or real).

        Tokens past the uniform blocks, requests whose inputs break a kernel
        precondition, and every token of a batch the kernel cannot take (no-op,
        buffer overflow, K/V views it cannot describe) are not written: the real
        kernel's output there is undefined, so nothing there is compared as a pass.
        """
        written = torch.zeros(common.num_actual_tokens, dtype=torch.bool)
        if md.overflow is not None or md.query_len == 0:
            return written
        views = self.impl.last_views or self._static_views()
        if view_violations(*views[:2], self.meta.layer.head_size, views[2]):
            return written
        # The same scan the CUDA kernel runs for itself, here on a host copy of the handed lengths and table:
        # two copies instead of ~15 small device launches and a read-back.
        on_host = replace(md, seq_lens=md.seq_lens.cpu(), block_table=md.block_table.cpu())
        undefined = undefined_requests(on_host, common.num_pages, self.builder.page_size, self.gate.contract)
        q = md.query_len
        for r in range(md.num_reqs):
            if r not in undefined:
                written[r * q:(r + 1) * q] = True
        return written

    def findings(self, common: CommonMetadata, md: FlashInferTSMetadata) -> list[Finding]:
        """Every kernel precondition this step's builder output breaks, with the numbers."""
        found: list[Finding] = []
        if self.not_applicable(common, md) is not None:
            return found
        if md.overflow is not None:
            return [self._finding(common, "buffer_overflow", md.overflow,
                                  details={"num_reqs": md.num_reqs, "buffer_rows": md.buffer_rows})]
        if md.noop_reason is not None:
            found.append(self._finding(
                common, "noop_batch", f"no token written: {md.noop_reason}",
                details={"num_tokens": md.num_tokens, "num_reqs": md.num_reqs,
                         "query_len": md.quotient_query_len, "max_decode_query_len": self.builder.query_len}))
            return found
        if md.query_len == 0:
            return found
        found += self._query_block_findings(common, md)
        if md.query_len == 1:
            found.append(self._finding(common, "q_rank_sq1_unverified", SQ1_RANK_NOTE,
                                       details={"q_shape": [md.num_reqs, 1, self.meta.layer.num_heads,
                                                            self.meta.layer.head_size]}))
        found += self._request_findings(common, md)
        views = self.impl.last_views or self._static_views()
        found += self._from_violations(common, view_violations(*views[:2], self.meta.layer.head_size, views[2]))
        return found

    def _static_views(self):
        """K/V views of an empty cache in the snapshot's layout, on the meta device (strides only)."""
        layer = self.meta.layer
        shape = (1, layer.num_kv_heads, self.meta.backend.page_size, 2 * layer.head_size)
        dtype = torch.uint8 if layer.is_fp8 else getattr(torch, layer.dtype)
        pages = torch.empty(shape, dtype=dtype, device="meta")
        return (*split_kv(pages, LAYOUT_VLLM, layer.head_size, fp8=layer.is_fp8), pages)

    def _query_block_findings(self, common: CommonMetadata, md: FlashInferTSMetadata) -> list[Finding]:
        found = []
        q, n = md.query_len, md.num_reqs
        starts = common.query_start_loc.to("cpu").tolist()
        lens = [b - a for a, b in zip(starts, starts[1:])]
        wrong = [r for r in range(n) if (starts[r], starts[r + 1]) != (r * q, (r + 1) * q)]
        if wrong:
            shown = ", ".join(f"{r} (tokens {starts[r]}..{starts[r + 1] - 1}, kernel block {r * q}..{(r + 1) * q - 1})"
                              for r in wrong[:8])
            more = f" and {len(wrong) - 8} more" if len(wrong) > 8 else ""
            found.append(self._finding(
                common, "non_uniform_query_blocks",
                f"query lens {lens[:16]} are not uniform: the kernel views the flat query as {n} blocks of {q}, "
                f"so requests {shown}{more} get other requests' tokens",
                details={"query_lens": lens, "query_len": q, "misassigned_requests": wrong}))
        leftover = md.num_tokens - n * q
        if leftover > 0:
            found.append(self._finding(
                common, "ragged_leftover_tokens",
                f"{md.num_tokens} tokens over {n} requests round down to blocks of {q}: tokens "
                f"{n * q}..{md.num_tokens - 1} ({leftover}) are not written",
                details={"num_tokens": md.num_tokens, "query_len": q, "first_unwritten": n * q,
                         "unwritten": leftover}))
        return found

    def _request_findings(self, common: CommonMetadata, md: FlashInferTSMetadata) -> list[Finding]:
        found = []
        ps = self.builder.page_size
        lens = md.seq_lens.to("cpu").tolist()
        table = md.block_table.to("cpu")
        engine_lens = common.seq_lens[: md.num_reqs].to("cpu").tolist()
        start_pages = md.start_page.to("cpu").tolist() if md.start_page is not None else [0] * md.num_reqs
        width = int(table.shape[1])
        api = self.gate.contract
        mask_type = md.plan.mask_type if md.plan is not None else ts_mask_type(md.causal)
        for r, length in enumerate(lens):
            found += self._from_violations(common, check_request(
                request=r, seq_len=length, query_len=md.query_len, max_kv_len=md.max_kv_len,
                table_width=width, page_size=ps, mask_type=mask_type, api=api))
            if request_inactive(length, api):
                found.append(self._finding(
                    common, "inactive_request",
                    f"request {r}: seq_len {length} <= 0 marks an inactive request in the {api.label}: the "
                    "kernel leaves its output untouched, so none of its tokens is computed",
                    request=r, details={"seq_len": length}))
                continue
            live = table[r, : min(cdiv(length, ps), width)]
            bad = ((live < 0) | (live >= common.num_pages)).nonzero().flatten().tolist()
            if bad:
                col = bad[0]
                engine_col = min(start_pages[r] + col, common.block_table_engine.shape[1] - 1)
                engine_id = int(common.block_table_engine[r, engine_col])
                value = int(live[col])
                where = "not stored in the snapshot" if value < 0 else f"outside the {common.num_pages} stored pages"
                found.append(self._finding(
                    common, "page_outside_cache",
                    f"request {r}: handed block-table column {col} holds page {value} (engine page {engine_id}), "
                    f"{where}; {len(bad)} live column(s) read outside the cache",
                    request=r, details={"column": col, "stored_index": value, "engine_page": engine_id,
                                        "bad_columns": bad, "num_pages": common.num_pages}))
            if md.restricted and md.query_len <= engine_lens[r]:
                vis = visibility_table(engine_lens[r], self.builder.sliding_window, md.query_len, ps, False)
                if vis.worst_extra > 0:
                    worst = max(vis.tokens, key=lambda t: t.extra)
                    found.append(self._finding(
                        common, "window_restriction_extra_keys",
                        f"request {r}: FLASHINFER_TS's page-aligned window restriction (dense mask, one shared "
                        f"start) keeps keys from {start_pages[r] * ps} on: {sum(t.extra > 0 for t in vis.tokens)} "
                        f"of {len(vis.tokens)} query tokens see keys outside their exact window |p - k| < "
                        f"{self.builder.sliding_window}; worst token {worst.index} (position {worst.position}) sees "
                        f"keys {worst.kernel_lo}..{worst.kernel_hi - 1} instead of {worst.exact_lo}.."
                        f"{worst.exact_hi - 1} ({worst.extra} extra)", request=r,
                        details={"first_kept_token": start_pages[r] * ps, "worst_extra": vis.worst_extra,
                                 "drift": vis.drift, "extra_per_token": [t.extra for t in vis.tokens]}))
        return found

    # ------------------------------------------------------------------ explain

    def _preconditions(self, md: FlashInferTSMetadata, request: int, seq_len: int, table) -> str:
        """Every run() precondition of one request: ok or broken, each with the wrapper validation that owns it."""
        api = self.gate.contract
        ps = self.builder.page_size
        mask_type = md.plan.mask_type if md.plan is not None else ts_mask_type(md.causal)
        if request_inactive(seq_len, api):
            return f"inactive (seq_len {seq_len} <= 0): output left untouched [{api.label}]"
        broken = {v.code for v in check_request(request=request, seq_len=seq_len, query_len=md.query_len,
                                                max_kv_len=md.max_kv_len, table_width=int(table.shape[1]),
                                                page_size=ps, mask_type=mask_type, api=api)}
        codes = ["seq_len_not_positive", "seq_len_over_max_kv_len", "table_too_narrow", "page_outside_cache"]
        if mask_type == "causal":
            codes.insert(1, "seq_len_below_query_len")
        live = table[request, : min(cdiv(max(seq_len, 0), ps), int(table.shape[1]))]
        if bool(((live < 0) | (live >= self._num_pages)).any()):
            broken.add("page_outside_cache")
        # Grouped by the wrapper validation that owns them: "source: rule ok, rule BROKEN".
        by_source: dict[str, list[str]] = {}
        for c in codes:
            rule, source = PRECONDITIONS[c]
            by_source.setdefault(source, []).append(f"{rule} {'BROKEN' if c in broken else 'ok'}")
        if mask_type == "dense":
            by_source[PRECONDITIONS["seq_len_below_query_len"][1]].append(
                "no query_len bound for dense (every row sees all seq_len keys)")
        if md.query_len == 1:
            by_source.setdefault("run: _validate_q, _validate_out", []).append(
                "q/out [B, 1, Hq, D] for a length-1 query unverified")
        return "; ".join(f"{source}: {', '.join(rules)}" for source, rules in by_source.items())

    def _layer_preconditions(self) -> str:
        """plan() rules (all hold, or the backend would be unavailable) and the K/V view rules, by source."""
        views = self.impl.last_views or self._static_views()
        broken = {v.code for v in view_violations(*views[:2], self.meta.layer.head_size, views[2])}
        broken |= {v.code for v in _plan_violations(self.meta, self.gate.contract)}
        codes = ("head_dim_unsupported", "page_size_unsupported", "heads_not_divisible", "head_ratio_unsupported",
                 "dtype_mismatch", "window_needs_causal", "kv_head_dim_not_contiguous", "kv_stride_not_positive",
                 "kv_stride_misaligned", "kv_base_misaligned", "kv_dims_overlap")
        by_source: dict[str, list[str]] = {}
        for c in codes:
            rule, source = PRECONDITIONS[c]
            by_source.setdefault(source, []).append(f"{rule} {'BROKEN' if c in broken else 'ok'}")
        return "; ".join(f"{source}: {', '.join(rules)}" for source, rules in by_source.items())

    def explain(self, common: CommonMetadata, md: FlashInferTSMetadata) -> list[dict[str, Any]]:
        """Per request: the builder's decisions that decide what the kernel sees, the FlashInfer calling path,
        and every run() precondition with the wrapper validation it comes from."""
        self._num_pages = common.num_pages
        layer_rules = self._layer_preconditions()
        ps = self.builder.page_size
        engine_lens = common.seq_lens[: md.num_reqs].to("cpu").tolist()
        handed = md.seq_lens.to("cpu").tolist()
        start_pages = md.start_page.to("cpu").tolist() if md.start_page is not None else [0] * md.num_reqs
        table = md.block_table.to("cpu")  # once, not once per request
        width = int(table.shape[1])
        window = self.builder.sliding_window
        rows = []
        for r, length in enumerate(engine_lens):
            row = {
                "request": r,
                "seq_len": length,
                "restricted_seq_len": handed[r],
                "restricted": md.restricted,
                "start_page": start_pages[r],
                "first_kept_token": start_pages[r] * ps,
                "pages_kept": cdiv(handed[r], ps),
                "table_width": width,
                "plan_key": list(md.plan_key) if md.plan_key else None,
                "query_len": md.query_len,
                "mask_type": md.plan.mask_type if md.plan else ts_mask_type(md.causal),
                "window_left": md.plan.window_left if md.plan else ts_window_left(window, md.causal),
                "max_kv_len": md.max_kv_len,
                "flashinfer_path": self.gate.short_path,
            }
            if md.overflow is not None:
                row["note"] = "buffer overflow: vLLM's builder fails, nothing runs"
            elif md.query_len == 0:
                row["note"] = f"no-op batch: {md.noop_reason or 'no tokens'}"
            else:
                if md.restricted and md.query_len <= length:
                    row["restriction"] = asdict(restrict_to_window(length, window, md.query_len, ps))
                row["preconditions"] = self._preconditions(md, r, handed[r], table)
                row["layer_preconditions"] = layer_rules
            rows.append(row)
        return rows
