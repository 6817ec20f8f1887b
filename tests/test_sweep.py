"""`kvdbg sweep`: the prefix_page0 acceptance, variants known by construction, flips, exit codes, JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import types

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.snapshot.store import load_snapshot
from kvdbg.moves.sweeper import (free_page_id, parse_knobs, relabel_pages, retype_snapshot, shorten_queries, sweep,
                         sweep_verdict)
from kvdbg.moves.synth import SynthSpec, synth_snapshot

from tests.helpers import FIXTURES, assert_close_ulps

PREFIX_PAGE0 = os.path.join(FIXTURES, "prefix_page0.safetensors")


def run(*args):
    return CliRunner().invoke(cli, ["sweep", *args], env={"NO_COLOR": "1", "COLUMNS": "100"})


def strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


@pytest.fixture(scope="module")
def prefix_page0_json():
    res = run(PREFIX_PAGE0, "--vary", "placement", "--json")
    return res.exit_code, strict(res.output)


def test_prefix_page0_flex_depends_on_page_0_and_nothing_else_does(prefix_page0_json):
    code, data = prefix_page0_json
    assert code == 1
    rows = {r["variant"]: r for r in data["rows"]}
    assert list(rows)[0] == "baseline"
    assert [c["name"] for c in data["columns"]] == ["reference", "flex"]
    assert rows["baseline"]["cells"]["flex"]["status"] == "fail"
    kept = [name for name in rows if "page 0 kept" in name]
    moved = [name for name in rows if "page 0 moved" in name]
    assert len(kept) == 2 and len(moved) == 1
    for name in kept:  # pages permuted, page 0 still at 0: flex still masks request 1's keys there
        assert rows[name]["cells"]["flex"]["status"] == "fail" and not rows[name]["flipped"]
    assert rows[moved[0]]["cells"]["flex"]["status"] == "pass"
    assert rows[moved[0]]["flipped"] == ["flex"]
    for name in rows:  # the reference reproduces itself under every placement
        if name != "baseline":
            ref = rows[name]["cells"]["reference"]
            assert ref["status"] == "pass" and ref["max_abs"] == 0.0 and not ref["flipped"]
    summary = data["verdict"]["summary"]
    # The snapshot's own verdict first (what `kvdbg replay` says), then the variants, never counted.
    assert summary.startswith("FAIL: 2 of 2 comparison(s) failed (flex vs reference); 2 error finding(s) "
                              "(live_page_zero); variants (what-if, not counted): verdict flips: flex under "
                              "placement: page 0 moved to")
    assert "never flips: reference" in summary


def test_prefix_page0_table_marks_the_flip():
    res = run(PREFIX_PAGE0, "--vary", "placement")
    assert res.exit_code == 1, res.output
    row = [line for line in res.output.splitlines() if "page 0 moved" in line][0]
    assert "▶pass" in row and "FAIL" not in row
    assert sum("▶" in line for line in res.output.splitlines() if "│" in line) == 1
    assert "flashinfer_ts:" in res.output  # no column: it cannot run this layout, and the notes say why
    assert res.output.rstrip().splitlines()[-1].endswith("(exit 1)")


# --------------------------------------------------------------------------- variants by construction


def test_relabel_moves_data_and_ids_together():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 20), query_len=2, causal=True))
    ids = sorted(int(p) for p in snap.page_ids.tolist())
    mapping = dict(zip(ids, ids[::-1]))
    moved = relabel_pages(snap, mapping)
    assert sorted(moved.page_ids.tolist()) == ids
    assert moved.page_ids.tolist() == sorted(moved.page_ids.tolist())  # stored in id order
    for old in ids:  # the page renamed old -> new holds old's bytes
        i_old = snap.page_ids.tolist().index(old)
        i_new = moved.page_ids.tolist().index(mapping[old])
        assert torch.equal(snap.kv_cache[i_old], moved.kv_cache[i_new])
    table = snap.steps[0].block_table
    assert moved.steps[0].block_table.tolist() == [[mapping.get(p, p) for p in row] for row in table.tolist()]
    slots = snap.steps[0].slot_mapping.tolist()
    ps = snap.page_size
    assert moved.steps[0].slot_mapping.tolist() == [mapping[s // ps] * ps + s % ps for s in slots]


def test_free_page_id_skips_every_used_id():
    snap = synth_snapshot(SynthSpec(seq_lens=(40,), query_len=1, stale_tail=2, use_page_zero=True))
    used = set(snap.page_ids.tolist()) | set(snap.steps[0].block_table.flatten().tolist())
    free = free_page_id(snap)
    assert free not in used and free >= 1 and all(p in used for p in range(1, free))


def test_retyped_cache_holds_the_dequantised_values():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 24), query_len=2, fp8=True, q_scale=0.05, k_scale=0.03,
                                    v_scale=0.04, causal=False))
    as_fp16 = retype_snapshot(snap, "float16", False)
    k8, v8 = snap.kv_views()
    k16, v16 = as_fp16.kv_views()
    assert k16.dtype == torch.float16 and as_fp16.meta.layer.kv_cache_dtype == "auto"
    assert_close_ulps(k16.float(), (k8.float() * 0.03).half().float())
    assert_close_ulps(v16.float(), (v8.float() * 0.04).half().float())
    assert as_fp16.steps[0].output is None and as_fp16.steps[0].query.dtype == torch.float16
    back = retype_snapshot(as_fp16, "bfloat16", True, (0.05, 0.03, 0.04))
    assert back.kv_cache.dtype == torch.uint8 and back.meta.layer.k_scale == 0.03
    # e4m3 -> x0.03 -> fp16 -> /0.03 -> e4m3 returns the same bytes wherever fp16 held the value exactly.
    same = (back.kv_cache == snap.kv_cache).float().mean()
    assert same > 0.99


def test_shorter_queries_keep_the_last_tokens_and_their_reference_rows():
    snap = synth_snapshot(SynthSpec(seq_lens=(40, 30), query_lens=(4, 2), causal=True, engine_output="reference"))
    short, kept = shorten_queries(snap, 1)
    assert kept[0].tolist() == [3, 5]
    assert short.steps[0].query_start_loc.tolist() == [0, 1, 2]
    assert torch.equal(short.steps[0].output, snap.steps[0].output[[3, 5]])
    result = sweep(snap, ["query-len"], ["reference"])
    rows = {r.variant.name: r for r in result.rows}
    # The exact output of a token depends on its own position only: dropping the others changes nothing.
    for name in ("query-len: last 1", "query-len: last 2"):
        assert rows[name].cells["reference"].status == "pass", rows[name].cells
        assert rows[name].cells["captured"].status == "pass"


class _ContiguousInstance:
    """A broken consumer that assumes a request's pages sit at consecutive physical indices after its first."""

    def __init__(self, meta, options):
        from kvdbg.backends.reference import ReferenceInstance

        self.inner = ReferenceInstance(meta, options)
        self.impl = self.inner.impl
        self.output_dtype = getattr(self.inner, "output_dtype", None)  # as exact as the reference it wraps
        outer = self

        class Builder:
            def build(self, common):
                first = common.block_table[:, :1].clamp_min(0)
                cols = torch.arange(common.block_table.shape[1], device=first.device)
                table = (first + cols).clamp_max(common.num_pages - 1)
                return outer.inner.builder.build(dataclasses.replace(common, block_table=table))

        self.builder = Builder()

    def describe(self):
        return self.inner.describe()


