"""`kvdbg diff A B`: synthetic pairs with planted differences, placement-only pairs, refusals, outputs files."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.snapshot.store import Snapshot, save_snapshot
from kvdbg.moves.sweeper import relabel_pages
from kvdbg.moves.synth import SynthSpec, synth_snapshot


def run(*args):
    return CliRunner().invoke(cli, ["diff", *map(str, args)], env={"NO_COLOR": "1", "COLUMNS": "120"})


def strict(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))


SPEC = SynthSpec(seq_lens=(40, 70), query_len=2, causal=True, engine_output="reference", shared_prefix_pages=1)


def base() -> Snapshot:
    return synth_snapshot(SPEC)


def clone(snap: Snapshot) -> Snapshot:
    steps = [dataclasses.replace(s, **{k: v.clone() for k, v in s.tensors().items()}) for s in snap.steps]
    return Snapshot(meta=snap.meta, kv_cache=snap.kv_cache.clone(), page_ids=snap.page_ids.clone(), steps=steps)


def reversed_placement(snap: Snapshot) -> Snapshot:
    ids = sorted(int(p) for p in snap.page_ids.tolist() if p != 0)
    return relabel_pages(snap, dict(zip(ids, ids[::-1])))


def save_pair(tmp_path, a: Snapshot, b: Snapshot):
    return save_snapshot(a, tmp_path / "a.safetensors"), save_snapshot(b, tmp_path / "b.safetensors")


def page_of(snap: Snapshot, request: int, logical: int) -> int:
    """The stored index of a request's logical page."""
    return int(snap.stored_block_table(0)[request, logical])


def test_same_file_is_same(tmp_path):
    a, b = save_pair(tmp_path, base(), base())
    res = run(a, b)
    assert res.exit_code == 0, res.output
    assert res.output.rstrip().splitlines()[-1] == "PASS: outputs agree within tolerance (16 heads); inputs the same " \
                                                   "(exit 0)"


def test_placement_alone_is_no_difference(tmp_path):
    a, b = save_pair(tmp_path, base(), reversed_placement(base()))
    res = run(a, b, "--json")
    assert res.exit_code == 0, res.output
    data = strict(res.output)
    step = data["steps"][0]
    assert step["moved_entries"] > 0 and step["pages_differ"] == 0 and step["inputs_differ"] == []
    assert step["slot_mapping_differ"] == 0  # new K/V go to the same logical positions, other physical slots
    assert data["verdict"]["summary"].endswith("inputs the same (placement aside)")


def test_a_planted_page_difference_is_named_by_logical_position(tmp_path):
    a = base()
    b = reversed_placement(base())
    # Request 1's logical page 2, token 5 of its K: the only input changed. B stores it at another id than A.
    k, _ = b.kv_views()
    k[page_of(b, 1, 2), :, 5] += 1.0
    pa, pb = save_pair(tmp_path, a, b)
    data = strict(run(pa, pb, "--json").output)
    step = data["steps"][0]
    assert step["pages_differ"] == 1 and step["slots_differ"] == 1
    (page,) = step["pages"]
    assert (page["request"], page["logical_page"], page["tokens"]) == (1, 2, 1)
    assert page["page_a"] == int(a.steps[0].block_table[1, 2]) and page["page_b"] == int(b.steps[0].block_table[1, 2])
    assert page["page_a"] != page["page_b"]
    assert 0.9 < page["max_abs"] < 1.1  # +1.0, rounded to bf16 at the stored value
    assert data["inputs_differ"] == ["pages"]
    # The engine outputs were not touched: the same outputs, exit 0 -- inputs are reported, never counted.
    assert data["verdict"]["exit_code"] == 0


def test_a_shared_prefix_page_is_read_once_and_counted_per_request(tmp_path):
    a, b = base(), clone(base())
    k, _ = b.kv_views()
    k[page_of(b, 0, 0), :, 0] += 1.0  # the shared prefix page: logical page 0 of both requests
    pa, pb = save_pair(tmp_path, a, b)
    step = strict(run(pa, pb, "--json").output)["steps"][0]
    assert step["pages_differ"] == 2 and step["slots_differ"] == 1 and step["pages"][0]["shared_by"] == 2


