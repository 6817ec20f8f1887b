"""What vLLM refuses (capabilities, plan() rules), the kernel's dtypes, and the FLASHINFER_TS metadata builder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kvdbg.backends.base import Capabilities, unsupported_by, CommonMetadata, Finding
from kvdbg.errors import BackendUnavailable
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.ts.window import ts_mask_type, ts_max_kv_len, ts_table_width, ts_window_left
from kvdbg.ts.planner import B200_SMS, DecodeProfile, fp8_decode_profile
from kvdbg.ts.window_torch import restrict_to_window_tensors
from kvdbg.ts.contract import PRECONDITIONS, ApiGeneration, check_plan
from kvdbg.backends.flashinfer_ts.gate import KernelGate, installed_api

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta


# --------------------------------------------------------------------------- what vLLM refuses


# vLLM's FLASHINFER_TS refuses these layers outright; the kernel reads only the packed HND page.
CAPABILITIES = Capabilities(
    who="FLASHINFER_TS", soft_cap=False, kv_layouts=(LAYOUT_VLLM,), then="vLLM would not pick it for this layer",
    layout_reason=(f"kv_layout {{layout!r}} keeps K and V in separate planes with token stride Hkv*D; FLASHINFER_TS "
                   f"hands the kernel the two halves of a {LAYOUT_VLLM!r} page (HND, token stride 2*D), so this "
                   "cache cannot be given to prims_ts as it is (capture it from a vLLM with that layout)"))


def unsupported_reason(meta: "SnapshotMeta", api: ApiGeneration | None = None) -> str | None:
    """Why FLASHINFER_TS cannot replay this snapshot (its capabilities, then plan()'s rules), else None.

    ``api``: the FlashInfer generation whose plan() rules apply (default: the installed one).
    """
    return unsupported_by(CAPABILITIES, meta) or _plan_reason(meta, api)


def _plan_reason(meta: "SnapshotMeta", api: ApiGeneration | None = None) -> str | None:
    api = api or installed_api()
    refused = _plan_violations(meta, api)
    if refused:
        # plan() raises on these, so no output of this backend exists to compare -- emulated or not.
        return "prims_ts plan() rejects this layer: " + "; ".join(
            f"{v.message} [{PRECONDITIONS[v.code][1]}]" for v in refused)
    return None


def _plan_violations(meta: "SnapshotMeta", api: ApiGeneration) -> list[Finding]:
    layer = meta.layer
    kv_dtype = "float8_e4m3fn" if layer.is_fp8 else layer.dtype
    return check_plan(head_dim=layer.head_size, num_qo_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                      api=api, page_size=meta.backend.page_size, q_dtype=kv_dtype,
                      kv_dtype=kv_dtype, mask_type=ts_mask_type(layer.causal),
                      window_left=ts_window_left(layer.sliding_window, layer.causal))


# --------------------------------------------------------------------------- dtypes


def kv_kernel_dtype(layer) -> "torch.dtype":
    """An FP8 cache is stored as uint8 and viewed as e4m3; otherwise the model dtype."""
    return torch.float8_e4m3fn if layer.is_fp8 else getattr(torch, layer.dtype)


def ts_output_dtype(q_dtype: "torch.dtype", model_dtype: "torch.dtype") -> "torch.dtype":
    """The dtype the kernel writes: an FP8 query only yields fp16 (or fp8), so a non-fp16 model stages via fp16."""
    if q_dtype == torch.float8_e4m3fn and model_dtype != torch.float16:
        return torch.float16
    return model_dtype


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------- builder


@dataclass(frozen=True)
class TSPlan:
    """The keyword arguments FLASHINFER_TS passes to ``BatchDecodePagedTSWrapper.plan`` for one plan key.

    Named as FLASHINFER_TS writes them (flashinfer 0.7.1-0.7.2 names); ``ApiGeneration.plan_kwargs`` renames them for
    the installed release.
    """

    device: Any  # torch.device
    batch_size: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_kv_len: int
    max_seq_len_q: int
    packed_query: bool
    q_data_type: Any  # torch.dtype
    kv_data_type: Any
    o_data_type: Any
    mask_type: str
    window_left: int

    def kwargs(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


@dataclass
class FlashInferTSMetadata:
    """What the builder hands the kernel for one step (passive; filled by FlashInferTSBuilder.build).

    ``seq_lens`` and ``block_table`` are views of the builder's persistent
    buffers, overwritten by the next build, exactly as in vLLM (CUDA graphs
    record their addresses).
    """

    seq_lens: "torch.Tensor"  # [num_reqs] int32: the (restricted) lengths the kernel reads
    block_table: "torch.Tensor"  # [num_reqs, width] int32 stored-page indices the kernel reads
    num_reqs: int
    num_actual_tokens: int  # tokens the kernel writes: num_reqs * query_len (0 for a no-op batch)
    query_len: int  # uniform block length (0: no-op batch)
    plan: TSPlan | None
    plan_key: tuple[int, int, bool] | None
    wrapper: Any  # the planned real wrapper; None when emulated or no-op
    causal: bool
    restricted: bool  # the dense-window page restriction ran
    start_page: "torch.Tensor | None"  # [num_reqs] int64 first engine column kept, when restricted
    num_tokens: int  # query tokens in the step, before rounding to whole blocks
    quotient_query_len: int  # num_tokens // num_reqs, before the no-op rule
    noop_reason: str | None  # why the builder planned a no-op batch
    overflow: str | None  # vLLM's builder raises here (more requests than buffer rows); nothing runs
    buffer_rows: int
    buffer_width: int
    max_kv_len: int
    build_id: int
    fp8_profile: DecodeProfile | None = None  # the planner's profile of an FP8 plan (how P is rounded)


def _buffer_rows(meta: "SnapshotMeta", query_len: int) -> int | None:
    backend = meta.backend
    seqs, tokens = backend.max_num_seqs, backend.max_num_batched_tokens
    if seqs is None and tokens is None:
        return None
    return max(seqs or 0, (tokens or 0) // max(query_len, 1))


class FlashInferTSBuilder:
    """vLLM's FlashInferTSMetadataBuilder, step for step; planning goes to the real wrapper when it runs."""

    def __init__(self, meta: "SnapshotMeta", device: str, gate: KernelGate):
        layer, backend = meta.layer, meta.backend
        self.meta = meta
        self.gate = gate
        self.device = torch.device(device)
        self.page_size = backend.page_size
        self.num_kv_heads = layer.num_kv_heads
        self.num_qo_heads = layer.num_heads
        self.head_size = layer.head_size
        self.kv_dtype = kv_kernel_dtype(layer)
        self.q_dtype = self.kv_dtype
        self.out_dtype = getattr(torch, layer.dtype)
        self.sliding_window = layer.sliding_window
        self.query_len = backend.max_decode_query_len
        self.max_kv_len = ts_max_kv_len(self.sliding_window, self.query_len, self.page_size, backend.max_model_len)
        self.plans: dict[tuple[int, int, bool], tuple[TSPlan, Any]] = {}
        self.fp8_profiles: dict[tuple[int, int, bool], DecodeProfile] = {}
        self.plan_calls = 0
        self.build_count = 0
        rows = _buffer_rows(meta, self.query_len)
        # Without the scheduler limits the builder's sizing is unknown: grow to the largest batch seen, and say so.
        self.rows_known = rows is not None
        self.buffer_width = ts_table_width(self.sliding_window, self.query_len, self.page_size, backend.max_model_len)
        self._buf_seq_lens = torch.zeros(rows or 0, dtype=torch.int32, device=self.device)
        self._buf_block_table = torch.zeros((rows or 0, self.buffer_width), dtype=torch.int32, device=self.device)

    def _plan_for(self, num_reqs: int, query_len: int, causal: bool) -> tuple[TSPlan, Any]:
        key = (num_reqs, query_len, causal)
        cached = self.plans.get(key)
        if cached is not None:
            return cached
        plan = TSPlan(
            device=self.device, batch_size=num_reqs, num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_size, page_size=self.page_size,
            max_kv_len=self.max_kv_len, max_seq_len_q=query_len, packed_query=False,
            q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
            o_data_type=ts_output_dtype(self.q_dtype, self.out_dtype),
            mask_type=ts_mask_type(causal), window_left=ts_window_left(self.sliding_window, causal),
        )
        wrapper = None
        if self.gate.available:
            wrapper = self.gate.wrapper_cls(kv_layout="HND")
            wrapper.plan(**self.gate.api.plan_kwargs(plan.kwargs()))
        elif self.q_dtype == torch.float8_e4m3fn:
            # Emulated: which profile the planner would pick decides how the kernel rounds P.
            self.fp8_profiles[key] = fp8_decode_profile(
                head_dim=self.head_size, query_len=query_len, heads_per_kv=self.num_qo_heads // self.num_kv_heads,
                batch_size=num_reqs, num_kv_heads=self.num_kv_heads, max_kv_len=self.max_kv_len,
                window_left=plan.window_left, sm_count=B200_SMS)
        self.plan_calls += 1
        self.plans[key] = (plan, wrapper)
        return plan, wrapper

    def build(self, common: CommonMetadata) -> FlashInferTSMetadata:
        causal = common.causal
        if isinstance(causal, torch.Tensor):
            raise BackendUnavailable("FLASHINFER_TS plans one mask per batch; a per-request causal tensor "
                                     "cannot be expressed")
        causal = bool(causal)
        self.build_count += 1
        num_reqs, num_tokens = common.num_reqs, common.num_actual_tokens
        quotient = num_tokens // num_reqs if num_reqs else 0
        query_len = quotient
        noop_reason = None
        if query_len > self.query_len:
            noop_reason = (f"query_len {query_len} ({num_tokens} tokens over {num_reqs} requests) exceeds "
                           f"max_decode_query_len {self.query_len}: the builder treats it as a batch it never runs")
            query_len = 0
        elif query_len == 0 and num_tokens > 0:
            noop_reason = f"{num_tokens} tokens over {num_reqs} requests round down to 0 tokens per request"
        window = self.sliding_window

        if num_reqs > self._buf_seq_lens.shape[0] and not self.rows_known:
            self._buf_seq_lens = torch.zeros(num_reqs, dtype=torch.int32, device=self.device)
            self._buf_block_table = torch.zeros((num_reqs, self.buffer_width), dtype=torch.int32, device=self.device)
        rows = int(self._buf_seq_lens.shape[0])
        base = dict(num_reqs=num_reqs, causal=causal, num_tokens=num_tokens, quotient_query_len=quotient,
                    noop_reason=noop_reason, buffer_rows=rows, buffer_width=self.buffer_width,
                    max_kv_len=self.max_kv_len, build_id=self.build_count)
        seq_lens = common.seq_lens[:num_reqs]
        table = common.block_table[:num_reqs]
        if num_reqs > rows:
            overflow = (f"{num_reqs} requests but the persistent metadata buffers hold {rows} rows "
                        f"(max(max_num_seqs, max_num_batched_tokens // {max(self.query_len, 1)})); "
                        "vLLM's builder fails here and no token is computed")
            return FlashInferTSMetadata(seq_lens=seq_lens, block_table=table, num_actual_tokens=0, query_len=0,
                                        plan=None, plan_key=None, wrapper=None, restricted=False, start_page=None,
                                        overflow=overflow, **base)

        restricted = window is not None and not causal
        start_page = None
        if restricted:
            restricted_lens, restricted_table, start_page = restrict_to_window_tensors(
                seq_lens, table, window, query_len, self.page_size, self.buffer_width)
            out_lens = self._buf_seq_lens[:num_reqs]
            out_table = self._buf_block_table[:num_reqs]
            out_lens.copy_(restricted_lens)
            out_table.copy_(restricted_table)
        else:
            # A causal windowed layer's buffer is only the window's width: long requests get a truncated table.
            width = min(table.shape[1], self.buffer_width)
            out_lens = self._buf_seq_lens[:num_reqs]
            out_table = self._buf_block_table[:num_reqs, :width]
            out_lens.copy_(seq_lens)
            out_table.copy_(table[:, :width])

        if query_len == 0:
            return FlashInferTSMetadata(seq_lens=seq_lens, block_table=table, num_actual_tokens=0, query_len=0,
                                        plan=None, plan_key=None, wrapper=None, restricted=restricted,
                                        start_page=start_page, overflow=None, **base)
        plan, wrapper = self._plan_for(num_reqs, query_len, causal)
        key = (num_reqs, query_len, causal)
        return FlashInferTSMetadata(seq_lens=out_lens, block_table=out_table, num_actual_tokens=num_reqs * query_len,
                                    query_len=query_len, plan=plan, plan_key=key, wrapper=wrapper,
                                    restricted=restricted, start_page=start_page, overflow=None,
                                    fp8_profile=self.fp8_profiles.get(key), **base)

