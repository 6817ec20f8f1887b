"""What capture and the sentinel cost a vLLM engine whose decode steps run as full CUDA graphs, in one run.

Usage (the GPU machine: tests/gpu/run_graph_cost.sh puts vLLM 0.33's sources and stand-ins on the path):
    bash tests/gpu/run_graph_cost.sh OUT [--parts baseline,armed,wanted,sentinel,hooks,baseline2] [--budget 330]
The hooks' Python alone, on any machine (the tests' vLLM stand-ins, no GPU, no vLLM), and a whole step nothing
wants through kvdbg's three patches against vLLM's own calls (``_patched_row``); ``--cold`` adds rows with other
work between the steps (``Evict``), whose figures are of the engine's order:
    python bench/graph_cost.py OUT --parts hooks [--cold]

Three figures, each against its line:

- **armed, no step wanted**: decode step time with capture switched on (``KVDBG_CAPTURE_DIR`` set) and its
  step filter on a step not reached, against the engine with kvdbg absent: <= 1.02x;
- **a wanted step**: what capturing one whole step (every layer) adds to the engine's thread, <= 50 us, and
  to the device, <= 1.5x the step's bytes copied at the device-to-host bandwidth measured in the same run;
- **sentinel at 0.01**: decode step time with ``KVDBG_SENTINEL=0.01`` alone, against kvdbg absent: <= 1.01x.

How: each engine is a process of its own (vLLM's engine core and graphs are per process): vLLM 0.33 in-process
(``LLM``), TRITON_ATTN, ``cudagraph_mode=FULL_DECODE_ONLY`` with one graph of ``--batch`` tokens, a Llama of
``--layers`` layers (hidden 4096, 32 query / 8 KV heads of 128, MLP 14336, bfloat16) with vLLM's random
``load_format="dummy"`` weights. Every round serves ``--batch`` new prompts of ``--prompt`` tokens for
``--decode`` tokens each (greedy, no early stop): one prefill step, then decode steps of the whole batch,
each one replay of the graph. The bench times (its own wrappers, the same in every engine): each engine step
(``LLMEngine.step``, wall), each graph replay on the device (CUDA events around ``CUDAGraph.replay``; the
replay of kvdbg's staging program, a graph of its own, is counted apart) and, with kvdbg, each of the plugin's
hooks a graph step runs (``after_build``, ``graph_call``, ``before_graph_replay``,
``after_graph_replay``; wall). A round's step time is the mean wall time of its decode steps (the two first and
two last left out); a figure is the median over rounds, against the median of the kvdbg-absent rounds. A
second kvdbg-absent engine at the end (``baseline2``) says how much two processes of the same engine differ.

That difference (0.95-1.41x in earlier runs) is larger than the armed and sentinel lines, so those two are
judged within one process, and within each round: the capture and sentinel engines switch kvdbg's patches of
vLLM off (vLLM's originals back, ``Bypass``) and on again between steps, by blocks of ``--block`` steps in the
order on, off, off, on (``Interleave``), so that the host's drift (the same engine's step time moved by 1.2-1.5x
from one round to the next on the H200) falls on both alike. A round's figure is the mean of its decode steps
with kvdbg against the mean of those without (the step at each change of kind left out: the batch queue still
holds a step of the other kind), and the figure is the median over rounds of that ratio for capture armed, their
mean for the sentinel, whose cost comes in rare draws that a median over rounds counts or leaves out as they happen
to lie (``paired_figure``'s ``over``) (kvdbg's Python on the
engine's thread, its threads, its device work outside the graph; the capture thread and the sentinel's checks
are let finish, untimed, before the patches go off and between rounds), times ``1 + (graph - graph_absent) / step_absent``: the most the copies
kvdbg recorded into the graph (with the patches off vLLM replays the variant kvdbg installed last, nearly always
the plain one: ``GraphHooks.choose_graph``) can add to a step, from the graph's device
time against the kvdbg-absent engine's (``paired_figure``). The ratio across processes is printed beside it.
``--no-paired`` leaves the switching out (and the lines are then judged across processes). The paired rounds
run kvdbg's hooks without the bench's timers around them (``Timing.hook_timers``: Python of the bench's, on the
engine's thread in kvdbg's steps only, which would count as kvdbg's); ``--timed-rounds`` more rounds, paired the
same way, time the hooks (the hooks' time a step comes from them) and give the paired ratio with the timers on,
printed beside the figure, not judged. Each paired figure also gets its 95 % interval, the rounds resampled with
replacement (``interval``, seeded), and whether that interval lies wholly on one side of the line: where it
straddles the line, the rounds cannot tell met from missed, and the verdict (the figure's own) is said with that.

The wanted step, in the capture engine after its armed rounds: one round to warm up (pinned buffers are
allocated for the first capture), then rounds with one wanted decode step each (the filter set to that step
of every layer; the writer idle before it). Engine's thread: the hooks' time in the wanted step, less the
median of the round's other decode steps, plus the time the next step waited for kvdbg's graph capture thread
to issue the wanted step's copies (the plugin's own count, ``EngineTime.waited_ns``): the wanted step's
captures run on that thread, so the engine's thread pays the hand-off and that wait. Device: in other rounds, a sleep kernel is queued before the
wanted step's capture hook, so that the device is still busy when the hook has issued every copy; the time
from an event recorded after the sleep to the end of the copies (events on the engine's stream and on
kvdbg's side stream; with the capture thread, the events it records after its copies) is the copies' device
time, against the step's bytes (pages, query, output, metadata)
over the device-to-host bandwidth of a 256 MiB copy into pinned memory, measured in the same process. A staged
step is the device's work: the staging program on the engine's stream, the copies the capture thread issues
ahead for every layer (from the first to the last, back to back when every one was issued before the device
reached the first: the run says when not), and the reads it makes later (the page ids, the metadata), each timed
alone; the span from the program to the thread's last issue holds the thread's host time too, while its
stream waits idle, and is printed beside.

With ``--thread-times``, the engine's thread's parts of a wanted step (the staging program, and the build's
metadata copy to the host where a build still makes one: a build that a full graph replays makes none) are also timed in that thread's own CPU time and its voluntary context switches
(``getrusage(RUSAGE_THREAD)``), about 2 us of their own each, outside their wall time: a part whose wall time
is far above its CPU time waited (for the GIL, or in a runtime call that blocks), one whose CPU time is as
high ran that long (its calls dearer in the engine than alone: ``bench/staging_calls.py``). kvdbg's hooks are
timed the same way in the rounds that time them, and printed beside their wall time (a round's means; a wanted
step's over its round's other steps). Each step's CPU time on the engine's thread, and its waits on the device
there (``torch.cuda.Event`` and ``Stream`` ``synchronize``: vLLM waits for a step's sampled tokens so), split
a sentinel's drawn step and the steps after it into work, waiting on the device, and waiting for something
else (Python's lock, mostly: the sentinel's worker, whose checks are timed on its own thread too).

The sentinel's engine checks staged steps in its checker process (``KVDBG_SENTINEL_PROCESS``, kvdbg's default;
``--sentinel-process off``: in its worker thread; ``--sentinel-reference device``: the process works the reference
out on the device, not on the host), and its rounds start once that process is ready; a run of it without the
kvdbg-absent part (``--parts sentinel``) has no figure, and prints where its time went all the same. Three
diagnostics, never figures: ``--where MS`` samples the engine thread's frames every MS ms in timed steps and prints
the frames where a drawn step, and a step after one, had more samples than a quiet step (a sample falls where the
thread let go of Python's lock); ``--worker-check idle`` replaces the sentinel's check by ``--idle-ms`` of sleep
(the worker thread waits for the staging first; the checker process still receives and rebuilds each check:
``bench/_idle_checker.py``), ``--worker-check spin`` by as long a spin of one CPU core in the checker process
(nothing compared either way, the figure not judged), to tell the check's cost from the send's and the rest;
``--profile`` runs the sentinel's steps under ``cProfile`` on the engine's thread and prints the functions a drawn
step, and a step after one, spent more time in than a quiet step (each Python call dearer: the figure not judged).

Prints a line per part, the figures against their lines, and one line ``GCOST-SUMMARY {json}``. Writes
OUT/records/PART.json (each part's raw record) and OUT/logs/PART.log; snapshots go to ``--scratch`` and are
deleted once counted. Exit 0: every part ran, every check passed and every figure is within its line; 1: every
part ran and every check passed, a figure is over its line; 2: a part failed or a check did not pass.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import types
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cuda import cycles_per_us  # noqa: E402  (the sleep kernel's clock, shared with plugin_cuda)

# The issue's lines.
ARMED_LINE = 1.02  # step time, armed with no step wanted / kvdbg absent
WANTED_ENGINE_US_LINE = 50.0  # engine's thread added by a wanted step (all layers)
WANTED_DEVICE_LINE = 1.5  # device time added / the step's bytes at the measured device-to-host bandwidth
SENTINEL_LINE = 1.01  # step time, sentinel at 0.01 / kvdbg absent
# A paired figure's interval: the rounds resampled this many times (seeded: a run's records give one interval)
INTERVAL_RESAMPLES = 2000
INTERVAL_LEVEL = 0.95

PARTS = ("baseline", "armed", "wanted", "sentinel", "hooks", "baseline2")
ENGINE_KIND = {"baseline": "absent", "armed": "capture", "wanted": "capture", "sentinel": "sentinel",
               "baseline2": "absent"}
SENTINEL_RATE = "0.01"
# A step the capture filter names while "armed": never reached in a run.
UNREACHED_STEP = 10**15
KVDBG_HOOKS = ("after_build", "graph_call", "choose_graph", "before_graph_replay", "after_graph_replay", "quiet_replay",
               "quiet_replayed", "ticket_replay", "ticket_replayed")
# The hooks after a replay: timed with what the bench marks on the step (its step, whether it copied, its device job).
REPLAY_HOOKS = ("after_graph_replay", "ticket_replayed")
# The engine's thread's parts of a wanted step that --thread-times also times in thread CPU time and switches.
ENGINE_PARTS = ("metadata_copy", "stage", "program_run")
# Parts of a step the sentinel drew, timed on the engine's thread in the rounds with the bench's timers on (a drawn
# step's split prints their means): a staging program made (its page-locked buffers) and recorded, and the sentinel's
# hand-off of the step's checks to its worker.
DRAWN_PARTS = ("program_new", "program_record", "sentinel_hand")
# The capture thread's parts timed the same way with --thread-times: CPU time well under the wall time there is time
# spent waiting (for the device, or for the interpreter's lock the engine's thread holds).
CAPTURE_THREAD_PARTS = ("copies_ahead", "begin", "finish")
# vLLM's IR ops on its native torch implementations (its compiled kernels are not carried): as the engine stage.
NATIVE_IR_OPS = {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]}
# Steps after a wanted one whose wall time beyond the round's median is reported with it.
FOLLOWING_STEPS = 8
RECORD_PREFIX = "GCOST-RECORD "
SUMMARY_PREFIX = "GCOST-SUMMARY "
RECORD_PATH_VARIABLE = "GCOST_RECORD_PATH"  # where a part's process writes its record (no KVDBG_ prefix: the hooks
# part clears kvdbg's variables between its configurations)


# --------------------------------------------------------------------------- the model and the engine


def model_config(layers: int) -> dict:
    """A Llama of realistic widths (Llama-3-8B's attention and MLP), ``layers`` deep; random weights."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": layers, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
    }


def write_model(directory: str, layers: int) -> str:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump(model_config(layers), fh, indent=1)
    return directory


