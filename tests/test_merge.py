"""kvdbg merge: the tensor-parallel ranks of one step joined into one snapshot of all heads, or refused by field."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from click.testing import CliRunner

from kvdbg import api
from kvdbg.snapshot.layout import kv_head_dim
from kvdbg.cli import cli
from kvdbg.snapshot.merge import MergeError, kv_head_assignment, merge_ranks
from kvdbg.snapshot.store import Snapshot, Step, load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from tests.helpers import assert_close_ulps

ENGINE = "1764633600123456789"


def split_into_ranks(full: Snapshot, tp_size: int, *, engine: str = ENGINE, step: int = 5,
                     record_total: bool = True) -> list[Snapshot]:
    """What ``tp_size`` tensor-parallel ranks of vLLM capture for the step ``full`` holds (vLLM's head split)."""
    layer, meta = full.meta.layer, full.meta
    hq = layer.num_heads // tp_size
    hkv = max(1, layer.num_kv_heads // tp_size)
    kv_dim = kv_head_dim(meta.kv_layout)
    shards = []
    for rank in range(tp_size):
        kv = list(kv_head_assignment(rank, tp_size, hkv, layer.num_kv_heads))
        heads = slice(rank * hq, (rank + 1) * hq)
        steps = []
        for s in full.steps:
            part = Step(block_table=s.block_table.clone(), seq_lens=s.seq_lens.clone(),
                        query_start_loc=s.query_start_loc.clone(), query=s.query[:, heads].clone())
            part.slot_mapping = None if s.slot_mapping is None else s.slot_mapping.clone()
            part.key = None if s.key is None else s.key[:, kv].clone()
            part.value = None if s.value is None else s.value[:, kv].clone()
            part.output = None if s.output is None else s.output[:, heads].clone()
            steps.append(part)
        capture = dict(meta.capture, rank=rank, tp_rank=rank, tp_size=tp_size, engine_instance=engine, step=step,
                       dp_rank=0, pid=1000 + rank)
        if record_total:
            capture["total_num_kv_heads"] = layer.num_kv_heads
        shard_meta = dataclasses.replace(meta, layer=dataclasses.replace(layer, num_heads=hq, num_kv_heads=hkv),
                                         capture=capture)
        values = {name: t[heads].clone() for name, t in full.layer_tensors().items()}  # sliced as the heads
        shards.append(Snapshot(meta=shard_meta, kv_cache=full.kv_cache.index_select(kv_dim, torch.tensor(kv)),
                               page_ids=full.page_ids.clone(), steps=steps, **values))
    return shards


def write_shards(directory, shards: list[Snapshot], stem: str = "model.layers.0.self_attn.attn-step5") -> list[str]:
    os.makedirs(directory, exist_ok=True)
    return [save_snapshot(s, os.path.join(directory, f"{stem}-rank{i}-{i:04d}.safetensors"))
            for i, s in enumerate(shards)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("num_heads, num_kv_heads, tp_size", [(8, 4, 2), (8, 2, 4), (4, 1, 2)],
                         ids=["split", "split-4-ranks", "replicated-kv"])
def test_the_merged_ranks_are_the_whole_step(num_heads, num_kv_heads, tp_size):
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45, 70), num_heads=num_heads, num_kv_heads=num_kv_heads,
                                    head_size=16, engine_output="reference"))
    shards = split_into_ranks(full, tp_size)
    merged = merge_ranks(list(reversed(shards)))  # any order
    for name, t in full.tensors().items():
        assert same_bytes(merged.tensors()[name], t), name
    assert (merged.meta.layer.num_heads, merged.meta.layer.num_kv_heads) == (num_heads, num_kv_heads)
    assert dataclasses.replace(merged.meta.layer) == full.meta.layer
    capture = merged.meta.capture
    assert capture["tp_rank"] is None and capture["rank"] is None and capture["merged_by"].startswith("kvdbg merge")
    assert [m["tp_rank"] for m in capture["merged_from"]] == list(range(tp_size))
    assert capture["merged_from"][1]["heads"] == [num_heads // tp_size, 2 * num_heads // tp_size]
    replicas = [m["kv_replica"] for m in capture["merged_from"]]
    copies = max(1, tp_size // num_kv_heads)  # ranks holding each KV head
    assert replicas == [rank % copies != 0 for rank in range(tp_size)]


@pytest.mark.parametrize("features", [{}, {"sinks": "auto", "alibi_slopes": "auto"}], ids=["plain", "sinks-alibi"])
def test_the_merged_replay_equals_the_replays_of_the_ranks(tmp_path, features):
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45, 70), num_heads=8, num_kv_heads=4, head_size=16,
                                    engine_output="reference", **features))
    assert set(full.layer_tensors()) == set(features)
    paths = write_shards(tmp_path / "ranks", split_into_ranks(full, 2))
    out = tmp_path / "merged.safetensors"
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", str(out), "--json"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["tp_ranks"] == [0, 1]
    backends = ["reference"] if features else ["reference", "flex"]  # flex models neither sinks nor ALiBi
    merged = api.replay(load_snapshot(out), backends)
    ranks = [api.replay(load_snapshot(p), backends) for p in paths]
    assert merged.verdict.exit_code == 0 and all(r.verdict.exit_code == 0 for r in ranks)
    for name, values in full.layer_tensors().items():
        assert same_bytes(getattr(load_snapshot(out), name), values), name
    for backend in backends:
        whole = merged.result.steps[0].runs[backend].output
        joined = torch.cat([r.result.steps[0].runs[backend].output for r in ranks], dim=1)
        assert_close_ulps(whole, joined, ulps=4)


