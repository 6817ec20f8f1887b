"""`kvdbg import` of a flashinfer-bench dataset: paged GQA decode and prefill workloads as snapshots, every other
workload listed, hostile and inconsistent files refused in one line naming the field.

The dataset is written by tests/fibench_dataset.py from flashinfer-bench's public schema. What each workload
must compute is worked out there in float64 from the workload's own tensors (no kvdbg code), planted as the
snapshot's output, and held against kvdbg's reference by `kvdbg replay`.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot, save_snapshot
from tests import fibench_dataset as fb


def run_cli(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


@pytest.fixture
def dataset(tmp_path) -> tuple[Path, dict]:
    root = tmp_path / "flashinfer-trace"
    return root, fb.write_dataset(root)


def _import_json(*args) -> dict:
    result = run_cli("import", *args, "--json")
    assert result.exit_code == 0, result.output
    return _strict(result.output)


def _imported(data: dict) -> dict[str, dict]:
    return {item["workload"]: item for item in data["items"] if item["status"] == "imported"}


def _one_line_error(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output
    return lines[0]


# ----------------------------------------------------------------------------- the listing


def test_every_workload_is_listed_and_each_stored_paged_gqa_one_imported(dataset):
    root, _ = dataset
    data = _import_json(root)
    assert data["kind"] == "flashinfer_bench" and data["workloads"] == 8 and data["written"] is False
    assert data["totals"] == {"imported": 4, "used": 0, "skipped": 3, "refused": 1}
    status = {item["workload"]: (item["status"], item["definition"], item["reason"]) for item in data["items"]}
    assert {u for u, s in status.items() if s[0] == "imported"} == {fb.DECODE_A, fb.DECODE_B, fb.DECODE_PS1,
                                                                   fb.PREFILL_A}
    assert status[fb.NORM_A] == ("skipped", fb.RMSNORM, "op_type rmsnorm: not attention")
    assert status[fb.MLA_A][0] == status[fb.RAGGED_A][0] == "skipped"
    assert "attention, but not paged GQA" in status[fb.RAGGED_A][2]
    refused = status[fb.DECODE_RANDOM]
    assert refused[0] == "refused" and "q, k_cache, v_cache are random" in refused[2]
    assert "stored: kv_indptr, kv_indices, kv_last_page_len, sm_scale" in refused[2]
    facts = _imported(data)[fb.PREFILL_A]["snapshot"]
    assert facts == {"requests": 3, "tokens": 11, "num_heads": 8, "num_kv_heads": 2, "head_size": 64,
                     "page_size": 16, "kv_layout": "NHD", "causal": True, "sliding_window": None,
                     "logits_soft_cap": None, "sinks": False, "dtype": "bfloat16", "kv_cache_dtype": "auto",
                     "output": False}


def test_a_random_workload_alone_is_refused_by_name_with_exit_2(dataset):
    root, _ = dataset
    line = _one_line_error(run_cli("import", root, "--workload", fb.DECODE_RANDOM),
                           "q, k_cache, v_cache are random", fb.DECODE_RANDOM, "never recorded")
    assert "gqa_paged_decode_h8_kv2_d64_ps16.jsonl:3" in line


def test_a_random_workload_is_refused_as_random_whatever_axes_it_gives(dataset):
    """flashinfer-bench's collection writes only the axes of what it stores when q, k_cache, v_cache are random."""
    root, _ = dataset
    fb.edit_workload(root, fb.DECODE_RANDOM, _set(["workload", "axes"], {"len_indptr": 3, "num_kv_indices": 3}))
    _one_line_error(run_cli("import", root, "--workload", fb.DECODE_RANDOM), "q, k_cache, v_cache are random")


def test_a_dataset_without_a_paged_gqa_workload_imports_nothing(dataset):
    root, _ = dataset
    _one_line_error(run_cli("import", root / "workloads" / "rmsnorm" / f"{fb.RMSNORM}.jsonl"),
                    "no workload of a paged GQA decode or prefill definition among its 1 workload(s)",
                    f"definitions: {fb.RMSNORM}")


