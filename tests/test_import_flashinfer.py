"""`kvdbg import`: FlashInfer level-10 dumps written by FlashInfer's own logging code, as snapshots.

The dumps under tests/flashinfer_dumps/data were written by FlashInfer 0.7.2.post1's ``flashinfer_api``
decorator (tests/flashinfer_dumps/make_dumps.py says how, and which outputs are computed rather than
kernel-made). KVDBG_FLASHINFER_DUMPS points these tests at freshly written ones instead (the stage
tests/flashinfer_dumps/run.sh does, with FlashInfer installed).
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from kvdbg.cli import cli
from kvdbg.importers.dumpdir import DumpError, signature_parameters
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.snapshot.store import load_snapshot
from tests.helpers import ROOT

DUMPS = Path(os.environ.get("KVDBG_FLASHINFER_DUMPS") or Path(ROOT) / "tests" / "flashinfer_dumps" / "data")


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))


def run_cli(*args, env=None):
    return CliRunner().invoke(cli, [str(a) for a in args], env=env)


def calls(session: Path, function: str) -> list[Path]:
    """``function``'s call directories in ``session``, in call order (``call0001`` first)."""
    return sorted((p for p in session.iterdir() if p.is_dir() and f"_{function}_call" in p.name),
                  key=lambda p: p.name.rpartition("_call")[2])


@pytest.fixture
def session(tmp_path) -> Path:
    """A private copy of the torch.save session (tests may change it)."""
    return Path(shutil.copytree(DUMPS / "torch", tmp_path / "dump"))


def _import_json(*args) -> dict:
    result = run_cli("import", *args, "--json")
    assert result.exit_code == 0, result.output
    return _strict(result.output)


# ----------------------------------------------------------------------------- the session listing


def test_a_session_lists_every_call_and_imports_each_paged_run(session, tmp_path):
    out = tmp_path / "snaps"
    data = _import_json(session, "-o", out)
    assert data["totals"] == {"imported": 5, "used": 9, "skipped": 3, "refused": 0}
    by_function = {}
    for item in data["items"]:
        by_function.setdefault(item["function"], []).append(item)
    assert [i["status"] for i in by_function["rmsnorm"]] == ["skipped"]
    assert by_function["rmsnorm"][0]["reason"] == "not paged attention"
    # The wrapper planned and never run: its __init__ and plan are listed, nothing imported from them.
    assert by_function["BatchDecodeWithPagedKVCacheWrapper.plan"][-1]["reason"] == "plan never run"
    written = sorted(p.name for p in out.iterdir())
    assert written == ["000_BatchPrefill.run_call0001.safetensors", "001_BatchDecode.run_call0001.safetensors",
                       "002_BatchDecode.run_call0002.safetensors", "003_BatchDecode.run_call0003.safetensors",
                       "004_BatchPrefill.run_call0002.safetensors"]
    assert data["written"] is True


def test_each_run_pairs_with_its_own_wrappers_latest_plan(session, tmp_path):
    """A decode and a prefill wrapper interleave; the decode wrapper is planned twice: self_id decides."""
    out = tmp_path / "snaps"
    _import_json(session, "-o", out)
    prefill = load_snapshot(out / "000_BatchPrefill.run_call0001.safetensors")
    decode1 = load_snapshot(out / "001_BatchDecode.run_call0001.safetensors")
    decode2 = load_snapshot(out / "002_BatchDecode.run_call0002.safetensors")
    # make_dumps: decode plan 1 indptr [0,3,4,5] indices [7,2,9,0,4] last [5,16,3].
    assert decode1.steps[0].seq_lens.tolist() == [37, 16, 3]
    assert decode1.steps[0].block_table.tolist() == [[7, 2, 9], [0, 0, 0], [4, 0, 0]]
    assert decode1.meta.layer.logits_soft_cap is None
    # decode plan 2 (same wrapper, later): indptr [0,2,4] indices [11,6,3,7] last [9,2], soft cap 30.
    assert decode2.steps[0].seq_lens.tolist() == [25, 18]
    assert decode2.steps[0].block_table.tolist() == [[11, 6], [3, 7]]
    assert decode2.meta.layer.logits_soft_cap == 30.0
    # prefill: qo_indptr [0,4,5,12], pages [1,3,5] [6,8] [10], last [8,1,12], causal, window_left 15.
    step = prefill.steps[0]
    assert step.query_start_loc.tolist() == [0, 4, 5, 12]
    assert step.seq_lens.tolist() == [40, 17, 12]
    assert prefill.meta.layer.causal is True and prefill.meta.layer.sliding_window == 16
    assert prefill.meta.backend.max_decode_query_len == 7


