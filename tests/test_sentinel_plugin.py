"""The sentinel inside kvdbg.vllm_plugin, against the vLLM 0.33 stand-ins (no real vLLM here)."""

from __future__ import annotations

import logging
import os

import pytest


from kvdbg import api


from kvdbg import vllm_plugin
from kvdbg.sentinel.config import ENV_RATE
from kvdbg.snapshot.store import load_snapshot
from tests.test_vllm_plugin import StandinEngine, clean, standins  # noqa: F401  (fixtures)

SENTINEL_VARS = ("KVDBG_SENTINEL", "KVDBG_SENTINEL_DIR", "KVDBG_SENTINEL_LAYERS", "KVDBG_SENTINEL_PAIRS",
                 "KVDBG_SENTINEL_MAX", "KVDBG_SENTINEL_INTERVAL", "KVDBG_SENTINEL_SEED")


@pytest.fixture
def sentinel_env(standins, tmp_path):
    for var in SENTINEL_VARS:
        standins.delenv(var, raising=False)
    directory = tmp_path / "sentinel"
    standins.setenv("KVDBG_SENTINEL", "1")
    standins.setenv("KVDBG_SENTINEL_DIR", str(directory))
    standins.setenv("KVDBG_SENTINEL_PAIRS", "64")
    standins.setenv("KVDBG_SENTINEL_INTERVAL", "0")
    standins.setenv("KVDBG_CAPTURE_BACKENDS", "FLEX_ATTENTION")
    return standins, directory


def _hooks():
    return vllm_plugin._state.sentinel


def _files(directory):
    hooks = _hooks()
    assert hooks.capturer.flush(10)
    return sorted(os.path.join(directory, n) for n in os.listdir(directory)) if os.path.isdir(directory) else []


