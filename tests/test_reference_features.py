"""Layer features the reference models -- sinks, ALiBi, soft cap, chunked lookback, encoder and cross attention --
held to values worked out by hand, to a naive float64 loop written apart from kvdbg, and to vLLM's Triton kernel
semantics as read in vLLM 0.33 (triton_unified_attention.py and its helpers)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner

import kvdbg.backends.reference as reference_module
from kvdbg.backends.base import ReplayOptions
from kvdbg.cli import cli
from kvdbg.replayer.runner import replay
from kvdbg.snapshot.store import Snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, alibi_slopes, synth_snapshot
from tests.test_reference import _page_tensors


def reference(snap: Snapshot, exact: bool = True) -> torch.Tensor:
    return replay(snap, ["reference"], ReplayOptions(exact=exact)).steps[0].runs["reference"].output


# --------------------------------------------------------------------------- 1. by hand


def tiny(keys, values, queries, *, causal=True, **features) -> Snapshot:
    """One request, one head of size 1 (scale 1): key k holds keys[k] and values[k]; query row i is queries[i]."""
    snap = synth_snapshot(SynthSpec(seq_lens=(len(keys),), query_len=len(queries), num_heads=1, num_kv_heads=1,
                                    head_size=1, page_size=4, dtype="float32", shuffle=False, new_kv=False,
                                    causal=causal, **features))
    k_pages, v_pages = snap.kv_views()  # [pages, 1, 4, 1]; with shuffle off, stored page i is logical page i
    for t, (k, v) in enumerate(zip(keys, values)):
        k_pages[t // 4, 0, t % 4, 0] = k
        v_pages[t // 4, 0, t % 4, 0] = v
    snap.steps[0].query[:, 0, 0] = torch.tensor(queries, dtype=torch.float32)
    return snap


E = math.e


@pytest.mark.parametrize("features, keys, values, queries, causal, expected", [
    # Logits 0 and 1 and a sink of 0: weights 1, e and the sink's 1, which carries no value.
    (dict(sinks=(0.0,)), [0, 1], [1, 2], [1], True, [(1 + 2 * E) / (2 + E)]),
    # A sink far below the logits changes nothing measurable.
    (dict(sinks=(-80.0,)), [0, 1], [1, 2], [1], True, [(1 + 2 * E) / (1 + E)]),
    # ALiBi slope 1/2, causal row p = 2: biases -1, -1/2, 0.
    (dict(alibi_slopes=(0.5,)), [0, 0, 0], [1, 2, 3], [1], True,
     [(math.exp(-1) + 2 * math.exp(-0.5) + 3) / (math.exp(-1) + math.exp(-0.5) + 1)]),
    # Dense rows p = 1, 2: -slope * |p - k|, so row p = 1 is symmetric about its own key.
    (dict(alibi_slopes=(0.5,)), [0, 0, 0], [1, 2, 3], [1, 1], False,
     [(math.exp(-0.5) + 2 + 3 * math.exp(-0.5)) / (2 * math.exp(-0.5) + 1),
      (math.exp(-1) + 2 * math.exp(-0.5) + 3) / (math.exp(-1) + math.exp(-0.5) + 1)]),
    # Square-root ALiBi at p = 2: -sqrt(2)/2, -1/2, 0.
    (dict(alibi_slopes=(0.5,), alibi_sqrt=True), [0, 0, 0], [1, 2, 3], [1], True,
     [(math.exp(-math.sqrt(2) / 2) + 2 * math.exp(-0.5) + 3) / (math.exp(-math.sqrt(2) / 2) + math.exp(-0.5) + 1)]),
    # Soft cap 2 on logits 0 and 3: 2 tanh(3/2).
    (dict(logits_soft_cap=2.0), [0, 3], [1, 2], [1], True,
     [(1 + 2 * math.exp(2 * math.tanh(1.5))) / (1 + math.exp(2 * math.tanh(1.5)))]),
    # All three: the sink (1.0) is neither capped (cap 0.5) nor biased; logits 0, 1 are capped, then biased.
    (dict(sinks=(1.0,), logits_soft_cap=0.5, alibi_slopes=(0.25,)), [0, 1], [1, 2], [1], True,
     [(math.exp(-0.25) * 1 + math.exp(0.5 * math.tanh(2)) * 2)
      / (math.exp(-0.25) + math.exp(0.5 * math.tanh(2)) + math.exp(1.0))]),
])
def test_features_by_hand(features, keys, values, queries, causal, expected):
    out = reference(tiny(keys, values, queries, causal=causal, **features))
    torch.testing.assert_close(out[:, 0, 0], torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=1e-7)


def test_chunk_lookback_replaces_the_window_by_hand():
    # Window 4, lookback 1: chunks of 2 tokens. Row p = 4 sees chunks 2 and 1 (keys 2..4); the plain window
    # would show keys 1..4. Equal logits: the output is the mean of the values it sees.
    values = [0, 1, 2, 3, 4]
    chunked = reference(tiny([0] * 5, values, [1], sliding_window=4, chunk_lookback=1))
    windowed = reference(tiny([0] * 5, values, [1], sliding_window=4))
    assert chunked[0, 0, 0].item() == pytest.approx(3.0)
    assert windowed[0, 0, 0].item() == pytest.approx(2.5)


def test_encoder_and_cross_attention_by_hand():
    # encoder_only: the step's own 3 tokens, every row sees all of them.
    enc = reference(tiny([0, 0, 0], [1, 2, 6], [1, 1, 1], causal=False, attn_type="encoder_only"))
    torch.testing.assert_close(enc[:, 0, 0], torch.full((3,), 3.0, dtype=torch.float64))
    # encoder_decoder: 4 decoder queries over 2 encoder keys (more queries than keys is allowed).
    cross = reference(tiny([0, 0], [1, 3], [1, 1, 1, 1], causal=False, attn_type="encoder_decoder"))
    torch.testing.assert_close(cross[:, 0, 0], torch.full((4,), 2.0, dtype=torch.float64))


def test_a_row_that_sees_no_key_gives_zero_with_a_sink():
    # Window 1 on a dense row whose own position lies past the keys (cross-attention, q > L): no key is seen.
    snap = tiny([0, 0], [1, 3], [1, 1, 1, 1], causal=False, attn_type="encoder_decoder", sliding_window=1,
                sinks=(0.0,))
    out = reference(snap)[:, 0, 0]
    # p = L - q + i = -2, -1, 0, 1: rows 0 and 1 see nothing (only the sink: 0), rows 2 and 3 see one key.
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, 0.5, 1.5], dtype=torch.float64))


# --------------------------------------------------------------------------- 2. a naive float64 loop


def naive_attention(snap: Snapshot, step: int = 0) -> torch.Tensor:
    """Attention written out key by key in float64, from the snapshot's raw tensors and docs/snapshot-format.md."""
    layer, ps = snap.meta.layer, snap.page_size
    k_pages, v_pages = _page_tensors(snap)  # [pages, ps, Hkv, D]
    index_of = {int(e): i for i, e in enumerate(snap.page_ids.tolist())}
    s = snap.steps[step]
    assert s.key is None, "build these cases with new_kv=False: the cache then holds every key"
    qsl = s.query_start_loc.tolist()
    query = s.query.to(torch.float64)
    group = layer.num_heads // layer.num_kv_heads
    sinks = None if snap.sinks is None else snap.sinks.tolist()
    slopes = None if snap.alibi_slopes is None else snap.alibi_slopes.tolist()
    w, lookback = layer.sliding_window, layer.chunk_lookback
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    for r, length in enumerate(s.seq_lens.tolist()):
        q_len = qsl[r + 1] - qsl[r]
        pages = [index_of[int(p)] for p in s.block_table[r, : math.ceil(length / ps)].tolist()]
        keys = torch.cat([k_pages[i] for i in pages])[:length]
        values = torch.cat([v_pages[i] for i in pages])[:length]
        for i in range(q_len):
            p = length - q_len + i
            for h in range(layer.num_heads):
                num = torch.zeros(layer.head_size, dtype=torch.float64)
                den = math.exp(sinks[h]) if sinks is not None else 0.0
                logits, seen = [], []
                for k in range(length):
                    visible = k <= p if layer.causal else True
                    if lookback is not None:
                        chunk = w // (lookback + 1)
                        visible = visible and p // chunk - k // chunk <= lookback
                    elif w is not None:
                        visible = visible and abs(p - k) < w
                    if not visible:
                        continue
                    x = layer.scale * float(query[qsl[r] + i, h] @ keys[k, h // group])
                    if layer.logits_soft_cap:
                        x = layer.logits_soft_cap * math.tanh(x / layer.logits_soft_cap)
                    if slopes is not None:
                        x += -slopes[h] * (math.sqrt(p - k) if k <= p else 0.0) if layer.alibi_sqrt \
                            else -slopes[h] * abs(p - k)
                    logits.append(x)
                    seen.append(k)
                if not seen and sinks is None:
                    continue
                top = max(logits + ([sinks[h]] if sinks is not None else []))
                den = math.exp(sinks[h] - top) if sinks is not None else 0.0
                for x, k in zip(logits, seen):
                    weight = math.exp(x - top)
                    den += weight
                    num += weight * values[k, h // group]
                out[qsl[r] + i, h] = num / den
    return out


NAIVE_CASES = {
    "sinks_causal": dict(sinks="auto", query_len=2),
    "sinks_window_gqa": dict(sinks="auto", sliding_window=19, query_len=3),
    "sinks_dense_window": dict(sinks="auto", causal=False, sliding_window=11, query_len=4),
    "alibi_causal": dict(alibi_slopes="auto", query_len=2),
    "alibi_dense": dict(alibi_slopes="auto", causal=False, query_len=3),
    "alibi_sqrt_dense_window": dict(alibi_slopes="auto", alibi_sqrt=True, causal=False, sliding_window=9,
                                    query_len=3),
    "soft_cap": dict(logits_soft_cap=3.0, query_len=2),
    "everything": dict(sinks="auto", alibi_slopes="auto", logits_soft_cap=4.0, sliding_window=23, query_len=2),
    "chunk_lookback": dict(sliding_window=24, chunk_lookback=2, query_len=3, sinks="auto"),
    "encoder_only": dict(seq_lens=(5, 17, 9), query_lens=(5, 17, 9), causal=False, attn_type="encoder_only",
                         alibi_slopes="auto"),
    "cross": dict(seq_lens=(7, 30, 2), query_len=6, causal=False, attn_type="encoder_decoder", sinks="auto"),
}


@pytest.mark.parametrize("case", sorted(NAIVE_CASES))
def test_reference_matches_the_naive_loop(case):
    spec = dict(seq_lens=(9, 60, 41), num_heads=6, num_kv_heads=2, head_size=16, dtype="float32", new_kv=False,
                seed=7)
    spec.update(NAIVE_CASES[case])
    snap = synth_snapshot(SynthSpec(**spec))
    torch.testing.assert_close(reference(snap), naive_attention(snap), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("exact", [True, False], ids=["fp64", "fp32"])
def test_a_sink_is_counted_once_when_kv_blocks_are_merged(exact, monkeypatch):
    spec = SynthSpec(seq_lens=(333, 90, 200), query_len=3, num_heads=6, num_kv_heads=2, head_size=32,
                     dtype="float32", new_kv=False, sinks="auto", alibi_slopes="auto", sliding_window=150)
    snap = synth_snapshot(spec)
    whole = reference(snap, exact)
    monkeypatch.setattr(reference_module, "CHUNK_BUDGET_BYTES", 16 * 1024)
    from kvdbg.replayer.runner import common_metadata

    md = reference_module.BACKEND.create(snap.meta, ReplayOptions(exact=exact)).builder.build(
        common_metadata(snap, 0))
    assert any(b < p for b, p in zip(md.block_pages, md.page_counts)), "the budget must cut a request"
    blocked = reference(snap, exact)
    tol = 1e-12 if exact else 2e-6
    torch.testing.assert_close(blocked, whole, atol=tol, rtol=tol)
    torch.testing.assert_close(blocked.double(), naive_attention(snap), atol=tol * 10, rtol=tol * 10)


# --------------------------------------------------------------------------- 3. vLLM's Triton kernel, as read


def triton_semantics(snap: Snapshot, tile: int = 16) -> torch.Tensor:
    """vLLM 0.33's unified Triton attention as its source reads, in float64: per row an online softmax over key
    tiles whose running max starts at the head's sink logit (L starts at 1); logits scale * q.k, soft-capped
    as cap * (1 - 2 / (exp(2 s / cap) + 1)), masked, then ALiBi adds slope * (k - context_len) with
    context_len = L - q."""
    layer, ps = snap.meta.layer, snap.page_size
    k_pages, v_pages = _page_tensors(snap)
    index_of = {int(e): i for i, e in enumerate(snap.page_ids.tolist())}
    s = snap.steps[0]
    qsl = s.query_start_loc.tolist()
    query = s.query.to(torch.float64)
    group = layer.num_heads // layer.num_kv_heads
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    for r, length in enumerate(s.seq_lens.tolist()):
        q_len = qsl[r + 1] - qsl[r]
        context = length - q_len
        pages = [index_of[int(p)] for p in s.block_table[r, : math.ceil(length / ps)].tolist()]
        keys = torch.cat([k_pages[i] for i in pages])[:length]
        values = torch.cat([v_pages[i] for i in pages])[:length]
        for i in range(q_len):
            p = context + i
            for h in range(layer.num_heads):
                m = float(snap.sinks[h]) if snap.sinks is not None else float("-inf")
                total, acc = 1.0, torch.zeros(layer.head_size, dtype=torch.float64)
                for t0 in range(0, length, tile):
                    k = torch.arange(t0, min(t0 + tile, length))
                    logits = layer.scale * (keys[k, h // group] @ query[qsl[r] + i, h])
                    if layer.logits_soft_cap:
                        cap = layer.logits_soft_cap
                        logits = cap * (1 - 2 / (torch.exp(2 * logits / cap) + 1))
                    mask = k <= p if layer.causal else k < length
                    if layer.sliding_window:
                        mask &= (p - k) < layer.sliding_window
                        if not layer.causal:
                            mask &= (k - p) < layer.sliding_window
                    logits = logits.masked_fill(~mask, float("-inf"))
                    if snap.alibi_slopes is not None:
                        logits = logits + float(snap.alibi_slopes[h]) * (k - context).to(torch.float64)
                    m_new = max(m, float(logits.max()))
                    shift = m_new if m_new != float("-inf") else 0.0
                    weights = torch.exp(logits - shift)
                    alpha = math.exp(m - shift)
                    total = total * alpha + float(weights.sum())
                    acc = acc * alpha + weights @ values[k, h // group]
                    m = m_new
                out[qsl[r] + i, h] = acc / total
    return out


TRITON_CASES = {
    "sinks_window": dict(sinks="auto", sliding_window=21, query_len=2),
    "alibi_soft_cap": dict(alibi_slopes="auto", logits_soft_cap=5.0, query_len=3),
    "everything_dense_no_alibi": dict(sinks="auto", logits_soft_cap=2.0, causal=False, sliding_window=13,
                                      query_len=4),
}


@pytest.mark.parametrize("case", sorted(TRITON_CASES))
def test_reference_equals_the_triton_kernel_semantics(case):
    spec = dict(seq_lens=(9, 60, 41), num_heads=4, num_kv_heads=2, head_size=16, dtype="float32", new_kv=False,
                seed=3)
    spec.update(TRITON_CASES[case])
    snap = synth_snapshot(SynthSpec(**spec))
    torch.testing.assert_close(reference(snap), triton_semantics(snap), atol=1e-10, rtol=1e-10)


def test_dense_alibi_is_where_triton_departs_and_the_column_says_so():
    snap = synth_snapshot(SynthSpec(seq_lens=(20, 33), query_len=4, causal=False, alibi_slopes="auto",
                                    num_heads=4, num_kv_heads=2, head_size=16, dtype="float32", new_kv=False))
    gap = (reference(snap) - triton_semantics(snap)).abs().max().item()
    assert gap > 1e-3  # TRITON_ATTN's slope * (k - (L - q)) keeps growing for keys after p
    notes = " ".join(replay(snap, ["reference"]).backends[0].info.notes)
    assert "TRITON_ATTN adds slope * (k - (L - q))" in notes


# --------------------------------------------------------------------------- 4. replay, end to end


def _with_engine_output(snap: Snapshot, output: torch.Tensor) -> Snapshot:
    snap.steps[0].output = output.to(getattr(torch, snap.meta.layer.dtype))
    return snap


@pytest.mark.parametrize("features", [dict(sinks="auto"), dict(alibi_slopes="auto"), dict(logits_soft_cap=2.0)],
                         ids=["sinks", "alibi", "soft_cap"])
def test_a_captured_feature_replays_against_the_reference(features, tmp_path):
    # Captured from TRITON_ATTN, which takes these features (and head size 16, which prims_ts would refuse).
    spec = SynthSpec(seq_lens=(9, 60, 41), query_len=2, num_heads=4, num_kv_heads=2, head_size=16,
                     dtype="bfloat16", new_kv=False, backend="TRITON_ATTN", **features)
    right = synth_snapshot(spec)
    save_snapshot(_with_engine_output(right, naive_attention(right)), tmp_path / "right.safetensors")
    result = CliRunner().invoke(cli, ["replay", str(tmp_path / "right.safetensors"), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verdict"]["status"] == "pass"
    backends = {b["name"]: b for b in report["backends"]}
    if "logits_soft_cap" not in features:  # flex and FLASHINFER_TS refuse sinks and ALiBi, with the reason
        assert not backends["flashinfer_ts"]["available"]
        assert ("sinks" in backends["flashinfer_ts"]["reason"]) or ("ALiBi" in backends["flashinfer_ts"]["reason"])

    # An engine that ignored the feature: the reference models it, so the capture fails.
    wrong = synth_snapshot(spec)
    plain = synth_snapshot(SynthSpec(**{**spec.__dict__, "sinks": None, "alibi_slopes": None,
                                        "logits_soft_cap": None}))
    save_snapshot(_with_engine_output(wrong, naive_attention(plain)), tmp_path / "wrong.safetensors")
    result = CliRunner().invoke(cli, ["replay", str(tmp_path / "wrong.safetensors"), "--json"])
    assert result.exit_code == 1, result.output


@pytest.mark.parametrize("extra, words", [
    ({"mm_prefix": True}, "PrefixLM multimodal attention (layer.mm_prefix"),
    ({"rswa_window": 512}, "Reference Sliding Window Attention (layer.rswa_window = 512"),
    ({"has_sinks": True}, "layer.has_sinks is true but the snapshot holds no 'sinks' tensor"),
])
def test_a_feature_the_reference_cannot_model_exits_2_naming_it(extra, words, tmp_path):
    path = tmp_path / "snap.safetensors"
    save_snapshot(synth_snapshot(SynthSpec(extra_layer=extra)), path)
    result = CliRunner().invoke(cli, ["replay", str(path)])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.output


def test_standard_alibi_slopes():
    assert alibi_slopes(8) == [2.0 ** -(i + 1) for i in range(8)]
    # 12 heads: the 8-head series, then every other slope of the 16-head series.
    assert alibi_slopes(12) == alibi_slopes(8) + [2.0 ** -(0.5 * (2 * i + 1)) for i in range(4)]
