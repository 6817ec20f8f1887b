"""The vllm column (vLLM's own code for the snapshot's backend) where vLLM is absent or broken (this suite's venv).

It says why it cannot run and nothing else changes. Where vLLM runs, the engine
stage checks the column itself (tests/engine/test_vllm_column.py, the
differential, every captured snapshot), and tests/vllm033 holds its layout
reading to vLLM 0.33's own classes.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch
from click.testing import CliRunner

from kvdbg.backends import DEFAULT_ORDER, get_backend, resolve_backend, vllm_flex
from kvdbg.backends._vllm_kv_cache import place_pages, renumber
from kvdbg.snapshot.layout import CPU_ATTN_K_TRANSPOSED, join_kv, split_kv
from kvdbg.cli import cli
from kvdbg.util.fixtures_path import fixture_path
from kvdbg.moves.synth import SynthSpec, synth_snapshot
from kvdbg.judge.verdict import counted_backends

no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                             reason="vLLM is installed here: the engine stage checks the column that runs")


def _replay_json(path, *args):
    res = CliRunner().invoke(cli, ["replay", str(path), "--json", *args])
    return res, (json.loads(res.output) if res.output.startswith("{") else None)


@no_vllm
def test_without_vllm_the_column_says_why_and_the_exit_code_is_unchanged():
    res, data = _replay_json(fixture_path("causal_gqa.safetensors"))
    assert res.exit_code == 0, res.output[-2000:]
    status = {b["name"]: b for b in data["backends"]}["vllm"]
    assert not status["available"] and status["reason"].startswith("vLLM is not installed in this environment")
    # The column is the snapshot's own backend's, whichever that is.
    assert status["engine_name"] == "FLASHINFER_TS"
    assert not any(c["actual"] == "vllm" for c in data["comparisons"])
    assert not any(f["backend"] == "vllm" for f in data["findings"])
    assert vllm_flex.vllm_version() is None


@no_vllm
@pytest.mark.parametrize("name", ["vllm", "vllm_flex"])
def test_asking_for_the_column_without_vllm_is_one_line_exit_2(name):
    res = CliRunner().invoke(cli, ["replay", fixture_path("causal_gqa.safetensors"), "--backend", name])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"Error: backend {name} cannot run: vLLM is not installed")


def test_the_column_is_in_the_default_order_and_vllm_flex_is_kept_by_name():
    assert DEFAULT_ORDER[-1] == "vllm" and "vllm_flex" not in DEFAULT_ORDER
    assert resolve_backend("VLLM") == "vllm" and resolve_backend("vllm-flex") == "vllm_flex"
    assert get_backend("vllm_flex").engine_name == "FLEX_ATTENTION"


@pytest.mark.parametrize("engine_backend", ["CPU_ATTN", "FLEX_ATTENTION", "FLASH_ATTN", "TRITON_ATTN", "FLASHINFER"])
def test_the_column_runs_and_counts_as_the_snapshots_own_backend(engine_backend):
    meta = synth_snapshot(SynthSpec(seq_lens=(5,), backend=engine_backend)).meta
    spec = get_backend("vllm")
    assert spec.engine_name_for(meta) == engine_backend
    columns = [("vllm", spec.engine_name_for(meta)), ("vllm_flex", get_backend("vllm_flex").engine_name_for(meta))]
    counted = counted_backends(engine_backend, columns)
    assert "vllm" in counted and ("vllm_flex" in counted) == (engine_backend == "FLEX_ATTENTION")


@pytest.mark.parametrize("num_pages, null_page, want, blocks, added", [
    (4, None, [1, 2, 3, 4], 5, True),  # page 0 not stored: an empty null block is put at index 0
    (4, 0, [0, 1, 2, 3], 4, False),
    (4, 2, [1, 2, 0, 3], 4, False),  # wherever page 0 is stored, vLLM sees it at index 0
])
def test_stored_pages_are_renumbered_keeping_the_null_block_at_zero(num_pages, null_page, want, blocks, added):
    new_index, num_blocks, added_null = renumber(num_pages, null_page, torch.device("cpu"))
    assert new_index.tolist() == want and num_blocks == blocks and added_null == added


def _strided_view(blocks, heads, tokens, width, order, dtype=torch.float16):
    """A logical [B, H, N, C] view whose memory order is ``order`` (B, H, N, C axes from outer to inner)."""
    sizes = {"B": blocks, "H": heads, "N": tokens, "C": width}
    strides, step = {}, 1
    for axis in reversed(order):
        strides[axis] = step
        step *= sizes[axis]
    raw = torch.zeros(step, dtype=dtype)
    return raw, raw.as_strided((blocks, heads, tokens, width), tuple(strides[a] for a in "BHNC"))


@pytest.mark.parametrize("order", ["BNHC", "BHNC"])  # vLLM's LBNHC (FLEX) and LBHNC (CPU_ATTN, FLASHINFER)
def test_pages_land_in_their_blocks_whatever_the_physical_order(order):
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 2, 4, 8, generator=gen).half(), torch.randn(3, 2, 4, 8, generator=gen).half()
    new_index = torch.tensor([2, 0, 3])
    raw, view = _strided_view(4, 2, 4, 16, order)
    place_pages(view, keys, values, new_index, None)
    assert torch.equal(view[new_index, :, :, :8], keys) and torch.equal(view[new_index, :, :, 8:], values)
    assert torch.count_nonzero(view[1]) == 0  # the block no stored page maps to stays empty
    # The bytes went where the physical order puts them, not into a copy.
    if order == "BHNC":
        assert torch.equal(raw.view(4, 2, 4, 16)[2], torch.cat([keys[0], values[0]], dim=-1))
    else:
        assert torch.equal(raw.view(4, 4, 2, 16)[2].transpose(0, 1), torch.cat([keys[0], values[0]], dim=-1))


def test_cpu_attn_pages_hold_k_transposed_then_v():
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 2, 4, 8, generator=gen).half(), torch.randn(2, 2, 4, 8, generator=gen).half()
    raw, view = _strided_view(3, 2, 4, 16, "BHNC")
    place_pages(view, keys, values, torch.tensor([1, 2]), CPU_ATTN_K_TRANSPOSED)
    slot = raw.view(3, 2, 2 * 4 * 8)[1, 0]  # block 1, head 0, in memory order
    assert torch.equal(slot[:32].view(8, 4), keys[0, 0].transpose(0, 1))  # D rows of page_size keys
    assert torch.equal(slot[32:].view(4, 8), values[0, 0])
    back_k, back_v = split_kv(view[1:].contiguous(), CPU_ATTN_K_TRANSPOSED, 8)
    assert torch.equal(back_k, keys) and torch.equal(back_v, values)
    assert torch.equal(view[1:], join_kv(keys, values, CPU_ATTN_K_TRANSPOSED))


def test_fp8_pages_are_copied_as_bytes():
    gen = torch.Generator().manual_seed(2)
    keys = (torch.randn(2, 1, 4, 8, generator=gen) * 3).to(torch.float8_e4m3fn)
    values = (torch.randn(2, 1, 4, 8, generator=gen) * 3).to(torch.float8_e4m3fn)
    raw, view = _strided_view(2, 1, 4, 16, "BNHC", dtype=torch.uint8)
    place_pages(view, keys, values, torch.tensor([0, 1]), None)
    assert torch.equal(view[..., :8], keys.view(torch.uint8)) and torch.equal(view[..., 8:], values.view(torch.uint8))


BROKEN_VLLM = {
    "vllm/__init__.py": "",
    "vllm/v1/__init__.py": "",
    "vllm/v1/attention/__init__.py": "",
    "vllm/v1/attention/backends/__init__.py": "",
    "vllm/v1/attention/backends/registry.py":
        "raise RuntimeError('pin_memory=True requires a CUDA-enabled build of torch')\n",
}


@no_vllm
def test_a_vllm_that_cannot_load_makes_the_column_unavailable_not_an_error_finding(tmp_path, monkeypatch):
    for rel, text in BROKEN_VLLM.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        res, data = _replay_json(fixture_path("causal_gqa.safetensors"))
        assert res.exit_code == 0, res.output[-2000:]
        status = {b["name"]: b for b in data["backends"]}["vllm"]
        assert not status["available"]
        assert "backend registry (vllm.v1.attention.backends.registry) does not import: RuntimeError: " \
               "pin_memory=True requires a CUDA-enabled build of torch" in status["reason"]
        assert not any(f["backend"] == "vllm" for f in data["findings"])
        named = CliRunner().invoke(cli, ["replay", fixture_path("causal_gqa.safetensors"), "--backend", "vllm"])
        assert named.exit_code == 2 and named.output.count("\n") == 1
    finally:
        for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[name]


# --------------------------------------------------------------------------- what the column declares

def _meta(**features):
    spec = dict(seq_lens=(9, 40), num_heads=4, num_kv_heads=2, backend="TRITON_ATTN")
    return synth_snapshot(SynthSpec(**dict(spec, **features))).meta


@pytest.mark.parametrize("features", [dict(sinks="auto"), dict(alibi_slopes="auto"),
                                      dict(alibi_slopes="auto", alibi_sqrt=True), dict(logits_soft_cap=30.0),
                                      dict(sliding_window=16, chunk_lookback=1), dict(sliding_window=16),
                                      dict(kv_sharing_target="model.layers.0.self_attn.attn", new_kv=False)])
def test_features_the_column_hands_to_vllm_are_left_for_vllm_to_accept(features):
    """Nothing the column hands vLLM's Attention is refused by kvdbg: vLLM's own checks say, in its words."""
    from kvdbg.backends.base import unsupported_by
    from kvdbg.backends.vllm_native import CAPABILITIES

    assert unsupported_by(CAPABILITIES, _meta(**features)) is None


@pytest.mark.parametrize("features, why", [
    (dict(attn_type="encoder_only", seq_lens=(3, 4), query_lens=(3, 4), causal=False),
     "attn_type 'encoder_only' (it replays decoder attention only)"),
    (dict(attn_type="encoder", seq_lens=(3, 4), query_lens=(3, 4), causal=False),
     "attn_type 'encoder' (it replays decoder attention only)"),
    (dict(extra_layer={"mm_prefix": True}), "PrefixLM multimodal attention (layer.mm_prefix: "),
    (dict(sliding_window=16, extra_layer={"rswa_window": 8}), "Reference Sliding Window Attention"),
])
def test_what_the_column_cannot_hand_to_vllm_is_refused_by_name(features, why):
    from kvdbg.backends.base import unsupported_by
    from kvdbg.backends.vllm_native import CAPABILITIES

    reason = unsupported_by(CAPABILITIES, _meta(**features))
    assert reason is not None and reason.startswith(f"the vllm column does not support {why}"), reason


@no_vllm
def test_a_layer_with_sinks_and_alibi_replays_and_the_column_says_only_that_vllm_is_absent(tmp_path):
    from kvdbg.snapshot.store import save_snapshot

    snap = synth_snapshot(SynthSpec(seq_lens=(9, 40), num_heads=4, num_kv_heads=2, backend="CPU_ATTN", sinks="auto",
                                    alibi_slopes="auto", logits_soft_cap=30.0, engine_output="reference"))
    res, data = _replay_json(save_snapshot(snap, str(tmp_path / "features.safetensors")))
    assert res.exit_code == 0, res.output[-2000:]
    status = {b["name"]: b for b in data["backends"]}["vllm"]
    assert not status["available"] and status["reason"].startswith("vLLM is not installed in this environment")
    assert status["engine_name"] == "CPU_ATTN"
