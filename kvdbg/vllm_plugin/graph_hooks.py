"""Steps run as full CUDA graphs: what the graph must copy for capture, recorded into it, and the capture
itself once vLLM has replayed it.

A replayed graph runs no Python, so the per-layer hooks of ``step_hooks`` never see its steps. Two things
still do: the metadata builder (vLLM builds every step in Python, graphs or not, so ``builder_hooks`` keeps
the step's block table, lengths and query offsets as for any step) and vLLM's ``CUDAGraphWrapper.__call__``
(once per step, wrapped here). So:

- **while a graph is recorded** (once per batch size, at start-up), each attention layer's forward is also
  recorded copying its query and its output into buffers of the plugin's (one per layer, as large as the
  largest graph, allocated while the first graph is recorded, from the graph's pool): a few hundred kilobytes
  of device-to-device copies per layer, no Python. They are recorded only for the layers capture's or the
  sentinel's filter selects; the writer holds its device work meanwhile
  (:meth:`~kvdbg.capture.writer.CaptureWriter.held_writer`: CUDA forbids, process-wide, what it does while a
  stream captures), and the sentinel's checks still in its worker are collected before the recording starts.
  Right after, vLLM records the graph once more with nothing of kvdbg's in it
  (:meth:`GraphHooks.record_plain_graph`), and before each replay the plugin installs the one with the copies
  for a step that capture's filters select or the sentinel draws, the plain one for any other
  (:meth:`GraphHooks.choose_graph`): a step nothing wants is the engine's own device work alone. With capture
  or the sentinel on, vLLM records it a third time with the copies and, after the forward, kvdbg's staging program
  (:meth:`GraphHooks.record_staged_graph`, ``graph_staging.InGraphProgram``): a step capture wants on every layer,
  or the sentinel draws on every layer (capture wanting all of them or none), replays that variant when the
  program is free and the step's pages fit, and is handed over with no torch call on the engine's thread
  (:meth:`GraphHooks._hand_in_graph`); other wanted or drawn steps are staged as below;
- **after each replay**, the selected layers' steps are counted as if their forwards had run. A step capture
  wants or the sentinel samples is first *staged* (``graph_staging``): on the engine's stream, right after the
  graph's work, a small program of kvdbg's (recorded once per size as a CUDA graph of its own) copies the
  page ids the step's block table names (within the host's bound on each request's length, known at the build),
  those pages of each layer, the layers' query and output buffers and the step's metadata (block table, lengths,
  offsets, as the graph read them) into kvdbg's device buffers. Nothing a later step does can reach those
  copies, so the engine's thread goes on at once and never waits: the wanted step is handed, whole (every
  wanted layer, with its build's context), to the plugin's *graph capture thread*, which reads the metadata and
  the page ids back, keeps the pages the step's exact lengths read and copies them to the host from the staged
  buffers whenever it gets to them. The build of such a step copied nothing (``builder_hooks``: a build whose
  padded batch is a recorded full graph's is left uncopied until its step is read); for a step not staged, the
  engine's thread makes the build's copies right after the replay; a sampled step's check runs in the
  sentinel's worker
  on the same copies and is collected when it is done (a wrong step is captured from them too). Each reader
  releases the staged buffers with an event on which their next use waits, on the device.
- a step staging cannot serve (its program still held by earlier readers, over kvdbg's staging memory, a
  build that gave no bound) is read the way it was before staging: from the engine's memory, the capture
  thread issuing its copies behind one event after the graph's work, and the engine's next work on the device
  (the worker's next step, whose model runner may zero or copy cache pages before it builds; else the next
  build, graph replay, graph recording, layer forward or cache update) waiting until that thread has issued
  them; the sentinel's check of such a step is collected before the next replay.

Two shortcuts keep a step's Python on the engine's thread to a few lines, since in an engine each line first
touched in a step costs microseconds (its code and objects evicted by the engine's own work between two hooks):

- **runs told ahead** (:class:`_QuietRun`): a step nothing wants, every layer at one step, tells the steps after
  it at once (capture's step filter searched, the sentinel's draws made, up to QUIET_AHEAD steps); while no
  other count moves and the filters stay, their builds and choices ask nothing and their replays only count.
  Through vLLM's graph wrapper such a replay skips the graph call's questions too (:meth:`GraphHooks.quiet_replay`:
  the same wrapper, batch descriptor and entry, nothing built for a capture or handed over, no check of the
  sentinel's out but on its own staged copies);
- **tickets** (:class:`_Ticket`): once a wanted step of a shape was staged inside vLLM's graph with its metadata,
  a later wanted build of that shape keeps nothing (``BuilderHooks._on_ticket``); through vLLM's graph wrapper the
  call installs the staged variant on the ticket with a few reads (:meth:`GraphHooks.ticket_replay`: the ticket's
  wrapper, batch descriptor and entry, no count moved, the filters the same, the program free; else the choice
  takes it the same way), and the replay's hook hands the build as given to the capture thread, which makes the
  step's context there (:meth:`GraphHooks._ticket_job`). A ticketed build read any other way is kept then, as any
  build (``BuilderHooks._settle_build``).

Padding rows of a graph's batch (vLLM pads a batch up to the graph's size with requests of no tokens on the
null block) are not requests: the builder hook keeps only the rows with tokens, and the query rows past the
step's tokens are not stored.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from itertools import repeat
from operator import add, is_not
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvdbg.capture")

# Where vLLM defines the wrapper that records and replays its CUDA graphs.
GRAPH_WRAPPER = ("vllm.compilation.cuda_graph", "CUDAGraphWrapper")
# How many steps ahead a graph's replays are told unwanted at once (GraphHooks._quiet_horizon): the capture's step
# filter searched and the sentinel's draws made that far ahead, once per run of steps. The step that tells a run
# asks every question, its code cold in an engine (about 100 us at 32 ahead on a 2-core CPU with the caches
# evicted, docs/benchmarks.md), so a longer run spreads it over more steps; the draws cost the same either way
# (one a step, made once).
QUIET_AHEAD = 128
# The longest the engine's thread waits for the graph capture thread to issue a step's copies (it takes about a
# millisecond a layer; this is for a thread stuck on a device that no longer answers).
GRAPH_CAPTURE_WAIT_S = 30.0


def _fits(buffer: Any, t: Any, rows: int) -> bool:
    """Whether ``t``'s first ``rows`` rows can be copied into ``buffer`` (one of a layer's graph copy buffers)."""
    return buffer is not None and buffer.shape[0] >= rows and buffer.shape[1:] == t.shape[1:] \
        and buffer.dtype == t.dtype and buffer.device == t.device


class _Done:
    """A one-shot flag that threads wait on, as ``threading.Event`` does, made with one lock (an Event makes a
    condition and two locks: dearer, and a wanted graph step makes one on the engine's thread)."""

    __slots__ = ("_lock", "_set")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._set = False

    def set(self) -> None:
        if not self._set:
            self._set = True
            self._lock.release()

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        if self._set:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # the next waiter passes too
            return True
        return self._set


class _NotAhead(Exception):
    """A layer's staged pages cannot go to the host in one copy: no copies are issued ahead for the step."""


@dataclass(slots=True)
class GraphSlot:
    """One layer of one recorded graph: where the graph copies the layer's query and output, and what the
    capture needs that the graph's Python no longer hands over (the impl, the layer, its cache tensor)."""

    name: str
    impl: Any
    layer: Any
    kv_cache: "torch.Tensor"
    query: "torch.Tensor"
    output: "torch.Tensor | None" = None
    staging: Any = None  # (page_dim, page_size) of the layer's cache, for graph_staging; read once
    # (declaration, scales, (cache layout, capture layer)): what the sentinel's staged checks of the layer need, worked
    # out once (sentinel_hooks.SentinelHooks._graph_layer)
    checked: Any = None


class _GraphBuffers:
    """A layer's buffers for its query and output: one each, rows for the largest graph; views per graph."""

    __slots__ = ("query", "output")

    def __init__(self, query: "torch.Tensor", output: "torch.Tensor | None" = None):
        self.query, self.output = query, output


@dataclass(eq=False)
class _GraphJob:
    """A wanted step of a replayed graph, for the capture thread: its layers (slot, step, build context), the
    event after the graph's work, and, once the thread has issued every copy, the event after them."""

    items: list
    tokens: int
    ready: Any = None  # torch.cuda.Event on the engine's stream after the replay (None on a CPU)
    device: Any = None
    issued: Any = None  # torch.cuda.Event after the capture thread's copies (None on a CPU, or none issued)
    finished: _Done = field(default_factory=_Done)
    abandoned: bool = False  # the engine's thread stopped waiting for it (GRAPH_CAPTURE_WAIT_S)
    staged: Any = None  # graph_staging.StagedStep: the step's copies staged on the device (nothing to wait for)


class _QuietRun:
    """Replays of one graph that nothing can want, told once for up to QUIET_AHEAD steps (GraphHooks._quiet_horizon):
    while no count moved but the run's own (``epoch``) and capture's filters are the same, the build of ``step`` and
    the choice of graph for it ask nothing of the filters or the sentinel, and the replay's hook only counts."""

    __slots__ = ("batch", "names", "config", "step", "horizon", "epoch", "chosen", "wrapper", "entry", "plain",
                 "table", "taken", "lent")

    def __init__(self, batch: Any, names: tuple, config: Any, step: int, horizon: int, epoch: int,
                 graph: tuple = (None, None, None), taken: int = -1):
        self.batch, self.names, self.config = batch, names, config
        self.step, self.horizon, self.epoch = step, horizon, epoch  # the layers' next step; the first one not told
        # The horizon when capture's filters take it (for a layer the layer filter selects, on this rank), else -1:
        # a build of that step, with nothing counted since the run's last replay, may be told on its shape's ticket
        # right there (builder_hooks.after_build).
        self.taken = taken
        self.chosen = None  # the batch descriptor the choice took the run for, until its replay's hook
        # vLLM's wrapper, its entry for the batch and the graph's plain variant: what GraphHooks.quiet_replay installs;
        # and the wrapper's table of entries then (a new table: its graphs recorded anew)
        self.wrapper, self.entry, self.plain = graph
        self.table = getattr(self.wrapper, "concrete_cudagraph_entries", None)
        self.lent = False  # whether its builders were lent vLLM's own build (GraphHooks._lend_builders)


@dataclass(eq=False, slots=True)
class _Ticket:
    """What a wanted step of one shape (a builder's padded tokens and rows) needs on the engine's thread once one
    such step was staged inside vLLM's graph (``GraphHooks._make_ticket``): its build is then kept as given, the call
    of vLLM's graph wrapper (``GraphHooks.ticket_replay``, or the choice of graph) checks the few facts below, and the
    replay's hook counts the forwards and hands the step to the capture thread, which makes its context and staged
    step there (``GraphHooks._ticket_job``)."""

    builder: Any
    selected: list  # the builder's layers capture's layer filter selects (the list kept per configuration)
    facts: Any  # the builder's _BuilderFacts
    wrapper: Any
    batch: Any
    graph: tuple  # the staged variant: (graph, output)
    program: Any  # its graph_staging.InGraphProgram
    slots: tuple
    names: tuple
    max_seq_len: float  # the longest request the program's pages hold at the shape's rows (inf: any)
    tokens: int
    rows: int  # the rows of each layer's query and output copies
    entry: Any = None  # vLLM's entry for the batch, and the wrapper's table of entries then (a new table: its
    table: Any = None  # graphs recorded anew; vLLM never replaces an entry in a table, see quiet_replay)
    covers: bool = False  # every selected layer is one of the graph's (their steps then a quiet run's, if any)
    # Capture's configuration under which the builder's selected layers were last found to be ``selected``
    # (BuilderHooks._on_ticket; let go when the builder's are worked out anew): a quiet run's end under it asks
    # that no more (after_build).
    told: Any = None


class _GraphCaptureThread:
    """The thread that captures the wanted steps of replayed graphs, one job at a time (graph_hooks' module doc)."""

    def __init__(self, state: "GraphHooks"):
        self.state = state
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._main, name="kvdbg-graph-capture", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        from kvdbg.vllm_plugin.graph_staging import RELEASE_POLL_S

        streams: dict[Any, Any] = {}
        while True:
            try:  # while a step staged inside a graph is still being copied, its program is let go once it is done
                pending = self.state._poll_in_graph_releases()
            except Exception as exc:  # noqa: BLE001 - said; the programs then stay held, and steps staged as before
                self.state.capturer._note_once(f"release:{type(exc).__name__}", f"kvdbg capture: letting a staging "
                                               f"inside vLLM's graph go failed ({type(exc).__name__}: {exc})")
                pending = False
            try:
                job = self.jobs.get(timeout=RELEASE_POLL_S) if pending else self.jobs.get()
            except queue.Empty:
                continue
            if job is None:
                return
            if isinstance(job, threading.Event):  # drain(): every job before it is done
                job.set()
                continue
            if job.__class__ is tuple:  # a step handed on its ticket: its job made here (none: said lost)
                try:
                    job = self.state._ticket_job(job)
                except Exception as exc:  # noqa: BLE001 - said; the thread goes on with the next job
                    self.state.capturer.report(exc, "the graph capture thread", step_lost=True)
                    job = None
                if job is None:
                    continue
            try:
                self.state._capture_graph_job(job, streams)
            except Exception as exc:  # noqa: BLE001 - said, and the engine's thread is never left waiting
                self.state.capturer.report(exc, "the graph capture thread", step_lost=True)
            finally:
                job.finished.set()

    def drain(self, timeout: float) -> bool:
        """Wait until every job handed so far is done; whether they were within ``timeout`` seconds."""
        marker = threading.Event()
        self.jobs.put(marker)
        return marker.wait(timeout)

    def stop(self, timeout: float) -> None:
        self.jobs.put(None)
        self.thread.join(timeout)


class GraphHooks:
    """The plugin state's hooks for full CUDA graphs (mixed into ``_PluginState``)."""

    # ---------------------------------------------------------------- what a graph call is

    def graph_call(self, wrapper: Any) -> tuple[str, Any] | None:
        """What this call of vLLM's graph wrapper does, with the graph's batch descriptor (its key: a full graph
        of N tokens for uniform decode batches and one for mixed batches are two graphs): ``"record"`` a full
        graph (attention inside), ``"record_pieces"`` a piecewise one (attention runs in Python between its
        pieces, also while they record), ``"replay"`` a full one; None: no graph, or piecewise pieces replayed."""
        try:
            if self._lent:  # no quiet run's replay (quiet_replay took them back already, but for a ticket's call);
                # the worker's execute_model stays lent (_not_quiet says why)
                self._take_builders_back(worker=False)
            context = self._forward_context
            if context is None:
                from vllm.forward_context import get_forward_context, is_forward_context_available

                context = self._forward_context = (is_forward_context_available, get_forward_context)
            available, get = context
            if not available():
                return None
            forward = get()
            mode = forward.cudagraph_runtime_mode
            if mode is None or mode != wrapper.runtime_mode:
                return None
            # An enum's name is a Python property: read once per mode (this runs on every step).
            name = self._mode_names.get(mode)
            if name is None:
                name = self._mode_names[mode] = str(getattr(mode, "name", ""))
            if name == "NONE":
                return None
            batch = forward.batch_descriptor
            if batch is None:
                return None
            full = name == "FULL"
            entry = wrapper.concrete_cudagraph_entries.get(batch)
            if entry is None or entry.cudagraph is None:
                return ("record" if full else "record_pieces"), batch
            return ("replay", batch) if full else None
        except Exception as exc:  # an unknown vLLM: say it once, capture what eager steps show
            self.capturer.report(exc, "CUDAGraphWrapper.__call__")
            return None

    def _poll_in_graph_releases(self, wait: bool = False) -> bool:
        """:meth:`InGraphProgram.poll_released` of every staged variant's program; whether a hold is still pending."""
        pending = False
        for program in list(self._in_graph_programs.values()):
            pending |= program.poll_released(wait)
        return pending

    def before_graph_recording(self) -> None:
        """vLLM is about to record a graph (a full one, or one piece of a piecewise one): the sentinel's checks of
        earlier steps still in its worker are collected first. CUDA forbids, process-wide, what the worker does (a
        sync, an allocation) while a stream captures, and vLLM records right after its warm-up steps, which the
        sentinel may have sampled. No check is handed to the worker while a graph records (its hooks see the
        stream capturing); between the pieces of a piecewise graph one may be, and the next piece collects it."""
        self.await_graph_capture()
        if self.sentinel is not None:  # first: a wrong step it captures now leaves a hold to let go below
            self.sentinel.before_graph_replay(self, recording=True)
        if self._in_graph_programs:  # the capture thread idle and every staged read done: it queries nothing now
            self.drain_graph_capture(GRAPH_CAPTURE_WAIT_S)
            self._poll_in_graph_releases(wait=True)

    def begin_graph_recording(self, batch: Any) -> None:
        """A full graph for ``batch`` (vLLM's batch descriptor) is about to be recorded: its selected layers are
        learnt anew."""
        self._graph_layers[batch] = []
        shape = (int(batch.num_tokens), getattr(batch, "num_reqs", None))
        self._graph_shapes.add(shape)
        self._graph_rows = max(self._graph_rows, shape[1] or shape[0])
        self._stage_layouts.clear()  # a recording may give a layer larger copy buffers: worked out again
        self._drop_tickets()  # a graph's variants are recorded anew: each shape earns its ticket again
        self._end_quiet_run()
        self._pending_build = None  # the recording's own build (a dummy batch): never a step
        self._recording = batch

    def end_graph_recording(self) -> None:
        self._recording = None

    # ---------------------------------------------------------------- two graphs of each size

    def record_plain_graph(self, wrapper: Any, batch: Any, record: Any, forward_state: Any = None) -> None:
        """vLLM has just recorded its full graph for ``batch`` with kvdbg's copies in it: record it once more
        without them (``record()`` calls vLLM's wrapper again, its entry emptied so that it records anew) and keep
        both. A step that nothing wants then replays the plain graph, exactly the engine's own work; a step that
        capture wants or the sentinel samples replays the one with the copies (:meth:`choose_graph`). Should
        the second recording fail, it is said once and every step replays the graph with the copies."""
        self._graph_variants.pop((id(wrapper), batch), None)  # an earlier recording's, which vLLM let go
        self._staged_variants.pop((id(wrapper), batch), None)
        entries = getattr(wrapper, "concrete_cudagraph_entries", None)
        entry = entries.get(batch) if isinstance(entries, dict) else None
        if not self._graph_layers.get(batch) or entry is None or getattr(entry, "cudagraph", None) is None:
            return
        copying = (entry.cudagraph, entry.output)
        plain = self._record_variant(entry, copying, record, forward_state, batch, None)
        if plain is None:
            return
        if not self._graph_variants:
            logger.info("kvdbg: each full CUDA graph is recorded twice, with kvdbg's copies of the selected layers' "
                        "query and output and without them; a step that capture wants or the sentinel samples "
                        "replays the first, every other step the second (the engine's own work alone)")
        self._graph_variants[(id(wrapper), batch)] = (entry, copying, plain)

    def record_staged_graph(self, wrapper: Any, batch: Any, record: Any, forward_state: Any = None) -> None:
        """After the plain variant, a third recording of vLLM's full graph for ``batch`` when capture is on or the
        sentinel checks, for every layer the graph copies: the layers' copies again, then, after the model's forward
        and inside the graph, the staging of the step (:class:`~kvdbg.vllm_plugin.graph_staging.InGraphProgram`:
        the pages the step's lengths read, the query and output copies, the metadata). A wanted or drawn step that
        replays it is staged with no torch call on the engine's thread (:meth:`choose_graph`). Should it fail, it is
        said once, and such steps replay the graph with the copies and are staged from the host as before."""
        key = (id(wrapper), batch)
        self._staged_variants.pop(key, None)
        variants = self._graph_variants.get(key)
        slots = self._graph_layers.get(batch)
        if variants is None or not slots:
            return
        # A step replays this variant only when capture wants every layer the graph copies for kvdbg or the sentinel
        # draws every one (_in_graph_step): else its staging would hold device memory and never run.
        captured = self.capturer.active and all(self.capturer.layer_selected(slot.name) for slot in slots)
        checked = self.sentinel is not None and all(self.sentinel.sentinel.layer_selected(slot.name) for slot in slots)
        if not captured and not checked:
            if not self._staged_skip_said and self.capturer.active \
                    and any(self.capturer.layer_selected(slot.name) for slot in slots):
                self._staged_skip_said = True
                logger.info("kvdbg: the full CUDA graphs are not recorded a third time with kvdbg's staging in them: "
                            "the graphs copy layers for the sentinel that capture's layer filter leaves out, and the "
                            "sentinel's leaves out some capture selects; a step is staged inside the graph only when "
                            "capture wants, or the sentinel draws, every layer the graph copies. Such steps are "
                            "staged by the engine's thread after the replay")
            return
        entry, copying, _ = variants
        try:
            program = self._in_graph_program(slots)
        except Exception as exc:  # noqa: BLE001 - wanted steps are staged from the host, as before
            self._variant_failed(batch, "staged", exc)
            return
        if program is None:
            return
        rows = int(slots[0].query.shape[0])
        runnable = wrapper.runnable

        def forward_then_stage(*args: Any, **kwargs: Any) -> Any:
            output = runnable(*args, **kwargs)
            program.graph_body(rows)
            return output

        wrapper.runnable = forward_then_stage
        try:
            staged = self._record_variant(entry, copying, record, forward_state, batch, program)
        finally:
            wrapper.runnable = runnable
        if staged is None:
            return
        if not self._staged_variants:
            logger.info("kvdbg: each full CUDA graph is also recorded with kvdbg's staging in it (%d pages of every "
                        "selected layer, %.0f MiB): a step %s replays that variant when its pages fit and no earlier "
                        "step's staging is still being read", program.size, program.nbytes / 2**20,
                        " or ".join(what for what, on in (("capture wants", captured), ("the sentinel draws", checked))
                                    if on))
        self._staged_variants[key] = (staged, program)

    def _record_variant(self, entry: Any, copying: tuple, record: Any, forward_state: Any, batch: Any,
                        program: Any) -> tuple | None:
        """vLLM's wrapper records its graph for ``batch`` once more, its entry emptied so that it records anew, then
        the entry is given back the graph with the copies: plain (``program`` None: nothing of kvdbg's recorded)
        or staged (the layers' copies again, the wrapper's forward then running ``program``). (graph, output) of
        the new recording, or None (a failure said once)."""
        entry.cudagraph = None
        self._recording_plain = program is None
        if program is not None:
            self._recording, self._recording_again, self._again_failed = batch, True, None
        try:
            with self.held_writers():
                if forward_state is not None:  # what the first recording's forward moved on, as it found it
                    forward_state()
                record()
            if self._again_failed is not None:
                raise RuntimeError(self._again_failed)
            variant = (entry.cudagraph, entry.output)
        except Exception as exc:  # noqa: BLE001 - the graph with the copies serves, as before
            self._variant_failed(batch, "plain" if program is None else "staged", exc)
            variant = None
        finally:
            self._recording_plain = self._recording_again = False
            if program is not None:
                self._recording, self._again_failed = None, None
            entry.cudagraph, entry.output = copying
        return None if variant is None or variant[0] is None else variant

    def _variant_failed(self, batch: Any, which: str, exc: BaseException) -> None:
        if which == "plain":
            what = ("a second time, without kvdbg's copies,", "every step of it replays the graph with the copies")
        else:
            what = ("with kvdbg's staging in it", "its wanted steps are staged by the engine's thread after the replay")
        self.capturer._note_once(f"{which}:{type(exc).__name__}", f"kvdbg: recording vLLM's full CUDA graph of {batch} "
                                 f"{what[0]} failed ({type(exc).__name__}: {exc}); {what[1]}")

    def _in_graph_program(self, slots: list) -> Any:
        """The program a staged variant of a graph with these slots runs (made once for the runner's buffers and the
        layers' caches and copy buffers), or None when staging cannot read them or no build of theirs was seen."""
        from kvdbg.vllm_plugin.graph_staging import IN_GRAPH_MAX_BYTES, MIN_PAGES, InGraphProgram, stage_hint

        common = None
        for builder, last in self._last_builds.values():
            if self._covers_graph_layers(builder):
                common = last
        if common is None:
            return None
        buffers = (common.block_table_tensor, common.seq_lens, common.query_start_loc)
        hint = stage_hint(common, buffers, int(common.num_reqs))
        if hint is None or hint.seq_lens is None or hint.seq_lens.dim() != 1 or hint.seq_lens.stride(0) != 1 \
                or hint.block_table.dim() != 2 or hint.block_table.stride(1) != 1:
            return None
        layers, page_size = self._staged_layers(tuple(slots))
        if layers is None:
            return None
        rows = InGraphProgram.rows_for(hint)
        key = (hint.block_table.data_ptr(), hint.block_table.stride(0), hint.seq_lens.data_ptr(), rows,
               tuple((name, cache.data_ptr(), query.data_ptr(), 0 if output is None else output.data_ptr())
                     for name, cache, _, query, output in layers))
        program = self._in_graph_programs.get(key)
        if program is None:
            per_page = sum(cache.element_size() * (cache.numel() // max(1, cache.shape[dim]))
                           for _, cache, dim, _, _ in layers)
            pages = min(rows * int(hint.block_table.shape[1]), IN_GRAPH_MAX_BYTES // max(1, per_page))
            if pages < MIN_PAGES:
                return None
            program = self._in_graph_programs[key] = InGraphProgram(hint.block_table.device, hint, layers, pages,
                                                                    rows, page_size)
        return program

    def _in_graph_step(self, batch: Any, program: Any, slots: list, names: tuple, steps: list) -> tuple | None:
        """The coming replay of ``batch``'s graph as a step the staged variant serves, or None: every layer of the
        graph at one step with one build's context, wanted by capture on every layer (its filters and budget asked
        once) or drawn by the sentinel on every layer (and then wanted by capture on all or none), no reader holding
        the program, the build read the program's buffers and its pages fit. Then (batch, program, names, steps,
        layers, hint, metadata staged, captured, checked) for :meth:`after_graph_replay`, which hands the step to
        the capture thread and the sentinel with nothing asked again."""
        step = steps[0]
        if steps.count(step) != len(steps):
            return None
        checked = self.sentinel is not None and self.sentinel.sentinel.drawn(step)
        if checked:
            items = self._every_layer_checked(batch, slots, names, step)
            if items is None:
                return None
            captured = self._capture_takes_all(batch, names, step)
            if not captured and not self._no_layer_wanted(batch, step):
                return None  # capture wants some of its layers: the host stages the step for both
        else:
            items = self._every_layer_wanted(batch, slots, names, step)
            captured = True
        if items is None:
            return None
        if not program.reusable():
            # Holds let go whose readers' copies may be done by now: asked here too (the capture thread asks between
            # its jobs, and waits for its next one when none was pending then; with the sentinel alone nobody else
            # does). One event query each, only while a hold is pending.
            if not program._pending or program.poll_released() or not program.reusable():
                return None
        hint = items[0][2].stage
        serves = 0 if hint is None else program.serves(hint)
        if not serves:
            return None
        return batch, program, names, steps, items, hint, serves == 2, captured, checked

    def _every_layer_checked(self, batch: Any, slots: list, names: tuple, step: int) -> list | None:
        """Every layer of the graph, all at ``step``, checked by the sentinel with one build's context (the layers'
        names all selected by its layer filter, kept per graph); None: the host stages the step."""
        sentinel = self.sentinel.sentinel
        hit = self._graph_checked.get(batch)
        if hit is None or hit[0] is not names:
            hit = self._graph_checked[batch] = (names, all(map(sentinel.layer_selected, names)))
        return self._every_layer_built(slots, names, step) if hit[1] else None

    def _no_layer_wanted(self, batch: Any, step: int) -> bool:
        """Whether capture takes no layer of the graph at ``step`` (as :meth:`_nothing_wanted` last told its layers:
        none selected on this rank, or the step filter takes none; a step it would take with capture off is counted
        dropped by the layers' hooks, so not this)."""
        hit = self._graph_takers.get(batch)
        return hit is not None and hit[1] is self.capturer.config and (not hit[2]
                                                                       or self.capturer.takes_no_step(step, step))

    def _prepared_step(self, wrapper: Any, batch: Any, prepared: tuple) -> tuple | None:
        """:meth:`_in_graph_step` for a step its build already told wanted on every layer at one step (the build's
        ``_prepared``), asking nothing of the filters again: taken when no forward was counted since (the counts'
        epoch) and the filters are the same, the graph's layers are all the build's, and the program is free and
        serves the step."""
        names_built, step, ctx, epoch, config = prepared
        if epoch != self._counts_epoch or config is not self.capturer.config or not self._staged_variants:
            return None
        staged = self._staged_variants.get((id(wrapper), batch))
        slots = self._graph_layers.get(batch)
        if staged is None or not slots:
            return None
        names, distinct = self._slot_names(batch, slots)
        covered = self._covered.get(batch)
        if covered is None or covered[0] is not names or covered[1] is not names_built:
            covered = self._covered[batch] = (names, names_built, distinct and set(names) <= set(names_built))
        if not covered[2] or (self.sentinel is not None and self.sentinel.sentinel.drawn(step)):
            return None  # the sentinel's draw: asked as below (_in_graph_step)
        program = staged[1]
        hint = ctx.stage
        serves = 0 if hint is None or not program.reusable() else program.serves(hint)
        if not serves:
            return None
        return (batch, program, names, [step] * len(names), list(zip(slots, repeat(step), repeat(ctx))), hint,
                serves == 2, True, False)

    def quiet_replay(self, wrapper: Any) -> "_QuietRun | None":
        """The coming call of ``wrapper`` as the next step of the quiet run told for it (:class:`_QuietRun`), told
        with a few reads instead of :meth:`graph_call`, :meth:`choose_graph` and :meth:`before_graph_replay`: the
        same full graph replayed, nothing counted, built for a capture or handed over since, the filters the same,
        no check of the sentinel's out that reads the engine's memory (staged ones done are collected here). Then
        the plain variant is installed and the run returned, for
        :meth:`quiet_replayed` once vLLM queued the replay; None: the call is asked as any other."""
        try:
            run = self._quiet_run
            if run is None or run.wrapper is not wrapper or run.epoch != self._counts_epoch \
                    or run.step >= run.horizon or run.config is not self.capturer.config \
                    or self._pending_build is not None or self._prepared is not None or self._graph_job is not None \
                    or (self.sentinel is not None and not self.sentinel.quiet_replay_ready(self)):
                return self._not_quiet()
            context = self._forward_context  # kept by graph_call, which the run's first step went through
            if context is None or not context[0]():
                return self._not_quiet()
            forward = context[1]()
            batch = forward.batch_descriptor
            # vLLM's entry for the batch still the run's: vLLM lets its graphs go through clear_graphs (which ends the
            # run) or by giving the wrapper a new table (elastic expert parallelism re-records them so), and never
            # replaces an entry in a table.
            if forward.cudagraph_runtime_mode is not wrapper.runtime_mode or batch != run.batch \
                    or wrapper.concrete_cudagraph_entries is not run.table:
                return self._not_quiet()
            self._in_graph_ran = self._quiet = None
            entry = run.entry
            if entry.cudagraph is not run.plain[0]:
                entry.cudagraph, entry.output = run.plain
            self._plain_ran = True
            self.plain_replays += 1
            return run
        except Exception as exc:  # noqa: BLE001 - never into vLLM's forward: the call is asked as any other
            self._end_quiet_run()
            self.capturer.report(exc, "a CUDA graph's replay told quiet ahead")
            return None

    def ticket_replay(self, wrapper: Any) -> Any:
        """The coming call of ``wrapper`` as the step its build kept on a ticket (``_pending_build``), told with a few
        reads instead of :meth:`graph_call`, :meth:`choose_graph` and :meth:`before_graph_replay`: the ticket's graph
        and batch, no forward counted and the filters the same since the build, its program free, no capture of an
        earlier step still to issue. Then the staged variant is installed, the step kept as :meth:`choose_graph`
        keeps it, and that returned for :meth:`ticket_replayed` once vLLM queued the replay; None: the call is asked as
        any other (the build still kept)."""
        try:
            pending = self._pending_build
            ticket = pending[0]
            # _ticket_fits, read here in line (keep the two alike): a wanted step is rare, so each call of its own
            # would be a cold one.
            if ticket.wrapper is not wrapper or pending[5] != self._counts_epoch \
                    or pending[6] is not self.capturer.config or ticket.program._holds or ticket.table is None \
                    or self._graph_job is not None or self.sentinel is not None:
                return None
            context = self._forward_context  # kept by graph_call, which the shape's first wanted step went through
            if context is None or not context[0]():
                return None
            forward = context[1]()
            batch = forward.batch_descriptor
            # The ticket's graph, and vLLM's table of graphs the ticket's: vLLM lets its graphs go through
            # clear_graphs (forget_graphs lets every ticket go: _drop_tickets) or by giving the wrapper a new table.
            if forward.cudagraph_runtime_mode is not wrapper.runtime_mode or batch != ticket.batch \
                    or wrapper.concrete_cudagraph_entries is not ticket.table:
                return None
            entry = ticket.entry
            entry.cudagraph, entry.output = ticket.graph
            self._pending_build = self._prepared = self._quiet = None
            fast = self._in_graph_ran = (batch, ticket.program, ticket, pending)
            self._plain_ran = False
            self.staged_replays += 1
            return fast
        except Exception as exc:  # noqa: BLE001 - never into vLLM's forward: the call is asked as any other
            self.capturer.report(exc, "a CUDA graph's replay on a ticket")
            return None

    def _drop_tickets(self) -> None:
        """Every shape's ticket gone, and each one let go marked so (its table none), so that a build kept on one
        before (``_pending_build``) is no longer told on it: vLLM's ``clear_graphs`` empties the wrapper's table in
        place, which :meth:`ticket_replay`'s check of the table's identity alone would not see."""
        for ticket in self._tickets.values():
            ticket.table = None
        self._tickets.clear()

    def _ticket_fits(self, pending: tuple, wrapper: Any) -> bool:
        """Whether the build kept on a ticket (``_pending_build``) may be handed on it by this call of ``wrapper``
        (its graph's batch told by the caller): the ticket's wrapper, no forward counted and the filters the same
        since the build, the program free."""
        ticket = pending[0]
        return ticket.wrapper is wrapper and pending[5] == self._counts_epoch and pending[6] is self.capturer.config \
            and not ticket.program._holds and ticket.table is not None

    def quiet_replayed(self, run: "_QuietRun") -> None:
        """The quiet run's step is queued (:meth:`quiet_replay`): its layers' forwards counted, nothing else.

        The run's step is its layers' count, so the counts themselves are written at their first read
        (:meth:`count_quiet_replays`), not on every replay: a dict write per layer, whose keys and entries a serving
        engine's step has evicted from the processor's caches, was most of a quiet replay's Python. Meanwhile the dict
        is off the instance, so no read can miss them (the state's class writes them first: state._UncountedReplays)."""
        try:
            run.step += 1
            if self._uncounted is not run:  # the run's first replay since the counts were read
                counts = self._forward_counts  # (another run's replays written in first)
                self._uncounted, self._counts_off = run, counts
                del self._forward_counts
            run.epoch = self._counts_epoch = self._counts_epoch + 1
            if run.step < run.horizon:  # the next step is the run's too: its builds need no hook
                if not run.lent:
                    self._lend_builders(run)
            elif self._lent:  # the next step is one the filters or the sentinel may want: its builds told (the
                # worker's execute_model stays vLLM's own: its hook only waits for a capture that reads the engine's
                # memory, and handing one over takes it back first)
                self._take_builders_back(worker=False)
        except Exception as exc:  # noqa: BLE001 - never into vLLM
            self._end_quiet_run()
            self.capturer.report(exc, "after a CUDA graph's replay told quiet ahead")

    def _lend_builders(self, run: "_QuietRun") -> None:
        """vLLM's own methods back, as attributes of the objects themselves, on what the quiet run's next steps call
        but need no hook of kvdbg's in, until :meth:`_take_builders_back`: each builder the run holds (every layer of
        it that capture selects or the sentinel checks is one of the run's graph's, :meth:`BuilderHooks._quiet_builder`)
        and the worker's ``execute_model`` (its hook only waits for a capture that reads the engine's memory, and none
        is while a run lasts: a step handed over so takes them back first). A quiet build only kept the build for a graph's next
        recording, which no step of a run makes (a recording goes through the graph call, which takes them back
        first, and finds no build kept: its staged variant is not recorded, as for any graph whose build was not
        seen). Lent once a run (``run.lent``), only with nothing of a build waited for or kept (no capture still
        copying, no build on a ticket); a host copy of a lent builder's slot mapping is let go then, as its quiet
        builds would let it go (a copy is read only before the forward it was made for, ``host_slots``, so one
        of another buffer is never read for the run's steps).

        Each builder's is taken back before any step the run did not tell builds: at the run's horizon, at any graph
        call that is not the run's replay, at a layer's forward in Python, at new filters (from any thread:
        ``Capturer.on_reconfigure``), when a step is handed over, and when the plugin goes away. The worker's stays
        past the horizon and other graph calls (its hook would have nothing to wait for), and comes back with the
        others at the rest: a step handed over to be read from the engine's memory first of all."""
        run.lent = True
        if self._graph_job is not None or self._pending_build is not None:
            return
        with self._lending:
            # The filters again, under the lock: new ones set from another thread since quiet_replay read them
            # (reconfigure sets them before it takes the lent methods back, under this lock) lend nothing.
            if run.config is not self.capturer.config:
                return
            for key, (builder, _) in list(self._last_builds.items()):
                known = self._quiet_builders.get(key)
                if known is None or not known[2] or known[0] is not run.names or known[1] is not run.config:
                    continue
                if self._lend(builder, "build"):
                    common = self._last_builds.pop(key)[1]
                    if self._host_slots and common.slot_mapping is not None:
                        self._host_slots.pop(common.slot_mapping.data_ptr(), None)
            if self._worker is not None:
                self._lend(self._worker, "execute_model")

    def _lend(self, owner: Any, name: str) -> bool:
        """vLLM's own method ``name`` bound on ``owner`` itself, over the class's patch (under ``_lending``): only
        where the class's method is kvdbg's own patch (not another tool's wrapper around it, nor after restore())."""
        own = getattr(owner, "__dict__", None)
        patched = getattr(type(owner), name, None)
        if own is None or name in own or patched is None or patched not in self._wrappers:
            return False
        try:
            setattr(owner, name, patched._kvdbg_original.__get__(owner, type(owner)))
        except (AttributeError, TypeError):  # an object that takes no attribute of that name: its hook stays
            return False
        if name == "execute_model":  # the worker's, kept apart: it may stay lent past the run (_not_quiet)
            self._worker_lent = owner
        else:
            self._lent.append((owner, name))
        return True

    def _take_builders_back(self, worker: bool = True) -> None:
        """Every method :meth:`_lend_builders` lent vLLM's own to has kvdbg's hook back (the class's patch); one that
        cannot be is said, and the others still are. ``worker=False``: the worker's ``execute_model`` stays lent."""
        with self._lending:
            lent = self._lent
            if worker and self._worker_lent is not None:
                lent.append((self._worker_lent, "execute_model"))
                self._worker_lent = None
            while lent:
                owner, name = lent.pop()
                try:
                    own = owner.__dict__.get(name)
                    if own is not None and getattr(own, "__self__", None) is owner:
                        delattr(owner, name)
                except Exception as exc:  # noqa: BLE001 - never into vLLM
                    self.capturer.report(exc, f"giving {type(owner).__name__}.{name} kvdbg's hook back")

    def _not_quiet(self) -> None:
        """A graph call that is no quiet run's replay: the builders lent to the run are taken back (the step's own build
        ran without kvdbg's hook; a step of the run's layers before its horizon is one nothing wants). The worker's
        execute_model stays vLLM's own (its hook only waits for a capture that reads the engine's memory, and handing
        one over takes it back first)."""
        if self._lent:
            self._take_builders_back(worker=False)
        return None

    def _end_quiet_run(self) -> None:
        """No run told any more, and none left holding vLLM's wrapper or a graph (its replays' counts written now), nor
        a builder lent vLLM's own build."""
        self._quiet_run = None
        if self._lent or self._worker_lent is not None:
            self._take_builders_back()
        if self._uncounted is not None:
            self.count_quiet_replays()

    def count_quiet_replays(self) -> dict[str, int]:
        """The forward counts with the uncounted quiet run's replays written in (:meth:`quiet_replayed`), back on the
        instance as ``_forward_counts``."""
        counts, run = self._counts_off, self._uncounted
        counts.update(zip(run.names, repeat(run.step)))
        self._forward_counts = counts
        self._uncounted = self._counts_off = None
        return counts

    def choose_graph(self, wrapper: Any, batch: Any) -> None:
        """Before vLLM replays its full graph for ``batch``: the variant with kvdbg's copies when this step of any of
        the graph's layers may be captured or checked (the filters, the sentinel's draw), else the plain one."""
        self._in_graph_ran = self._quiet = None
        prepared, self._prepared = self._prepared, None  # the latest build's answer serves this choice or none
        pending = self._pending_build
        variants = self._graph_variants.get((id(wrapper), batch)) if self._graph_variants else None
        if variants is None:
            self._plain_ran = False
            if pending is not None:  # the step runs as vLLM wills: its build kept for the hooks that read it
                self._settle_build()
                self._prepared = None
            return
        entry, copying, plain = variants
        if wrapper.concrete_cudagraph_entries.get(batch) is not entry:  # vLLM let its graphs go since
            del self._graph_variants[(id(wrapper), batch)]
            self._staged_variants.pop((id(wrapper), batch), None)
            self._drop_tickets()
            self._plain_ran = False
            if pending is not None:
                self._settle_build()
                self._prepared = None
            return
        try:
            use = plain
            fast = None
            if pending is not None:
                ticket = pending[0]
                if ticket.batch == batch and self._ticket_fits(pending, wrapper):
                    # Wanted on every layer, told at the build; the program free: the staged variant, nothing kept.
                    self._pending_build = None
                    fast = (batch, ticket.program, ticket, pending)
                    use, self._in_graph_ran = ticket.graph, fast
                else:  # asked as for any build
                    self._settle_build()
                    prepared, self._prepared = self._prepared, None
            if fast is None and prepared is not None:
                fast = self._prepared_step(wrapper, batch, prepared)
                if fast is not None:
                    use, self._in_graph_ran = self._staged_variants[(id(wrapper), batch)][0], fast + (wrapper,)
            run = self._quiet_run
            if fast is not None:
                wants = False
            elif run is not None and run.epoch == self._counts_epoch and run.step < run.horizon \
                    and run.config is self.capturer.config and run.batch == batch:
                run.chosen, self._quiet = batch, run  # told unwanted ahead: the replay's hook only counts
                wants = False
            else:
                wants = self._step_wants_copies(batch, (wrapper, entry, plain))
            if wants:
                use = copying
                staged = self._staged_variants.get((id(wrapper), batch)) if self._staged_variants else None
                fast = None if staged is None or wants is True else self._in_graph_step(batch, staged[1], *wants)
                if fast is not None:
                    use, self._in_graph_ran = staged[0], fast + (wrapper,)
        except Exception as exc:  # noqa: BLE001 - never into vLLM's forward: the copies then run, as before
            self.capturer.report(exc, "choosing a CUDA graph to replay")
            use, self._in_graph_ran = copying, None
        self._plain_ran = use is plain
        self.plain_replays += self._plain_ran
        self.staged_replays += self._in_graph_ran is not None
        entry.cudagraph, entry.output = use

    def forget_graphs(self, wrapper: Any) -> None:
        """vLLM let a wrapper's graphs go (``clear_graphs``: after profiling their memory, at a reconfiguration):
        kvdbg lets their variants go too, so that no graph's memory outlives vLLM's own hold on it."""
        for key in [key for key in self._graph_variants if key[0] == id(wrapper)]:
            del self._graph_variants[key]
        for key in [key for key in self._staged_variants if key[0] == id(wrapper)]:
            del self._staged_variants[key]
        self._drop_tickets()
        self._end_quiet_run()
        # Programs no staged variant runs any more go too (a step still reading one keeps it until done), and the
        # builds kept for the next recording: vLLM clears its graphs after profiling their memory with a cache and
        # buffers of its own, which a program must not keep alive.
        used = {id(program) for _, program in self._staged_variants.values()}
        for key in [key for key, program in self._in_graph_programs.items() if id(program) not in used]:
            del self._in_graph_programs[key]
        self._last_builds.clear()

    def install_plain_graphs(self) -> None:
        """Every graph's plain variant in vLLM's entries (the plugin going away, or its patches switched off):
        what vLLM replays then is its own work alone, writing no buffer of kvdbg's."""
        for entry, _, plain in self._graph_variants.values():
            entry.cudagraph, entry.output = plain

    def _step_wants_copies(self, batch: Any, graph: tuple = (None, None, None)) -> Any:
        """Whether the coming replay of ``batch``'s graph is a step that capture's filters select or the sentinel
        draws, on any of its layers (nothing counted: :meth:`after_graph_replay` decides and counts): falsy when
        not; else (slots, names, the layers' steps), or True for a graph that runs a layer twice a step. ``graph``:
        (vLLM's wrapper, its entry for the batch, the plain variant), kept on a quiet run told here."""
        slots = self._graph_layers.get(batch)
        if not slots:
            return False
        names, distinct = self._slot_names(batch, slots)
        if not distinct:  # a layer run twice a step: its steps are counted one by one; always copied
            return True
        steps = list(map(self._forward_counts.get, names, repeat(0)))
        if not self._nothing_wanted(batch, names, steps, True):
            return slots, names, steps
        if self._quiet_after:  # the replay's hook will find the same: it only counts (after_graph_replay)
            self._quiet = (batch, names, steps, self.capturer.config, self._counts_epoch)
            step = steps[0]
            if steps.count(step) == len(steps):  # and the steps after it, as far as nothing can want them
                horizon, taken = self._quiet_horizon(batch, step + 1)
                self._quiet_run = None if horizon <= step + 1 else _QuietRun(
                    batch, names, self.capturer.config, step + 1, horizon, self._counts_epoch + 1, graph,
                    horizon if taken else -1)
        return False

    def _quiet_horizon(self, batch: Any, first: int) -> tuple[int, bool]:
        """The first step from ``first`` on (at most QUIET_AHEAD steps on) that capture's step filter may take or the
        sentinel draws, for the graph's layers as :meth:`_nothing_wanted` last told them (its ``_graph_takers``),
        and whether capture's filters take it; the sentinel's draws are made here, in the order of the steps, as
        its hooks would make them."""
        hit = self._graph_takers[batch]
        last = first + QUIET_AHEAD - 1
        capturer = self.capturer
        taken = False
        if hit[2] and not capturer.takes_no_step(first, last):
            last = next(step for step in range(first, last + 1) if not capturer.takes_no_step(step, step))
            if last == first:
                return first, True
            last -= 1
            taken = True
        if hit[3]:
            drawn = self.sentinel.sentinel.drawn
            for step in range(first, last + 1):
                if drawn(step):
                    return step, False
        return last + 1, taken

    def _nothing_wanted(self, batch: Any, names: tuple, steps: list, active_only: bool = False) -> bool:
        """Whether no layer of the graph is at a step capture's step filter may take (for a layer its layer filter
        selects; ``active_only``: and capture is on) or the sentinel drew (for a layer it checks): one search
        and a draw or two for all the layers, nothing counted. False is a maybe: the caller asks layer by layer."""
        capturer = self.capturer
        config = capturer.config
        hit = self._graph_takers.get(batch)
        if hit is None or hit[0] is not names or hit[1] is not config:
            sentinel = self.sentinel
            hit = self._graph_takers[batch] = (
                names, config, any(map(capturer.layer_selected, names))
                and (config.ranks is None or capturer.rank() in config.ranks),
                sentinel is not None and any(map(sentinel.sentinel.layer_selected, names)))
        lo, hi = min(steps), max(steps)
        # Capture off with a step its filters select: nothing to copy, but the replay's hook counts it as dropped.
        self._quiet_after = True
        if hit[2] and not capturer.takes_no_step(lo, hi):
            if capturer.active or not active_only:
                return False
            self._quiet_after = False
        if hit[3]:
            drawn = self.sentinel.sentinel.drawn
            if drawn(lo) if lo == hi else any(map(drawn, set(steps))):
                return False
        return True

    # ---------------------------------------------------------------- recording (inside the graph)

    def record_in_graph(self, impl: Any, layer: Any, query, kv_cache, output) -> GraphSlot | None:
        """Called for a layer's forward while a graph records: note the layer's place in the graph and, for a
        layer capture selects, record the copy of its query (the output's follows the forward)."""
        if self._recording_plain:  # the graph's plain variant: nothing of kvdbg's in it
            return None
        batch = self._recording
        name = getattr(layer, "layer_name", None)
        if batch is None or name is None:  # a graph recorded outside vLLM's wrapper: not replayed through it
            if name is not None and self.capturer.layer_selected(name):
                self.note_graph_recording(name)
            return None
        captured = self.capturer.active and self.capturer.layer_selected(name)
        checked = self.sentinel is not None and self.sentinel.sentinel.layer_selected(name)
        if not (captured or checked) or kv_cache is None:
            # Neither capture nor the sentinel will ever ask for this layer's steps: its count is never read.
            return None
        rows = int(query.shape[0])
        if self._recording_again:  # the staged variant: the same copies into the same buffers, no slot learnt
            buffers = self._graph_buffers.get(name)
            if not _fits(buffers and buffers.query, query, rows):  # the variant would stage stale copies: not kept
                self._again_failed = (f"layer {name} has no query buffer of the graph's recording with kvdbg's copies "
                                      "that this recording's query fits")
                return None
            buffers.query[:rows].copy_(query[:rows])
            return GraphSlot(name, impl, layer, kv_cache, buffers.query[:rows])
        buffers = self._graph_buffers.get(name)
        if buffers is None or buffers.query.shape[0] < rows or buffers.query.shape[1:] != query.shape[1:] \
                or buffers.query.dtype != query.dtype or buffers.query.device != query.device:
            # Allocated while the graph records, from its pool; alive as long as the plugin, so never reused.
            size = max(rows, self._max_graph_tokens or 0)
            buffers = self._graph_buffers[name] = _GraphBuffers(query.new_empty((size, *query.shape[1:])))
        buffers.query[:rows].copy_(query[:rows])
        slot = GraphSlot(name, impl, layer, kv_cache, buffers.query[:rows])
        self._graph_layers[batch].append(slot)
        return slot

    def record_graph_output(self, slot: GraphSlot, output) -> None:
        """After the layer's forward, still recording: the copy of its output."""
        if output is None:
            return
        rows = slot.query.shape[0]
        buffers = self._graph_buffers[slot.name]
        if not _fits(buffers.output, output, rows):
            if self._recording_again:  # a new buffer here would leave the graph with the copies writing the old one
                self._again_failed = (f"layer {slot.name}'s output does not fit the buffer of the graph's recording "
                                      "with kvdbg's copies")
                return
            size = max(rows, buffers.query.shape[0])
            buffers.output = output.new_empty((size, *output.shape[1:]))
        buffers.output[:rows].copy_(output[:rows])
        slot.output = buffers.output[:rows]

    # ---------------------------------------------------------------- after a replay

    def before_graph_replay(self) -> None:
        """A full graph is about to run a step: the step before's capture issued, the sentinel's checks of it
        collected."""
        if self._graph_job is not None:  # asked before the call: nearly every step has nothing to wait for
            self.await_graph_capture()
        if self.sentinel is not None:
            self.sentinel.before_graph_replay(self)

    def after_graph_replay(self, batch: Any) -> bool:
        """The full graph for ``batch`` was replayed (its work is queued): count its selected layers' forwards (on
        every step, so only theirs), capture the steps wanted and hand the sentinel those it samples. Whether
        anything was copied for a capture."""
        fast = self._in_graph_ran
        if fast is not None:
            self._in_graph_ran = None
            if fast[0] == batch:  # the staged variant replayed: the step was told wanted when it was chosen
                return self.ticket_replayed(fast) if len(fast) == 4 else self._hand_in_graph(fast)
            if len(fast) == 4:  # not the graph chosen for it (never seen): its build kept, the step asked as below
                self._pending_build = fast[3]
                self._settle_build()
        quiet = self._quiet
        if quiet is not None:
            self._quiet = None
            if quiet.__class__ is _QuietRun:
                if quiet.chosen == batch and quiet.epoch == self._counts_epoch and quiet.config is self.capturer.config:
                    quiet.chosen = None
                    quiet.step += 1
                    self._forward_counts.update(zip(quiet.names, repeat(quiet.step)))
                    quiet.epoch = self._counts_epoch = self._counts_epoch + 1
                    return False
                quiet.chosen = None
                quiet = None
        if quiet is not None:
            # Told unwanted when chosen (the same batch, filters and counts, no forward counted between, and a
            # step's draw is kept): its layers' forwards counted, nothing else.
            if quiet[0] is batch and quiet[3] is self.capturer.config and quiet[4] == self._counts_epoch:
                self._forward_counts.update(zip(quiet[1], map(add, quiet[2], repeat(1))))
                self._counts_epoch += 1
                return False
        slots = self._graph_layers.get(batch)
        if not slots:
            return False
        counts = self._forward_counts
        names, distinct = self._slot_names(batch, slots)
        if distinct:  # every layer's count moved on at once, and, armed, most steps let go with one search
            steps = list(map(counts.get, names, repeat(0)))
            counts.update(zip(names, map(add, steps, repeat(1))))
            self._counts_epoch += 1
            if self._nothing_wanted(batch, names, steps):
                return False
        else:  # a layer run twice in one graph: its forwards counted one by one
            steps = []
            for name in names:
                steps.append(counts.get(name, 0))
                counts[name] = steps[-1] + 1
            self._counts_epoch += 1
        wanted, sampled = [], []
        every = None
        if distinct and self.sentinel is None and steps.count(steps[0]) == len(steps):
            every = self._every_layer_wanted(batch, slots, names, steps[0])
        for slot, step in zip(slots, steps) if every is None else ():
            name = slot.name
            built = self._graph_builds.get(name)
            ctx = built[1] if built is not None and built[0] == step else None
            if self.sentinel is not None and self.sentinel.sentinel.sampled(name, step):
                sampled.append((slot, step, ctx))
            if not self.capturer.wants(name, step):
                continue
            if ctx is None:
                from kvdbg.capture.capturer import CaptureInputError

                self.capturer.report(CaptureInputError(
                    "no build of the metadata builder was seen for this step of a CUDA graph, so the step's block "
                    "table and lengths are unknown"), "after a CUDA graph's replay", step_lost=True)
                continue
            wanted.append((slot, step, ctx))
        if every is not None:
            wanted = every
        if not wanted and not sampled:
            return False
        if self._plain_ran:  # chosen before the replay, and the filters changed since: its buffers are stale
            self._plain_ran = False
            from kvdbg.capture.capturer import CaptureInputError

            for slot, step, _ in wanted:
                self.capturer.report(CaptureInputError(
                    f"step {step} of {slot.name} was wanted after the graph without kvdbg's copies had been chosen "
                    "for it (the filters changed between): its query and output were not copied"),
                    "after a CUDA graph's replay", step_lost=True)
            if sampled:
                self.capturer._note_once("plain-ran", "kvdbg sentinel: a step of a full CUDA graph was drawn after "
                                         "the graph without kvdbg's copies had been chosen for it; it is not checked")
            return False
        staged = None
        if not sampled:
            staged = self._stage(wanted)
        elif all(item[2] is not None for item in sampled):
            taken = {id(item[0]) for item in wanted}
            staged = self._stage(wanted + [item for item in sampled if id(item[0]) not in taken])
        if sampled:
            self.sentinel.after_graph_replay(self, sampled, staged)
        if not wanted:
            return False
        job = _GraphJob(wanted, batch.num_tokens)
        # Unless staged with its metadata, the build's copies now, on the engine's stream right after the replay:
        # later work of this very step (a drafter's) may rewrite the runner's buffers before the capture thread
        # would read them.
        unstaged = staged is None or not staged.with_metadata
        return self._hand_job(job, staged, [ctx for _, _, ctx in wanted] if unstaged else [])

    def _hand_job(self, job: _GraphJob, staged: Any, resolve: list, in_graph: bool = False) -> bool:
        """Hand a wanted step to the capture thread (the builds in ``resolve`` copied first), holding its staging
        until that thread has read it; whether it was handed (else the step is said lost and its staging let go)."""
        try:
            for ctx in resolve:
                self.resolve(ctx, slots=False)
            if staged is not None:
                job.staged = staged.hold()
                account = self.capturer.engine_time
                account.staged += 1
                account.in_graph += in_graph
            self._hand_over(job)
        except Exception as exc:
            if job.staged is not None:
                job.staged.release(issued=False)  # the capture thread never got it
            self.capturer.report(exc, "after a CUDA graph's replay", step_lost=True)
            return False
        return True

    def _hand_in_graph(self, fast: tuple) -> bool:
        """A step the staged variant of its graph staged (:meth:`_in_graph_step`): its layers' forwards counted, the
        step handed to the sentinel when it drew it (its checks hold the program until collected) and to the capture
        thread when capture wants it, holding the program until that thread has read it."""
        batch, program, names, steps, items, hint, with_metadata, captured, checked, wrapper = fast
        self._forward_counts.update(zip(names, map(add, steps, repeat(1))))
        self._counts_epoch += 1
        try:  # without staged metadata, the step's requests are worked out here, from the build's host offsets
            staged = program.staged_step(items[0][0].query.shape[0], hint, with_metadata)
        except Exception as exc:  # never into vLLM: each layer's step is said lost
            if captured:
                self._steps_lost(exc, [(slot, step) for slot, step, _ in items])
            if checked:
                self.sentinel._failed(exc, "after a CUDA graph's replay")
            return False
        if checked:
            self.sentinel.after_graph_replay(self, items, staged)
        if not captured:
            return False
        # The runner's buffers were not the program's: the build's copies, now.
        handed = self._hand_job(_GraphJob(items, batch.num_tokens), staged, [] if with_metadata else [items[0][2]],
                                in_graph=True)
        if handed and with_metadata and self.sentinel is None:
            try:
                self._make_ticket(wrapper, batch, program, names, items, hint)
            except Exception as exc:  # noqa: BLE001 - the shape's wanted steps are then told as this one was
                self.capturer._note_once(f"ticket:{type(exc).__name__}", f"kvdbg capture: keeping what a wanted step "
                                         f"of a CUDA graph needs failed ({type(exc).__name__}: {exc}); such steps "
                                         "are told at each build, as before")
        return handed

    def _make_ticket(self, wrapper: Any, batch: Any, program: Any, names: tuple, items: list, hint: Any) -> None:
        """After a wanted step the staged variant served with its metadata: a ticket for the build's shape, when the
        build's builder holds every layer of the graph and capture selects them all (see :class:`_Ticket`)."""
        ctx = items[0][2]
        deferred, common = ctx.deferred, hint.common
        if deferred is None or common is None or not isinstance(common.max_seq_len, int) \
                or common.causal.__class__ is not bool:
            return
        builder = deferred.builder
        selected = self._selected_layers(builder)
        layers = getattr(builder, "layer_names", None) or ()
        if not selected or len(selected) != len(layers) or len(set(names)) != len(names) \
                or not set(names) <= set(selected):
            return
        staged = self._staged_variants.get((id(wrapper), batch))
        variants = self._graph_variants.get((id(wrapper), batch))
        facts = self._builder_facts.get(id(builder))
        table = wrapper.concrete_cudagraph_entries
        if staged is None or staged[1] is not program or facts is None or variants is None \
                or table.get(batch) is not variants[0]:
            return
        # The batch's padded rows, not its real requests (worked out when the build's bound was read): the capture
        # thread tells a ticketed step with the rows alone (InGraphProgram.serves, host=False).
        rows = hint.rows if hint.rows > 0 else hint.most_reqs
        per_request = program.size // max(1, rows)
        if rows > program.count_rows or per_request < 1:
            return
        longest = float("inf") if per_request >= program.width else per_request * program.page_size
        key = (id(builder), common.num_actual_tokens, common.num_reqs)
        self._tickets[key] = _Ticket(builder, selected, facts, wrapper, batch, staged[0], program,
                                     tuple(item[0] for item in items), names, longest, batch.num_tokens,
                                     int(items[0][0].query.shape[0]), variants[0], table,
                                     set(selected) <= set(names), self._builder_layers[id(builder)][0])

    def ticket_replayed(self, fast: tuple) -> bool:
        """A wanted step handed on its ticket (:meth:`ticket_replay`, or :meth:`choose_graph` then
        :meth:`after_graph_replay`) once vLLM queued its replay: its layers' forwards counted, the program held, the
        rest left to the capture thread (:meth:`_ticket_job`). A wanted step is rare, so whatever it calls is
        likely out of the processor's caches: the program's hold is taken here in line, not by a call."""
        self._in_graph_ran = None
        ticket, step = fast[2], fast[3][4]
        run = self._uncounted
        if run is not None and run.names is ticket.names and run.step == step:
            run.step = step + 1  # the graph's layers' counts are still the quiet run's: moved on there, unwritten
        else:
            self._forward_counts.update(zip(ticket.names, repeat(step + 1)))
        self._counts_epoch += 1
        held = False
        try:
            thread = self._graph_thread
            if thread is None:
                thread = self._graph_thread = _GraphCaptureThread(self)
            program = ticket.program
            program._holds.append(None)  # program.hold(), in line
            held = True
            thread.jobs.put(fast)
        except Exception as exc:  # never into vLLM: each layer's step said lost, the program let go
            if held:
                ticket.program.release(issued=False)
            self._steps_lost(exc, zip(ticket.slots, repeat(step)))
            return False
        account = self.capturer.engine_time
        account.handed += 1
        account.staged += 1
        account.in_graph += 1
        return True

    def _ticket_job(self, fast: tuple) -> _GraphJob | None:
        """The capture thread: the job of a step handed on its ticket, made from its build as after_build would
        have kept it (its context, the staging hint) and the program's staged step; None when it cannot be (each
        layer's step said lost, the program let go)."""
        _, program, ticket, pending = fast
        _, builder, common, metadata, step, _, _ = pending
        try:
            from kvdbg.vllm_plugin.builder_hooks import _stage_hint
            from kvdbg.vllm_plugin.records import deferred_context

            buffers = (common.block_table_tensor, common.seq_lens, common.query_start_loc)
            hint = _stage_hint()(common, buffers, -1)
            # Told from the build's device buffers and the shape's rows alone: its host buffers are the engine's again.
            if hint is None or program.serves(hint, host=False) != 2:
                from kvdbg.capture.capturer import CaptureInputError

                raise CaptureInputError("the build handed the step's metadata in buffers other than those vLLM's graph "
                                        "and kvdbg's staging inside it read, or the step's pages could not be told "
                                        "within the staged positions from its padded rows")
            ctx = deferred_context(builder, common, metadata, ticket.facts, buffers, hint)
            staged = program.staged_step(ticket.rows, hint, True)
            job = _GraphJob(list(zip(ticket.slots, repeat(step), repeat(ctx))), ticket.tokens, staged=staged)
            kv_cache = ticket.slots[0].kv_cache
            if kv_cache.is_cuda:
                job.device, job.ready = kv_cache.device, staged.ready
        except Exception as exc:  # noqa: BLE001 - each layer's step said lost; the program let go
            program.release(issued=False)
            self._steps_lost(exc, zip(ticket.slots, repeat(step)))
            return None
        return job

    def _steps_lost(self, exc: BaseException, layers: Any) -> None:
        """Each (slot, step) of a replayed graph's step that cannot be captured, said lost with ``exc``."""
        for slot, step in layers:
            self.capturer.report(exc, f"after a CUDA graph's replay (step {step} of {slot.name})", step_lost=True)

    def _every_layer_wanted(self, batch: Any, slots: list, names: tuple, step: int) -> list | None:
        """Every layer of the graph, all at ``step``, wanted with one build's context: told with one check of capture's
        filters and budget instead of a call per layer (the layers' names all selected, kept per graph and
        configuration); None: asked layer by layer."""
        return self._every_layer_built(slots, names, step) if self._capture_takes_all(batch, names, step) else None

    def _capture_takes_all(self, batch: Any, names: tuple, step: int) -> bool:
        """Whether capture wants every layer of the graph at ``step``, told with one check of its filters and budget
        (the layers' names all selected, kept per graph and configuration)."""
        capturer = self.capturer
        hit = self._graph_every.get(batch)
        if hit is None or hit[0] is not names or hit[1] is not capturer.config:
            hit = self._graph_every[batch] = (names, capturer.config, all(map(capturer.layer_selected, names)))
        return bool(hit[2] and capturer.wants_all(len(names), step))

    def _every_layer_built(self, slots: list, names: tuple, step: int) -> list | None:
        """(slot, step, context) of every layer of the graph, when each one's latest build is of ``step`` and they
        share one context; else None."""
        builds = self._graph_builds
        first = builds.get(names[0])
        if first is None or first[0] != step:
            return None
        ctx = first[1]
        if any(map(is_not, map(builds.get, names), repeat(first))):  # not one shared entry: each layer's asked
            for name in names:
                built = builds.get(name)
                if built is None or built[0] != step or built[1] is not ctx:
                    return None
        return list(zip(slots, repeat(step), repeat(ctx)))

    def _slot_names(self, batch: Any, slots: list) -> tuple[tuple[str, ...], bool]:
        """The layer names of a graph's slots, and whether they are distinct; kept per graph until it records
        again (a new list) or more slots."""
        hit = self._graph_names.get(batch)
        if hit is None or hit[0] is not slots or hit[1] != len(slots):
            names = tuple(slot.name for slot in slots)
            hit = self._graph_names[batch] = (slots, len(slots), names, len(set(names)) == len(names))
        return hit[2], hit[3]

    def _stage(self, items: list) -> Any:
        """Stage the layers of a step that capture wants or the sentinel checks, on the device (engine's thread,
        graph_staging); None: not staged, and their readers read the engine's memory while the engine's next
        step waits for them."""
        try:
            return self._stage_layers(items)
        except Exception as exc:  # staging spares the engine a wait: said once, and the step is read the old way
            self.capturer._note_once(f"staging:{type(exc).__name__}", f"kvdbg capture: staging a CUDA graph's step "
                                     f"failed ({type(exc).__name__}: {exc}); such steps are read from the engine's "
                                     "memory, the engine's thread waiting for the copies")
            return None

    def _stage_layers(self, items: list) -> Any:
        if not items or items[0][2] is None:
            return None
        ctx = items[0][2]
        hint = ctx.stage
        if hint is None or any(item[2] is not ctx for item in items):
            return None
        stager = self._stager
        if stager is None:
            from kvdbg.vllm_plugin.graph_staging import GraphStager

            stager = self._stager = GraphStager()
        slots = tuple(item[0] for item in items)
        key = tuple(map(id, slots))  # the slots are held in the value: no id here is ever another slot's
        known = self._stage_layouts.get(key)
        if known is None:
            known = self._stage_layouts[key] = (slots, *self._staged_layers(slots))
        _, layers, page_size = known
        if layers is None:
            return None
        staged = stager.stage(layers, hint, page_size, int(slots[0].query.shape[0]), self._graph_rows)
        account = self.capturer.engine_time
        account.staging_graphs, account.staging_ms = stager.recordings, stager.recording_ms
        return staged

    def _staged_layers(self, slots: tuple) -> tuple:
        """(the staging program's layers, their page size) for a graph's layers, or (None, None) when staging cannot
        read them (a cache layout kvdbg does not know, two page sizes); worked out once per set of layers, the
        same list then handed to the stager on every step (graph_staging keys its programs by it)."""
        layers, page_size = [], None
        for slot in slots:
            facts = slot.staging
            if facts is None:
                layout = self.engine_layout(slot.impl, slot.layer, self._info(slot.impl), slot.kv_cache)
                if layout is None:
                    return None, None
                facts = slot.staging = (layout.page_dim, int(slot.kv_cache.shape[layout.token_dim]))
            if page_size is not None and facts[1] != page_size:
                return None, None
            page_size = facts[1]
            buffers = self._graph_buffers[slot.name]
            layers.append((slot.name, slot.kv_cache, facts[0], buffers.query, buffers.output))
        return layers, page_size

    # ---------------------------------------------------------------- the graph capture thread

    def _hand_over(self, job: _GraphJob) -> None:
        """The wanted step to the capture thread, behind an event after the graph's work (engine's thread)."""
        kv_cache = job.items[0][0].kv_cache
        if kv_cache.is_cuda:
            job.device = kv_cache.device
            if job.staged is not None:
                job.ready = job.staged.ready
            else:
                import torch

                from kvdbg.capture.buffers import current_stream

                job.ready = torch.cuda.Event()
                job.ready.record(current_stream(job.device))
        if self._graph_thread is None:
            self._graph_thread = _GraphCaptureThread(self)
        if job.staged is None:  # the capture thread reads the engine's memory: the next step waits for it
            self._graph_job = job
            if self._lent or self._worker_lent is not None:  # the worker's hook waits for this job
                self._take_builders_back()
        self.capturer.engine_time.handed += 1
        self._graph_thread.jobs.put(job)

    def await_graph_capture(self) -> None:
        """Before the engine's next work on the device: the capture thread has issued the last handed step's
        copies, and the engine's stream waits for them (engine's thread; a no-op when nothing was handed)."""
        job = self._graph_job
        if job is None:
            return
        self._graph_job = None
        start = time.perf_counter_ns()
        if not job.finished.wait(GRAPH_CAPTURE_WAIT_S):
            # Never a hung engine: the step is given up (the thread skips what it has not begun) and capture
            # turned off, since the thread may still be reading what this step is about to overwrite.
            job.abandoned = True
            self.capturer.disable(f"the graph capture thread did not issue a step's copies within "
                                  f"{GRAPH_CAPTURE_WAIT_S:g} s", level=logging.ERROR)
        elif job.issued is not None:
            from kvdbg.capture.buffers import current_stream

            current_stream(job.device).wait_event(job.issued)
        account = self.capturer.engine_time
        account.waited_ns += time.perf_counter_ns() - start
        account.waits += 1

    def drain_graph_capture(self, timeout: float) -> bool:
        """Wait until the capture thread has issued every step handed to it, staged ones included (a staged
        step is never waited for by the engine); whether it had within ``timeout`` seconds."""
        thread = self._graph_thread
        return thread is None or thread.drain(timeout)

    def stop_graph_capture(self, timeout: float) -> None:
        """At shutdown: the last handed step issued, the thread gone (the writer then drains as before)."""
        thread, self._graph_thread = self._graph_thread, None
        job, self._graph_job = self._graph_job, None
        if job is not None and not job.finished.wait(timeout):
            job.abandoned = True  # the layers it has not begun are skipped: the writers drain next
        if thread is not None:
            thread.stop(timeout)

    def _capture_graph_job(self, job: _GraphJob, streams: dict) -> None:
        """The capture thread: each wanted layer's capture, issued on the thread's stream after the graph's work
        (the same begin and finish as an eager step's, from the graph's copies of query and output)."""
        import contextlib

        if job.ready is not None:
            import torch

            stream = streams.get(job.device)
            if stream is None:
                stream = streams[job.device] = torch.cuda.Stream(job.device)
            stream.wait_event(job.ready)
            where = torch.cuda.stream(stream)
        else:
            stream, where = None, contextlib.nullcontext()
        staged = job.staged
        read: dict[int, Any] = {}
        with where:
            sizing = None
            if staged is not None:
                try:
                    staged.sized()  # staged inside vLLM's graph: the counts the device worked out, read back
                except Exception as exc:  # noqa: BLE001 - each layer's step said lost below
                    sizing = exc
            if staged is not None and sizing is None:
                # The step's staged metadata and page ids, read back before the pages' copies are issued: a read is
                # a copy to the host and a wait on this stream, which would otherwise wait behind every layer's
                # pages (milliseconds). Each is kept by the staged step; one that fails is read again, and said,
                # where the layers need it.
                for read_first in (staged.metadata, staged.unique_ids):
                    try:
                        read_first()
                    except Exception:  # noqa: BLE001 - said per layer below
                        pass
            ahead = self._issue_ahead(job) if staged is not None and stream is not None and sizing is None else {}
            try:
                for slot, step, ctx in job.items:
                    if job.abandoned:
                        break
                    if sizing is not None:
                        self.capturer.report(sizing, "after a CUDA graph's replay", step_lost=True)
                        continue
                    query, output, pages = slot.query, slot.output, None
                    early = ahead.pop(slot.name, None)
                    if early is not None:  # its copies to the host are on their way already
                        early_copies, query, output = early
                        pages = staged.pages_for(slot.name, True)
                    elif staged is not None:  # the step's copies on the device, which no later step overwrites
                        copies = staged.layers[slot.name]
                        query, output, pages = copies.query, copies.output, staged.pages_for(slot.name, True)
                    pending = None
                    try:
                        if ctx.deferred is not None:  # the metadata as the program staged it, read once a step
                            known = read.get(id(ctx))
                            if known is None:
                                known = read[id(ctx)] = self._graph_metadata(ctx, staged)
                            ctx = known
                        pending = self.start_capture(slot.impl, slot.layer, step, query, None, None,
                                                     slot.kv_cache, ctx, None, output.dtype
                                                     if output is not None else slot.layer.dtype,
                                                     notes=f"replayed from a full CUDA graph of {job.tokens} tokens",
                                                     staged=pages, copies=None if early is None else early_copies)
                        if pending is not None:
                            self.capturer.finish(pending, output)
                    except Exception as exc:
                        self.capturer.report(exc, "after a CUDA graph's replay", step_lost=True)
                    if early is not None and pending is None:  # not captured after all: its copies let go
                        early_copies.discard()
            finally:
                for early_copies, _, _ in ahead.values():  # layers never reached (an abandoned job)
                    early_copies.discard()
                if staged is not None:
                    staged.release()  # every read of the staged buffers is issued: the next run may reuse them
            if stream is not None:
                import torch

                job.issued = torch.cuda.Event()
                job.issued.record(stream)

    def _issue_ahead(self, job: _GraphJob) -> dict:
        """:meth:`_copies_ahead`, or nothing when issuing them failed (said once): each layer is then read as before,
        and the staged buffers are still let go at the job's end."""
        try:
            return self._copies_ahead(job)
        except Exception as exc:  # noqa: BLE001 - the layers are still captured one by one
            self.capturer._note_once(f"ahead:{type(exc).__name__}", f"kvdbg capture: issuing a staged step's copies "
                                     f"for every layer at once failed ({type(exc).__name__}: {exc}); its layers "
                                     "are copied one by one")
            return {}

    def _copies_ahead(self, job: _GraphJob) -> dict:
        """A staged step's copies to the host for every layer, issued at once on the capture thread's stream, before
        any layer is planned: per layer, its staged pages (every staged position: one copy in memory order), its
        query and its output. The device then makes them back to back, where issued layer by layer they would
        come one layer's Python apart (about 1.4 ms a layer on the H200's host, where the device copies one
        layer in 0.85 ms). {name: (StepCopies, query on the host, output on the host)}; empty when the copies
        would not fit the writer's queue, or a layer's pages cannot go in one copy (each is then read as before)."""
        from kvdbg.capture.buffers import StepCopies

        staged, capturer = job.staged, self.capturer
        layers = staged.layers
        spans = []
        total = 0
        for slot, _, _ in job.items:
            layer = layers.get(slot.name)
            if layer is None:
                return {}
            pages = layer.pages
            nbytes = pages.element_size() * (pages.numel() // max(1, pages.shape[layer.page_dim])) * staged.sized()
            spans.append((slot.name, layer, nbytes))
            total += nbytes + 2 * layer.query.numel() * layer.query.element_size()
        if not capturer.queue_would_take(total):
            return {}
        ahead, copies = {}, None
        try:
            for name, layer, _ in spans:
                copies = StepCopies(job.device, capturer.host_buffers)
                if not copies.span_ahead(layer.pages, layer.page_dim, 0, staged.sized()):
                    raise _NotAhead
                ahead[name] = (copies, copies.ahead(layer.query),
                               None if layer.output is None else copies.ahead(layer.output))
        except BaseException as exc:  # nothing issued ahead is left behind: the buffers go back once copied
            for issued in [copies] + [entry[0] for entry in ahead.values() if entry[0] is not copies]:
                if issued is not None:
                    issued.discard()
            if isinstance(exc, _NotAhead):
                return {}
            raise
        return ahead

    def _graph_metadata(self, ctx: Any, staged: Any) -> Any:
        """The capture thread's copy of a deferred build's context, with its metadata as the staging program copied
        it after the replay (the engine's context is left as it is)."""
        import dataclasses

        metadata = None if staged is None else staged.metadata()
        if metadata is None:  # after_graph_replay copies a step's build whenever staging did not
            from kvdbg.capture.capturer import CaptureInputError

            raise CaptureInputError("the step's metadata was neither copied by its build nor staged after the replay")
        bt, sl, qsl = metadata
        return dataclasses.replace(ctx, block_table=bt, seq_lens=sl, query_start_loc=qsl, host=None, deferred=None)