def _wrong_head_2_of_layer_1(monkeypatch):
    """vLLM's FLEX_ATTENTION with a fault: head 2 of layer 1's output is off by one on every step."""
    from vllm.v1.attention.backends.flex_attention import FlexAttentionImpl

    real = FlexAttentionImpl.forward

    def faulty(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        out = real(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        if attn_metadata is not None and layer.layer_name.endswith("layers.1.self_attn.attn"):
            n = attn_metadata.num_actual_tokens
            out[:n].view(n, self.num_heads, self.head_size)[:, 2] += 1.0
        return out

    monkeypatch.setattr(FlexAttentionImpl, "forward", faulty)


def test_the_plugin_spells_the_sentinel_variable_as_the_config_does():
    assert vllm_plugin.ENV_SENTINEL == ENV_RATE


def test_honest_steps_are_checked_and_nothing_is_written(sentinel_env):
    monkeypatch, directory = sentinel_env
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    for _ in range(3):
        engine.step()
    hooks = _hooks()
    assert hooks.sentinel.counts["checked"] == 6 and hooks.sentinel.counts["failed"] == 0
    assert hooks.sentinel.counts["pairs"] == 6 * 3 * 4
    assert _files(directory) == []
    assert vllm_plugin.active_capturer().written == []  # capture itself is off: only the sentinel's variables


def test_a_wrong_head_is_captured_once_with_its_finding(sentinel_env, caplog):
    monkeypatch, directory = sentinel_env
    _wrong_head_2_of_layer_1(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvdbg"):
        vllm_plugin.register()
        engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
        for _ in range(3):
            engine.step()
        (path,) = _files(directory)  # the same fault on later steps has the same signature
    lines = [r.getMessage() for r in caplog.records if "is wrong" in r.getMessage()]
    assert lines == [f"kvdbg sentinel: layer model.layers.1.self_attn.attn step 0 is wrong (output disagrees with "
                     f"the exact reference): first failing request 0 head 2; snapshot {path}"]
    snap = load_snapshot(path)
    assert snap.meta.notes.startswith("kvdbg sentinel, layer model.layers.1.self_attn.attn step 0: 3 of 12 sampled")
    assert snap.meta.capture["captured_by"] == "the sentinel (mismatch)"
    assert snap.meta.capture["step"] == 0
    # The snapshot holds the state the step started from: replay finds the same head wrong, and only it.
    result = api.replay(path, ["reference"])
    assert result.verdict.exit_code == 1
    (comparison,) = [c for c in result.comparisons if (c.actual, c.expected) == ("captured", "reference")]
    assert sorted({h.head for h in comparison.failed}) == [2]
    hooks = _hooks()
    assert hooks.sentinel.counts["failed"] == 3 and hooks.sentinel.counts["duplicate"] == 2
    vllm_plugin._state.before_shutdown()
    summary = [r.getMessage() for r in caplog.records if "kvdbg sentinel in pid" in r.getMessage()]
    assert len(summary) == 1 and "checked 6 step(s)" in summary[0] and "3 wrong, 1 captured" in summary[0]


def test_unsampled_layers_are_not_checked(sentinel_env):
    monkeypatch, directory = sentinel_env
    monkeypatch.setenv("KVDBG_SENTINEL_LAYERS", "*.layers.0.*")
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=1)
    engine.step()
    assert _hooks().sentinel.counts["checked"] == 1


def test_a_bad_sentinel_variable_is_one_line_and_nothing_is_patched(sentinel_env, caplog):
    monkeypatch, _ = sentinel_env
    monkeypatch.setenv("KVDBG_SENTINEL", "7")
    with caplog.at_level(logging.ERROR, logger="kvdbg"):
        vllm_plugin.register()
    assert vllm_plugin._state is None
    assert [r.getMessage() for r in caplog.records] == [
        "kvdbg capture not started: KVDBG_SENTINEL must be a share of steps in (0, 1] like 0.01 or 1%, 'on' (0.01) "
        "or 'off', got '7'"]



class _ChecksNeverBack:
    """Device checks that do not come back: each collect waits its whole timeout."""

    def __init__(self):
        self.timeouts = []

    def collect(self, name, timeout=None):
        import time

        self.timeouts.append(timeout)
        time.sleep(timeout)
        return None

    def close(self, timeout=5.0):  # its checker process told to stop, within what is left of the time
        self.closed = timeout


def test_closing_with_checks_still_out_keeps_to_its_one_time_limit(sentinel_env, caplog):
    """vLLM kills a worker past its shutdown grace: the checks still out share the sentinel's time, not one each."""
    monkeypatch, _ = sentinel_env
    vllm_plugin.register()
    StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=1, query_len=1).step()
    hooks = _hooks()
    hooks._deferred = never = _ChecksNeverBack()
    hooks._waiting = {f"model.layers.{i}.self_attn.attn": None for i in range(5)}
    with caplog.at_level(logging.INFO, logger="kvdbg"):
        hooks.close(vllm_plugin._state, 0.6)
    assert sum(never.timeouts) <= 0.6 + 1e-6  # one deadline for all five (before: 0.6 s each, 3 s in all)
    assert never.closed <= 0.6 - sum(never.timeouts) + 1e-6  # the checker process's stop within the same deadline
    assert hooks.sentinel.counts["errors"] == 5  # each check not back is counted, and the line is still said
    assert any("kvdbg sentinel in pid" in r.getMessage() for r in caplog.records)


def test_the_sentinel_alone_records_a_staged_variant_only_when_it_checks_every_layer_the_graph_copies(sentinel_env,
                                                                                                      tmp_path):
    """The sentinel alone: a graph's staged variant is recorded when the sentinel checks every layer the graph copies
    (a step it draws then replays it); with capture on for another layer, neither covers the graph's layers and it is
    not (no step could replay it: its staging would hold device memory for nothing)."""
    from tests.test_vllm_plugin import _record_graph, _record_variants

    monkeypatch, _ = sentinel_env
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    _record_graph(engine, 8, 4, monkeypatch)
    _record_variants(8)
    state = vllm_plugin._state
    assert state._graph_layers and state._graph_variants
    assert len(state._staged_variants) == 1 and len(state._in_graph_programs) == 1

    # The sentinel checking layer 0 (its graph then copies that layer alone: recorded as above), capture on for
    # layer 1: the graph copies both, and no step is drawn or wanted on both.
    vllm_plugin.unregister()
    monkeypatch.setenv("KVDBG_SENTINEL_LAYERS", "model.layers.0.self_attn.attn")
    monkeypatch.setenv("KVDBG_CAPTURE_DIR", str(tmp_path / "captured"))
    monkeypatch.setenv("KVDBG_CAPTURE_LAYERS", "model.layers.1.self_attn.attn")
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    _record_graph(engine, 8, 4, monkeypatch)
    _record_variants(8)
    state = vllm_plugin._state
    assert len(state._graph_layers[next(iter(state._graph_layers))]) == 2 and state._graph_variants
    assert not state._staged_variants and not state._in_graph_programs


def test_a_drawn_step_replays_the_staged_variant_and_is_checked_from_its_copies_with_no_host_staging(
        sentinel_env, caplog):
    """A step the sentinel draws replays the graph's staged variant: the program inside the graph staged its pages,
    query and output, so the engine's thread stages nothing (no program of the host's is ever made) and reads no
    count back: the check works each request's pages out from the step's lengths. A wrong head is caught and
    captured from those copies, the step's padding rows no requests; an honest step of another batch passes; every
    hold on the program is let go."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _record_variants, _run_as_graph

    from kvdbg.sentinel.checker import PagesOfLengths, Sentinel
    from kvdbg.vllm_plugin.graph_staging import StagedStep

    monkeypatch, directory = sentinel_env
    _wrong_head_2_of_layer_1(monkeypatch)
    seen = []
    real = Sentinel.check_layers
    monkeypatch.setattr(Sentinel, "check_layers", lambda self, entries, step: seen.append(
        [inputs.max_pages for _, inputs in entries]) or real(self, entries, step))
    sized = []
    real_sized = StagedStep.sized
    monkeypatch.setattr(StagedStep, "sized", lambda self: sized.append(self) or real_sized(self))
    with caplog.at_level(logging.INFO, logger="kvdbg"):
        vllm_plugin.register()
        engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
        tokens, reqs = 8, 4  # three requests of 2 tokens, padded to a graph of 8 tokens and 4 rows
        _record_graph(engine, tokens, reqs, monkeypatch)
        wrapper, entry = _record_variants(tokens)
        state = vllm_plugin._state
        program = next(iter(state._in_graph_programs.values()))
        replayed = []
        for _ in range(2):
            _run_as_graph(engine, _padded(engine.common(), reqs=reqs, tokens=tokens), _padded_inputs(engine, tokens),
                          tokens, monkeypatch, wrapper=wrapper)
            replayed.append(entry.cudagraph)
        (path,) = _files(directory)
    hooks = _hooks()
    assert replayed == ["staged", "staged"] and state.staged_replays == 2
    # No count read back but by the capture of the wrong step (the first; the second is wrong the same way: not
    # captured again)
    assert len({id(staged) for staged in sized}) == 1
    assert state._stager is None  # nothing staged from the host
    # Each check was handed what the program counted, as a rule on the lengths, and worked it out itself.
    assert [marks for marks in seen] == [[PagesOfLengths(16, program.width, program.size)] * 2] * 2
    assert hooks.sentinel.counts["checked"] == 4 and hooks.sentinel.counts["failed"] == 2
    assert hooks.sentinel.counts["errors"] == 0
    assert not program.held and program.reusable()
    snap = load_snapshot(path)
    assert snap.steps[0].num_reqs == 3  # the graph's padding rows are not requests
    result = api.replay(path, ["reference"])
    (comparison,) = [c for c in result.comparisons if (c.actual, c.expected) == ("captured", "reference")]
    assert result.verdict.exit_code == 1 and sorted({h.head for h in comparison.failed}) == [2]
    lines = [r.getMessage() for r in caplog.records if "is wrong" in r.getMessage()]
    assert lines == [f"kvdbg sentinel: layer model.layers.1.self_attn.attn step 0 is wrong (output disagrees with "
                     f"the exact reference): first failing request 0 head 2; snapshot {path}"]


def test_a_drawn_step_capture_wants_on_every_layer_or_none_is_staged_once_inside_the_graph_for_both(
        sentinel_env, tmp_path):
    """The sentinel and capture on together: a step both take (capture's steps 0 and 2, every layer; the sentinel
    draws every step) replays the staged variant once, the sentinel's checks and the capture thread each holding it;
    a step capture leaves (1) replays it for the sentinel alone. Capture's snapshots are the steps it wants, exact;
    each check passes; nothing is staged from the host and every hold is let go."""
    import torch

    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _record_variants, _run_as_graph, \
        snapshots

    monkeypatch, _ = sentinel_env
    captured = tmp_path / "captured"
    monkeypatch.setenv("KVDBG_CAPTURE_DIR", str(captured))
    monkeypatch.setenv("KVDBG_CAPTURE_STEPS", "0,2")
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    tokens, reqs = 8, 4
    _record_graph(engine, tokens, reqs, monkeypatch)
    wrapper, entry = _record_variants(tokens)
    state = vllm_plugin._state
    program = next(iter(state._in_graph_programs.values()))
    replayed, outputs = [], []
    for _ in range(3):
        common = _padded(engine.common(), reqs=reqs, tokens=tokens)
        out = _run_as_graph(engine, common, _padded_inputs(engine, tokens), tokens, monkeypatch, wrapper=wrapper)
        outputs.append([o[:6].clone() for o in out])
        replayed.append(entry.cudagraph)
        assert state.drain_graph_capture(10)  # the capture thread done with it: the program free for the next
    assert replayed == ["staged"] * 3 and state._stager is None
    counts = _hooks().sentinel.counts
    assert counts["checked"] == 6 and counts["failed"] == 0 and counts["errors"] == 0
    snaps = snapshots(captured)
    assert sorted((s.meta.capture["step"], s.meta.capture["layer"]) for s in snaps) == \
        [(step, name) for step in (0, 2) for name in engine.names]
    for snap in snaps:
        layer = engine.names.index(snap.meta.capture["layer"])
        expected = outputs[snap.meta.capture["step"]][layer]
        torch.testing.assert_close(snap.steps[0].output.reshape(expected.shape), expected, rtol=0, atol=0)
    account = vllm_plugin.active_capturer().engine_time
    assert account.in_graph == 2 and account.waits == 0
    assert not program.held and program.reusable()


@pytest.mark.parametrize("capture_on", [False, True], ids=["sentinel alone", "capture on, its thread idle"])
def test_a_hold_the_sentinels_capture_left_pending_is_let_go_by_the_next_choice_of_graph(sentinel_env, tmp_path,
                                                                                        capture_on):
    """After the sentinel captured a wrong step from the program's copies, its hold is let go once those copies are
    done on the device (an event, as on a GPU; here one that has passed): the next drawn step's choice asks, so every
    step still replays the staged variant, with capture's thread idle or absent."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _record_variants, _run_as_graph

    from kvdbg.vllm_plugin.graph_staging import InGraphProgram

    class Passed:
        def query(self):
            return True

        def synchronize(self):
            pass

    monkeypatch, _ = sentinel_env
    pended = []

    def release(self, issued=True):  # a GPU's: an issued release pends until asked
        if issued:
            pended.append(1)
            with self._lock:
                self._pending.append(Passed())
        else:
            self._let_go()

    monkeypatch.setattr(InGraphProgram, "release", release)
    _wrong_head_2_of_layer_1(monkeypatch)
    if capture_on:
        monkeypatch.setenv("KVDBG_CAPTURE_DIR", str(tmp_path / "captured"))
        monkeypatch.setenv("KVDBG_CAPTURE_STEPS", "0")
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    _record_graph(engine, 8, 4, monkeypatch)
    wrapper, entry = _record_variants(8)
    state = vllm_plugin._state
    program = next(iter(state._in_graph_programs.values()))
    replayed = []
    for _ in range(4):
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=8), _padded_inputs(engine, 8), 8, monkeypatch,
                      wrapper=wrapper)
        replayed.append(entry.cudagraph)
        if capture_on and not replayed[1:]:  # capture's step: its thread done, then idle (nothing pending then)
            assert state.drain_graph_capture(10)
    assert replayed == ["staged"] * 4 and state._stager is None
    counts = _hooks().sentinel.counts
    assert counts["failed"] == 4 and counts["captured"] == 1
    assert pended  # (on a CPU the sentinel's checks run in line, each letting its layer's hold go issued)
    state._poll_in_graph_releases()
    assert not program.held


