"""`kvdbg replay DIR|FILES...`: one row per snapshot, the exit code over all, --jobs, --json, bad files."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil

import pytest
from click.testing import CliRunner

from kvdbg.replayer.batch import (STATUS_BAD_INPUT, STATUS_CRASHED, STATUS_FAIL, STATUS_PASS, STATUS_UNVERIFIED, BatchOptions,
                         FileResult, batch_exit_code, find_snapshots, replay_many)
from kvdbg.cli import cli
from kvdbg.snapshot.store import save_snapshot

from tests.helpers import FIXTURES, assert_close_ulps, shown_commands, wider_than


def invoke(*args):
    return CliRunner().invoke(cli, ["replay", *args], catch_exceptions=False)


@pytest.fixture
def capture_dir(tmp_path, make_snapshot):
    """A directory of three snapshots with known verdicts: pass, fail (flex on the null page), pass."""
    directory = tmp_path / "captures"
    directory.mkdir()
    good, _ = make_snapshot(seq_lens=(40, 70), query_len=2, engine_output="reference")
    bad, _ = make_snapshot(seq_lens=(40, 70), query_len=2, use_page_zero=True, page_zero_request=1,
                           engine_output="reference", backend="FLEX_ATTENTION")
    shutil.copy(good, directory / "b_good.safetensors")
    shutil.copy(bad, directory / "a_null_page.safetensors")
    shutil.copy(good, directory / "c_good.safetensors")
    (directory / "notes.txt").write_text("not a snapshot, not listed\n")
    return directory


def test_directory_gives_one_sorted_row_per_snapshot_and_exit_1(capture_dir):
    res = invoke(str(capture_dir), "--backend", "flex", "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.output)
    assert [os.path.basename(f["path"]) for f in data["files"]] == [
        "a_null_page.safetensors", "b_good.safetensors", "c_good.safetensors"]
    assert [f["status"] for f in data["files"]] == ["fail", "pass", "pass"]
    failing = data["files"][0]
    assert failing["worst"]["actual"] == "flex" and not failing["worst"]["passed"]
    assert failing["worst"]["failed_heads"] > 0
    assert failing["error_findings"] == ["live_page_zero"]
    assert data["verdict"]["exit_code"] == 1 and list(data)[-1] == "verdict"
    table = invoke(str(capture_dir), "--backend", "flex").output
    assert f"3 snapshot(s) in {capture_dir}" in table
    assert "live_page_zero" in table
    assert table.rstrip().splitlines()[-1].startswith("FAIL: 3 snapshot(s): 1 fail (a_null_page.safetensors); 2 pass")


def test_the_closing_counts_are_the_files_own_summed(capture_dir):
    batch = json.loads(invoke(str(capture_dir), "--backend", "flex", "--json").output)
    singles = [json.loads(invoke(f["path"], "--backend", "flex", "--json").output)["verdict"] for f in batch["files"]]
    verdict = batch["verdict"]
    assert verdict["comparisons"] == sum(v["comparisons"] for v in singles) > 0
    assert verdict["failed_comparisons"] == sum(v["failed_comparisons"] for v in singles) > 0
    assert verdict["error_findings"] == sum(v["error_findings"] for v in singles) == 1  # live_page_zero, once


def test_each_row_matches_the_single_file_replay(capture_dir):
    """A row's verdict is exactly `kvdbg replay FILE`'s, and the single-file output is today's full output."""
    batch = json.loads(invoke(str(capture_dir), "--backend", "flex", "--json").output)
    for record in batch["files"]:
        single = invoke(record["path"], "--backend", "flex", "--json")
        data = json.loads(single.output)
        assert single.exit_code == record["exit_code"]
        assert data["verdict"]["summary"] == record["summary"]
        assert "files" not in data and "comparisons" in data
    text = invoke(batch["files"][0]["path"], "--backend", "flex", "--full").output
    assert "step 0: flex vs reference — FAIL" in text and "snapshot(s)" not in text


def test_bad_file_gets_a_one_line_row_and_the_others_still_run(capture_dir):
    (capture_dir / "broken.safetensors").write_bytes(b"junk")
    res = invoke(str(capture_dir), "--backend", "flex", "--json")
    assert res.exit_code == 2
    data = json.loads(res.output)
    rows = {os.path.basename(f["path"]): f for f in data["files"]}
    assert rows["broken.safetensors"]["status"] == "bad input"
    assert "not a safetensors file" in rows["broken.safetensors"]["summary"]
    assert "\n" not in rows["broken.safetensors"]["summary"]
    assert rows["b_good.safetensors"]["status"] == "pass" and rows["a_null_page.safetensors"]["status"] == "fail"
    table = invoke(str(capture_dir), "--backend", "flex").output
    assert "BAD INPUT" in table and "Traceback" not in table


