"""kvdbg.moves.whatif: a failing output named as exact attention of the layer with a feature taken away."""

from __future__ import annotations

import os

import pytest
import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.moves.whatif import WHAT_IFS, explain_output
from kvdbg.moves.conform.matrix import spec_for
from kvdbg.moves.synth import synth_snapshot
from kvdbg.replayer.runner import replay
from kvdbg.snapshot.store import load_snapshot, torch_dtype
from tests.helpers import ROOT

# A real FLASHINFER decode from the H200 (tests/flashinfer_h200/README.md): FP8, ALiBi, window, soft cap.
REAL = os.path.join(ROOT, "tests", "flashinfer_h200", "fp8_alibi_window_softcap_decode.safetensors")
# A real FLASHINFER step from the H200: FP8, ALiBi, soft cap, a dense (non-causal) mask, so SM90's FP8 prefill.
REAL_DENSE = os.path.join(ROOT, "tests", "flashinfer_h200", "fp8_alibi_softcap_dense_decode.safetensors")
# A real FLASHINFER mixed batch from the H200: one decode request on the decode kernel, three prefills on SM90's
# FP8 prefill kernel, each dropping a different feature.
REAL_MIXED = os.path.join(ROOT, "tests", "flashinfer_h200", "fp8_alibi_window_softcap_mixed.safetensors")

WHAT = {w.what: w for w in WHAT_IFS}


def _cell(row: dict, kind: str = "prefill"):
    return synth_snapshot(spec_for("TRITON_ATTN", row, kind, 0))


def _engine_computes(snapshot, whats: tuple[str, ...]) -> None:
    """Store as the engine's output exact attention of the layer changed by ``whats`` (what a backend that skips
    those features returns)."""
    variant, options = snapshot, {}
    for what in whats:
        variant = WHAT[what].change(variant)
        options.update(WHAT[what].options)
    result = replay(variant, ["reference"], ReplayOptions(device="cpu", **options))
    for step in result.steps:
        out = step.runs["reference"].output
        snapshot.steps[step.step].output = out.to(torch_dtype(snapshot.meta.layer.dtype))


@pytest.mark.parametrize("row, whats", [
    ({"alibi": "on"}, ("without ALiBi",)),
    ({"soft_cap": "on", "dtype": "float16"}, ("without the soft cap",)),
    ({"window": "short"}, ("without the sliding window",)),
    ({"window": "short", "mask": "dense"}, ("with the window bounding keys on the left only",)),
    ({"sinks": "on"}, ("without the sinks",)),
    ({"kv_cache": "fp8"}, ("with the logits scaled by the query scale once more",)),
    ({"alibi": "on", "kv_cache": "fp8"}, ("without ALiBi", "with the logits scaled by the query scale once more")),
], ids=["alibi", "soft-cap", "window", "left-window", "sinks", "q-scale", "alibi+q-scale"])
def test_an_output_that_skips_features_is_named_by_them(row, whats):
    snapshot = _cell(row)
    _engine_computes(snapshot, whats)
    found = explain_output(snapshot)
    assert found is not None and found.what == " and ".join(whats)
    assert found.max_abs < 1e-2 and "the backend " in found.sentence()


def test_an_output_no_change_of_the_layer_explains_is_left_unexplained():
    snapshot = _cell({"alibi": "on", "window": "short", "soft_cap": "on"})
    _engine_computes(snapshot, ())
    for step in snapshot.steps:
        step.output = step.output * 1.5  # wrong in a way no missing feature accounts for
    assert explain_output(snapshot) is None


def test_a_snapshot_without_an_output_or_without_features_has_nothing_to_explain():
    snapshot = _cell({"alibi": "on"})
    for step in snapshot.steps:
        step.output = None
    assert explain_output(snapshot) is None
    plain = _cell({})
    _engine_computes(plain, ())
    for step in plain.steps:
        step.output = -step.output
    assert explain_output(plain) is None  # no feature to take away


def test_flashinfers_real_fp8_decode_on_an_h200_is_attention_without_alibi_with_the_query_scale_twice():
    """FlashInfer's kernel on an H200 through vLLM 0.33's FLASHINFER (tests/flashinfer_h200/README.md): it fails
    by 1.25 against the reference; either change alone leaves it far off, both together explain it."""
    snapshot = load_snapshot(REAL)
    found = explain_output(snapshot)
    assert found is not None
    assert found.what == "without ALiBi and with the logits scaled by the query scale once more"
    assert found.max_abs < 5e-3
    alone = explain_output(snapshot, pairs=False)
    assert alone is None or alone.max_abs > 0.1  # a single change passes only by the FP8 tolerance's width