def test_a_wrong_step_replayed_from_a_full_cuda_graph_is_caught_and_captured(sentinel_env, caplog):
    """The sentinel under a full CUDA graph: it checks what the graph's copies wrote, after each replay."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _run_as_graph

    from tests.test_vllm_plugin import _staged_spans_on_the_host

    from kvdbg.backends.reference import ReferenceImpl

    monkeypatch, directory = sentinel_env
    _wrong_head_2_of_layer_1(monkeypatch)
    spans = _staged_spans_on_the_host(monkeypatch)
    problems = []  # the reference problems the checks made: both layers of a step are one
    forward = ReferenceImpl.forward
    monkeypatch.setattr(ReferenceImpl, "forward", lambda self, q, *a, **k: problems.append(q.shape[0])
                        or forward(self, q, *a, **k))
    with caplog.at_level(logging.INFO, logger="kvdbg"):
        vllm_plugin.register()
        engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
        tokens, reqs = 8, 4  # three requests of 2 tokens, padded to a graph of 8 tokens and 4 rows
        _record_graph(engine, tokens, reqs, monkeypatch)
        hooks = _hooks()
        assert hooks.sentinel.counts["checked"] == 0  # recording a graph is no step
        for _ in range(2):
            _run_as_graph(engine, _padded(engine.common(), reqs=reqs, tokens=tokens),
                          _padded_inputs(engine, tokens), tokens, monkeypatch)
        (path,) = _files(directory)
    assert hooks.sentinel.counts["checked"] == 4 and hooks.sentinel.counts["failed"] == 2
    # The two layers of a step are alike: their pairs went to the reference as one problem, one per step.
    assert len(problems) == 2 and problems[0] == problems[1] > 0
    # Both steps were staged (checked and captured from kvdbg's copies), and their staging was let go.
    stager = vllm_plugin._state._stager
    assert stager.staged == 2 and not any(p.held for ps in stager._programs.values() for p in ps)
    # Captured on the engine's thread: gathered as ever, never one span copy that its stream would wait for.
    assert spans == []
    lines = [r.getMessage() for r in caplog.records if "is wrong" in r.getMessage()]
    assert lines == [f"kvdbg sentinel: layer model.layers.1.self_attn.attn step 0 is wrong (output disagrees with "
                     f"the exact reference): first failing request 0 head 2; snapshot {path}"]
    snap = load_snapshot(path)
    assert snap.steps[0].num_reqs == 3  # the graph's padding rows are not requests
    result = api.replay(path, ["reference"])
    assert result.verdict.exit_code == 1
    (comparison,) = [c for c in result.comparisons if (c.actual, c.expected) == ("captured", "reference")]
    assert sorted({h.head for h in comparison.failed}) == [2]


def test_a_staged_steps_check_names_its_programs_whole_buffers_and_its_graphs_rows(sentinel_env):
    """One staging program serves every graph size: a step's check names the program's whole buffers (the same
    objects for every size, so the checker process is given them once) and the rows its graph wrote; the rows a
    larger graph wrote past them (NaN here) are not the step's, and it passes."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _run_as_graph

    from kvdbg.sentinel.checker import Sentinel

    monkeypatch, _ = sentinel_env
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    _record_graph(engine, 16, 8, monkeypatch)
    _record_graph(engine, 8, 4, monkeypatch)
    seen = []
    real = Sentinel.check_layers
    monkeypatch.setattr(Sentinel, "check_layers", lambda self, entries, step: seen.append(entries) or
                        real(self, entries, step))
    for tokens, reqs in ((16, 8), (8, 4)):
        _run_as_graph(engine, _padded(engine.common(), reqs=reqs, tokens=tokens), _padded_inputs(engine, tokens),
                      tokens, monkeypatch)
        if tokens == 16:  # rows the next, smaller graph does not write
            for _, inputs in seen[-1]:
                inputs.query[8:].fill_(float("nan"))
                inputs.output[8:].fill_(float("nan"))
    assert [[inputs.rows for _, inputs in entries] for entries in seen] == [[16, 16], [8, 8]]
    assert [id(inputs.query) for _, inputs in seen[0]] == [id(inputs.query) for _, inputs in seen[1]]
    assert [id(inputs.output) for _, inputs in seen[0]] == [id(inputs.output) for _, inputs in seen[1]]
    assert all(inputs.query.shape[0] == 16 for entries in seen for _, inputs in entries)
    counts = _hooks().sentinel.counts
    assert counts["checked"] == 4 and counts["failed"] == 0 and counts["errors"] == 0


