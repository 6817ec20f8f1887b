"""Verdicts a user can believe: no PASS on a NaN side or on nothing, no error for what vLLM does by design.

Each test drives the CLI on a real snapshot (a bundled fixture or a synthetic one) and checks the exit
code and the JSON the user would read.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli, main
from kvdbg.util.fixtures_path import fixture_path
from kvdbg.snapshot.format import LAYOUT_KV_PLANES
from kvdbg.snapshot.store import load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from kvdbg.judge.verdict import EXIT_FINDING, EXIT_INTERRUPTED, EXIT_NOTHING_VERIFIED, EXIT_OK


def replay(*args):
    res = CliRunner().invoke(cli, ["replay", *args, "--json"], catch_exceptions=False)
    return res.exit_code, json.loads(res.output)


def comparisons(data):
    return {(c["actual"], c["expected"]): c for c in data["comparisons"]}


def copy_fixture(tmp_path, name, *, cache=None, layer=None):
    snap = load_snapshot(fixture_path(name))
    if cache is not None:
        snap = dataclasses.replace(snap, kv_cache=cache(snap.kv_cache.clone()))
    if layer is not None:
        snap = dataclasses.replace(snap, meta=dataclasses.replace(
            snap.meta, layer=dataclasses.replace(snap.meta.layer, **layer)))
    return str(save_snapshot(snap, tmp_path / f"copy_{name}"))


# --------------------------------------------------------------------------- non-finite values


def test_nan_poisoned_fixture_fails_every_comparison_against_the_nan_reference(tmp_path):
    path = copy_fixture(tmp_path, "causal_gqa.safetensors", cache=lambda kv: kv.fill_(float("nan")))
    code, data = replay(path)
    assert code == EXIT_FINDING and data["passed"] is False and data["verdict"]["status"] == "fail"
    vs_ref = [c for c in data["comparisons"] if c["expected"] == "reference"]
    assert {c["actual"] for c in vs_ref} == {"flex", "flashinfer_ts", "captured"}
    for comp in vs_ref:
        elements = sum(h["num_tokens"] for h in comp["heads"]) * 128
        assert comp["passed"] is False and comp["failed_heads"] == comp["heads_compared"] == 4 * 32
        assert comp["expected_nonfinite"] == elements  # the reference is 100% NaN, and says so
        assert comp["max_abs"] is None
        assert all(h["cosine"] is None and h["max_abs"] is None for h in comp["heads"])
    by = comparisons(data)
    # The engine's captured output is finite: only the reference side is non-finite.
    assert by[("captured", "reference")]["actual_nonfinite"] == 0
    # flex ran and produced NaN: its own NaN, never "unwritten".
    assert by[("flex", "reference")]["actual_nonfinite"] > 0 and by[("flex", "reference")]["unwritten"] == 0
    assert "nonfinite_kv" in {f["code"] for f in data["findings"] if f["severity"] == "error"}


def test_nan_in_pages_before_the_window_is_read_by_no_correct_backend(tmp_path):
    snap = synth_snapshot(SynthSpec(seq_lens=(300, 90), sliding_window=32, query_len=2, dtype="float32",
                                    new_kv=False))
    first_page = int(snap.steps[0].block_table[0, 0])
    stored = int((snap.page_ids == first_page).nonzero())
    snap.kv_cache[stored] = float("nan")  # tokens 0..15 of request 0: far before its window 267..299
    path = str(save_snapshot(snap, tmp_path / "early_nan.safetensors"))
    code, data = replay(path, "--backend", "flex")
    assert code == EXIT_OK, data["verdict"]
    assert data["findings"] == []  # a page no query token may see is not scanned
    (comp,) = data["comparisons"]
    assert comp["passed"] and comp["nonfinite"] == 0


# --------------------------------------------------------------------------- nothing compared / soft cap


def test_soft_capped_layer_is_verified_against_the_captured_output(tmp_path):
    # Captured from TRITON_ATTN, which takes float32 and a soft cap (prims_ts would refuse float32).
    spec = SynthSpec(seq_lens=(40, 200), query_len=2, dtype="float32", extra_layer={"logits_soft_cap": 2.0},
                     engine_output="reference", backend="TRITON_ATTN")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "capped.safetensors"))
    code, data = replay(path)
    assert code == EXIT_OK, data["verdict"]
    unavailable = {b["name"]: b["reason"] for b in data["backends"] if not b["available"]}
    assert "soft-capping" in unavailable["flex"] and "soft-capping" in unavailable["flashinfer_ts"]
    (comp,) = data["comparisons"]
    assert (comp["actual"], comp["expected"], comp["passed"]) == ("captured", "reference", True)


def test_soft_cap_changes_the_reference_so_an_uncapped_engine_output_fails(tmp_path):
    """The fixture's engine output was computed without a cap: with the cap declared, the reference
    disagrees with it -- proof that the cap is applied and the captured output really compared."""
    path = copy_fixture(tmp_path, "causal_gqa.safetensors", layer={"logits_soft_cap": 1.0})
    code, data = replay(path)
    assert code == EXIT_FINDING
    assert comparisons(data)[("captured", "reference")]["passed"] is False


def test_nothing_compared_is_never_exit_0(tmp_path):
    spec = SynthSpec(seq_lens=(40, 200), query_len=2, extra_layer={"logits_soft_cap": 2.0})
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "capped_no_output.safetensors"))
    code, data = replay(path)
    assert code == EXIT_NOTHING_VERIFIED
    assert data["passed"] is False and data["verdict"]["status"] == "unverified" and data["comparisons"] == []
    res = CliRunner().invoke(cli, ["replay", path], catch_exceptions=False)
    assert res.exit_code == EXIT_NOTHING_VERIFIED
    assert "NOTHING VERIFIED" in res.output.splitlines()[-1]


# --------------------------------------------------------------------------- null block and aliasing


def test_null_block_before_the_window_is_a_note_and_exit_0(tmp_path):
    # A FLEX_ATTENTION snapshot: the null block is flex's rule (and `map` judges by the snapshot's backend).
    spec = SynthSpec(seq_lens=(300, 90), sliding_window=32, use_page_zero=True, page_zero_request=0,
                     dtype="float32", backend="FLEX_ATTENTION")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "null_before_window.safetensors"))
    code, data = replay(path, "--backend", "reference", "--backend", "flex")
    assert code == EXIT_OK, data["verdict"]
    (finding,) = data["findings"]
    assert (finding["code"], finding["severity"]) == ("live_page_zero", "info")
    assert "remove_skipped_blocks" in finding["message"] and finding["details"]["hidden_keys"] == 0
    res = CliRunner().invoke(cli, ["map", path, "--json"], catch_exceptions=False)
    assert res.exit_code == 0
    assert [a["code"] for a in json.loads(res.output)["anomalies"] if a["severity"] == "error"] == []


def test_null_block_that_hides_a_visible_key_is_an_error_and_exit_1(tmp_path):
    # Request 0 has 40 tokens and a 32-token window: keys 8..39 are visible, so page 0 at block 0 hides 8.
    spec = SynthSpec(seq_lens=(40, 90), sliding_window=32, use_page_zero=True, page_zero_request=0,
                     dtype="float32")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "null_in_window.safetensors"))
    code, data = replay(path, "--backend", "flex")
    assert code == EXIT_FINDING
    (finding,) = data["findings"]
    assert (finding["code"], finding["severity"], finding["details"]["hidden_keys"]) == ("live_page_zero", "error", 8)
    assert comparisons(data)[("flex", "reference")]["passed"] is False
    res = CliRunner().invoke(cli, ["map", path], catch_exceptions=False)
    assert res.exit_code == EXIT_FINDING


def test_page_reused_after_it_left_the_window_is_a_note(tmp_path):
    """vLLM frees blocks that left the window and may hand one back to the same request."""
    snap = synth_snapshot(SynthSpec(seq_lens=(300,), sliding_window=32, query_len=1, dtype="float32",
                                    new_kv=False, shuffle=False))
    table = snap.steps[0].block_table
    table[0, 2] = table[0, 17]  # block 2 (tokens 32..47) lies before the window 268..299; block 17 is live
    path = str(save_snapshot(snap, tmp_path / "reused.safetensors"))
    code, data = replay(path, "--backend", "flex")
    assert code == EXIT_OK, data["verdict"]
    codes = {(f["code"], f["severity"]) for f in data["findings"]}
    assert codes == {("page_mapped_twice", "info")}
    table[0, 16] = table[0, 17]  # block 16 (tokens 256..271) holds visible keys 268..271: now one is hidden
    path = str(save_snapshot(snap, tmp_path / "aliased.safetensors"))
    code, data = replay(path, "--backend", "flex")
    assert code == EXIT_FINDING
    assert {f["code"] for f in data["findings"] if f["severity"] == "error"} == {"page_mapped_twice"}


# --------------------------------------------------------------------------- not applicable


def test_mixed_prefill_decode_batch_that_agrees_exits_0(tmp_path):
    spec = SynthSpec(seq_lens=(100, 45, 300), query_lens=(1, 1, 64), max_decode_query_len=8,
                     backend="FLEX_ATTENTION", engine_output="reference")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "mixed.safetensors"))
    code, data = replay(path)
    assert code == EXIT_OK, data["verdict"]
    why = data["steps"][0]["runs"]["flashinfer_ts"]["not_applicable"]
    assert "max_decode_query_len 8" in why and "never runs it" in why
    assert not any(c["actual"] == "flashinfer_ts" for c in data["comparisons"])
    assert {c["actual"] for c in data["comparisons"]} == {"flex", "captured"}
    assert all(f["backend"] != "flashinfer_ts" for f in data["findings"])


def test_a_batch_the_engines_flashinfer_ts_really_ran_is_still_judged(tmp_path):
    """The engine's own backend is FLASHINFER_TS and its output is in the snapshot: a ragged batch is a bug."""
    spec = SynthSpec(seq_lens=(40, 60), query_lens=(2, 3), backend="FLASHINFER_TS", engine_output="reference")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "ragged_ts.safetensors"))
    code, data = replay(path, "--backend", "flashinfer_ts")
    assert code == EXIT_FINDING
    assert data["steps"][0]["runs"]["flashinfer_ts"]["not_applicable"] is None
    errors = {f["code"] for f in data["findings"] if f["severity"] == "error"}
    assert {"non_uniform_query_blocks", "ragged_leftover_tokens"} <= errors
    comp = comparisons(data)[("flashinfer_ts", "reference")]
    assert comp["passed"] is False and comp["unwritten"] > 0  # the leftover token is unwritten, not NaN


