"""The sentinel's check against an independent attention (dense softmax per request), its faults and its policy."""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import types

import pytest
import torch

from kvdbg.backends.reference import ReferenceImpl
from kvdbg.snapshot.layout import join_kv, quantize_fp8
from kvdbg.capture.prepare import CaptureLayer
from kvdbg.capture.engine_layouts import vllm_to_cpu_attn
from kvdbg.errors import OptionError
from kvdbg.snapshot.format import LAYOUT_KV_PLANES, LAYOUT_VLLM
from kvdbg.sentinel.checker import Sentinel, StepInputs, check_layers, check_step, choose_pairs
from kvdbg.sentinel.config import DEFAULT_RATE, SentinelConfig, parse_rate, sentinel_requested

HQ, HKV, D, PS, PAGES = 4, 2, 16, 8, 40
CPU_ATTN = "cpu_attn:pages,heads,[dim,tokens]k+[tokens,dim]v"


def _layer(**kw) -> CaptureLayer:
    fields = dict(name="model.layers.1.self_attn.attn", num_heads=HQ, num_kv_heads=HKV, head_size=D,
                  scale=D ** -0.5, dtype="bfloat16", kv_layout=LAYOUT_VLLM)
    fields.update(kw)
    return CaptureLayer(**fields)


def _dense(q, k, v, scale, *, pos0, window=None, cap=None, sink=None, slope=None):
    """Attention of query rows [q, D] at positions pos0.. over keys [L, D], float64, causal.

    A sink logit joins the denominator with no value; an ALiBi slope adds -slope * (p - k) after the cap.
    """
    s = (q @ k.T) * scale
    if cap:
        s = cap * torch.tanh(s / cap)
    p = torch.arange(q.shape[0]).unsqueeze(1) + pos0
    key = torch.arange(k.shape[0]).unsqueeze(0)
    if slope is not None:
        s = s - slope * (p - key).abs()
    allowed = key <= p
    if window is not None:
        allowed &= p - key < window
    s = s.masked_fill(~allowed, -math.inf)
    if sink is not None:
        s = torch.cat([s, torch.full((s.shape[0], 1), float(sink), dtype=s.dtype)], dim=1)
        return torch.softmax(s, -1)[:, :-1] @ v
    return torch.softmax(s, -1) @ v