def test_a_wrong_step_of_a_smaller_graph_is_captured_with_its_graphs_rows(sentinel_env):
    """A staged step's copies are the program's whole buffers (the largest graph's rows): the capture of a wrong
    step takes its own graph's rows of them, as the engine handed its kernel."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _run_as_graph

    monkeypatch, directory = sentinel_env
    _wrong_head_2_of_layer_1(monkeypatch)
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2)
    _record_graph(engine, 16, 8, monkeypatch)
    _record_graph(engine, 8, 4, monkeypatch)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=8), _padded_inputs(engine, 8), 8, monkeypatch)
    (path,) = _files(directory)
    snap = load_snapshot(path)
    assert snap.meta.capture["query_rows_given"] == 8 and snap.steps[0].num_reqs == 3
    result = api.replay(path, ["reference"])
    (comparison,) = [c for c in result.comparisons if (c.actual, c.expected) == ("captured", "reference")]
    assert result.verdict.exit_code == 1 and sorted({h.head for h in comparison.failed}) == [2]


def _graph_engine(monkeypatch, layers: int, query_len: int, tokens: int, reqs: int):
    """The plugin registered on a stand-in engine whose full graph of ``tokens`` is recorded with kvdbg's copies and
    plain: (engine, plugin state, sentinel hooks, the graph's batch, vLLM's entry, its wrapper)."""
    import types

    from tests.test_vllm_plugin import _record_graph

    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=layers, query_len=query_len)
    _record_graph(engine, tokens, reqs, monkeypatch)
    state = vllm_plugin._state
    batch = next(iter(state._graph_layers))
    entry = types.SimpleNamespace(cudagraph="copies", output=None)
    wrapper = types.SimpleNamespace(concrete_cudagraph_entries={batch: entry})
    state.record_plain_graph(wrapper, batch, lambda: setattr(entry, "cudagraph", "plain"))
    return engine, state, _hooks(), batch, entry, wrapper


def test_a_graph_step_the_sentinel_did_not_draw_is_let_go_for_all_its_layers_at_once(sentinel_env):
    """Under full graphs at a low rate, most steps are not drawn: the replay's hook tells so with one draw for all
    the graph's layers (no per-layer call), each layer's count still moves on; the graph chosen before the replay
    is the plain one for those steps and the one with kvdbg's copies for a drawn step, which is checked."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _run_as_graph

    from kvdbg.sentinel.checker import Sentinel

    monkeypatch, _ = sentinel_env
    monkeypatch.setenv("KVDBG_SENTINEL", "0.2")
    monkeypatch.setenv("KVDBG_SENTINEL_SEED", "3")
    tokens, reqs = 8, 4
    engine, state, hooks, batch, entry, wrapper = _graph_engine(monkeypatch, 8, 2, tokens, reqs)
    asked = []
    real = Sentinel.sampled
    monkeypatch.setattr(Sentinel, "sampled", lambda self, *a: (asked.append(a), real(self, *a))[1])
    chosen, drawn = [], []
    for step in range(20):
        state.choose_graph(wrapper, batch)
        chosen.append(entry.cudagraph)
        drawn.append(hooks.sentinel.drawn(step))
        asked.clear()
        _run_as_graph(engine, _padded(engine.common(), reqs=reqs, tokens=tokens), _padded_inputs(engine, tokens),
                      tokens, monkeypatch)
        assert set(state._forward_counts[n] for n in engine.names) == {step + 1}
        # a step not drawn: no layer asked one by one; a drawn one: every layer, as before
        assert (asked == []) == (not drawn[-1]), (step, asked)
    assert 0 < sum(drawn) < 20 and chosen == ["copies" if d else "plain" for d in drawn]
    hooks.close(state, 30)
    assert hooks.sentinel.counts["checked"] == 8 * sum(drawn) and hooks.sentinel.counts["failed"] == 0
    assert state.plain_replays == 20 - sum(drawn)