# --------------------------------------------------------------------------- definitions and refusals


def test_dense_window_narrower_than_the_block_uses_vllms_symmetric_rule(tmp_path):
    spec = SynthSpec(seq_lens=(100, 45), query_len=8, causal=False, sliding_window=3, dtype="float32")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "narrow.safetensors"))
    code, data = replay(path, "--backend", "flex")
    assert code == EXIT_OK, data["verdict"]  # vLLM's flex mask and the reference agree on |p - k| < w


def test_head_dim_the_kernel_rejects_is_never_an_emulated_pass(tmp_path):
    path = str(save_snapshot(synth_snapshot(SynthSpec(seq_lens=(40, 90), head_size=7)), tmp_path / "d7.safetensors"))
    code, data = replay(path)
    status = {b["name"]: b for b in data["backends"]}["flashinfer_ts"]
    assert not status["available"] and "head_dim 7" in status["reason"]
    assert not any(c["actual"] == "flashinfer_ts" for c in data["comparisons"])
    # The snapshot's own backend is FLASHINFER_TS, whose kernel refuses the layer: its error finding fails the
    # replay, whatever flex (a what-if here) does -- never exit 0. Named, flex is judged.
    assert code == EXIT_FINDING and "what-if column(s) flex pass too" in data["verdict"]["summary"]
    assert [(f["code"], f["backend"]) for f in data["findings"] if f["severity"] == "error"] == [
        ("head_dim_unsupported", "flashinfer_ts")]
    code, data = replay(path, "--backend", "flex")
    assert code == EXIT_OK
    res = CliRunner().invoke(cli, ["replay", path, "--backend", "flashinfer_ts"])
    assert res.exit_code == 2 and "head_dim 7" in res.output and "Traceback" not in res.output