def engine_sizes(batch: int, prompt: int, decode: int, page: int = 16) -> dict:
    """The engine's limits for rounds of ``batch`` requests of ``prompt + decode`` tokens: every prefill in one
    step, the cache a little larger than one round needs (no preemption)."""
    max_model_len = -(-(prompt + decode + 8) // page) * page
    return {"max_model_len": max_model_len, "max_num_seqs": batch,
            "max_num_batched_tokens": max(batch * prompt, max_model_len, 2048),
            "num_gpu_blocks_override": batch * (max_model_len // page) + 64}


def kind_environment(kind: str, scratch: str) -> dict[str, str]:
    """The variables an engine process of ``kind`` runs with (on top of the harness's)."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: its hooks are timed here
           "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if kind == "capture":
        env.update(KVDBG_CAPTURE_DIR=os.path.join(scratch, "capture"), KVDBG_CAPTURE_STEPS=str(UNREACHED_STEP),
                   KVDBG_CAPTURE_MAX="unlimited", KVDBG_CAPTURE_MAX_BYTES="unlimited")
    elif kind == "sentinel":
        env.update(KVDBG_SENTINEL=SENTINEL_RATE, KVDBG_SENTINEL_DIR=os.path.join(scratch, "sentinel"),
                   KVDBG_SENTINEL_SEED="0")
    elif kind == "absent":
        env["VLLM_PLUGINS"] = plugins_without_kvdbg()
    return env


def plugins_without_kvdbg() -> str:
    """``VLLM_PLUGINS`` naming every vLLM plugin installed but kvdbg's: vLLM loads kvdbg's not at all."""
    import importlib.metadata as metadata

    names = sorted({ep.name for dist in metadata.distributions() for ep in dist.entry_points
                    if ep.group.startswith("vllm.") and ep.name != "kvdbg"})
    return ",".join(names) or "none"


def engine_arguments(model_dir: str, batch: int, prompt: int, decode: int) -> dict:
    """vLLM's engine arguments: random weights, TRITON_ATTN, one full CUDA graph of ``batch`` decode tokens, vLLM's
    torch-native ops (custom_ops none, no compilation: its compiled kernels are not carried), no prefix cache."""
    compilation = {"custom_ops": ["none"], "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY",
                   "cudagraph_capture_sizes": [batch]}
    return dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", block_size=16,
                enable_prefix_caching=False, seed=0, gpu_memory_utilization=0.5, attention_backend="TRITON_ATTN",
                compilation_config=compilation, kernel_config={"ir_op_priority": NATIVE_IR_OPS},
                **engine_sizes(batch, prompt, decode))


def make_llm(model_dir: str, batch: int, prompt: int, decode: int):
    from vllm import LLM

    return LLM(**engine_arguments(model_dir, batch, prompt, decode))


def prompts(round_index: int, batch: int, length: int, vocab: int = 32000) -> list[dict]:
    import random

    rng = random.Random(1000 + round_index)
    return [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]} for _ in range(batch)]


# --------------------------------------------------------------------------- timing wrappers (the bench's own)


def _new_step() -> dict:
    return {"wall_ns": 0, "replays": 0, "graph_events": [], "hooks": {}, "inner": {}, "thread": {},
            "replayed_step": None,
            "copied": False, "captured_bytes": 0, "captures": 0, "device_mark": None, "device_job": None}


class Timing:
    """The bench's wrappers: engine steps, graph replays on the device, kvdbg's hooks. Records only in rounds."""

    def __init__(self, thread_times: bool = False):
        # --thread-times: ENGINE_PARTS and CAPTURE_THREAD_PARTS also in thread CPU time and switches
        self.thread_times = thread_times
        self.current: dict | None = None
        self.steps: list[dict] = []
        self.recording = False
        self._events: list = []
        self.device_steps: set[int] = set()  # steps (a layer's forward count) whose capture is device-timed
        self.sleep_cycles = 0
        # While kvdbg's replay hook runs: the step's record and the device-timed start event (or None), which the
        # hand-over puts on the job before the capture thread can take it.
        self.handing: tuple[dict | None, object] | None = None
        self.stand_in = None  # a ticketed step's stand-in job, made before the replay's hook is timed
        self.engine_thread: int | None = None  # the thread that runs the engine's steps (install_device_waits)
        self.worker_checks: list[dict] = []  # the sentinel's worker's checks (wrap_worker_checks)
        self.profiles: "StepProfiles | None" = None  # --profile: each step's functions on the engine's thread
        self.handed_job = None  # the job the latest after_graph_replay handed to the capture thread
        self._replaced: list[tuple[object, str, object]] = []
        # kvdbg's hooks and their timers, (class, name, the class's own hook or None, the timed hook): hook_timers()
        # swaps them
        self._hook_timers: list[tuple[object, str, object, object]] = []
        # Called with a step's index in its round before the step, untimed: (kvdbg's patches on, the step is the
        # first of its block); ``Interleave``. None: the patches stay as they are.
        self.switch = None
        # With the sentinel: (kvdbg's plugin state, a layer of the graph), for the step wrapper to mark each step the
        # sentinel drew, whether kvdbg's hooks are timed or not (the paired rounds run them without timers).
        self.draw_probe: tuple | None = None
        # kvdbg's staging program running (engine's thread): a graph replayed then is the program's, not vLLM's
        self.in_program = False

    def _replace(self, owner, name: str, wrapper) -> None:
        # A class's own attribute (None: inherited, deleted again at restore); a module's attribute as it is.
        self._replaced.append((owner, name, owner.__dict__.get(name)))
        setattr(owner, name, wrapper)

    def hook_timers(self, on: bool) -> None:
        """kvdbg's hooks timed (``on``) or as they are: rounds that give a step-time figure run without the timers,
        which are Python of the bench's on the engine's thread in kvdbg's steps only."""
        for owner, name, own, timed in self._hook_timers:
            if on:
                setattr(owner, name, timed)
            elif own is None:  # an inherited hook: the class's own attribute goes, as restore() does
                if name in owner.__dict__:
                    delattr(owner, name)
            else:
                setattr(owner, name, own)

    def restore(self) -> None:
        """Put back what :meth:`install_graphs` and :meth:`install_kvdbg` replaced (an engine's step stays)."""
        for owner, name, original in reversed(self._replaced):
            if original is None:
                if name in owner.__dict__:  # (hook_timers(False) takes an inherited hook's timer off the same way)
                    delattr(owner, name)
            else:
                setattr(owner, name, original)
        self._replaced.clear()

    def install_device_waits(self, owners) -> None:
        """--thread-times: the engine's thread's waits on the device (each ``synchronize`` of ``owners``' classes:
        torch.cuda.Event, where vLLM waits for a step's sampled tokens, and torch.cuda.Stream) added up in the step
        being timed (``device_wait_ns``): a step's wall time above its CPU time and these is its thread waiting for
        something else (Python's lock, mostly). Calls on other threads are not counted."""
        timing = self
        for owner in owners:
            original = owner.synchronize

            def synchronize(event, *args, _original=original, **kwargs):
                record = timing.current
                if record is None or threading.get_ident() != timing.engine_thread:
                    return _original(event, *args, **kwargs)
                began = time.perf_counter_ns()
                try:
                    return _original(event, *args, **kwargs)
                finally:
                    record["device_wait_ns"] = record.get("device_wait_ns", 0) + time.perf_counter_ns() - began

            self._replace(owner, "synchronize", synchronize)

    # engine steps
    def install_steps(self, engine) -> None:
        original = engine.step
        timing = self

        def step(*args, **kwargs):
            if not timing.recording:
                return original(*args, **kwargs)
            switched = None
            if timing.switch is not None:  # kvdbg's patches set for this step, before its clock starts
                switched = timing.switch(len(timing.steps))
            record = timing.current = _new_step()
            if switched is not None:
                record["kvdbg"], record["block_first"] = switched
            probe = timing.draw_probe
            counted = None if probe is None else probe[0]._forward_counts.get(probe[1], 0)
            cpu = time.thread_time_ns() if timing.thread_times else None
            timing.engine_thread = threading.get_ident()
            profile = timing.profiles.begin() if timing.profiles is not None else None
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                record["wall_ns"] = time.perf_counter_ns() - start
                if profile is not None:
                    profile.disable()
                if cpu is not None:  # --thread-times: the engine's thread's CPU time in the step (wall above it: waiting)
                    record["cpu_ns"] = time.thread_time_ns() - cpu
                if counted is not None:  # the layer's forwards the step counted: its draws (outside the clock)
                    now = probe[0]._forward_counts.get(probe[1], 0)
                    if now > counted:
                        draws = probe[0].sentinel.sentinel._draws
                        record["drawn"] = any(draws.get(n) for n in range(counted, now))
                if profile is not None:
                    timing.profiles.end(profile, record)
                timing.steps.append(record)
                timing.current = None

        engine.step = step

    def install_gc(self) -> None:
        """Python's garbage collections, each one's pause (from its start to its end, on whichever thread ran it:
        every thread waits for it) added to the step then timed (``gc_ns``; ``gc_full``: those of the oldest
        generation, which walk every object the engine holds). A round's rare long step may be one."""
        import gc

        timing, started = self, {}

        def paused(phase, info):
            if phase == "start":
                started[threading.get_ident()] = time.perf_counter_ns()
                return
            begun, record = started.pop(threading.get_ident(), None), timing.current
            if begun is None or record is None:
                return
            record["gc_ns"] = record.get("gc_ns", 0) + time.perf_counter_ns() - begun
            if info.get("generation") == 2:
                record["gc_full"] = record.get("gc_full", 0) + 1

        gc.callbacks.append(paused)

    # graph replays
    def install_graphs(self) -> None:
        import torch

        graph_cls = torch.cuda.CUDAGraph
        original = graph_cls.replay
        timing = self

        def replay(graph, *args, **kwargs):
            record = timing.current
            if record is None:
                return original(graph, *args, **kwargs)
            if timing.in_program:  # kvdbg's staging program, a graph of its own: not a replay of vLLM's step
                record["program_replays"] = record.get("program_replays", 0) + 1
                # Its device time apart: a drawn step's program runs on the engine's stream before vLLM's sampler.
                start, end = timing._take_events()
                start.record()
                result = original(graph, *args, **kwargs)
                end.record()
                record.setdefault("program_events", []).append((start, end))
                return result
            start, end = timing._take_events()
            start.record()
            result = original(graph, *args, **kwargs)
            end.record()
            record["graph_events"].append((start, end))
            record["replays"] += 1
            return result

        self._replace(graph_cls, "replay", replay)

    def _take_events(self):
        import torch

        if len(self._events) < 2:
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return self._events.pop(), self._events.pop()

    def begin_round(self, expected_steps: int) -> None:
        import torch

        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2 * expected_steps + 64)]
        self.steps = []
        self.recording = True

    def end_round(self) -> list[dict]:
        import torch

        self.recording = False
        torch.cuda.synchronize()
        for record in self.steps:
            record["graph_ms"] = [s.elapsed_time(e) for s, e in record.pop("graph_events")]
            programs = record.pop("program_events", None)
            if programs:  # kvdbg's staging program's replays, on the engine's stream
                record["program_ms"] = sum(s.elapsed_time(e) for s, e in programs)
            handed = record.pop("device_job")
            if handed is not None and handed[2] is not None:
                # A staged step: the staging program on the engine's stream (from the mark to the hook's end), then
                # the capture thread's copies to the host from the staged buffers (from their first to their end).
                start, job, staged_end = handed
                job.finished.wait(60)
                torch.cuda.synchronize()
                begin = getattr(job, "bench_copies_begin", None)
                ends = [e for e in (getattr(job, "bench_engine_end", None), getattr(job, "bench_side_end", None))
                        if e is not None]
                copies = [_elapsed(begin, e) for e in ends] if begin is not None else []
                # The device's own work for the step: the program, the copies issued ahead (from the first to the
                # last, made back to back when the host issued them all before the device reached the first),
                # and each read the capture thread made later (its page ids, the step's metadata), timed alone.
                copies_end, ahead_begin = getattr(job, "bench_copies_end", None), getattr(job, "bench_ahead_begin", None)
                reads = [_elapsed(a, b) for a, b in getattr(job, "bench_reads", [])]
                each = [_elapsed(a, b) for a, b in getattr(job, "bench_each_copy", [])]
                record["device"] = {"engine_ms": start.elapsed_time(staged_end),
                                    "side_ms": max([c for c in copies if c is not None], default=None),
                                    "copies_ms": None if ahead_begin is None or copies_end is None
                                    else _elapsed(ahead_begin, copies_end),
                                    "reads_ms": sum(r for r in reads if r is not None), "reads": len(reads),
                                    # the copies issued ahead each alone: their sum leaves out the gaps where the
                                    # device waited for the capture thread to issue the next one
                                    "copies_busy_ms": None if not each or None in each else sum(each),
                                    "copies_each": len(each),
                                    "device_caught_up": getattr(job, "bench_copies_caught_up", None),
                                    "capture_thread": True, "staged": True,
                                    # Staged by vLLM's graph itself (its staged variant): the program ran inside the
                                    # replay, its time in the step's graph time, not on the engine's stream after.
                                    "in_graph": type(getattr(job.staged, "program", None)).__name__
                                    == "InGraphProgram"}
            elif handed is not None:  # the copies the capture thread issued for this step, from the mark
                start, job, _ = handed
                job.finished.wait(60)
                torch.cuda.synchronize()
                # Timing events the capture thread recorded once it had issued every copy: on its own stream and
                # on capture's side stream; whether the device had already reached the start then.
                engine_end, side_end = getattr(job, "bench_engine_end", None), getattr(job, "bench_side_end", None)
                record["device"] = {"engine_ms": None if engine_end is None else _elapsed(start, engine_end),
                                    "side_ms": None if side_end is None else _elapsed(start, side_end),
                                    "device_caught_up": getattr(job, "bench_caught_up", None),
                                    "capture_thread": True}
            mark = record.pop("device_mark")
            if mark is not None:
                start, engine_end, side_end, caught_up = mark
                record["device"] = {"engine_ms": start.elapsed_time(engine_end), "side_ms": _elapsed(start, side_end),
                                    "device_caught_up": caught_up}
        return self.steps

    def _timed_replay_hook(self, name: str, hook):
        """``hook`` (one of REPLAY_HOOKS) timed into the step's record, with the step it replayed, whether it copied,
        and for a device-timed step the device's marks around its work; a ticketed step's stand-in job made off the
        clock. ``ticket_replayed`` called from within ``after_graph_replay`` (the choice of graph took the ticket)
        is that hook's work, not timed again."""
        import torch

        timing = self
        ticketed = name == "ticket_replayed"

        def timed(state, arg, *args, **kwargs):
            if ticketed:
                if timing.handing is not None:  # within after_graph_replay's clock
                    return hook(state, arg, *args, **kwargs)
                fast, batch = arg, arg[0]
                step = fast[3][4]  # the build's step, as kept on the ticket: no count read here
            else:
                batch = arg
                slots = state._graph_layers.get(batch)
                step = state._forward_counts.get(slots[0].name, 0) if slots else None
                fast = state._in_graph_ran
                if fast is None or len(fast) != 4 or fast[0] != batch:
                    fast = None
            record = timing.current
            device_timed = record is not None and step is not None and step in timing.device_steps
            if device_timed:
                torch.cuda._sleep(timing.sleep_cycles)  # the device stays busy while the hook issues its copies
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            timing.handing = (record, start if device_timed else None)
            if fast is not None:  # a step on its ticket: the stand-in made here, off the hook's clock
                timing.stand_in = _ticket_stand_in(fast, *timing.handing)
            thread = _thread_clock() if timing.thread_times and record is not None else None
            began = time.perf_counter_ns()
            try:
                copied = hook(state, arg, *args, **kwargs)
            finally:
                timing.handing = None
            spent = time.perf_counter_ns() - began
            if record is not None:
                record["hooks"][name] = record["hooks"].get(name, 0) + spent
                if thread is not None:
                    _thread_add(record, name, thread)
                record["replayed_step"], record["copied"] = step, bool(copied)
                if state.sentinel is not None and step is not None:  # the step's draw, as the hook made it
                    record["drawn"] = bool(state.sentinel.sentinel._draws.get(step))
                job, timing.handed_job = (timing.handed_job if copied else None), None
                if device_timed and job is not None and getattr(job, "staged", None) is not None:
                    staged_end = torch.cuda.Event(enable_timing=True)  # after the staging program, engine's stream
                    staged_end.record()
                    record["device_job"] = (start, job, staged_end)
                elif device_timed and job is not None:
                    record["device_job"] = (start, job, None)
                elif device_timed:
                    record["device_mark"] = _device_mark(start)
            return copied

        return timed

    # kvdbg's hooks
    def install_kvdbg(self) -> None:
        import torch

        from kvdbg.capture.capturer import Capturer
        from kvdbg.vllm_plugin import state as plugin_state

        timing = self
        cls = plugin_state._PluginState
        # A step handed on its shape's ticket (graph_hooks._Ticket) has no job yet on the engine's thread: the capture
        # thread makes it. A stand-in takes the job's place here (its step's record, the device start, the program),
        # the real job carries them once made, and its timing events come back to the stand-in when it is done. Put
        # under the hook's timer (which makes the stand-in off its clock), so that it stays with the timers off.
        ticket_replayed, ticket_job = cls.ticket_replayed, cls._ticket_job
        tickets: dict = {}

        def _ticket_replayed(state, fast):
            stand_in, timing.stand_in = timing.stand_in, None
            if stand_in is None:  # made by neither replay hook's timer (the timers off)
                stand_in = _ticket_stand_in(fast, *(timing.handing or (timing.current, None)))
            tickets[id(fast)] = stand_in
            timing.handed_job = stand_in
            return ticket_replayed(state, fast)

        def _ticket_job(state, fast):
            stand_in = tickets.pop(id(fast), None)
            job = ticket_job(state, fast)
            if stand_in is not None:
                if job is None:
                    stand_in.finished.set()
                else:
                    job.bench_record, job.bench_start, job.bench_stand_in = (stand_in.bench_record,
                                                                             stand_in.bench_start, stand_in)
            return job

        self._replace(cls, "ticket_replayed", _ticket_replayed)
        self._replace(cls, "_ticket_job", _ticket_job)
        for name in KVDBG_HOOKS:
            if name not in REPLAY_HOOKS:
                own = cls.__dict__.get(name)
                self._replace(cls, name, _timed(timing, name, getattr(cls, name), "hooks"))
                self._hook_timers.append((cls, name, own, cls.__dict__[name]))
        for name in REPLAY_HOOKS:
            own = cls.__dict__.get(name)
            self._replace(cls, name, self._timed_replay_hook(name, getattr(cls, name)))
            self._hook_timers.append((cls, name, own, cls.__dict__[name]))
        hand_over = cls._hand_over

        def _hand_over(state, job):
            """The job marked with the step's record (the capture thread counts its bytes there) and the start of
            a device-timed step, before the capture thread can take it."""
            job.bench_record, job.bench_start = timing.handing or (timing.current, None)
            timing.handed_job = job
            return hand_over(state, job)

        self._replace(cls, "_hand_over", _hand_over)
        capture_job = cls._capture_graph_job

        def _capture_graph_job(state, job, streams):
            """The capture thread's job; for a device-timed step, as soon as every copy is issued, timing events on
            the thread's stream and on capture's side stream (its pages' copies to the host), and whether the
            device had already reached the start (then the span holds the thread's own time too)."""
            _capturing.job = job
            try:
                capture_job(state, job, streams)
            finally:
                _capturing.job = None
                start = getattr(job, "bench_start", None)
                if start is not None and job.device is not None:
                    from kvdbg.capture.buffers import _side_stream

                    job.bench_caught_up = start.query()
                    stream = streams.get(job.device)
                    if stream is not None:
                        job.bench_engine_end = torch.cuda.Event(enable_timing=True)
                        job.bench_engine_end.record(stream)
                    job.bench_side_end = torch.cuda.Event(enable_timing=True)
                    job.bench_side_end.record(_side_stream(job.device))
                stand_in = getattr(job, "bench_stand_in", None)
                if stand_in is not None:  # a ticket's job: its marks to the stand-in the step's record holds
                    for name, value in vars(job).items() if hasattr(job, "__dict__") else ():
                        if name.startswith("bench_") and name != "bench_stand_in":
                            setattr(stand_in, name, value)
                    stand_in.staged = job.staged
                    stand_in.finished.set()

        self._replace(cls, "_capture_graph_job", _capture_graph_job)
        from kvdbg.vllm_plugin.graph_staging import StagedStep

        unique_ids = StagedStep.unique_ids

        def timed_read(read):
            def staged_read(staged):
                """A staged step's read by the capture thread (its page ids, its metadata), once the program is done
                (the host wait outside the events): on a device-timed step, its device time alone."""
                job = getattr(_capturing, "job", None)
                if job is None or getattr(job, "bench_start", None) is None:
                    return read(staged)
                staged._wait()
                if getattr(job, "bench_copies_begin", None) is None:  # no copies issued ahead: they begin here
                    job.bench_copies_begin = torch.cuda.Event(enable_timing=True)
                    job.bench_copies_begin.record()
                return _events_around(job, "bench_reads", read, staged)
            return staged_read

        self._replace(StagedStep, "unique_ids", timed_read(StagedStep.unique_ids))
        self._replace(StagedStep, "metadata", timed_read(StagedStep.metadata))
        copies_ahead = cls._copies_ahead

        def ahead(state, job):
            """A staged step's copies issued for every layer at once: they begin here, and end with the last one
            issued (whether the device had already reached the first says if they ran back to back); the step's
            copies to the host begin here unless a read began them."""
            timed = getattr(job, "bench_start", None) is not None
            if timed:
                job.bench_ahead_begin = torch.cuda.Event(enable_timing=True)
                job.bench_ahead_begin.record()
                if getattr(job, "bench_copies_begin", None) is None:
                    job.bench_copies_begin = job.bench_ahead_begin
            try:
                return copies_ahead(state, job)
            finally:
                if timed:
                    job.bench_copies_end = torch.cuda.Event(enable_timing=True)
                    job.bench_copies_end.record()
                    job.bench_copies_caught_up = job.bench_ahead_begin.query()

        self._replace(cls, "_copies_ahead", _timed(timing, "copies_ahead", ahead, "inner"))
        from kvdbg.capture.buffers import StepCopies

        def timed_copy(issue):
            def issued(copies, *args, **kwargs):
                """One copy issued ahead by the capture thread (the current stream): on a device-timed step, events
                just before and after it, so that the copies' own device time is known apart from the gaps where
                the device waited for the thread to issue the next one (``bench_each_copy``)."""
                job = getattr(_capturing, "job", None)
                if job is None or getattr(job, "bench_start", None) is None:
                    return issue(copies, *args, **kwargs)
                return _events_around(job, "bench_each_copy", issue, copies, *args, **kwargs)
            return issued

        self._replace(StepCopies, "span_ahead", timed_copy(StepCopies.span_ahead))
        self._replace(StepCopies, "ahead", timed_copy(StepCopies.ahead))
        # The engine's thread's part of a wanted step: the build's copies to the host, the staging program.
        from kvdbg.capture import buffers as capture_buffers
        from kvdbg.vllm_plugin.graph_staging import GraphStager

        self._replace(capture_buffers, "copies_to_host",
                      _timed(timing, "metadata_copy", capture_buffers.copies_to_host, "inner"))
        self._replace(GraphStager, "stage", _timed(timing, "stage", GraphStager.stage, "inner"))
        # Within the stage: the program's run (the counts' copy, the graph's launch, its event); the rest of the
        # stage is its Python and numpy.
        from kvdbg.vllm_plugin.graph_staging import _Program

        timed_run = _timed(timing, "program_run", _Program.run, "inner")

        def run(program, *args, **kwargs):
            """The program's run, marked: its graph's replay is not counted as the step's (``replays``), else a
            step the sentinel drew (which stages its layers) would fall out of every round's decode window."""
            timing.in_program = True
            try:
                return timed_run(program, *args, **kwargs)
            finally:
                timing.in_program = False

        self._replace(_Program, "run", run)
        # A drawn step's own parts (DRAWN_PARTS): a program made (its buffers, page-locked ones among them) and
        # recorded as a CUDA graph, and the sentinel's hand-off of the step's checks.
        self._replace(_Program, "__init__", _timed(timing, "program_new", _Program.__init__, "inner"))
        self._replace(_Program, "_record", _timed(timing, "program_record", _Program._record, "inner"))
        from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

        self._replace(SentinelHooks, "after_graph_replay",
                      _timed(timing, "sentinel_hand", SentinelHooks.after_graph_replay, "inner"))
        # The capture thread's read of a staged step's metadata (the build copies none when a graph replays it).
        self._replace(StagedStep, "metadata", _timed(timing, "metadata_read", StagedStep.metadata, "inner"))
        self._replace(Capturer, "begin", _timed(timing, "begin", Capturer.begin, "inner"))
        # Where a capture's time goes (in the capture thread, for a step replayed from a graph): waiting for the
        # device to pass the build's metadata copies, taking host buffers (a new page-locked one is dear), and
        # issuing the page copies (the buffers' take included).
        from kvdbg.capture.buffers import HostBuffers, HostCopiesReady, StepCopies

        self._replace(HostCopiesReady, "synchronize",
                      _timed(timing, "metadata_wait", HostCopiesReady.synchronize, "inner"))
        self._replace(HostBuffers, "take", _timed(timing, "buffer_take", HostBuffers.take, "inner"))
        self._replace(StepCopies, "gather", _timed(timing, "gather", StepCopies.gather, "inner"))
        finish = _timed(timing, "finish", Capturer.finish, "inner")

        def finish_counting(capturer, pending, *args, **kwargs):
            # In the graph capture thread, the step that handed the job over (the engine is on a later one).
            record = _record_for(timing)
            if record is not None and pending is not None:
                plan = pending.plan
                record["captured_bytes"] += plan.lower_bound_bytes + plan.output_bytes
                record["captures"] += 1
            return finish(capturer, pending, *args, **kwargs)

        self._replace(Capturer, "finish", finish_counting)


def _events_around(job, attr: str, call, *args, **kwargs):
    """``call`` between two timing events on the current stream, the pair added to the job's list ``attr``."""
    import torch

    before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    before.record()
    try:
        return call(*args, **kwargs)
    finally:
        after.record()
        setattr(job, attr, [*getattr(job, attr, []), (before, after)])


def _elapsed(start, end) -> float | None:
    """Milliseconds from ``start`` to ``end``; None when CUDA will not say (``end`` on an idle stream may have
    completed before ``start``: capture then queued nothing there)."""
    try:
        value = start.elapsed_time(end)
    except RuntimeError:
        return None
    return value if value >= 0 else None


# In kvdbg's graph capture thread: the job it is capturing (its step's record is the one to count into).
_capturing = threading.local()


def _record_for(timing: "Timing") -> dict | None:
    job = getattr(_capturing, "job", None)
    return getattr(job, "bench_record", None) if job is not None else timing.current


def _timed(timing: Timing, name: str, original, where: str):
    if timing.thread_times and (name in ENGINE_PARTS or name in CAPTURE_THREAD_PARTS or name in KVDBG_HOOKS):
        return _thread_timed(timing, name, original, where)

    def timed(*args, **kwargs):
        record = _record_for(timing)
        if record is None:
            return original(*args, **kwargs)
        began = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            record[where][name] = record[where].get(name, 0) + time.perf_counter_ns() - began

    return timed


def _thread_timed(timing: Timing, name: str, original, where: str):
    """As _timed, and the calling thread's CPU time and voluntary context switches over the call (read outside
    its wall time), into ``record["thread"][name]``."""
    def timed(*args, **kwargs):
        record = _record_for(timing)
        if record is None:
            return original(*args, **kwargs)
        thread = _thread_clock()
        began = time.perf_counter_ns()
        try:
            return original(*args, **kwargs)
        finally:
            wall = time.perf_counter_ns() - began
            record[where][name] = record[where].get(name, 0) + wall
            _thread_add(record, name, thread)

    return timed


def _ticket_stand_in(fast: tuple, record: dict | None, start) -> types.SimpleNamespace:
    """What stands for a ticketed step's job on the engine's thread (its record, its device start, its program)
    until the capture thread makes the job; made before the replay's hook is timed, so that its event is the
    bench's cost, not kvdbg's."""
    return types.SimpleNamespace(bench_record=record, bench_start=start, finished=threading.Event(),
                                 staged=types.SimpleNamespace(program=fast[1]), device=None)


def _thread_clock() -> tuple[int, int]:
    """The calling thread's voluntary context switches and CPU time so far (``getrusage(RUSAGE_THREAD)``)."""
    import resource

    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw, time.thread_time_ns()


def _thread_add(record: dict, name: str, since: tuple[int, int]) -> None:
    """The thread's CPU time and voluntary switches since ``since`` (:func:`_thread_clock`), added to
    ``record["thread"][name]``; read after the part's wall time was."""
    cpu = time.thread_time_ns() - since[1]
    switches = _thread_clock()[0] - since[0]
    kept = record.setdefault("thread", {}).setdefault(name, {"cpu_ns": 0, "switches": 0})
    kept["cpu_ns"] += cpu
    kept["switches"] += switches


def _device_mark(start):
    """Events after the hook: on the engine's stream and on kvdbg's side stream (its pages' copies to the host)."""
    import torch

    from kvdbg.capture.buffers import _side_stream

    device = torch.device("cuda", torch.cuda.current_device())
    engine_end = torch.cuda.Event(enable_timing=True)
    engine_end.record()
    side_end = torch.cuda.Event(enable_timing=True)
    side_end.record(_side_stream(device))
    return start, engine_end, side_end, start.query()  # query: the device already reached the start


def d2h_bandwidth(nbytes: int = 256 * 1024**2, repeats: int = 5) -> dict:
    """Device-to-host copies of ``nbytes`` into pinned memory (the first one left out): GB/s, median and range."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    rates = []
    for i in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        if i:
            rates.append(nbytes / (start.elapsed_time(end) * 1e-3) / 1e9)
    del source, target
    return {"bytes": nbytes, "gb_s": statistics.median(rates), "min_gb_s": min(rates), "max_gb_s": max(rates)}


# --------------------------------------------------------------------------- rounds and what they show


def decode_window(steps: list[dict]) -> list[dict]:
    """The decode steps of a round that replayed the graph once, the two first and two last left out."""
    graph_steps = [s for s in steps if s.get("replays") == 1]
    return graph_steps[2:-2] if len(graph_steps) >= 12 else graph_steps


def hooks_ns(step: dict) -> int:
    return sum(step.get("hooks", {}).values())


def summarize_round(steps: list[dict], window: list[dict] | None = None) -> dict:
    """One round: its decode steps' wall time (mean and median), graph device time, kvdbg's hooks per step;
    ``window``: the decode steps to take (default ``decode_window(steps)``)."""
    window = decode_window(steps) if window is None else window
    if not window:
        return {"steps": len(steps), "decode_steps": 0}
    walls = [s["wall_ns"] / 1e6 for s in window]
    graphs = [s["graph_ms"][0] for s in window if s.get("graph_ms")]
    split = drawn_split(steps, window) if any("drawn" in s for s in window) else None
    return {"steps": len(steps), "decode_steps": len(window), "step_ms": statistics.fmean(walls),
            **({} if split is None else {"drawn_split": split}),
            # Python's garbage collections in the window's steps (Timing.install_gc): their pauses, those of the
            # oldest generation, and the steps' mean with the pauses taken out
            "gc_ms": sum(s.get("gc_ns", 0) for s in window) / 1e6, "gc_full": sum(s.get("gc_full", 0) for s in window),
            "step_ms_without_gc": statistics.fmean((s["wall_ns"] - s.get("gc_ns", 0)) / 1e6 for s in window),
            # the longest step, and the mean without it: a round whose excess is one stall shows it here
            "step_ms_max": max(walls),
            "step_ms_trimmed": statistics.fmean(sorted(walls)[:-1]) if len(walls) > 1 else walls[0],
            "step_ms_median": statistics.median(walls),
            "graph_ms": statistics.median(graphs) if graphs else None,
            "hooks_us": statistics.median(hooks_ns(s) / 1e3 for s in window),
            "hooks_us_mean": statistics.fmean(hooks_ns(s) / 1e3 for s in window),
            "hooks_us_max": max(hooks_ns(s) / 1e3 for s in window),
            "hooks_us_by_name": {name: statistics.median(s["hooks"].get(name, 0) / 1e3 for s in window)
                                 for name in KVDBG_HOOKS},
            # Means apart: a step the sentinel checked, and the next one's collecting its check, are rare and dear.
            "hooks_us_mean_by_name": {name: statistics.fmean(s["hooks"].get(name, 0) / 1e3 for s in window)
                                      for name in KVDBG_HOOKS},
            # --thread-times: the same hooks' CPU time on the engine's thread (wall far above it: waiting)
            **({"hooks_cpu_us_mean_by_name": {name: statistics.fmean(_hook_cpu_ns(s, name) / 1e3 for s in window)
                                              for name in KVDBG_HOOKS}}
               if any(name in s.get("thread", {}) for s in window for name in KVDBG_HOOKS) else {})}


def _hook_cpu_ns(step: dict, name: str) -> int:
    return step.get("thread", {}).get(name, {}).get("cpu_ns", 0)


def drawn_split(steps: list[dict], window: list[dict]) -> dict:
    """Where a sentinel round's time goes: the steps the sentinel drew (staged and handed to its worker) and the
    ``FOLLOWING_STEPS`` after each (its check runs in the worker meanwhile, sharing the interpreter's lock), each
    against the median of the window's other steps. ``share``: what those added, over the window's whole time."""
    taken = {id(s) for s in window}
    at = {id(s): i for i, s in enumerate(steps)}
    drawn = [s for s in window if s.get("drawn")]
    near: set[int] = set()
    following: list[list[dict]] = []
    for s in drawn:
        i = at[id(s)]
        after = [t for t in steps[i + 1: i + 1 + FOLLOWING_STEPS] if id(t) in taken]
        following.append(after)
        near.update([id(s)] + [id(t) for t in after])
    quiet = [s for s in window if id(s) not in near]
    out: dict = {"drawn": len(drawn), "steps": len(window)}
    if not drawn or not quiet:
        return out
    base = statistics.median(s["wall_ns"] for s in quiet)
    drawn_added = [s["wall_ns"] - base for s in drawn]
    after_added = [sum(t["wall_ns"] - base for t in after) for after in following]
    programs = [s["program_ms"] for s in drawn if s.get("program_ms") is not None]
    if programs:  # the staging program's device time in a drawn step (its replay, between two events)
        out["drawn_program_ms"] = statistics.fmean(programs)
    parts = {name for s in drawn for name in s.get("inner", {})}
    if parts:  # the rounds with the bench's timers on: where a drawn step's hooks went (means over drawn steps)
        out["drawn_parts_us"] = {name: statistics.fmean(s.get("inner", {}).get(name, 0) for s in drawn) / 1e3
                                 for name in sorted(parts)}
    if all("cpu_ns" in s for s in window):  # --thread-times: the same on the engine's thread's CPU (the rest: waiting)
        base_cpu = statistics.median(s["cpu_ns"] for s in quiet)
        out["drawn_cpu_added_ms"] = statistics.fmean(s["cpu_ns"] - base_cpu for s in drawn) / 1e6
        out["after_cpu_added_ms"] = statistics.fmean(sum(t["cpu_ns"] - base_cpu for t in after)
                                                     for after in following) / 1e6
        base_wait = statistics.median(s.get("device_wait_ns", 0) for s in quiet)  # its waits on the device
        out["drawn_wait_added_ms"] = statistics.fmean(s.get("device_wait_ns", 0) - base_wait for s in drawn) / 1e6
        out["after_wait_added_ms"] = statistics.fmean(sum(t.get("device_wait_ns", 0) - base_wait for t in after)
                                                      for after in following) / 1e6
    if any("where" in s for s in window):  # --where: the engine thread's frames, sampled while a step was timed
        out["where"] = {"drawn_steps": len(drawn), "quiet_steps": len(quiet),
                        "after_steps": sum(len(after) for after in following),
                        "drawn": dict(Counter(w for s in drawn for w in s.get("where", ()))),
                        "quiet": dict(Counter(w for s in quiet for w in s.get("where", ()))),
                        "after": dict(Counter(w for after in following for s in after for w in s.get("where", ())))}
    out.update(drawn_added_ms=statistics.fmean(drawn_added) / 1e6, after_added_ms=statistics.fmean(after_added) / 1e6,
               drawn_hooks_us=statistics.fmean(hooks_ns(s) for s in drawn) / 1e3,
               quiet_hooks_us=statistics.median(hooks_ns(s) for s in quiet) / 1e3,
               share=(sum(drawn_added) + sum(after_added)) / sum(s["wall_ns"] for s in window))
    return out


def summarize_wanted(steps: list[dict], wanted: int) -> dict:
    """A round with one wanted step: what it added to the engine's thread (hooks, and the step's wall time),
    its bytes, and (when device-timed) its copies' device time; against the round's other decode steps."""
    window = decode_window(steps)
    hits = [s for s in steps if s.get("replayed_step") == wanted]
    others = [s for s in window if s.get("replayed_step") != wanted and not s.get("copied")]
    out = {"wanted_step": wanted, "found": bool(hits), "copied": bool(hits and hits[0].get("copied"))}
    if not hits or not others:
        return out
    hit = hits[0]
    base_hooks = statistics.median(hooks_ns(s) for s in others)
    base_wall = statistics.median(s["wall_ns"] for s in others)
    # The steps after it: the writer thread now works on the capture, sharing the interpreter's lock.
    at = next(i for i, s in enumerate(steps) if s is hit)
    following = steps[at + 1: at + 1 + FOLLOWING_STEPS]
    out.update(hooks_us=hooks_ns(hit) / 1e3, hooks_added_us=(hooks_ns(hit) - base_hooks) / 1e3,
               step_ms=hit["wall_ns"] / 1e6, step_added_ms=(hit["wall_ns"] - base_wall) / 1e6,
               following_added_ms=sum(s["wall_ns"] - base_wall for s in following) / 1e6,
               inner_us={k: v / 1e3 for k, v in hit.get("inner", {}).items()},
               thread={k: {"cpu_us": v["cpu_ns"] / 1e3, "switches": v["switches"]}
                       for k, v in hit.get("thread", {}).items() if k not in KVDBG_HOOKS},
               hooks_added_by_name_us={name: (hit["hooks"].get(name, 0)
                                              - statistics.median(s["hooks"].get(name, 0) for s in others)) / 1e3
                                       for name in KVDBG_HOOKS},
               captured_bytes=hit.get("captured_bytes", 0), captures=hit.get("captures", 0))
    if any(name in hit.get("thread", {}) for name in KVDBG_HOOKS):  # --thread-times: the same, in CPU time
        out["hooks_cpu_added_by_name_us"] = {
            name: (_hook_cpu_ns(hit, name) - statistics.median(_hook_cpu_ns(s, name) for s in others)) / 1e3
            for name in KVDBG_HOOKS}
    if hit.get("device"):
        device = hit["device"]
        if device.get("staged"):  # the staging on the engine's stream, then the copies from the staged buffers
            span = (device["engine_ms"] or 0.0) + (device["side_ms"] or 0.0)
            # The device's work: the program, the copies issued ahead (each one's own time where each was timed:
            # not the gaps where the device waited for the capture thread to issue the next), the reads; the span
            # above also holds the capture thread's host time between them (its stream idle, waiting for the thread).
            copies = device.get("copies_busy_ms")
            copies = device.get("copies_ms") if copies is None else copies
            work = None if copies is None else (device["engine_ms"] or 0.0) + copies + device.get("reads_ms", 0.0)
            if device.get("in_graph"):
                # The program ran inside the graph: what the staged graph took over the plain ones the round's other
                # steps replayed (the layers' query and output copies and the staging) is the device's work too.
                others_graph = [sum(s["graph_ms"]) for s in others if s.get("graph_ms")]
                extra = None if not hit.get("graph_ms") or not others_graph else \
                    max(0.0, sum(hit["graph_ms"]) - statistics.median(others_graph))
                device = {**device, "graph_extra_ms": extra}
                work = None if work is None or extra is None else work + extra
        else:
            span = max(device["engine_ms"] or 0.0, device["side_ms"] or 0.0)
            work = span
        out["device"] = {**device, "span_ms": span, "work_ms": work}
    return out


def spread(values: list[float]) -> dict:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {}
    return {"median": statistics.median(values), "min": values[0], "max": values[-1], "n": len(values)}


def interval(values: list[float], statistic, resamples: int = INTERVAL_RESAMPLES,
             level: float = INTERVAL_LEVEL) -> list[float] | None:
    """The ``level`` percentile interval of ``statistic`` over ``values`` by the bootstrap (the rounds resampled with
    replacement, ``resamples`` times, from a fixed seed), or None under 4 values. A paired figure's rounds vary by
    several percent where its line is 1 or 2 % over 1: whether they can tell met from missed is its interval's
    side of the line."""
    if len(values) < 4:
        return None
    rng = random.Random(0)
    n = len(values)
    stats = sorted(statistic([values[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return [stats[round((1 - level) / 2 * resamples)], stats[round((1 + level) / 2 * resamples) - 1]]


def ratio_of_rounds(rounds: list[dict], baseline_rounds: list[dict], key: str = "step_ms") -> dict:
    """Median over rounds against the baseline's median, and each round's value over that median (its spread)."""
    mine = [r[key] for r in rounds if r.get(key) is not None]
    base = [r[key] for r in baseline_rounds if r.get(key) is not None]
    if not mine or not base:
        return {}
    reference = statistics.median(base)
    return {"ratio": statistics.median(mine) / reference, "rounds": spread([v / reference for v in mine]),
            "value": statistics.median(mine), "baseline": reference}


def paired_figure(rounds: list[dict], bypassed: list[dict], graph: dict, baseline_rounds: list[dict],
                  block: int | None = None, over: str = "median") -> dict:
    """kvdbg's cost on the step from within its own process: in each round, its steps with kvdbg against its steps
    with kvdbg's patches off (``run_interleaved_rounds``; ``rounds`` and ``bypassed`` summarise the two halves of
    each round, ``block`` steps a block), times what kvdbg's copies recorded into the graph add on the device,
    which both halves share (the graph's device time against the kvdbg-absent engine's, over that engine's step:
    the most it can add, were the step waiting for the device throughout). {} without both halves.

    ``over``: how the rounds' ratios make the figure. ``median`` (capture armed: a cost on every step, and a round
    that a stray stall hit left out); ``mean`` (the sentinel: its cost comes in draws a round or two in three
    holds, so the median of the rounds falls on a round with a draw or on one without, as the draws happen to
    lie, where the mean counts each draw at its weight in the long run, which the line is about)."""
    pairs = [a["step_ms"] / b["step_ms"] for a, b in zip(rounds, bypassed)
             if a.get("step_ms") and b.get("step_ms")]
    if not pairs:
        return {}
    host = {**spread(pairs), "mean": statistics.fmean(pairs),
            "interval": interval(pairs, statistics.median if over == "median" else statistics.fmean)}
    out = {"host": host, "pairs": len(pairs), "block": block, "over": over}
    if any(a.get("drawn_split") for a in rounds):  # the sentinel's: its rounds by the draws in their kvdbg half
        groups: dict[int, list[float]] = {}
        for a, b in zip(rounds, bypassed):
            if a.get("step_ms") and b.get("step_ms"):
                groups.setdefault((a.get("drawn_split") or {}).get("drawn", 0), []).append(a["step_ms"] / b["step_ms"])
        out["by_draws"] = {str(k): {"rounds": len(v), "mean": statistics.fmean(v)} for k, v in sorted(groups.items())}
    if any("gc_ms" in a for a in rounds):  # Python's garbage collections in each half, and the pairs without them
        kept = [(a, b) for a, b in zip(rounds, bypassed) if a.get("step_ms_without_gc") and b.get("step_ms_without_gc")]
        out["gc"] = {"kvdbg_ms": sum(a.get("gc_ms", 0) for a, _ in kept),
                     "bypassed_ms": sum(b.get("gc_ms", 0) for _, b in kept),
                     "kvdbg_full": sum(a.get("gc_full", 0) for a, _ in kept),
                     "bypassed_full": sum(b.get("gc_full", 0) for _, b in kept),
                     "host_without": {**spread([a["step_ms_without_gc"] / b["step_ms_without_gc"] for a, b in kept]),
                                      "mean": statistics.fmean(a["step_ms_without_gc"] / b["step_ms_without_gc"]
                                                               for a, b in kept) if kept else None}}
    trimmed = [(a, b) for a, b in zip(rounds, bypassed) if a.get("step_ms_trimmed") and b.get("step_ms_trimmed")]
    if trimmed:  # each half without its longest step
        pairs_trimmed = [a["step_ms_trimmed"] / b["step_ms_trimmed"] for a, b in trimmed]
        out["trimmed"] = {**spread(pairs_trimmed), "mean": statistics.fmean(pairs_trimmed),
                          "longest_ms": spread([a["step_ms_max"] for a, _ in trimmed]),
                          "longest_bypassed_ms": spread([b["step_ms_max"] for _, b in trimmed])}
    base_step = statistics.median(r["step_ms"] for r in baseline_rounds if r.get("step_ms")) \
        if any(r.get("step_ms") for r in baseline_rounds) else None
    if graph.get("value") is not None and graph.get("baseline") is not None and base_step:
        device = 1.0 + max(0.0, graph["value"] - graph["baseline"]) / base_step
        out.update(device=device, ratio=host[over] * device,
                   interval=None if host["interval"] is None else [v * device for v in host["interval"]])
    return out


def judged(step: dict, paired: dict, line: float) -> dict:
    """The figure a line is judged on: the paired one where it could be made (one process: the drift between
    two processes, ``baseline_drift``, is larger than these lines), else the ratio across processes."""
    if paired.get("ratio") is not None:
        # Whether the rounds tell met from missed: the figure's interval wholly on one side of the line (None: too
        # few rounds for one). Said beside the verdict, which stays the figure's own.
        bounds = paired.get("interval")
        resolved = None if bounds is None else (bounds[1] <= line or bounds[0] > line)
        return {"paired": paired, "judged_on": "paired", "met": paired["ratio"] <= line, "resolved": resolved}
    return {"paired": paired, "judged_on": "processes", "met": step.get("ratio", 99) <= line}


def _hooks_by_name(rounds: list[dict]) -> dict:
    """Each hook's mean time a step, the median over ``rounds``: wall, and (--thread-times) the engine's thread's
    CPU time."""
    out = {"hooks_us_mean_by_name": {name: spread([r.get("hooks_us_mean_by_name", {}).get(name)
                                                   for r in rounds]).get("median") for name in KVDBG_HOOKS}}
    if any("hooks_cpu_us_mean_by_name" in r for r in rounds):
        out["hooks_cpu_us_mean_by_name"] = {name: spread([r.get("hooks_cpu_us_mean_by_name", {}).get(name)
                                                          for r in rounds]).get("median") for name in KVDBG_HOOKS}
    return out


def _thread_figures(timed: list[dict]) -> dict:
    """--thread-times: per engine-thread part, its wall time, its thread CPU time and its voluntary switches
    (spreads over the timed wanted steps); {} without."""
    names = sorted({k for w in timed for k in w.get("thread", {})})
    return {k: {"wall_us": spread([w.get("inner_us", {}).get(k) for w in timed if k in w.get("thread", {})]),
                "cpu_us": spread([w["thread"][k]["cpu_us"] for w in timed if k in w.get("thread", {})]),
                "switches": spread([w["thread"][k]["switches"] for w in timed if k in w.get("thread", {})])}
            for k in names}


def figures(records: dict[str, dict]) -> dict:
    """The three figures (and what stands beside them) from the parts' records; pure, for tests."""
    out: dict = {}
    base = records.get("baseline", {}).get("phases", {}).get("rounds", [])
    base2 = records.get("baseline2", {}).get("phases", {}).get("rounds", [])
    baseline_rounds = base + base2
    if base and base2:
        out["baseline_drift"] = ratio_of_rounds(base2, base)
        # The same for the graph's device time: what the paired figure's device part (kvdbg's process against the
        # kvdbg-absent ones) cannot be told from.
        out["baseline_drift_graph"] = ratio_of_rounds(base2, base, "graph_ms")
    capture = records.get("capture", {}).get("phases", {})
    if capture.get("armed") and baseline_rounds:
        step = ratio_of_rounds(capture["armed"], baseline_rounds)
        graph = ratio_of_rounds(capture["armed"], baseline_rounds, "graph_ms")
        hooked = capture.get("timed") or capture["armed"]  # the hooks' time, from the rounds that timed them
        out["armed"] = {**step, "line": ARMED_LINE, "graph": graph,
                        "hooks_us": spread([r.get("hooks_us") for r in hooked]),
                        "hooks_us_mean": spread([r.get("hooks_us_mean") for r in hooked]),
                        **_hooks_by_name(hooked),
                        "with_hook_timers": paired_figure(capture.get("timed", []), capture.get("timed_bypassed", []),
                                                          graph, baseline_rounds,
                                                          records["capture"].get("interleaved_block")),
                        **judged(step, paired_figure(capture["armed"], capture.get("bypassed", []), graph,
                                                     baseline_rounds, records["capture"].get("interleaved_block")),
                                 ARMED_LINE)}
    wanted = capture.get("wanted", [])
    timed = [w for w in wanted if w.get("role") == "engine" and "hooks_added_us" in w]
    if timed:
        # The hand-off in the wanted step's hooks, and the next step's wait for the capture thread's copies.
        added = spread([w["hooks_added_us"] + w.get("waited_us", 0.0) for w in timed])
        out["wanted_engine"] = {"added_us": added, "line_us": WANTED_ENGINE_US_LINE,
                                "met": added["median"] <= WANTED_ENGINE_US_LINE,
                                "handoff_us": spread([w["hooks_added_us"] for w in timed]),
                                "waited_us": spread([w.get("waited_us", 0.0) for w in timed]),
                                "step_added_ms": spread([w["step_added_ms"] for w in timed]),
                                "bytes": spread([w["captured_bytes"] for w in timed]),
                                # the capture thread's time per part (begin, metadata_wait, buffer_take, ...)
                                "inner_us": {k: spread([w.get("inner_us", {}).get(k) for w in timed])
                                             for k in sorted({k for w in timed for k in w.get("inner_us", {})})},
                                "hooks_added_by_name_us": {
                                    k: spread([w.get("hooks_added_by_name_us", {}).get(k) for w in timed])
                                    for k in sorted({k for w in timed for k in w.get("hooks_added_by_name_us", {})})},
                                "hooks_cpu_added_by_name_us": {
                                    k: spread([w.get("hooks_cpu_added_by_name_us", {}).get(k) for w in timed])
                                    for k in sorted({k for w in timed for k in w.get("hooks_cpu_added_by_name_us", {})})},
                                "thread": _thread_figures(timed),
                                "first": next((w for w in wanted if w.get("role") == "warm-up"), None)}
    device = [w for w in wanted if w.get("role") == "device" and w.get("device")]
    bandwidth = capture.get("d2h", {}).get("gb_s")
    if device and bandwidth:
        def device_ms(w: dict) -> float:  # the device's work where the run could tell it apart, else the span
            work = w["device"].get("work_ms")
            return w["device"]["span_ms"] if work is None else work

        ratios = [device_ms(w) / (w["captured_bytes"] / (bandwidth * 1e9) * 1e3) for w in device
                  if w.get("captured_bytes")]
        if ratios:
            r = spread(ratios)
            out["wanted_device"] = {"ratio": r, "line": WANTED_DEVICE_LINE, "met": r["median"] <= WANTED_DEVICE_LINE,
                                    "device_ms": spread([device_ms(w) for w in device]),
                                    "judged_on": "work" if all(w["device"].get("work_ms") is not None
                                                               for w in device) else "span",
                                    "copies_ms": spread([w["device"].get("copies_ms") for w in device]),
                                    "copies_busy_ms": spread([w["device"].get("copies_busy_ms") for w in device]),
                                    "reads_ms": spread([w["device"].get("reads_ms") for w in device]),
                                    "span_ms": spread([w["device"]["span_ms"] for w in device]),
                                    "engine_stream_ms": spread([w["device"]["engine_ms"] for w in device]),
                                    "in_graph": sum(bool(w["device"].get("in_graph")) for w in device),
                                    "graph_extra_ms": spread([w["device"].get("graph_extra_ms") for w in device]),
                                    "copy_at_bandwidth_ms": spread([w["captured_bytes"] / (bandwidth * 1e9) * 1e3
                                                                    for w in device]),
                                    "d2h_gb_s": bandwidth,
                                    "device_caught_up": sum(bool(w["device"]["device_caught_up"]) for w in device)}
    sentinel_phases = records.get("sentinel", {}).get("phases", {})
    sentinel = sentinel_phases.get("rounds", [])
    if sentinel and baseline_rounds:
        step = ratio_of_rounds(sentinel, baseline_rounds)
        graph = ratio_of_rounds(sentinel, baseline_rounds, "graph_ms")
        hooked = sentinel_phases.get("timed") or sentinel
        out["sentinel"] = {**step, "line": SENTINEL_LINE, "graph": graph,
                           **judged(step, paired_figure(sentinel, sentinel_phases.get("bypassed", []), graph,
                                                        baseline_rounds,
                                                        records["sentinel"].get("interleaved_block"), "mean"),
                                    SENTINEL_LINE),
                           "with_hook_timers": paired_figure(sentinel_phases.get("timed", []),
                                                             sentinel_phases.get("timed_bypassed", []), graph,
                                                             baseline_rounds,
                                                             records["sentinel"].get("interleaved_block"), "mean"),
                           "hooks_us": spread([r.get("hooks_us") for r in hooked]),
                           "hooks_us_mean": spread([r.get("hooks_us_mean") for r in hooked]),
                           **_hooks_by_name(hooked),
                           **_sentinel_split(records["sentinel"])}
        if records["sentinel"].get("worker_check", "real") != "real":  # a diagnostic: nothing was compared
            out["sentinel"].update(worker_check=records["sentinel"]["worker_check"], met=True, diagnostic=True)
        elif records["sentinel"].get("profile"):  # a diagnostic: every Python call in its steps made dearer
            out["sentinel"].update(met=True, diagnostic=True)
    elif sentinel:  # no kvdbg-absent rounds to hold it to (a run of the sentinel alone): where its time went only
        out["sentinel_alone"] = _sentinel_split(records["sentinel"])
    return out


