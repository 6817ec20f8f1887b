"""`kvdbg shrink`: the failure kept (same backend, same renumbered heads), each reduction sound, refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner

from kvdbg.snapshot import cache as cache_module
from kvdbg.replayer import runner
from kvdbg.moves import shrinker
from kvdbg.backends.base import ReplayOptions
from kvdbg.cli import cli
from kvdbg.replayer.runner import ReplayContext, backend_key, load_backends, prepare_replay, replay, run_replay
from kvdbg.moves.shrinker import (bake_step, ddmin, drop_pages, droppable_pages, observe, same_failure, select_kv_heads,
                          select_requests, shrink)
from kvdbg.snapshot.store import load_snapshot, validate
from kvdbg.moves.synth import SynthSpec, synth_snapshot

from tests.helpers import FIXTURES


def invoke(*args):
    return CliRunner().invoke(cli, ["shrink", *args], catch_exceptions=False)


def reference_output(snap, step=0):
    """fp64: shrunk snapshots batch requests differently, so outputs agree to round-off, not bit for bit."""
    return replay(snap, ["reference"], ReplayOptions(exact=True), steps=[step]).steps[0].runs["reference"].output


def test_shrink_keeps_flex_failure_on_the_same_renumbered_heads(make_snapshot, tmp_path):
    path, snap = make_snapshot(seq_lens=(40, 70, 100, 55, 90, 33), steps=3, num_heads=8, num_kv_heads=4,
                               use_page_zero=True, page_zero_request=3)
    out = tmp_path / "small.safetensors"
    res = invoke(path, "-o", str(out), "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["backend"] == "flex"
    sig = {tuple(p) for p in data["signature"]["failing_heads"]}
    assert sig == {(3, h) for h in range(8)}  # page 0 hides 16 of request 3's keys from every head
    assert data["signature"]["error_findings"] == [{"code": "live_page_zero", "request": 3}]
    assert data["kept_requests"] == [3]
    assert data["kept_heads"] == list(range(8))  # --same-heads (default): every failing head stays
    assert data["output_bytes"] < data["input_bytes"] / 10
    assert [p["name"] for p in data["passes"]] == ["steps", "requests", "heads", "sequences", "table width"]

    small = load_snapshot(out)
    assert len(small.steps) == 1 and small.steps[0].num_reqs == 1
    assert (small.meta.layer.num_heads, small.meta.layer.num_kv_heads) == (8, 4)
    assert 0 in small.page_ids.tolist()
    # Independent replay of the written file, mapped back to the input's numbering.
    obs = observe(small, "flex", 0)
    mapped = {(data["kept_requests"][r], data["kept_heads"][h]) for r, h in obs.failing_heads}
    assert mapped and mapped == {p for p in sig if p[1] in data["kept_heads"]}
    assert {tuple(p) for p in data["failing_heads_after"]} == set(obs.failing_heads)
    assert obs.error_findings == {("live_page_zero", 0)}
    res = CliRunner().invoke(cli, ["replay", str(out), "--backend", "flex"])
    assert res.exit_code == 1

    # --any-heads lets the head pass drop failing heads too: one KV group (2 query heads) is enough.
    smaller = tmp_path / "smaller.safetensors"
    res = invoke(path, "-o", str(smaller), "--json", "--any-heads")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert len(data["kept_kv_heads"]) == 1 and len(data["kept_heads"]) == 2
    assert data["output_bytes"] < os.path.getsize(out)


def test_refuses_clean_input_and_existing_output(make_snapshot, tmp_path):
    clean, _ = make_snapshot(seq_lens=(30, 50))
    out = tmp_path / "out.safetensors"
    res = invoke(clean, "-o", str(out))
    # Nothing fails: the snapshot's verdict (PASS, as `kvdbg replay` says), and no file.
    assert res.exit_code == 0, res.output
    assert res.output.startswith("PASS: ") and "nothing to shrink, no file written (exit 0)" in " ".join(
        res.output.split())
    assert not out.exists()

    failing, _ = make_snapshot(seq_lens=(30, 50), use_page_zero=True, page_zero_request=0)
    res = invoke(failing, "-o", str(out), "--backend", "flashinfer_ts")  # page 0 is no bug for flashinfer_ts
    assert res.exit_code == 0 and "nothing to shrink" in res.output and not out.exists()
    out.write_bytes(b"keep me")
    res = invoke(failing, "-o", str(out))
    assert res.exit_code == 2 and "already exists; pass --force" in res.output
    assert out.read_bytes() == b"keep me"
    assert invoke(failing, "-o", str(out), "--force").exit_code == 0
    assert load_snapshot(out).steps[0].num_reqs == 1


def test_ddmin_finds_the_minimal_subset():
    calls = []

    def needs(subset):
        calls.append(tuple(subset))
        return {3, 11} <= set(subset)

    assert ddmin(range(20), needs) == [3, 11]
    assert ddmin(range(5), lambda s: True, allow_empty=True) == []
    assert ddmin([7], lambda s: bool(s)) == [7]
    assert len(set(calls)) < 60


def test_same_failure_rule():
    want = frozenset({(1, 0), (1, 2)})
    finds = frozenset({("live_page_zero", 1)})
    assert same_failure(want, finds, want, finds)
    assert same_failure(want | {(1, 3)}, finds, want, finds)  # the same request's other heads may join
    assert not same_failure(want | {(0, 0)}, finds, want, finds)  # a passing request must not start failing
    assert not same_failure(frozenset({(1, 0)}), finds, want, finds)  # a kept failing head stopped failing
    assert not same_failure(want, finds | {("x", None)}, want, finds)  # a new error finding: another bug
    assert not same_failure(frozenset(), frozenset(), frozenset(), frozenset())


@pytest.fixture(scope="module")
def multi_step():
    return synth_snapshot(SynthSpec(seq_lens=(40, 90, 65), steps=3, num_heads=8, num_kv_heads=4, seed=3))


def test_bake_step_equals_replaying_earlier_steps(multi_step):
    baked = bake_step(multi_step, 2)
    validate(baked)
    assert len(baked.steps) == 1 and baked.num_pages <= multi_step.num_pages
    torch.testing.assert_close(reference_output(baked), reference_output(multi_step, 2), rtol=1e-12, atol=1e-12)


def test_select_requests_and_heads_keep_their_exact_outputs(multi_step):
    baked = bake_step(multi_step, 1)
    full = reference_output(baked)
    qsl = baked.steps[0].query_start_loc.tolist()
    some = select_requests(baked, [2, 0])
    validate(some)
    rows = list(range(qsl[2], qsl[3])) + list(range(qsl[0], qsl[1]))
    torch.testing.assert_close(reference_output(some), full[rows], rtol=1e-12, atol=1e-12)
    heads = select_kv_heads(baked, [1, 3])  # group size 2: query heads 2, 3, 6, 7
    validate(heads)
    torch.testing.assert_close(reference_output(heads), full[:, [2, 3, 6, 7]], rtol=1e-12, atol=1e-12)


def test_dropping_pages_before_a_causal_window_keeps_the_output():
    snap = synth_snapshot(SynthSpec(seq_lens=(200, 37), sliding_window=32, num_heads=4, num_kv_heads=2, seed=5))
    baked = bake_step(snap, 0)
    assert droppable_pages(baked, 0) == list(range(12))  # token 199 is on page 12
    shorter = drop_pages(baked, 0, range(10))  # keys 0..159 lie before the window 168..199
    validate(shorter)
    assert shorter.steps[0].seq_lens.tolist() == [40, 37]
    assert shorter.num_pages == baked.num_pages - 10
    torch.testing.assert_close(reference_output(shorter), reference_output(baked), rtol=1e-12, atol=1e-12)
    inside = drop_pages(baked, 0, [11])  # keys 176..191 are inside the window: the output must change
    assert not torch.allclose(reference_output(inside)[0], reference_output(baked)[0])


# --------------------------------------------------------------------------- state reused across candidates


@pytest.mark.parametrize("fixture, backend, same_heads", [("prefix_page0", "flex", False),
                                                          ("ts_causal_window", "flashinfer_ts", True)])
def test_shrink_makes_backends_once_per_layer_and_answers_as_fresh_replays(fixture, backend, same_heads, tmp_path,
                                                                            monkeypatch):
    loads = []
    real_load = runner.load_backends

    def counting(names, meta, options, **kwargs):
        loads.append((tuple(names), backend_key(meta)))
        return real_load(names, meta, options, **kwargs)

    monkeypatch.setattr(runner, "load_backends", counting)
    path = os.path.join(FIXTURES, f"{fixture}.safetensors")
    reused = shrink(load_snapshot(path), backend, output_path=str(tmp_path / "reused.safetensors"),
                    same_heads=same_heads)
    # The input's own replay, then the candidates': one load per layer they have.
    assert {names for names, _ in loads[1:]} == {("reference", backend)}
    layers = [key for _, key in loads[1:]]
    assert len(layers) == len(set(layers)) and len(layers) < reused.replays - 2
    if not same_heads:  # --any-heads: the head pass tries one KV head of two, a layer of its own
        assert len(set(layers)) == 2

    # The same shrink with a fresh replay per candidate: the same file, the same result.
    loads.clear()
    monkeypatch.setattr(shrinker._Shrinker, "observe",
                        lambda self, candidate: observe(candidate, self.signature.backend, 0))
    fresh = shrink(load_snapshot(path), backend, output_path=str(tmp_path / "fresh.safetensors"),
                   same_heads=same_heads)
    assert len(loads) == fresh.replays
    assert (tmp_path / "reused.safetensors").read_bytes() == (tmp_path / "fresh.safetensors").read_bytes()
    strip = ("seconds", "output_path")
    assert {k: v for k, v in reused.to_json().items() if k not in strip} == \
        {k: v for k, v in fresh.to_json().items() if k not in strip}


def _run_record(result):
    """Each backend's output bits, findings and what it reports having run."""
    step = result.steps[0]
    return ({name: run.output for name, run in step.runs.items()},
            {name: [f.to_json() for f in run.findings] for name, run in step.runs.items()},
            {st.name: st.info for st in result.backends})