def make_step(layer: CaptureLayer, *, seed=0, seq_lens=(37, 9, 21), query_lens=(1, 4, 1), fp8=False,
              table_seed=None):
    """A cache in the layer's engine layout and the output an honest kernel would give, in the model dtype
    (``table_seed``: the block table drawn apart from the rest, the same for every ``seed``)."""
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layer.dtype)
    keys = torch.randn(PAGES, HKV, PS, D, generator=g) * 2
    values = torch.randn(PAGES, HKV, PS, D, generator=g)
    if fp8:
        k8, v8 = quantize_fp8(keys, layer.k_scale), quantize_fp8(values, layer.v_scale)
        keys, values = k8.float() * layer.k_scale, v8.float() * layer.v_scale
        cache = torch.cat([k8, v8], -1).view(torch.uint8)
    else:
        keys, values = keys.to(dtype).float(), values.to(dtype).float()
        cache = torch.cat([keys, values], -1).to(dtype)
        if layer.kv_layout == CPU_ATTN:
            cache = vllm_to_cpu_attn(cache)
        elif layer.kv_layout == LAYOUT_KV_PLANES:
            cache = join_kv(keys.to(dtype), values.to(dtype), LAYOUT_KV_PLANES)
    drawn = g if table_seed is None else torch.Generator().manual_seed(table_seed)
    perm = torch.randperm(PAGES - 1, generator=drawn) + 1  # page 0 is vLLM's null block
    width = max(-(-n // PS) for n in seq_lens) + 1
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(seq_lens):
        live = -(-n // PS)
        table[r, :live] = perm[used:used + live].to(torch.int32)
        used += live
    qsl = torch.tensor([0, *query_lens]).cumsum(0).to(torch.int32)
    query = (torch.randn(int(qsl[-1]), HQ, D, generator=g) * 2).to(dtype)
    out = torch.empty(int(qsl[-1]) + 3, HQ, D, dtype=dtype).fill_(float("nan"))  # padding rows the kernel skips
    group = HQ // HKV
    for r, (n, q) in enumerate(zip(seq_lens, query_lens)):
        pages = table[r, :-(-n // PS)].long()
        for h in range(HQ):
            k = keys[pages, h // group].reshape(-1, D)[:n].double()
            v = values[pages, h // group].reshape(-1, D)[:n].double()
            rows = query[int(qsl[r]):int(qsl[r]) + q, h].double()
            out[int(qsl[r]):int(qsl[r]) + q, h] = _dense(rows, k, v, layer.scale, pos0=n - q,
                                                          window=layer.sliding_window,
                                                          cap=layer.logits_soft_cap,
                                                          sink=None if layer.sinks is None else layer.sinks[h],
                                                          slope=None if layer.alibi_slopes is None
                                                          else layer.alibi_slopes[h]).to(dtype)
    return StepInputs(query=query.view(-1, HQ * D), kv_cache=cache, block_table=table,
                      seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl, causal=True,
                      output=out.view(-1, HQ * D), max_model_len=512)


ALL_PAIRS = [(r, h) for r in range(3) for h in range(HQ)]


@pytest.mark.parametrize("kw", [
    {},
    {"dtype": "float16"},
    {"kv_layout": CPU_ATTN},
    {"kv_layout": LAYOUT_KV_PLANES},
    {"sliding_window": 6},
    {"logits_soft_cap": 5.0},
    {"kv_cache_dtype": "fp8", "k_scale": 0.05, "v_scale": 0.02, "dtype": "float16"},
    {"sinks": [0.5, -1.0, 2.0, 0.0]},
    {"alibi_slopes": [0.5, 0.25, 0.125, 0.0625], "logits_soft_cap": 8.0},
], ids=["bf16", "fp16", "cpu_attn", "kv_planes", "window", "soft_cap", "fp8", "sinks", "alibi"])
def test_an_honest_step_passes_every_pair(kw):
    layer = _layer(**kw)
    for seed in range(3):
        inputs = make_step(layer, seed=seed, fp8=layer.kv_cache_dtype.startswith("fp8"))
        result = check_step(layer, inputs, pairs=ALL_PAIRS, step=5)
        assert result.nonfinite is None
        assert len(result.pairs) == len(ALL_PAIRS)
        assert result.passed, [(p.request, p.head, p.diff.max_abs) for p in result.failed_pairs]
        assert result.finding() is None


def _one_step_of_layers(count: int, **kw) -> list:
    """``count`` layers of one step: their own caches, queries and outputs, the step's metadata tensors shared."""
    entries = []
    for i in range(count):
        layer = _layer(name=f"model.layers.{i}.self_attn.attn", **kw)
        inputs = make_step(layer, seed=10 + i, fp8=layer.kv_cache_dtype.startswith("fp8"), table_seed=3)
        if entries:
            shared = entries[0][1]
            assert torch.equal(inputs.block_table, shared.block_table)
            inputs = dataclasses.replace(inputs, block_table=shared.block_table, seq_lens=shared.seq_lens,
                                         query_start_loc=shared.query_start_loc)
        entries.append((layer, inputs))
    return entries


# Layers of one step checked together: each kind of layer the reference treats apart.
LAYER_KINDS = pytest.mark.parametrize("kw", [
    {},
    {"kv_layout": LAYOUT_KV_PLANES},
    {"sliding_window": 6, "logits_soft_cap": 5.0},
    {"kv_cache_dtype": "fp8", "k_scale": 0.05, "v_scale": 0.02, "dtype": "float16"},
    {"sinks": [0.5, -1.0, 2.0, 0.0]},
], ids=["bf16", "kv_planes", "window_cap", "fp8", "sinks"])


@LAYER_KINDS
def test_a_steps_layers_checked_together_match_each_checked_alone(kw, monkeypatch):
    entries = _one_step_of_layers(3, **kw)
    out = entries[1][1].output.view(-1, HQ, D)
    out[1:5, 2] += 0.5  # layer 1 only: request 1 (tokens 1..4), head 2
    alone = [check_step(layer, inputs, pairs=ALL_PAIRS, step=4) for layer, inputs in entries]
    calls = []
    forward = ReferenceImpl.forward
    monkeypatch.setattr(ReferenceImpl, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    together = check_layers(entries, pairs=ALL_PAIRS, step=4)
    # One reference problem for the three layers (one per head where heads carry their own values).
    assert len(calls) == (HQ if "sinks" in kw else 1)
    assert [r.layer for r in together] == [layer.name for layer, _ in entries]
    for one, both in zip(alone, together):
        assert both.tolerance == one.tolerance
        assert [(p.request, p.head, p.passed) for p in both.pairs] == [(p.request, p.head, p.passed)
                                                                       for p in one.pairs]
        for a, b in zip(one.pairs, both.pairs):
            assert (a.diff is None) == (b.diff is None)
            if a.diff is not None:
                assert b.diff.max_abs == pytest.approx(a.diff.max_abs, rel=1e-5, abs=1e-5)  # a few ulps
    assert [p.passed for p in together[0].pairs + together[2].pairs] == [True] * (2 * len(ALL_PAIRS))
    assert [(p.request, p.head) for p in together[1].failed_pairs] == [(1, 2)]


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """Counts calls into torch's Python bindings (reads of a tensor's attributes, which let go of nothing, left
    out)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__qualname__", "") != "getset_descriptor.__get__":
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_checks_torch_calls_do_not_grow_with_its_pairs_and_few_with_its_layers():
    # The sentinel's worker shares Python's lock with the engine's thread: each torch call is a moment the engine
    # may wait, so a check makes none per pair and about a dozen per layer (its gathers, its non-finite check).
    counts = {}
    for layers in (1, 4):
        for pairs in ([(0, 0), (1, 1)], ALL_PAIRS):
            entries = _one_step_of_layers(layers)
            with _TorchCalls() as calls:
                results = check_layers(entries, pairs=pairs, step=1)
            assert all(result.passed for result in results)
            counts[layers, len(pairs)] = calls.count
    assert counts[1, 2] == counts[1, len(ALL_PAIRS)] and counts[4, 2] == counts[4, len(ALL_PAIRS)], counts
    assert counts[4, 2] - counts[1, 2] <= 3 * 16, counts


def _stacked(entries: list, order: list[int] | None = None) -> list:
    """The same layers with their copies in one buffer per kind, a layer per index of its first axis (as a graph
    step's staging lays alike layers out: graph_staging.StagedStack); ``order``: each layer's index there."""
    order = list(range(len(entries))) if order is None else order
    count = max(order) + 1
    kinds = {}
    for kind in ("kv_cache", "query", "output"):
        first = getattr(entries[0][1], kind)
        kinds[kind] = torch.zeros((count, *first.shape), dtype=first.dtype)
        for (_, inputs), at in zip(entries, order):
            kinds[kind][at].copy_(getattr(inputs, kind))
    stack = types.SimpleNamespace(pages=kinds["kv_cache"], query=kinds["query"], output=kinds["output"])
    return [(layer, dataclasses.replace(inputs, kv_cache=stack.pages[at], query=stack.query[at],
                                        output=stack.output[at], stack=(stack, at)))
            for (layer, inputs), at in zip(entries, order)]


def test_a_staged_steps_pages_one_request_after_another_are_read_without_a_block_table():
    # A graph step's staging copies each request's pages after the last request's, as many as the host's bound on
    # its length asks (here one more for request 1): its check has no block table, only those counts.
    layer = _layer()
    inputs = make_step(layer, seed=3)
    inputs.output.view(-1, HQ, D)[4, 1] += 0.5  # request 1's last query token, head 1
    counts = [-(-n // PS) for n in inputs.seq_lens.tolist()]
    counts[1] += 1
    ids = [int(p) for r, c in enumerate(counts) for p in inputs.block_table[r, :c]]
    staged = dataclasses.replace(inputs, kv_cache=inputs.kv_cache[ids], block_table=None, max_pages=counts)
    [here] = check_layers([(layer, inputs)], pairs=ALL_PAIRS, step=2)
    [there] = check_layers([(layer, staged)], pairs=ALL_PAIRS, step=2)
    assert [(p.request, p.head, p.passed) for p in there.pairs] == [(p.request, p.head, p.passed) for p in here.pairs]
    assert [(p.request, p.head) for p in there.failed_pairs] == [(1, 1)]
    for p, q in zip(here.pairs, there.pairs):
        assert q.diff.max_abs == pytest.approx(p.diff.max_abs, rel=1e-6, abs=1e-6)
    short = dataclasses.replace(staged, max_pages=[counts[0] - 1, *counts[1:]])
    with pytest.raises(ValueError, match=f"request 0 is 37 tokens long, past the {counts[0] - 1} pages staged for it"):
        check_layers([(layer, short)], pairs=ALL_PAIRS, step=2)
    fewer = dataclasses.replace(staged, max_pages=counts[:2])
    with pytest.raises(ValueError, match=r"request 2 has no count of staged pages \(the step's staging counted 2"):
        check_layers([(layer, fewer)], pairs=ALL_PAIRS, step=2)


def test_a_step_staged_inside_the_graph_has_its_pages_per_request_worked_out_from_its_lengths():
    # Staged inside vLLM's graph, the device counted each request's pages from its length (at most the block table's
    # width); the engine's thread hands that rule, and the check works the counts out once the lengths are on the host.
    from kvdbg.sentinel.checker import PagesOfLengths, settle_pages

    layer = _layer()
    inputs = make_step(layer, seed=3)
    inputs.output.view(-1, HQ, D)[4, 1] += 0.5  # request 1's last query token, head 1
    counts = [-(-n // PS) for n in inputs.seq_lens.tolist()]
    ids = [int(p) for r, c in enumerate(counts) for p in inputs.block_table[r, :c]]
    width = inputs.block_table.shape[1]
    staged = dataclasses.replace(inputs, kv_cache=inputs.kv_cache[ids], block_table=None,
                                 max_pages=PagesOfLengths(PS, width, len(ids)))
    [(_, settled)] = settle_pages([(layer, staged)])
    assert settled.max_pages == counts and staged.max_pages == PagesOfLengths(PS, width, len(ids))
    [listed] = check_layers([(layer, dataclasses.replace(staged, max_pages=counts))], pairs=ALL_PAIRS, step=2)
    [ruled] = check_layers([(layer, staged)], pairs=ALL_PAIRS, step=2)
    assert [(p.request, p.head) for p in ruled.failed_pairs] == [(1, 1)]
    assert [(p.request, p.head, p.diff.max_abs) for p in ruled.pairs] == \
        [(p.request, p.head, p.diff.max_abs) for p in listed.pairs]
    # Two layers on one lengths tensor share one list: still one reference problem.
    pair = settle_pages([(layer, staged), (layer, staged)])
    assert pair[0][1].max_pages is pair[1][1].max_pages
    # Lengths past the staged positions (the host's bound at the build exceeded): nothing there was staged.
    over = dataclasses.replace(staged, max_pages=PagesOfLengths(PS, width, len(ids) - 1))
    with pytest.raises(ValueError, match=f"the step reads {len(ids)} pages, more than the {len(ids) - 1} that "
                                         "kvdbg's staging inside the CUDA graph holds"):
        check_layers([(layer, over)], pairs=ALL_PAIRS, step=2)
    # A request longer than the block table's width: its count stops there, and its check is refused as such.
    narrow = dataclasses.replace(staged, max_pages=PagesOfLengths(PS, counts[0] - 1, len(ids)))
    with pytest.raises(ValueError, match=f"request 0 is 37 tokens long, past the {counts[0] - 1} pages staged"):
        check_layers([(layer, narrow)], pairs=ALL_PAIRS, step=2)


def _in_whole_buffers(entries: list, extra: int) -> list:
    """Stacked entries whose query and output lie in buffers ``extra`` rows longer, NaN past the step's rows (the
    rows a larger graph wrote), read to the step's rows (``StepInputs.rows``), as a staging program hands them."""
    first = entries[0][1]
    stack = first.stack[0]
    rows = min(first.query.shape[0], first.output.shape[0])
    kinds = {}
    for kind in ("query", "output"):
        old = getattr(stack, kind)[:, :rows]
        kinds[kind] = torch.full((old.shape[0], rows + extra, *old.shape[2:]), float("nan"), dtype=old.dtype)
        kinds[kind][:, :rows].copy_(old)
    whole = types.SimpleNamespace(pages=stack.pages, **kinds)
    return [(layer, dataclasses.replace(inputs, query=whole.query[at], output=whole.output[at], stack=(whole, at),
                                        rows=rows))
            for layer, inputs in entries for at in [inputs.stack[1]]]


@pytest.mark.parametrize("stacked", [False, True], ids=["apart", "stacked"])
def test_a_staged_steps_whole_buffers_are_read_to_its_rows_alone(stacked):
    # A staging program's copies are buffers of the largest graph's rows; a step's graph wrote the first of them,
    # and the rest hold another step's (NaN here): the check reads the step's rows alone, apart or stacked, and
    # refuses a step with more tokens than its graph's rows.
    entries = _stacked(_one_step_of_layers(3))
    entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # layer 1: request 1, head 2
    whole = _in_whole_buffers(entries, extra=6)
    if not stacked:
        whole = [(layer, dataclasses.replace(inputs, stack=None)) for layer, inputs in whole]
    cut = check_layers(entries, pairs=ALL_PAIRS, step=4)
    read = check_layers(whole, pairs=ALL_PAIRS, step=4)
    assert [[(p.request, p.head, p.passed) for p in r.pairs] for r in read] == \
        [[(p.request, p.head, p.passed) for p in r.pairs] for r in cut]
    assert [r.passed for r in read] == [True, False, True] and all(r.nonfinite is None for r in read)
    assert whole[0][1].query.shape[0] == whole[0][1].rows + 6  # nothing of the caller's was cut
    # Fewer rows than the step's tokens: refused, never read past them.
    short = [(layer, dataclasses.replace(inputs, rows=inputs.rows - 1)) for layer, inputs in whole]
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.attn: the step has 6 token\(s\), its query and "
                                         r"output hold 5 row\(s\)"):
        check_layers(short, pairs=ALL_PAIRS, step=4)


@LAYER_KINDS
@pytest.mark.parametrize("order", [None, [4, 1, 2]], ids=["in_order", "some_of_a_stack"])
def test_layers_whose_copies_lie_in_one_stack_are_checked_as_each_alone(kw, order):
    # A graph step's staging lays alike layers' copies in one buffer per kind; the check then picks every layer's
    # pages, query and output rows at once, and must find what each layer checked alone finds: a wrong head, a NaN.
    entries = _one_step_of_layers(3, **kw)
    entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # layer 1: request 1, head 2
    entries[2][1].output.view(-1, HQ, D)[5, 3] = float("nan")  # layer 2: request 2's token, head 3
    alone = [check_step(layer, inputs, pairs=ALL_PAIRS, step=4) for layer, inputs in entries]
    stacked = _stacked(entries, order)
    together = check_layers(stacked, pairs=ALL_PAIRS, step=4)
    for one, both in zip(alone, together):
        assert both.layer == one.layer and both.tolerance == one.tolerance
        assert (both.nonfinite is None) == (one.nonfinite is None)
        if one.nonfinite is not None:
            assert (both.nonfinite.request, both.nonfinite.head) == (one.nonfinite.request, one.nonfinite.head)
        assert [(p.request, p.head, p.passed) for p in both.pairs] == [(p.request, p.head, p.passed)
                                                                       for p in one.pairs]
        for a, b in zip(one.pairs, both.pairs):
            if a.diff is not None and b.diff is not None:  # a few ulps; NaN where the output is
                assert b.diff.max_abs == pytest.approx(a.diff.max_abs, rel=1e-5, abs=1e-5, nan_ok=True)
    assert together[0].passed and [(p.request, p.head) for p in together[1].failed_pairs] == [(1, 2)]
    assert (together[2].nonfinite.request, together[2].nonfinite.head) == (2, 3)


def test_a_stacked_step_with_more_tokens_than_its_copies_rows_is_refused_not_read_past_them():
    # A stack's buffers hold the largest graph's rows; a layer's copies are the step's rows of them. A step whose
    # offsets say more tokens than those rows is refused, as a layer read apart is, never checked against rows
    # an earlier step left there.
    entries = _stacked(_one_step_of_layers(3))
    tokens = int(entries[0][1].query_start_loc[-1])
    cut = [(layer, dataclasses.replace(inputs, query=inputs.query[:tokens - 1], output=inputs.output[:tokens - 1]))
           for layer, inputs in entries]
    with pytest.raises(ValueError, match=f"the step has {tokens} token\\(s\\), its query and output hold {tokens - 1}"):
        check_layers(cut, pairs=ALL_PAIRS, step=1)
    assert all(result.passed for result in check_layers(entries, pairs=ALL_PAIRS, step=1))


def test_a_stacked_checks_torch_calls_do_not_grow_with_its_layers():
    # Per layer, a check read each layer's copies apart (its gathers, its non-finite check): with the layers' copies
    # in one stack, those are one call each for every layer, so the count is that of one problem.
    counts = {}
    for layers in (2, 6):
        entries = _stacked(_one_step_of_layers(layers))
        with _TorchCalls() as calls:
            results = check_layers(entries, pairs=4, step=1)
        assert all(result.passed for result in results)
        counts[layers] = calls.count
    assert counts[2] == counts[6], counts
    with _TorchCalls() as calls:
        check_layers(_one_step_of_layers(6), pairs=4, step=1)
    assert calls.count > counts[6] + 6 * 8, (calls.count, counts)  # the same layers apart: a dozen calls a layer


def test_layers_unlike_each_other_are_checked_apart():
    entries = _one_step_of_layers(2) + [(_layer(name="model.layers.9.self_attn.attn", sliding_window=6),
                                         make_step(_layer(sliding_window=6), seed=4, table_seed=3))]
    entries[2][1].output.view(-1, HQ, D)[0, 3] = float("nan")
    results = check_layers(entries, pairs=ALL_PAIRS, step=2)
    assert [r.passed for r in results] == [True, True, False]
    assert results[2].nonfinite is not None and (results[2].nonfinite.request, results[2].nonfinite.head) == (0, 3)
    assert results[0].nonfinite is None and len(results[0].pairs) == len(ALL_PAIRS)


def test_one_layers_own_draw_of_pairs_when_checked_together():
    entries = _one_step_of_layers(3)
    rng = random.Random(5)
    results = check_layers(entries, pairs=2, rng=rng, step=0)
    again = random.Random(5)
    expected = [sorted(choose_pairs([1, 4, 1], HQ, 2, again)) for _ in entries]
    assert [[(p.request, p.head) for p in r.pairs] for r in results] == expected
    assert all(r.passed for r in results)


def test_one_corrupted_head_is_found_and_named():
    layer = _layer()
    inputs = make_step(layer)
    out = inputs.output.view(-1, HQ, D)
    out[1:5, 3] += 0.5  # request 1 (tokens 1..4), head 3
    result = check_step(layer, inputs, pairs=ALL_PAIRS, step=7)
    assert [(p.request, p.head) for p in result.failed_pairs] == [(1, 3)]
    finding = result.finding()
    assert finding.kind == "mismatch" and finding.first == (1, 3)
    assert finding.signature == ("mismatch", layer.name, 3)
    text = finding.text()
    assert "layer model.layers.1.self_attn.attn step 7" in text and "request 1 head 3" in text
    assert "1 of 12 sampled" in text and "default for bfloat16" in text


def test_a_wrong_page_for_the_kernel_is_a_mismatch():
    layer = _layer()
    inputs = make_step(layer)
    # The kernel read request 0 with one page swapped: held to the table the engine built, it is wrong.
    wrong = inputs.block_table.clone()
    wrong[0, 1] = inputs.block_table[2, 0]
    kernel = make_step(layer)
    kernel.block_table = wrong  # as if the output had been computed from this table ...
    kernel.output = make_step(layer).output
    kernel_out = check_step(layer, StepInputs(**{**inputs.__dict__, "block_table": wrong}), pairs=ALL_PAIRS)
    assert {p.request for p in kernel_out.failed_pairs} == {0}


def test_nan_in_the_output_and_in_a_page():
    layer = _layer()
    inputs = make_step(layer)
    inputs.output.view(-1, HQ, D)[4, 2, 0] = float("inf")
    result = check_step(layer, inputs, pairs=[(0, 0)])
    assert result.nonfinite is not None
    assert (result.nonfinite.request, result.nonfinite.head, result.nonfinite.token) == (1, 2, 4)
    assert result.finding().kind == "nonfinite" and "1 NaN/inf value(s) in 1 of the step's 6" in result.finding().text()

    # NaN in a page request 2 reads, under a visible key: the reference is NaN there, the output is not.
    inputs = make_step(layer)
    page = int(inputs.block_table[2, 0])
    inputs.kv_cache[page, 0, 3, D + 1] = float("nan")  # V of key 3, KV head 0
    result = check_step(layer, inputs, pairs=[(2, 0), (2, 2)])
    assert [(p.request, p.head) for p in result.failed_pairs] == [(2, 0)]
    assert "non-finite in the reference" in result.finding().text()


def test_padding_rows_and_stale_table_entries_are_not_read():
    layer = _layer()
    inputs = make_step(layer)
    assert torch.isnan(inputs.output.view(-1, HQ, D)[-1]).all()  # padding past the step's tokens
    inputs.block_table[:, -1] = 10_000  # past every request's live pages
    assert check_step(layer, inputs, pairs=ALL_PAIRS).passed


def test_pairs_are_sampled_from_requests_with_tokens():
    rng = random.Random(3)
    pairs = choose_pairs([1, 0, 2], 4, 5, rng)
    assert len(set(pairs)) == 5 and all(r in (0, 2) and 0 <= h < 4 for r, h in pairs)
    assert choose_pairs([0, 0], 4, 3, rng) == []
    assert len(choose_pairs([1], 2, 10, rng)) == 2


def test_unmodelled_layer_is_said_once_and_never_checked(caplog):
    sentinel = Sentinel(SentinelConfig(directory="/tmp/x", rate=1.0))
    layer = _layer(mm_prefix=True)
    with caplog.at_level(logging.WARNING, logger="kvdbg.sentinel"):
        assert not sentinel.can_check(layer, "CPU_ATTN")
        assert not sentinel.can_check(layer, "CPU_ATTN")
        assert not sentinel.can_check(_layer(name="x"), "FLASHINFER_TS")
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "cannot check layer model.layers.1.self_attn.attn" in lines[0] and "PrefixLM" in lines[0]
    assert "FLASHINFER_TS" in lines[1]
    assert sentinel.can_check(_layer(name="y"), "CPU_ATTN")


def test_sampling_rate_layers_and_one_draw_per_step():
    sentinel = Sentinel(SentinelConfig(directory="/tmp/x", rate=0.25, layers="*.layers.1.*", seed=11))
    hits = sum(sentinel.sampled("model.layers.1.attn", step) for step in range(4000))
    assert 850 < hits < 1150
    assert not any(sentinel.sampled("model.layers.0.attn", step) for step in range(200))
    first = sentinel.sampled("model.layers.1.attn", 9000)
    assert all(sentinel.sampled("model.layers.1.attn", 9000) == first for _ in range(20))
    same = [Sentinel(SentinelConfig(directory="/tmp/x", rate=0.25, seed=11)) for _ in range(2)]
    assert [same[0].sampled("a", s) for s in range(50)] == [same[1].sampled("a", s) for s in range(50)]
    # One draw a step for all its layers: a drawn step is checked on every selected layer at once (a graph's
    # step is then staged once), and each layer's steps are still drawn at the rate.
    both = Sentinel(SentinelConfig(directory="/tmp/x", rate=0.25, seed=5))
    drawn = [(both.sampled("model.layers.0.attn", s), both.sampled("model.layers.7.attn", s)) for s in range(4000)]
    assert all(a == b for a, b in drawn) and 850 < sum(a for a, _ in drawn) < 1150
    # Layers a few steps apart (one asks for step s + 3 before the other asks for s) still share the draws.
    pairs = [(both.sampled("model.layers.0.attn", s + 3), both.sampled("model.layers.7.attn", s))
             for s in range(5000, 5400)]
    assert [a for a, _ in pairs[:-3]] == [b for _, b in pairs[3:]] and any(a for a, _ in pairs)


def test_dedupe_cap_and_interval():
    now = [0.0]
    sentinel = Sentinel(SentinelConfig(directory="/tmp/x", rate=1.0, max_snapshots=2, interval=10), clock=lambda: now[0])
    layer = _layer()

    def finding(head):
        inputs = make_step(layer)
        inputs.output.view(-1, HQ, D)[0, head] += 1
        result = check_step(layer, inputs, pairs=[(0, head)])
        sentinel.record(result)
        return result.finding()

    assert sentinel.admit(finding(1))
    assert not sentinel.admit(finding(1))  # same signature
    assert not sentinel.admit(finding(2))  # too soon
    now[0] = 11
    assert sentinel.admit(finding(2))
    now[0] = 30
    assert not sentinel.admit(finding(3))  # past the cap
    line = sentinel.summary()
    assert "checked 5 step(s)" in line and "5 wrong, 2 captured" in line
    assert "1 already captured with the same signature" in line and "1 past KVDBG_SENTINEL_MAX=2" in line
    assert "1 within KVDBG_SENTINEL_INTERVAL=10s" in line


def test_config_from_env():
    env = {"KVDBG_SENTINEL": "1%", "KVDBG_CAPTURE_DIR": "/tmp/cap"}
    config = SentinelConfig.from_env(env)
    assert config.rate == 0.01 and config.directory == "/tmp/cap" and config.pairs == 4
    config = SentinelConfig.from_env({"KVDBG_SENTINEL": "on", "KVDBG_SENTINEL_DIR": "/tmp/s",
                                      "KVDBG_CAPTURE_DIR": "/tmp/cap", "KVDBG_SENTINEL_LAYERS": "re:layers\\.1\\.",
                                      "KVDBG_SENTINEL_PAIRS": "2", "KVDBG_SENTINEL_MAX": "unlimited",
                                      "KVDBG_SENTINEL_INTERVAL": "0", "KVDBG_SENTINEL_SEED": "5"})
    assert (config.rate, config.directory, config.pairs, config.max_snapshots, config.interval, config.seed) == \
        (DEFAULT_RATE, "/tmp/s", 2, None, 0.0, 5)
    assert config.layers("model.layers.1.attn") and not config.layers("model.layers.11.attn")
    assert sentinel_requested({"KVDBG_SENTINEL": "0.5"}) and not sentinel_requested({"KVDBG_SENTINEL": "off"})
    assert parse_rate("0") == 0.0
    for env, name in [({"KVDBG_SENTINEL": "2"}, "KVDBG_SENTINEL "),
                      ({"KVDBG_SENTINEL": "nan"}, "KVDBG_SENTINEL "),
                      ({"KVDBG_SENTINEL": "0.1"}, "KVDBG_SENTINEL_DIR"),
                      ({"KVDBG_SENTINEL": "0.1", "KVDBG_SENTINEL_DIR": "/x", "KVDBG_SENTINEL_PAIRS": "0"},
                       "KVDBG_SENTINEL_PAIRS"),
                      ({"KVDBG_SENTINEL": "0.1", "KVDBG_SENTINEL_DIR": "/x", "KVDBG_SENTINEL_INTERVAL": "-1"},
                       "KVDBG_SENTINEL_INTERVAL"),
                      ({"KVDBG_SENTINEL": "0.1", "KVDBG_SENTINEL_DIR": "/x", "KVDBG_SENTINEL_LAYERS": "re:("},
                       "KVDBG_SENTINEL_LAYERS")]:
        with pytest.raises(OptionError, match=name):
            SentinelConfig.from_env(env)


def test_a_kernel_that_ignores_the_layers_sinks_is_caught():
    sinks = [12.0, 12.0, 12.0, 12.0]  # above every logit here: the sink takes most of each softmax
    ignored = make_step(_layer())  # the same cache, query and output, computed without the sinks
    result = check_step(_layer(sinks=sinks), ignored, pairs=ALL_PAIRS)
    assert len(result.failed_pairs) == len(ALL_PAIRS)


def test_a_prefill_is_held_to_the_reference_on_its_last_rows():
    layer = _layer()
    inputs = make_step(layer, seq_lens=(37, 30, 21), query_lens=(1, 30, 1))
    assert check_step(layer, inputs, pairs=ALL_PAIRS).passed
    inputs.output.view(-1, HQ, D)[30, 2] += 1.0  # request 1's last query row (position 29)
    result = check_step(layer, inputs, pairs=ALL_PAIRS)
    assert [(p.request, p.head) for p in result.failed_pairs] == [(1, 2)]
    assert result.failed_pairs[0].diff.worst_position == 29
    assert result.failed_pairs[0].diff.num_tokens == 16  # MAX_QUERY_ROWS of the 30
