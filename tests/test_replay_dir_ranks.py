"""`kvdbg replay DIR`: a row that joins rank files `kvdbg merge` would refuse is bad input, never a pass."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from kvdbg.replayer.batch import STATUS_BAD_INPUT, STATUS_PASS, FileResult, batch_verdict, step_rows
from kvdbg.cli import cli
from kvdbg.snapshot.ranks import rank_info
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.test_merge import split_into_ranks, write_shards


def _full(**changes):
    spec = dict(seq_lens=(20, 45), num_heads=4, num_kv_heads=2, head_size=16, engine_output="reference")
    return synth_snapshot(SynthSpec(**{**spec, **changes}))


def _two_of_four():
    return split_into_ranks(_full(num_heads=8, num_kv_heads=4), 4)[:2]


def _other_heads():
    ours, theirs = split_into_ranks(_full(), 2), split_into_ranks(_full(head_size=32, seq_lens=(5,)), 2)
    return [ours[0], theirs[1]]


def _other_batch():
    ours, theirs = split_into_ranks(_full(), 2), split_into_ranks(_full(seq_lens=(20, 46)), 2)
    for shard in (ours[0], theirs[1]):
        del shard.meta.capture["synth"]  # synth's record of its spec would differ first; a capture has none
    return [ours[0], theirs[1]]


def _rank_seven():
    shards = split_into_ranks(_full(), 2)
    shards[1].meta.capture["tp_rank"] = 7
    return shards


@pytest.mark.parametrize("make, says", [
    (_other_heads, "rank1-0001.safetensors: layer.head_size is 32 but the first file's is 16: not the same step"),
    (_other_batch, "rank1-0001.safetensors: seq_lens differs from the first file's: not the same step"),
    (_rank_seven, "capture.tp_rank: the files are not every rank of one step (tp_rank 7 not below "
                  "capture.tp_size; tp_rank 1 missing; capture.tp_size is 2)"),
])
def test_a_group_merge_refuses_is_one_bad_input_row(tmp_path, make, says):
    """Each file replays and passes on its own; the row of the step they claim to be does not."""
    write_shards(tmp_path / "d", make())
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "d"), "--backend", "reference", "--json"])
    assert res.exit_code == 2, res.output
    data = json.loads(res.output)
    assert [f["status"] for f in data["files"]] == [STATUS_PASS, STATUS_PASS]
    assert "step_facts" not in data["files"][0]
    [row] = data["rows"]
    assert (row["status"], row["exit_code"]) == (STATUS_BAD_INPUT, 2) and row["summary"].endswith(says), row
    assert data["verdict"]["summary"].startswith("BAD INPUT: 2 snapshot(s): 1 step(s) whose rank files do not "
                                                 "agree or are not ranks of one step (")
    table = CliRunner().invoke(cli, ["replay", str(tmp_path / "d"), "--backend", "reference"], env={"COLUMNS": "200"})
    assert table.exit_code == 2 and "BAD INPUT" in table.output and "PASS" not in table.output.split("By cause")[0]


def test_every_rank_of_one_step_still_passes(tmp_path):
    write_shards(tmp_path / "d", split_into_ranks(_full(num_heads=8, num_kv_heads=4), 4))
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "d"), "--backend", "reference", "--json"])
    data = json.loads(res.output)
    assert res.exit_code == 0 and [(row["status"], row["tp_ranks"]) for row in data["rows"]] == [
        (STATUS_PASS, [0, 1, 2, 3])]


def test_rank_rows_without_recorded_facts_do_not_pass():
    """A rank's row built without what its file holds (not from replay_file) cannot be vouched for as one step."""
    files = [FileResult(f"r{rank}.safetensors", STATUS_PASS, 0,
                        rank=rank_info("layers.0", {"step": 5, "tp_rank": rank, "tp_size": 2})) for rank in (0, 1)]
    [row] = step_rows(files)
    assert row.status == STATUS_BAD_INPUT and row.exit_code == 2 and "was not recorded" in row.summary
    assert batch_verdict(files)[0] == 2


def test_a_results_file_keeps_what_the_ranks_are_checked_with(tmp_path):
    """triage (and --resume) read the rows back: a refused step stays bad input, with merge as its example."""
    write_shards(tmp_path / "d", _rank_seven())
    results = tmp_path / "r.jsonl"
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "d"), "--backend", "reference", "--results",
                                   str(results)])
    assert res.exit_code == 2, res.output
    res = CliRunner().invoke(cli, ["triage", str(results), "--json"])
    assert res.exit_code == 2, res.output
    data = json.loads(res.output)
    [group] = data["groups"]
    assert group["kind"] == "bad input" and group["key"].startswith(
        "bad input: rank files that disagree or are not ranks of one step")
    assert group["example"]["command"].startswith("kvdbg merge ") and group["example"]["command"].endswith(
        "-o merged.safetensors")
    assert data["verdict"]["exit_code"] == 2
    # A complete step read back still passes.
    write_shards(tmp_path / "e", split_into_ranks(_full(num_heads=8, num_kv_heads=4), 4))
    results = tmp_path / "e.jsonl"
    assert CliRunner().invoke(cli, ["replay", str(tmp_path / "e"), "--backend", "reference", "--results",
                                    str(results)]).exit_code == 0
    assert CliRunner().invoke(cli, ["triage", str(results)]).exit_code == 0


def test_some_ranks_of_a_step_are_judged_on_their_heads_and_say_so(tmp_path):
    """A capture filtered to some ranks (KVDBG_CAPTURE_RANKS=0-1 on four) is not bad input: the row holds the
    heads it has, names how many of the step's ranks are here, and a real failure elsewhere still shows."""
    write_shards(tmp_path / "d", _two_of_four())
    res = CliRunner().invoke(cli, ["replay", str(tmp_path / "d"), "--backend", "reference", "--json"])
    assert res.exit_code == 0, res.output
    [row] = json.loads(res.output)["rows"]
    assert (row["status"], row["tp_ranks"], row["tp_size"]) == (STATUS_PASS, [0, 1], 4)
    assert row["summary"].endswith("2 of the step's 4 ranks are here: the others' heads were not replayed")
    table = CliRunner().invoke(cli, ["replay", str(tmp_path / "d"), "--backend", "reference", "--full"],
                               env={"COLUMNS": "120"})
    assert "0,1 of 4" in table.output
    # merge still wants every rank
    res = CliRunner().invoke(cli, ["merge", *sorted(str(p) for p in (tmp_path / "d").iterdir()), "-o",
                                   str(tmp_path / "m.safetensors")])
    assert res.exit_code == 2 and "tp_rank 2, 3 missing" in res.output
