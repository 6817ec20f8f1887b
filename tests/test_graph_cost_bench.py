"""bench/graph_cost.py on the CPU: its figures and verdict from made-up records, the variables each engine gets,
and its timing wrappers around kvdbg's graph hooks on the vLLM stand-ins (the engines themselves need a GPU)."""

from __future__ import annotations

import importlib.util
import os
import random
import statistics
import time
import types

import pytest
import torch

from kvdbg import vllm_plugin
from kvdbg.capture.config import CaptureConfig
from kvdbg.sentinel.config import SentinelConfig
from tests.helpers import ROOT
from tests.test_vllm_plugin import (  # noqa: F401  (fixtures)
    StandinEngine, _padded, _padded_inputs, _record_graph, _run_as_graph, clean, enable, snapshots, standins
)


def _load_bench():
    spec = importlib.util.spec_from_file_location("graph_cost", os.path.join(ROOT, "bench", "graph_cost.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gc = _load_bench()


def _step(wall_ms, graph_ms=2.0, hooks_us=10.0, replays=1, **extra):
    return {"wall_ns": int(wall_ms * 1e6), "replays": replays, "graph_ms": [graph_ms] * replays,
            "hooks": {"after_graph_replay": int(hooks_us * 1e3)}, "inner": {}, **extra}


def _round(wall_ms, graph_ms=2.0, hooks_us=10.0, steps=40):
    prefill = _step(30.0, replays=0, hooks_us=0)
    return gc.summarize_round([prefill] + [_step(wall_ms, graph_ms, hooks_us) for _ in range(steps)])


def test_a_round_is_its_decode_steps_without_the_prefill_and_the_edges():
    steps = [_step(30.0, replays=0)] + [_step(100.0)] * 2 + [_step(5.0)] * 20 + [_step(100.0)] * 2
    summary = gc.summarize_round(steps)
    assert summary["decode_steps"] == 20 and summary["step_ms"] == pytest.approx(5.0)
    assert summary["hooks_us"] == pytest.approx(10.0) and summary["graph_ms"] == pytest.approx(2.0)


def test_a_wanted_step_is_measured_against_the_rounds_other_decode_steps():
    steps = [_step(30.0, replays=0)] + [_step(5.0, replayed_step=i) for i in range(1, 40)]
    steps[20] = _step(7.0, hooks_us=1510.0, replayed_step=20, copied=True, captured_bytes=8 * 2**20, captures=8,
                      device={"engine_ms": 0.4, "side_ms": 3.0, "device_caught_up": False})
    steps[21] = _step(6.0, replayed_step=21)  # the writer's share of the next step
    w = gc.summarize_wanted(steps, 20)
    assert w["copied"] and w["hooks_added_us"] == pytest.approx(1500.0)
    assert w["step_added_ms"] == pytest.approx(2.0) and w["following_added_ms"] == pytest.approx(1.0)
    assert w["device"]["span_ms"] == 3.0 and w["captured_bytes"] == 8 * 2**20
    assert not gc.summarize_wanted(steps, 99)["found"]


def _records(armed_ms=5.05, sentinel_ms=5.02, hooks_added=1500.0, span_ms=3.0, nbytes=100e6, gb_s=50.0):
    wanted = [{"role": "warm-up", "hooks_added_us": 30000.0}]
    wanted += [{"role": "engine", "hooks_added_us": hooks_added, "step_added_ms": 1.6, "captured_bytes": nbytes}
               for _ in range(3)]
    wanted += [{"role": "device", "captured_bytes": nbytes,
                "device": {"engine_ms": 0.5, "side_ms": span_ms, "span_ms": span_ms, "device_caught_up": False}}]
    return {
        "baseline": {"problems": [], "phases": {"rounds": [_round(5.0) for _ in range(4)]}},
        "capture": {"problems": [], "phases": {"armed": [_round(armed_ms, hooks_us=12.0) for _ in range(4)],
                                               "wanted": wanted, "d2h": {"gb_s": gb_s}}},
        "sentinel": {"problems": [], "phases": {"rounds": [_round(sentinel_ms) for _ in range(4)]},
                     "sentinel_counts": {"checked": 30}},
        "hooks": {"problems": [], "rows": []},
        "baseline2": {"problems": [], "phases": {"rounds": [_round(5.1, graph_ms=2.02) for _ in range(4)]}},
    }


def test_the_three_figures_against_their_lines():
    records = _records()
    figs = gc.figures(records)
    # The baseline is both kvdbg-absent engines pooled: rounds of 5.0 and 5.1 ms, median 5.05.
    assert figs["armed"]["ratio"] == pytest.approx(1.0) and figs["armed"]["met"]
    assert figs["sentinel"]["ratio"] == pytest.approx(5.02 / 5.05) and figs["sentinel"]["met"]
    assert figs["baseline_drift"]["ratio"] == pytest.approx(5.1 / 5.0)
    assert figs["baseline_drift_graph"]["ratio"] == pytest.approx(2.02 / 2.0)
    assert figs["wanted_engine"]["added_us"]["median"] == 1500.0 and not figs["wanted_engine"]["met"]
    # 100 MB at 50 GB/s: 2 ms; the copies took 3 ms on the device.
    assert figs["wanted_device"]["ratio"]["median"] == pytest.approx(1.5) and figs["wanted_device"]["met"]
    code, problems, over = gc.verdict(list(gc.PARTS), records, figs)
    assert (code, problems, over) == (1, [], ["wanted_engine"])


def test_thread_times_put_each_hooks_cpu_time_beside_its_wall_time():
    """--thread-times: a round's hooks, and a wanted step's over the round's others, in the engine's thread's CPU
    time too, so that a hook that waited (wall far over CPU) is told from one that ran; none without."""
    def timed(wall_ms, hook_us, cpu_us, **extra):
        return _step(wall_ms, hooks_us=hook_us, thread={"after_graph_replay": {"cpu_ns": int(cpu_us * 1e3),
                                                                                "switches": 0}}, **extra)

    steps = [_step(30.0, replays=0, hooks_us=0)] + [timed(5.0, 10.0, 4.0, replayed_step=i) for i in range(1, 40)]
    steps[20] = timed(6.0, 90.0, 24.0, replayed_step=20, copied=True, captured_bytes=2**20, captures=8)
    rnd = gc.summarize_round(steps)
    assert rnd["hooks_us_mean_by_name"]["after_graph_replay"] > rnd["hooks_cpu_us_mean_by_name"]["after_graph_replay"]
    assert rnd["hooks_cpu_us_mean_by_name"]["after_build"] == 0.0
    w = gc.summarize_wanted(steps, 20)
    assert w["hooks_added_by_name_us"]["after_graph_replay"] == pytest.approx(80.0)
    assert w["hooks_cpu_added_by_name_us"]["after_graph_replay"] == pytest.approx(20.0)
    assert "after_graph_replay" not in w["thread"]  # the parts' table holds parts only
    records = _records()
    for x in records["capture"]["phases"]["wanted"]:
        if x["role"] == "engine":
            x["hooks_cpu_added_by_name_us"] = w["hooks_cpu_added_by_name_us"]
    records["sentinel"]["phases"]["rounds"] = [rnd] * 4
    figs = gc.figures(records)
    assert figs["wanted_engine"]["hooks_cpu_added_by_name_us"]["after_graph_replay"]["median"] == pytest.approx(20.0)
    assert figs["sentinel"]["hooks_cpu_us_mean_by_name"]["after_graph_replay"] == pytest.approx(
        rnd["hooks_cpu_us_mean_by_name"]["after_graph_replay"])
    assert "hooks_cpu_us_mean_by_name" not in figs["armed"]  # its rounds ran without --thread-times
    assert "hooks_cpu_us_mean_by_name" not in gc.summarize_round([_step(5.0)] * 20)


def test_a_staged_steps_device_figure_is_the_devices_work_not_the_capture_threads_host_time():
    """A staged step: the program, the copies issued ahead and the later reads are the device's work; the span up to
    the capture thread's last issue also holds the thread's host time (its stream idle) and is printed, not judged."""
    steps = [_step(30.0, replays=0)] + [_step(5.0, replayed_step=i) for i in range(1, 40)]
    steps[20] = _step(7.0, hooks_us=400.0, replayed_step=20, copied=True, captured_bytes=100e6, captures=8,
                      device={"engine_ms": 0.4, "side_ms": 25.0, "copies_ms": 2.2, "reads_ms": 0.05, "reads": 2,
                              "device_caught_up": False, "staged": True})
    w = gc.summarize_wanted(steps, 20)
    assert w["device"]["span_ms"] == pytest.approx(25.4)
    assert w["device"]["work_ms"] == pytest.approx(0.4 + 2.2 + 0.05)
    records = _records()
    records["capture"]["phases"]["wanted"][-1] = {**w, "role": "device"}
    f = gc.figures(records)["wanted_device"]
    # 100 MB at 50 GB/s: 2 ms, against 2.65 ms of the device's work.
    assert f["judged_on"] == "work" and f["ratio"]["median"] == pytest.approx(2.65 / 2.0) and f["met"]
    assert f["span_ms"]["median"] == pytest.approx(25.4)
    # Each copy issued ahead timed alone: their own time, not the gaps where the device waited for the thread.
    steps[20]["device"] = {**steps[20]["device"], "copies_ms": 3.1, "copies_busy_ms": 2.2, "device_caught_up": True}
    records["capture"]["phases"]["wanted"][-1] = {**gc.summarize_wanted(steps, 20), "role": "device"}
    f = gc.figures(records)["wanted_device"]
    assert f["judged_on"] == "work" and f["ratio"]["median"] == pytest.approx(2.65 / 2.0)
    assert f["copies_ms"]["median"] == 3.1 and f["copies_busy_ms"]["median"] == 2.2
    # Copies not issued ahead (no mark after them): the span is all the run can tell, and it is judged.
    steps[20]["device"] = {**steps[20]["device"], "copies_ms": None, "copies_busy_ms": None}
    records["capture"]["phases"]["wanted"][-1] = {**gc.summarize_wanted(steps, 20), "role": "device"}
    f = gc.figures(records)["wanted_device"]
    assert f["judged_on"] == "span" and f["ratio"]["median"] == pytest.approx(25.4 / 2.0) and not f["met"]


def test_the_wanted_steps_capture_thread_time_is_split_into_its_parts():
    """Where a wanted step's wait goes: the medians of the capture thread's parts over the timed steps."""
    records = _records()
    parts = [{"begin": 9000.0, "metadata_wait": 6000.0, "buffer_take": 2000.0, "gather": 2500.0},
             {"begin": 5000.0, "metadata_wait": 1000.0, "gather": 3000.0},
             {"begin": 7000.0, "metadata_wait": 4000.0, "buffer_take": 100.0, "gather": 2000.0}]
    engine = [w for w in records["capture"]["phases"]["wanted"] if w["role"] == "engine"]
    for w, inner in zip(engine, parts):
        w["inner_us"] = inner
    inner = gc.figures(records)["wanted_engine"]["inner_us"]
    assert set(inner) == {"begin", "metadata_wait", "buffer_take", "gather"}
    assert inner["metadata_wait"]["median"] == 4000.0 and inner["metadata_wait"]["n"] == 3
    assert inner["buffer_take"]["n"] == 2  # a step that took no buffer has no such part


def test_thread_times_tell_a_part_that_waited_from_one_that_ran():
    """--thread-times: an engine-thread part's wall time beside its thread CPU time and voluntary switches (a
    part that sleeps waited: little CPU, a switch; one that spins ran: CPU near its wall time); others as ever."""
    import time

    timing = gc.Timing(thread_times=True)
    timing.current = record = gc._new_step()

    def spin(seconds):  # until the thread has run that long (a loaded machine only stretches its wall time)
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    gc._timed(timing, "stage", time.sleep, "inner")(0.02)
    gc._timed(timing, "metadata_copy", spin, "inner")(0.02)
    gc._timed(timing, "begin", time.sleep, "inner")(0.02)  # the capture thread's: timed the same way
    gc._timed(timing, "buffer_take", time.sleep, "inner")(0.001)  # neither thread's timed part: wall time only
    assert record["inner"]["stage"] >= 20e6 and record["thread"]["stage"]["cpu_ns"] < 5e6
    assert record["thread"]["stage"]["switches"] >= 1
    assert record["inner"]["metadata_copy"] >= 20e6
    assert set(record["thread"]) == {"stage", "metadata_copy", "begin"}
    assert record["thread"]["metadata_copy"]["cpu_ns"] >= 20e6 and record["thread"]["begin"]["cpu_ns"] < 5e6
    assert "buffer_take" in record["inner"] and not gc.Timing().thread_times

    records = _records()
    engine = [w for w in records["capture"]["phases"]["wanted"] if w["role"] == "engine"]
    for w, (wall, cpu, switches) in zip(engine, [(280.0, 70.0, 9), (300.0, 80.0, 11), (260.0, 75.0, 8)]):
        w["inner_us"], w["thread"] = {"stage": wall}, {"stage": {"cpu_us": cpu, "switches": switches}}
    thread = gc.figures(records)["wanted_engine"]["thread"]["stage"]
    assert (thread["wall_us"]["median"], thread["cpu_us"]["median"], thread["switches"]["median"]) == (280, 75, 9)
    assert gc.figures(_records())["wanted_engine"]["thread"] == {}  # a run without --thread-times
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        gc.print_figures(gc.figures(records), records)
    assert "stage on the engine's thread (medians): wall 280 us, on the CPU 75 us (27%), voluntary switches 9" \
        in out.getvalue()


def test_every_line_met_exits_0_and_a_failed_part_exits_2():
    records = _records(hooks_added=40.0)
    parts = list(gc.PARTS)
    assert gc.verdict(parts, records, gc.figures(records))[0] == 0
    records["sentinel"] = {"problems": ["stopped: RuntimeError('x')"]}
    code, problems, _ = gc.verdict(parts, records, gc.figures(records))
    assert code == 2 and "sentinel: stopped: RuntimeError('x')" in problems
    assert "sentinel: the figure sentinel could not be computed" in problems
    del records["baseline2"]
    assert "baseline2: no record" in gc.verdict(parts, records, gc.figures(records))[1]
    records = _records(hooks_added=40.0)
    records["baseline2"] = {"problems": [], "skipped": "skipped: 40 s of the budget left, ~70 s needed"}
    assert gc.verdict(parts, records, gc.figures(records))[0] == 0  # the figures stand on the first baseline


def test_over_a_line_is_said(capsys):
    records = _records(armed_ms=5.2, sentinel_ms=5.2, hooks_added=10.0, span_ms=4.0)
    records["hooks"]["rows"] = [{"mode": "armed", "layers": 8, "after_build_us": 3.7, "replay_hooks_us": 3.9,
                                 "per_layer_us": 0.95},
                                {"mode": "wanted", "layers": 8, "after_build_us": 9.0, "replay_hooks_us": 10.0,
                                 "per_layer_us": 2.4, "added_us": 12.5, "staged_in_graph": 2300,
                                 "by_hook_us": {"after_build": 9.0, "replay": 10.0},
                                 "unwanted_by_hook_us": {"after_build": 2.5, "replay": 4.0}}]
    figs = gc.figures(records)
    assert not figs["armed"]["met"] and not figs["sentinel"]["met"] and not figs["wanted_device"]["met"]
    assert figs["wanted_engine"]["met"]
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "armed     step 5.200 ms vs 5.050 ms: 1.0297x" in out and "line <= 1.02x: MISSED" in out
    assert "wanted step, engine's thread: +10 us" in out and "line <= 50 us: met" in out
    assert "wanted step, device: 4.00 ms against 2.00 ms for its bytes at 50.0 GB/s: 2.0000x" in out
    assert "stand-ins, armed      8 layers" in out
    assert "stand-ins, wanted     8 layers: after_build 9.0 us" in out
    assert "12.5 us over an unwanted step (build 6.5, replay 6.0;" in out


def test_armed_and_sentinel_are_judged_on_rounds_paired_in_their_own_process(capsys):
    """Two processes of the same engine differ by more than the 1-2 % lines (baseline_drift): a line is judged on
    the ratio of each round with kvdbg to its paired round with kvdbg's patches off, in the same process, times
    the most kvdbg's recorded graph copies can add (the graph's device time over the kvdbg-absent engine's)."""
    records = _records(armed_ms=5.6, sentinel_ms=5.6)  # 11 % over the other process: its drift, not kvdbg
    records["baseline"]["phases"]["rounds"] = [_round(5.0, graph_ms=2.0) for _ in range(4)]
    records["baseline2"]["phases"]["rounds"] = [_round(5.0, graph_ms=2.0) for _ in range(4)]
    records["capture"]["phases"]["armed"] = [_round(5.6 + 0.01 * i, graph_ms=2.02) for i in range(4)]
    records["capture"]["phases"]["bypassed"] = [_round(5.56 + 0.01 * i, graph_ms=2.02, hooks_us=0) for i in range(4)]
    records["sentinel"]["phases"]["rounds"] = [_round(5.7, graph_ms=2.02) for _ in range(4)]
    records["sentinel"]["phases"]["bypassed"] = [_round(5.5, graph_ms=2.02, hooks_us=0) for _ in range(4)]
    records["capture"]["interleaved_block"] = records["sentinel"]["interleaved_block"] = 8
    figs = gc.figures(records)
    armed, sentinel = figs["armed"], figs["sentinel"]
    assert armed["ratio"] == pytest.approx(5.615 / 5.0)  # across processes: far over the line
    host = statistics.median((5.6 + 0.01 * i) / (5.56 + 0.01 * i) for i in range(4))
    assert armed["paired"]["host"]["median"] == pytest.approx(host) and armed["paired"]["pairs"] == 4
    assert armed["paired"]["device"] == pytest.approx(1 + 0.02 / 5.0)  # 20 us of copies against a 5 ms step
    assert armed["paired"]["ratio"] == pytest.approx(host * 1.004)
    assert armed["judged_on"] == "paired" and armed["met"]  # 1.0111x
    assert sentinel["judged_on"] == "paired" and not sentinel["met"]  # 5.7 / 5.5: kvdbg's own cost, 3.6 %
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "armed     paired in its process (4 rounds, kvdbg's patches on and off by blocks of 8 steps): 1.0072x" in out
    assert "x 1.0040 (kvdbg's graph copies, at most) = 1.0112x; judged on the paired figure" in out
    # Without paired rounds (--no-paired, or an older record): judged across processes, as before.
    del records["capture"]["phases"]["bypassed"]
    figs = gc.figures(records)
    assert figs["armed"]["judged_on"] == "processes" and not figs["armed"]["met"]
    assert figs["armed"]["paired"] == {}


def test_the_sentinels_paired_rounds_are_told_apart_by_the_steps_drawn_in_their_kvdbg_half(capsys):
    """The sentinel's draws fall in few rounds: the rounds with none drawn say what its quiet steps cost, those
    with one what a draw adds; grouped by the draws of each round's kvdbg half, a mean each."""
    records = _records()
    rounds = [_round(5.5 + 0.1 * drawn) for drawn in (0, 1, 0, 2, 1)]
    for r, drawn in zip(rounds, (0, 1, 0, 2, 1)):
        r["drawn_split"] = {"drawn": drawn, "steps": 40}
    records["sentinel"]["phases"]["rounds"] = rounds
    records["sentinel"]["phases"]["bypassed"] = [_round(5.5, hooks_us=0) for _ in range(5)]
    records["sentinel"]["interleaved_block"] = 8
    by = gc.figures(records)["sentinel"]["paired"]["by_draws"]
    assert list(by) == ["0", "1", "2"] and [v["rounds"] for v in by.values()] == [2, 2, 1]
    assert by["0"]["mean"] == pytest.approx(1.0) and by["1"]["mean"] == pytest.approx(5.6 / 5.5)
    gc.print_figures(gc.figures(records), records)
    out = capsys.readouterr().out
    assert "its paired rounds by the steps drawn in their kvdbg half (the draws are seeded: the same each run): " \
           "0 drawn: 1.0000x (2 rounds, mean), 1 drawn: 1.0182x (2 rounds, mean), 2 drawn: 1.0364x (1 round, mean)" \
        in out
    # The capture's armed rounds draw nothing: no such line.
    records["capture"]["phases"]["bypassed"] = [_round(5.5, hooks_us=0) for _ in range(4)]
    assert "by_draws" not in gc.figures(records)["armed"].get("paired", {})


def test_a_paired_figure_says_whether_its_rounds_can_tell_met_from_missed(capsys):
    """Rounds that vary by several percent around a 1 % line cannot tell met from missed: the figure's bootstrap
    interval (seeded, the same for the same rounds) is printed with its side of the line, beside the verdict, which
    stays the figure's own."""
    records = _records()
    # The sentinel: rounds 0.97x to 1.05x, mean 1.01x: the line inside the interval.
    ratios = [0.97, 1.05, 0.99, 1.03, 1.00, 1.02, 0.98, 1.04]
    records["sentinel"]["phases"]["rounds"] = [_round(5.0 * r) for r in ratios]
    records["sentinel"]["phases"]["bypassed"] = [_round(5.0, hooks_us=0) for _ in ratios]
    # Capture armed: every round 1.001x to 1.003x, under its 1.02x line.
    records["capture"]["phases"]["armed"] = [_round(5.0 * (1.001 + 0.0005 * (i % 5))) for i in range(8)]
    records["capture"]["phases"]["bypassed"] = [_round(5.0, hooks_us=0) for _ in range(8)]
    records["capture"]["interleaved_block"] = records["sentinel"]["interleaved_block"] = 8
    figs = gc.figures(records)
    sentinel, armed = figs["sentinel"], figs["armed"]
    lo, hi = sentinel["paired"]["interval"]
    assert lo < statistics.fmean(ratios) < hi and lo <= gc.SENTINEL_LINE < hi
    assert sentinel["resolved"] is False
    assert armed["resolved"] is True and armed["met"] and armed["paired"]["interval"][1] <= gc.ARMED_LINE
    assert gc.figures(records)["sentinel"]["paired"]["interval"] == [lo, hi]  # seeded
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "sentinel  its 95% interval (the rounds resampled): " in out
    assert "the line is inside it: these rounds cannot tell met from missed" in out
    assert "wholly under the line" in out
    # Every round over the line: resolved, and missed.
    records["sentinel"]["phases"]["rounds"] = [_round(5.0 * (r + 0.1)) for r in ratios]
    figs = gc.figures(records)
    assert figs["sentinel"]["resolved"] is True and not figs["sentinel"]["met"]
    # Under 4 rounds: no interval, nothing said of it.
    assert gc.interval([1.0, 1.1, 1.2], statistics.fmean) is None
    # kvdbg's graph copies add to the absent engines' graph (2.0 and 2.02 ms, median 2.01) against their step (5.0
    # and 5.1 ms, median 5.05): the interval is the rounds' times that factor.
    records["sentinel"]["phases"]["rounds"] = [_round(5.0 * r, graph_ms=2.05) for r in ratios]
    records["sentinel"]["phases"]["bypassed"] = [_round(5.0, graph_ms=2.05, hooks_us=0) for _ in ratios]
    paired = gc.figures(records)["sentinel"]["paired"]
    device = 1 + (2.05 - 2.01) / 5.05
    assert paired["device"] == pytest.approx(device)
    assert paired["interval"] == pytest.approx([lo * device, hi * device])
    assert paired["host"]["interval"] == pytest.approx([lo, hi])
    # The percentiles' ranks are symmetric at any level: at 80 %, of 10 resamples the 2nd and the 9th.
    rng = random.Random(0)
    firsts = sorted([rng.randrange(100) for _ in range(100)][0] for _ in range(10))
    assert gc.interval(list(range(100)), lambda v: v[0], resamples=10, level=0.8) == [firsts[1], firsts[8]]


class _Switches:
    """A stand-in for Bypass: kvdbg's patches as a flag, every swap counted, and its plugin state's background
    work let finish (``settle``) counted among the swaps."""

    def __init__(self):
        self.patched, self.swaps = True, []
        switches = self

        class State:
            sentinel = None

            def drain_graph_capture(self, timeout):
                switches.swaps.append("settle")
                return True

        self.state = State()

    def on(self):
        self.patched = True
        self.swaps.append("on")

    def off(self):
        self.patched = False
        self.swaps.append("off")


def test_kvdbgs_patches_switch_by_blocks_within_a_round_before_each_steps_clock():
    """The host's speed drifts from one round to the next by more than the armed and sentinel lines (1.2-1.5x on
    the H200), so kvdbg's patches go off and on within a round, by blocks in the order on, off, off, on; each step
    runs with the patches its record says, set before its clock starts, and swapped only where the kind changes;
    before they go off, kvdbg's background work is let finish (a sentinel check reads buffers the graph's
    recorded copies rewrite on every replay, patched or not)."""
    switches = _Switches()

    class Engine:
        def __init__(self):
            self.seen = []

        def step(self):
            self.seen.append(switches.patched)

    engine, timing = Engine(), gc.Timing()
    timing.install_steps(engine)
    timing.recording, timing.steps = True, []
    interleave = timing.switch = gc.Interleave(switches, 2)
    for _ in range(10):
        engine.step()
    interleave.end()
    kinds = [s["kvdbg"] for s in timing.steps]
    assert kinds == [True, True, False, False, False, False, True, True, True, True]
    assert engine.seen == kinds  # each step ran as its record says
    assert [s["block_first"] for s in timing.steps] == [i in (2, 6) for i in range(10)]  # where the kind changed
    assert switches.swaps == ["settle", "off", "on", "on"] and switches.patched  # no swap within a kind
    interleave = gc.Interleave(switches, 8)
    interleave(8)
    interleave.end()  # a round ending in an off block leaves the patches on
    assert switches.swaps[-3:] == ["settle", "off", "on"] and switches.patched

    def failing_off():
        raise RuntimeError("a swap failed halfway")

    switches.off = failing_off
    interleave = timing.switch = gc.Interleave(switches, 1)  # step 10 of the round: an off block
    with pytest.raises(RuntimeError):
        engine.step()  # the switch to off fails: no record left half made
    assert timing.current is None and len(timing.steps) == 10
    interleave.end()
    assert switches.patched


def test_an_interleaved_round_splits_into_its_steps_with_kvdbg_and_without():
    """The decode window (no prefill, the two first and two last steps left out) split by kind, the first step of
    each block left out (the batch queue still holds a step of the other kind); the halves' ratio is the paired
    figure of that round."""
    steps = [_step(30.0, replays=0, kvdbg=True, block_first=False)]
    for i in range(1, 33):
        on = ((i // 4) % 4) in (0, 3)
        steps.append(_step(5.5 if on else 5.0, hooks_us=10.0 if on else 0.0, kvdbg=on,
                           block_first=on != steps[-1]["kvdbg"]))
    steps[4]["wall_ns"] = steps[12]["wall_ns"] = int(50e6)  # where the kind changed: the other kind's still queued
    with_kvdbg, without = gc.split_interleaved(steps)
    window = gc.decode_window(steps)
    assert len(with_kvdbg) + len(without) == len([s for s in window if not s["block_first"]])
    assert all(s["kvdbg"] for s in with_kvdbg) and not any(s["kvdbg"] for s in without)
    assert with_kvdbg and without and not any(s["block_first"] for s in with_kvdbg + without)
    on, off = gc.summarize_round(with_kvdbg, with_kvdbg), gc.summarize_round(without, without)
    assert on["step_ms"] == pytest.approx(5.5) and off["step_ms"] == pytest.approx(5.0)
    assert off["hooks_us_max"] == 0
    base = [_round(5.0) for _ in range(2)]
    paired = gc.paired_figure([on, on], [off, off], {"value": 2.0, "baseline": 2.0}, base, 4)
    assert paired["host"]["median"] == pytest.approx(1.1) and paired["block"] == 4 and paired["ratio"] == \
        pytest.approx(1.1)


def test_the_bypass_swaps_kvdbgs_patches_for_vllms_originals_and_back(standins, tmp_path, monkeypatch):
    """A round with kvdbg's patches off runs vLLM's own methods (no kvdbg hook, no count, nothing lent on vLLM's
    objects); on again, kvdbg's; and between rounds the bench lets kvdbg's background work finish (a wanted step's
    capture), untimed."""
    from kvdbg.vllm_plugin import vllm_facts  # noqa: F401  (the stand-ins' vLLM is loaded)

    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch)
    try:
        state = vllm_plugin._state
        builder_cls = type(engine.builder)
        wrapped = builder_cls.__dict__["build"]
        bypass = gc.Bypass(state)
        assert bypass.items and all(attr not in gc.Bypass.KEPT for _, attr, *_ in bypass.items)
        with state._lending:  # as a quiet run lends it (graph_hooks._lend_builders): taken back with the patches
            assert state._lend(engine.builder, "build") and "build" in vars(engine.builder)
        bypass.off()
        assert builder_cls.build is wrapped._kvdbg_original and "build" not in vars(engine.builder)
        counts = dict(state._forward_counts)
        timing.current = record = gc._new_step()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        assert record["hooks"].get("after_build", 0) == 0  # the build ran without kvdbg's hook
        bypass.on()
        assert builder_cls.__dict__["build"] is wrapped
        record = timing.current = gc._new_step()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        assert record["hooks"]["after_build"] > 0
        assert all(state._forward_counts[n] >= counts.get(n, 0) + 1 for n in engine.names)
        timing.current = None
        # settle: a wanted step's capture, slow on the capture thread, is done before settle returns.
        import time as clock

        from kvdbg.util.ranges import IntRanges

        jobs, slow = [], state.start_capture
        monkeypatch.setattr(state, "start_capture", lambda *a, **k: (clock.sleep(0.2), slow(*a, **k))[1])
        hand_over = state._hand_over
        monkeypatch.setattr(state, "_hand_over", lambda job: (jobs.append(job), hand_over(job))[1])
        vllm_plugin.active_capturer().reconfigure(steps=IntRanges.of(state._forward_counts[engine.names[0]],
                                                                     "steps"))
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        assert len(jobs) == 1 and not jobs[0].finished.is_set()
        gc.settle(state)
        assert jobs[0].finished.is_set()
    finally:
        timing.restore()


def test_each_engine_gets_variables_kvdbg_reads_as_meant(tmp_path):
    capture = gc.kind_environment("capture", str(tmp_path))
    config = CaptureConfig.from_env(capture)
    assert config.steps is not None and gc.UNREACHED_STEP in config.steps and 10**6 not in config.steps
    assert config.max_snapshots is None and config.max_bytes is None and config.background
    sentinel = gc.kind_environment("sentinel", str(tmp_path))
    assert "KVDBG_CAPTURE_DIR" not in sentinel
    assert SentinelConfig.from_env(sentinel).rate == pytest.approx(0.01)
    absent = gc.kind_environment("absent", str(tmp_path))
    assert not any(k.startswith("KVDBG_") for k in absent)
    assert "kvdbg" not in absent["VLLM_PLUGINS"].split(",")  # vLLM loads every plugin but kvdbg's
    for env in (capture, sentinel, absent):
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core in the bench's process


def test_the_engine_fits_a_round_and_prefills_it_in_one_step():
    sizes = gc.engine_sizes(64, 128, 128)
    assert sizes["max_model_len"] >= 128 + 128 and sizes["max_model_len"] % 16 == 0
    assert sizes["max_num_batched_tokens"] >= 64 * 128 and sizes["max_num_seqs"] == 64
    assert sizes["num_gpu_blocks_override"] >= 64 * -(-(128 + 128) // 16)
    config = gc.model_config(8)
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"]) == (8, 4096, 32, 8, 128)


def _armed_graph_engine(standins, tmp_path, monkeypatch, thread_times=False):
    """Capture armed (no step wanted yet), the bench's wrappers installed, and a stand-in engine of 2 layers
    whose 16-token full graph is recorded: (timing, engine); the caller restores ``timing``."""
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS=str(gc.UNREACHED_STEP))
    timing = gc.Timing(thread_times=thread_times)
    timing.install_kvdbg()
    try:
        engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
        _record_graph(engine, 16, 4, monkeypatch)
    except BaseException:
        timing.restore()
        raise
    return timing, engine


def _replaced_by_the_bench():
    from kvdbg.capture.buffers import HostBuffers, HostCopiesReady, StepCopies
    from kvdbg.capture.capturer import Capturer

    return [(owner, name, owner.__dict__[name]) for owner, name in
            ((Capturer, "begin"), (Capturer, "finish"), (HostCopiesReady, "synchronize"), (HostBuffers, "take"),
             (StepCopies, "gather"))]


@pytest.mark.parametrize("thread_times", [False, True])
def test_the_wrappers_time_kvdbgs_graph_hooks_and_count_a_wanted_steps_bytes(standins, tmp_path, monkeypatch,
                                                                             thread_times):
    """The bench's wrappers on the real plugin (vLLM stand-ins, CPU): hooks timed per step, the replayed step
    and whether it was copied, the captured bytes (counted by the graph capture thread into the step that handed
    it over); with --thread-times the staging program's thread CPU time too; then everything put back."""
    from kvdbg.util.ranges import IntRanges
    from kvdbg.vllm_plugin import state as plugin_state

    before = {name: plugin_state._PluginState.__dict__.get(name) for name in gc.KVDBG_HOOKS}
    replaced_before = _replaced_by_the_bench()
    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch, thread_times)
    try:
        records = []
        for step in range(3):
            if step == 2:
                vllm_plugin.active_capturer().reconfigure(steps=IntRanges.of(2, "steps"))
            timing.current = gc._new_step()
            _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                          monkeypatch)
            records.append(timing.current)
            timing.current = None
        assert vllm_plugin._state.drain_graph_capture(10)  # the capture thread done with the handed step
        assert [r["replayed_step"] for r in records] == [0, 1, 2]
        assert [r["copied"] for r in records] == [False, False, True]
        assert all(r["hooks"]["after_build"] > 0 and r["hooks"]["after_graph_replay"] > 0 for r in records)
        assert records[2]["captures"] == 2 and records[2]["captured_bytes"] > 12 * 4 * 16 * 2  # pages too
        # the capture's parts (on a CPU no metadata event and no pooled buffer: begin, finish, the pages' gather,
        # the staged metadata's read) and the engine's thread's part of it: the staging program (the build copied
        # nothing: the program staged its metadata)
        # (the program's run within the stage: its copy, launch and event apart from the stage's own Python)
        # (and the program made for the first staged step: a drawn step's split says so)
        assert set(records[2]["inner"]) == {"begin", "finish", "gather", "metadata_read", "stage", "program_run",
                                            "program_new"} and not records[0]["inner"]
        assert 0 < records[2]["inner"]["program_run"] <= records[2]["inner"]["stage"]
        if thread_times:  # the engine's thread's parts, also in its CPU time (the metadata copy is a GPU one), and
            # the capture thread's (on a CPU nothing is issued ahead: no stream of its own)
            # and kvdbg's hooks, each in the engine's thread's CPU time beside its wall time
            hooks = {name for name in records[2]["hooks"]}
            assert {"after_build", "after_graph_replay"} <= hooks <= set(gc.KVDBG_HOOKS)
            assert set(records[2]["thread"]) == {"stage", "program_run", "begin", "finish"} | hooks
            assert all(0 < records[2]["thread"][name]["cpu_ns"] for name in hooks)
            assert 0 < records[2]["thread"]["program_run"]["cpu_ns"] <= records[2]["thread"]["stage"]["cpu_ns"]
        else:
            assert not records[2]["thread"]
        assert len(snapshots(tmp_path)) == 2
    finally:
        timing.restore()
    assert {name: plugin_state._PluginState.__dict__.get(name) for name in gc.KVDBG_HOOKS} == before
    assert _replaced_by_the_bench() == replaced_before  # the capture's timers too


def test_a_capture_thread_that_takes_the_job_at_once_still_counts_into_the_step_that_handed_it(standins, tmp_path,
                                                                                                monkeypatch):
    """The capture thread may run the job before the engine's thread returns from the hand-over: the job carries
    its step's record from the start."""
    from kvdbg.util.ranges import IntRanges
    from kvdbg.vllm_plugin import graph_hooks

    class AtOnce:  # a capture thread scheduled first: the job runs inside the hand-over's put
        def __init__(self, state):
            self.state, self.jobs = state, self

        def put(self, job):
            if job is not None:
                try:
                    self.state._capture_graph_job(job, {})
                finally:
                    job.finished.set()

        def stop(self, timeout):
            pass

    monkeypatch.setattr(graph_hooks, "_GraphCaptureThread", AtOnce)
    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch)
    try:
        vllm_plugin.active_capturer().reconfigure(steps=IntRanges.of(0, "steps"))
        timing.current = record = gc._new_step()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        timing.current = None
        vllm_plugin._state.await_graph_capture()
        assert record["copied"] and record["captures"] == 2 and record["captured_bytes"] > 0
        assert set(record["inner"]) == {"begin", "finish", "gather", "metadata_read", "stage", "program_run",
                                        "program_new"}
    finally:
        timing.restore()