def test_layouts_scale_sinks_and_provenance(session, tmp_path):
    out = tmp_path / "snaps"
    _import_json(session, "-o", out)
    nhd = load_snapshot(out / "001_BatchDecode.run_call0001.safetensors")
    hnd = load_snapshot(out / "003_BatchDecode.run_call0003.safetensors")
    dense = load_snapshot(out / "004_BatchPrefill.run_call0002.safetensors")
    assert nhd.meta.kv_layout == LAYOUT_KV_PLANES and hnd.meta.kv_layout == LAYOUT_VLLM
    # NHD page 7 of the dumped K cache is stored page 7's K plane, token-major ([page_size, Hkv, D]).
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    k_cache = torch.load(run / "inputs.pt", weights_only=True)["arg_2__0"]
    stored = nhd.page_ids.tolist().index(7)
    assert torch.equal(nhd.kv_cache[0, stored], k_cache[7])
    # HND (one 5-D tensor [P, 2, Hkv, page_size, D]): page 9's V is the second half of the stored rows.
    run3 = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[2]
    kv = torch.load(run3 / "inputs.pt", weights_only=True)["arg_2"]
    stored = hnd.page_ids.tolist().index(9)
    assert torch.equal(hnd.kv_cache[stored, :, :, 64:], kv[9, 1])
    layer = hnd.meta.layer
    assert (layer.num_heads, layer.num_kv_heads, layer.head_size, layer.dtype) == (16, 4, 64, "bfloat16")
    assert layer.scale == pytest.approx(0.11) and layer.sliding_window == 12 and layer.logits_soft_cap == 12.0
    assert layer.has_sinks and torch.equal(hnd.sinks, torch.load(run3 / "inputs.pt", weights_only=True)["kwarg_sinks"])
    assert nhd.meta.layer.scale == pytest.approx(1 / 8)  # sm_scale not given: 1/sqrt(head_dim)
    assert dense.meta.layer.causal is False and dense.meta.layer.logits_soft_cap == 20.0
    capture = hnd.meta.capture
    assert capture["flashinfer"] == "0.7.2.post1" and capture["engine"] == "flashinfer 0.7.2.post1"
    assert capture["function"] == "BatchDecodeWithPagedKVCacheWrapper.run"
    assert capture["dump"] == str(run3) and capture["kv_layout"] == "HND" and capture["kv_layout_from"] == "__init__"
    assert hnd.meta.backend.name == "FLASHINFER"


# ----------------------------------------------------------------------------- replay


def _replay(path) -> tuple[int, dict]:
    result = run_cli("replay", path, "--backend", "reference", "--json")
    return result.exit_code, _strict(result.output)


@pytest.mark.parametrize("index", range(5))
def test_every_imported_run_replays_pass_against_its_recorded_output(session, tmp_path, index):
    out = tmp_path / "snaps"
    _import_json(session, "-o", out)
    path = sorted(out.iterdir())[index]
    code, data = _replay(path)
    assert code == 0, data["verdict"]
    captured = [c for c in data["comparisons"] if c["actual"] == "captured"]
    assert len(captured) == 1 and captured[0]["passed"] and captured[0]["heads_compared"] > 0


def test_a_planted_wrong_output_fails_naming_the_request_and_head(session, tmp_path):
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[2]  # HND, bf16, 4 requests, 16 heads
    outputs = torch.load(run / "outputs.pt", weights_only=True)
    outputs["result"][2, 5] += 0.5  # request 2 (one token each), head 5
    torch.save(outputs, run / "outputs.pt")
    snap = tmp_path / "one.safetensors"
    result = run_cli("import", run, "-o", snap)
    assert result.exit_code == 0, result.output
    code, data = _replay(snap)
    assert code == 1
    captured = next(c for c in data["comparisons"] if c["actual"] == "captured")
    assert [(h["request"], h["head"]) for h in captured["heads"] if not h["passed"]] == [(2, 5)]
    text = run_cli("replay", snap, "--backend", "reference", env={"COLUMNS": "80", "NO_COLOR": "1"}).output
    assert "captured vs reference — FAIL: 1 of 64 heads" in text