def _sentinel_split(record: dict) -> dict:
    """What the sentinel's part says beside its figure: its counts, draws and checks, and where its rounds' time went
    (the drawn steps and those after them, against the others: no baseline needed)."""
    phases = record.get("phases", {})
    return {"counts": record.get("sentinel_counts"),
            "draws": record.get("sentinel_draws"),
            "worker_checks": _worker_checks(record.get("sentinel_checks")),
            "reference": record.get("sentinel_reference"),
            "drawn_split": _split_over_rounds(phases.get("rounds", [])),
            "drawn_split_timed": _split_over_rounds(phases.get("timed", [])),
            "profile": record.get("profile")}


def _worker_checks(checks: list[dict] | None) -> dict | None:
    """The worker's checks (:func:`wrap_worker_checks`): how many, and the spread of each one's wall time, CPU time
    and switches."""
    if not checks:
        return None
    thread = [c for c in checks if not c.get("process")]
    process = [c for c in checks if c.get("process")]
    return {"checks": len(checks), "in_process": len(process),
            **{key: spread([c.get(key) for c in thread]) for key in ("wall_us", "cpu_us", "switches", "device_us")},
            **{key: spread([c.get(key) for c in process]) for key in ("send_us", "send_cpu_us", "answer_us")},
            **({} if not process else {"buffers": [process[0].get("buffers"), process[-1].get("buffers")],
                                       "layers_given": [process[0].get("layers_given"),
                                                        process[-1].get("layers_given")],
                                       "templates": [process[0].get("templates"), process[-1].get("templates")]})}


