"""`kvdbg map` and find_anomalies on synthetic snapshots."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.snapshot.pagemap import find_anomalies, page_map
from kvdbg.snapshot.store import save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot

LENS = (40, 77, 200, 333)


def codes(anomalies):
    return sorted({a.code for a in anomalies})


def test_clean_snapshot_has_no_anomalies():
    snap = synth_snapshot(SynthSpec(seq_lens=LENS))
    assert find_anomalies(snap, 0) == []
    m = page_map(snap)
    assert m.errors == 0
    r = m.requests[1]
    assert r.live_pages == 5 and r.live == snap.steps[0].block_table[1, :5].tolist()
    assert all(x == 0 for x in r.stale)
    assert {(e.physical, e.logical) for e in r.physical_to_logical} == {(p, i) for i, p in enumerate(r.live)}


def test_live_page_zero_is_an_error():
    snap = synth_snapshot(SynthSpec(seq_lens=LENS, use_page_zero=True, page_zero_request=2))
    found = find_anomalies(snap, 0)
    assert codes(found) == ["live_page_zero"]
    (a,) = found
    assert (a.severity, a.request, a.pages) == ("error", 2, [0])
    assert a.message.startswith("request 2: logical block(s) 0 hold engine page 0, vLLM's null block, which "
                                "FLEX_ATTENTION masks: 16 key(s) the mask must show are hidden")
    entry = next(e for e in page_map(snap).requests[2].physical_to_logical if e.physical == 0)
    assert entry.logical == -1 and entry.candidates == [0]


def test_shared_prefix_is_info():
    snap = synth_snapshot(SynthSpec(seq_lens=LENS, shared_prefix_pages=2))
    found = find_anomalies(snap, 0)
    assert codes(found) == ["shared_pages"]
    (a,) = found
    shared = snap.steps[0].block_table[0, :2].tolist()
    assert a.severity == "info" and a.requests == [0, 1, 2, 3] and a.pages == sorted(shared)


def test_stale_tail_is_reported():
    snap = synth_snapshot(SynthSpec(seq_lens=LENS, stale_tail=2))
    found = find_anomalies(snap, 0)
    assert codes(found) and set(codes(found)) <= {"stale_tail", "stale_tail_aliases_live"}
    assert {a.request for a in found} == {0, 1, 2, 3}
    assert all(a.severity in ("warning", "info") for a in found)


def test_page_mapped_twice_and_stale_alias_are_detected():
    snap = synth_snapshot(SynthSpec(seq_lens=LENS))
    table = snap.steps[0].block_table
    table[3, 5] = table[3, 2]  # request 3 now reads one physical page at logical pages 2 and 5
    table[0, 3] = table[0, 1]  # a stale entry past request 0's 3 live pages repeats a live one
    found = find_anomalies(snap, 0)
    twice = [a for a in found if a.code == "page_mapped_twice"]
    assert len(twice) == 1 and twice[0].request == 3 and twice[0].severity == "error"
    assert "sits at logical blocks 2, 5" in twice[0].message and "hiding 16 key(s)" in twice[0].message
    alias = [a for a in found if a.code == "stale_tail_aliases_live"]
    assert len(alias) == 1 and alias[0].request == 0 and alias[0].severity == "warning"
    entry = next(e for e in page_map(snap).requests[3].physical_to_logical if e.physical == int(table[3, 2]))
    assert entry.candidates == [2, 5]
    # The old copy of logical page 5 is no longer referenced by anything live.
    assert "unreferenced_pages" in codes(found)
    assert found[0].severity == "error"  # errors sort first


def test_unreferenced_pages_in_later_steps():
    snap = synth_snapshot(SynthSpec(seq_lens=(16, 32), steps=2, new_kv=False, shuffle=False))
    # Step 1 crosses a page boundary for both requests: those pages are stored but not live at step 0.
    assert codes(find_anomalies(snap, 0)) == ["unreferenced_pages"]
    assert find_anomalies(snap, 1) == []


@pytest.fixture
def snapshot_files(tmp_path):
    clean = tmp_path / "clean.safetensors"
    bad = tmp_path / "bad.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(seq_lens=LENS)), clean)
    # A FLEX_ATTENTION capture: the null block is FLEX_ATTENTION's rule, so its harm is this snapshot's failure.
    save_snapshot(synth_snapshot(SynthSpec(seq_lens=LENS, use_page_zero=True, shared_prefix_pages=2,
                                           stale_tail=2, backend="FLEX_ATTENTION")), bad)
    return str(clean), str(bad)


def test_cli_judges_a_flex_rule_as_what_if_on_a_flashinfer_ts_snapshot(tmp_path):
    """The same live page 0 in a FLASHINFER_TS capture: FLASHINFER_TS reads page 0 like any page, so the harm is
    FLEX_ATTENTION's, a what-if -- as `kvdbg replay` counts it (kvdbg.judge.verdict's one rule)."""
    path = tmp_path / "ts.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(seq_lens=LENS, use_page_zero=True, backend="FLASHINFER_TS",
                                           dtype="bfloat16")), path)
    res = invoke(str(path), "--json")
    data = json.loads(res.output)
    assert data["errors"] == 1 and res.exit_code == 0, data["verdict"]
    assert "what-if error finding(s) under FLEX_ATTENTION's rules" in data["verdict"]["summary"]
    replayed = CliRunner().invoke(cli, ["replay", str(path), "--json"], env={"NO_COLOR": "1"})
    assert replayed.exit_code == 0 and json.loads(replayed.output)["verdict"]["what_if_failures"] == ["flex"]


def invoke(*args):
    return CliRunner().invoke(cli, ["map", *args], env={"NO_COLOR": "1", "COLUMNS": "200"})


def test_cli_clean_exits_0(snapshot_files):
    clean, _ = snapshot_files
    res = invoke(clean)
    assert res.exit_code == 0, res.output
    assert "no anomalies" in res.output and "physical → logical" in res.output


def test_cli_flags_anomalies_and_exits_1(snapshot_files):
    _, bad = snapshot_files
    res = invoke(bad)
    assert res.exit_code == 1, res.output
    out = res.output
    assert "live_page_zero" in out and "shared_pages" in out and "stale_tail" in out
    assert "0→null" in out
    assert " … " in out  # long rows are elided without --full
    assert " … " not in invoke(bad, "--full").output.split("anomal")[0]


def test_cli_json_matches_library(snapshot_files):
    _, bad = snapshot_files
    res = invoke(bad, "--json")
    assert res.exit_code == 1
    data = json.loads(res.output)
    assert data["errors"] == 1 and data["num_reqs"] == 4
    assert [r["seq_len"] for r in data["requests"]] == list(LENS)
    assert {a["code"] for a in data["anomalies"]} >= {"live_page_zero", "shared_pages"}


def test_cli_request_filter(snapshot_files):
    _, bad = snapshot_files
    res = invoke(bad, "--request", "0", "--json")
    data = json.loads(res.output)
    assert [r["request"] for r in data["requests"]] == [0]
    assert all(0 in a["requests"] for a in data["anomalies"])
    assert res.exit_code == 0  # page 0 is live in request 1, not 0
    assert invoke(bad, "--request", "1").exit_code == 1


@pytest.mark.parametrize("args, message", [
    (["--step", "3"], "Error: --step 3 is out of range: the snapshot has 1 step(s)"),
    (["--request", "9"], "Error: --request 9 is out of range: step 0 has 4 request(s)"),
])
def test_cli_bad_options_exit_2(snapshot_files, args, message):
    clean, _ = snapshot_files
    res = CliRunner().invoke(cli, ["map", clean, *args])
    assert res.exit_code == 2 and res.output.strip() == message


def test_cli_missing_file_exits_2(tmp_path):
    res = CliRunner().invoke(cli, ["map", str(tmp_path / "nope.safetensors")])
    assert res.exit_code == 2 and res.output.startswith("Error: ") and len(res.output.strip().splitlines()) == 1


def test_physical_to_logical_follows_vllms_rule():
    """The one map both `kvdbg map` and the flex backend use: the docstring's example, entry for entry."""
    import torch

    from kvdbg.snapshot.pagemap import physical_to_logical

    table = torch.tensor([[7, 3, 0, 3, 9], [1, 2, -1, 0, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([64, 20])  # 4 live pages, then 2 of 16 tokens
    p2l = physical_to_logical(table, seq_lens, 16, 10, null_page=0).tolist()
    assert p2l[0] == [-1, -1, -1, 3, -1, -1, -1, 0, -1, -1]  # 3: last block wins; 0: null; 9: stale
    assert p2l[1] == [-1, 0, 1, -1, -1, -1, -1, -1, -1, -1]
    assert physical_to_logical(table, seq_lens, 16, 10, null_page=None).tolist()[0][0] == 2