def test_a_step_handed_on_its_ticket_counts_its_bytes_into_its_own_step_through_a_stand_in(standins, tmp_path,
                                                                                              monkeypatch):
    """A wanted step handed on its shape's ticket has no job on the engine's thread (the capture thread makes it):
    the bench hands the step's record to a stand-in there, the job carries it once made (its bytes counted into the
    step that handed it, not a later one), and the stand-in is told done with the job's marks."""
    from tests.test_vllm_plugin import _record_variants

    from kvdbg.util.ranges import IntRanges

    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch)
    try:
        state = vllm_plugin._state
        wrapper, entry = _record_variants(16)
        vllm_plugin.active_capturer().reconfigure(steps=IntRanges.of("1-3", "steps"))
        stand_ins, records = [], []
        handing = state.ticket_replayed  # the bench's wrapper: what it leaves for the step's record

        def spied(fast):
            try:
                return handing(fast)
            finally:
                stand_ins.append(timing.handed_job)

        monkeypatch.setattr(state, "ticket_replayed", spied)
        for _ in range(4):
            timing.current = gc._new_step()
            _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                          monkeypatch, wrapper=wrapper)
            records.append(timing.current)
            timing.current = None
            assert state.drain_graph_capture(10)
            next(iter(state._staged_variants.values()))[1].poll_released(wait=True)
        assert entry.cudagraph == "staged" and len(state._tickets) == 1 and state.staged_replays == 3
        assert [r["copied"] for r in records] == [False, True, True, True]
        assert all(r["captures"] == 2 and r["captured_bytes"] > 12 * 4 * 16 * 2 for r in records[1:])
        assert records[0]["captures"] == 0
        assert [s.bench_record for s in stand_ins] == records[2:]  # steps 2 and 3 went on the ticket
        assert all(s.finished.is_set() and type(s.staged).__name__ == "StagedStep" for s in stand_ins)
        assert len(snapshots(tmp_path)) == 6
    finally:
        timing.restore()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the engine part would run for minutes")