def test_one_workloads_file_or_one_workload(dataset, tmp_path):
    root, _ = dataset
    data = _import_json(root / "workloads" / "gqa_paged" / f"{fb.DECODE16}.jsonl")
    assert [item["workload"] for item in data["items"]] == [fb.DECODE_A, fb.DECODE_B, fb.DECODE_RANDOM]
    one = tmp_path / "one.safetensors"
    data = _import_json(root, "--workload", fb.PREFILL_A[:8], "-o", one)
    assert [item["output"] for item in data["items"]] == [str(one)]
    assert load_snapshot(str(one)).meta.capture["workload"] == fb.PREFILL_A
    _one_line_error(run_cli("import", root, "--workload", "ffffffff"), "--workload ffffffff: no workload")


# ----------------------------------------------------------------------------- what a snapshot holds


def test_the_snapshot_holds_the_workload_as_the_definition_says(dataset, tmp_path):
    root, workloads = dataset
    out = tmp_path / "snaps"
    data = _import_json(root, "-o", out)
    prefill = load_snapshot(_imported(data)[fb.PREFILL_A]["output"])
    step = prefill.steps[0]
    assert step.seq_lens.tolist() == [20, 33, 7]
    assert step.query_start_loc.tolist() == [0, 3, 4, 11]
    assert prefill.meta.layer.causal and prefill.meta.layer.scale == 0.125
    assert prefill.meta.kv_layout == LAYOUT_KV_PLANES and prefill.meta.backend.name == "FLASHINFER"
    assert prefill.meta.backend.page_size == 16 and prefill.meta.backend.num_gpu_blocks == 10
    assert step.output is None
    raw = workloads[fb.PREFILL_A].tensors
    assert sorted(prefill.page_ids.tolist()) == sorted(raw["kv_indices"].tolist())  # only the pages read
    capture = prefill.meta.capture
    assert capture["definition"] == fb.PREFILL16 and capture["workload"] == fb.PREFILL_A
    assert capture["workload_file"] == f"workloads/gqa_paged/{fb.PREFILL16}.jsonl:1"
    assert capture["blobs"] == [fb.blob_path(fb.PREFILL16, "gqa_paged", fb.PREFILL_A).removeprefix("./")]
    assert capture["output_recorded"] is False and capture["stage"] == "prefill"
    assert capture["last_page_len_from"] == "the kv_last_page_len input"
    assert len(capture["reference_sha256"]) == 64
    ps1 = load_snapshot(_imported(data)[fb.DECODE_PS1]["output"])
    assert ps1.steps[0].seq_lens.tolist() == [9, 4] and ps1.meta.layer.scale == pytest.approx(1 / 32 ** 0.5)
    assert ps1.meta.capture["sm_scale_from"] == "safetensors input"
    assert ps1.meta.capture["last_page_len_from"].startswith("none given: every page is full")
    info = run_cli("info", _imported(data)[fb.PREFILL_A]["output"], env={"COLUMNS": "200", "NO_COLOR": "1"})
    assert info.exit_code == 0 and f"workload={fb.PREFILL_A}" in info.output


def _planted(path: str, output: torch.Tensor, target: Path) -> Path:
    snapshot = load_snapshot(path)
    snapshot.steps[0].output = output.to(torch.bfloat16)
    save_snapshot(snapshot, target)
    return target


@pytest.mark.parametrize("uuid", [fb.DECODE_A, fb.DECODE_B, fb.DECODE_PS1, fb.PREFILL_A])
def test_the_definitions_own_semantics_pass_against_kvdbgs_reference(dataset, tmp_path, uuid):
    """The float64 reading of the definition (decode: every key; prefill: bottom-right causal; the last page cut
    to kv_last_page_len), planted as the engine's output, is what kvdbg's reference computes from the snapshot."""
    root, workloads = dataset
    snap = _imported(_import_json(root, "-o", tmp_path / "snaps"))[uuid]["output"]
    planted = _planted(snap, fb.expected_output(workloads[uuid]), tmp_path / "planted.safetensors")
    result = run_cli("replay", planted, "--backend", "reference", "--json")
    data = _strict(result.output)
    assert result.exit_code == 0, data["verdict"]
    [captured] = [c for c in data["comparisons"] if c["actual"] == "captured"]
    assert captured["passed"] and captured["heads_compared"] > 0


def test_a_wrong_output_fails_naming_the_request_and_head(dataset, tmp_path):
    root, workloads = dataset
    snap = _imported(_import_json(root, "-o", tmp_path / "snaps"))[fb.PREFILL_A]["output"]
    expected = fb.expected_output(workloads[fb.PREFILL_A])
    expected[3, 5] += 0.5  # request 1 holds one query token, the fourth row
    planted = _planted(snap, expected, tmp_path / "wrong.safetensors")
    result = run_cli("replay", planted, "--backend", "reference", "--json")
    assert result.exit_code == 1
    [captured] = [c for c in _strict(result.output)["comparisons"] if c["actual"] == "captured"]
    assert [(h["request"], h["head"]) for h in captured["heads"] if not h["passed"]] == [(1, 5)]