def test_ctrl_c_exits_130(monkeypatch, capsys):
    import kvdbg.snapshot.info

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvdbg.snapshot.info, "summarize", interrupted)
    with pytest.raises(SystemExit) as exc:
        main(["info", fixture_path("causal_gqa.safetensors")])
    assert exc.value.code == EXIT_INTERRUPTED
    assert "interrupted" in capsys.readouterr().err


def test_main_keeps_exit_codes_of_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["info", "/nonexistent/file.safetensors"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("Error: ")
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


def test_verdict_rule_in_one_place():
    from kvdbg.judge.compare import compare, default_tolerance
    from kvdbg.judge.verdict import replay_verdict

    qsl, lens = torch.tensor([0, 1]), torch.tensor([5])
    ok = compare(torch.ones(1, 1, 2), torch.ones(1, 1, 2), qsl, lens, default_tolerance("float32"))
    empty = compare(torch.ones(1, 1, 2), torch.ones(1, 1, 2), qsl, lens, default_tolerance("float32"), heads=[])
    warn = type("F", (), {"severity": "warning", "code": "w", "backend": "replay"})()
    error = type("F", (), {"severity": "error", "code": "e", "backend": "replay"})()
    assert replay_verdict([ok], [warn]).exit_code == EXIT_OK
    assert replay_verdict([ok], [error]).exit_code == EXIT_FINDING
    assert replay_verdict([], [warn]).exit_code == EXIT_NOTHING_VERIFIED
    assert replay_verdict([empty], []).exit_code == EXIT_NOTHING_VERIFIED
    assert replay_verdict([], [error]).exit_code == EXIT_FINDING
    # What counts: a failing what-if column is named but does not set the exit code.
    bad = compare(torch.zeros(1, 1, 2), torch.ones(1, 1, 2), qsl, lens, default_tolerance("float32"),
                  actual_name="flashinfer_ts", expected_name="reference")
    captured = compare(torch.ones(1, 1, 2), torch.ones(1, 1, 2), qsl, lens, default_tolerance("float32"),
                       actual_name="captured", expected_name="reference")
    ts_error = type("F", (), {"severity": "error", "code": "table_too_narrow", "backend": "flashinfer_ts"})()
    verdict = replay_verdict([bad, captured], [ts_error], counted={"captured", "reference", "replay", "flex"})
    assert verdict.exit_code == EXIT_OK and verdict.what_if_failures == ("flashinfer_ts",)
    assert "what-if column(s) flashinfer_ts fail, not counted" in verdict.summary
    assert replay_verdict([bad, captured], [ts_error], counted={"captured", "flashinfer_ts"}).exit_code == EXIT_FINDING


def test_a_what_if_column_that_fails_is_named_but_does_not_set_the_exit_code(tmp_path):
    """A FLEX_ATTENTION capture of a causal windowed layer past window + q + page: FLASHINFER_TS (which did
    not run in this engine) would break its kernel's preconditions; the engine's output is right."""
    spec = SynthSpec(seq_lens=(1000, 200, 70), query_len=4, num_heads=4, num_kv_heads=1, head_size=64,
                     sliding_window=256, backend="FLEX_ATTENTION", engine_output="reference")
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "flex_window.safetensors"))
    code, data = replay(path)
    assert code == EXIT_OK, data["verdict"]
    assert data["verdict"]["what_if_failures"] == ["flashinfer_ts"]
    assert comparisons(data)[("flashinfer_ts", "reference")]["passed"] is False  # shown in full
    assert {"seq_len_over_max_kv_len", "table_too_narrow"} <= {f["code"] for f in data["findings"]}
    code, data = replay(path, "--backend", "flashinfer_ts")  # named, it is judged
    assert code == EXIT_FINDING