@pytest.fixture
def contiguous_backend(monkeypatch):
    from kvdbg import backends
    from kvdbg.backends.base import BackendSpec, Capabilities

    module = types.ModuleType("kvdbg_test_contiguous")
    module.BACKEND = BackendSpec(name="contiguous", engine_name="CONTIGUOUS", summary="assumes contiguous pages",
                                 capabilities=Capabilities(who="contiguous"), create=_ContiguousInstance)
    monkeypatch.setitem(sys.modules, "kvdbg_test_contiguous", module)
    monkeypatch.setitem(backends.BACKEND_MODULES, "contiguous", "kvdbg_test_contiguous")


def test_a_placement_dependent_backend_flips_and_the_reference_never_does(contiguous_backend):
    # Unshuffled pages: each request's pages are consecutive, so the broken backend is right as captured.
    snap = synth_snapshot(SynthSpec(seq_lens=(70, 40), query_len=1, shuffle=False))
    result = sweep(snap, ["placement"], ["reference", "contiguous"], required=["contiguous"])
    base, *variants = result.rows
    assert base.cells["contiguous"].status == "pass"
    ran = [r for r in variants if r.variant.skipped is None]
    assert ran and all(r.cells["contiguous"].status == "fail" and r.cells["contiguous"].flipped for r in ran)
    assert all(r.cells["reference"].status == "pass" and not r.cells["reference"].flipped for r in ran)
    verdict = sweep_verdict(result)
    # The snapshot as captured passes (so does its replay); the flips are what-ifs, named and not counted.
    assert verdict.exit_code == 0 and verdict.summary.startswith("PASS: ")
    assert "variants (what-if, not counted): verdict flips: contiguous under placement: reversed" in verdict.summary
    assert "never flips: reference" in verdict.summary