def test_a_reused_backend_forgets_the_last_snapshot_and_replays_the_next_as_a_fresh_one():
    names = ["reference", "flex", "flashinfer_ts"]
    big = bake_step(synth_snapshot(SynthSpec(seq_lens=(40, 90, 65, 300), num_heads=4, num_kv_heads=2, seed=3)), 0)
    small = select_requests(big, [2, 0])
    context = ReplayContext(names)
    first = context.setup(big, [0], private_cache=False)
    instances = first.instances
    run_replay(big, first)
    assert instances["flex"].impl.scores > 0 and instances["flashinfer_ts"].impl.last_views is not None
    plans = dict(instances["flashinfer_ts"].builder.plans)

    setup = context.setup(small, [0], private_cache=False)
    assert setup.instances is instances  # the same layer: the same instances, reset
    assert instances["flex"].impl.scores == 0 and instances["flashinfer_ts"].impl.last_views is None
    _, fresh_instances, _ = load_backends(names, small.meta, ReplayOptions())
    assert {n: i.describe() for n, i in instances.items()} == {n: i.describe() for n, i in fresh_instances.items()}

    shared = _run_record(run_replay(small, setup))
    fresh = _run_record(replay(small, names, steps=[0]))
    for name in names:
        torch.testing.assert_close(shared[0][name], fresh[0][name], atol=0, rtol=0, equal_nan=True)
    assert shared[1:] == fresh[1:]
    # flashinfer_ts planned the 2-request batch next to the 4-request one: plans are kept, not rebuilt.
    assert set(plans) < set(instances["flashinfer_ts"].builder.plans)