def test_flashinfers_real_fp8_prefill_on_an_h200_is_attention_without_alibi_and_without_the_soft_cap():
    """FlashInfer's SM90 FP8 prefill kernel on an H200, running a non-causal decode batch
    (tests/flashinfer_h200/README.md): it fails by 1.55; vLLM drops the ALiBi slopes and FlashInfer's FP8 variant
    the soft cap; no single change comes close."""
    snapshot = load_snapshot(REAL_DENSE)
    found = explain_output(snapshot)
    assert found is not None
    assert found.what == "without ALiBi and without the soft cap"
    assert found.max_abs < 5e-2  # the FP8 kernel's rounding of P, under a 0.29 tolerance
    assert explain_output(snapshot, pairs=False) is None


def test_conform_names_what_a_failing_cell_computed_and_a_cause_it_could_not_test_becomes_semantic():
    """A FLASHINFER-like cell (no float32 path: cause unknown) whose output is attention without ALiBi: conform's
    cell says so, in its JSON and its table, and the cause becomes semantic; a rounding cell is not asked."""
    from kvdbg.moves.conform.run import FAIL, Cell, Outcome, _what_the_output_is
    from kvdbg.render.conform import _failure_lines

    row = {"alibi": "on"}
    snapshot = _cell(row)
    _engine_computes(snapshot, ("without ALiBi",))

    class Cached:
        def run(self, row, kind, exact=False):
            return Outcome(FAIL, max_abs=0.7, snapshot=snapshot)

    class Runner:
        atol = rtol = None

    cell = Cell(2, dict(row), "prefill", FAIL, max_abs=0.7, cause="unknown",
                cause_detail="no float32 path: the backend takes float16 and bfloat16 only")
    _what_the_output_is(cell, Cached(), Runner())
    assert cell.cause == "semantic" and cell.engine_computed["what"] == "without ALiBi"
    assert cell.cause_detail.startswith("no float32 path") and "ignores the layer's ALiBi slopes" in cell.cause_detail
    assert cell.to_json()["engine_computed"]["max_abs"] < 1e-2
    lines = " ".join(text for text, _ in _failure_lines(cell))
    assert "semantic: no float32 path" in lines and "exact attention without ALiBi" in lines

    rounding = Cell(3, dict(row), "prefill", FAIL, max_abs=0.01, cause="rounding", cause_detail="passes on float32")
    _what_the_output_is(rounding, Cached(), Runner())
    assert rounding.engine_computed is None and rounding.cause_detail == "passes on float32"


def _replay(*args):
    from click.testing import CliRunner

    from kvdbg.cli import cli

    return CliRunner().invoke(cli, ["replay", *map(str, args)], env={"COLUMNS": "80", "NO_COLOR": "1"})


def test_replay_what_if_names_what_the_engines_failing_output_is_and_keeps_the_verdict():
    import json

    done = _replay(REAL, "--what-if", "--json")
    assert done.exit_code == 1, done.output
    record = json.loads(done.output)
    assert list(record)[-1] == "verdict" and record["verdict"]["exit_code"] == 1
    found = record["what_if"]["explained"]
    assert found["what"] == "without ALiBi and with the logits scaled by the query scale once more"
    assert found["max_abs"] < 5e-3 and "without ALiBi" in record["what_if"]["changes"]
    table = _replay(REAL, "--what-if")
    assert table.exit_code == 1
    lines = table.output.splitlines()
    assert lines[-1].startswith("FAIL") and "what-if: the captured output is exact attention without ALiBi" in \
        " ".join(lines)
    # A next command's path longer than the line (in a deep checkout) is shown whole, alone on its line.
    assert all(len(line) <= 80 for line in lines if not line.lstrip().startswith(REAL))


def test_replay_suggests_the_what_if_for_a_failing_engine_output_and_says_when_there_is_nothing_to_explain(tmp_path):
    plain = _replay(REAL)
    assert "--what-if" in plain.output  # a next command: the engine's output fails on a layer with features
    snapshot = _cell({"alibi": "on"})
    _engine_computes(snapshot, ())  # the engine's output is right
    from kvdbg.snapshot.store import save_snapshot

    path = save_snapshot(snapshot, str(tmp_path / "right.safetensors"))
    done = _replay(path, "--what-if")
    assert done.exit_code == 0 and "what-if: nothing to explain: the captured output passes" in done.output
    assert "--what-if" not in _replay(path).output


def test_replay_what_if_is_for_one_snapshot():
    done = _replay(REAL, REAL, "--what-if")
    assert done.exit_code == 2 and "--what-if" in done.output and "Traceback" not in done.output


