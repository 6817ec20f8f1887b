"""The contract between the replay core and the backends (vLLM's builder -> metadata -> impl split).

The replay core derives one :class:`CommonMetadata` per snapshot step (like
vLLM's ``CommonAttentionMetadata``) and hands it to every backend. A backend
module in ``backends/`` exposes ``BACKEND``, a :class:`BackendSpec`; its
``create`` returns an object with a ``builder`` (``build(common) -> metadata``)
and an ``impl`` (``forward(query, kv_cache, metadata, output) -> output``), and a
``describe()`` that says what really runs.

Output convention: the replay core allocates ``output`` [num_tokens, Hq, D]
filled with NaN and the impl writes the tokens it computes. A backend that may
leave tokens unwritten (ragged leftovers, a request its kernel cannot run) says
which it wrote with ``written_tokens(common, metadata)``, so NaN it *produced*
is never mistaken for a token it did not write. A backend whose builder would
not run a step at all says why with ``not_applicable(common, metadata)``; that
step is then not compared for it, and is no failure.
``query`` and ``kv_cache`` are the snapshot's own dtypes (FP8 as stored); the
working ``kv_cache`` is in the snapshot's layout and already holds the step's
new K/V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kvdbg.judge.findings import Finding  # what a backend's findings() returns (codes from kvdbg.judge.findings.CODES)

if TYPE_CHECKING:  # torch stays out of module import time
    import torch

    from kvdbg.snapshot.format import SnapshotMeta


@dataclass
class CommonMetadata:
    """Engine-level metadata of one decode step, derived once and shared by every builder.

    All tensors live on the replay device.
    """

    block_table: "torch.Tensor"  # [num_reqs, width] int64 indices into the stored pages; -1 = not stored
    block_table_engine: "torch.Tensor"  # [num_reqs, width] the engine's physical page ids, as captured
    seq_lens: "torch.Tensor"  # [num_reqs] int64, query tokens included
    query_start_loc: "torch.Tensor"  # [num_reqs + 1] int64
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    causal: bool
    sliding_window: int | None
    page_size: int
    num_pages: int  # stored pages in the working cache
    null_page: int | None  # stored index of engine page 0 (vLLM's null block), if stored
    step: int = 0
    has_engine_output: bool = False  # the snapshot holds the engine's own output of this step
    # The step's new K/V, which the replay has already written into the working cache (a backend that runs
    # the engine's own cache write, vLLM's do_kv_cache_update, writes them again). None when the step has none.
    new_key: "torch.Tensor | None" = None  # [num_tokens, Hkv, D], model dtype
    new_value: "torch.Tensor | None" = None
    new_slots: "torch.Tensor | None" = None  # [num_tokens] int64: stored page * page_size + offset; -1: not written
    # The layer's learned values when the snapshot holds them ([num_heads] float32 on the replay device):
    # read by a backend that models the feature, as vLLM's impl holds them.
    sinks: "torch.Tensor | None" = None
    alibi_slopes: "torch.Tensor | None" = None

    @property
    def query_lens(self) -> "torch.Tensor":
        return self.query_start_loc[1:] - self.query_start_loc[:-1]


@dataclass
class ReplayOptions:
    """What the user asked for; backends read only what concerns them."""

    device: str = "cpu"
    exact: bool = False  # reference in fp64 instead of fp32
    compile: bool | None = None  # flex: None = eager on CPU; on CUDA compiled only for big steps
    force_emulation: bool = False  # flashinfer_ts: emulate even where the real kernel could run
    flex_q_block: int | None = None  # flex: the BlockMask's query block (None = vLLM's 16 tokens)
    # reference: a non-causal window's sides. "symmetric" is vLLM's |p - k| < w (the snapshot format's meaning);
    # "left" bounds keys on the left only, p - w < k, as FlashInfer's window_left does: a what-if of
    # kvdbg.moves.whatif, never a replay's default.
    dense_window: str = "symmetric"


@dataclass
class RunInfo:
    """What really ran, shown in every table and JSON record. Never pretend."""

    backend: str
    kernel: str  # e.g. "flex_attention (eager)", "prims_ts BatchDecodePagedTSWrapper", "torch emulation"
    device: str
    dtype: str  # compute / output dtype
    emulated: bool = False
    compiled: bool = False
    notes: list[str] = field(default_factory=list)
    jit_build_seconds: float | None = None  # time in kernel builds this replay made (FlashInfer's JIT), if any

    def to_json(self) -> dict[str, Any]:
        record = {"kernel": self.kernel, "device": self.device, "dtype": self.dtype, "emulated": self.emulated,
                  "compiled": self.compiled, "notes": list(self.notes)}
        if self.jit_build_seconds is not None:
            record["jit_build_seconds"] = self.jit_build_seconds
        return record


class BackendInstance(Protocol):
    builder: Any
    impl: Any

    def describe(self) -> RunInfo: ...

    def findings(self, common: CommonMetadata, metadata: Any) -> list[Finding]: ...

    def explain(self, common: CommonMetadata, metadata: Any) -> list[dict[str, Any]]:
        """Per-request builder decisions (one dict per request) for ``replay --explain``."""
        ...

    def reset(self) -> None:
        """Optional: forget what the last replay left (views of its cache, what describe() reports) before
        the instance replays another snapshot of the same layer (``kvdbg.replayer.runner.ReplayContext``)."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a backend accepts, declared on it (as vLLM's backends declare theirs) and checked in one
    place, :func:`unsupported_by`. ``None`` in a tuple field: anything.

    ``who`` names the backend in the reasons ("vLLM's FLEX_ATTENTION"); ``then`` is added to each
    reason (e.g. "vLLM would not pick it for this layer").
    """

    who: str
    model_dtypes: tuple[str, ...] | None = None
    fp8_kv_cache: bool = True
    kv_layouts: tuple[str, ...] | None = None
    layout_reason: str = ""  # why another layout cannot be handed to the kernel; {layout} is the snapshot's
    head_sizes: tuple[int, ...] | None = None
    soft_cap: bool = True
    sinks: bool = False
    alibi: bool = False
    alibi_sqrt: bool = False
    chunk_lookback: bool = False
    mm_prefix: bool = False
    rswa: bool = False
    kv_sharing: bool = False
    attn_types: tuple[str, ...] = ("decoder",)
    devices: tuple[str, ...] = ("cpu", "cuda")
    then: str = ""


def unsupported_by(caps: Capabilities, meta: "SnapshotMeta", device: str | None = None) -> str | None:
    """The first declared capability ``meta`` (and ``device``) needs and the backend lacks, as one line."""
    layer = meta.layer
    then = f"; {caps.then}" if caps.then else ""
    refusals = [
        (layer.has_sinks and not caps.sinks, "attention sinks (layer.has_sinks)"),
        (layer.has_alibi and not caps.alibi, "ALiBi slopes (layer.has_alibi)"),
        (layer.alibi_sqrt and not caps.alibi_sqrt, "square-root ALiBi (layer.alibi_sqrt)"),
        (layer.chunk_lookback is not None and not caps.chunk_lookback,
         f"chunked attention with lookback (layer.chunk_lookback = {layer.chunk_lookback})"),
        (layer.mm_prefix and not caps.mm_prefix,
         "PrefixLM multimodal attention (layer.mm_prefix: each request's bidirectional image ranges widen the "
         "mask, and a snapshot does not hold them)"),
        (layer.rswa_window is not None and not caps.rswa,
         f"Reference Sliding Window Attention (layer.rswa_window = {layer.rswa_window}: each request's "
         "globally visible prefix length shapes the mask, and a snapshot does not hold it)"),
        (bool(layer.logits_soft_cap) and not caps.soft_cap,
         f"logits soft-capping (layer.logits_soft_cap = {layer.logits_soft_cap})"),
        (layer.kv_sharing_target is not None and not caps.kv_sharing,
         f"KV sharing between layers (layer.kv_sharing_target = {layer.kv_sharing_target!r})"),
        (layer.attn_type not in caps.attn_types,
         f"attn_type {layer.attn_type!r} (it replays {', '.join(caps.attn_types)} attention only)"),
        (layer.is_fp8 and not caps.fp8_kv_cache, "an FP8 KV cache (layer.kv_cache_dtype)"),
        (caps.model_dtypes is not None and layer.dtype not in caps.model_dtypes,
         f"model dtype {layer.dtype} (layer.dtype; it takes {', '.join(caps.model_dtypes or ())})"),
        (caps.head_sizes is not None and layer.head_size not in caps.head_sizes,
         f"head size {layer.head_size} (layer.head_size; it takes {', '.join(map(str, caps.head_sizes or ()))})"),
        (device is not None and device.split(":")[0] not in caps.devices,
         f"device {device} (it runs on {', '.join(caps.devices)})"),
    ]
    for refused, what in refusals:
        if refused:
            return f"{caps.who} does not support {what}{then}"
    if caps.kv_layouts is not None and meta.kv_layout not in caps.kv_layouts:
        return caps.layout_reason.format(layout=meta.kv_layout) if caps.layout_reason else \
            f"{caps.who} does not read kv_layout {meta.kv_layout!r}"
    return None


@dataclass(frozen=True)
class BackendSpec:
    name: str  # the --backend name, e.g. "flex"
    engine_name: str  # vLLM's name, e.g. "FLEX_ATTENTION"
    summary: str
    capabilities: Capabilities
    create: Callable[["SnapshotMeta", ReplayOptions], BackendInstance]
    # What the capabilities cannot say: the environment (torch, FlashInfer, vLLM) and rules that
    # depend on several fields at once (FlashInfer's plan). None when nothing else stands in the way.
    environment_reason: Callable[["SnapshotMeta"], str | None] = lambda meta: None
    # A column that runs whichever backend the snapshot names (vLLM's own code) takes its engine name from
    # the snapshot; None: always ``engine_name``.
    engine_name_of: Callable[["SnapshotMeta"], str] | None = None
    # The real kernel's own refusal of ``meta``, as findings (FlashInfer's plan() preconditions): when the
    # backend is unavailable for that reason, the replay reports them, so that a snapshot of this backend
    # whose kernel would refuse it never passes. [] where the kernel takes it, or nothing says.
    kernel_refusals: Callable[["SnapshotMeta"], list["Finding"]] = lambda meta: []

    def engine_name_for(self, meta: "SnapshotMeta") -> str:
        """The engine backend this column runs for ``meta`` (what verdict.counted_backends matches)."""
        return self.engine_name if self.engine_name_of is None else self.engine_name_of(meta)

    def unsupported_reason(self, meta: "SnapshotMeta", device: str | None = None) -> str | None:
        """None when this backend can replay ``meta`` (on ``device``), else the one-line reason."""
        return unsupported_by(self.capabilities, meta, device) or self.environment_reason(meta)