def test_a_part_that_cannot_start_says_why_and_the_run_exits_2(tmp_path):
    """The whole parent on a CPU: the engine part fails (no CUDA here), is reported with its trace, and the
    run goes on to print its summary."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVDBG_", "VLLM_"))}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "graph_cost.py"), str(tmp_path / "out"),
                           "--parts", "baseline", "--budget", "120", "--scratch", str(tmp_path / "scratch")],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    [line] = [ln for ln in proc.stdout.splitlines() if ln.startswith(gc.SUMMARY_PREFIX)]
    summary = json.loads(line[len(gc.SUMMARY_PREFIX):])
    assert summary["exit"] == 2 and any(p.startswith("baseline: stopped:") for p in summary["problems"])
    assert os.path.exists(tmp_path / "out" / "records" / "baseline.json")
    assert os.path.exists(tmp_path / "out" / "model" / "config.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the bench runs here")
def test_the_staging_calls_bench_says_it_needs_a_gpu_and_exits_2():
    """bench/staging_calls.py takes apart a wanted graph step's runtime calls on a CUDA device; elsewhere it says
    so in one line and exits 2, without a traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "staging_calls.py"), "--iters", "5"],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and done.stdout.strip() == "staging_calls: needs a CUDA device", done
    assert "Traceback" not in done.stderr


