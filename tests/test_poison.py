"""`kvdbg poison`: regions known by construction, who reads them, the DFlash acceptance, and exit codes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.moves.poisoner import REGIONS, poison, poison_regions
from kvdbg.snapshot.store import Snapshot, Step, load_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot

from tests.helpers import FIXTURES

DFLASH = os.path.join(FIXTURES, "dflash.safetensors")


def run(*args):
    return CliRunner().invoke(cli, ["poison", *args], env={"NO_COLOR": "1", "COLUMNS": "80"})


def regions_of(snap, step=0):
    return {r.name: r for r in poison_regions(snap, step)}


def protected_slots(snap, step):
    """(engine page, offset) of every key some query token of some request must see, computed apart."""
    s = snap.steps[step]
    ps, window = snap.page_size, snap.meta.layer.sliding_window
    out = set()
    for r, (row, length) in enumerate(zip(s.block_table.tolist(), s.seq_lens.tolist())):
        q = s.query_lens[r]
        first = 0 if window is None else max(0, length - q - window + 1)
        for key in range(first, length):
            out.add((row[key // ps], key % ps))
    return out


@pytest.fixture(scope="module")
def dflash_json():
    res = run(DFLASH, "--backend", "reference", "--backend", "flex", "--backend", "flashinfer_ts", "--json")
    return res.exit_code, json.loads(res.output)


def test_dflash_flashinfer_ts_reads_the_keys_just_before_the_window(dflash_json):
    code, data = dflash_json
    # FLASHINFER_TS's page-aligned window restriction keeps those keys by design (documented): named, not failed.
    assert code == 0
    results = {b["backend"]: b for b in data["steps"][0]["results"]}
    assert not results["reference"]["reads_poisoned"] and not results["flex"]["reads_poisoned"]
    ts = results["flashinfer_ts"]
    assert not ts["reads_poisoned"] and ts["reads_by_design"]
    by_region = {r["region"]: r for r in ts["regions"]}
    before = by_region["before_window"]
    assert before["status"] == "reads by design"
    # Request 0 (L=9000, q=8, w=4096): its first visible key is 4897; the page-aligned restriction keeps page
    # 306 whole, so every one of its 8 query tokens on all 4 heads weights key 4896 -- and nothing else.
    assert (before["requests"], before["heads"], before["tokens"]) == (1, 4, 8)
    assert {o["request"] for o in before["outputs"]} == {0}
    assert [c["keys"] for c in before["culprits"]] == [[{"request": 0, "first": 4896, "last": 4896}]]
    assert before["bisect_complete"]
    assert all(r["status"] in ("clean", "empty") for r in ts["regions"] if r["region"] != "before_window")
    assert data["verdict"]["exit_code"] == 0 and data["verdict"]["summary"].startswith("PASS: ")
    assert "flashinfer_ts read(s) only the keys FLASHINFER_TS's page-aligned window restriction shows by design" \
        in data["verdict"]["summary"]
    assert [(f["backend"], f["code"], f["severity"]) for f in data["findings"]] == \
        [("flashinfer_ts", "window_restriction_extra_keys", "warning")]


def test_dflash_table_and_verdict_line():
    res = run(DFLASH, "--backend", "flashinfer_ts")
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "│ before_window │ 4897 │ 1/4/8 │ - │ reads by design │" in out
    assert "page 659 token 0 = request 0 key 4896" in out
    assert out.startswith("flashinfer_ts") and out.endswith("(exit 0)")
    assert "PASS: " in out and "shows by design (documented, not a failure)" in out


def test_dflash_flex_loads_masked_slots_without_weighting_them(dflash_json):
    """Flex's tiles hold the slots next to the window's edge: NaN values reach its output as 0 x NaN."""
    _, data = dflash_json
    flex = {r["region"]: r for b in data["steps"][0]["results"] if b["backend"] == "flex" for r in b["regions"]}
    assert flex["before_window"]["status"] == "loads masked" and flex["before_window"]["outputs"] == []
    ref = [b for b in data["steps"][0]["results"] if b["backend"] == "reference"][0]
    assert all(r["status"] in ("clean", "empty") for r in ref["regions"])


def test_regions_of_a_causal_window_are_known_by_construction():
    # L=100, q=1, w=32: keys 0..67 are outside every window (first visible key 100 - 1 - 32 + 1 = 68),
    # and the last page (block 6, keys 96..111) holds 12 slots past seq_len.
    snap = synth_snapshot(SynthSpec(seq_lens=(100,), query_len=1, sliding_window=32, causal=True))
    regions = regions_of(snap)
    assert regions["before_window"].slots == 68
    assert regions["past_seq_len"].slots == 12
    assert regions["unreferenced"].slots == regions["stale_tail"].slots == 0


def test_causal_windowed_snapshot_flex_and_reference_read_nothing():
    snap = synth_snapshot(SynthSpec(seq_lens=(100, 40), query_len=1, sliding_window=32, causal=True))
    result = poison(snap, ["reference", "flex"])
    for record in result.steps[0].backends:
        assert record.ran and not record.reads_poisoned, record.backend
        assert {r.region: r.status for r in record.regions}["before_window"] in ("clean", "loads masked")


def _with_stale_tail(snap: Snapshot) -> Snapshot:
    """Request 1 dropped from the step; its pages stay stored and become request 0's stale table tail."""
    s = snap.steps[0]
    q0 = s.query_lens[0]
    row0 = [p for p in s.block_table[0].tolist()]
    live0 = -(-int(s.seq_lens[0]) // snap.page_size)
    live1 = -(-int(s.seq_lens[1]) // snap.page_size)
    row = row0[:live0] + s.block_table[1].tolist()[:live1]
    step = Step(block_table=torch.tensor([row], dtype=s.block_table.dtype), seq_lens=s.seq_lens[:1].clone(),
                query_start_loc=torch.tensor([0, q0], dtype=s.query_start_loc.dtype), query=s.query[:q0].clone(),
                key=s.key[:q0].clone(), value=s.value[:q0].clone(), slot_mapping=s.slot_mapping[:q0].clone())
    return Snapshot(meta=snap.meta, kv_cache=snap.kv_cache.clone(), page_ids=snap.page_ids.clone(), steps=[step])


class _WholeRowInstance:
    """A broken consumer that reads every table column, the stale tail and past seq_len."""

    def __init__(self, meta, options):
        from kvdbg.backends.reference import ReferenceInstance

        self.inner = ReferenceInstance(meta, options)
        self.impl = self.inner.impl
        self.meta = meta
        outer = self

        class Builder:
            def build(self, common):
                width = common.block_table.shape[1] * common.page_size
                lengths = torch.full_like(common.seq_lens, width)
                return outer.inner.builder.build(dataclasses.replace(common, seq_lens=lengths, max_seq_len=width))

        self.builder = Builder()

    def describe(self):
        return self.inner.describe()


def _register_whole_row(monkeypatch):
    import sys
    import types

    from kvdbg import backends
    from kvdbg.backends.base import BackendSpec, Capabilities

    module = types.ModuleType("kvdbg_test_whole_row")
    module.BACKEND = BackendSpec(name="whole_row", engine_name="WHOLE_ROW", summary="reads the whole table row",
                                 capabilities=Capabilities(who="whole_row"), create=_WholeRowInstance)
    monkeypatch.setitem(sys.modules, "kvdbg_test_whole_row", module)
    monkeypatch.setitem(backends.BACKEND_MODULES, "whole_row", "kvdbg_test_whole_row")


def test_a_consumer_of_the_whole_row_reads_the_stale_tail(monkeypatch):
    _register_whole_row(monkeypatch)
    snap = _with_stale_tail(synth_snapshot(SynthSpec(seq_lens=(40, 30), query_len=2, causal=False)))
    regions = regions_of(snap)
    # Request 1's 2 pages are stored, live nowhere, in request 0's tail; 40 keys leave 8 slots of page 3.
    assert regions["stale_tail"].slots == 32 and regions["past_seq_len"].slots == 8
    result = poison(snap, ["reference", "whole_row"])
    ref, broken = result.steps[0].backends
    assert not ref.reads_poisoned
    status = {r.region: r for r in broken.regions}
    assert status["stale_tail"].status == "reads poisoned" and status["past_seq_len"].status == "reads poisoned"
    assert status["stale_tail"].tokens == 2 and status["stale_tail"].heads == snap.meta.layer.num_heads
    # Every stale slot is weighted (dense mask over the whole row): the bisection names them all.
    assert sum(c.run.size for c in status["stale_tail"].culprits) == 32
    assert status["stale_tail"].culprits[0].keys == []  # stale: no request holds them as live keys


def test_no_region_touches_a_slot_some_request_must_see():
    for name in ("prefix_page0", "dflash", "causal_gqa", "ts_causal_window"):
        snap = load_snapshot(os.path.join(FIXTURES, f"{name}.safetensors"))
        for step in range(len(snap.steps)):
            protected = protected_slots(snap, step)
            for region in poison_regions(snap, step):
                slots = {(r.page, t) for r in region.runs for t in range(r.lo, r.hi)}
                assert not slots & protected, (name, step, region.name)
                if region.name != "null_block":
                    assert all(r.page != 0 for r in region.runs)


def test_live_page_zero_within_the_window_is_not_poisoned():
    """prefix_page0: request 1 reads page 0 as a real page (flex masks it: a replay failure, not a poisoned read)."""
    snap = load_snapshot(os.path.join(FIXTURES, "prefix_page0.safetensors"))
    null = regions_of(snap)["null_block"]
    assert all(r.page == 0 for r in null.runs)
    assert null.slots == 0  # page 0 holds only keys request 1 must see


def test_poison_leaves_the_file_and_the_snapshot_untouched(tmp_path):
    path = os.path.join(FIXTURES, "causal_gqa.safetensors")
    before = hashlib.sha256(open(path, "rb").read()).hexdigest()
    snap = load_snapshot(path)
    cache = snap.kv_cache.clone()
    poison(snap, ["reference"])
    assert torch.equal(snap.kv_cache.view(torch.uint8), cache.view(torch.uint8))
    assert hashlib.sha256(open(path, "rb").read()).hexdigest() == before


def test_clean_run_exits_0_and_json_is_strict():
    res = run(os.path.join(FIXTURES, "causal_gqa.safetensors"), "--backend", "reference", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert data["verdict"]["summary"] == ("PASS: 1 comparison(s) agree within tolerance, no error finding; "
                                          "reference read nothing poisoned")
    assert [r["region"] for r in data["steps"][0]["regions"]] == list(REGIONS)


def test_nothing_to_poison_is_not_clean(tmp_path):
    # One request filling its pages exactly, no window: every stored slot is one it must see.
    snap = synth_snapshot(SynthSpec(seq_lens=(32,), query_len=1, causal=True))
    assert all(r.slots == 0 for r in poison_regions(snap, 0))
    from kvdbg.cli.poison import poison_verdict

    verdict = poison_verdict(poison(snap, ["reference"]))
    assert verdict.exit_code == 3 and verdict.summary.startswith("NOTHING VERIFIED")


@pytest.mark.parametrize("args, message", [
    (["--step", "3"], "Error: --step 3 is out of range: the snapshot has 1 step(s)"),
    (["--backend", "flexx"], "Error: --backend: unknown backend 'flexx'; did you mean flex? (choose from: "
                             "reference, flex, flashinfer_ts, vllm, vllm_flex; engine names FLEX_ATTENTION and "
                             "FLASHINFER_TS work too)"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    res = run(DFLASH, *args)
    assert res.exit_code == 2
    assert res.output.strip() == message


def test_missing_file_exits_2(tmp_path):
    res = run(str(tmp_path / "nope.safetensors"))
    assert res.exit_code == 2 and res.output.startswith("Error: ") and len(res.output.strip().splitlines()) == 1


def test_backend_asked_by_name_that_cannot_run_exits_2():
    res = run(os.path.join(FIXTURES, "prefix_page0.safetensors"), "--backend", "flashinfer_ts")
    assert res.exit_code == 2 and res.output.startswith("Error: backend flashinfer_ts cannot run")


def test_bisection_names_a_group_no_half_of_which_reads_alone():
    """A read that needs two slots at once cannot be halved: the pair is named, not lost."""
    from kvdbg.moves.poisoner import Region, RegionResult, SlotRun, _bisect

    snap = synth_snapshot(SynthSpec(seq_lens=(40,), query_len=1, causal=True))
    runs = [SlotRun(page=5, stored=0, lo=0, hi=1), SlotRun(page=6, stored=1, lo=3, hi=4)]
    target = torch.ones(1, 1, dtype=torch.bool)

    def run_with(group, which="k"):
        return torch.full((1, 1), sum(r.size for r in group) == 2)

    result = RegionResult("stale_tail", 2, "reads poisoned", [(0, 0, 0)])
    _bisect(snap, 0, Region("stale_tail", runs), target, ~target, run_with, result, budget=8)
    assert [c.run for c in result.culprits] == runs and result.bisect_runs == 2 and result.bisect_complete


def test_a_backend_whose_every_output_was_already_unwritten_verifies_nothing(tmp_path):
    """Both requests break prims_ts preconditions (past max_kv_len, a table too narrow), so the emulation leaves
    every output unwritten before any poison: no read could show, and that is no PASS. The snapshot's verdict is
    the replay's: FAIL on those error findings."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    spec = SynthSpec(seq_lens=(1000, 900), query_len=4, causal=True, sliding_window=256, num_heads=2, num_kv_heads=1)
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "blind.safetensors"))
    res = CliRunner().invoke(cli, ["poison", path, "--backend", "flashinfer_ts", "--json"])
    assert res.exit_code == 1, res.output
    data = json.loads(res.output)
    assert data["verdict"]["summary"].startswith("FAIL: ") and "seq_len_over_max_kv_len" in data["verdict"]["summary"]
    (record,) = [b for s in data["steps"] for b in s["results"]]
    assert record["ran"] and not record["observed"] and record["baseline_nonfinite"] == record["outputs"] == 16
    assert "no read could show" in data["verdict"]["summary"]