def test_step_out_of_range_for_one_file_is_that_file_s_bad_input(tmp_path, make_snapshot):
    one, _ = make_snapshot(seq_lens=(30,), engine_output="reference")
    two, _ = make_snapshot(seq_lens=(30,), steps=2, engine_output="reference")
    data = json.loads(invoke(one, two, "--step", "1", "--backend", "flex", "--json").output)
    assert [f["status"] for f in data["files"]] == ["bad input", "pass"]
    assert "--step 1 is out of range" in data["files"][0]["summary"]
    assert data["verdict"]["exit_code"] == 2


def test_nothing_verified_anywhere_exits_3_and_one_verified_file_makes_it_0(make_snapshot):
    bare, _ = make_snapshot(seq_lens=(30,))  # no engine output: the reference alone verifies nothing
    bare2, _ = make_snapshot(seq_lens=(50,))
    res = invoke(bare, bare2, "--backend", "reference", "--json")
    assert res.exit_code == 3
    assert [f["status"] for f in json.loads(res.output)["files"]] == ["unverified", "unverified"]
    captured, _ = make_snapshot(seq_lens=(30,), engine_output="reference")
    res = invoke(bare, captured, "--backend", "reference", "--json")
    assert res.exit_code == 0
    assert [f["status"] for f in json.loads(res.output)["files"]] == ["unverified", "pass"]


@pytest.mark.parametrize("statuses, code", [
    ([STATUS_PASS, STATUS_PASS], 0),
    ([STATUS_PASS, STATUS_UNVERIFIED], 0),
    ([STATUS_UNVERIFIED, STATUS_UNVERIFIED], 3),
    ([], 3),
    ([STATUS_PASS, STATUS_FAIL, STATUS_UNVERIFIED], 1),
    ([STATUS_PASS, STATUS_CRASHED], 1),
    ([STATUS_FAIL, STATUS_BAD_INPUT], 2),
    ([STATUS_UNVERIFIED, STATUS_BAD_INPUT], 2),
])
def test_exit_rule(statuses, code):
    files = [FileResult(f"f{i}", s, 0) for i, s in enumerate(statuses)]
    assert batch_exit_code(files) == code


def test_jobs_keep_the_order_and_the_results(capture_dir):
    one = json.loads(invoke(str(capture_dir), "--backend", "flex", "--json").output)
    four = json.loads(invoke(str(capture_dir), "--backend", "flex", "--json", "--jobs", "3").output)
    assert [f["path"] for f in one["files"]] == [f["path"] for f in four["files"]]
    for a, b in zip(one["files"], four["files"]):
        assert (a["status"], a["exit_code"], a["error_findings"]) == (b["status"], b["exit_code"], b["error_findings"])
        import torch

        assert_close_ulps(torch.tensor(b["worst"]["max_abs"]), torch.tensor(a["worst"]["max_abs"]))
    assert one["verdict"] == four["verdict"]


def test_interrupt_stops_the_workers(capture_dir):
    files = find_snapshots([str(capture_dir)])

    def interrupt(done, total, result):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replay_many(files, BatchOptions(backends=("flex",)), jobs=2, progress=interrupt)
    assert multiprocessing.active_children() == []


def test_recursive_and_empty_directories(tmp_path, make_snapshot):
    path, _ = make_snapshot(seq_lens=(30,))
    top = tmp_path / "top"
    (top / "sub").mkdir(parents=True)
    shutil.copy(path, top / "sub" / "x.safetensors")
    res = invoke(str(top))
    assert res.exit_code == 2
    assert res.output.strip() == (f"Error: no *.safetensors file in directory {top} "
                                  "(--recursive searches subdirectories)")
    assert find_snapshots([str(top)], recursive=True) == [str(top / "sub" / "x.safetensors")]
    # A file named twice (directly and through its directory) is replayed once.
    assert find_snapshots([str(top / "sub"), str(top / "sub" / "x.safetensors")]) == [
        str(top / "sub" / "x.safetensors")]


def test_single_file_options_are_refused_with_several(capture_dir):
    res = invoke(str(capture_dir), "--head", "0")
    assert res.exit_code == 2
    assert res.output.strip() == ("Error: --head applies to one snapshot; with several (or a directory) replay "
                                  "that file on its own")