def test_the_figures_rounds_run_without_the_benchs_hook_timers(standins, tmp_path, monkeypatch):
    """The rounds a step-time figure is made of run kvdbg's hooks without the bench's timers around them (Python
    of the bench's own, on the engine's thread in kvdbg's steps only): the hooks still run (each layer's count
    moves on) and nothing is timed; switched on again, they are timed as before; restore puts kvdbg's own back.
    The one layer the timers leave is the bench's stand-in for a ticketed step's job (its record), under
    ``ticket_replayed``'s timer."""
    from kvdbg.vllm_plugin import state as plugin_state

    before = {name: plugin_state._PluginState.__dict__.get(name) for name in gc.KVDBG_HOOKS}
    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch)
    try:
        timed = {name: plugin_state._PluginState.__dict__.get(name) for name in gc.KVDBG_HOOKS}
        assert all(timed[name] is not before[name] for name in gc.KVDBG_HOOKS)
        untimed = {**before, "ticket_replayed": next(own for _, name, own, _ in timing._hook_timers
                                                     if name == "ticket_replayed")}
        assert untimed["ticket_replayed"].__name__ == "_ticket_replayed"
        records = []
        for on in (False, True):
            timing.hook_timers(on)
            assert {name: plugin_state._PluginState.__dict__.get(name) for name in gc.KVDBG_HOOKS} == \
                (timed if on else untimed)
            timing.current = gc._new_step()
            _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                          monkeypatch)
            records.append(timing.current)
            timing.current = None
        assert records[0]["hooks"] == {} and records[0].get("replayed_step") is None
        assert records[1]["hooks"]["after_build"] > 0 and records[1]["replayed_step"] == 1
        assert set(vllm_plugin._state._forward_counts.values()) == {2}  # both steps counted by kvdbg's hooks
    finally:
        timing.restore()
    assert {name: plugin_state._PluginState.__dict__.get(name) for name in gc.KVDBG_HOOKS} == before