@pytest.mark.parametrize("uuid", [fb.DECODE_A, fb.PREFILL_A])
def test_without_a_recorded_output_the_named_backend_is_judged_against_the_reference(dataset, tmp_path, uuid):
    root, _ = dataset
    snap = _imported(_import_json(root, "-o", tmp_path / "snaps"))[uuid]["output"]
    result = run_cli("replay", snap, "--backend", "flex", "--json")
    data = _strict(result.output)
    assert result.exit_code == 0, data["verdict"]
    assert data["verdict"]["summary"].startswith("PASS: 1 comparison(s)")
    assert not [c for c in data["comparisons"] if c["actual"] == "captured"]
    # Nothing named, no captured output: nothing of this snapshot's own backend ran here, so nothing counts.
    plain = run_cli("replay", snap, "--json")
    assert plain.exit_code == 3, plain.output
    assert "no captured output" in _strict(plain.output)["verdict"]["summary"]


def test_page_zero_is_a_page_to_flashinfer_and_flex_says_what_vllm_would_hide(dataset, tmp_path):
    """DECODE_B reads page 0: FlashInfer's paged kernels read it as any page, vLLM's FLEX_ATTENTION takes it for
    the null block. The flex column (a what-if for a FLASHINFER snapshot) says so when it is judged."""
    root, workloads = dataset
    snap = _imported(_import_json(root, "-o", tmp_path / "snaps"))[fb.DECODE_B]["output"]
    assert 0 in load_snapshot(snap).page_ids.tolist()
    result = run_cli("replay", snap, "--backend", "flex", "--json")
    assert result.exit_code == 1
    assert "live_page_zero" in {f["code"] for f in _strict(result.output)["findings"]}


def test_a_hnd_definition_is_read_by_its_axis_names(dataset, tmp_path):
    root, _ = dataset
    name, uuid = "gqa_paged_decode_h8_kv2_d64_ps16_hnd", "0a1b2c3d-4e5f-4a6b-8c7d-8e9f0a1b2c3d"
    definition = fb.gqa_paged_definition(name, "decode", 8, 2, 64, 16, last_page="batch", layout="HND")
    (root / "definitions" / "gqa_paged" / f"{name}.json").write_text(json.dumps(definition))
    tensors = fb._paged(9, 8, 2, 64, 16, [40, 3], [1, 1], 6, "batch")
    w = fb.Workload(name, uuid, "decode", tensors, 0.09, 16)
    hnd = dict(tensors, k_cache=tensors["k_cache"].transpose(1, 2), v_cache=tensors["v_cache"].transpose(1, 2))
    w.tensors = hnd
    w.axes = fb._axes(w, "decode")
    fb._stored(root, w, "gqa_paged")
    (root / "workloads" / "gqa_paged" / f"{name}.jsonl").write_text(json.dumps(fb._line(name, uuid, w.axes,
                                                                                         w.inputs)) + "\n")
    snap = _import_json(root, "--workload", uuid, "-o", tmp_path / "hnd.safetensors")["items"][0]["output"]
    assert load_snapshot(snap).meta.kv_layout == LAYOUT_VLLM
    w.tensors = tensors  # the NHD reading of the same pages
    planted = _planted(snap, fb.expected_output(w), tmp_path / "planted.safetensors")
    assert run_cli("replay", planted, "--backend", "reference").exit_code == 0


# ----------------------------------------------------------------------------- refused, naming the field


def _set(path: list[str], value):
    def change(record):
        target = record
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _blob(root: Path, workloads, uuid: str) -> Path:
    w = workloads[uuid]
    return root / fb.blob_path(w.definition, "gqa_paged", uuid)


def _not_monotone(root, workloads):
    fb.rewrite_blob(root, workloads[fb.DECODE_A], kv_indptr=torch.tensor([0, 3, 2, 5], dtype=torch.int32))


def _past_the_pages(root, workloads):
    indices = workloads[fb.DECODE_A].tensors["kv_indices"].clone()
    indices[1] = 99
    fb.rewrite_blob(root, workloads[fb.DECODE_A], kv_indices=indices)