def log_draws(state, timing: "Timing") -> list[dict]:
    """Each step the sentinel draws, as it draws it: the step's number, the bench's step it was drawn in (its index,
    whether one was being timed), the thread that asked, and the probe layer's count then. What the step marks
    (``drawn``) are checked against. Since 2026-12-06 a graph's steps that nothing wants are told up to 32 steps ahead
    (graph_hooks._QuietRun), their draws made then: a step's draw may come several bench steps before the step, with
    the probe's count below its number."""
    sentinel = state.sentinel.sentinel
    real, main, log = sentinel.drawn, threading.get_ident(), []

    def drawn(step):
        new = step not in sentinel._draws
        hit = real(step)
        if hit and new:
            log.append({"step": step, "bench_step": len(timing.steps), "timed": timing.current is not None,
                        "engine_thread": threading.get_ident() == main,
                        "probe_count": state._forward_counts.get(timing.draw_probe[1], 0)})
        return hit

    sentinel.drawn = drawn  # the instance's: every hook asks through it
    return log


def idle_check(idle_ms: float):
    """``--worker-check idle`` (a diagnostic, never a figure): the sentinel worker's check replaced by a wait for the
    step's staging on the device, then ``idle_ms`` of sleep, which hold nothing the engine's thread wants (the
    interpreter's lock, the device), and results with nothing compared. A drawn step that still costs what it did
    with the real check spends that time elsewhere than in the check."""
    import torch

    nothing_compared = _idle_checker().nothing_compared

    def check_layers(entries, *args, step=None, **kwargs):
        torch.cuda.current_stream().synchronize()  # the worker's stream, after the staging's event
        time.sleep(idle_ms / 1e3)
        return nothing_compared(entries, step)

    return check_layers


def _idle_checker():
    """bench/_idle_checker.py, beside this file (the stand-in checks of --worker-check; imported when asked)."""
    import _idle_checker

    return _idle_checker


class StepProfiles:
    """``--profile`` (a diagnostic): each timed step's Python on the engine's thread under ``cProfile`` (which makes
    every Python call dearer: the step times of such a run are no figure), kept by kind of step: the sentinel's
    drawn steps, the ``FOLLOWING_STEPS`` after each, and quiet steps (kvdbg on, none drawn within as many steps
    before; up to ``QUIET_KEPT``). :meth:`excess` says which functions a drawn step, and a step after one, spent
    more time in than a quiet step: a function's own time (``tottime``) and with its callees (``cumtime``)."""

    QUIET_KEPT = 400

    def __init__(self):
        self.kept: dict[str, list] = {"drawn": [], "after": [], "quiet": []}
        self._since_drawn = None  # steps since the last drawn one

    def begin(self):
        import cProfile

        profile = cProfile.Profile()
        profile.enable()
        return profile

    def end(self, profile, record: dict) -> None:
        if record.get("drawn"):
            kind, self._since_drawn = "drawn", 0
        elif self._since_drawn is not None and self._since_drawn < FOLLOWING_STEPS:
            kind = "after"
            self._since_drawn += 1
        else:
            kind, self._since_drawn = "quiet", None
        if kind == "quiet" and (not record.get("kvdbg", True) or len(self.kept["quiet"]) >= self.QUIET_KEPT):
            return
        self.kept[kind].append(profile)

    def excess(self, top: int = 12) -> dict:
        """Per kind: its steps, and the ``top`` functions by time a step above a quiet step's (us), own and
        cumulative."""
        import pstats

        def per_step(profiles: list) -> dict:
            if not profiles:
                return {}
            stats = pstats.Stats(profiles[0])
            for other in profiles[1:]:
                stats.add(other)
            return {_function_name(key): (tt / len(profiles), ct / len(profiles))
                    for key, (_, _, tt, ct, _) in stats.stats.items()}

        quiet = per_step(self.kept["quiet"])
        out: dict = {f"{kind}_steps": len(self.kept[kind]) for kind in self.kept}
        if not quiet:
            return out
        for kind in ("drawn", "after"):
            mine = per_step(self.kept[kind])
            if not mine:
                continue
            for column, which in (("own", 0), ("cumulative", 1)):
                more = {name: (mine.get(name, (0, 0))[which] - quiet.get(name, (0, 0))[which]) * 1e6
                        for name in set(mine) | set(quiet)}
                out[f"{kind}_{column}"] = sorted(([name, round(us, 1)] for name, us in more.items()),
                                                 key=lambda x: -x[1])[:top]
            out[f"{kind}_total_us"] = round(sum(tt for tt, _ in mine.values()) * 1e6, 1)
        out["quiet_total_us"] = round(sum(tt for tt, _ in quiet.values()) * 1e6, 1)
        return out


def _function_name(key: tuple) -> str:
    file, line, name = key
    return name if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line} {name}"


def profile_lines(profile: dict | None) -> list[str]:
    """--profile: what a drawn step, and a step after one, spent above a quiet step, by function."""
    if not profile or not profile.get("quiet_steps"):
        return []
    lines = []
    for kind, what in (("drawn", "a drawn step"), ("after", "a step after one")):
        if not profile.get(f"{kind}_own"):
            continue
        lines.append(f"profile: {what} ({profile[f'{kind}_steps']} steps) {profile[f'{kind}_total_us']:.0f} us "
                     f"of Python under the profiler, a quiet step ({profile['quiet_steps']}) "
                     f"{profile['quiet_total_us']:.0f} us; its extra by function, own time:")
        lines += [f"  {us:+8.1f} us  {name}" for name, us in profile[f"{kind}_own"]]
        lines.append("  ... and with their callees:")
        lines += [f"  {us:+8.1f} us  {name}" for name, us in profile[f"{kind}_cumulative"]]
    return lines


class StackSampler:
    """``--where MS`` (a diagnostic): every MS ms while a step is timed, the engine's thread's three innermost frames
    are kept on the step's record (``where``). The sampler takes the interpreter's lock to look, so a sample falls
    where the engine's thread let it go: in a wait (the device, a queue, the lock itself) or a call into C. A drawn
    step's samples against a quiet step's say where the drawn step's extra time is spent."""

    def __init__(self, timing: "Timing", interval_ms: float):
        self.timing, self.interval = timing, interval_ms / 1e3
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-where", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        timing = self.timing
        while not self._stop.wait(self.interval):
            record, thread = timing.current, timing.engine_thread
            if record is None or thread is None:
                continue
            frame = sys._current_frames().get(thread)
            if frame is not None:
                record.setdefault("where", []).append(frame_key(frame))