@pytest.mark.parametrize("through", [False, True], ids=["hooks", "through-vllms-wrapper"])
def test_the_sentinel_draws_ahead_for_replays_told_unwanted_ahead_the_draws_it_would_make_one_by_one(
        sentinel_env, through):
    """Steps of a graph that nothing wants are told ahead (graph_hooks._QuietRun): the sentinel's draws for them are
    made then, in the order of the steps, so the same seed draws the same steps as when each is asked at its own
    step (nothing told ahead); each drawn step is still replayed with kvdbg's copies and checked on every
    layer, and the steps between ask nothing (``through`` the patch of vLLM's graph wrapper: not even the graph
    call's questions)."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _run_as_graph

    from kvdbg.vllm_plugin import graph_hooks

    monkeypatch, _ = sentinel_env
    monkeypatch.setenv("KVDBG_SENTINEL", "0.1")
    monkeypatch.setenv("KVDBG_SENTINEL_SEED", "5")

    def forty_steps(ahead):
        monkeypatch.setattr(graph_hooks, "QUIET_AHEAD", ahead)
        tokens, reqs = 4, 4
        engine, state, hooks, _, entry, wrapper = _graph_engine(monkeypatch, 4, 1, tokens, reqs)
        asked, chosen = [], []
        real = type(state)._step_wants_copies
        monkeypatch.setattr(type(state), "_step_wants_copies", lambda self, *a: (asked.append(a), real(self, *a))[1])
        calls = [0]
        graph_call = type(state).graph_call
        monkeypatch.setattr(type(state), "graph_call", lambda self, w: (calls.__setitem__(0, calls[0] + 1),
                                                                        graph_call(self, w))[1])
        for _ in range(40):
            _run_as_graph(engine, _padded(engine.common(), reqs=reqs, tokens=tokens), _padded_inputs(engine, tokens),
                          tokens, monkeypatch, wrapper=wrapper, through=through and ahead > 0)
            chosen.append(entry.cudagraph)
        monkeypatch.setattr(type(state), "graph_call", graph_call)
        assert {state._forward_counts[n] for n in engine.names} == {40}
        if through and ahead:  # the run's steps skipped the graph call's questions too
            assert calls[0] == len(asked) < 20
        hooks.close(state, 30)
        counts = dict(hooks.sentinel.counts)
        monkeypatch.setattr(type(state), "_step_wants_copies", real)
        vllm_plugin.unregister()
        return chosen, len(asked), counts

    ahead = graph_hooks.QUIET_AHEAD
    one_by_one, asked_each, counts_each = forty_steps(0)
    chosen, asked, counts = forty_steps(ahead)
    drawn = one_by_one.count("copies")
    assert chosen == one_by_one and 2 <= drawn <= 10
    assert asked_each == 40 and asked < 20  # most steps told ahead
    assert counts["checked"] == counts_each["checked"] == 4 * drawn and counts.get("failed", 0) == 0


class _ChecksInFlight:
    """Device checks still in the sentinel's worker: which layers' checks were collected, in order."""

    def __init__(self):
        self.collected = []

    def collect(self, name, timeout=None):
        self.collected.append(name)
        return None


@pytest.mark.parametrize("kind", ["record", "record_pieces"])
def test_checks_still_in_the_worker_are_collected_before_vllm_records_a_graph(sentinel_env, kind):
    """CUDA forbids, process-wide, a sync or an allocation while a stream captures: the sentinel's worker must be
    idle when vLLM starts recording a graph (or a piece of a piecewise one), right after the warm-up steps it may
    have sampled."""
    from kvdbg.vllm_plugin.wrappers import _wrap_graph_call
    from tests.test_vllm_plugin import _Batch

    monkeypatch, _ = sentinel_env
    vllm_plugin.register()
    StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=1).step()
    state, hooks = vllm_plugin._state, _hooks()
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    hooks._deferred = in_flight = _ChecksInFlight()
    hooks._waiting = {name: None for name in names}  # submitted on the warm-up step, not yet collected
    seen = []

    def vllm_records(wrapper):
        seen.append(list(in_flight.collected))
        return "recorded"

    monkeypatch.setattr(state, "graph_call", lambda wrapper: (kind, _Batch((8,))))
    assert _wrap_graph_call(state, vllm_records)(object()) == "recorded"
    assert seen == [names] and hooks._waiting == {}


class _StagedStandIn:
    def __init__(self):
        self.released = 0
        self.issued = []

    def release(self, issued=True):
        self.released += 1
        self.issued.append(issued)


def test_checks_of_staged_graph_steps_are_collected_when_done_and_never_waited_for(sentinel_env):
    """A staged step's check reads kvdbg's own copies, so the next replay does not wait for it: a check still
    running is left for a later hook, a finished one is recorded and its staging let go; only recording a graph,
    which needs the worker idle, waits for them."""
    import threading

    from kvdbg.sentinel.checker import CheckResult
    from kvdbg.vllm_plugin.sentinel_hooks import _Waiting

    vllm_plugin.register()
    StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=1, query_len=1).step()
    state, hooks = vllm_plugin._state, _hooks()

    class Job:
        def __init__(self):
            self.done, self.error = threading.Event(), None
            self.results = [CheckResult(layer="x", step=3, tolerance=None)]

    staged = [_StagedStandIn(), _StagedStandIn()]
    jobs = [Job(), Job()]
    hooks._staged = [_Waiting(None, None, None, None, None, None, None, None, None, 3, staged=st, job=job)
                     for st, job in zip(staged, jobs)]
    checked = hooks.sentinel.counts["checked"]
    jobs[1].done.set()
    hooks.before_graph_replay(state)  # the next replay: nothing is waited for
    assert [w.job for w in hooks._staged] == [jobs[0]] and hooks.sentinel.counts["checked"] == checked + 1
    assert [s.released for s in staged] == [0, 1]

    def finish_later():
        jobs[0].done.set()

    timer = threading.Timer(0.2, finish_later)
    timer.start()
    hooks.before_graph_replay(state, recording=True)  # vLLM about to record a graph: the worker must be idle
    timer.join()
    assert hooks._staged == [] and [s.released for s in staged] == [1, 1]
    assert hooks.sentinel.counts["checked"] == checked + 2


def test_a_checked_staging_is_let_go_with_no_event_unless_the_engine_read_it(sentinel_env, monkeypatch):
    """A done check's reads are done on the device (its worker or process synchronised first): its staging is let
    go without an event on the engine's stream (issued=False). A step found wrong is captured from the staging on
    the engine's stream, so that one is let go with the event (issued=True); one found wrong again, whose capture the
    sentinel does not admit (the same finding), and a check that failed read nothing more."""
    import threading

    from kvdbg.sentinel.checker import CheckResult, NonFinite
    from kvdbg.vllm_plugin.sentinel_hooks import _Waiting

    vllm_plugin.register()
    StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=1, query_len=1).step()
    state, hooks = vllm_plugin._state, _hooks()
    captured = []
    monkeypatch.setattr(hooks, "_capture", lambda state, finding, waiting: captured.append(finding.kind)
                        or len(captured) == 1)

    class Job:
        def __init__(self, result=None, error=None):
            self.done, self.error = threading.Event(), error
            self.results = [result]
            self.done.set()

    honest = CheckResult(layer="x", step=3, tolerance=None)
    wrong = CheckResult(layer="x", step=4, tolerance=None, nonfinite=NonFinite(2, 1, 0, 1, 0))
    jobs = [Job(honest), Job(wrong), Job(wrong), Job(error=RuntimeError("the check raised"))]
    staged = [_StagedStandIn() for _ in jobs]
    hooks._staged = [_Waiting(None, None, None, None, None, None, None, None, None, 3, staged=st, job=job)
                     for st, job in zip(staged, jobs)]
    hooks.poll_staged(state)
    assert hooks._staged == [] and captured == ["nonfinite", "nonfinite"]
    assert [s.issued for s in staged] == [[False], [True], [False], [False]]


@pytest.mark.parametrize("cache_layout", ["LBNHC", "BHLNC"])
def test_a_staged_graph_step_is_checked_through_the_caches_own_layout(sentinel_env, cache_layout):
    """vLLM hands a layer its cache as a permuted view, and a layout is named by its strides too: the staged
    pages lie in memory as the cache does, so the sentinel reads them through the same layout (a wrong step is
    caught and captured, a right one passes)."""
    from tests.test_vllm_plugin import _padded, _padded_inputs, _record_graph, _run_as_graph

    monkeypatch, directory = sentinel_env
    _wrong_head_2_of_layer_1(monkeypatch)
    vllm_plugin.register()
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, layers=2, query_len=2,
                           cache_layout=cache_layout)
    _record_graph(engine, 8, 4, monkeypatch)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=8), _padded_inputs(engine, 8), 8, monkeypatch)
    hooks = _hooks()
    assert hooks.sentinel.counts["errors"] == 0
    assert hooks.sentinel.counts["checked"] == 2 and hooks.sentinel.counts["failed"] == 1
    assert vllm_plugin._state._stager.staged == 1 and len(_files(directory)) == 1


def test_a_replay_told_quiet_goes_on_while_staged_checks_are_out_and_collects_those_done(sentinel_env):
    """Staged checks read kvdbg's own copies, which no replay overwrites: a replay told quiet ahead goes on while they
    are out (graph_hooks.quiet_replay), collecting those done; a check that reads the engine's memory stops it, for
    the replay's questions to collect first."""
    import threading
    import types

    from kvdbg.sentinel.checker import CheckResult

    vllm_plugin.register()
    state, hooks = vllm_plugin._state, _hooks()
    released = []
    job = types.SimpleNamespace(done=threading.Event(), error=None, results=None)
    waiting = types.SimpleNamespace(job=job, index=0, staged=types.SimpleNamespace(
        release=lambda issued=True: released.append(issued)))
    hooks._staged.append(waiting)
    assert hooks.quiet_replay_ready(state) and hooks._staged == [waiting] and released == []  # still out
    job.results = [CheckResult(layer="model.layers.0.self_attn.attn", step=3, tolerance=None)]
    job.done.set()
    assert hooks.quiet_replay_ready(state) and hooks._staged == [] and released == [False]  # collected, let go
    assert hooks.sentinel.counts["checked"] == 1
    hooks._waiting["model.layers.0.self_attn.attn"] = object()
    assert not hooks.quiet_replay_ready(state)
    hooks._waiting.clear()