@pytest.mark.parametrize("refused", [dict(page_size=256), dict(head_size=96)], ids=["page size", "head size"])
def test_a_snapshot_its_own_kernel_refuses_never_passes(tmp_path, refused):
    """A FLASHINFER_TS capture whose layer prims_ts plan() refuses: the engine's output may agree with the
    reference, but the real kernel would not have run it. The refusal is the snapshot's own backend's error
    finding (as `kvdbg window` says), in replay and report alike."""
    code_name = "page_size_unsupported" if "page_size" in refused else "head_dim_unsupported"
    spec = SynthSpec(seq_lens=(9, 77, 300), engine_output="reference", backend="FLASHINFER_TS", **refused)
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "refused.safetensors"))
    code, data = replay(path)
    assert code == EXIT_FINDING, data["verdict"]
    assert comparisons(data)[("captured", "reference")]["passed"] is True
    found = [f for f in data["findings"] if f["code"] == code_name]
    assert [(f["backend"], f["severity"]) for f in found] == [("flashinfer_ts", "error")]
    status = {b["name"]: b for b in data["backends"]}["flashinfer_ts"]
    assert not status["available"] and "plan() rejects" in status["reason"]
    res = CliRunner().invoke(cli, ["report", path, "-o", str(tmp_path / "r.md")])
    assert res.exit_code == EXIT_FINDING and code_name in (tmp_path / "r.md").read_text()
    # Captured from FLEX_ATTENTION, the same layer is fine: FLASHINFER_TS's refusal is a what-if.
    flex = str(save_snapshot(synth_snapshot(dataclasses.replace(spec, backend="FLEX_ATTENTION", layout=LAYOUT_KV_PLANES)),
                             tmp_path / "flex.safetensors"))
    code, data = replay(flex)
    assert code == EXIT_OK and data["verdict"]["what_if_failures"] == ["flashinfer_ts"], data["verdict"]


