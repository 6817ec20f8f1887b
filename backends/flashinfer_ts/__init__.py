"""vLLM's FLASHINFER_TS: prims_ts paged decode, on the real kernel where it can run, else its contract in torch.

The builder reproduces the specified FLASHINFER_TS builder's decisions exactly -- uniform query
blocks, the no-op batch, persistent int32 buffers, the page-aligned window
restriction for dense windowed layers, plans keyed by (num_reqs, query_len,
causal) with one constant max_kv_len. The kernel runs with ``validate=False``,
so :meth:`FlashInferTSInstance.findings` checks every documented precondition
of each batch the builder produces; what the real kernel does with a batch
that breaks one is undefined, and that is usually the bug being chased.

The package owns this backend, one module per role, each importing only those
before it: ``gate`` (can the real kernel run here) <- ``builder`` (what vLLM
refuses, dtypes, the metadata builder) <- ``impl`` (the kernel call or its
emulation; ``triton_decode``, the Triton emulation, is loaded by it only when
used) <- ``instance`` (what ran, findings, explain) <- this module (``create``,
``BACKEND``, and the names other code imports from here). Outside the package
it may import kvdbg.errors, kvdbg.util, kvdbg.judge, kvdbg.ts, kvdbg.snapshot
and kvdbg.backends; flashinfer only inside ``gate._import_prims_ts``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdbg.backends.base import BackendSpec, ReplayOptions
from kvdbg.errors import BackendUnavailable
from kvdbg.backends.flashinfer_ts.gate import MIN_FLASHINFER, KernelGate, installed_api, kernel_gate, parse_version
from kvdbg.backends.flashinfer_ts.builder import (
    CAPABILITIES,
    FlashInferTSBuilder,
    FlashInferTSMetadata,
    TSPlan,
    _buffer_rows,
    _plan_reason,
    _plan_violations,
    kv_kernel_dtype,
    ts_output_dtype,
    unsupported_reason,
)
from kvdbg.backends.flashinfer_ts.impl import (
    FP8_P_CAVEAT,
    FP8_P_SCALE,
    TRITON_ABOVE_BYTES,
    TRITON_ABOVE_REQUESTS,
    UNDEFINED_CODES,
    FlashInferTSImpl,
    emulate_decode,
    fp8_rounded_attention,
    undefined_codes,
    undefined_requests,
    view_violations,
)
from kvdbg.backends.flashinfer_ts.instance import (
    EMULATED_KERNEL,
    EMULATED_KERNEL_TRITON,
    ENGINE_NAME,
    NAME,
    SQ1_RANK_NOTE,
    FlashInferTSInstance,
)

if TYPE_CHECKING:
    from kvdbg.snapshot.format import SnapshotMeta

__all__ = [
    "BACKEND", "CAPABILITIES", "EMULATED_KERNEL", "EMULATED_KERNEL_TRITON", "ENGINE_NAME", "FP8_P_CAVEAT",
    "FP8_P_SCALE", "MIN_FLASHINFER", "NAME", "SQ1_RANK_NOTE", "TRITON_ABOVE_BYTES", "TRITON_ABOVE_REQUESTS",
    "UNDEFINED_CODES", "FlashInferTSBuilder", "FlashInferTSImpl", "FlashInferTSInstance", "FlashInferTSMetadata",
    "KernelGate", "TSPlan", "_buffer_rows", "create", "emulate_decode", "fp8_rounded_attention", "installed_api",
    "kernel_gate", "kv_kernel_dtype", "parse_version", "ts_output_dtype", "undefined_codes", "undefined_requests",
    "unsupported_reason", "view_violations",
]


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