class _Staged:
    """A staged step as the sentinel's hook reads it (graph_staging.StagedStep): its layers' copies, the pages each
    request holds, and holds counted."""

    rows = 4
    ready = None
    count = 3  # staged by a program of the host's: its counts known (one inside vLLM's graph: -1, the device's)

    def __init__(self, names, sized_fails=False):
        from types import SimpleNamespace

        import numpy as np

        self.layers = {n: SimpleNamespace(pages=f"pages:{n}", query=f"q:{n}", output=f"o:{n}", whole=None, stack=None)
                       for n in names}
        self.counts = np.array([1, 2])
        self.holds = self.sized_calls = 0
        self.sized_fails = sized_fails

    def sized(self):
        self.sized_calls += 1
        if self.sized_fails:
            raise RuntimeError("sized")

    def hold(self):
        self.holds += 1
        return self


class _Ctx:
    """A build's context as the hook reads it; ``host`` raises with ``host_fails``."""

    def __init__(self, tag, refused=None, host_fails=False):
        self.tag, self.refused, self.causal, self.host_fails = tag, refused, True, host_fails
        self.seq_lens, self.query_start_loc = f"lens {tag}", f"offsets {tag}"
        self.max_model_len, self.block_table = 64, None

    @property
    def host(self):
        if self.host_fails:
            raise RuntimeError("host")
        return None