def _escaping(root, workloads):
    outside = root.parent / "outside.safetensors"
    outside.write_bytes(_blob(root, workloads, fb.DECODE_A).read_bytes())
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "inputs", "q", "path"], "./blob/../../outside.safetensors"))


def _absolute(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "inputs", "q", "path"],
                                             str(_blob(root, workloads, fb.DECODE_A))))


def _link_out(root, workloads):
    blob = _blob(root, workloads, fb.DECODE_A)
    outside = root.parent / "elsewhere.safetensors"
    outside.write_bytes(blob.read_bytes())
    blob.unlink()
    blob.symlink_to(outside)


def _huge_axis(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "axes", "num_pages"], 2**40))


def _huge_shape(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "axes", "num_pages"], 2**31 - 1))


def _huge_header(root, workloads):
    """A safetensors header that declares a [2^31, 2^20] tensor over a few bytes."""
    header = json.dumps({"q": {"dtype": "BF16", "shape": [2**31, 2**20], "data_offsets": [0, 2**52]}}).encode()
    _blob(root, workloads, fb.DECODE_A).write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)


def _lfs(root, workloads):
    _blob(root, workloads, fb.DECODE_A).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:ab\n"
                                                   "size 123\n")


def _fifo(root, workloads):
    blob = _blob(root, workloads, fb.DECODE_A)
    blob.unlink()
    os.mkfifo(blob)


def _last_page(root, workloads):
    fb.rewrite_blob(root, workloads[fb.DECODE_A], kv_last_page_len=torch.tensor([17, 16, 5], dtype=torch.int32))


def _dtype(root, workloads):
    fb.rewrite_blob(root, workloads[fb.DECODE_A], q=workloads[fb.DECODE_A].tensors["q"].to(torch.float16))


def _unknown_input(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "inputs", "window_left"], {"type": "scalar", "value": 3}))


def _nan_scale(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "inputs", "sm_scale"], {"type": "scalar", "value": "nan"}))


def _missing_key(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "inputs", "q", "tensor_key"], "query"))


def _axis_of_another(root, workloads):
    fb.edit_workload(root, fb.DECODE_A, _set(["workload", "axes", "num_qo_heads"], 16))