def test_the_sentinel_is_judged_on_the_mean_of_its_rounds_and_capture_armed_on_their_median(capsys):
    """The sentinel's cost comes in draws that one round in three holds: the median of its rounds is a round
    without one (1.0x here, under the line), where the mean counts the draw at its weight (2 %, over it). Capture
    armed costs every step alike, and its median leaves a round a stall hit out."""
    records = _records()
    halves = ([_round(5.0), _round(5.0), _round(5.3)], [_round(5.0, hooks_us=0) for _ in range(3)])
    records["capture"]["phases"]["armed"], records["capture"]["phases"]["bypassed"] = halves
    records["sentinel"]["phases"]["rounds"], records["sentinel"]["phases"]["bypassed"] = halves
    records["capture"]["interleaved_block"] = records["sentinel"]["interleaved_block"] = 8
    figs = gc.figures(records)
    armed, sentinel = figs["armed"]["paired"], figs["sentinel"]["paired"]
    assert armed["over"] == "median" and armed["ratio"] == pytest.approx(1.0) and figs["armed"]["met"]
    assert sentinel["over"] == "mean" and sentinel["ratio"] == pytest.approx(1.02) and not figs["sentinel"]["met"]
    assert sentinel["host"]["median"] == pytest.approx(1.0) and armed["host"]["mean"] == pytest.approx(1.02)
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "sentinel  paired in its process (3 rounds, kvdbg's patches on and off by blocks of 8 steps): 1.0200x " \
        "(mean of the rounds; their median 1.0000x, rounds 1.0000..1.0600)" in out
    assert "armed     paired in its process (3 rounds, kvdbg's patches on and off by blocks of 8 steps): 1.0000x " \
        "(median of the rounds; their mean 1.0200x" in out


def test_the_hooks_time_comes_from_the_timed_rounds_and_the_timed_pairs_are_shown_apart(capsys):
    records = _records(armed_ms=5.0, sentinel_ms=5.0)
    for kind, phases in (("capture", records["capture"]["phases"]), ("sentinel", records["sentinel"]["phases"])):
        first = "armed" if kind == "capture" else "rounds"
        phases[first] = [_round(5.05, graph_ms=2.0, hooks_us=0) for _ in range(4)]
        phases["bypassed"] = [_round(5.0, graph_ms=2.0, hooks_us=0) for _ in range(4)]
        phases["timed"] = [_round(5.2, graph_ms=2.0, hooks_us=30) for _ in range(2)]
        phases["timed_bypassed"] = [_round(5.0, graph_ms=2.0, hooks_us=0) for _ in range(2)]
        records[kind]["interleaved_block"] = 8
    figs = gc.figures(records)
    for name in ("armed", "sentinel"):
        f = figs[name]
        assert f["hooks_us"]["median"] == 30  # from the timed rounds: the figure's rounds timed nothing
        assert f["paired"]["host"]["median"] == pytest.approx(1.01) and f["judged_on"] == "paired"
        assert f["with_hook_timers"]["host"]["median"] == pytest.approx(1.04)
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "armed     paired with the bench's hook timers on (2 rounds after those; not judged): 1.0400x" in out


def test_the_stand_ins_wanted_row_times_a_step_the_staged_graph_serves_against_an_unwanted_one(standins, tmp_path):
    """The hooks part's wanted row: capture takes every WANTED_EVERY-th step; every timed wanted step replays the
    staged variant through kvdbg's patch of vLLM's graph wrapper (the row stops otherwise), on its shape's ticket
    after the first, told at its build as the end of the quiet run before it, and is handed over with its staging;
    unwanted steps replay the plain one, on quiet runs but the first after a wanted step; the row's figures are the
    wanted steps' medians less the unwanted ones'."""
    import pytest as _pytest

    from tests.test_vllm_plugin import _Batch, _record_variants

    enable(standins, tmp_path)
    patch = _pytest.MonkeyPatch()
    state = vllm_plugin._state
    served: list = []
    told = state.ticket_replay
    patch.setattr(state, "ticket_replay", lambda wrapper: served.append(told(wrapper)) or served[-1])
    quiet: list = []
    quiet_told = state.quiet_replay
    patch.setattr(state, "quiet_replay", lambda wrapper: quiet.append(quiet_told(wrapper)) or quiet[-1])
    ends: list = []
    on_ticket = state._on_ticket
    patch.setattr(state, "_on_ticket", lambda *args: ends.append(args[4:]) or on_ticket(*args))
    try:
        row = gc._wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants, 8,
                             steps_timed=50)
    finally:
        patch.undo()
    every = gc.WANTED_EVERY
    assert every >= 3  # a quiet run between two wanted steps
    assert row["mode"] == "wanted" and row["graph_slots"] == 8 and row["steps"] == 50
    assert row["staged_in_graph"] == 350  # every wanted step, warm-up included, staged inside the graph
    assert row["tickets"] == 1 and len(served) == 349 and all(fast is not None for fast in served)
    assert state.staged_replays == 350
    # Each wanted build after the first told on the ticket at the quiet run's end by the build's own lines, its step
    # the run's (no count read, _on_ticket not asked); the builds of the unwanted steps that are asked try the
    # ticket, which their step refuses.
    kept = [fast[3][4] for fast in served]
    assert all(later - earlier == every for earlier, later in zip(kept, kept[1:]))
    assert ends == [()] * 349
    # The unwanted steps: the first after each wanted one (and the very first) asked, which tells a quiet run for the
    # others. The first wanted step is asked too; the others' builds were kept on the ticket, whose call is first.
    unwanted = (every - 1) * 350
    assert len(quiet) == unwanted + 1 and sum(run is not None for run in quiet) == unwanted - 350
    hooks = row["by_hook_us"]
    assert set(hooks) == {"after_build", "replay"} == set(row["unwanted_by_hook_us"])
    assert row["added_us"] == _pytest.approx(sum(hooks.values()) - sum(row["unwanted_by_hook_us"].values()))
    assert row["replay_hooks_us"] == _pytest.approx(hooks["replay"])