def test_one_run_goes_into_a_directory_when_o_ends_with_a_slash(tmp_path):
    data = _import_json(DUMPS / "safetensors", "-o", f"{tmp_path / 'snaps'}/")
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == ["000_BatchDecode.run_call0001.safetensors"]
    assert data["items"][-1]["output"] == str(tmp_path / "snaps" / "000_BatchDecode.run_call0001.safetensors")


def test_the_safetensors_form_imports_and_replays(tmp_path):
    snap = tmp_path / "st.safetensors"
    data = _import_json(DUMPS / "safetensors", "-o", snap)
    assert data["totals"]["imported"] == 1
    assert load_snapshot(snap).meta.kv_layout == LAYOUT_VLLM
    assert _replay(snap)[0] == 0


# ----------------------------------------------------------------------------- FP8 and the one-shot functions


@pytest.fixture
def more(tmp_path) -> Path:
    return Path(shutil.copytree(DUMPS / "more", tmp_path / "more"))


def test_fp8_and_the_one_shot_trtllm_functions_import_and_replay_pass(more, tmp_path):
    out = tmp_path / "snaps"
    data = _import_json(more, "-o", out)
    assert [(i["function"], i["status"]) for i in data["items"]] == [
        ("BatchDecodeWithPagedKVCacheWrapper.__init__", "used"), ("BatchDecodeWithPagedKVCacheWrapper.plan", "used"),
        ("BatchDecodeWithPagedKVCacheWrapper.run", "imported"), ("trtllm_batch_decode_with_kv_cache", "imported"),
        ("trtllm_batch_context_with_kv_cache", "imported")]
    fp8, decode, context = (load_snapshot(p) for p in sorted(out.iterdir()))
    layer = fp8.meta.layer
    assert (layer.kv_cache_dtype, layer.k_scale, layer.v_scale, layer.q_scale) == ("fp8_e4m3", 0.25, 0.25, 1.0)
    assert layer.dtype == "float16" and fp8.kv_cache.dtype == torch.float8_e4m3fn
    # trtllm decode: HND [P, 2, Hkv, page, D]; bmm1_scale is the scale; a block table's stale tail is dropped.
    assert decode.meta.layer.scale == pytest.approx(0.1) and decode.meta.layer.sliding_window == 21
    assert decode.meta.layer.has_sinks and decode.meta.kv_layout == LAYOUT_VLLM
    assert decode.steps[0].seq_lens.tolist() == [60, 17, 30]
    assert decode.steps[0].block_table.tolist() == [[8, 2, 5, 3], [1, 0, 0, 0], [4, 6, 0, 0]]
    assert decode.meta.capture["kv_layout_from"] == "the function's default"
    assert context.meta.kv_layout == LAYOUT_KV_PLANES and context.meta.layer.causal
    assert context.steps[0].query_start_loc.tolist() == [0, 6, 9]
    for path in sorted(out.iterdir()):
        code, replayed = _replay(path)
        assert code == 0, (path.name, replayed["verdict"])


def _set_recorded(call: Path, **values) -> None:
    """Append a record to ``call``'s metadata.jsonl with these arguments changed (the last record is read)."""
    record = json.loads((call / "metadata.jsonl").read_text().splitlines()[-1])
    record["input_metadata"].update({f"kwarg_{k}": v for k, v in values.items()})
    with open(call / "metadata.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")