@pytest.mark.parametrize("case", ["contexts A B A", "no context first", "host read fails", "layout refused",
                                  "nothing checkable"])
def test_a_staged_steps_layers_read_what_their_context_shares_once_and_each_fails_alone(case, tmp_path):
    """The sentinel's hook for a staged graph step (SentinelHooks.after_graph_replay with ``staged``): each layer's
    check carries its own build context's lengths; the pages per request are read once per step, and only for a
    layer that is checked; a context that cannot be read fails each of its layers (counted each, no staging held);
    a step with no context says so once; a layer whose cache layout is refused is left out quietly."""
    from types import SimpleNamespace as NS

    from kvdbg.sentinel.checker import Sentinel
    from kvdbg.sentinel.config import SentinelConfig
    from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

    names = ["l0", "l1", "l2"]
    a, b = _Ctx("A"), _Ctx("B")
    ctxs, refused, sized_fails = {
        "contexts A B A": ([a, b, a], set(), False),
        "no context first": ([None, a, a], set(), False),
        "host read fails": ([_Ctx("C", host_fails=True)] * 3, set(), False),
        "layout refused": ([a, a, a], {"l1"}, False),
        "nothing checkable": ([a, a, a], set(names), True),
    }[case]
    hooks = SentinelHooks(Sentinel(SentinelConfig(rate=1.0, directory=str(tmp_path))), capturer=None)
    said, failed, handed = [], [], []
    hooks._say_once = lambda key, message, level=logging.INFO: said.append(key)
    hooks._failed = lambda exc, where: failed.append(str(exc))
    hooks._check_staged = lambda state, batch, staged: handed.append(batch)
    state = NS(_info=lambda impl: NS(backend_name="TRITON_ATTN"),
               engine_layout=lambda impl, layer, info, kv: None if layer.layer_name in refused else "layout",
               capture_layer=lambda impl, layer, layout, dtype: NS(name=layer.layer_name), _declared={},
               capturer=NS(layer_refused=lambda name: None))
    hooks.sentinel.can_check = lambda target, backend: True
    staged = _Staged(names, sized_fails)
    # A layer whose layout is refused may have no output (a forward that returned none): never read for it.
    sampled = [(NS(impl="impl", layer=NS(layer_name=n), kv_cache="cache",
                   output=None if n in refused else NS(dtype="bf16"), checked=None), 7, ctx)
               for n, ctx in zip(names, ctxs)]
    hooks.after_graph_replay(state, sampled, staged)
    batch = handed[0] if handed else []
    assert staged.holds == len(batch) and len(handed) <= 1
    entries = [(w.layer.layer_name, w.inputs.seq_lens, w.inputs.max_pages, w.inputs.block_table) for w in batch]
    if case == "contexts A B A":
        assert entries == [("l0", "lens A", [1, 2], None), ("l1", "lens B", [1, 2], None),
                           ("l2", "lens A", [1, 2], None)]
        assert staged.sized_calls == 1 and not failed and not said
    elif case == "no context first":
        assert [e[0] for e in entries] == ["l1", "l2"] and said == ["metadata"] and not failed
    elif case == "host read fails":
        assert not batch and failed == ["host"] * 3 and staged.sized_calls == 0
    elif case == "layout refused":
        assert [e[0] for e in entries] == ["l0", "l2"] and not failed and not said
    else:
        assert not batch and not failed and staged.sized_calls == 0