def test_a_step_without_cache_update_is_replayed_from_the_snapshot_own_pages(monkeypatch):
    copies = []
    real_working_cache = cache_module.working_cache

    def counting(snapshot, device="cpu"):
        copies.append(snapshot)
        return real_working_cache(snapshot, device)

    monkeypatch.setattr(cache_module, "working_cache", counting)
    spec = dict(seq_lens=(40, 90), num_heads=4, num_kv_heads=2, seed=2)
    read_only = synth_snapshot(SynthSpec(new_kv=False, **spec))
    updated = synth_snapshot(SynthSpec(**spec))
    before = read_only.kv_cache.clone()
    context = ReplayContext(["reference", "flex"])

    setup = context.setup(read_only, [0], private_cache=False)
    assert setup.cache.data_ptr() == read_only.kv_cache.data_ptr() and not copies
    assert observe(read_only, "flex", 0, context=context) == observe(read_only, "flex", 0)
    assert not copies
    assert torch.equal(read_only.kv_cache, before)  # backends only read the pages they are handed

    updated_before = updated.kv_cache.clone()
    setup = context.setup(updated, [0], private_cache=False)
    assert setup.cache.data_ptr() != updated.kv_cache.data_ptr() and len(copies) == 1  # the update writes
    run_replay(updated, setup)
    assert torch.equal(updated.kv_cache, updated_before)
    # poison writes NaN regions into its cache: it gets a private one even without an update.
    assert prepare_replay(read_only, ["reference"]).cache.data_ptr() != read_only.kv_cache.data_ptr()