def test_the_stand_ins_patched_row_times_whole_steps_through_kvdbgs_patches_most_with_vllms_own_methods_lent(
        standins, tmp_path):
    """The hooks part's patched rows: armed, every step goes through kvdbg's three patches as vLLM calls them, counted
    (each layer's forwards); after each step that tells a quiet run and the run's first replay, the builder and the
    worker run vLLM's own methods, lent (graph_hooks._lend_builders), until the run's horizon."""
    import pytest as _pytest

    from kvdbg.vllm_plugin.graph_hooks import QUIET_AHEAD
    from tests.test_vllm_plugin import _Batch

    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="100000")
    patch = _pytest.MonkeyPatch()
    state = vllm_plugin._state
    try:
        row = gc._patched_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, "armed", 8)
        names = list(state._graph_layers[_Batch((4,))])
        assert {state._forward_counts[slot.name] for slot in names} == {2000}
    finally:
        patch.undo()
    assert row["mode"] == "armed" and row["steps"] == 2000
    # A step that asks every question tells the QUIET_AHEAD steps after it: cycles of QUIET_AHEAD + 1 steps, and the
    # one the row ends in.
    full, rest = divmod(2000, QUIET_AHEAD + 1)
    assert row["run_starts"] == full + (rest > 0)
    # Lent after each told step's replay but the last's (which takes them back); the cycle the row ends in has no
    # last one.
    assert row["lent_steps"] == full * (QUIET_AHEAD - 1) + max(rest - 1, 0)
    assert row["own_us"] > 0 and row["quiet_us"] > 0 and row["run_start_us"] > 0
    assert row["added_us"] == _pytest.approx(row["quiet_us"] - row["own_us"])


def test_the_stand_ins_patched_wanted_row_times_whole_wanted_steps_against_quiet_ones(standins, tmp_path):
    """The hooks part's patched wanted row: every WANTED_EVERY-th step wanted, through kvdbg's three patches, served
    on its shape's ticket by the staged graph; the others are told by the step after each wanted one, the run's
    first replay, and quiet steps that run vLLM's own methods, lent."""
    import pytest as _pytest

    from tests.test_vllm_plugin import _Batch, _record_variants

    enable(standins, tmp_path)
    patch = _pytest.MonkeyPatch()
    state = vllm_plugin._state
    try:
        row = gc._patched_wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph,
                                     _record_variants, 8, steps_timed=40)
        names = [slot.name for slot in state._graph_layers[_Batch((4,))]]
        cycles = 300 + 40  # the row's warm-up cycles, then the timed ones
        assert {state._forward_counts[n] for n in names} == {gc.WANTED_EVERY * cycles}
    finally:
        patch.undo()
    assert row["steps"] == 40 and row["tickets"] == 1
    assert row["staged_in_graph"] == cycles  # every wanted step, staged inside the graph (the first earns the ticket)
    assert row["wanted_us"] > 0 and row["quiet_us"] > 0 and row["first_replay_us"] > 0 and row["run_start_us"] > 0
    assert row["added_us"] == _pytest.approx(row["wanted_us"] - row["quiet_us"])


def test_the_stand_ins_drawn_row_checks_each_drawn_step_in_the_checker_process_from_the_staged_graph(standins,
                                                                                                     tmp_path):
    """The hooks part's drawn row: the sentinel draws every DRAWN_EVERY-th step; each drawn step replays the staged
    variant (the row stops otherwise) and its check goes, from the engine's thread, to a checker process that reads
    the program's buffers, shared once; the step after it reads the answer in its hooks and collects the verdicts;
    none fails and none is checked in the engine's process. The row's figures are the timed drawn steps' medians
    less those of the steps not drawn, the program's own run (the device's, in an engine) out of them; with
    ``profile``, the heaviest functions of as many drawn steps again, run after the timed ones (their times kept out
    of the figures)."""
    import pytest as _pytest

    from tests.test_vllm_plugin import _Batch, _record_variants

    from kvdbg.sentinel.remote import CheckerProcess
    from kvdbg.vllm_plugin import graph_staging

    standins.setenv("KVDBG_SENTINEL", "0.01")
    standins.setenv("KVDBG_SENTINEL_DIR", str(tmp_path / "sentinel"))
    standins.setenv("KVDBG_SENTINEL_PAIRS", "4")
    vllm_plugin.register()
    patch = _pytest.MonkeyPatch()
    state = vllm_plugin._state
    bodies: list = []
    looks: list = []  # (a hook's look, answers it read)
    real_answers = CheckerProcess.answers
    try:
        real_body = graph_staging.InGraphProgram.graph_body
        patch.setattr(graph_staging.InGraphProgram, "graph_body",
                      lambda self, rows: bodies.append(rows) or real_body(self, rows))
        patch.setattr(CheckerProcess, "answers", lambda self, timeout=0.0: looks.append(
            (timeout is None, len(got := real_answers(self, timeout)))) or got)
        row = gc._drawn_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants, 8,
                            steps_timed=12, profile=True)
    finally:
        patch.undo()
    every = gc.DRAWN_EVERY
    drawn = 20 + 12 + 12  # warm-up, timed, profiled
    assert row["mode"] == "drawn" and row["graph_slots"] == 8 and row["steps"] == 12 and every >= 3
    # The program ran inside the staged graph for each drawn step, and for no other (once more: its recording)
    assert len(bodies) == drawn + 1
    assert state.staged_replays == drawn and state._stager is None  # nothing staged from the host
    checks = row["checks"]
    assert checks["in_the_process"] == drawn and checks["errors"] == 0 and checks["checked"] == drawn * 8
    # Every answer was read by a hook's look (the step after the drawn one), none by the row's own waits
    assert sum(n for hook, n in looks if hook) == drawn and sum(n for hook, n in looks if not hook) == 0
    assert set(row["by_hook_us"]) == {"after_build", "replay"} == set(row["undrawn_by_hook_us"])
    assert set(row["after_by_hook_us"]) == {"after_build", "replay"}
    assert row["added_us"] == _pytest.approx(sum(row["by_hook_us"].values())
                                             - sum(row["undrawn_by_hook_us"].values()))
    top = row["profile_top"]
    assert 0 < len(top) <= 25 and all(t["with_callees_us_per_step"] >= t["own_us_per_step"] >= 0 for t in top)
    assert all("graph_body" not in t["function"] for t in top)  # the program's run is not the hooks'


def test_a_cold_row_runs_the_other_work_before_each_of_its_steps_and_fewer_of_them(standins, tmp_path):
    """--cold: each step of a row (warm-up and timed, wanted and unwanted) comes after a call of the evicting work,
    outside its timers; a sixth of the steps (the wanted row: of its wanted steps, each with the unwanted ones
    before it)."""
    import pytest as _pytest

    from tests.test_vllm_plugin import _Batch, _record_variants

    calls = []
    enable(standins, tmp_path)
    patch = _pytest.MonkeyPatch()
    try:
        row = gc._wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants, 8,
                             steps_timed=60, cold=lambda: calls.append(1))
    finally:
        patch.undo()
    assert gc._steps_for(None, 300, 60) == (300, 60) and gc._steps_for(object(), 300, 60) == (50, 10)
    assert row["steps"] == 10 and len(calls) == gc.WANTED_EVERY * (50 + 10) and row["staged_in_graph"] == 60
    evict = gc.Evict()
    evict()
    evict()
    assert evict.turn == 2


def test_a_sentinel_rounds_time_is_split_between_its_drawn_steps_the_steps_after_them_and_the_rest(capsys):
    """A drawn step and the steps while its check runs in the worker, each against the median of the round's other
    steps; the share is what they added over the round's whole time."""
    steps = [_step(30.0, replays=0, hooks_us=0, drawn=False)]
    steps += [_step(5.0, drawn=False) for _ in range(40)]
    steps[11] = _step(6.0, hooks_us=510.0, drawn=True)  # the round's one drawn step, then its check's 8 steps
    steps[11]["program_ms"] = 0.4  # its staging program on the device
    for i in range(12, 12 + gc.FOLLOWING_STEPS):
        steps[i] = _step(5.25, drawn=False)
    summary = gc.summarize_round(steps)
    split = summary["drawn_split"]
    window = gc.decode_window(steps)
    assert split["drawn"] == 1 and split["steps"] == len(window)
    assert split["drawn_added_ms"] == pytest.approx(1.0) and split["after_added_ms"] == pytest.approx(2.0)
    assert split["drawn_hooks_us"] == pytest.approx(510.0) and split["quiet_hooks_us"] == pytest.approx(10.0)
    assert split["share"] == pytest.approx(3.0 / sum(s["wall_ns"] / 1e6 for s in window))
    assert "drawn_split" not in gc.summarize_round([_step(5.0) for _ in range(20)])  # no sentinel: no split
    records = _records()
    records["sentinel"]["phases"]["rounds"] = [summary] * 3
    figs = gc.figures(records)
    assert figs["sentinel"]["drawn_split"]["drawn"] == 3 and figs["sentinel"]["drawn_split"]["share"] == \
        pytest.approx(split["share"])
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "sentinel  where its time goes: 3 of" in out and "a drawn step +1.00 ms (its hooks 510 us)" in out
    assert f"the {gc.FOLLOWING_STEPS} after it +2.00 ms in all" in out
    assert split["drawn_program_ms"] == pytest.approx(0.4) and "its staging program 0.40 ms on the device" in out
    assert "a drawn step's hooks with the bench's timers on" not in out  # no timed rounds: no parts
    # The rounds timed with the bench's timers: a drawn step's parts, their means over its drawn steps.
    steps[11]["inner"] = {"program_new": 300_000, "sentinel_hand": 120_000}
    timed = gc.summarize_round(steps)
    assert timed["drawn_split"]["drawn_parts_us"] == {"program_new": 300.0, "sentinel_hand": 120.0}
    records["sentinel"]["phases"]["timed"] = [timed, summary]
    figs = gc.figures(records)
    assert figs["sentinel"]["drawn_split_timed"]["drawn_parts_us"] == {"program_new": 300.0, "sentinel_hand": 120.0}
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "a drawn step's hooks with the bench's timers on: 510 us (2 step(s)); of it program_new 300 us, " \
        "sentinel_hand 120 us" in out