def test_a_graph_layers_check_constants_are_worked_out_once_and_asked_again_when_what_decides_them_changes(
        tmp_path):
    """A staged step's layers: what each layer's check needs that stays from one replay to the next (its cache
    layout, its capture layer, whether the sentinel can check it) is asked once per slot of the recorded graph,
    the first step the sentinel draws on it; a later drawn step asks none of it. It is asked again for a layer whose
    quantisation scales or declaration changed, and for one the sentinel could not check (asked each step); a
    layer whose layout the engine's capture refused since is left out of the next step's checks, as the layout's
    own check leaves it out."""
    from types import SimpleNamespace as NS

    from kvdbg.sentinel.checker import Sentinel
    from kvdbg.sentinel.config import SentinelConfig
    from kvdbg.vllm_plugin.graph_hooks import GraphSlot
    from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

    names = ["l0", "l1", "l2", "l3"]
    refused: set = set()
    hooks = SentinelHooks(Sentinel(SentinelConfig(rate=1.0, directory=str(tmp_path))),
                          capturer=NS(layer_refused=lambda name: None))  # the sentinel's own: refuses nothing
    handed = []
    hooks._check_staged = lambda state, batch, staged: handed.append([w.layer.layer_name for w in batch])
    asked = []
    capturer = NS(layer_refused=lambda name: "unusable" if name in refused else None)  # the engine's capture

    def engine_layout(impl, layer, info, kv):  # as the plugin's: None for a layer capture refused
        asked.append(layer.layer_name)
        return None if capturer.layer_refused(layer.layer_name) else "layout"

    state = NS(_info=lambda impl: NS(backend_name="TRITON_ATTN"), engine_layout=engine_layout, capturer=capturer,
               capture_layer=lambda impl, layer, layout, dtype: NS(name=layer.layer_name),
               _declared={n: object() for n in names})
    hooks.sentinel.can_check = lambda target, backend: target.name != "l2"  # a layer its reference cannot model
    layers = {n: NS(layer_name=n, _q_scale_float=1.0, _k_scale_float=1.0, _v_scale_float=1.0) for n in names}
    slots = [GraphSlot(n, "impl", layers[n], "cache", "query", NS(dtype="bf16")) for n in names]
    ctx = _Ctx("A")

    def drawn(step, slots=slots):
        asked.clear()
        hooks.after_graph_replay(state, [(slot, step, ctx) for slot in slots], _Staged(names))
        return sorted(asked), handed[-1]

    assert drawn(0) == (names, ["l0", "l1", "l3"])
    assert drawn(1) == (["l2"], ["l0", "l1", "l3"])  # only the layer it cannot check is asked again
    layers["l1"]._k_scale_float = 0.5  # scales calibrated anew
    state._declared["l3"] = object()  # declared anew
    assert drawn(2) == (["l1", "l2", "l3"], ["l0", "l1", "l3"])
    refused.add("l0")
    assert drawn(3) == (["l2"], ["l1", "l3"])
    assert drawn(4) == (["l2"], ["l1", "l3"])
    # Another graph's slots of the same layers are asked for themselves
    others = [GraphSlot(n, "impl", layers[n], "cache", "query", NS(dtype="bf16")) for n in names]
    assert drawn(5, others) == (names, ["l1", "l3"])


@pytest.mark.parametrize("worker", ["none", "cuda", "cpu"])
def test_a_staged_step_of_a_cpu_cache_goes_to_a_worker_only_when_one_was_given_for_the_cpu(worker, tmp_path):
    """A staged step's checks on a CPU cache are checked in line, as they always were, even where the sentinel holds
    a device worker for a GPU (CUDA available beside a CPU engine); only a worker made for the CPU itself (the
    bench's stand-in rows and the tests' way into the checker process) is handed them."""
    from types import SimpleNamespace as NS

    import torch

    from kvdbg.sentinel.checker import Sentinel
    from kvdbg.sentinel.config import SentinelConfig
    from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

    hooks = SentinelHooks(Sentinel(SentinelConfig(rate=1.0, directory=str(tmp_path))), capturer=None)
    inline, submitted, released = [], [], []
    hooks.sentinel.check_layers = lambda entries, step: inline.append(len(entries)) or []
    if worker != "none":
        hooks._deferred = NS(device=torch.device(worker, 0) if worker == "cuda" else torch.device("cpu"),
                             submit_staged=lambda entries, step, ready, host_ready: submitted.append(len(entries))
                             or NS())
    staged = NS(ready=None, release=lambda issued=True: released.append(issued))
    batch = [NS(cache=torch.zeros(1), ctx=NS(host=None), target=f"t{i}", inputs=f"i{i}", step=3, staged=staged)
             for i in range(2)]
    hooks._check_staged(None, batch, staged)
    if worker == "cpu":
        assert submitted == [2] and not inline and len(hooks._staged) == 2 and not released
    else:
        assert inline == [2] and not submitted and not hooks._staged and released == [True, True]