@pytest.mark.parametrize("change, says", [
    (lambda s: s.meta.capture.update(step=6), "capture.step is 6 but the first file's is 5: not the same step"),
    (lambda s: s.meta.capture.update(engine_instance="other"), "capture.engine_instance is 'other'"),
    (lambda s: s.steps[0].seq_lens.add_(1), "seq_lens differs from the first file's: not the same step"),
    (lambda s: s.meta.capture.update(tp_rank=0), "capture.tp_rank: the files are not every rank of one step "
                                                 "(tp_rank 0 given twice; capture.tp_size is 2)"),
])
def test_files_that_are_not_the_same_step_are_refused_naming_the_field(tmp_path, change, says):
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45), num_heads=4, num_kv_heads=2, head_size=16))
    shards = split_into_ranks(full, 2)
    change(shards[1])
    paths = write_shards(tmp_path, shards)
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "m.safetensors").exists()


def test_a_layer_field_that_differs_is_named():
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45), num_heads=4, num_kv_heads=2, head_size=16))
    shards = split_into_ranks(full, 2)
    shards[1] = dataclasses.replace(shards[1], meta=dataclasses.replace(
        shards[1].meta, layer=dataclasses.replace(shards[1].meta.layer, k_scale=2.0)))
    with pytest.raises(MergeError, match="layer.k_scale is 2.0 but the first file's is 1.0"):
        merge_ranks(shards)
    other_pages = split_into_ranks(full, 2)
    other_pages[1] = dataclasses.replace(other_pages[1], page_ids=other_pages[1].page_ids.flip(0))
    with pytest.raises(MergeError, match="page_ids differ from the first file's: not the same step"):
        merge_ranks(other_pages)


def test_a_missing_rank_and_unrecorded_facts_are_refused():
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45), num_heads=8, num_kv_heads=4, head_size=16))
    shards = split_into_ranks(full, 4)
    with pytest.raises(MergeError, match=r"tp_rank 3 missing; capture.tp_size is 4"):
        merge_ranks(shards[:3])
    replicated = split_into_ranks(synth_snapshot(SynthSpec(seq_lens=(20,), num_heads=4, num_kv_heads=1,
                                                           head_size=16)), 2, record_total=False)
    with pytest.raises(MergeError, match=r"total_num_kv_heads is not recorded .*\(--num-kv-heads\)"):
        merge_ranks(replicated)
    assert merge_ranks(replicated, total_kv_heads=1).meta.layer.num_kv_heads == 1
    # The new K/V of a replicated head too: the merged file would keep one rank's and hide the other's.
    for name in ("key", "value"):
        changed = [replicated[0], dataclasses.replace(replicated[1], steps=[
            dataclasses.replace(replicated[1].steps[0], **{name: getattr(replicated[1].steps[0], name) + 1})])]
        with pytest.raises(MergeError, match=f"step 0 {name} differs from .* replicated KV head 0"):
            merge_ranks(changed, total_kv_heads=1)
    replicated[1].kv_cache.view(torch.uint8)[0] ^= 1
    with pytest.raises(MergeError, match="kv_cache differs from .* replicated KV head 0"):
        merge_ranks(replicated, total_kv_heads=1)
    lone = dataclasses.replace(shards[0], meta=dataclasses.replace(shards[0].meta, capture={"step": 5}))
    with pytest.raises(MergeError, match="capture.tp_size and capture.tp_rank are not recorded"):
        merge_ranks([lone, shards[1]])
    with pytest.raises(MergeError, match="at least two ranks"):
        merge_ranks(shards[:1])