def test_what_a_snapshot_cannot_hold_is_refused_naming_the_argument(more):
    decode = calls(more, "trtllm_batch_decode_with_kv_cache")[0]
    context = calls(more, "trtllm_batch_context_with_kv_cache")[0]
    _set_recorded(decode, bmm2_scale=2.0)
    inputs = torch.load(context / "inputs.pt", weights_only=True)
    inputs["kwarg_mask"] = torch.ones(9, 40, dtype=torch.bool)
    torch.save(inputs, context / "inputs.pt")
    data = _import_json(more)
    reasons = {i["function"]: i["reason"] for i in data["items"] if i["status"] == "refused"}
    assert "bmm2_scale) 2.0 scales the output of a bfloat16 cache" in reasons["trtllm_batch_decode_with_kv_cache"]
    assert "trtllm_batch_context_with_kv_cache.mask = a bool tensor of shape [9, 40]: a custom mask" in \
        reasons["trtllm_batch_context_with_kv_cache"]
    assert data["totals"] == {"imported": 1, "used": 2, "skipped": 0, "refused": 2}


# ----------------------------------------------------------------------------- untrusted input


class _CreatesAFile:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("form", ["pickle", "torch.save"])
def test_a_hostile_pickle_is_refused_without_running(session, tmp_path, form):
    marker = tmp_path / "pwned"
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    payload = {"arg_1": _CreatesAFile(str(marker))}
    with open(run / "inputs.pt", "wb") as fh:
        if form == "pickle":
            pickle.dump(payload, fh)
        else:
            torch.save(payload, fh)
    assert not marker.exists()
    result = run_cli("import", session, "-o", tmp_path / "snaps")
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "refused" in lines[0] and "inputs.pt" in lines[0]
    assert "weights_only" in lines[0]
    assert not marker.exists()
    assert not (tmp_path / "snaps").exists()


def test_a_pipe_instead_of_a_tensor_file_is_refused_not_waited_on(session, tmp_path):
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    (run / "inputs.pt").unlink()
    os.mkfifo(run / "inputs.pt")
    result = run_cli("import", run, "-o", tmp_path / "x.safetensors")
    assert result.exit_code == 2 and "inputs.pt: not a regular file" in result.output


def test_a_tensor_claiming_more_than_its_data_is_refused_before_any_copy(session, tmp_path):
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    inputs = torch.load(run / "inputs.pt", weights_only=True)
    inputs["arg_1"] = torch.zeros(1, dtype=torch.float16).expand(1 << 28, 8, 64)  # 64 GiB if copied
    torch.save(inputs, run / "inputs.pt")
    result = run_cli("import", run, "-o", tmp_path / "x.safetensors")
    assert result.exit_code == 2
    assert "tensor 'arg_1' of shape [268435456, 8, 64] claims more elements than its data" in result.output