def frame_key(frame, depth: int = 3) -> str:
    """``file:line function`` of a frame and its callers, innermost first (paths cut to their last two parts)."""
    names = []
    while frame is not None and len(names) < depth:
        code = frame.f_code
        names.append(f"{'/'.join(code.co_filename.split('/')[-2:])}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(names)


def stand_in_checker(mode: str, ms: float) -> None:
    """``--worker-check idle|spin`` on the checker process's path: the sentinel starts ``bench/_idle_checker.py``
    in place of kvdbg's child. It receives and rebuilds every check as the child does, then sleeps (``idle``) or
    spins one CPU core (``spin``) ``ms`` in place of the check, without the device, and compares nothing."""
    from kvdbg.sentinel import remote

    stand_in, real_init = _idle_checker().command(mode, ms), remote.CheckerProcess.__init__

    def init(self, device, *args, command=None, **kwargs):
        real_init(self, device, *args, command=command or stand_in, **kwargs)

    remote.CheckerProcess.__init__ = init


def wrap_worker_checks(timing: "Timing", idle_ms: float | None = None) -> list[dict]:
    """Each check the sentinel's worker thread makes (``checker.check_layers`` on its thread): its wall time, its
    CPU time (the part that can hold the interpreter's lock the engine's thread wants), voluntary switches, the
    bench's step when it began, and on a GPU its span on the worker's stream (from before its first kernel to after
    its last: the device's work and the gaps while the worker launched). Checks on other threads are not timed."""
    from kvdbg.sentinel import checker

    try:
        import torch
    except ImportError:  # pragma: no cover - kvdbg's checker needs it anyway
        torch = None
    real, log = checker.check_layers if idle_ms is None else idle_check(idle_ms), timing.worker_checks

    def check_layers(entries, *args, **kwargs):
        if threading.current_thread().name != "kvdbg-sentinel":
            return real(entries, *args, **kwargs)
        marks = None
        if torch is not None and torch.cuda.is_available():  # the check's span on the worker's stream
            marks = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            marks[0].record()
        clock, began, bench_step = _thread_clock(), time.perf_counter_ns(), len(timing.steps)
        try:
            return real(entries, *args, **kwargs)
        finally:
            wall = time.perf_counter_ns() - began
            switches, cpu = _thread_clock()
            entry = {"step": kwargs.get("step"), "layers": len(entries), "bench_step": bench_step,
                     "wall_us": wall / 1e3, "cpu_us": (cpu - clock[1]) / 1e3, "switches": switches - clock[0]}
            if marks is not None:
                marks[1].record()
                marks[1].synchronize()  # the worker synchronises its stream next anyway
                entry["device_us"] = marks[0].elapsed_time(marks[1]) * 1e3
            log.append(entry)

    checker.check_layers = check_layers  # the worker's loop reads the module's name on each job
    from kvdbg.sentinel import remote

    real_submit, real_answers = remote.CheckerProcess.submit, remote.CheckerProcess.answers
    waiting: collections.deque = collections.deque()  # the process's checks sent, their answers not read yet

    def submit(self, entries, *args, **kwargs):  # the engine's thread pickles and sends a staged step's check
        clock, began, bench_step = _thread_clock(), time.perf_counter_ns(), len(timing.steps)
        try:
            return real_submit(self, entries, *args, **kwargs)
        finally:
            sent = time.perf_counter_ns()
            switches, cpu = _thread_clock()
            entry = {"step": kwargs.get("step"), "layers": len(entries), "bench_step": bench_step, "process": True,
                     "send_us": (sent - began) / 1e3, "send_cpu_us": (cpu - clock[1]) / 1e3, "sent_ns": sent,
                     # buffers shared with the child and layers given to it so far (each once: a check's
                     # metadata travels by value); None from a kvdbg before those counts (a run against older code)
                     "buffers": getattr(self, "shares", None), "layers_given": getattr(self, "defines", None),
                     "templates": getattr(self, "templates", None)}
            log.append(entry)
            waiting.append(entry)

    def answers(self, *args, **kwargs):  # read on the engine's thread, at a hook after the answer came back
        got = real_answers(self, *args, **kwargs)
        now = time.perf_counter_ns()
        for _ in got:
            if waiting:
                entry = waiting.popleft()
                entry["answer_us"] = (now - entry.pop("sent_ns")) / 1e3
        return got

    remote.CheckerProcess.submit, remote.CheckerProcess.answers = submit, answers
    return log


def where_lines(where: dict | None, top: int = 8) -> list[str]:
    """--where: the frames where a drawn step had more samples than a quiet step, per step, the most first."""
    if not where or not where.get("drawn_steps") or not where.get("quiet_steps"):
        return []
    quiet, per_quiet = where["quiet"], where["quiet_steps"]
    lines = []
    for kind, what in (("drawn", "a drawn step"), ("after", "a step after one")):
        samples, steps = where.get(kind) or {}, where.get(f"{kind}_steps") or 0
        if not steps:
            continue
        excess = {key: samples.get(key, 0) / steps - quiet.get(key, 0) / per_quiet for key in set(samples) | set(quiet)}
        lines.append(f"where (samples a step): {kind} {sum(samples.values()) / steps:.1f}, quiet "
                     f"{sum(quiet.values()) / per_quiet:.1f}; {what}'s extra, by frame:")
        for key, more in sorted(excess.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {more:+.2f}  {key}")
    return lines


def _split_over_rounds(rounds: list[dict]) -> dict:
    """:func:`drawn_split` over a part's rounds: the steps drawn in all, and each figure's median over rounds."""
    splits = [r["drawn_split"] for r in rounds if r.get("drawn_split")]
    if not splits:
        return {}
    out: dict = {"drawn": sum(x["drawn"] for x in splits), "steps": sum(x["steps"] for x in splits)}
    for key in ("drawn_added_ms", "after_added_ms", "drawn_hooks_us", "quiet_hooks_us", "share", "drawn_program_ms",
                "drawn_cpu_added_ms", "after_cpu_added_ms", "drawn_wait_added_ms", "after_wait_added_ms"):
        out[key] = spread([x.get(key) for x in splits]).get("median")
    wheres = [x["where"] for x in splits if x.get("where")]
    if wheres:  # --where: the samples of every round, added up
        out["where"] = {**{f"{kind}_steps": sum(w.get(f"{kind}_steps", 0) for w in wheres)
                           for kind in ("drawn", "quiet", "after")},
                        **{kind: dict(sum((Counter(w.get(kind, {})) for w in wheres), Counter()))
                           for kind in ("drawn", "quiet", "after")}}
    parts = {name for x in splits for name in x.get("drawn_parts_us", {})}
    if parts:
        out["drawn_parts_us"] = {name: spread([x["drawn_parts_us"].get(name) for x in splits
                                               if "drawn_parts_us" in x]).get("median") for name in sorted(parts)}
    return out


EXPECTED_FIGURES = {"armed": "armed", "wanted": ("wanted_engine", "wanted_device"), "sentinel": "sentinel"}


def verdict(parts: list[str], records: dict[str, dict], figs: dict) -> tuple[int, list[str], list[str]]:
    """(exit code, problems, figures over their lines). 2: a part failed or a check did not pass."""
    problems = []
    for part in parts:
        key = "capture" if ENGINE_KIND.get(part) == "capture" else ("hooks" if part == "hooks" else part)
        record = records.get(key)
        if record is None:
            problems.append(f"{part}: no record")
            continue
        if record.get("skipped"):  # a part the run may go without (the second baseline), said in the summary
            continue
        problems += [f"{part}: {p}" for p in record.get("problems", [])]
        for name, wanted in EXPECTED_FIGURES.items():
            if part == name:
                for fig in (wanted if isinstance(wanted, tuple) else (wanted,)):
                    if fig not in figs:
                        problems.append(f"{part}: the figure {fig} could not be computed"
                                        + (": no kvdbg-absent rounds in this run (its split is printed)"
                                           if f"{fig}_alone" in figs else ""))
    problems = list(dict.fromkeys(problems))
    over = [name for name in ("armed", "wanted_engine", "wanted_device", "sentinel")
            if name in figs and not figs[name]["met"]]
    return (2 if problems else 1 if over else 0), problems, over


# --------------------------------------------------------------------------- one engine process


def run_rounds(llm, timing: Timing, count: int, first_index: int, args) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True)
    rounds = []
    for i in range(count):
        timing.begin_round(args.decode + 8)
        llm.generate(prompts(first_index + i, args.batch, args.prompt), params, use_tqdm=False)
        rounds.append(timing.end_round())
    return rounds


class Bypass:
    """kvdbg's patches of vLLM swapped for vLLM's originals (``off``) and back (``on``), in the engine's process: a
    round run with them off is the same engine without kvdbg's Python, replaying the plain variant of each of its
    graphs (installed at ``off``; with a graph recorded once, its copies are still inside it). Interleaved with the armed rounds, it gives kvdbg's host cost as a ratio within one process, which
    two processes of the same engine cannot resolve (module docstring). The shutdown and layer-constructor
    wrappers stay (they run once)."""

    KEPT = ("shutdown", "__init__")

    def __init__(self, state):
        self.state = state
        self.items = [(cls, attr, had_own, original, cls.__dict__[attr])
                      for cls, attr, had_own, original in state._patches if attr not in self.KEPT]

    def off(self) -> None:
        for cls, attr, had_own, original, _ in self.items:
            if had_own:
                setattr(cls, attr, original)
            else:
                delattr(cls, attr)
        self.state.install_plain_graphs()  # vLLM then replays whichever graph is in its entry
        self.state._take_builders_back()  # nothing of kvdbg's on vLLM's objects either (a quiet run's lent methods)

    def on(self) -> None:
        for cls, attr, _, _, wrapped in self.items:
            setattr(cls, attr, wrapped)


class Interleave:
    """kvdbg's patches on and off between the steps of a round, by blocks of ``block`` steps in the order on, off,
    off, on (a drift within the four blocks falls on both alike): the bench's step wrapper calls it with each
    step's index before the step's clock starts. The patches are swapped only where the kind changes; before they
    go off, kvdbg's work still out (the capture thread's steps, the sentinel's checks, which read buffers the
    graph's recorded copies rewrite on every replay, patched or not) is let finish (``settle``), untimed.
    Returns (the step's kind, whether the kind changed at it: that step is left out of the figure)."""

    def __init__(self, bypass: "Bypass", block: int):
        self.bypass, self.block, self.on = bypass, max(1, block), True

    def __call__(self, index: int) -> tuple[bool, bool]:
        on = (index // self.block) % 4 in (0, 3)
        changed = on != self.on
        if changed:
            if on:
                self.bypass.on()
            else:
                settle(self.bypass.state)
                self.bypass.off()
            self.on = on
        return on, changed

    def end(self) -> None:
        self.bypass.on()  # whatever state a failed swap left: setting the patches again is harmless
        self.on = True


def split_interleaved(steps: list[dict]) -> tuple[list[dict], list[dict]]:
    """A round's decode window (``decode_window``) split into its steps with kvdbg's patches on and off, the step
    at each change of kind left out (the batch queue still holds a step of the other kind)."""
    window = [s for s in decode_window(steps) if not s.get("block_first")]
    return [s for s in window if s.get("kvdbg") is True], [s for s in window if s.get("kvdbg") is False]


def run_interleaved_rounds(llm, timing: Timing, count: int, first_index: int, args,
                           bypass: Bypass) -> list[list[dict]]:
    """``count`` rounds, each switching kvdbg's patches on and off by blocks of ``args.block`` steps
    (``Interleave``); kvdbg's background work let finish between rounds, untimed (``settle``). Each round's
    steps (``split_interleaved`` splits them)."""
    rounds = []
    for i in range(count):
        interleave = Interleave(bypass, args.block)
        timing.switch = interleave
        try:
            [steps] = run_rounds(llm, timing, 1, first_index + i, args)
        finally:
            timing.switch = None
            interleave.end()
        settle(bypass.state)
        rounds.append(steps)
    return rounds


def settle(state, timeout: float = 30.0) -> None:
    """kvdbg's background work of a round done before the next one starts (untimed): the graph capture thread's
    steps and the sentinel's checks still out, so that a round with kvdbg's patches off never pays for them."""
    state.drain_graph_capture(timeout)
    hooks = state.sentinel
    if hooks is not None:
        for name in list(hooks._waiting):
            hooks._collect(state, name, timeout)
        if hooks._staged:
            hooks.poll_staged(state, wait=timeout)


def save(record: dict) -> None:
    """Write the record so far where the parent reads it: a part stopped at its time limit keeps its phases."""
    path = os.environ.get(RECORD_PATH_VARIABLE)
    if path:
        with open(path + ".tmp", "w") as fh:
            fh.write(json.dumps(record, default=str))
        os.replace(path + ".tmp", path)


def wanted_phase(llm, timing: Timing, args, record: dict, first_index: int, deadline: float) -> list[dict]:
    """Rounds with one wanted decode step each: warm-up, engine-timed, device-timed (module docstring); no new
    round once the part's time is nearly out (each waits for the writer, which the first rounds measure)."""
    from kvdbg import vllm_plugin
    from kvdbg.util.ranges import IntRanges

    state = vllm_plugin._state
    capturer = vllm_plugin.active_capturer()
    probe = next(iter(state._graph_layers.values()))[0].name  # a layer of the graph: its forward count
    clock = cycles_per_us()
    record["sleep_cycles_per_us"] = clock
    roles = ["warm-up"] + ["engine"] * args.wanted_rounds + ["device"] * args.device_rounds
    results = record["phases"]["wanted"] = []
    longest = 0.0
    for i, role in enumerate(roles):
        if time.monotonic() + 1.5 * longest + 5 > deadline:
            record["problems"].append(f"the part's time ran out before the {role} round {i}")
            break
        began = time.monotonic()
        if not capturer.flush(60):
            record["problems"].append("the writer still had steps after 60 s before a wanted round")
        wanted = state._forward_counts.get(probe, 0) + args.wanted_offset
        capturer.reconfigure(steps=IntRanges.of(wanted, "steps"))
        timing.device_steps = {wanted} if role == "device" else set()
        engine_us = [w["hooks_us"] for w in results if w.get("role") == "engine" and "hooks_us" in w]
        sleep_ms = min(300.0, max(50.0, 3 * statistics.median(engine_us) / 1e3 + 5)) if engine_us else 50.0
        timing.sleep_cycles = int(sleep_ms * 1e3 * clock)
        before = len(capturer.written)
        waited_before = capturer.engine_time.waited_ns
        [steps] = run_rounds(llm, timing, 1, first_index + i, args)
        waited_us = (capturer.engine_time.waited_ns - waited_before) / 1e3
        capturer.reconfigure(steps=IntRanges.of(UNREACHED_STEP, "steps"))
        flushed = capturer.flush(60)
        summary = summarize_wanted(steps, wanted)
        written = capturer.written[before:]
        summary.update(role=role, waited_us=waited_us, sleep_ms=sleep_ms if role == "device" else None,
                       flushed=flushed,
                       written=len(written), written_for_step=sum(f"-step{wanted}-" in os.path.basename(p)
                                                                  for p in written),
                       round=summarize_round(steps))
        results.append(summary)
        for path in written:  # counted: the disk is not the measurement's
            try:
                os.remove(path)
            except OSError:
                pass
        longest = max(longest, time.monotonic() - began)
        save(record)
    timing.device_steps = set()
    return results


def engine_child(args) -> dict:
    kind = args.one
    record: dict = {"kind": kind, "problems": [], "phases": {}, "pid": os.getpid()}
    started = time.monotonic()
    deadline = started + args.child_limit - 10
    os.environ.update(kind_environment(kind, args.scratch))
    if kind == "sentinel":  # its checks in the checker process (kvdbg's child or the stand-in), or its worker thread
        os.environ["KVDBG_SENTINEL_PROCESS"] = "1" if args.sentinel_process == "on" else "0"
        if args.sentinel_process == "on" and args.worker_check != "real":
            stand_in_checker(args.worker_check, args.idle_ms)
        os.environ["KVDBG_SENTINEL_REFERENCE"] = args.sentinel_reference
        record["sentinel_reference"] = args.sentinel_reference
    try:
        import torch

        record["load_before"] = os.getloadavg()
        timing = Timing(thread_times=args.thread_times)
        timing.install_gc()
        timing.install_graphs()
        if kind != "absent":
            timing.install_kvdbg()
        model_dir = os.path.join(args.out, "model")
        llm = make_llm(model_dir, args.batch, args.prompt, args.decode)
        record["startup_s"] = round(time.monotonic() - started, 1)
        engine = llm.llm_engine
        config = engine.vllm_config
        record["engine"] = {
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "vllm": getattr(sys.modules.get("vllm"), "__version__", "?"),
            "async_scheduling": getattr(config.scheduler_config, "async_scheduling", None),
            "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
            "capture_sizes": list(config.compilation_config.cudagraph_capture_sizes or []),
            "layers": args.layers, "batch": args.batch, "prompt": args.prompt, "decode": args.decode}
        plugin = sys.modules.get("kvdbg.vllm_plugin")
        state = getattr(plugin, "_state", None)
        record["kvdbg_active"] = state is not None
        if (kind == "absent") == (state is not None):
            record["problems"].append("kvdbg is active in the baseline engine" if kind == "absent" else
                                      "kvdbg's plugin is not active in this engine")
        if state is not None:
            record["graph_layers"] = {str(k): len(v) for k, v in state._graph_layers.items()}
            if not state._graph_layers:
                record["problems"].append("no full CUDA graph was recorded through kvdbg's hooks")
        timing.install_steps(engine)
        if args.thread_times:
            timing.install_device_waits((torch.cuda.Event, torch.cuda.Stream))
        if state is not None and state.sentinel is not None and state._graph_layers:
            timing.draw_probe = (state, next(iter(state._graph_layers.values()))[0].name)
            record["sentinel_draws"] = log_draws(state, timing)
            record["sentinel_checks"] = wrap_worker_checks(timing, args.idle_ms if args.worker_check == "idle" and
                                                           args.sentinel_process == "off" else None)
            record["worker_check"] = args.worker_check
            if os.environ.get("KVDBG_SENTINEL_PROCESS") == "1":  # the rounds time checks in the process, not its start
                began = time.monotonic()
                ready = state.sentinel.checker_ready(120.0)
                record["checker_wait_s"] = time.monotonic() - began
                if not ready:
                    record["problems"].append("the sentinel's checker process was not ready within 120 s")
        sampler = None
        if args.where:
            sampler = StackSampler(timing, args.where)
            sampler.start()
        if args.profile and kind == "sentinel":
            timing.profiles = StepProfiles()
        run_rounds(llm, timing, 1, 0, args)  # warm-up: first launches of the eager prefill's kernels
        phases = args.phases.split(",")
        index = 1
        if kind in ("absent", "sentinel") or "armed" in phases:
            if state is not None and args.paired:
                # As many rounds as pairs of rounds took before: each round is half with kvdbg, half without.
                if args.decode < 4 * args.block:
                    record["problems"].append(f"--decode {args.decode} is under 4 blocks of {args.block} steps: "
                                              "a round cannot hold the on, off, off, on order")
                # The figure's rounds without the bench's hook timers (its Python, in kvdbg's steps only); then
                # a few rounds with them: kvdbg's hooks' time a step, and no hook run with the patches off.
                timing.hook_timers(False)
                try:
                    rounds = run_interleaved_rounds(llm, timing, 2 * args.rounds, index, args, Bypass(state))
                finally:
                    timing.hook_timers(True)
                index += 2 * args.rounds
                halves = [split_interleaved(r) for r in rounds]
                summaries = [summarize_round(r, on) for r, (on, _) in zip(rounds, halves)]
                record["phases"]["bypassed"] = [summarize_round(r, off) for r, (_, off) in zip(rounds, halves)]
                record["interleaved_block"] = args.block
                timed = run_interleaved_rounds(llm, timing, args.timed_rounds, index, args, Bypass(state))
                index += args.timed_rounds
                timed_halves = [split_interleaved(r) for r in timed]
                record["phases"]["timed"] = [summarize_round(r, on) for r, (on, _) in zip(timed, timed_halves)]
                record["phases"]["timed_bypassed"] = [summarize_round(r, off)
                                                      for r, (_, off) in zip(timed, timed_halves)]
                if any(b.get("hooks_us_max", 0) > 0 for b in record["phases"]["timed_bypassed"]):
                    record["problems"].append("a kvdbg hook ran in a step with kvdbg's patches off")
                if not any(t.get("hooks_us_max", 0) > 0 for t in record["phases"]["timed"]):
                    record["problems"].append("no kvdbg hook was timed in a step with kvdbg's patches on")
            else:
                rounds = run_rounds(llm, timing, args.rounds, index, args)
                index += args.rounds
                summaries = [summarize_round(r) for r in rounds]
            record["phases"]["rounds" if kind != "capture" else "armed"] = summaries
            if any(s.get("decode_steps", 0) < 8 for s in summaries + record["phases"].get("bypassed", [])):
                record["problems"].append("a round had fewer than 8 decode steps replayed from the graph")
            save(record)
        if kind == "capture":
            capturer = plugin.active_capturer()
            if "armed" in phases and (capturer.written or capturer.failures):
                record["problems"].append(f"armed with no step wanted, yet {len(capturer.written)} written, "
                                          f"failures {dict(capturer.failures)}")
            if "wanted" in phases:
                record["phases"]["d2h"] = d2h_bandwidth()
                wanted = wanted_phase(llm, timing, args, record, index, deadline)
                for w in wanted:
                    if not (w.get("copied") and w.get("written_for_step") == args.layers):
                        record["problems"].append(f"wanted step {w.get('wanted_step')} ({w.get('role')}): "
                                                  f"copied={w.get('copied')}, {w.get('written_for_step')} of "
                                                  f"{args.layers} layers written")
                record["dropped"] = dict(capturer.dropped)
                record["failures"] = dict(capturer.failures)
                if capturer.dropped or capturer.failures:
                    record["problems"].append(f"capture dropped {dict(capturer.dropped)}, failures "
                                              f"{dict(capturer.failures)}")
        if kind == "sentinel":
            counts = dict(state.sentinel.sentinel.counts)
            record["sentinel_counts"] = counts
            if timing.profiles is not None:
                record["profile"] = timing.profiles.excess()
            if not counts.get("checked"):
                record["problems"].append("the sentinel checked no step")
            if counts.get("failed") or counts.get("errors"):
                record["problems"].append(f"the sentinel counted {counts.get('failed', 0)} wrong step(s) and "
                                          f"{counts.get('errors', 0)} error(s) on a correct engine")
    except Exception as exc:  # say where it stopped; the parent goes on with the other parts
        record["problems"].append(f"stopped: {exc!r}"[:400])
        record["trace"] = traceback.format_exc().strip().splitlines()[-30:]
    record["load_after"] = os.getloadavg()
    record["wall_s"] = round(time.monotonic() - started, 1)
    return record


# --------------------------------------------------------------------------- the hooks' Python (stand-ins)


def hooks_child(args) -> dict:
    """kvdbg's per-step Python under a recorded graph, by layer count, on the tests' vLLM stand-ins (CPU):
    ``after_build`` and the replay hooks of a decode step nothing wants, armed (capture) and sentinel."""
    record: dict = {"kind": "hooks", "problems": [], "rows": []}
    try:
        sys.path.insert(0, os.path.join(ROOT, "tests", "vllm_standins"))
        sys.path.insert(0, ROOT)
        import pytest

        from kvdbg import vllm_plugin
        from tests.test_vllm_plugin import StandinEngine, _Batch, _padded, _record_graph, _record_variants

        variants = [(mode, layers, None) for mode in ("armed", "sentinel", "wanted") for layers in (8, 32, 80)]
        variants.append(("drawn", 8, None))
        variants += [(mode, 8, None) for mode in ("patched_armed", "patched_sentinel", "patched_wanted")]
        if args.cold:
            evict = Evict()
            variants += [(mode, 8, evict) for mode in ("armed", "sentinel", "wanted", "drawn", "patched_armed",
                                                       "patched_sentinel", "patched_wanted")]
        for mode, layers, cold in variants:
            for name in [k for k in os.environ if k.startswith("KVDBG_")]:
                del os.environ[name]
            os.environ.update({k: v for k, v in kind_environment("sentinel" if mode in ("sentinel", "drawn",
                                                                                    "patched_sentinel")
                                                                  else "capture", args.scratch).items()
                               if k.startswith("KVDBG_")})
            vllm_plugin.register()
            patch = pytest.MonkeyPatch()
            try:
                if mode == "wanted":
                    row = _wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph,
                                      _record_variants, layers, cold=cold)
                elif mode == "drawn":
                    row = _drawn_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph,
                                     _record_variants, layers, cold=cold, profile=args.profile)
                elif mode == "patched_wanted":
                    record.setdefault("patched_wanted", []).append(
                        {**_patched_wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph,
                                               _record_variants, layers, cold=cold), "cold": cold is not None})
                    continue
                elif mode.startswith("patched_"):
                    record.setdefault("patched", []).append(
                        {**_patched_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph,
                                        mode[len("patched_"):], layers, cold=cold), "cold": cold is not None})
                    continue
                else:
                    row = _hooks_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, mode,
                                     layers, cold=cold)
                record["rows"].append({**row, "cold": cold is not None})
            finally:
                patch.undo()
                vllm_plugin.unregister()
    except Exception as exc:
        record["problems"].append(f"stopped: {exc!r}"[:400])
        record["trace"] = traceback.format_exc().strip().splitlines()[-30:]
    return record