def test_a_sentinel_run_without_kvdbg_absent_rounds_prints_its_split_and_says_why_it_has_no_figure(capsys):
    # --parts sentinel (a diagnostic run, --where): no baseline to hold it to, but where its time went needs none.
    steps = [_step(30.0, replays=0, hooks_us=0, drawn=False)] + [_step(5.0, drawn=False) for _ in range(40)]
    steps[11] = _step(6.0, hooks_us=510.0, drawn=True)
    summary = gc.summarize_round(steps)
    records = {"sentinel": {**_records()["sentinel"], "sentinel_reference": "host"}}
    records["sentinel"]["phases"]["rounds"] = [summary] * 2
    figs = gc.figures(records)
    assert "sentinel" not in figs and figs["sentinel_alone"]["drawn_split"]["drawn"] == 2
    assert figs["sentinel_alone"]["reference"] == "host"
    code, problems, _ = gc.verdict(["sentinel"], records, figs)
    assert code == 2 and problems == ["sentinel: the figure sentinel could not be computed: no kvdbg-absent rounds "
                                      "in this run (its split is printed)"]
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "sentinel  no figure: no kvdbg-absent rounds in this run (--parts)" in out
    assert "sentinel  where its time goes: 2 of" in out and "a drawn step +1.00 ms (its hooks 510 us)" in out
    # With the baseline, the figure and the same split; the other parts' missing figures say nothing more.
    assert "sentinel_alone" not in gc.figures(_records())
    assert gc.verdict(["armed"], {"capture": {"problems": [], "phases": {}}}, {})[1] == \
        ["armed: the figure armed could not be computed"]


def test_a_drawn_steps_time_on_the_engines_cpu_and_its_workers_checks_are_shown_beside_the_wall_time(capsys):
    """--thread-times: each step's CPU time on the engine's thread splits a drawn step's added wall time into work
    and waiting; the worker's checks are timed on its own thread (others' calls are not), and printed."""
    import threading

    from kvdbg.sentinel import checker

    steps = [_step(30.0, replays=0, hooks_us=0, drawn=False, cpu_ns=0)]
    steps += [_step(5.0, drawn=False, cpu_ns=2_000_000) for _ in range(40)]
    steps[11] = _step(8.0, drawn=True, cpu_ns=2_500_000, device_wait_ns=1_000_000)  # +3 ms: 0.5 CPU, 1 device
    for i in range(12, 12 + gc.FOLLOWING_STEPS):
        steps[i] = _step(5.5, drawn=False, cpu_ns=2_000_000)  # +0.5 ms each, none of it on the CPU
    split = gc.summarize_round(steps)["drawn_split"]
    assert split["drawn_added_ms"] == pytest.approx(3.0) and split["drawn_cpu_added_ms"] == pytest.approx(0.5)
    assert split["after_added_ms"] == pytest.approx(4.0) and split["after_cpu_added_ms"] == pytest.approx(0.0)
    assert split["drawn_wait_added_ms"] == pytest.approx(1.0) and split["after_wait_added_ms"] == pytest.approx(0.0)
    from kvdbg.sentinel.remote import CheckerProcess

    timing = gc.Timing(thread_times=True)
    real = checker.check_layers
    calls = []
    checker.check_layers = lambda entries, *a, **k: calls.append(k.get("step")) or ["ok"] * len(entries)
    real_remote = CheckerProcess.submit, CheckerProcess.answers
    try:
        log = gc.wrap_worker_checks(timing)
        assert checker.check_layers([1, 2], pairs=4, step=5) == ["ok", "ok"]  # the engine's thread: not timed
        worker = threading.Thread(target=lambda: checker.check_layers([1, 2, 3], pairs=4, step=7),
                                  name="kvdbg-sentinel")
        worker.start()
        worker.join()
    finally:
        checker.check_layers = real
        CheckerProcess.submit, CheckerProcess.answers = real_remote
    assert calls == [5, 7] and [(c["step"], c["layers"]) for c in log] == [(7, 3)]
    assert log[0]["wall_us"] > 0 and log[0]["cpu_us"] >= 0 and log[0]["switches"] >= 0
    records = _records()
    records["sentinel"]["phases"]["rounds"] = [gc.summarize_round(steps)] * 3
    records["sentinel"]["sentinel_checks"] = log * 2
    figs = gc.figures(records)
    assert figs["sentinel"]["worker_checks"]["checks"] == 2
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "the same on the engine's thread's CPU: a drawn step +0.50 ms, the 8 after it +0.00 ms" in out
    assert "waiting on the device (its event and stream waits): +1.00 ms and +0.00 ms" in out
    assert "its worker thread's checks: 2; each" in out and "checker process's checks" not in out


def test_the_checker_processs_checks_are_timed_where_the_engines_thread_sends_and_reads_them(capsys):
    """A staged step's check in the checker process: the engine's thread's time to pickle and send it, and how long
    after the send a hook read its answer, logged per check and printed apart from the worker thread's checks."""
    from tests.test_sentinel import _one_step_of_layers

    from kvdbg.sentinel.remote import CheckerProcess

    timing = gc.Timing(thread_times=True)
    real_remote = CheckerProcess.submit, CheckerProcess.answers
    process = CheckerProcess("cpu")
    try:
        log = gc.wrap_worker_checks(timing)
        entries = _one_step_of_layers(2)
        for step in (3, 4):
            process.submit(entries, pairs=1, seed=step, step=step)
        assert [kind for kind, _ in process.answers(30.0)] == ["ok", "ok"]
    finally:
        CheckerProcess.submit, CheckerProcess.answers = real_remote
        process.close()
    assert [(c["step"], c["layers"], c["process"]) for c in log] == [(3, 2, True), (4, 2, True)]
    assert all(c["send_us"] > 0 and c["send_cpu_us"] >= 0 and c["answer_us"] > 0 and "sent_ns" not in c for c in log)
    records = _records()
    records["sentinel"]["sentinel_checks"] = log
    figs = gc.figures(records)
    assert figs["sentinel"]["worker_checks"]["in_process"] == 2 and not figs["sentinel"]["worker_checks"]["wall_us"]
    # The two layers given with the first check and named by the second; on a CPU every tensor goes by value.
    assert figs["sentinel"]["worker_checks"]["layers_given"] == [2, 2]
    assert figs["sentinel"]["worker_checks"]["buffers"] == [0, 0]
    gc.print_figures(figs, records)
    out = capsys.readouterr().out
    assert "its checker process's checks: 2; each sent by the engine's thread in" in out
    records["sentinel"]["sentinel_reference"] = "device"  # the bench's --sentinel-reference, said where it matters
    gc.print_figures(gc.figures(records), records)
    assert "its checker process's checks: 2 (their reference on the device); each sent" in capsys.readouterr().out
    assert "buffers shared with the child by the first check 0, by the last 0; layers given 2, 2; " \
           "templates made 0, 0" in out
    assert "after it was sent" in out and "its worker thread's checks" not in out


@pytest.mark.parametrize("mode", ["idle", "spin"])
def test_the_stand_in_checker_process_answers_each_check_after_its_time_with_nothing_compared(mode, capsys):
    """--worker-check idle|spin with the checker process: the sentinel starts the bench's stand-in child, which takes
    each check as kvdbg's child does and answers it, no sooner than --idle-ms, with each layer named and no pair."""
    from tests.test_sentinel import _one_step_of_layers

    from kvdbg.sentinel.remote import CheckerProcess

    real_init = CheckerProcess.__init__
    try:
        gc.stand_in_checker(mode, 300.0)
        process = CheckerProcess("cpu")
    finally:
        CheckerProcess.__init__ = real_init
    try:
        assert process._process.args[2:4] == [mode, "300.0"] and process._process.args[1].endswith("_idle_checker.py")
        entries = _one_step_of_layers(2)
        entries[1][1].output.view(-1)[0] = float("nan")  # not looked at: nothing is checked
        began = time.monotonic()
        process.submit(entries, pairs=1, seed=3, step=3)
        [(kind, results)] = process.answers(30.0)
        assert time.monotonic() - began >= 0.3
    finally:
        process.close()
    assert kind == "ok" and [r.layer for r in results] == [layer.name for layer, _ in entries]
    assert all(not r.pairs and r.nonfinite is None for r in results)
    records = _records()
    records["sentinel"].update(worker_check=mode, sentinel_checks=[
        {"step": 3, "layers": 2, "bench_step": 5, "process": True, "send_us": 200.0, "send_cpu_us": 150.0,
         "answer_us": 310e3, "buffers": 0, "layers_given": 2}])
    gc.print_figures(gc.figures(records), records)
    assert f"DIAGNOSTIC: the sentinel's check was '{mode}' (in its checker process; nothing compared)" \
        in capsys.readouterr().out


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _sent_after_a_draw() -> None:
    _busy(0.004)


def test_profiled_steps_say_which_functions_drawn_steps_and_those_after_spend_more_in(capsys):
    """--profile: each step under cProfile, kept as drawn, after (the FOLLOWING_STEPS after one) or quiet; the
    functions a drawn step and a step after one spend more time in than a quiet step come first, in us a step."""
    profiles = gc.StepProfiles()
    kinds = []
    for index in range(30):
        drawn = index == 5
        record = {"drawn": drawn}
        profile = profiles.begin()
        _busy(0.0005)
        if drawn:
            _busy(0.006)
        elif 5 < index <= 5 + gc.FOLLOWING_STEPS:
            _sent_after_a_draw()
        profile.disable()
        profiles.end(profile, record)
        kinds.append(record)
    off = {"drawn": False, "kvdbg": False}  # a step with kvdbg's patches off is no quiet step of its
    profile = profiles.begin()
    profile.disable()
    profiles.end(profile, off)
    out = profiles.excess()
    assert (out["drawn_steps"], out["after_steps"], out["quiet_steps"]) == (1, gc.FOLLOWING_STEPS, 30 - 1 - 8)
    [(name, us)] = [(n, us) for n, us in out["after_cumulative"][:2] if n.endswith("_sent_after_a_draw")]
    assert 3000 < us < 40000
    assert out["drawn_cumulative"][0][0].endswith("_busy") and out["drawn_cumulative"][0][1] > 5000
    assert {name.split(" ")[-1] for name, _ in out["drawn_own"][:2]} & {"_busy", "<built-in method time.perf_counter>"}
    records = _records()
    records["sentinel"]["profile"] = out
    figs = gc.figures(records)
    assert figs["sentinel"]["diagnostic"] and figs["sentinel"]["met"]
    gc.print_figures(figs, records)
    printed = capsys.readouterr().out
    assert "DIAGNOSTIC: its steps ran under the profiler (--profile)" in printed
    assert f"profile: a step after one ({gc.FOLLOWING_STEPS} steps)" in printed and "_sent_after_a_draw" in printed