class _RefusesFp8Instance(_ContiguousInstance):
    """A backend that runs as the reference does but refuses an FP8 cache, as vLLM's CPU_ATTN does on a CPU
    without AVX-512 (BackendUnavailable, in its own words)."""

    def __init__(self, meta, options):
        from kvdbg.errors import BackendUnavailable

        if meta.layer.is_fp8:
            raise BackendUnavailable("FP8 KV cache refused on this CPU")
        super().__init__(meta, options)
        self.builder = self.inner.builder  # the reference's own pages: right


def test_a_backend_that_cannot_run_under_a_variant_is_said_in_the_verdict(monkeypatch):
    """A backend that ran as captured but could not run under a variant: its cell is n/a with the backend's reason,
    and the verdict's summary names it (the variant compared nothing of it), rather than 'no variant flips'
    alone."""
    from kvdbg import backends
    from kvdbg.backends.base import BackendSpec, Capabilities

    module = types.ModuleType("kvdbg_test_refuses_fp8")
    module.BACKEND = BackendSpec(name="refuses_fp8", engine_name="REFUSES_FP8", summary="refuses FP8 caches",
                                 capabilities=Capabilities(who="refuses_fp8"), create=_RefusesFp8Instance)
    monkeypatch.setitem(sys.modules, "kvdbg_test_refuses_fp8", module)
    monkeypatch.setitem(backends.BACKEND_MODULES, "refuses_fp8", "kvdbg_test_refuses_fp8")
    snap = synth_snapshot(SynthSpec(seq_lens=(50, 33), query_len=1))
    result = sweep(snap, ["kv-dtype"], ["reference", "refuses_fp8"], required=["refuses_fp8"])
    rows = {r.variant.name: r for r in result.rows}
    fp8 = [name for name in rows if "fp8" in name]
    assert fp8 and rows["baseline"].cells["refuses_fp8"].status == "pass", rows["baseline"].cells
    for name in fp8:
        cell = rows[name].cells["refuses_fp8"]
        assert cell.status == "n/a" and "FP8 KV cache refused on this CPU" in cell.reason
        assert rows[name].to_json()["not_run"] == [{"backend": "refuses_fp8", "reason": cell.reason}]
    assert all(not r.not_run for name, r in rows.items() if name not in fp8)
    verdict = sweep_verdict(result)
    assert verdict.exit_code == 0  # the snapshot as captured passes; a variant is a what-if
    assert f"could not run: refuses_fp8 under {fp8[0]} (" in verdict.summary, verdict.summary
    # A backend that could not run as captured either is not listed variant by variant.
    result.rows[0].not_run.append(("refuses_fp8", "refused as captured too"))
    assert "could not run" not in sweep_verdict(result).summary