class _FullMode:
    """vLLM's CUDAGraphMode.FULL as the plugin reads it (hashable, with its name), for the stand-in graph calls."""

    name = "FULL"


class Evict:
    """Work of other kinds between two stand-in steps, untimed, as a serving engine's step runs between kvdbg's
    hooks (its scheduler, the runner's input preparation, small torch calls, the sampler's output): the hooks then
    find the processor's caches holding the engine's code and data, not theirs. On a GPU host kvdbg's hooks took 5
    to 10 times what they take back to back on the stand-ins; with this between them the stand-ins come within
    a few times of the engine (docs/benchmarks.md), so a cut measured this way is one the engine is likelier to
    see. About 12 ms a call."""

    def __init__(self):
        import numpy as np
        import torch

        import json.decoder

        with open(json.decoder.__file__) as f:  # a module of the standard library's, whole: it parses
            self.source = f.read()
        self.memory = [np.zeros(1 << 20, dtype=np.uint8) for _ in range(24)]  # 24 MiB: past a core's caches
        self.table = torch.arange(4096, dtype=torch.int32).view(64, 64)
        self.into = torch.zeros(64, 64, dtype=torch.int32)
        self.turn = 0

    def __call__(self) -> None:
        import ast
        import difflib

        import torch

        ast.parse(self.source)  # Python of many kinds: the parser's, then the objects it makes
        difflib.SequenceMatcher(None, self.source[:3000], self.source[3000:6000]).ratio()
        json.dumps({str(i): [i, str(i)] for i in range(2000)})
        self.turn += 1
        for block in self.memory:  # the data caches, from a new offset each call
            block[self.turn % 4096::4096].sum()
        for i in range(40):  # small torch calls, as a runner's: their paths stay as warm as in an engine
            rows = self.table[: i + 1]
            self.into[: i + 1].copy_(rows)
            rows.numpy().sum()
            torch.cumsum(self.table[i], 0).tolist()


# The stand-ins' wanted row: capture's step filter takes every this many steps (the others' median a quiet run's).
WANTED_EVERY = 5


def _steps_for(cold: "Evict | None", warm: int, timed: int) -> tuple[int, int]:
    """Warm-up and timed steps of a row: fewer with ``cold`` (each step then runs Evict first, about 12 ms)."""
    return (warm, timed) if cold is None else (max(1, warm // 6), max(1, timed // 6))


def _timed_stand_in_step(state, engine, common, metadata, replay, wrapper, cold: "Evict | None") -> tuple[int, int]:
    """One stand-in step (``cold``'s work first, untimed): its build's hook, then the replay through kvdbg's patch
    of vLLM's graph wrapper; each one's wall time in ns."""
    if cold is not None:
        cold()
    t0 = time.perf_counter_ns()
    state.after_build(engine.builder, common, metadata)
    t1 = time.perf_counter_ns()
    replay(wrapper)
    return t1 - t0, time.perf_counter_ns() - t1


def _prefill_slots_copy(state) -> None:
    """A host copy of another buffer's slot mapping, as every GPU engine keeps one from its prefill (a build on the
    device copies its slot mapping to the host; the stand-ins' builds are on the CPU and copy none): each build's
    hook then lets go of the copy at its own buffer's address, as it does in an engine."""
    state._host_slots[-1] = (("a prefill's slot mapping",), None, None)


def _plain_stand_in(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, layers: int) -> tuple:
    """The stand-in engine of the hooks and patched rows, its graph of 4 tokens recorded twice (with kvdbg's copies,
    and plain) as kvdbg sees vLLM's wrapper then, with a forward context that names the graph as vLLM's does:
    (engine, common metadata, metadata, batch descriptor, wrapper)."""
    engine = StandinEngine("FLEX_ATTENTION", layers=layers, causal=True, window=None, query_len=1,
                           seq_lens=(60, 33, 17), num_heads=8, num_kv_heads=2, head_size=64, num_blocks=64)
    state = vllm_plugin._state
    _record_graph(engine, 4, 4, patch)
    common = _padded(engine.common(), reqs=4, tokens=4)
    metadata = type(engine.builder).build._kvdbg_original(engine.builder, 0, common)
    batch = _Batch((4,))
    entry = types.SimpleNamespace(cudagraph="with kvdbg's copies", output=None)
    wrapper = types.SimpleNamespace(concrete_cudagraph_entries={batch: entry})
    state.record_plain_graph(wrapper, batch, lambda: setattr(entry, "cudagraph", "plain"))
    if not state._graph_variants:
        raise RuntimeError("the stand-in graph was not recorded twice")
    wrapper.runtime_mode = full = _FullMode()
    forward = types.SimpleNamespace(cudagraph_runtime_mode=full, batch_descriptor=batch)
    state._forward_context = (lambda: True, lambda: forward)
    _prefill_slots_copy(state)
    return engine, common, metadata, batch, wrapper


def _hooks_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, mode: str, layers: int,
               cold: "Evict | None" = None) -> dict:
    # The replay through kvdbg's patch of vLLM's graph wrapper (graph_call, the quiet runs' path), vLLM's own call a
    # no-op.
    from kvdbg.vllm_plugin.wrappers import _wrap_graph_call

    engine, common, metadata, batch, wrapper = _plain_stand_in(vllm_plugin, patch, StandinEngine, _Batch, _padded,
                                                               _record_graph, layers)
    state = vllm_plugin._state
    replay = _wrap_graph_call(state, lambda graph: None)
    counts = state.sentinel.sentinel.counts if state.sentinel is not None else None
    build_ns, replay_ns = [], []
    for _ in range(sum(_steps_for(cold, 0, 2000))):
        checked = counts["checked"] if counts is not None else 0
        build, replayed = _timed_stand_in_step(state, engine, common, metadata, replay, wrapper, cold)
        if counts is None or counts["checked"] == checked:  # a step the sentinel drew is a check, not this cost
            build_ns.append(build)
            replay_ns.append(replayed)
    return {"mode": mode, "layers": layers, "graph_slots": len(state._graph_layers.get(batch, [])),
            "steps": len(build_ns), "after_build_us": statistics.median(build_ns) / 1e3,
            "replay_hooks_us": statistics.median(replay_ns) / 1e3,
            "per_layer_us": (statistics.median(build_ns) + statistics.median(replay_ns)) / 1e3 / layers}


def _patched_engine(state, engine, common, metadata, wrapper) -> tuple:
    """The stand-in's step through every patch kvdbg puts on it, as vLLM calls them: the worker's ``execute_model``,
    the builder's ``build`` (looked up on the builder, so that a quiet run's lent build, graph_hooks'
    ``_lend_builders``, is what runs) and the graph wrapper's call, each around a no-op of vLLM's; and the same
    three calls of vLLM's alone. (the patched builder, the worker, vLLM's own step)"""
    from kvdbg.vllm_plugin.wrappers import _wrap_build, _wrap_execute_model, _wrap_graph_call

    def build(builder, common_prefix_len, common_attn_metadata, fast_build=False):  # vLLM's, its result ready
        return metadata

    def graph(graph_wrapper):  # vLLM's replay: nothing on the CPU
        return None

    class Patched(type(engine.builder)):  # the stand-in's builder class with kvdbg's patch around vLLM's no-op
        pass

    class Own(type(engine.builder)):
        pass

    Patched.build, Own.build = _wrap_build(state, build), build
    builder, own = engine.builder, copy.copy(engine.builder)
    builder.__class__, own.__class__ = Patched, Own
    replay = _wrap_graph_call(state, graph)

    def step(runner):
        builder.build(0, common)
        replay(wrapper)

    def own_step(runner):
        own.build(0, common)
        graph(wrapper)

    class Worker:  # vLLM's worker, its execute_model patched around the step
        execute_model = _wrap_execute_model(state, lambda worker, scheduler_output: step(worker))

    worker = Worker()
    state._wrappers.update((Patched.build, Worker.execute_model))  # kvdbg's own patches, as state._patch notes them
    return builder, worker, own_step


def _patched_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, mode: str, layers: int,
                 cold: "Evict | None" = None) -> dict:
    """A decode step nothing wants through every patch kvdbg puts on it (``_patched_engine``), against the same
    three calls of vLLM's alone, steps alternating. Unlike the hooks rows, this holds the patches' own frames and
    clocks, and the steps that tell a quiet run (``run_start``), which a median leaves out and the mean does not."""
    engine, common, metadata, batch, wrapper = _plain_stand_in(vllm_plugin, patch, StandinEngine, _Batch, _padded,
                                                               _record_graph, layers)
    state = vllm_plugin._state
    builder, worker, own_step = _patched_engine(state, engine, common, metadata, wrapper)
    counts = state.sentinel.sentinel.counts if state.sentinel is not None else None
    times: dict[str, list] = {"quiet": [], "run_start": [], "own": []}
    lent = 0
    for i in range(sum(_steps_for(cold, 0, 2000))):
        for kvdbg in ((True, False) if i % 2 else (False, True)):
            if cold is not None:
                cold()
            if not kvdbg:
                t0 = time.perf_counter_ns()
                own_step(None)
                times["own"].append(time.perf_counter_ns() - t0)
                continue
            run = state._quiet_run
            told = run is not None and run.step < run.horizon
            checked = counts["checked"] if counts is not None else 0
            t0 = time.perf_counter_ns()
            worker.execute_model(None)
            spent = time.perf_counter_ns() - t0
            lent += "build" in vars(builder) and "execute_model" in vars(worker)
            if counts is None or counts["checked"] == checked:  # a step the sentinel drew is a check, not this cost
                times["quiet" if told else "run_start"].append(spent)
    own_us = statistics.median(times["own"]) / 1e3
    every = times["quiet"] + times["run_start"]
    return {"mode": mode, "layers": layers, "steps": len(every), "run_starts": len(times["run_start"]),
            "lent_steps": lent, "own_us": own_us, "quiet_us": statistics.median(times["quiet"]) / 1e3,
            "run_start_us": statistics.median(times["run_start"]) / 1e3 if times["run_start"] else None,
            "added_us": statistics.median(times["quiet"]) / 1e3 - own_us,
            "mean_added_us": statistics.fmean(every) / 1e3 - statistics.fmean(times["own"]) / 1e3}


def _staged_stand_in(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants,
                     layers: int) -> tuple:
    """The stand-in engine of the wanted and drawn rows, its graph of 4 tokens recorded three times (the staged
    variant too), and vLLM's forward context as kvdbg's patch of the graph wrapper reads it: (engine, wrapper,
    entry, common metadata, metadata, batch descriptor)."""
    engine = StandinEngine("FLEX_ATTENTION", layers=layers, causal=True, window=None, query_len=1,
                           seq_lens=(60, 33, 17), num_heads=8, num_kv_heads=2, head_size=64, num_blocks=64)
    state = vllm_plugin._state
    _record_graph(engine, 4, 4, patch)
    wrapper, entry = _record_variants(4)
    if not state._staged_variants:
        raise RuntimeError("the stand-in graph was not recorded with kvdbg's staging in it")
    common = _padded(engine.common(), reqs=4, tokens=4)
    metadata = type(engine.builder).build._kvdbg_original(engine.builder, 0, common)
    batch = _Batch((4,))
    wrapper.runtime_mode = full = _FullMode()
    forward = types.SimpleNamespace(cudagraph_runtime_mode=full, batch_descriptor=batch)
    state._forward_context = (lambda: True, lambda: forward)
    _prefill_slots_copy(state)
    return engine, wrapper, entry, common, metadata, batch


def _handed_nowhere(state, patch) -> list:
    """The stand-ins' wanted steps go nowhere: a step handed over has its staging let go at once, and one handed on
    its shape's ticket goes to the capture thread's queue, here a list (its append is a C call, as the queue's put
    is), which the row empties after each step's clocks, letting its programs go (``_release_queued``). The engine's
    put also wakes the waiting capture thread, which a list does not: 5 us more on a 2-core machine
    (python bench/thread_wake.py), which the stand-ins' rows leave out and the engine's figures hold."""

    def handed(job):
        if job.staged is not None:
            job.staged.release(issued=False)

    patch.setattr(state, "_hand_over", handed)
    queued: list = []
    patch.setattr(state, "_graph_thread", types.SimpleNamespace(jobs=types.SimpleNamespace(put=queued.append),
                                                                drain=lambda timeout: True,
                                                                stop=lambda timeout: None))
    return queued


def _release_queued(queued: list) -> None:
    for job in queued:
        job[1].release(issued=False)
    queued.clear()