def test_planted_output_difference_fails_exactly_that_head(tmp_path):
    a, b = base(), clone(base())
    qsl = b.steps[0].query_start_loc.tolist()
    b.steps[0].output[qsl[1]:qsl[2], 3] += 0.5  # request 1, head 3
    b.steps[0].query[qsl[1]] += 0.25  # and request 1's first query token
    pa, pb = save_pair(tmp_path, a, b)
    res = run(pa, pb, "--json")
    assert res.exit_code == 1
    data = strict(res.output)
    (comp,) = data["outputs"]
    failing = [(h["request"], h["head"]) for h in comp["heads"] if not h["passed"]]
    assert failing == [(1, 3)]
    query = [t for t in data["steps"][0]["tensors"] if t["name"] == "query"][0]
    assert query["first_tokens"] == [qsl[1]] and query["tokens_differ"] == 1
    summary = data["verdict"]["summary"]
    assert summary.startswith("FAIL: outputs differ on 1 of 16 heads (step 0 captured: ")
    assert "element(s) beyond tolerance, max abs 5.0" in summary and "finite" not in summary
    assert summary.endswith("; inputs differ: query")
    assert (data["verdict"]["comparisons"], data["verdict"]["failed_comparisons"]) == (1, 1)
    assert data["verdict"]["error_findings"] == 0  # a diff makes no findings
    text = run(pa, pb).output
    assert "1 of 4 token(s) differ (max abs 2.5" in " ".join(text.split())


def test_a_head_that_differs_only_by_nan_says_so(tmp_path):
    a, b = base(), clone(base())
    b.steps[0].output[0, 2, 5] = float("nan")
    pa, pb = save_pair(tmp_path, a, b)
    res = run(pa, pb)
    assert res.exit_code == 1
    last = " ".join(res.output.split()).rsplit("FAIL:", 1)[1]
    assert last.startswith(" outputs differ on 1 of 16 heads (step 0 captured: no finite value in B on 1 "
                           "element(s) (NaN, inf or unwritten))"), last
    assert "beyond tolerance" not in last and "max abs" not in last
    res = run(pb, pb)  # the same NaN on both sides still verifies nothing there: it fails, and says why
    assert res.exit_code == 1 and "no finite value in A on 1 element(s) and B on 1 element(s)" in \
        " ".join(res.output.split())


def test_a_step_of_no_query_tokens_verifies_nothing(tmp_path):
    snap = base()
    step = snap.steps[0]
    empty = dataclasses.replace(step, query_start_loc=torch.zeros_like(step.query_start_loc),
                                **{k: getattr(step, k)[:0] for k in ("query", "key", "value", "slot_mapping",
                                                                    "output")})
    path = save_snapshot(dataclasses.replace(snap, steps=[empty]), tmp_path / "empty.safetensors")
    for args in ((path, path), (path, path, "--json")):
        res = run(*args)
        assert res.exit_code == 3 and "Traceback" not in res.output, res.output
    assert strict(res.output)["verdict"]["summary"].startswith("NOTHING VERIFIED: no output held by both files")


def test_lengths_and_scales_are_named(tmp_path):
    a = synth_snapshot(dataclasses.replace(SPEC, fp8=True, k_scale=0.03, engine_output=None))
    b = clone(a)
    b.meta = dataclasses.replace(a.meta, layer=dataclasses.replace(a.meta.layer, k_scale=0.05))
    b.steps[0].seq_lens[0] -= 1
    pa, pb = save_pair(tmp_path, a, b)
    res = run(pa, pb, "--json")
    assert res.exit_code == 3  # no engine output in either: nothing to judge
    data = strict(res.output)
    assert data["meta"] == [{"field": "layer.k_scale", "a": 0.03, "b": 0.05}]
    assert data["steps"][0]["seq_lens"] == [{"request": 0, "a": 40, "b": 39}]
    # The same bytes read with another k scale differ in value: every compared K slot differs.
    assert data["steps"][0]["pages_differ"] == data["steps"][0]["logical_pages"]
    assert data["verdict"]["summary"].startswith("NOTHING VERIFIED: no output held by both files; inputs differ: "
                                                 "layer.k_scale, seq_lens, pages")


