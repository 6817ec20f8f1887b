"""vLLM's FLASHINFER_TS: prims_ts paged decode, on the real kernel where it can run, else its contract in torch.

The builder reproduces the specified FLASHINFER_TS builder's decisions exactly -- uniform query
blocks, the no-op batch, persistent int32 buffers, the page-aligned window
restriction for dense windowed layers, plans keyed by (num_reqs, query_len,
causal) with one constant max_kv_len. The kernel runs with ``validate=False``,
so :meth:`FlashInferTSInstance.findings` checks every documented precondition
of each batch the builder produces; what the real kernel does with a batch
that breaks one is undefined, and that is usually the bug being chased.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from kvdbg.backends.base import BackendSpec, Capabilities, unsupported_by, CommonMetadata, Finding, ReplayOptions, RunInfo
from kvdbg.snapshot.layout import FP8_MAX, as_fp8, quantize_fp8, split_kv
from kvdbg.errors import BackendUnavailable
from kvdbg.snapshot.format import LAYOUT_VLLM
from kvdbg.ts.window import (
    cdiv,
    restrict_to_window,
    ts_batch_not_run,
    ts_mask_type,
    ts_max_kv_len,
    ts_table_width,
    ts_window_left,
    visibility_table,
)
from kvdbg.ts.planner import B200_SMS, DecodeProfile, fp8_decode_profile, window_first_tiles
from kvdbg.ts.window_torch import restrict_to_window_tensors
from kvdbg.ts.contract import (
    FP8_P_STREAMS,
    FP8_P_TILE,
    PRECONDITIONS,
    STRICTEST,
    SUPPORTED_CAPABILITIES,
    ApiGeneration,
    api_for_version,
    check_kv_views,
    check_plan,
    check_request,
    request_inactive,
)

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

NAME = "flashinfer_ts"
ENGINE_NAME = "FLASHINFER_TS"
MIN_FLASHINFER = (0, 7, 1)
EMULATED_KERNEL = "prims_ts contract, emulated in torch"
EMULATED_KERNEL_TRITON = "prims_ts contract, emulated in Triton"
# On CUDA the Triton emulation runs a step that may read more K/V than this, or has more requests than
# TRITON_ABOVE_REQUESTS; a smaller one runs the torch loop (FlashInferTSImpl._emulator says why).
TRITON_ABOVE_BYTES = 64 << 20
TRITON_ABOVE_REQUESTS = 256
# The FP8 kernel scales unnormalised probabilities by 448 (e4m3's largest finite value) and rounds them to
# e4m3 before the P.V product (fmha_decode helpers_softmax). It streams keys in tiles of FP8_P_TILE through
# one or two K/V instances, each with its own running max, merged at the end; how many depends on the
# profile the planner picks (kvdbg.ts.planner). kvdbg models that at split count 1.
FP8_P_SCALE = FP8_MAX
FP8_P_CAVEAT = ("P rounded to e4m3 at 448x per 128-key tile against its K/V instance's running max, with the "
                "planner's profile (one instance for a Keeps tile at head_dim 192/256, else two, tiles dealt in "
                "turn from the first one the window keeps), modelled at split count 1 for a B200; the real "
                "planner may split the keys further (its choice depends on batch and GPU), which moves where P "
                "is rounded: each P stays within half an e4m3 step (1/16 relative) of exact either way")

# Named in the reason a GPU is refused, so a user sees at once which machine they are on.
_ARCH_NAMES = {7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper, e.g. H100/H200", 12: "consumer Blackwell"}


# For query length 1 the wrapper documents q and out as [B, Hq, D] (_validate_q, _validate_out: rank 3),
# while FLASHINFER_TS always passes [B, SQ, Hq, D]; only validate=False lets that through.
SQ1_RANK_NOTE = ("query length 1: FLASHINFER_TS passes q and out as [B, 1, Hq, D] with validate=False, where "
                 "the wrapper's _validate_q/_validate_out expect [B, Hq, D] for a length-1 query; the memory "
                 "layout is the same, but whether the kernel reads it right is unverified (no Blackwell GPU "
                 "has run it for kvdbg)")


# --------------------------------------------------------------------------- can the real kernel run here?


@dataclass(frozen=True)
class KernelGate:
    """Whether the real prims_ts kernel runs, and precisely why not when it does not."""

    available: bool
    reason: str | None = None  # why not; shown in RunInfo.notes of the emulated run
    wrapper_cls: Any = None  # flashinfer's BatchDecodePagedTSWrapper (or a test double)
    flashinfer_version: str | None = None
    capability: tuple[int, int] | None = None
    api: ApiGeneration | None = None  # the installed flashinfer's API generation (None: not installed/usable)
    api_note: str | None = None  # set when the installed release is newer than any kvdbg knows

    @property
    def contract(self) -> ApiGeneration:
        """The generation whose rules a batch is held to: the installed one, else the strictest known."""
        return self.api or STRICTEST

    @property
    def short_path(self) -> str:
        """``path`` in a few words, for a table column."""
        if self.api is None:
            return f"none usable: {STRICTEST.label} rules (strictest)"
        return f"{self.flashinfer_version}: {self.api.label}" + (" (newer, untested)" if self.api_note else "")

    @property
    def path(self) -> str:
        """Which FlashInfer calling path and rules apply, in words (``--explain``, the column's notes)."""
        if self.api is None:
            why = f"flashinfer {self.flashinfer_version} unusable" if self.flashinfer_version else \
                "no usable flashinfer installed"
            return f"{why}: held to the {STRICTEST.label}'s rules, the strictest kvdbg knows"
        path = f"flashinfer-python {self.flashinfer_version}, called with the {self.api.label}"
        return f"{path} ({self.api_note})" if self.api_note else path


def _import_prims_ts() -> tuple[Any, str]:
    """(BatchDecodePagedTSWrapper, flashinfer.__version__); raises ImportError where absent.

    Kept in its own function so tests can replace it, and so flashinfer is only
    ever imported when a replay asks for this backend.
    """
    from flashinfer.attention.prims_ts import BatchDecodePagedTSWrapper

    import flashinfer

    return BatchDecodePagedTSWrapper, str(getattr(flashinfer, "__version__", "unknown"))


def _probe_device(device: str) -> tuple[tuple[int, int] | None, str | None]:
    """(compute capability, None) for a usable CUDA replay device, else (None, why not)."""
    if not torch.cuda.is_available():
        built = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        return None, f"no CUDA: {built} (torch {torch.__version__}); prims_ts needs a CUDA device"
    dev = torch.device(device)
    if dev.type != "cuda":
        return None, f"the replay runs on {device}; prims_ts needs CUDA tensors (replay with --device cuda)"
    return tuple(torch.cuda.get_device_capability(dev)), None


def parse_version(text: str) -> tuple[int, int, int] | None:
    """The release triple of a version string (``0.7.0.post1`` -> (0, 7, 0)); None if it has none."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def _too_old_reason(version: str, parsed: tuple[int, int, int]) -> str:
    need = ".".join(map(str, MIN_FLASHINFER))
    if parsed[:2] == (0, 7):
        # The one release before the fix: the module imports, then the first plan() dies in codegen; and
        # its unchecked run() path passes the kernel only the page stride, assuming compact HND pages.
        why = ("its prims_ts code generation still passes a `context` keyword to Task._run_task_body_impl, "
               "which cutlass-dsl 4.8 removed, so the first plan() fails with a TypeError; and it requires "
               "compact K/V strides (head_dim-wide tokens): with validate=False it would read vLLM's K/V "
               "halves, whose token stride is 2*D, at the wrong addresses without any error")
    else:
        why = "earlier prims_ts builds do not accept vLLM's K/V halves with token stride 2*D"
    return f"flashinfer-python {version} is too old: FLASHINFER_TS needs >= {need} ({why})"


def kernel_gate(device: str, *, force_emulation: bool = False) -> KernelGate:
    """Check, in order: flashinfer importable, version, forced emulation, CUDA, compute capability.

    The installed release decides the calling path and the rules a batch is held to, emulated or not.
    """
    forced = "emulation requested (force_emulation): the real kernel was not tried"
    try:
        wrapper_cls, version = _import_prims_ts()
    except ImportError as exc:
        if force_emulation:
            return KernelGate(False, forced)
        need = ".".join(map(str, MIN_FLASHINFER))
        return KernelGate(False, f"flashinfer missing: flashinfer.attention.prims_ts does not import "
                                 f"({exc}); FLASHINFER_TS needs flashinfer-python >= {need}")
    parsed = parse_version(version)
    if parsed is None:
        return KernelGate(False, f"flashinfer reports version {version!r}, which kvdbg cannot compare with "
                                 f"{'.'.join(map(str, MIN_FLASHINFER))}", flashinfer_version=version)
    api, api_note = api_for_version(parsed)
    if api is None:
        return KernelGate(False, _too_old_reason(version, parsed), flashinfer_version=version)
    versioned = dict(flashinfer_version=version, api=api, api_note=api_note)
    if force_emulation:
        return KernelGate(False, forced, **versioned)
    capability, why = _probe_device(device)
    if capability is None:
        return KernelGate(False, why, **versioned)
    capability = (int(capability[0]), int(capability[1]))
    if capability not in SUPPORTED_CAPABILITIES:
        arch = _ARCH_NAMES.get(capability[0])
        shown = f"{capability[0]}.{capability[1]}" + (f" ({arch})" if arch else "")
        wanted = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_CAPABILITIES)
        return KernelGate(False, f"compute capability {shown} is not supported: prims_ts runs only on "
                                 f"{wanted} (B200, B300, Rubin)", capability=capability, **versioned)
    return KernelGate(True, None, wrapper_cls, capability=capability, **versioned)


# --------------------------------------------------------------------------- what vLLM refuses


def installed_api() -> ApiGeneration:
    """The installed flashinfer's API generation, else the strictest known (no flashinfer: nothing to run)."""
    try:
        _, version = _import_prims_ts()
    except ImportError:
        return STRICTEST
    parsed = parse_version(version)
    api = api_for_version(parsed)[0] if parsed is not None else None
    return api or STRICTEST


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


# --------------------------------------------------------------------------- the kernel contract in torch


def emulate_decode(
    q: "torch.Tensor",
    k_cache: "torch.Tensor",
    v_cache: "torch.Tensor",
    seq_lens: "torch.Tensor",
    block_tables: "torch.Tensor",
    *,
    mask_type: str,
    window_left: int,
    bmm1_scale: float,
    bmm2_scale: float,
    out: "torch.Tensor",
    requests: list[int] | None = None,
    key_mask: Callable[[int], "torch.Tensor"] | None = None,
    fp8_p: bool | None = None,
    fp8_profile: DecodeProfile | None = None,
) -> "torch.Tensor":
    """prims_ts paged decode by its documented contract, in fp32.

    ``q`` [B, SQ, Hq, D]; K/V caches [pages, Hkv, page_size, D] (any strides);
    ``out`` [B, SQ, Hq, D] in the kernel's output dtype. Request ``b`` gathers
    ``cdiv(seq_lens[b], page_size)`` pages through ``block_tables[b]``. "dense"
    sees every key below seq_len; "causal" is bottom-right aligned (row i sees
    keys ``[0, L - SQ + i]``) and ``window_left >= 0`` keeps only the last
    ``window_left + 1`` of those. Logits are scaled by ``bmm1_scale`` and the
    normalised output by ``bmm2_scale``. Only ``requests`` are written (default
    all); a row that sees no key is left as it was. ``key_mask(b)`` -> [SQ, L]
    bool can hide further keys (tests use it to take out the restriction's extras).
    A dense row sees all ``seq_len`` keys even when ``seq_len < SQ``.

    ``fp8_p`` (default: when q and K are FP8) models the FP8 kernel's P
    rounding, see :func:`fp8_rounded_attention`, with the K/V instances and
    query tokens per CTA of ``fp8_profile`` (default: two instances, one token);
    otherwise P stays fp32.
    """
    if fp8_p is None:
        fp8_p = q.dtype == torch.float8_e4m3fn and k_cache.dtype == torch.float8_e4m3fn
    instances = fp8_profile.kv_instances if fp8_profile is not None else FP8_P_STREAMS
    tokens_per_cta = fp8_profile.q_tokens_per_cta if fp8_profile is not None else 1

    batch, sq, hq, d = q.shape
    hkv, page_size = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    for b in (range(batch) if requests is None else requests):
        length = int(seq_lens[b])
        if length <= 0:
            continue
        pages = block_tables[b, : cdiv(length, page_size)].to(torch.int64)
        keys = k_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        values = v_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        query = q[b].float().reshape(sq, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, SQ, D]
        scores = torch.matmul(query, keys.unsqueeze(1).transpose(-1, -2)) * bmm1_scale  # [Hkv, G, SQ, L]
        key_pos = torch.arange(length, device=q.device).unsqueeze(0)
        if mask_type == "causal":
            last = (length - sq + torch.arange(sq, device=q.device)).unsqueeze(1)
            allowed = key_pos <= last
            if window_left >= 0:
                allowed = allowed & (key_pos >= last - window_left)
        else:
            allowed = torch.ones(sq, length, dtype=torch.bool, device=q.device)
        if key_mask is not None:
            allowed = allowed & key_mask(b).to(q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if fp8_p:
            first = window_first_tiles(seq_len=length, query_len=sq, q_tokens_per_cta=tokens_per_cta,
                                       window_left=window_left if mask_type == "causal" else -1)
            result = fp8_rounded_attention(scores, values.unsqueeze(1), instances=instances,
                                           first_tile=torch.tensor(first, device=q.device)) * bmm2_scale
        else:
            probs = torch.softmax(scores, dim=-1)
            result = torch.matmul(probs, values.unsqueeze(1)) * bmm2_scale  # [Hkv, G, SQ, D]
        result = result.permute(2, 0, 1, 3).reshape(sq, hq, d)
        seen = allowed.any(dim=1)
        out[b, seen] = result[seen].to(out.dtype)
    return out


def fp8_rounded_attention(scores: "torch.Tensor", values: "torch.Tensor", *, instances: int = FP8_P_STREAMS,
                          first_tile: "torch.Tensor | None" = None) -> "torch.Tensor":
    """softmax(scores) @ values with P rounded as prims_ts's FP8 path rounds it, at split count 1.

    ``scores`` [..., SQ, L] fp32, already scaled, -inf where masked; ``values``
    [..., L, D]. Keys go in tiles of 128. The kernel skips whole tiles before a
    CTA's window and deals the rest in turn to its ``instances`` K/V instances:
    for query row ``i``, tile ``t`` belongs to instance ``(t - first_tile[i]) %
    instances`` (``first_tile`` [SQ], default 0) and is exponentiated against
    ``m_t``, that instance's running max after it. Its unnormalised P, times
    448, is rounded to e4m3 for the P.V product, while the softmax sum adds the
    unrounded values. Rescaling every tile to the overall max ``M`` is exactly
    what the online merge does::

        out = sum_t e^(m_t - M) * e4m3(448 e^(s_t - m_t)) @ V_t
              / sum_t e^(m_t - M) * sum(448 e^(s_t - m_t))

    Rows that see no key come back NaN.
    """
    length, sq = scores.shape[-1], scores.shape[-2]
    tiles = -(-length // FP8_P_TILE)
    padded = torch.nn.functional.pad(scores, (0, tiles * FP8_P_TILE - length), value=float("-inf"))
    tiled = padded.unflatten(-1, (tiles, FP8_P_TILE))  # [..., SQ, T, 128]
    tile_max = tiled.amax(-1)  # [..., SQ, T]
    first = torch.zeros(sq, dtype=torch.int64, device=scores.device) if first_tile is None else first_tile
    # Tiles before a row's first tile are masked for it: whichever instance they fall to, they stay -inf.
    owner = torch.remainder(torch.arange(tiles, device=scores.device).unsqueeze(0) - first.view(sq, 1), instances)
    running = torch.full_like(tile_max, float("-inf"))
    for instance in range(instances):
        own = owner == instance  # [SQ, T]
        mine = torch.cummax(tile_max.masked_fill(~own, float("-inf")), dim=-1).values
        running = torch.where(own, mine, running)
    empty = running == float("-inf")
    anchor = running.masked_fill(empty, 0.0)
    probs = torch.exp(tiled - anchor.unsqueeze(-1)) * FP8_P_SCALE
    rounded = probs.to(torch.float8_e4m3fn).float()
    overall = running.amax(-1, keepdim=True)
    weight = torch.exp(running - overall.masked_fill(overall == float("-inf"), 0.0)).masked_fill(empty, 0.0)
    denom = (probs.sum(-1) * weight).sum(-1, keepdim=True)  # [..., SQ, 1]
    weighted = (rounded * weight.unsqueeze(-1)).flatten(-2)[..., :length]
    return torch.matmul(weighted, values) / denom


def _view_record(t: "torch.Tensor", base: "torch.Tensor | None") -> dict[str, Any]:
    if base is not None:
        # The address that matters is the engine's, not that of kvdbg's copy (a memory-mapped file can start
        # anywhere): take the engine's page tensor as 16-byte aligned -- allocators align far more -- and
        # check where in it the view starts (V starts D elements in).
        ptr = (t.storage_offset() - base.storage_offset()) * t.element_size()
    else:
        ptr = None if t.device.type == "meta" else int(t.data_ptr())
    return {"shape": tuple(t.shape), "strides": tuple(t.stride()), "element_size": t.element_size(), "data_ptr": ptr}


def view_violations(k: "torch.Tensor", v: "torch.Tensor", head_size: int,
                    base: "torch.Tensor | None" = None) -> list[Finding]:
    """What ``_validate_native_hnd_tma_strides`` checks of the K/V views (see ``ts_contract.check_kv_view``).

    ``base``: the page tensor the views were cut from; addresses are then taken relative to it.
    """
    return check_kv_views(_view_record(k, base), _view_record(v, base), head_size)


class FlashInferTSImpl:
    """vLLM's FlashInferTSImpl.forward: real ``wrapper.run(validate=False)`` or the emulated contract."""

    def __init__(self, meta: "SnapshotMeta", builder: FlashInferTSBuilder):
        layer = meta.layer
        self.meta = meta
        self.builder = builder
        self.num_heads = layer.num_heads
        self.head_size = layer.head_size
        self.fp8 = layer.is_fp8
        # vLLM's layer keeps q/k/v scales even without FP8 (1.0 by default) and the backend folds them all.
        self.bmm1_scale = float(layer.scale) * float(layer.q_scale) * float(layer.k_scale)
        self.bmm2_scale = float(layer.v_scale)
        self.q_scale = float(layer.q_scale)
        self.reset()

    def reset(self) -> None:
        """Forget the last forward: its cache views (findings must never judge another cache's views, and
        holding them would keep that cache alive) and the emulator it chose (describe() reports it)."""
        self.last_views: tuple[Any, Any, Any] | None = None  # K view, V view, the page tensor
        self.emulator, self.emulator_note = "torch", None

    def kernel_query(self, query: "torch.Tensor") -> "torch.Tensor":
        """The query in the plan's dtype: FP8 bytes viewed as e4m3; a model-dtype query on an FP8 cache is
        quantised with q_scale, as vLLM's attention layer does before calling this backend."""
        if not self.fp8:
            return query
        query = as_fp8(query)
        return query if query.dtype == torch.float8_e4m3fn else quantize_fp8(query, self.q_scale)

    def _emulator(self, q: "torch.Tensor", k_cache: "torch.Tensor", md: FlashInferTSMetadata) -> Callable:
        """The Triton kernel of the same contract on CUDA for a large step, else the torch loop.

        Triton's first launch in a process costs ~0.5-1 s (import, cache lookup
        or compile); the torch loop costs ~0.1 ms a request. A step that may read
        more than TRITON_ABOVE_BYTES of K/V, or holds more than
        TRITON_ABOVE_REQUESTS requests, goes to Triton. ``KVDBG_EMULATION=torch``
        or ``=triton`` decides instead.
        """
        import os

        self.emulator, self.emulator_note = "torch", None
        forced = os.environ.get("KVDBG_EMULATION", "").lower()
        if not q.is_cuda or forced == "torch":
            return emulate_decode
        readable = md.num_reqs * md.block_table.shape[1] * self.builder.page_size
        kv_bytes = 2 * readable * k_cache.shape[1] * self.head_size * k_cache.element_size()
        if forced != "triton" and kv_bytes <= TRITON_ABOVE_BYTES and md.num_reqs <= TRITON_ABOVE_REQUESTS:
            self.emulator_note = (f"torch loop chosen by size (at most {kv_bytes / 2**20:.1f} MiB of K/V, "
                                  f"{md.num_reqs} requests; Triton above {TRITON_ABOVE_BYTES >> 20} MiB or "
                                  f"{TRITON_ABOVE_REQUESTS} requests); KVDBG_EMULATION=triton decides instead")
            return emulate_decode
        try:
            from kvdbg.backends import _triton_decode
        except Exception as exc:  # triton missing or broken: say so, run the torch definition
            self.emulator_note = f"Triton emulation unavailable ({type(exc).__name__}: {exc}); torch loop used"
            return emulate_decode
        reason = _triton_decode.supported(q, k_cache)
        if reason is not None:
            self.emulator_note = f"Triton emulation not used: {reason}; torch loop used"
            return emulate_decode
        self.emulator = "triton"
        return _triton_decode.triton_decode

    def forward(self, query, kv_cache, md: FlashInferTSMetadata, output):
        if md.overflow is not None or md.num_actual_tokens == 0:
            return output
        if md.build_id != self.builder.build_count:
            raise RuntimeError(f"FLASHINFER_TS metadata of build {md.build_id} was overwritten by build "
                               f"{self.builder.build_count}: its buffers are persistent, run each build before the next")
        n, b, sq = md.num_actual_tokens, md.num_reqs, md.query_len
        k_cache, v_cache = split_kv(kv_cache, LAYOUT_VLLM, self.head_size, fp8=self.fp8)
        self.last_views = (k_cache, v_cache, kv_cache)
        # The flat view assigns token t to request t // sq whatever query_start_loc says (see findings).
        q = self.kernel_query(query[:n]).reshape(b, sq, self.num_heads, self.head_size)
        plan = md.plan
        model_dtype = self.builder.out_dtype
        if md.wrapper is not None:
            kernel_out = torch.empty((b, sq, self.num_heads, self.head_size), dtype=plan.o_data_type,
                                     device=query.device)
            md.wrapper.run(**self.builder.gate.api.run_kwargs(dict(
                q=q, paged_kv_cache=(k_cache, v_cache), seq_lens=md.seq_lens, block_tables=md.block_table,
                bmm1_scale=self.bmm1_scale, bmm2_scale=self.bmm2_scale, out=kernel_out, validate=False)))
        else:
            if view_violations(k_cache, v_cache, self.head_size, kv_cache):
                return output  # the kernel's TMA descriptors would be wrong: nothing to predict (see findings)
            # As the backend does, the kernel writes straight into the output unless a cast is needed. Rows the
            # emulation cannot predict (undefined on the real kernel) are left as they were: the replay core's
            # NaN, or NaN in the staging buffer, so they show as "not written".
            direct = output[:n]
            if plan.o_data_type == output.dtype == model_dtype and direct.is_contiguous():
                kernel_out = direct.view(b, sq, self.num_heads, self.head_size)
            else:
                kernel_out = torch.full((b, sq, self.num_heads, self.head_size), float("nan"),
                                        dtype=plan.o_data_type, device=query.device)
            emulate = self._emulator(q, k_cache, md)
            if emulate is emulate_decode:
                codes = undefined_codes(md, int(k_cache.shape[0]), self.builder.page_size,
                                        self.builder.gate.contract)
                defined = [r for r, code in enumerate(codes.tolist()) if not code]
                emulate_decode(q, k_cache, v_cache, md.seq_lens, md.block_table, mask_type=plan.mask_type,
                               window_left=plan.window_left, bmm1_scale=self.bmm1_scale,
                               bmm2_scale=self.bmm2_scale, out=kernel_out, requests=defined,
                               fp8_profile=md.fp8_profile)
            else:  # the kernel checks the same preconditions itself: no host round trip, no extra launch
                emulate(q, k_cache, v_cache, md.seq_lens, md.block_table, mask_type=plan.mask_type,
                        window_left=plan.window_left, bmm1_scale=self.bmm1_scale, bmm2_scale=self.bmm2_scale,
                        out=kernel_out, max_kv_len=md.max_kv_len, fp8_profile=md.fp8_profile)
        # The engine converts the kernel's dtype (fp16 for an FP8 query) to the model dtype.
        if kernel_out.data_ptr() != output.data_ptr():
            output[:n] = kernel_out.reshape(n, self.num_heads, self.head_size).to(model_dtype).to(output.dtype)
        return output


UNDEFINED_CODES = ("seq_len_not_positive", "seq_len_below_query_len", "seq_len_over_max_kv_len",
                   "table_too_narrow", "page_outside_cache", "inactive_request")


def undefined_codes(md: FlashInferTSMetadata, num_pages: int, page_size: int,
                    api: ApiGeneration = STRICTEST) -> "torch.Tensor":
    """Per request, 1 + the index in UNDEFINED_CODES of the first reason it is not computed, 0 when it is.

    The same rules as ``ts_contract.check_request``, on the metadata's device
    without a host round trip, so the CUDA emulation can skip those requests
    inside the kernel. A dense mask has no ``query_len <= seq_len`` rule;
    ``inactive_request`` (0.7.4+, ``seq_len <= 0``) is defined -- its output is
    left untouched -- but nothing is computed for it either.
    """
    lens = md.seq_lens.to(torch.int64)
    table = md.block_table
    width = table.shape[1]
    active = lens > 0
    pages = (lens.clamp_min(0) + page_size - 1) // page_size
    live = torch.arange(width, device=lens.device).unsqueeze(0) < pages.clamp_max(width).unsqueeze(1)
    outside = (live & ((table < 0) | (table >= num_pages))).any(1)
    causal = md.plan.mask_type == "causal" if md.plan is not None else md.causal
    inactive = ~active if api.nonpositive_is_inactive else torch.zeros_like(active)
    checks = (~active & ~inactive,  # precedence order
              active & (lens < md.query_len) & causal,
              active & (lens > md.max_kv_len),
              active & (pages > width),
              active & outside,
              inactive)
    codes = torch.zeros_like(lens)
    for index in reversed(range(len(checks))):
        codes = torch.where(checks[index], index + 1, codes)
    return codes


def undefined_requests(md: FlashInferTSMetadata, num_pages: int, page_size: int,
                       api: ApiGeneration = STRICTEST) -> dict[int, str]:
    """Requests the kernel does not compute (a broken precondition, or inactive), with the first reason."""
    if md.query_len == 0 or md.overflow is not None:
        return {}
    codes = undefined_codes(md, num_pages, page_size, api).tolist()
    return {r: UNDEFINED_CODES[c - 1] for r, c in enumerate(codes) if c}


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
        undefined = undefined_requests(md, common.num_pages, self.builder.page_size, self.gate.contract)
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
        width = int(md.block_table.shape[1])
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
                row["preconditions"] = self._preconditions(md, r, handed[r], md.block_table.to("cpu"))
                row["layer_preconditions"] = layer_rules
            rows.append(row)
        return rows


def create(meta: "SnapshotMeta", options: ReplayOptions, *, gate: KernelGate | None = None) -> FlashInferTSInstance:
    """A ready backend; ``gate`` overrides the real-kernel probe (tests pass a recording wrapper this way)."""
    gate = gate or kernel_gate(options.device, force_emulation=options.force_emulation)
    reason = unsupported_reason(meta, gate.contract)
    if reason is not None:
        raise BackendUnavailable(reason)
    return FlashInferTSInstance(meta, options, gate)


BACKEND = BackendSpec(
    name=NAME,
    engine_name=ENGINE_NAME,
    summary="FlashInfer prims_ts paged decode (uniform query blocks, dense or causal, page-restricted windows)",
    capabilities=CAPABILITIES,
    environment_reason=_plan_reason,
    kernel_refusals=lambda meta: _plan_violations(meta, installed_api()),
    create=create,
)