def _wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants,
                layers: int, steps_timed: int = 2000, cold: "Evict | None" = None) -> dict:
    """A wanted step's hooks on the stand-ins, against the unwanted steps' between them in the same process: the
    graph recorded three times (the staged variant serves the wanted step); capture's step filter takes every
    WANTED_EVERY-th step, every layer of it, as an engine armed for a few steps meets them (a quiet run, then
    the wanted step it stopped at). The step handed over goes nowhere (its staging let go at once): the capture
    thread's work is no part of the engine's thread. The replay goes through kvdbg's patch of vLLM's graph
    wrapper, vLLM's own call a no-op, as the engine's does: an unwanted step then replays on a quiet run (but the
    first after a wanted one, which tells the run), a wanted one on its shape's ticket once the first has earned
    it."""
    from kvdbg.capture.config import IntRanges
    from kvdbg.vllm_plugin.wrappers import _wrap_graph_call

    state = vllm_plugin._state
    engine, wrapper, entry, common, metadata, batch = _staged_stand_in(vllm_plugin, patch, StandinEngine, _Batch,
                                                                       _padded, _record_graph, _record_variants,
                                                                       layers)
    replay = _wrap_graph_call(state, lambda graph: None)
    queued = _handed_nowhere(state, patch)
    times: dict[str, dict[str, list[int]]] = {kind: {"after_build": [], "replay": []} for kind in ("unwanted", "wanted")}
    warm, timed = _steps_for(cold, 300, steps_timed)
    every = WANTED_EVERY
    first = state._forward_counts.get(state._graph_layers[batch][0].name, 0)  # the layers' next step
    state.capturer.reconfigure(steps=IntRanges.of(range(first + every - 1, first + every * (warm + timed), every),
                                                  "steps"))
    for i in range(every * (warm + timed)):
        kind = "wanted" if i % every == every - 1 else "unwanted"
        build, replayed = _timed_stand_in_step(state, engine, common, metadata, replay, wrapper, cold)
        _release_queued(queued)
        if entry.cudagraph != ("staged" if kind == "wanted" else "plain"):
            raise RuntimeError(f"a {kind} stand-in step replayed the {entry.cudagraph} graph")
        if i >= every * warm:  # the first ones warm up
            times[kind]["after_build"].append(build)
            times[kind]["replay"].append(replayed)
    medians = {kind: {hook: statistics.median(v) / 1e3 for hook, v in hooks.items()} for kind, hooks in times.items()}
    wanted, unwanted = medians["wanted"], medians["unwanted"]
    return {"mode": "wanted", "layers": layers, "graph_slots": len(state._graph_layers.get(batch, [])),
            "steps": len(times["wanted"]["after_build"]), "after_build_us": wanted["after_build"],
            "replay_hooks_us": wanted["replay"], "per_layer_us": (wanted["after_build"] + wanted["replay"]) / layers,
            "by_hook_us": wanted, "unwanted_by_hook_us": unwanted,
            "added_us": sum(wanted.values()) - sum(unwanted.values()),
            "tickets": len(state._tickets), "staged_in_graph": state.capturer.engine_time.in_graph}


def _patched_wanted_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants,
                        layers: int, steps_timed: int = 2000, cold: "Evict | None" = None) -> dict:
    """A wanted step as the wanted row has it (capture's step filter takes every WANTED_EVERY-th step, the staged
    graph serves it on its shape's ticket), but whole, through every patch kvdbg puts on it (``_patched_engine``),
    against the unwanted steps between them: the quiet ones (vLLM's own build and ``execute_model`` lent), the run's
    first replay (which lends them after it), and the one after each wanted step, which tells a run again
    (``run_start``); an engine's runs are longer (QUIET_AHEAD), its steps nearly all quiet ones. Unlike the wanted row, this holds the
    patches' own frames and clocks, which a wanted step runs and a lent step does not."""
    from kvdbg.capture.config import IntRanges

    state = vllm_plugin._state
    engine, wrapper, entry, common, metadata, batch = _staged_stand_in(vllm_plugin, patch, StandinEngine, _Batch,
                                                                       _padded, _record_graph, _record_variants,
                                                                       layers)
    builder, worker, own_step = _patched_engine(state, engine, common, metadata, wrapper)
    queued = _handed_nowhere(state, patch)
    times: dict[str, list[int]] = {"wanted": [], "quiet": [], "first_replay": [], "run_start": [], "own": []}
    warm, timed = _steps_for(cold, 300, steps_timed)
    every = WANTED_EVERY
    first = state._forward_counts.get(state._graph_layers[batch][0].name, 0)
    state.capturer.reconfigure(steps=IntRanges.of(range(first + every - 1, first + every * (warm + timed), every),
                                                  "steps"))
    for i in range(every * (warm + timed)):
        kind = "wanted" if i % every == every - 1 else "unwanted"
        run = state._quiet_run
        told = run is not None and run.step < run.horizon
        lent = "build" in vars(builder) and "execute_model" in vars(worker)
        if kind == "wanted" and lent:
            raise RuntimeError("a wanted stand-in step would run vLLM's own build, lent")
        if cold is not None:
            cold()
        t0 = time.perf_counter_ns()
        worker.execute_model(None)
        spent = time.perf_counter_ns() - t0
        _release_queued(queued)
        if entry.cudagraph != ("staged" if kind == "wanted" else "plain"):
            raise RuntimeError(f"a {kind} stand-in step replayed the {entry.cudagraph} graph")
        if i >= every * warm:
            # a quiet step lent vLLM's own methods; the run's first replay, which lends them after it; the step
            # that tells a run
            times[kind if kind == "wanted" else "quiet" if lent else "first_replay" if told else "run_start"].append(
                spent)
            if i % every == 0:  # vLLM's own calls, once a cycle
                if cold is not None:
                    cold()
                t0 = time.perf_counter_ns()
                own_step(None)
                times["own"].append(time.perf_counter_ns() - t0)
    medians = {kind: statistics.median(v) / 1e3 for kind, v in times.items() if v}
    return {"mode": "wanted", "layers": layers, "steps": len(times["wanted"]), "wanted_us": medians["wanted"],
            "quiet_us": medians["quiet"], "first_replay_us": medians.get("first_replay"),
            "run_start_us": medians.get("run_start"), "own_us": medians["own"],
            "added_us": medians["wanted"] - medians["quiet"],
            "tickets": len(state._tickets), "staged_in_graph": state.capturer.engine_time.in_graph}


class _EveryNth:
    """A sentinel's random source whose draw hits every ``every``-th step (its one draw a step, in order)."""

    def __init__(self, every: int):
        self.every, self.calls = every, 0

    def random(self) -> float:
        self.calls += 1
        return 0.0 if self.calls % self.every == 0 else 1.0


def _drawn_row(vllm_plugin, patch, StandinEngine, _Batch, _padded, _record_graph, _record_variants,
               layers: int, steps_timed: int = 400, cold: "Evict | None" = None, profile: bool = False) -> dict:
    """A step the sentinel draws, on the stand-ins, against the steps it does not draw between them in the same
    process: the graph recorded three times, the staged variant serving each drawn step (every DRAWN_EVERY-th); its
    check handed, as on a GPU, to the sentinel's device worker (here on the CPU) and from there to its checker
    process (the CPU's way in: host buffers shared as a GPU's staged ones are), which checks it on the second core.
    The send goes at the drawn step's own hook (its staging's readiness is known at once on a CPU); the row then
    waits, untimed, for the answer to be back, and the step after the drawn one (``after``) reads it and collects
    the verdicts in its hooks, as an engine's step does some steps later (11 ms on an H100 host); each drawn step
    so finds the program free, as in an engine at rate 0.01, whose draws come hundreds of steps apart. A wrong
    step is not captured here (the stand-ins' staged outputs are not the reference's): each check is counted, and
    the capture path is no part of these rows. With ``profile``: as many drawn steps again after the timed ones,
    under cProfile, their heaviest functions returned (``profile_top``; their times, the profiler's overhead in
    them, are no part of the row's figures)."""
    import torch

    from kvdbg.sentinel.checker import DeferredChecks
    from kvdbg.sentinel.remote import CheckerProcess
    from kvdbg.vllm_plugin.wrappers import _wrap_graph_call

    state = vllm_plugin._state
    hooks = state.sentinel
    engine, wrapper, entry, common, metadata, batch = _staged_stand_in(vllm_plugin, patch, StandinEngine, _Batch,
                                                                       _padded, _record_graph, _record_variants,
                                                                       layers)

    body_ns = [0]
    profiling: list = []  # the profiler while it runs: off for the program's run

    def graph(_):  # the staged variant's program runs inside the graph: here after the (no-op) replay, its time
        ran = state._in_graph_ran  # (the device's, in an engine) taken out of the replay's below, and the profile's
        if ran is not None and entry.cudagraph == "staged":
            for on in profiling:
                on.disable()
            t0 = time.perf_counter_ns()
            ran[1].graph_body(4)
            body_ns[0] += time.perf_counter_ns() - t0
            for on in profiling:
                on.enable()

    replay = _wrap_graph_call(state, graph)
    sentinel = hooks.sentinel
    found = []
    patch.setattr(hooks, "_capture", lambda state, finding, waiting: found.append(finding.kind) or False)
    # Host storages shared through files: the checker process is no multiprocessing child, so torch's other
    # strategy (descriptors over multiprocessing's connections) cannot hand them over.
    import torch.multiprocessing as mp

    patch.setattr(mp, "_sharing_strategy", "file_system")  # set_sharing_strategy's own, undone with the row
    deferred = hooks._deferred = DeferredChecks(sentinel, torch.device("cpu"), process=False)
    sentinel._draws.clear()
    sentinel._rng = _EveryNth(DRAWN_EVERY)
    times: dict[str, dict[str, list[int]]] = {kind: {"after_build": [], "replay": []}
                                              for kind in ("undrawn", "drawn", "after")}
    warm, timed = _steps_for(cold, 20, steps_timed)
    profiled = timed if profile else 0  # drawn steps after the timed ones, under the profiler, their times not kept
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
    try:
        deferred.remote = CheckerProcess("cpu", share_host=True, reference=sentinel.config.reference)
        first = state._forward_counts.get(state._graph_layers[batch][0].name, 0)
        for i in range(DRAWN_EVERY * (warm + timed + profiled)):
            step = first + i
            drawn = sentinel.drawn(step)
            if drawn:
                hooks.poll_staged(state, wait=10.0)  # untimed: any check still out collected, the program free
            on = profiler is not None and drawn and i >= DRAWN_EVERY * (warm + timed)
            if on:
                profiling.append(profiler)
                profiler.enable()
            body_ns[0] = 0
            build, replayed = _timed_stand_in_step(state, engine, common, metadata, replay, wrapper, cold)
            replayed -= body_ns[0]
            if on:
                profiler.disable()
                profiling.clear()
            if drawn and entry.cudagraph != "staged":
                raise RuntimeError(f"a drawn stand-in step replayed the {entry.cudagraph} graph")
            if drawn:  # untimed: until the check's answer is back (an engine's check spans a few steps), unread,
                remote = deferred.remote  # so that the next step's hooks read it and collect it
                # (nothing out: a drawn step slowed by the profiler read its answer in its own last hooks)
                if remote.outstanding and not remote._conn.poll(10.0):
                    raise RuntimeError("the checker process did not answer a drawn stand-in step within 10 s")
                # and past the time a hook's look waits before it asks the socket (half the last check's time)
                early = remote._too_soon - (time.perf_counter_ns() - remote._since)
                if early > 0:
                    time.sleep(early / 1e9)
            kind = "drawn" if drawn else ("after" if sentinel.drawn(step - 1) else "undrawn")
            if DRAWN_EVERY * warm <= i < DRAWN_EVERY * (warm + timed):
                times[kind]["after_build"].append(build)
                times[kind]["replay"].append(replayed)
        hooks.poll_staged(state, wait=10.0)
    finally:
        deferred.close(5.0)
    in_process = sentinel.staged_checks.get("process", 0)
    drawn_steps = warm + timed + profiled
    if sentinel.counts["errors"] or in_process != drawn_steps:
        raise RuntimeError(f"the stand-ins' drawn steps: {drawn_steps} drawn, {in_process} checked in the checker "
                           f"process, {sentinel.counts['errors']} errors")
    medians = {kind: {hook: statistics.median(v) / 1e3 for hook, v in kinds.items()} for kind, kinds in times.items()
               if kinds["replay"]}
    drawn, undrawn = medians["drawn"], medians["undrawn"]
    row = {"mode": "drawn", "layers": layers, "graph_slots": len(state._graph_layers.get(batch, [])),
           "steps": len(times["drawn"]["after_build"]), "after_build_us": drawn["after_build"],
           "replay_hooks_us": drawn["replay"], "per_layer_us": (drawn["after_build"] + drawn["replay"]) / layers,
           "by_hook_us": drawn, "undrawn_by_hook_us": undrawn, "after_by_hook_us": medians.get("after"),
           "added_us": sum(drawn.values()) - sum(undrawn.values()),
           "checks": {"checked": sentinel.counts["checked"], "errors": sentinel.counts["errors"],
                      "in_the_process": sentinel.staged_checks.get("process", 0), "wrong_not_captured": len(found)}}
    if profiler is not None:
        import pstats

        stats = pstats.Stats(profiler)
        calls = max(1, profiled)
        heavy = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]  # own time
        row["profile_top"] = [{"function": _function_name(key), "calls_per_step": value[1] / calls,
                               "own_us_per_step": value[2] * 1e6 / calls, "with_callees_us_per_step":
                               value[3] * 1e6 / calls} for key, value in heavy]
    return row


# The stand-ins' drawn row: the sentinel draws every this many steps.
DRAWN_EVERY = 5


# --------------------------------------------------------------------------- the parent


def child_command(args, kind: str, limit: float) -> list[str]:
    phases = ",".join(p for p in ("armed", "wanted") if p in args.parts.split(",")) if kind == "capture" else ""
    return [sys.executable, os.path.abspath(__file__), args.out, "--one", kind, "--phases", phases or "-",
            "--layers", str(args.layers), "--batch", str(args.batch), "--prompt", str(args.prompt),
            "--decode", str(args.decode), "--rounds", str(args.rounds), "--wanted-rounds", str(args.wanted_rounds),
            "--device-rounds", str(args.device_rounds), "--wanted-offset", str(args.wanted_offset),
            "--block", str(args.block), "--timed-rounds", str(args.timed_rounds), "--scratch", args.scratch,
            "--child-limit", str(limit)] \
        + (["--thread-times"] if args.thread_times else []) + ([] if args.paired else ["--no-paired"]) \
        + (["--cold"] if args.cold else []) \
        + (["--profile"] if args.profile else []) \
        + ["--where", str(args.where), "--worker-check", args.worker_check, "--idle-ms", str(args.idle_ms),
           "--sentinel-process", args.sentinel_process, "--sentinel-reference", args.sentinel_reference]


def run_part(args, part: str, kind: str, limit: float) -> dict:
    """One part in a child process: its record (from its file, else its stdout), or why there is none."""
    path = os.path.join(args.out, "records", f"{part}.json")
    log = os.path.join(args.out, "logs", f"{part}.log")
    started = time.monotonic()
    if os.path.exists(path):  # an earlier run's
        os.remove(path)
    stdout = stderr = ""
    problem = None
    try:
        proc = subprocess.run(child_command(args, kind, limit), capture_output=True, text=True, timeout=limit,
                              env={**os.environ, RECORD_PATH_VARIABLE: path})
        stdout, stderr = proc.stdout, proc.stderr
        if proc.returncode:
            problem = f"process exit {proc.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        problem = f"over its {limit:.0f} s"
    except Exception as exc:
        problem = f"could not run: {exc!r}"
    with open(log, "w") as fh:
        fh.write(stdout + "\n--- stderr ---\n" + stderr)
    record = None
    if os.path.exists(path):
        try:
            with open(path) as fh:
                record = json.load(fh)
        except ValueError:
            record = None
    if record is None:
        lines = [ln for ln in stdout.splitlines() if ln.startswith(RECORD_PREFIX)]
        record = json.loads(lines[-1][len(RECORD_PREFIX):]) if lines else {"problems": []}
    if problem is not None:  # a part stopped at its limit keeps the phases it saved, and says it stopped
        record.setdefault("problems", []).append(problem)
        record["trace"] = record.get("trace") or stderr.strip().splitlines()[-30:]
    record["part_wall_s"] = round(time.monotonic() - started, 1)
    return record