@pytest.mark.parametrize("source", ["prefix_page0", "ts_causal_window", "synth_three_steps"])
def test_signature_from_the_last_step_equals_the_whole_replays(source, monkeypatch):
    """The quick path (last step, first backend) and the whole replay choose the same failure."""
    if source == "synth_three_steps":
        snap = synth_snapshot(SynthSpec(seq_lens=(40, 90, 65), steps=3, num_heads=8, num_kv_heads=4, seed=3,
                                        use_page_zero=True, page_zero_request=1))
    else:
        snap = load_snapshot(os.path.join(FIXTURES, f"{source}.safetensors"))
    calls = []
    real_replay = shrinker.replay

    def recording(snapshot, backends, options=None, **kwargs):
        calls.append((tuple(backends), tuple(kwargs.get("steps") or ())))
        return real_replay(snapshot, backends, options, **kwargs)

    monkeypatch.setattr(shrinker, "replay", recording)
    quick = shrinker.failure_signature(snap)
    last = len(snap.steps) - 1
    assert calls[0] == (("reference", "flex"), (last,))
    if quick.backend == "flex" and quick.step == last:
        assert len(calls) == 1  # nothing else was replayed
    monkeypatch.setattr(shrinker, "_last_step_signature", lambda *args: None)
    assert shrinker.failure_signature(snap) == quick


def test_a_shrink_that_removed_nothing_never_says_smaller(tmp_path):
    from kvdbg.render.shrink import size_change
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    assert size_change(6692, 6884) == "not smaller: nothing could be removed, and the shrink's notes add 192 B"
    assert size_change(100, 100) == "not smaller: nothing could be removed"
    assert size_change(1000, 500) == "2.0× smaller" and size_change(1000, 990) == "10 B smaller"
    spec = SynthSpec(seq_lens=(10,), use_page_zero=True, page_zero_request=0, num_heads=2, num_kv_heads=1)
    path = str(save_snapshot(synth_snapshot(spec), tmp_path / "one.safetensors"))
    res = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"}).invoke(
        cli, ["shrink", path, "-o", str(tmp_path / "s.safetensors")])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())  # long temporary paths wrap the lines
    assert "× smaller" not in text and text.count("not smaller: nothing could be removed") == 2