def test_the_decode_plans_deprecated_positional_options_are_read_by_name(session, tmp_path):
    """FlashInfer still takes plan's options positionally after page_size (arg_8 on: pos_encoding_mode,
    window_left, logits_soft_cap, ...): the HND wrapper's plan recorded that way imports the same."""
    out = tmp_path / "snaps"
    _import_json(session, "-o", out)
    plan = calls(session, "BatchDecodeWithPagedKVCacheWrapper.plan")[2]
    record = json.loads((plan / "metadata.jsonl").read_text().splitlines()[-1])
    meta = record["input_metadata"]
    assert (meta.pop("kwarg_window_left"), meta.pop("kwarg_logits_soft_cap")) == (11, 12.0)
    meta.update({"arg_8": "NONE", "arg_9": 11, "arg_10": 12.0})
    with open(plan / "metadata.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[2]
    result = run_cli("import", run, "-o", tmp_path / "positional.safetensors")
    assert result.exit_code == 0, result.output
    positional = load_snapshot(tmp_path / "positional.safetensors").meta.layer
    keyword = load_snapshot(out / "003_BatchDecode.run_call0003.safetensors").meta.layer
    assert (positional.sliding_window, positional.logits_soft_cap) == (12, 12.0)
    assert positional == keyword
    # a positional argument past the names FlashInfer documents is refused, not dropped
    meta["arg_30"] = 1
    with open(plan / "metadata.jsonl", "a") as fh:
        fh.write(json.dumps(record) + "\n")
    result = run_cli("import", run, "-o", tmp_path / "p2.safetensors")
    assert result.exit_code == 2 and "positional argument arg_30 has no parameter" in result.output


def test_an_out_of_range_page_index_is_refused_naming_it(session, tmp_path):
    plan = calls(session, "BatchDecodeWithPagedKVCacheWrapper.plan")[0]
    inputs = torch.load(plan / "inputs.pt", weights_only=True)
    inputs["arg_2"][1] = 99  # indices[1]; the cache holds 12 pages
    torch.save(inputs, plan / "inputs.pt")
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    result = run_cli("import", run, "-o", tmp_path / "x.safetensors")
    assert result.exit_code == 2
    assert "indices[1] = 99 is outside the cache's 12 pages" in result.output
    assert len(result.output.strip().splitlines()) == 1
    # In a session the bad call is listed as refused and the others still import.
    data = _import_json(session)
    refused = [i for i in data["items"] if i["status"] == "refused"]
    assert len(refused) == 1 and "indices[1] = 99" in refused[0]["reason"]
    assert data["totals"]["imported"] == 4


def test_malformed_metadata_is_one_line_naming_the_file(session, tmp_path):
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    (run / "metadata.jsonl").write_text('{"function_name": "BatchDecode')
    result = run_cli("import", session)
    assert result.exit_code == 2
    assert result.output.startswith("Error: ") and "metadata.jsonl: last record is not JSON" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_without_the_constructor_the_layout_is_asked_for_never_guessed(session, tmp_path):
    init = calls(session, "BatchDecodeWithPagedKVCacheWrapper.__init__")[1]  # the HND wrapper's
    shutil.rmtree(init)
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[2]
    result = run_cli("import", run, "-o", tmp_path / "a.safetensors")
    assert result.exit_code == 2 and "give --kv-layout" in result.output
    result = run_cli("import", run, "-o", tmp_path / "b.safetensors", "--kv-layout", "HND")
    assert result.exit_code == 0, result.output
    assert load_snapshot(tmp_path / "b.safetensors").meta.capture["kv_layout_from"] == "--kv-layout"
    result = run_cli("import", run, "-o", tmp_path / "c.safetensors", "--kv-layout", "NHD")
    assert result.exit_code == 2 and "do not match plan's page_size 8" in result.output


def test_a_dump_without_paged_attention_imports_nothing(session, tmp_path):
    only = tmp_path / "norm"
    only.mkdir()
    shutil.copytree(calls(session, "rmsnorm")[0], only / calls(session, "rmsnorm")[0].name)
    result = run_cli("import", only)
    assert result.exit_code == 2
    assert result.output.strip() == f"Error: nothing imported from {only}: no paged decode or prefill run among " \
                                    "its 1 call(s) (rmsnorm)"
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run_cli("import", empty)
    assert result.exit_code == 2 and "no FlashInfer call directories" in result.output


def test_a_plans_own_directory_says_to_give_its_run(session):
    plan = calls(session, "BatchDecodeWithPagedKVCacheWrapper.plan")[0]
    result = run_cli("import", plan)
    assert result.exit_code == 2
    assert "no paged decode or prefill run among its 1 call(s)" in result.output
    from kvdbg.importers.session import import_session

    item, = import_session(plan).items
    assert item.status == "skipped" and item.reason.startswith("a wrapper's plan: give the directory of the run")


def test_outputs_are_never_clobbered(session, tmp_path):
    run = calls(session, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    target = tmp_path / "one.safetensors"
    target.write_bytes(b"mine")
    result = run_cli("import", run, "-o", target)
    assert result.exit_code == 2 and "already exists" in result.output
    assert target.read_bytes() == b"mine"
    result = run_cli("import", run, "-o", target, "--force")
    assert result.exit_code == 0 and load_snapshot(target).steps[0].num_reqs == 3
    # Several runs into a directory that already holds one of the names: nothing is written.
    out = tmp_path / "snaps"
    out.mkdir()
    (out / "002_BatchDecode.run_call0002.safetensors").write_bytes(b"mine")
    result = run_cli("import", session, "-o", out)
    assert result.exit_code == 2 and "already exists" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["002_BatchDecode.run_call0002.safetensors"]
    # Several runs and -o an existing file: refused.
    result = run_cli("import", session, "-o", target)
    assert result.exit_code == 2 and "give a directory" in result.output


def test_the_table_reads_whole_at_80_columns_without_color(session):
    result = run_cli("import", session, env={"COLUMNS": "80", "NO_COLOR": "1"})
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "\x1b[" not in result.output
    text = result.output
    assert "BatchDecode.run #3" in text and "imported" in text and "not paged attention" in text
    assert "read for #4" in text  # the prefill wrapper's plan, read by the run in row 4
    assert "5 snapshot(s) to write: give -o to write them" in " ".join(text.split())


def test_the_signature_reader_names_positional_parameters():
    sig = ("(self, q: torch.Tensor, kv: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]], "
           "x: str = 'a,b', *args, k: Optional[float] = None) -> Union[torch.Tensor, Tuple[int, int]]")
    assert signature_parameters(sig, "w") == (["self", "q", "kv", "x"], True)
    assert signature_parameters("(a, b=(1, 2), **kwargs) -> None", "w") == (["a", "b"], False)
    assert signature_parameters("(a, *, b) -> None", "w") == (["a"], False)
    with pytest.raises(DumpError, match="function_signature"):
        signature_parameters("<unavailable>", "w")
    with pytest.raises(DumpError, match="not closed"):
        signature_parameters("(a, b", "w")


def test_the_gpu_scripts_checks_pass_on_these_dumps(tmp_path, monkeypatch):
    """tests/gpu/flashinfer_dump_gpu.py's import, replay and planted-output checks, over the committed dumps."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flashinfer_dump_gpu",
                                                  Path(ROOT) / "tests" / "gpu" / "flashinfer_dump_gpu.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    # (the safetensors session: one decode run, so that the test starts kvdbg four times, not eight)
    checks = module.check_session(DUMPS / "safetensors", tmp_path / "w1", expect_runs=1)
    assert [c.name for c in checks if not c.ok] == [], [c for c in checks if not c.ok]
    assert [c.name for c in checks] == ["import", "replay 000_BatchDecode.run_call0001.safetensors",
                                        "planted wrong output"]
    # and it does fail when the dump's output is wrong to begin with (the safetensors form: its planting too)
    from safetensors.torch import load_file, save_file

    broken = Path(shutil.copytree(DUMPS / "safetensors", tmp_path / "broken"))
    run = calls(broken, "BatchDecodeWithPagedKVCacheWrapper.run")[0]
    outputs = load_file(run / "outputs.safetensors")
    outputs["result"][0, 0] += 2.0
    save_file(outputs, run / "outputs.safetensors")
    checks = module.check_session(broken, tmp_path / "w2", expect_runs=1)
    assert [c.name for c in checks if not c.ok] == ["replay 000_BatchDecode.run_call0001.safetensors",
                                                     "planted wrong output"]


def _shape_of_session(root: Path) -> list[tuple]:
    """What FlashInfer wrote, less what changes from run to run (times, pids, ids, paths, values)."""
    out = []
    for call in sorted((p for p in root.iterdir() if p.is_dir()), key=lambda p: p.name.split("_pid")[1]):
        record = json.loads((call / "metadata.jsonl").read_text().splitlines()[-1])
        details = {k: (v["shape"], v["dtype"]) for k, v in record["tensor_details"].items()}
        meta = {k: v for k, v in record["input_metadata"].items() if k != "arg_0"}
        files = sorted(p.name for p in call.iterdir())
        out.append((call.name.split("_pid")[1].split("_", 1)[1], record["function_name"], record["execution_status"],
                    record["function_signature"], json.dumps(meta, sort_keys=True), details, files,
                    record["versions"]["flashinfer"]))
    return out


@pytest.mark.skipif(not os.environ.get("KVDBG_FLASHINFER_DUMPS"),
                    reason="the FlashInfer stage (tests/flashinfer_dumps/run.sh) writes fresh dumps to compare")
@pytest.mark.parametrize("session_name", ["torch", "safetensors", "more"])
def test_the_committed_dumps_are_what_flashinfer_writes(session_name):
    committed = Path(ROOT) / "tests" / "flashinfer_dumps" / "data" / session_name
    assert _shape_of_session(DUMPS / session_name) == _shape_of_session(committed)
