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

from kvdbg.findings import Finding  # what a backend's findings() returns (codes from kvdbg.findings.CODES)

if TYPE_CHECKING:  # torch stays out of module import time
    import torch

    from kvdbg.format import SnapshotMeta


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

    def to_json(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "device": self.device, "dtype": self.dtype, "emulated": self.emulated,
                "compiled": self.compiled, "notes": list(self.notes)}


class BackendInstance(Protocol):
    builder: Any
    impl: Any

    def describe(self) -> RunInfo: ...

    def findings(self, common: CommonMetadata, metadata: Any) -> list[Finding]: ...

    def explain(self, common: CommonMetadata, metadata: Any) -> list[dict[str, Any]]:
        """Per-request builder decisions (one dict per request) for ``replay --explain``."""
        ...


@dataclass(frozen=True)
class BackendSpec:
    name: str  # the --backend name, e.g. "flex"
    engine_name: str  # vLLM's name, e.g. "FLEX_ATTENTION"
    summary: str
    # Returns None when the backend can replay this snapshot, else the reason it cannot.
    unsupported_reason: Callable[["SnapshotMeta"], str | None]
    create: Callable[["SnapshotMeta", ReplayOptions], BackendInstance]