def test_a_correct_snapshot_passes_every_exact_answer_knob():
    snap = synth_snapshot(SynthSpec(seq_lens=(50, 33), query_len=2, causal=True, sliding_window=24,
                                    engine_output="reference", backend="FLEX_ATTENTION"))
    result = sweep(snap, ["placement", "query-len", "flex-block"], ["reference", "flex"])
    assert [c.counted for c in result.columns] == [True, True, True]  # flex is this snapshot's own backend
    verdict = sweep_verdict(result)
    assert verdict.exit_code == 0, (verdict.summary, [(r.variant.name, r.cells) for r in result.rows])
    assert not any(r.flipped for r in result.rows)
    assert all(c.status == "pass" for r in result.rows[1:] if r.variant.skipped is None for c in r.cells.values())


def test_knobs_that_move_the_answer_compare_with_the_variant_reference_only():
    snap = synth_snapshot(SynthSpec(seq_lens=(60, 30), query_len=2, causal=False, sliding_window=20,
                                    engine_output="reference"))
    result = sweep(snap, ["window", "kv-dtype"], ["reference", "flex"])
    rows = {r.variant.name: r for r in result.rows}
    assert set(rows) >= {"window: none", "window: 19", "window: 21", "kv-dtype: fp16"}
    for name, row in rows.items():
        if name == "baseline":
            continue
        assert row.cells["captured"].status == "n/a"
        assert row.cells["reference"].status == "moves"
        # A window or an fp8 cache moves the exact answer; bf16 values re-stored as fp16 are exact (no move).
        assert (row.cells["reference"].max_abs > 0) == (name != "kv-dtype: fp16"), name
        assert row.cells["flex"].status == "pass"
    assert sweep_verdict(result).exit_code == 0


def test_rows_that_cannot_apply_say_why_and_do_not_fail():
    snap = synth_snapshot(SynthSpec(seq_lens=(20,), query_len=1, causal=True, engine_output="reference"))
    result = sweep(snap, ["scales", "window", "query-len", "device"], ["reference"])
    reasons = {r.variant.knob: r.variant.skipped for r in result.rows[1:]}
    assert "scales apply only to an FP8 cache" in reasons["scales"]
    assert reasons["window"] == "the layer has no sliding window"
    assert "nothing shorter" in reasons["query-len"]
    if not torch.cuda.is_available():
        assert reasons["device"] and next(r for r in result.rows if r.variant.knob == "device").variant.unavailable_here
    verdict = sweep_verdict(result)
    assert verdict.exit_code == 0 and verdict.summary.startswith("PASS")


def test_only_the_reference_and_no_engine_output_verifies_nothing():
    res = run(os.path.join(FIXTURES, "prefix_page0.safetensors"), "--vary", "placement", "--backend", "reference")
    assert res.exit_code == 3, res.output
    assert "NOTHING VERIFIED: " in " ".join(res.output.split()) and res.output.rstrip().endswith("(exit 3)")