@pytest.mark.parametrize("written", ["flex", "Flex_Attention", "flex-attention"])
def test_the_snapshots_backend_is_its_own_in_any_spelling(tmp_path, written):
    """vLLM spells FLEX_ATTENTION so; a file that names it otherwise is read as that backend, so its column is
    judged as the engine's and a failure there is not turned into a what-if."""
    spec = SynthSpec(seq_lens=(40, 70), use_page_zero=True, page_zero_request=1, engine_output="reference",
                     backend="FLEX_ATTENTION", layout=LAYOUT_KV_PLANES)
    snap = synth_snapshot(spec)
    snap = dataclasses.replace(snap, meta=dataclasses.replace(
        snap.meta, backend=dataclasses.replace(snap.meta.backend, name=written)))
    path = str(save_snapshot(snap, tmp_path / "spelled.safetensors"))
    assert load_snapshot(path).meta.backend.name == "FLEX_ATTENTION"
    code, data = replay(path)
    assert code == EXIT_FINDING and "flex" not in data["verdict"]["what_if_failures"], data["verdict"]
    assert "live_page_zero" in data["verdict"]["summary"]


def test_backend_names_are_read_in_vllms_spelling():
    from kvdbg.snapshot.format import canonical_backend_name

    assert canonical_backend_name("cpu_attn") == "CPU_ATTN"
    assert canonical_backend_name(" flashinfer-ts ") == "FLASHINFER_TS"
    assert canonical_backend_name("FLASHINFER") == "FLASHINFER"  # vLLM's other FlashInfer backend, not prims_ts
    assert canonical_backend_name("flex") == "FLEX_ATTENTION"
    for kept in ("my backend", "ünïcode", ""):
        assert canonical_backend_name(kept) == kept