@pytest.mark.parametrize("change, message", [
    (dict(num_heads=4), "Error: not comparable: layer.num_heads is 8 in A but 4 in B"),
    (dict(seq_lens=(40, 70, 20)), "Error: not comparable: block_table rows (requests) is 2 in A but 3 in B"),
    (dict(query_len=1), "Error: not comparable: query rows (tokens) is 4 in A but 2 in B"),
    (dict(layer_name="model.layers.1.self_attn.attn"),
     'Error: not comparable: layer.name is "model.layers.0.self_attn.attn" in A but '
     '"model.layers.1.self_attn.attn" in B'),
    (dict(steps=2), "Error: not comparable: num_steps is 1 in A but 2 in B"),
])
def test_files_that_are_not_comparable_exit_2_naming_the_field(tmp_path, change, message):
    pa, pb = save_pair(tmp_path, base(), synth_snapshot(dataclasses.replace(SPEC, **change)))
    res = run(pa, pb)
    assert res.exit_code == 2
    assert res.output.strip() == message


def test_a_snapshot_and_an_outputs_file_are_not_comparable(tmp_path):
    pa = save_snapshot(base(), tmp_path / "a.safetensors")
    out = tmp_path / "out.safetensors"
    assert CliRunner().invoke(cli, ["replay", pa, "--backend", "reference", "-o", str(out)]).exit_code \
        in (0, 3)
    res = run(pa, out)
    assert res.exit_code == 2
    assert res.output.strip() == "Error: not comparable: A is a snapshot but B is a replay -o file"
    missing = run(pa, tmp_path / "nope.safetensors")
    assert missing.exit_code == 2 and len(missing.output.strip().splitlines()) == 1


def test_saved_outputs_are_compared_per_request_and_head(tmp_path):
    a = base()
    b = clone(a)
    k, _ = b.kv_views()
    k[page_of(b, 1, 3), :, :] *= -1.0  # request 1's logical page 3: its outputs move, request 0's do not
    pa, pb = save_pair(tmp_path, a, b)
    outputs = []
    for name, path in (("oa", pa), ("ob", pb)):
        out = tmp_path / f"{name}.safetensors"
        CliRunner().invoke(cli, ["replay", path, "--backend", "reference", "-o", str(out)])
        outputs.append(out)
    res = run(*outputs, "--json")
    assert res.exit_code == 1, res.output
    data = strict(res.output)
    by_name = {c["expected"]: c for c in data["outputs"]}
    assert set(by_name) == {"A reference", "A captured"}
    assert by_name["A captured"]["passed"]  # the engine output is stored as captured in both: unchanged
    failing = {(h["request"], h["head"]) for h in by_name["A reference"]["heads"] if not h["passed"]}
    assert failing == {(1, h) for h in range(8)}
    assert data["notes"] == []
    same = run(outputs[0], outputs[0])
    assert same.exit_code == 0 and "PASS: outputs agree within tolerance (32 heads)" in same.output


def test_pages_are_read_a_chunk_at_a_time(tmp_path, monkeypatch):
    import kvdbg.moves.snapdiff as snapdiff

    a, b = base(), reversed_placement(base())
    k, _ = b.kv_views()
    k[page_of(b, 1, 4), :, 7] -= 2.0
    pa, pb = save_pair(tmp_path, a, b)
    whole = strict(run(pa, pb, "--json").output)["steps"][0]
    monkeypatch.setattr(snapdiff, "PAGE_CHUNK", 2)
    monkeypatch.setattr(snapdiff, "COMPARE_CHUNK_ELEMENTS", 64 * 8)  # one request per output chunk
    chunked = strict(run(pa, pb, "--json").output)
    assert chunked["steps"][0] == whole
    assert [h["request"] for h in chunked["outputs"][0]["heads"]] == [0] * 8 + [1] * 8


def test_table_reads_whole_at_80_columns(tmp_path):
    a, b = base(), reversed_placement(base())
    k, _ = b.kv_views()
    k[page_of(b, 1, 2), :, 5] += 1.0
    pa, pb = save_pair(tmp_path, a, b)
    res = CliRunner().invoke(cli, ["diff", pa, pb], env={"NO_COLOR": "1", "COLUMNS": "80"})
    assert all(len(line) <= 80 for line in res.output.splitlines())
    assert "hidden at" not in res.output
    assert "1 differ (1 slot(s), max abs 1.0" in " ".join(res.output.split())


def test_snapshots_are_not_written(tmp_path):
    import hashlib

    pa, pb = save_pair(tmp_path, base(), reversed_placement(base()))
    digest = [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (pa, pb)]
    run(pa, pb)
    assert digest == [hashlib.sha256(open(p, "rb").read()).hexdigest() for p in (pa, pb)]