def test_a_baseline_that_compared_nothing_is_never_agreed_with(tmp_path):
    """A ragged batch FLASHINFER_TS's builder does not run, with no captured output: only the variants that even
    out the queries compare anything. 'The baseline and its variants agree' would be a claim that did not happen."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    for window in (4096, 64):
        spec = SynthSpec(seq_lens=(300, 200), query_lens=(8, 4), causal=False, sliding_window=window)
        path = str(save_snapshot(synth_snapshot(spec), tmp_path / f"ragged{window}.safetensors"))
        res = run(path, "--vary", "query-len", "--json")
        verdict = strict(res.output)["verdict"]
        replayed = strict(CliRunner().invoke(cli, ["replay", path, "--json"]).output)["verdict"]
        # the snapshot's verdict is the replay's, whatever the variants compare
        assert res.exit_code == replayed["exit_code"] == 3, verdict
        assert verdict["status"] == replayed["status"] and verdict["comparisons"] == replayed["comparisons"]
        assert "variant(s) agree" not in verdict["summary"] and "baseline passes" not in verdict["summary"]
        assert "variants (what-if, not counted)" in verdict["summary"] or \
            "no variant flips a verdict" in verdict["summary"]


# --------------------------------------------------------------------------- options


def test_parse_knobs_orders_and_expands():
    assert parse_knobs("window,placement") == ["placement", "window"]
    assert parse_knobs(None) == parse_knobs("all") and len(parse_knobs(None)) == 8
    assert parse_knobs(["kv_dtype", "compile"]) == ["kv-dtype", "compile"]


@pytest.mark.parametrize("args, message", [
    (["--vary", "placment"], "Error: --vary: unknown knob 'placment'; did you mean placement? (choose from: "
                             "placement, kv-dtype, scales, window, query-len, flex-block, compile, device, all)"),
    (["--vary", ","], "Error: --vary: give at least one knob (placement, kv-dtype, scales, window, query-len, "
                      "flex-block, compile, device, all)"),
    (["--vary", "window", "--step", "5"], "Error: --step 5 is out of range: the snapshot has 2 step(s)"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    res = run(PREFIX_PAGE0, *args)
    assert res.exit_code == 2
    assert res.output.strip() == message


def test_report_includes_the_matrix_when_asked():
    res = CliRunner().invoke(cli, ["report", PREFIX_PAGE0, "--sweep", "placement"], env={"NO_COLOR": "1"})
    assert res.exit_code == 1, res.output
    assert "## Sweep: placement" in res.output
    assert "| variant | reference | flex |" in res.output
    assert "**▶pass" in res.output and "**Sweep verdict:** FAIL" in res.output
    bad = CliRunner().invoke(cli, ["report", PREFIX_PAGE0, "--sweep", "windw"])
    assert bad.exit_code == 2 and "did you mean window?" in bad.output


def test_progress_stays_off_a_pipe(tmp_path):
    res = CliRunner().invoke(cli, ["sweep", PREFIX_PAGE0, "--vary", "placement", "--backend", "flex", "--json"])
    strict(res.output)  # nothing but the JSON on stdout


def test_sweep_never_writes_the_snapshot():
    snap = load_snapshot(PREFIX_PAGE0)
    before = snap.kv_cache.clone()
    sweep(snap, ["placement", "kv-dtype"], ["reference", "flex"])
    assert torch.equal(before, snap.kv_cache)


@pytest.mark.parametrize("width", [60, 80, 120])
def test_matrix_reads_whole_at_common_widths(width):
    res = CliRunner().invoke(cli, ["sweep", PREFIX_PAGE0, "--vary", "placement"],
                             env={"NO_COLOR": "1", "COLUMNS": str(width)})
    assert res.exit_code == 1
    assert all(len(line) <= width for line in res.output.splitlines())
    assert "hidden at" not in res.output  # variant, reference and flex always fit
    assert "▶pass 2.6e-03" in res.output


def test_report_names_its_own_option_for_an_unknown_knob():
    from tests.helpers import FIXTURES

    res = CliRunner().invoke(cli, ["report", os.path.join(FIXTURES, "dflash.safetensors"), "--sweep", "nosuch"])
    assert res.exit_code == 2
    assert res.output.strip().splitlines() == [
        # the old spelling --sweep still works; the error names the option by its one spelling, --vary
        "Error: --vary: unknown knob 'nosuch' (choose from: placement, kv-dtype, scales, window, query-len, "
        "flex-block, compile, device, all)"]


def test_a_sweep_cell_quotes_its_failing_heads_error_never_a_passing_heads():
    from kvdbg.judge.compare import Tolerance, compare
    from kvdbg.moves.sweeper import _worst

    expected = torch.zeros(1, 2, 4)
    actual = expected.clone()
    actual[0, 0] = 0.01  # head 0: off by 0.01, within tolerance
    actual[0, 1] = float("nan")  # head 1: fails with no finite number to quote
    comp = compare(actual, expected, torch.tensor([0, 1]), torch.tensor([3]), Tolerance(atol=0.1, rtol=0.0, source="test"))
    assert [h.passed for h in comp.heads] == [True, False] and comp.max_abs == pytest.approx(0.01)
    assert _worst([comp]) is None  # not 0.01: that is the passing head's
    actual[0, 1] = 0.5
    comp = compare(actual, expected, torch.tensor([0, 1]), torch.tensor([3]), Tolerance(atol=0.1, rtol=0.0, source="test"))
    assert _worst([comp]) == pytest.approx(0.5)