def test_a_change_the_reference_refuses_is_no_explanation_and_the_others_are_still_tried(monkeypatch):
    from kvdbg.errors import SnapshotError
    from kvdbg.moves import whatif

    snapshot = _cell({"alibi": "on", "soft_cap": "on", "dtype": "float16"})
    _engine_computes(snapshot, ("without ALiBi",))
    compared = whatif._compared

    def refusing(variant, options, atol, rtol, requests):
        if variant.meta.layer.logits_soft_cap is None:  # every change that takes the soft cap away
            raise SnapshotError("meta field layer.logits_soft_cap: refused (a stand-in refusal)")
        return compared(variant, options, atol, rtol, requests)

    monkeypatch.setattr(whatif, "_compared", refusing)
    found = explain_output(snapshot)
    assert found is not None and found.what == "without ALiBi"


def _engine_computes_per_request(snapshot, whats_for) -> None:
    """Store as the engine's output, request by request, exact attention of the layer changed by
    ``whats_for(request)`` (a backend that runs a batch's requests through different kernels)."""
    outputs = {}
    for request in range(snapshot.steps[0].num_reqs):
        whats = whats_for(request)
        if whats not in outputs:
            copy = synth_snapshot(spec_for("TRITON_ATTN", ROW_SPLIT, "mixed", 0))
            _engine_computes(copy, whats)
            outputs[whats] = copy.steps[0].output
    step = snapshot.steps[0]
    qsl = step.query_start_loc.tolist()
    out = next(iter(outputs.values())).clone()
    for request in range(step.num_reqs):
        out[qsl[request]:qsl[request + 1]] = outputs[whats_for(request)][qsl[request]:qsl[request + 1]]
    step.output = out


ROW_SPLIT = {"alibi": "on", "soft_cap": "on", "dtype": "float16"}


def test_a_batch_whose_requests_each_skip_a_different_feature_is_named_request_by_request():
    """Request 0 computed without ALiBi, the others without the soft cap: no one change explains the batch; per
    request each is named, and narrowing to one request gives that request's change alone."""
    from kvdbg.moves.whatif import OutputExplained, SplitExplained

    snapshot = synth_snapshot(spec_for("TRITON_ATTN", ROW_SPLIT, "mixed", 0))
    num_reqs = snapshot.steps[0].num_reqs
    assert num_reqs >= 3
    _engine_computes_per_request(snapshot, lambda r: ("without ALiBi",) if r == 0 else ("without the soft cap",))
    found = explain_output(snapshot)
    assert isinstance(found, SplitExplained)
    assert [([key[1] for key in keys], part.what) for keys, part in found.parts] == [
        ([0], "without ALiBi"), (list(range(1, num_reqs)), "without the soft cap")]
    assert found.what == f"per request: request 0 without ALiBi; requests 1-{num_reqs - 1} without the soft cap"
    assert found.max_abs < 1e-2 and "no one change of the layer explains every request" in found.sentence()
    record = found.to_json()
    assert [r["what"] for r in record["requests"]] == ["without ALiBi", "without the soft cap"]
    assert record["requests"][0]["step_requests"] == [[0, 0]]
    alone = explain_output(snapshot, requests=[1])
    assert isinstance(alone, OutputExplained) and alone.what == "without the soft cap"


def test_a_request_that_passes_as_the_layer_is_needs_no_change_and_one_no_change_explains_leaves_it_unexplained():
    from kvdbg.moves.whatif import SplitExplained

    snapshot = synth_snapshot(spec_for("TRITON_ATTN", ROW_SPLIT, "mixed", 0))
    _engine_computes_per_request(snapshot, lambda r: ("without ALiBi",) if r == 0 else ())
    found = explain_output(snapshot)
    assert isinstance(found, SplitExplained)
    assert [part.what_ifs == () for _, part in found.parts] == [False, True]
    assert "as the layer is" in found.what and "of the layer as it is" in found.sentence()
    step = snapshot.steps[0]
    last = step.query_start_loc.tolist()[-2]
    step.output[last:] = step.output[last:] * 1.5  # the last request: wrong in a way no change accounts for
    assert explain_output(snapshot) is None


def test_flashinfers_real_mixed_batch_on_an_h200_runs_two_kernels_each_dropping_something_else():
    """A mixed FP8 batch through vLLM 0.33's FLASHINFER on an H200 (tests/flashinfer_h200/README.md): the decode
    request ran the decode kernel (no ALiBi, the query scale twice), the prefills SM90's FP8 prefill kernel (no
    ALiBi, no soft cap). No one change explains the batch; the what-if names each request's."""
    found = explain_output(load_snapshot(REAL_MIXED))
    assert found is not None and found.what == (
        "per request: request 0 without ALiBi and with the logits scaled by the query scale once more; "
        "requests 1-3 without ALiBi and without the soft cap")
    assert found.max_abs < 0.1  # FP8 P rounding, under a 0.31 tolerance
    done = _replay(REAL_MIXED, "--what-if", "--json")
    assert done.exit_code == 1
    import json

    record = json.loads(done.output)["what_if"]
    assert record["explained"]["what"] == found.what and record["said"].startswith("no one change")