def test_merge_never_clobbers(tmp_path):
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45), num_heads=4, num_kv_heads=2, head_size=16))
    paths = write_shards(tmp_path, split_into_ranks(full, 2))
    out = tmp_path / "m.safetensors"
    out.write_bytes(b"mine")
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", str(out)])
    assert res.exit_code == 2 and "already exists; pass --force" in res.output and out.read_bytes() == b"mine"
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", paths[0], "--force"])
    assert res.exit_code == 2 and "is an input of this command" in res.output
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", str(out), "--force"])
    assert res.exit_code == 0 and "merged 2 ranks of model.layers.0.self_attn.attn step 5: 4 query heads, " \
        "2 KV heads" in res.output
    assert load_snapshot(out).meta.layer.num_heads == 4


def _cache_as_float8(shard: Snapshot) -> Snapshot:
    return dataclasses.replace(shard, kv_cache=shard.kv_cache.view(torch.float8_e4m3fn))


def _query_as_bfloat16(shard: Snapshot) -> Snapshot:
    shard.steps[0].query = shard.steps[0].query.view(torch.float8_e4m3fn).to(torch.bfloat16)
    return shard


@pytest.mark.parametrize("retype, says", [
    (_cache_as_float8, "tensor 'kv_cache' is stored as float8_e4m3fn but the first file's as uint8"),
    (_query_as_bfloat16, "tensor 'query' is stored as bfloat16 but the first file's as uint8"),
])
def test_ranks_storing_a_tensor_in_another_dtype_are_refused(tmp_path, retype, says):
    """Each dtype is legal for an FP8 layer, but torch.cat of two would turn one rank's raw FP8 bytes into numbers."""
    full = synth_snapshot(SynthSpec(seq_lens=(20, 45), num_heads=4, num_kv_heads=2, head_size=16, fp8=True))
    shards = split_into_ranks(full, 2)
    assert shards[1].kv_cache.dtype == shards[1].steps[0].query.dtype == torch.uint8
    shards[1] = retype(shards[1])
    paths = write_shards(tmp_path, shards)
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 2 and says in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert "rank1" in res.output and not (tmp_path / "m.safetensors").exists()


def test_a_huge_claimed_tp_size_is_refused_in_one_short_line(tmp_path):
    """tp_size is the file's claim: the missing ranks are counted, not listed, and no range of it is built."""
    full = synth_snapshot(SynthSpec(seq_lens=(20,), num_heads=4, num_kv_heads=2, head_size=16))
    shards = split_into_ranks(full, 2)
    for shard in shards:
        shard.meta.capture["tp_size"] = 10**7
    paths = write_shards(tmp_path, shards)
    res = CliRunner().invoke(cli, ["merge", *paths, "-o", str(tmp_path / "m.safetensors")])
    assert res.exit_code == 2 and len(res.output) < 200, res.output[:300]
    assert "(tp_rank 2, 3, 4, 5, 6, … (9999998 in all) missing; capture.tp_size is 10000000)" in res.output
    shards[1].meta.capture.update(tp_size=2, tp_rank=7)
    shards[0].meta.capture.update(tp_size=2)
    with pytest.raises(MergeError, match=r"\(tp_rank 7 not below capture.tp_size; tp_rank 1 missing; "
                                         r"capture.tp_size is 2\)"):
        merge_ranks(shards)