HOSTILE = {
    "indptr not monotone": (_not_monotone, "kv_indptr[2] = 2 < kv_indptr[1] = 3: kv_indptr must never decrease"),
    "index past the pages": (_past_the_pages, "kv_indices[1] = 99 is outside k_cache's 12 pages"),
    "path escaping the root": (_escaping, "inputs.q.path './blob/../../outside.safetensors' leads outside the "
                                          "dataset root"),
    "absolute path": (_absolute, "is not relative to the dataset root"),
    "link out of the root": (_link_out, "leads outside the dataset root"),
    "huge axis": (_huge_axis, "axes.num_pages = 1099511627776 must be an integer in [0, 2147483647]"),
    "huge declared shape": (_huge_shape, "has shape [12, 16, 2, 64], but the definition's shape with the "
                                         "workload's axes is [2147483647, 16, 2, 64]"),
    "huge header": (_huge_header, "is not a readable safetensors file"),
    "git lfs pointer": (_lfs, "is a Git LFS pointer, not the tensors"),
    "named pipe": (_fifo, "not a regular file"),
    "last page too long": (_last_page, "kv_last_page_len[0] = 17 is outside [0, page_size 16]"),
    "dtype": (_dtype, "inputs.q: ", "is float16, but the definition declares bfloat16"),
    "unknown input": (_unknown_input, f"inputs.window_left is not an input of {fb.DECODE16}"),
    "nan scale": (_nan_scale, "inputs.sm_scale.value must be a finite number > 0"),
    "missing tensor key": (_missing_key, "tensor_key 'query' is not in"),
    "const axis overridden": (_axis_of_another, f"axes.num_qo_heads = 16, but {fb.DECODE16} fixes it at 8"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_and_inconsistent_workloads_are_refused_in_one_line_naming_the_field(dataset, case):
    root, workloads = dataset
    make, *needles = HOSTILE[case]
    make(root, workloads)
    _one_line_error(run_cli("import", root, "--workload", fb.DECODE_A), fb.DECODE_A, *needles)
    # the others still import, and the listing names the refusal
    data = _import_json(root)
    assert data["totals"]["imported"] == 3 and data["totals"]["refused"] == 2
    [item] = [i for i in data["items"] if i["workload"] == fb.DECODE_A]
    assert item["status"] == "refused" and needles[-1] in item["reason"]


def test_the_escaping_path_is_never_opened(dataset, monkeypatch):
    root, workloads = dataset
    _escaping(root, workloads)
    opened = []
    real_open = open

    def watch(path, *args, **kwargs):
        opened.append(os.path.realpath(path))
        return real_open(path, *args, **kwargs)

    import safetensors

    real_safe_open = safetensors.safe_open

    def watch_safetensors(path, *args, **kwargs):
        opened.append(os.path.realpath(path))
        return real_safe_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", watch)
    monkeypatch.setattr(safetensors, "safe_open", watch_safetensors)
    assert run_cli("import", root, "-o", root.parent / "snaps").exit_code == 0
    assert os.path.realpath(_blob(root, workloads, fb.PREFILL_A)) in opened  # the watch sees blobs read
    assert os.path.realpath(root.parent / "outside.safetensors") not in opened


def test_a_prefill_with_more_queries_than_keys_is_refused(dataset):
    root, workloads = dataset
    w = workloads[fb.PREFILL_A]
    fb.rewrite_blob(root, w, qo_indptr=torch.tensor([0, 3, 4, 11], dtype=torch.int32),
                    kv_last_page_len=torch.tensor([4, 1, 5, 0], dtype=torch.int32))
    _one_line_error(run_cli("import", root, "--workload", fb.PREFILL_A),
                    "request 2 has 7 queries (qo_indptr) but 5 keys")


def test_a_malformed_line_is_refused_and_the_rest_imported(dataset):
    root, _ = dataset
    path = root / "workloads" / "gqa_paged" / f"{fb.DECODE16}.jsonl"
    path.write_text(path.read_text() + "{not json\n" + json.dumps({"definition": fb.DECODE16}) + "\n")
    data = _import_json(root)
    reasons = [i["reason"] for i in data["items"] if i["status"] == "refused"]
    assert any(f"{fb.DECODE16}.jsonl:4: not JSON" in r for r in reasons)
    assert any(f"{fb.DECODE16}.jsonl:5: field workload is missing" in r for r in reasons)
    assert data["totals"]["imported"] == 4


DEFINITION_EDITS = {
    "an input kvdbg does not read": (
        lambda d: d["inputs"].update(logits_soft_cap={"shape": None, "dtype": "float32"}),
        "input 'logits_soft_cap' is not one kvdbg reads in a gqa_paged decode definition"),
    "a layout neither NHD nor HND": (
        lambda d: [d["inputs"][n].update(shape=["num_pages", "head_dim", "page_size", "num_kv_heads"])
                   for n in ("k_cache", "v_cache")],
        "is neither [pages, page_size, num_kv_heads, head_dim] (NHD) nor"),
    "an FP8 cache": (lambda d: [d["inputs"][n].update(dtype="float8_e4m3fn") for n in ("k_cache", "v_cache")],
                     "inputs.k_cache.dtype 'float8_e4m3fn'"),
    "a variable head count": (lambda d: d["axes"].update(num_kv_heads={"type": "var"}),
                              "axes.num_kv_heads must be a const axis"),
}


@pytest.mark.parametrize("case", sorted(DEFINITION_EDITS))
def test_a_definition_kvdbg_cannot_read_is_refused_naming_the_field(dataset, case):
    root, _ = dataset
    edit, needle = DEFINITION_EDITS[case]
    path = root / "definitions" / "gqa_paged" / f"{fb.DECODE16}.json"
    definition = json.loads(path.read_text())
    edit(definition)
    path.write_text(json.dumps(definition))
    _one_line_error(run_cli("import", root, "--workload", fb.DECODE_A),
                    f"definitions/gqa_paged/{fb.DECODE16}.json: ", needle)


def test_a_prefill_that_says_it_is_not_causal_is_refused(dataset):
    root, _ = dataset
    path = root / "definitions" / "gqa_paged" / f"{fb.PREFILL16}.json"
    definition = json.loads(path.read_text())
    definition["description"] = "Paged GQA prefill, non-causal (bidirectional)"
    path.write_text(json.dumps(definition))
    _one_line_error(run_cli("import", root, "--workload", fb.PREFILL_A), "says it is not causal")


def test_a_definition_named_twice_or_not_at_all_is_refused(dataset):
    root, _ = dataset
    source = root / "definitions" / "gqa_paged" / f"{fb.DECODE16}.json"
    (root / "definitions" / "copy.json").write_text(source.read_text())
    _one_line_error(run_cli("import", root, "--workload", fb.DECODE_A), "is given by more than one file",
                    "definitions/copy.json", f"definitions/gqa_paged/{fb.DECODE16}.json")
    (root / "definitions" / "copy.json").unlink()
    source.unlink()
    _one_line_error(run_cli("import", root, "--workload", fb.DECODE_A), f"no definition named '{fb.DECODE16}'")


def test_no_reference_code_is_ever_run(dataset, tmp_path):
    root, _ = dataset
    marker = tmp_path / "the reference ran"
    path = root / "definitions" / "gqa_paged" / f"{fb.DECODE16}.json"
    definition = json.loads(path.read_text())
    definition["reference"] = f"open({str(marker)!r}, 'w').close()\ndef run(*a):\n    open({str(marker)!r}, 'w')\n"
    path.write_text(json.dumps(definition))
    _import_json(root, "-o", tmp_path / "snaps")
    assert not marker.exists()


# ----------------------------------------------------------------------------- options and outputs


def test_options_that_belong_to_the_other_source_are_refused(dataset, tmp_path):
    root, _ = dataset
    _one_line_error(run_cli("import", root, "--kv-layout", "NHD"), "--kv-layout is for a FlashInfer dump")
    dump = tmp_path / "dump"
    dump.mkdir()
    _one_line_error(run_cli("import", dump, "--workload", "abc"), "--workload picks a flashinfer-bench workload")
    stray = tmp_path / "stray.jsonl"
    stray.write_text("{}\n")
    _one_line_error(run_cli("import", stray), "no definitions/ directory above it")


def test_outputs_are_checked_before_anything_is_written_and_never_clobbered(dataset, tmp_path):
    root, _ = dataset
    target = tmp_path / "one.safetensors"
    target.write_bytes(b"mine")
    _one_line_error(run_cli("import", root, "-o", target), "the dataset holds 4 paged GQA workloads; give a directory")
    _one_line_error(run_cli("import", root, "--workload", fb.DECODE_A, "-o", target), "already exists")
    assert target.read_bytes() == b"mine"
    assert run_cli("import", root, "--workload", fb.DECODE_A, "-o", target, "--force").exit_code == 0
    assert load_snapshot(str(target)).meta.capture["workload"] == fb.DECODE_A
    out = tmp_path / "snaps"
    data = _import_json(root, "-o", out)
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(i["output"]).name for i in _imported(data).values())
    assert f"001_{fb.DECODE16}_{fb.DECODE_A[:8]}.safetensors" in os.listdir(out)


def test_the_table_reads_whole_at_80_columns_without_color(dataset):
    root, _ = dataset
    result = run_cli("import", root, env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    assert all(len(line) <= 80 for line in result.output.splitlines())
    assert "flashinfer-bench dataset" in result.output and "8 workload(s): 4 imported, 3 skipped, 1 refused" in \
        " ".join(result.output.split())
    assert "no output tensor" in " ".join(result.output.split())


def test_a_long_line_is_refused_without_reading_it_whole(dataset, monkeypatch):
    from kvdbg.importers.fibench import dataset as module

    root, _ = dataset
    monkeypatch.setattr(module, "MAX_LINE_BYTES", 4096)
    path = root / "workloads" / "gqa_paged" / f"{fb.DECODE16}.jsonl"
    path.write_text('{"definition": "' + "x" * 10000 + '"}\n' + path.read_text())
    data = _import_json(root)
    [item] = [i for i in data["items"] if i["where"] == f"workloads/gqa_paged/{fb.DECODE16}.jsonl:1"]
    assert item["status"] == "refused" and item["reason"].endswith("a line longer than 4096 bytes")
    assert data["totals"]["imported"] == 4  # the lines after it are read as before


def test_names_from_the_dataset_never_reach_the_terminal_as_controls(dataset):
    root, _ = dataset
    fb.edit_workload(root, fb.DECODE_RANDOM, _set(["workload", "uuid"], "\x1b]0;pwned\x07\x1b[2J"))
    for args in ((root,), (root, "--workload", "\x1b]0;")):
        result = run_cli("import", *args, env={"COLUMNS": "80", "NO_COLOR": "1"})
        assert "\x1b" not in result.output and "\x07" not in result.output, result.output