def test_fixtures_directory_at_80_columns(monkeypatch, tmp_path):
    """The bundled fixtures: the two that must fail fail, and the table reads whole in 80 columns."""
    for name in ("prefix_page0.safetensors", "ts_causal_window.safetensors", "fp8_dense.safetensors"):
        shutil.copy(os.path.join(FIXTURES, name), tmp_path / name)
    monkeypatch.setenv("COLUMNS", "80")
    res = invoke(str(tmp_path), "--full")
    assert res.exit_code == 1
    lines = res.output.splitlines()
    # The example command of each group of failures breaks only between words (a path longer than the line
    # stands alone), so that it is copied whole.
    assert not wider_than(lines)
    rows = [line for line in lines if line.startswith("│ ") and ("PASS" in line or "FAIL" in line)]
    assert [("FAIL" in r, "PASS" in r) for r in rows] == [(False, True), (True, False), (True, False)]
    # Without --full: no row per file, the groups by cause with their commands, and how to get the rows.
    brief = invoke(str(tmp_path))
    assert brief.exit_code == 1
    lines = brief.output.splitlines()
    flat = " ".join(brief.output.split())
    assert flat.startswith(f"3 snapshot(s) in {tmp_path} By cause: 3 row(s): 1 pass; 2 fail, 2 causes")
    assert not [line for line in lines if line.lstrip().startswith(("│", "┃"))]
    assert sum(line.lstrip().startswith("$ kvdbg replay ") for line in lines) == 2
    assert [c.split()[:2] for c in shown_commands(brief.output)] == [["kvdbg", "replay"]] * 2
    assert f"next: kvdbg replay {tmp_path} --full" in flat.replace(" \\ ", " ")
    assert flat.endswith("(exit 1)") and "FAIL: 3 snapshot(s)" in flat
    assert not wider_than(lines)


def test_the_ranks_of_a_step_are_one_row_with_one_verdict(tmp_path):
    """Tensor-parallel ranks of one step (same engine, layer, step) share a row; the step fails if any rank does."""
    import torch

    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from tests.test_merge import split_into_ranks, write_shards

    directory = tmp_path / "captures"
    for step in (5, 6):
        full = synth_snapshot(SynthSpec(seq_lens=(20, 45), num_heads=4, num_kv_heads=2, head_size=16,
                                        engine_output="reference", seed=step))
        shards = split_into_ranks(full, 2, step=step)
        if step == 6:  # rank 1's engine wrote a wrong value in its first head
            shards[1].steps[0].output[0, 0] += 4.0
        write_shards(directory, shards, stem=f"model.layers.0.self_attn.attn-step{step}")
    alone = synth_snapshot(SynthSpec(seq_lens=(30,), num_heads=4, num_kv_heads=2, head_size=16,
                                     engine_output="reference"))
    save_snapshot(alone, directory / "zz-alone.safetensors")
    res = invoke(str(directory), "--backend", "flex", "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.output)
    assert len(data["files"]) == 5 and [f["status"] for f in data["files"]] == ["pass", "pass", "pass", "fail", "pass"]
    rows = data["rows"]
    assert [(row["tp_ranks"], row["status"], len(row["files"])) for row in rows] == [
        ([0, 1], "pass", 2), ([0, 1], "fail", 2), ([], "pass", 1)]
    failing = rows[1]
    assert failing["steps"] == [0] and "captured" in (failing["worst"]["actual"], failing["worst"]["expected"])
    # request x head pairs, counted over both ranks: 2 requests x 2 heads on each
    assert (failing["worst"]["failed_heads"], failing["worst"]["heads"]) == (1, 8)
    assert failing["summary"].startswith("tp_rank 1: ")
    table = invoke(str(directory), "--backend", "flex", "--full").output
    assert "3 rows, a step's ranks in one" in table.replace("\n", " ")
    assert "1/8 heads fail" in table and " 0,1 " in table
    assert torch.__version__  # torch is only needed to build the inputs


def test_shards_that_cannot_be_told_apart_are_not_grouped(tmp_path):
    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from tests.test_merge import split_into_ranks, write_shards

    full = synth_snapshot(SynthSpec(seq_lens=(20,), num_heads=4, num_kv_heads=2, head_size=16,
                                    engine_output="reference"))
    for run in ("a", "b"):  # two runs with no engine id, same layer and step: rank 0 twice
        write_shards(tmp_path / "d", split_into_ranks(full, 2, engine=None)[:1], stem=f"{run}-step5")
    data = json.loads(invoke(str(tmp_path / "d"), "--backend", "flex", "--json").output)
    assert [len(row["files"]) for row in data["rows"]] == [1, 1]
