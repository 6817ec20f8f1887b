"""A replay that ran FlashInfer's real paged kernel (the vllm column on vLLM's FLASHINFER) beside the FLASHINFER_TS
emulation says what their difference is: finding two_flashinfers (info), over the decode requests both wrote."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvdbg.backends.base import CommonMetadata
from kvdbg.judge.findings import lookup
from kvdbg.replayer.runner import two_flashinfers


def _common(query_lens):
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return SimpleNamespace(step=0, query_start_loc=torch.tensor(starts, dtype=torch.int32))


def _runs(tokens, offset=0.0):
    gen = torch.Generator().manual_seed(0)
    real = torch.randn(tokens, 4, 8, generator=gen)
    emulated = real.clone()
    emulated[:, 2] += offset
    return {"vllm": SimpleNamespace(output=real, written=None),
            "flashinfer_ts": SimpleNamespace(output=emulated, written=None)}


def test_the_difference_over_the_decode_requests_is_an_info_finding_saying_what_it_is():
    statuses = [SimpleNamespace(name="vllm", engine_name="FLASHINFER")]
    runs = _runs(8, offset=3e-4)
    runs["flashinfer_ts"].output[3:7] = 100.0  # the prefill request's rows: the decode-only emulation skips them
    (finding,) = two_flashinfers(statuses, runs, _common([1, 1, 1, 4, 1]))
    assert finding.code == "two_flashinfers" and finding.severity == "info" and finding.requests == [0, 1, 2, 4]
    assert abs(finding.details["max_abs"] - 3e-4) < 1e-6
    assert "two kernels of one attention" in finding.message and "3.0e-04" in finding.message
    assert "not a finding" in lookup("two_flashinfers").means


def test_nothing_is_said_without_both_columns_flashinfer_or_a_decode():
    flashinfer = [SimpleNamespace(name="vllm", engine_name="FLASHINFER")]
    triton = [SimpleNamespace(name="vllm", engine_name="TRITON_ATTN")]
    assert two_flashinfers(triton, _runs(3), _common([1, 1, 1])) == []
    assert two_flashinfers(flashinfer, {"vllm": _runs(3)["vllm"]}, _common([1, 1, 1])) == []
    assert two_flashinfers(flashinfer, _runs(8), _common([4, 4])) == []


def test_a_decode_row_the_emulation_left_unwritten_is_not_counted_as_rounding():
    statuses = [SimpleNamespace(name="vllm", engine_name="FLASHINFER")]
    runs = _runs(3, offset=1e-4)
    runs["flashinfer_ts"].output[1] = 0.0  # a request the emulated kernel did not run
    runs["flashinfer_ts"].written = torch.tensor([True, False, True])
    (finding,) = two_flashinfers(statuses, runs, _common([1, 1, 1]))
    assert finding.requests == [0, 2] and finding.details["max_abs"] < 2e-4