def test_spin_is_refused_for_the_worker_thread(capsys):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "graph_cost.py"), "/nonexistent",
                           "--worker-check", "spin", "--sentinel-process", "off"], capture_output=True, text=True)
    assert done.returncode == 2 and "--worker-check spin is for the checker process" in done.stderr


def test_the_engines_waits_on_the_device_count_into_its_step_and_no_other_threads_do():
    """--thread-times: each synchronize of the given classes on the engine's thread adds its time to the step being
    timed; another thread's, or one between steps, adds nothing; restore() puts the method back."""
    import threading

    class Event:
        def synchronize(self, pause=0.002):
            time.sleep(pause)
            return "done"

    original = Event.synchronize
    timing = gc.Timing(thread_times=True)
    timing.install_device_waits((Event,))
    timing.engine_thread = threading.get_ident()
    assert Event().synchronize() == "done"  # no step timed: nothing kept anywhere
    timing.current = record = gc._new_step()
    assert Event().synchronize() == "done"
    other = threading.Thread(target=lambda: Event().synchronize(0.4))
    other.start()
    other.join()
    timing.current = None
    assert 2_000_000 <= record["device_wait_ns"] < 400_000_000  # the engine's own wait, not the other thread's
    timing.restore()
    assert Event.synchronize is original


@pytest.mark.parametrize("sentinel", [False, True])
def test_the_wrappers_mark_the_steps_the_sentinel_drew(standins, tmp_path, monkeypatch, sentinel):
    """With the sentinel on (here at rate 1: every step drawn), each graph step's record says whether the sentinel
    drew it (drawn_split needs it); without the sentinel, the records say nothing of draws."""
    if sentinel:
        monkeypatch.setenv("KVDBG_SENTINEL", "1")
    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch)
    try:
        timing.current = record = gc._new_step()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        timing.current = None
        assert record["replayed_step"] == 0
        assert record.get("drawn") is (True if sentinel else None)
    finally:
        timing.restore()


def test_the_staging_programs_own_graph_is_not_counted_as_the_steps_replay(monkeypatch):
    """A step the sentinel draws stages its layers with a program that is a CUDA graph of its own: its replay is
    counted apart (``program_replays``), not as the step's (``replays``), and not timed as vLLM's graph, so the
    drawn step stays in its round's decode window (it fell out of every window before, and with it its cost)."""
    import torch

    from kvdbg.vllm_plugin.graph_staging import _Program

    replayed = []
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda graph: replayed.append(graph))
    monkeypatch.setattr(_Program, "run", lambda program, counts: torch.cuda.CUDAGraph.replay("the program's graph"))

    class Event:
        def record(self):
            pass

    timing = gc.Timing()
    timing.install_graphs()
    from kvdbg.capture import buffers as capture_buffers
    from kvdbg.vllm_plugin.graph_staging import GraphStager

    before = (_Program.__dict__["run"], GraphStager.__dict__["stage"], capture_buffers.copies_to_host)
    timing.install_kvdbg()
    try:
        timing._events = [Event() for _ in range(8)]
        timing.current = record = gc._new_step()
        torch.cuda.CUDAGraph.replay("vLLM's graph")  # the step's replay, then its staging program's
        _Program.run(object(), None)
        timing.current = None
        assert replayed == ["vLLM's graph", "the program's graph"]
        assert record["replays"] == 1 and record["program_replays"] == 1 and len(record["graph_events"]) == 1
        assert len(record["program_events"]) == 1  # the program's own device time, timed apart
        assert not timing.in_program and record["inner"]["program_run"] > 0
        steps = [dict(record, wall_ns=5_000_000, graph_ms=[2.0]) for _ in range(20)]
        assert len(gc.decode_window(steps)) == 16  # all but the two first and two last
    finally:
        timing.restore()
    assert (_Program.__dict__["run"], GraphStager.__dict__["stage"], capture_buffers.copies_to_host) == before


def test_the_step_wrapper_marks_the_steps_the_sentinel_drew_with_the_hook_timers_off(standins, tmp_path, monkeypatch):
    """The paired rounds run kvdbg's hooks without the bench's timers, so the step wrapper marks each step's draw
    itself, from the forwards the step counted: drawn_split then has its steps in the rounds it is worked out from."""
    import types

    monkeypatch.setenv("KVDBG_SENTINEL", "1")
    timing, engine = _armed_graph_engine(standins, tmp_path, monkeypatch)
    try:
        timing.hook_timers(False)
        state = vllm_plugin._state
        timing.draw_probe = (state, next(iter(state._graph_layers.values()))[0].name)
        log = gc.log_draws(state, timing)
        state.sentinel.sentinel._draws.clear()  # the recording's forwards asked for step 0's draw already
        llm_engine = types.SimpleNamespace(step=lambda: _run_as_graph(
            engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch))
        timing.install_steps(llm_engine)
        timing.recording = True
        llm_engine.step()
        state.sentinel.sentinel._draws[1] = False  # the next step's draw, made before it asks (rate 1 draws all)
        llm_engine.step()
        timing.recording = False
        assert [s.get("drawn") for s in timing.steps] == [True, False]
        assert all(s["hooks"] == {} for s in timing.steps)  # the hooks ran untimed
        # The draw log: step 0 drawn once, in the bench's first step, on this thread, the probe not yet counted.
        assert log == [{"step": 0, "bench_step": 0, "timed": True, "engine_thread": True, "probe_count": 0}]
    finally:
        timing.hook_timers(True)  # as the bench does after its paired rounds
        timing.restore()


def test_the_stack_sampler_keeps_the_engine_threads_frames_on_the_step_being_timed():
    import threading

    timing = gc.Timing()
    record, done = {}, threading.Event()

    def waits_here():
        done.wait(2.0)

    def engine():
        timing.engine_thread = threading.get_ident()
        timing.current = record
        waits_here()
        timing.current = None

    sampler = gc.StackSampler(timing, 1.0)
    sampler.start()
    thread = threading.Thread(target=engine)
    thread.start()
    time.sleep(0.1)
    done.set()
    thread.join()
    sampler.stop()
    assert record["where"], "no sample taken"
    # innermost first: the Condition's wait, the Event's, then the function the thread waits in
    assert all("/threading.py:" in key.split(" < ")[0] and key.endswith(" waits_here") for key in record["where"][1:]), \
        record["where"][:3]


def test_where_lines_rank_the_frames_a_drawn_step_has_more_of():
    where = {"drawn_steps": 2, "quiet_steps": 10, "drawn": {"a:1 lock": 8, "b:2 step": 4},
             "quiet": {"b:2 step": 20, "c:3 other": 10}}
    lines = gc.where_lines(where)
    assert lines[0].startswith("where (samples a step): drawn 6.0, quiet 3.0")
    assert lines[1] == "  +4.00  a:1 lock" and lines[2] == "  +0.00  b:2 step" and lines[3] == "  -1.00  c:3 other"
    assert gc.where_lines(None) == [] and gc.where_lines({**where, "drawn_steps": 0}) == []
    after = gc.where_lines({**where, "after_steps": 4, "after": {"d:4 wait": 6}})
    assert after[4].startswith("where (samples a step): after 1.5, quiet 3.0; a step after one's extra")
    assert after[5] == "  +1.50  d:4 wait"


def test_garbage_collections_are_timed_into_the_step_they_paused_and_the_pairs_shown_without_them(capsys):
    """A collection's pause counts into the step timed then (on any thread: every thread waits for it), and the
    paired rounds are also given with the pauses taken out: a rare long round may be Python's, not kvdbg's."""
    import gc as python_gc

    timing = gc.Timing()
    timing.install_gc()
    try:
        timing.current = record = gc._new_step()
        python_gc.collect(0)
        python_gc.collect(2)
        timing.current = None
        python_gc.collect(0)  # between steps: no step's
    finally:
        python_gc.callbacks[:] = [c for c in python_gc.callbacks if getattr(c, "__name__", "") != "paused"]
    assert record["gc_ns"] > 0 and record["gc_full"] == 1
    on = gc.summarize_round([_step(6.0, gc_ns=int(1e6), gc_full=1)] * 2 + [_step(5.0)] * 2)
    off = gc.summarize_round([_step(5.0)] * 4)
    assert on["gc_ms"] == pytest.approx(2.0) and on["gc_full"] == 2
    assert on["step_ms"] == pytest.approx(5.5) and on["step_ms_without_gc"] == pytest.approx(5.0)
    paired = gc.paired_figure([on], [off], {"value": 2.0, "baseline": 2.0}, [off], 4, over="mean")
    assert paired["host"]["mean"] == pytest.approx(1.1)
    assert paired["gc"]["kvdbg_ms"] == pytest.approx(2.0) and paired["gc"]["bypassed_ms"] == 0
    assert paired["gc"]["host_without"]["mean"] == pytest.approx(1.0)
    # each half without its longest step: the two 6 ms steps' one left out
    assert on["step_ms_max"] == 6.0 and on["step_ms_trimmed"] == pytest.approx(16.0 / 3)
    assert paired["trimmed"]["mean"] == pytest.approx(16.0 / 15) and paired["trimmed"]["longest_ms"]["max"] == 6.0