def print_figures(figs: dict, records: dict) -> None:
    def pct(v):
        return "?" if v is None else f"{v:.4f}x"

    base = records.get("baseline", {})
    engine = base.get("engine") or records.get("capture", {}).get("engine") or {}
    if engine:
        print(f"engine: {engine.get('device')}, vLLM {engine.get('vllm')}, torch {engine.get('torch')}; "
              f"{engine.get('layers')} layers, decode batch {engine.get('batch')}, prompts of {engine.get('prompt')}, "
              f"{engine.get('decode')} tokens each; {engine.get('cudagraph_mode')} sizes "
              f"{engine.get('capture_sizes')}, "
              f"async scheduling {engine.get('async_scheduling')}")
    if "baseline_drift" in figs:
        d = figs["baseline_drift"]
        g = figs.get("baseline_drift_graph") or {}
        print(f"  two kvdbg-absent engines: second / first {pct(d.get('ratio'))} (rounds {d.get('rounds')}); "
              f"their graphs on the device {pct(g.get('ratio'))}")
    for name, line in (("armed", ARMED_LINE), ("sentinel", SENTINEL_LINE)):
        f = figs.get(name)
        if f:
            g = f.get("graph", {})
            busy = g.get("baseline", 0) / f["baseline"] if f.get("baseline") and g.get("baseline") else None
            print(f"  {name:9s} step {f['value']:.3f} ms vs {f['baseline']:.3f} ms: {pct(f['ratio'])} (rounds "
                  f"{f['rounds'].get('min', 0):.4f}..{f['rounds'].get('max', 0):.4f}; line <= {line}x: "
                  f"{'met' if f['met'] else 'MISSED'}); graph on the device {g.get('value', 0):.3f} ms vs "
                  f"{g.get('baseline', 0):.3f} ms ({pct(g.get('ratio'))}; the baseline's graph is "
                  f"{0 if busy is None else busy:.0%} of its step); kvdbg's hooks {f['hooks_us'].get('median', 0):.1f} "
                  f"us a step (mean {f['hooks_us_mean'].get('median', 0):.1f})")
            p = f.get("paired") or {}
            if p.get("host"):
                host = p["host"]
                device = "" if p.get("device") is None else (
                    f" x {p['device']:.4f} (kvdbg's graph copies, at most) = {pct(p.get('ratio'))}")
                over = p.get("over", "median")
                other = "mean" if over == "median" else "median"
                print(f"  {name:9s} paired in its process ({p['pairs']} rounds, kvdbg's patches on and off by "
                      f"blocks of {p.get('block') or '?'} steps): {pct(host.get(over))} ({over} of the rounds; "
                      f"their {other} {pct(host.get(other))}, rounds {host['min']:.4f}..{host['max']:.4f}){device}; "
                      f"judged on the "
                      f"{'paired figure' if f.get('judged_on') == 'paired' else 'ratio across processes'}")
                if p.get("interval"):
                    lo, hi = p["interval"]
                    side = ("the line is inside it: these rounds cannot tell met from missed" if lo <= line < hi
                            else "wholly under the line" if hi <= line else "wholly over the line")
                    print(f"  {name:9s} its {INTERVAL_LEVEL:.0%} interval (the rounds resampled): "
                          f"{lo:.4f}x..{hi:.4f}x, {side}")
                g = p.get("gc")
                if g and g["host_without"].get("n"):
                    print(f"  {name:9s} Python's garbage collections in the paired rounds: {g['kvdbg_ms']:.1f} ms with "
                          f"kvdbg's patches ({g['kvdbg_full']} of the oldest generation), {g['bypassed_ms']:.1f} ms "
                          f"without ({g['bypassed_full']}); their pauses taken out, the rounds "
                          f"{g['host_without']['median']:.4f}x (median), {g['host_without']['mean']:.4f}x (mean)")
                t = p.get("trimmed")
                if t and t.get("n"):
                    print(f"  {name:9s} each half without its longest step (not judged): {t['median']:.4f}x (median), "
                          f"{t['mean']:.4f}x (mean); the longest step with kvdbg's patches {t['longest_ms']['median']:.2f} "
                          f"ms (median; up to {t['longest_ms']['max']:.2f}), without "
                          f"{t['longest_bypassed_ms']['median']:.2f} ms (up to {t['longest_bypassed_ms']['max']:.2f})")
                if p.get("by_draws"):  # the sentinel's rounds: its steps' own cost apart from its draws'
                    print(f"  {name:9s} its paired rounds by the steps drawn in their kvdbg half (the draws are "
                          "seeded: the same each run): " + ", ".join(
                              f"{k} drawn: {v['mean']:.4f}x ({v['rounds']} round{'s' * (v['rounds'] != 1)}, mean)"
                              for k, v in p["by_draws"].items()))
            _print_sentinel_split(name, f)
            walls, cpus = f.get("hooks_us_mean_by_name") or {}, f.get("hooks_cpu_us_mean_by_name") or {}
            if cpus:
                print(f"  {name:9s} its hooks a step, wall / on the CPU (means): " + ", ".join(
                    f"{k} {walls.get(k) or 0:.0f} / {cpus[k] or 0:.0f} us" for k in KVDBG_HOOKS if k in cpus))
            t = f.get("with_hook_timers") or {}
            if t.get("host"):
                print(f"  {name:9s} paired with the bench's hook timers on ({t['pairs']} rounds after those; not "
                      f"judged): {pct(t['host'].get(t.get('over', 'median')))} ({t.get('over', 'median')}; rounds "
                      f"{t['host']['min']:.4f}..{t['host']['max']:.4f})"
                      f" x {t.get('device') or 1:.4f} = {pct(t.get('ratio'))}")
    if "sentinel_alone" in figs:
        print("  sentinel  no figure: no kvdbg-absent rounds in this run (--parts); where its time went:")
        _print_sentinel_split("sentinel", figs["sentinel_alone"])
    f = figs.get("wanted_engine")
    if f:
        print(f"  wanted step, engine's thread: +{f['added_us']['median']:.0f} us (range {f['added_us']['min']:.0f}.."
              f"{f['added_us']['max']:.0f}; line <= {f['line_us']:.0f} us: {'met' if f['met'] else 'MISSED'}); "
              f"step +{f['step_added_ms']['median']:.2f} ms; {f['bytes']['median'] / 2**20:.1f} MiB a step")
        by_hook = {k: v.get("median") for k, v in f.get("hooks_added_by_name_us", {}).items()
                   if v.get("median") is not None}
        if by_hook:
            print("    engine's thread by hook (added, medians): " + ", ".join(f"{k} {v:.0f} us"
                                                                          for k, v in by_hook.items()))
        by_cpu = {k: v.get("median") for k, v in f.get("hooks_cpu_added_by_name_us", {}).items()
                  if v.get("median") is not None}
        if by_cpu:
            print("    the same on the engine's thread's CPU (added, medians): " + ", ".join(
                f"{k} {v:.0f} us" for k, v in by_cpu.items()))
        for name, t in f.get("thread", {}).items():
            if t.get("wall_us") and t.get("cpu_us"):
                wall, cpu = t["wall_us"]["median"], t["cpu_us"]["median"]
                where = "the capture thread" if name in CAPTURE_THREAD_PARTS else "the engine's thread"
                print(f"    {name} on {where} (medians): wall {wall:.0f} us, on the CPU {cpu:.0f} us "
                      f"({cpu / wall if wall else 0:.0%}), voluntary switches {t['switches'].get('median', 0):g}")
        inner = {k: v.get("median") for k, v in f.get("inner_us", {}).items() if v.get("median") is not None}
        if inner:
            print("    parts (medians; stage, program_run within it, and metadata_copy on the engine's thread, the "
                  "rest in the capture thread): " + ", ".join(f"{k} {v / 1e3:.3f} ms" for k, v in inner.items()))
    f = figs.get("wanted_device")
    if f:
        print(f"  wanted step, device: {f['device_ms']['median']:.2f} ms against "
              f"{f['copy_at_bandwidth_ms']['median']:.2f} ms for its bytes at {f['d2h_gb_s']:.1f} GB/s: "
              f"{pct(f['ratio']['median'])} (line <= {f['line']}x: "
              f"{'met' if f['met'] else 'MISSED'}); engine's stream {f['engine_stream_ms']['median']:.2f} ms; "
              f"device caught up with the host in {f['device_caught_up']} of {f['ratio']['n']}")
        if f.get("in_graph"):
            print(f"    staged inside vLLM's graph in {f['in_graph']} of {f['ratio']['n']}: the staged graph's time over "
                  f"the plain graph's {f['graph_extra_ms'].get('median') or 0:.3f} ms (counted in the device's work)")
        if f.get("judged_on") == "work":
            busy = f.get("copies_busy_ms") or {}
            print(f"    the device's work: the program on the engine's stream, the copies issued ahead "
                  + (f"{busy['median']:.2f} ms (each one's own time; from the first to the last "
                     f"{f['copies_ms']['median']:.2f} ms)" if busy.get("n") else f"{f['copies_ms']['median']:.2f} ms")
                  + f", the capture thread's reads {f['reads_ms']['median']:.3f} "
                  f"ms; from the program to the capture thread's last issue (its host time between them) "
                  f"{f['span_ms']['median']:.2f} ms")
    hooks = records.get("hooks", {}).get("rows", [])
    for row in records.get("hooks", {}).get("patched", []):
        print(f"  stand-ins{', cold' if row['cold'] else ''}, a step through kvdbg's patches, {row['mode']:8s} "
              f"{row['layers']} layers: {row['added_us']:.1f} us over vLLM's own calls ({row['own_us']:.1f}); with "
              f"the steps that tell a run ({row['run_starts']} of {row['steps']}, "
              f"{row['run_start_us'] or 0:.1f} us each) {row['mean_added_us']:.1f} us; vLLM's own build and "
              f"execute_model lent in {row['lent_steps']}")
    for row in records.get("hooks", {}).get("patched_wanted", []):
        print(f"  stand-ins{', cold' if row['cold'] else ''}, a step through kvdbg's patches, wanted   "
              f"{row['layers']} layers: {row['wanted_us']:.1f} us, {row['added_us']:.1f} us over a quiet step "
              f"({row['quiet_us']:.1f}; vLLM's own calls {row['own_us']:.1f}); the step after it, which tells a run "
              f"again, {row['run_start_us'] or 0:.1f} us; staged inside the graph {row['staged_in_graph']}")
    for row in hooks:
        print(f"  stand-ins{', cold' if row.get('cold') else ''}, {row['mode']:8s} {row['layers']:3d} layers: after_build {row['after_build_us']:.1f} us, "
              f"replay hooks {row['replay_hooks_us']:.1f} us a step ({row['per_layer_us']:.2f} us a layer)"
              + (f"; {row['added_us']:.1f} us over an unwanted step (build "
                 f"{row['by_hook_us']['after_build'] - row['unwanted_by_hook_us']['after_build']:.1f}, replay "
                 f"{row['by_hook_us']['replay'] - row['unwanted_by_hook_us']['replay']:.1f}; staged inside the graph "
                 f"{row['staged_in_graph']})" if row.get("staged_in_graph") is not None else ""))
        if row["mode"] == "drawn":
            undrawn, after, checks = row["undrawn_by_hook_us"], row.get("after_by_hook_us"), row["checks"]
            print(f"    {row['added_us']:.1f} us over a step not drawn (build "
                  f"{row['by_hook_us']['after_build'] - undrawn['after_build']:.1f}, replay "
                  f"{row['by_hook_us']['replay'] - undrawn['replay']:.1f}); the step after it, which collects its "
                  + ("verdicts: none timed" if not after else
                     f"verdicts: build {after['after_build']:.1f}, replay {after['replay']:.1f} us")
                  + f"; {checks['in_the_process']} checks in the checker process, {checks['errors']} errors")
            for top in row.get("profile_top") or []:
                print(f"      {top['own_us_per_step']:8.1f} us own, {top['with_callees_us_per_step']:8.1f} us with "
                      f"callees, {top['calls_per_step']:5.1f} calls a drawn step: {top['function']}")


def _print_sentinel_split(name: str, f: dict) -> None:
    """The lines of where a part's drawn steps' time went, its checks and its draws (print_figures)."""
    d = f.get("drawn_split") or {}
    if d.get("share") is not None:
        print(f"  {name:9s} where its time goes: {d['drawn']} of {d['steps']} steps drawn; a drawn step "
              f"+{d['drawn_added_ms']:.2f} ms (its hooks {d['drawn_hooks_us']:.0f} us), the "
              f"{FOLLOWING_STEPS} after it +{d['after_added_ms']:.2f} ms in all (while its check runs); "
              f"together {d['share']:.1%} of the rounds' time; the other steps' hooks "
              f"{d['quiet_hooks_us']:.1f} us"
              + ("" if d.get("drawn_program_ms") is None else
                 f"; its staging program {d['drawn_program_ms']:.2f} ms on the device"))
    if d.get("drawn_cpu_added_ms") is not None:
        print(f"  {name:9s} the same on the engine's thread's CPU: a drawn step "
              f"+{d['drawn_cpu_added_ms']:.2f} ms, the {FOLLOWING_STEPS} after it "
              f"+{d['after_cpu_added_ms']:.2f} ms; waiting on the device (its event and stream waits): "
              f"{d.get('drawn_wait_added_ms', 0):+.2f} ms and {d.get('after_wait_added_ms', 0):+.2f} ms; "
              f"the rest of the wall time above: the thread waiting for something else (Python's lock)")
    w = f.get("worker_checks") or {}
    if w.get("wall_us"):
        print(f"  {name:9s} its worker thread's checks: {w['checks'] - w.get('in_process', 0)}; each "
              f"{w['wall_us']['median'] / 1e3:.2f} ms "
              f"(median; {w['wall_us']['min'] / 1e3:.2f}..{w['wall_us']['max'] / 1e3:.2f}), of it "
              f"{w['cpu_us']['median'] / 1e3:.2f} ms on the CPU (when the worker can hold the interpreter's "
              f"lock), {w['switches']['median']:.0f} voluntary switches"
              + ("" if not w.get("device_us") else f"; its span on the worker's stream "
                 f"{w['device_us']['median'] / 1e3:.2f} ms"))
    if w.get("send_us"):
        print(f"  {name:9s} its checker process's checks: {w['in_process']}"
              + ("" if not f.get("reference") else f" (their reference on the {f['reference']})")
              + "; each sent by the engine's thread "
              f"in {w['send_us']['median']:.0f} us (median; its CPU {w['send_cpu_us']['median']:.0f} us)"
              + ("" if not w.get("answer_us") else f", its answer read at a hook "
                 f"{w['answer_us']['median'] / 1e3:.2f} ms after it was sent")
              + ("" if not w.get("buffers") or w["buffers"][0] is None else
                 f"; buffers shared with the child by the first check "
                 f"{w['buffers'][0]}, by the last {w['buffers'][1]}; layers given "
                 f"{w['layers_given'][0]}, {w['layers_given'][1]}")
              + ("" if not w.get("templates") or w["templates"][0] is None else
                 f"; templates made {w['templates'][0]}, {w['templates'][1]}"))
    if f.get("diagnostic") and f.get("worker_check"):
        print(f"  {name:9s} DIAGNOSTIC: the sentinel's check was '{f['worker_check']}' "
              f"({'in its checker process' if w.get('in_process') else 'in its worker thread'}; nothing compared); "
              "its figure is not judged")
    elif f.get("diagnostic"):
        print(f"  {name:9s} DIAGNOSTIC: its steps ran under the profiler (--profile); its figure is not judged")
    for line in where_lines(d.get("where")) + profile_lines(f.get("profile")):
        print(f"  {name:9s} {line}")
    t = f.get("drawn_split_timed") or {}
    if t.get("drawn_parts_us"):
        print(f"  {name:9s} a drawn step's hooks with the bench's timers on: {t['drawn_hooks_us']:.0f} us "
              f"({t['drawn']} step(s)); of it " + ", ".join(f"{part} {us:.0f} us" for part, us
                                                          in t["drawn_parts_us"].items()))
    draws = f.get("draws")
    if draws is not None and name == "sentinel":
        timed = [x for x in draws if x["timed"]]
        print(f"  {name:9s} its draws: {len(draws)} step(s) drawn, {len(timed)} while a step was timed "
              f"(the split found {d.get('drawn', 0)} in its windows), "
              f"{sum(not x['engine_thread'] for x in draws)} asked from another thread; first: "
              + ", ".join(f"step {x['step']} at bench step {x['bench_step']} (probe count {x['probe_count']})"
                          for x in draws[:4]))


def parent(args) -> int:
    parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"unknown part(s) {unknown}; known: {', '.join(PARTS)}", file=sys.stderr)
        return 2
    for sub in ("records", "logs"):
        os.makedirs(os.path.join(args.out, sub), exist_ok=True)
    os.makedirs(args.scratch, exist_ok=True)
    write_model(os.path.join(args.out, "model"), args.layers)
    deadline = time.monotonic() + args.budget
    records: dict[str, dict] = {}
    done: set[str] = set()
    engine_walls: list[float] = []
    for part in PARTS:  # a fixed order: the second baseline last
        if part not in parts:
            continue
        kind = "hooks" if part == "hooks" else ENGINE_KIND[part]
        key = "capture" if kind == "capture" else part
        if key in done:
            continue
        done.add(key)
        left = deadline - time.monotonic()
        needed = 20.0 if kind == "hooks" else max([60.0, *engine_walls]) + 10
        if left < needed:
            why = f"skipped: {left:.0f} s of the budget left, ~{needed:.0f} s needed"
            # The second baseline only says how far two processes differ: without it the figures still stand.
            records[key] = {"problems": [], "skipped": why} if part == "baseline2" else {"problems": [why]}
            print(f"[{part}] skipped ({left:.0f} s left)", flush=True)
            continue
        record = run_part(args, key, kind, min(left, args.part_limit))
        records[key] = record
        if kind != "hooks":
            engine_walls.append(record.get("part_wall_s", 0))
        print(f"[{key}] {record.get('part_wall_s')} s, startup {record.get('startup_s')} s, problems: "
              f"{record.get('problems') or 'none'}", flush=True)
        for line in record.get("trace", [])[-8:] if record.get("problems") else []:
            print(f"    {line}", flush=True)
    figs = figures(records)
    code, problems, over = verdict(parts, records, figs)
    print_figures(figs, records)
    skipped = {k: r["skipped"] for k, r in records.items() if r.get("skipped")}
    summary = {"exit": code, "problems": problems, "over_line": over, "skipped": skipped, "figures": figs,
               "parts": parts,
               "budget_s": args.budget, "load": os.getloadavg(),
               "walls_s": {k: r.get("part_wall_s") for k, r in records.items()}}
    print(SUMMARY_PREFIX + json.dumps(summary, default=str), flush=True)
    shutil.rmtree(args.scratch, ignore_errors=True)
    return code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    parser.add_argument("--part-limit", type=float, default=200.0, help="seconds for one part at most")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="decode batch (the graph's size)")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=128, help="tokens generated per request in a round")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per engine")
    parser.add_argument("--no-paired", dest="paired", action="store_false",
                        help="no steps with kvdbg's patches off in the capture and sentinel engines")
    parser.add_argument("--block", type=int, default=8,
                        help="steps in a block of kvdbg's patches on or off (the capture and sentinel engines)")
    parser.add_argument("--timed-rounds", type=int, default=2,
                        help="rounds after the paired ones with kvdbg's hooks timed (the paired ones run without the "
                             "bench's hook timers)")
    parser.add_argument("--wanted-rounds", type=int, default=4, help="rounds timing a wanted step's engine thread")
    parser.add_argument("--device-rounds", type=int, default=2, help="rounds timing a wanted step's device work")
    parser.add_argument("--wanted-offset", type=int, default=48,
                        help="the wanted step: this many forwards into a round")
    parser.add_argument("--scratch", default="/tmp/kvdbg-graph-cost", help="snapshots (deleted once counted)")
    parser.add_argument("--thread-times", action="store_true",
                        help="also time the engine's thread's parts of a wanted step (metadata copy, staging) in "
                             "its CPU time and voluntary context switches (about 2 us of their own each)")
    parser.add_argument("--cold", action="store_true",
                        help="hooks part: also each row with other work between the steps (Evict), as an engine's step "
                             "runs between kvdbg's hooks: the caches they find cold")
    parser.add_argument("--where", type=float, default=0.0, metavar="MS",
                        help="a diagnostic: sample the engine thread's frames every MS ms in timed steps; the "
                             "sentinel's split prints where a drawn step's extra samples fall")
    parser.add_argument("--profile", action="store_true",
                        help="a diagnostic: the sentinel's steps under cProfile on the engine's thread; prints the "
                             "functions a drawn step, and a step after one, spent more time in than a quiet step "
                             "(every Python call is dearer under it: the sentinel's figure is then not judged)")
    parser.add_argument("--worker-check", choices=("real", "idle", "spin"), default="real",
                        help="a diagnostic: 'idle' replaces the sentinel's check by --idle-ms of sleep, 'spin' (the "
                             "checker process only) by --idle-ms of one CPU core busy; the checker process still "
                             "receives each check, the worker thread waits for the staging first (nothing compared; "
                             "the sentinel's figure is then not judged)")
    parser.add_argument("--idle-ms", type=float, default=12.0)
    parser.add_argument("--sentinel-process", choices=("on", "off"), default="on",
                        help="the sentinel's checks of staged steps in its checker process (KVDBG_SENTINEL_PROCESS, "
                             "the default) or in its worker thread")
    parser.add_argument("--sentinel-reference", choices=("host", "device"), default="host",
                        help="where the checker process works out a staged step's reference "
                             "(KVDBG_SENTINEL_REFERENCE; host, kvdbg's default: the device only picks the pairs' "
                             "rows and pages)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    parser.add_argument("--phases", default="-", help=argparse.SUPPRESS)
    parser.add_argument("--child-limit", type=float, default=200.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_check == "spin" and args.sentinel_process == "off":
        parser.error("--worker-check spin is for the checker process (a spinning worker thread would hold the "
                     "interpreter's lock the engine's thread wants: another measurement)")
    if args.one is None:
        return parent(args)
    record = hooks_child(args) if args.one == "hooks" else engine_child(args)
    save(record)
    print(RECORD_PREFIX + json.dumps(record, default=str), flush=True)
    sys.stderr.flush()
    os._exit(0)  # the engine's own shutdown is no part of the measurement (and may wait on its threads)


if __name__ == "__main__":
    sys.exit(main())
