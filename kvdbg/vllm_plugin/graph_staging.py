"""A wanted step of a replayed full CUDA graph, staged in device memory by the engine's thread.

A replayed graph's step is read after the replay: the layers' query and output from the buffers the graph
copies into (``graph_hooks``), their pages from the caches. The next step overwrites both (the buffers at its
replay, the caches at its update), so whatever reads them must be ordered before the next step's work. Read
from the host, that order costs the engine's thread a wait: the host must know the step's pages, and under
asynchronous scheduling the device is a step behind the host's copy of the block table.

Staging orders the reads on the device instead, with no host wait and a constant number of runtime calls:

- the host knows, when the builder builds, a bound on every request's length (vLLM's
  ``seq_lens_cpu_upper_bound``, else ``max_seq_len`` for every row), so it knows how many block-table
  entries each request may read: a count per request, all the host works out;
- right after the replay, on the engine's stream, a *staging program* lays the requests' entries out one
  after another, works out on the device where each is in the block table (``row * stride + column``), and
  reads them: the page ids from the block table the step used (the runner's persistent one, as the graph did), clamped into the cache, then
  each selected layer's pages by those ids, its query and its output, into device buffers of its own; and
  the step's metadata as the graph read it (the runner's block table, lengths and query offsets, which a
  full graph reads at one place every step), so the build copies none of it to the host (``builder_hooks``).
  On a GPU the program is a small CUDA graph of kvdbg's, recorded once per size (the first use of a size
  runs it eagerly, then records it), so a step costs the engine's thread three torch ops whatever the
  number of layers: the counts' copy (from a page-locked buffer of the program's own), the graph's
  launch and an event (the program's own), and a wait on the device for each reader that let the program
  go since its last run;
- the graph capture thread then takes its time: it reads the metadata and the page ids back, keeps the
  pages the step's exact lengths read and copies them to the host from the staged buffers, never from the
  engine's.

A program's buffers are reused by its next step; the capture thread (or the sentinel's check) *holds* a
program until it has read what it needs and then records an event, on which the next run waits on the
device; its counts' buffer is written again only once the last run's copy of it is known done (a reader
waited for the run, or its event has passed). A program not free when another step wants it is not waited
for: a second program of that size
is made, up to :data:`PROGRAMS_PER_SIZE`, and past that (or past :data:`STAGING_MAX_BYTES` of device
memory) the step is captured the way it was before staging, the engine's thread waiting for the capture
thread's copies (said once at INFO). The exit line counts the steps staged among those handed over, and the
staging graphs recorded and what recording them took from the engine's thread.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvdbg.capture")

# The most device memory all staging programs of a process may hold (pages, query and output copies).
STAGING_MAX_BYTES = 2 * 1024**3
# The most device memory one program recorded into vLLM's graphs may hold (graph_hooks' staged variant); it stages
# as many pages as fit, at most every page of every row of the runner's block table.
IN_GRAPH_MAX_BYTES = 1024**3
# How often the graph capture thread asks whether a reader's copies of a step staged inside vLLM's graph are done,
# while one is pending (InGraphProgram.poll_released).
RELEASE_POLL_S = 0.001
# Programs are made for a number of pages rounded up to a power of two, at least this one.
MIN_PAGES = 64
# Programs of one size (and block table and layers): a second one serves a step wanted while the first is held.
PROGRAMS_PER_SIZE = 2
# Programs kept in all: past this, those of the sizes least recently used are let go (when not held).
MAX_PROGRAMS = 8


class StageHint:
    """What a build tells staging about its step (kept on the build's context; references, no copies):
    the block table the step reads (the runner's device buffer), the real requests, and a host bound on
    each request's length (None: ``max_seq_len`` bounds every row).

    The build's lengths and query offsets on the device (the runner's buffers, as the graph reads them) and the
    batch's rows with padding: with them the program also stages the step's metadata (StagedStep.metadata), so
    the build copies nothing to the host; without them the build's own copies are used.

    The real requests (:attr:`num_reqs`) may be left to whoever needs them first (``num_reqs=-1`` and the build's
    ``common`` metadata): worked out from its host query offsets on the engine's thread during the step, or by a
    step staged inside vLLM's graph from the offsets it staged (:meth:`StagedStep.sized`), on the capture thread,
    so that the engine's thread spares it.
    """

    __slots__ = ("block_table", "_num_reqs", "seq_lens_bound", "max_seq_len", "seq_lens", "query_start_loc", "rows",
                 "common")

    def __init__(self, block_table: Any, num_reqs: int, seq_lens_bound: Any, max_seq_len: int, seq_lens: Any = None,
                 query_start_loc: Any = None, rows: int = 0, common: Any = None):
        self.block_table = block_table
        self._num_reqs = num_reqs
        self.seq_lens_bound = seq_lens_bound  # a host tensor or array of >= num_reqs entries, or None
        self.max_seq_len = max_seq_len
        self.seq_lens, self.query_start_loc, self.rows = seq_lens, query_start_loc, rows
        self.common = common

    @property
    def num_reqs(self) -> int:
        """The step's real requests (engine's thread, during the step: the build's host offsets are rewritten at the
        next one)."""
        if self._num_reqs < 0:
            from kvdbg.vllm_plugin.vllm_facts import _requests_with_tokens

            self._num_reqs = _requests_with_tokens(self.common)
        return self._num_reqs

    @property
    def known_reqs(self) -> int:
        """:attr:`num_reqs` if worked out already, else -1."""
        return self._num_reqs

    @property
    def most_reqs(self) -> int:
        """A bound on :attr:`num_reqs` that works nothing out: the batch's rows with padding when known."""
        return self._num_reqs if self._num_reqs >= 0 or self.rows <= 0 else self.rows


def stage_hint(common: Any, rows: tuple, num_reqs: int) -> StageHint | None:
    """The hint for a build's ``common`` metadata and its ``rows`` (the block table, lengths and query offsets as
    the build was given them, views of the runner's buffers from their first row; padding rows may follow the
    real requests); None when it says too little to bound the step's pages. ``num_reqs`` -1: left to
    :attr:`StageHint.num_reqs`."""
    max_seq_len = getattr(common, "max_seq_len", None)
    bound = getattr(common, "seq_lens_cpu_upper_bound", None)
    # A bound shorter than the step's requests is left out; with the requests not yet worked out it is kept, and
    # its length checked where it is read (InGraphProgram.serves, GraphStager.stage).
    if bound is not None and (getattr(bound, "is_cuda", False) or (
            num_reqs >= 0 and (bound.shape[0] if hasattr(bound, "shape") else len(bound)) < num_reqs)):
        bound = None
    if bound is None and not isinstance(max_seq_len, int):
        return None
    return StageHint(rows[0], num_reqs, bound, int(max_seq_len or 0), rows[1], rows[2],
                     int(common.block_table_tensor.shape[0]), common)


@dataclass(eq=False)
class StagedPages:
    """One layer's staged pages, as :meth:`kvdbg.capture.prepare.CapturePlan.gather` reads them instead of the
    engine's cache: ``pages`` is the layer's cache with its page dimension cut to the staged positions."""

    step: "StagedStep"
    pages: "torch.Tensor"
    page_dim: int
    # Read on a stream of kvdbg's own (the graph capture thread's): there a layer's staged span may go to the host
    # in one copy (StepCopies.block), which holds up no engine work. Read on the engine's thread (the sentinel's
    # capture of a wrong step), the pages are gathered as ever, their copy on capture's side stream.
    own_stream: bool = False

    def positions(self, page_ids: np.ndarray) -> "torch.Tensor":
        """The staged position of each engine page id (int64, host); CaptureInputError naming one not staged."""
        import torch

        ids, first = self.step.unique_ids()
        where = np.searchsorted(ids, page_ids)
        where = np.minimum(where, max(0, ids.size - 1))
        missing = ids.size == 0 or not np.array_equal(ids[where], page_ids)
        if missing:
            from kvdbg.capture.inputs import CaptureInputError

            lost = page_ids[np.isin(page_ids, ids, invert=True)]
            raise CaptureInputError(
                f"page {int(lost[0])} of the step was not staged: the block table the graph read does not hold "
                "it within the lengths the host bounded at the build (a runner that changed its block table "
                "or its lengths after building)")
        return torch.from_numpy(first[where])


@dataclass(eq=False)
class StagedLayer:
    pages: "torch.Tensor"
    page_dim: int
    query: "torch.Tensor"  # the graph's rows of the layer's query buffer, copied
    output: "torch.Tensor | None"
    stack: tuple | None = None  # (StagedStack, index): the copies are that stack's at index (kvdbg.sentinel.checker)
    # (query copy, output copy or None): the whole buffers (the largest graph's rows) whose first rows ``query`` and
    # ``output`` are; the same objects whatever the graph (the sentinel's checks name them, and the rows)
    whole: tuple = ()


class StagedStack(NamedTuple):
    """A program's copies of alike layers, one buffer per kind with a layer per index of its first axis: ``pages``
    [layers, ...] in the engine's layout (each layer's laid out as its cache), ``query`` and ``output`` [layers, rows,
    ...]."""

    pages: "torch.Tensor"
    query: "torch.Tensor"
    output: "torch.Tensor"


@dataclass(eq=False, slots=True)
class StagedStep:
    """One staged step: its layers' copies, what was staged (``count`` positions, ``row_starts``/``counts``
    per request) and the event after the program's work on the engine's stream."""

    program: "_Program"
    rows: int  # the graph's tokens: the rows of each layer's query and output buffers that were copied
    count: int  # -1 until read back (staged inside vLLM's graph: the device worked the counts out)
    counts: np.ndarray | None
    page_size: int
    ready: Any  # torch.cuda.Event after the program (None on a CPU); the program's own, recorded again next run
    run: int = 0  # the program's run that staged this step
    num_reqs: int = 0  # -1: not worked out at the build: the requests among ``batch_rows``, from the staged offsets
    width: int = 0  # the block table's columns, as the build gave it
    # The program copied this step's metadata: it reads the runner's buffers the build handed over (a runner keeps
    # them at one place, which a graph needs; one that does not is read from the build's own copies).
    with_metadata: bool = False
    _unique: tuple | None = field(default=None, repr=False)
    _metadata: tuple | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    batch_rows: int = 0  # the graph's batch rows, padding included (the rows the staged offsets hold for it)

    def _requests(self) -> int:
        """The step's real requests; for a step whose build left them (``num_reqs`` -1), worked out from the query
        offsets the program staged, by the rule the host applies (vllm_facts.requests_in_offsets). Under the lock,
        after the program's work."""
        if self.num_reqs < 0:
            from kvdbg.vllm_plugin.vllm_facts import requests_in_offsets

            copies = self.program.metadata
            if copies is None or not self.with_metadata or copies[2].numel() < self.batch_rows + 1:
                from kvdbg.capture.inputs import CaptureInputError

                raise CaptureInputError("the step's real requests were neither worked out at its build nor staged "
                                        "with its query offsets")
            offsets = copies[2][: self.batch_rows + 1].to("cpu").numpy()
            self.num_reqs = requests_in_offsets(offsets, self.batch_rows)
        return self.num_reqs

    def _wait(self) -> None:
        """The program's work for this step is done (a host wait, by a reader: never the engine's thread)."""
        if self.ready is not None:
            self.ready.synchronize()
        self.program.seen(self.run)

    def sized(self) -> int:
        """The staged positions; for a step staged inside vLLM's graph (:class:`InGraphProgram`), where the device
        worked each request's pages out from the lengths the graph read, read back once (a reader's wait, never
        the engine's thread). CaptureInputError when the step reads more pages than the program stages."""
        if self.count >= 0:
            return self.count
        with self._lock:
            if self.count < 0:
                self._wait()
                counts = self.program.counts[: self._requests()].to("cpu").numpy().astype(np.int64, copy=False)
                total = int(counts.sum())
                if total > self.program.size:
                    from kvdbg.capture.inputs import CaptureInputError

                    raise CaptureInputError(
                        f"the step reads {total} pages, more than the {self.program.size} that kvdbg's staging "
                        "inside the CUDA graph holds (the host's bound on the lengths at the build was exceeded)")
                self.counts, self.count = counts, total
        return self.count

    def unique_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted engine page ids staged, the first staged position of each): read from the device once."""
        count = self.sized()
        with self._lock:
            if self._unique is None:
                self._wait()
                staged = self.program.ids[:count].to("cpu", dtype=self.program.ids.dtype).numpy()
                ids, first = np.unique(staged.astype(np.int64, copy=False), return_index=True)
                self._unique = (ids, first.astype(np.int64, copy=False))
            return self._unique

    def metadata(self) -> tuple | None:
        """(block table, lengths, query offsets) of the step's real requests, on the host, as the graph read them
        (the program copied the runner's buffers right after the replay); read from the device once. None: the
        program did not stage them (the build's own copies hold them)."""
        copies = self.program.metadata
        if copies is None or not self.with_metadata:
            return None
        with self._lock:
            if self._metadata is None:
                self._wait()
                table, seq_lens, offsets = copies[:3]
                n, stride = self._requests(), self.program.table_stride
                rows = table[: n * stride].view(n, stride)[:, : self.width]
                self._metadata = tuple(t.clone() if t.is_cpu else t.to("cpu")
                                       for t in (rows, seq_lens[:n], offsets[: n + 1]))
            return self._metadata

    @property
    def layers(self) -> dict[str, StagedLayer]:
        """Each staged layer's copies, by name (views made once per program and number of rows, by the reader:
        a view is a torch call, which the engine's thread is spared)."""
        return self.program.views(self.rows)

    def pages_for(self, name: str, own_stream: bool = False) -> StagedPages:
        layer = self.layers[name]
        return StagedPages(self, layer.pages, layer.page_dim, own_stream)

    @property
    def row_starts(self) -> np.ndarray:
        """Each request's first staged position (the program laid the requests' pages out one after another)."""
        self.sized()
        return np.cumsum(self.counts) - self.counts

    def hold(self) -> "StagedStep":
        """One more reader of the staged buffers (the capture thread, a sentinel check): the program is not run
        again until each has called :meth:`release`."""
        self.program.hold()
        return self

    def release(self, issued: bool = True) -> None:
        """The holder is done issuing its reads of the staged buffers (on the current stream; ``issued=False``: it
        read nothing)."""
        self.program.release(issued)


class _Program:
    """The device work that stages a step for one block table, one set of layers and one number of pages."""

    def __init__(self, device: Any, hint: StageHint, layers: list[tuple], pages: int, rows: int = 0):
        import torch

        block_table = hint.block_table
        cuda = block_table.is_cuda
        self.device = device
        self.size = pages
        # The block table as one flat view from its first entry to the end of its storage: the program
        # reads any row of the runner's buffer through it, whatever the batch's number of rows.
        self.table = _to_storage_end(block_table)
        self.table_stride = block_table.stride(0)
        # The host hands the program each request's number of pages to stage (at most ``rows`` requests, zero past
        # the step's); the program lays them out one request after another and works out, on the device, the
        # block-table position each staged page is read from (_body), so the engine's thread does no more than
        # count pages. The counts are written into a page-locked buffer of the program's own, not one allocated
        # per step (a torch call less on the engine's thread); it is written again only once the last run's copy
        # of it is known to be done (see reusable). The event after a run is the program's own too.
        reqs = max(1, rows, hint.num_reqs)
        device = block_table.device
        self.counts = torch.zeros(reqs, dtype=torch.int64, device=device)
        self.host_counts = torch.zeros(reqs, dtype=torch.int64, pin_memory=cuda)
        self.host_values = self.host_counts.numpy()
        self.slots = torch.arange(pages, dtype=torch.int64, device=device)  # the staged positions 0 .. pages-1
        self.index = torch.zeros(pages, dtype=torch.int64, device=device)
        self.ids = torch.zeros(pages, dtype=block_table.dtype, device=device)
        self.row_base = torch.arange(reqs, dtype=torch.int64, device=device) * self.table_stride
        self.ready = torch.cuda.Event() if cuda else None
        self.runs = 0
        self._seen = 0  # the latest run a reader waited for on the host
        self.layers = []  # (name, cache, page_dim, query source, query copy, output source, output copy, pages)
        highest = None
        # Layers alike (the usual model) get their copies in one buffer per kind, a layer per index of its first
        # axis: a reader then picks from all of them at once (the sentinel's check: one gather, not one a layer).
        self.stack = _stack_for(layers, pages)
        for index, (name, cache, page_dim, query, output) in enumerate(layers):
            shape = list(cache.shape)
            highest = shape[page_dim] - 1 if highest is None else min(highest, shape[page_dim] - 1)
            if self.stack is not None:
                copies = (self.stack.query[index], None if output is None else self.stack.output[index],
                          self.stack.pages[index])
            else:
                copies = (torch.empty_like(query), None if output is None else torch.empty_like(output),
                          _laid_out_like(cache, page_dim, pages))
            self.layers.append((name, cache, page_dim, query, copies[0], output, copies[1], copies[2]))
        self.highest = max(0, highest or 0)
        # The step's metadata as the graph read it: (table copy, lengths copy, offsets copy, their sources), the
        # first ``rows`` rows of the runner's buffers; None when the build gave no device lengths and offsets.
        self.metadata = _metadata_buffers(self.table, self.table_stride, hint, rows)
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.layers for t in (layer[4], layer[6], layer[7])
                          if t is not None) + 4 * pages * 8 + 3 * reqs * 8
        if self.metadata is not None:
            self.nbytes += sum(t.numel() * t.element_size() for t in self.metadata[:3])
        self.graph = None
        self.recorded_ms = 0.0
        self._views: dict[int, dict[str, StagedLayer]] = {}
        # One entry a hold: a hold appends, a release pops, each one call that Python's lock makes whole, so a hold
        # takes no lock of its own (the engine's thread holds, the capture thread and the sentinel release; taking a
        # threading.Lock on a wanted step was a third of its hand-over's Python, cold).
        self._holds: list[None] = []
        self._released: list[Any] = []  # events after the holders' reads, for the next run to wait on
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        return bool(self._holds)

    def _let_go(self) -> None:
        """One hold let go (none left: nothing)."""
        try:
            self._holds.pop()
        except IndexError:
            pass

    def reads_metadata_of(self, hint: StageHint) -> bool:
        """Whether the program's metadata copies read the buffers of this build (those it was made for)."""
        meta = self.metadata
        if meta is None or hint.seq_lens is None or hint.query_start_loc is None:
            return False
        return hint.seq_lens.data_ptr() == meta[4].data_ptr() and \
            hint.query_start_loc.data_ptr() == meta[5].data_ptr() and hint.num_reqs <= meta[4].numel()

    def seen(self, run: int) -> None:
        """A reader waited on the host for ``run``'s work: its copy of the counts is done."""
        with self._lock:
            self._seen = max(self._seen, run)

    def reusable(self) -> bool:
        """Whether a step may be staged with this program now: no reader holds it, and its last run's copy of
        the counts is done (a reader waited for it, else the run's event says so: one query, no wait)."""
        if self._holds:
            return False
        if self.ready is None or self._seen >= self.runs:
            return True
        if self.ready.query():
            self.seen(self.runs)
            return True
        return False

    def hold(self) -> None:
        self._holds.append(None)  # (graph_hooks' ticket_replayed takes a hold the same way, in line: keep the two alike)

    def views(self, rows: int) -> dict[str, StagedLayer]:
        """The layers' staged copies, their query and output cut to ``rows`` (made once per number of rows)."""
        views = self._views.get(rows)
        if views is None:
            stack = self.stack
            views = {name: StagedLayer(pages, page_dim, query_copy[:rows],
                                       None if output_copy is None else output_copy[:rows],
                                       None if stack is None else (stack, index), (query_copy, output_copy))
                     for index, (name, _, page_dim, _, query_copy, _, output_copy, pages) in enumerate(self.layers)}
            self._views[rows] = views
        return views

    def release(self, issued: bool = True) -> None:
        """A holder is done (``issued``: its reads of the buffers are issued on the current stream, which the next
        run waits for on the device; False: it read nothing)."""
        event = None
        if issued and self.index.is_cuda:
            import torch

            from kvdbg.capture.buffers import current_stream

            event = torch.cuda.Event()
            event.record(current_stream(self.device))
        if event is not None:  # first: a run that finds the program free must find the event to wait on too
            with self._lock:
                self._released.append(event)
        self._let_go()

    def _body(self, rows: int | None = None) -> None:
        """The staging (``rows``: only the first rows of each layer's query and output buffers, those of the graph
        recorded; None: the whole buffers, which are that graph's own views)."""
        import torch

        # Staged position p belongs to the request r whose pages end first past it (the counts laid out one
        # after another), as that request's entry j = p - (its first position); its block-table position is
        # r * stride + j. Positions past the step's pages read entry 0: a real page of the first request.
        ends = torch.cumsum(self.counts, 0)
        request = torch.searchsorted(ends, self.slots, right=True).clamp_(max=self.counts.numel() - 1)
        first = (ends - self.counts).index_select(0, request)
        flat = self.row_base.index_select(0, request) + (self.slots - first)
        self.index.copy_(flat.masked_fill_(self.slots >= ends[-1], 0))
        torch.index_select(self.table, 0, self.index, out=self.ids)
        # Entries past a request's pages may hold anything the runner left there: never an id outside the cache.
        self.ids.clamp_(0, self.highest)
        if self.metadata is not None:
            for copy, source in zip(self.metadata[:3], self.metadata[3:]):
                copy.copy_(source)
        for _, cache, page_dim, query, query_copy, output, output_copy, pages in self.layers:
            torch.index_select(cache, page_dim, self.ids, out=pages)
            if rows is None:
                query_copy.copy_(query)
            else:
                query_copy[:rows].copy_(query[:rows])
            if output is not None:
                if rows is None:
                    output_copy.copy_(output)
                else:
                    output_copy[:rows].copy_(output[:rows])

    def run(self, counts: np.ndarray) -> Any:
        """Stage a step whose requests have ``counts`` pages each to stage, in the block table's rows from the
        first (engine's thread, engine's stream; only when :meth:`reusable`); returns the event after the work
        (None on a CPU). A step costs the engine's thread three torch ops: the counts' copy, the graph's launch,
        the event (and a device wait per reader that released the program since)."""
        values = self.host_values
        values[: counts.size] = counts
        values[counts.size:] = 0
        self.runs += 1
        if self.ready is None:
            self.counts.copy_(self.host_counts)
            self._body()
            return None
        from kvdbg.capture.buffers import current_stream

        stream = current_stream(self.device)
        if self._released:
            with self._lock:
                released, self._released = self._released, []
            for event in released:  # the last holders' reads of these buffers come first (a wait on the device)
                stream.wait_event(event)
        self.counts.copy_(self.host_counts, non_blocking=True)
        if self.graph is not None:
            self.graph.replay()
        else:
            self._body()
            self._record(stream)
        self.ready.record(stream)
        return self.ready

    def _record(self, stream: Any) -> None:
        """Record the program as a CUDA graph of its own (once; its buffers are fixed, nothing is allocated)."""
        import time

        import torch

        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(stream)
        with torch.cuda.stream(side):
            # Thread-local: the engine's other threads (kvdbg's capture thread among them) go on meanwhile.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._body()
            finally:
                graph.capture_end()
        stream.wait_stream(side)
        self.graph = graph
        self.recorded_ms = (time.perf_counter() - start) * 1e3


class InGraphProgram(_Program):
    """Staging recorded into vLLM's own full graphs: a third variant of each, recorded at start-up after the plain
    one, runs this program's work right after the model's forward, inside the graph (``graph_hooks``).

    Nothing of it is left to the engine's thread at a step: the device works each request's number of pages out
    from the lengths the graph itself read (the runner's buffer, whose rows past the batch's requests vLLM
    keeps at zero), and the event after the work is recorded by the graph (an external event of the program's
    own). A wanted step that replays such a graph costs the engine's thread no torch call: it hands
    :meth:`staged_step` to the capture thread, which reads the counts back with the page ids.

    One program serves the staged variants of all of a wrapper's graphs: its buffers hold the runner's every row
    and ``pages`` staged positions, a number fixed when it is made (every step stages that many, whatever it
    reads). A step whose host bound on its pages is over it, or that comes while the program is still held by
    the capture thread, replays the variant with the copies and is staged by a program of the host's instead.
    """

    def __init__(self, device: Any, hint: StageHint, layers: list[tuple], pages: int, rows: int, page_size: int):
        import torch

        super().__init__(device, hint, layers, pages, rows)
        self.host_counts = self.host_values = None  # the device works the counts out
        self.page_size = page_size
        self.width = int(hint.block_table.shape[1])
        self.lengths = _to_storage_end(hint.seq_lens)[: self.counts.numel()]
        # Facts serves() reads on every wanted step, kept (each read of a tensor is a call on the engine's thread).
        self.count_rows = self.counts.numel()
        self.lengths_at, self.table_at = self.lengths.data_ptr(), self.table.data_ptr()
        self.offsets_at = None if self.metadata is None else self.metadata[5].data_ptr()
        self.offsets_rows = 0 if self.metadata is None else self.metadata[5].numel()
        self.ready = torch.cuda.Event(external=True) if hint.block_table.is_cuda else None
        self._pending: list[Any] = []  # events after the released readers' copies, not yet passed

    @staticmethod
    def rows_for(hint: StageHint) -> int:
        """The rows a program for this build's buffers covers: every row of the runner's lengths and block table."""
        table = hint.block_table
        table_rows = _to_storage_end(table).numel() // max(1, table.stride(0))
        return max(1, min(_to_storage_end(hint.seq_lens).numel(), table_rows))

    def serves(self, hint: StageHint, host: bool = True) -> int:
        """Whether a build's step can be staged by this program: the graph read the buffers it reads, and the
        host's bound on the step's pages is within its positions (the cheap bound first, then the exact one).
        0: it cannot; 1: it can; 2: it can, and its metadata copies read the build's (StagedStep.with_metadata).
        ``host=False``: told without the build's host buffers (the real requests, the bound on the lengths), which
        the engine rewrites at its next step: a reader other than the engine's thread asks so, and a step the cheap
        bound does not tell is refused (0)."""
        if hint.seq_lens is None or hint.seq_lens.data_ptr() != self.lengths_at \
                or hint.block_table.data_ptr() != self.table_at:
            return 0
        # The batch's rows with padding bound its requests: most steps are told with them, the requests left to
        # the reader (StagedStep._requests).
        reqs = hint.most_reqs
        if reqs > self.count_rows:
            if not host:
                return 0
            reqs = hint.num_reqs
            if reqs > self.count_rows:
                return 0
        size, page = self.size, self.page_size
        if hint.max_seq_len <= 0 or reqs * min(-(-hint.max_seq_len // page), self.width) > size:
            bound = hint.seq_lens_bound
            if bound is None or not host:
                return 0
            reqs = hint.num_reqs
            lengths = (bound.numpy() if hasattr(bound, "numpy") else np.asarray(bound))[:reqs]
            if lengths.shape[0] < reqs \
                    or int(np.minimum((lengths.astype(np.int64) + (page - 1)) // page, self.width).sum()) > size:
                return 0
        meta = self.metadata
        if meta is None or hint.query_start_loc is None or hint.query_start_loc.data_ptr() != self.offsets_at \
                or self.offsets_rows < hint.rows + 1:
            return 1
        return 2

    def graph_body(self, rows: int) -> None:
        """The program's work, recorded into vLLM's graph of ``rows`` tokens after its forward (the stream captures)."""
        import torch

        counts = torch.div(self.lengths.to(torch.int64) + (self.page_size - 1), self.page_size, rounding_mode="floor")
        self.counts.copy_(counts.clamp_(0, self.width))
        self._body(rows)
        if self.ready is not None:
            self.ready.record()

    def reusable(self) -> bool:
        """No reader holds the program (a reader lets it go only once its reads are done on the device: the engine's
        thread asks no event)."""
        return not self._holds

    def release(self, issued: bool = True) -> None:
        """The holder's reads of the staged buffers are issued (on the current stream): the program is let go once
        the device has made them (:meth:`poll_released`, asked by the capture thread between its jobs, never by the
        engine's thread); at once when nothing was read (``issued=False``) or on a CPU."""
        if issued and self.ready is not None:
            import torch

            from kvdbg.capture.buffers import current_stream

            done = torch.cuda.Event()
            done.record(current_stream(self.device))
            with self._lock:
                self._pending.append(done)
            return
        self._let_go()

    def poll_released(self, wait: bool = False) -> bool:
        """Let the holds go whose readers' copies are done on the device (``wait``: waiting for them); whether any
        is still pending. The capture thread asks between its jobs; the engine's thread only before a graph records,
        when nothing may query the device."""
        if not self._pending:
            return False
        with self._lock:
            pending = self._pending
            for event in list(pending):
                if wait:
                    event.synchronize()
                elif not event.query():
                    continue
                pending.remove(event)
                self._let_go()
            return bool(pending)

    def staged_step(self, rows: int, hint: StageHint, with_metadata: bool) -> StagedStep:
        """The step the graph just staged (engine's thread: no torch call); its counts are read back by the reader.
        ``with_metadata``: :meth:`serves` said 2."""
        self.runs += 1
        # Requests not worked out at the build are left to the reader, from the staged offsets (with_metadata).
        return StagedStep(self, rows, -1, None, self.page_size, self.ready, self.runs,
                          hint.known_reqs if with_metadata else hint.num_reqs, hint.block_table.shape[1],
                          with_metadata, batch_rows=hint.rows)


def _to_storage_end(t: "torch.Tensor") -> "torch.Tensor":
    """``t`` as one flat view from its first element to the end of its storage (a runner's buffer, whatever rows
    of it a build handed over); ``t`` must be laid out with its last dimension contiguous."""
    elements = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((elements,), (1,))


def _metadata_buffers(table: "torch.Tensor", stride: int, hint: StageHint, rows: int) -> tuple | None:
    """(table copy, lengths copy, offsets copy, table source, lengths source, offsets source) for a program that
    serves batches of up to ``rows`` rows, or None when the hint has no device lengths and offsets, or they are
    not the flat buffers a runner keeps (then the build's own host copies are what capture reads)."""
    seq_lens, offsets = hint.seq_lens, hint.query_start_loc
    n = hint.num_reqs
    if seq_lens is None or offsets is None or rows < n or seq_lens.device != table.device \
            or offsets.device != table.device:
        return None
    if seq_lens.dim() != 1 or offsets.dim() != 1 or seq_lens.stride(0) != 1 or offsets.stride(0) != 1:
        return None
    seq_lens, offsets = _to_storage_end(seq_lens), _to_storage_end(offsets)
    table_rows = min(rows, table.numel() // max(1, stride))
    if table_rows < n or seq_lens.numel() < n or offsets.numel() < n + 1:
        return None
    sources = (table[: table_rows * stride], seq_lens[: min(rows, seq_lens.numel())],
               offsets[: min(rows + 1, offsets.numel())])
    return (*(source.clone() for source in sources), *sources)


def _stack_for(layers: list[tuple], pages: int) -> StagedStack | None:
    """One buffer per kind for all ``layers`` (name, cache, page dim, query, output) when they are alike: caches of one
    shape, strides, type and device, paged on one axis, and queries and outputs of one shape and type each (outputs
    present); else None (each layer gets its own)."""
    import torch

    if len(layers) < 2:
        return None
    _, cache, page_dim, query, output = layers[0]
    if output is None or any(
            c.shape != cache.shape or c.stride() != cache.stride() or c.dtype != cache.dtype or c.device != cache.device
            or d != page_dim or q is None or o is None or q.shape != query.shape or q.dtype != query.dtype
            or o.shape != output.shape or o.dtype != output.dtype for _, c, d, q, o in layers[1:]):
        return None
    count = len(layers)
    return StagedStack(_laid_out_like(cache, page_dim, pages, count),
                       torch.empty((count, *query.shape), dtype=query.dtype, device=query.device),
                       torch.empty((count, *output.shape), dtype=output.dtype, device=output.device))


def _laid_out_like(cache: "torch.Tensor", page_dim: int, pages: int, layers: int | None = None) -> "torch.Tensor":
    """A buffer of ``pages`` pages whose axes lie in memory in the cache's order: an engine layout is named by
    its strides too (a vLLM cache is a permuted view), and the staged pages are read through that layout.
    ``layers``: that many such buffers, one per index of a first axis ahead of them all (a :class:`StagedStack`)."""
    shape = list(cache.shape)
    shape[page_dim] = pages
    order = sorted(range(cache.dim()), key=lambda d: (-cache.stride(d), d))  # outermost axis first
    ahead = [] if layers is None else [layers]
    physical = cache.new_empty(ahead + [shape[d] for d in order])
    return physical.permute(*range(len(ahead)), *[len(ahead) + order.index(d) for d in range(cache.dim())])


class GraphStager:
    """The staging programs of one process, and the choice, per wanted step, to stage it or not."""

    def __init__(self, max_bytes: int = STAGING_MAX_BYTES):
        self.max_bytes = max_bytes
        self._programs: dict[tuple, list[_Program]] = {}
        self.nbytes = 0
        self.staged = 0
        self.not_staged: dict[str, int] = {}
        self.recordings = 0  # staging graphs recorded, on the engine's thread
        self.recording_ms = 0.0
        self._said: set[str] = set()
        self._keys: dict[int, tuple] = {}

    def stage(self, layers: list[tuple], hint: StageHint, page_size: int, rows: int,
              meta_rows: int = 0) -> StagedStep | None:
        """Stage one step (engine's thread, right after the graph's replay). ``layers``: per selected layer,
        (name, cache, page_dim, query buffer, output buffer or None), the buffers the graph copied into;
        ``rows``: the graph's tokens; ``meta_rows``: the most rows of any graph's batch, the rows of the
        runner's buffers a program copies as the step's metadata (one program serves every graph). None (said
        once, counted) when it cannot: the caller then captures the way it did before staging."""
        bound = hint.seq_lens_bound
        n = hint.num_reqs
        table = hint.block_table
        if table.dim() != 2 or table.stride(1) != 1 or table.shape[0] < n:
            return self._not("table", "the block table is not a row-major matrix of the batch's rows")
        width = table.shape[1]
        if bound is not None and (bound.shape[0] if hasattr(bound, "shape") else len(bound)) < n:
            bound = None  # shorter than the step's requests (see stage_hint)
            if hint.max_seq_len <= 0:
                return self._not("bound", "the host's bound on the lengths covers fewer rows than the step's requests")
        if bound is None:
            lengths = np.full(n, hint.max_seq_len, dtype=np.int64)
        else:
            lengths = (bound.numpy() if hasattr(bound, "numpy") else np.asarray(bound))[:n].astype(np.int64)
        counts = np.minimum((lengths + (page_size - 1)) // page_size, width)
        counts = np.maximum(counts, 0)
        total = int(counts.sum())
        if total == 0:
            return self._not("empty", "the step reads no page")
        size = max(MIN_PAGES, 1 << (total - 1).bit_length())
        # A program copies the metadata of batches of up to ``reqs`` rows: every graph's, known once they are
        # recorded, so that graphs of other sizes share programs (else this batch's rows).
        reqs = max(meta_rows, hint.rows, n)
        key = (size, table.data_ptr(), table.stride(0), table.dtype, reqs, self._layers_key(layers))
        program = self._program(key, hint, layers, size, reqs)
        if program is None:
            return None
        recorded = program.graph is not None
        ready = program.run(counts)  # the program lays the requests' pages out one after another, on the device
        if program.graph is not None and not recorded:  # its first run recorded it: once per size, said at exit
            self.recordings += 1
            self.recording_ms += program.recorded_ms
        self.staged += 1
        return StagedStep(program, rows, total, counts, page_size, ready, program.runs, n, width,
                          program.reads_metadata_of(hint))

    def _layers_key(self, layers: list[tuple]) -> tuple:
        """The layers' names, caches and the buffers the graph copies their query and output into, as a program's
        key (a program copies from those buffers: a graph recorded later may give a layer new ones); kept per
        list, since a caller hands the same list for the same graph's layers on every step."""
        hit = self._keys.get(id(layers))
        if hit is not None and hit[0] is layers:
            return hit[1]
        key = tuple((name, cache.data_ptr(), query.data_ptr(), 0 if output is None else output.data_ptr())
                    for name, cache, _, query, output in layers)
        self._keys[id(layers)] = (layers, key)  # the list held: its id is never another's
        if len(self._keys) > 4 * MAX_PROGRAMS:
            self._keys.pop(next(iter(self._keys)))
        return key

    def _program(self, key: tuple, hint: StageHint, layers: list[tuple], size: int, reqs: int) -> _Program | None:
        programs = self._programs.pop(key, [])
        self._programs[key] = programs  # the most recently used size last
        for program in programs:
            if program.reusable():
                return program
        if len(programs) >= PROGRAMS_PER_SIZE:
            return self._not("held", "the staged buffers of earlier wanted steps are still held by their readers "
                                     "(the graph capture thread, the sentinel) or in use on the device")
        need = sum(cache.element_size() * (cache.numel() // max(1, cache.shape[page_dim])) * size
                   + query.numel() * query.element_size() * 2 for _, cache, page_dim, query, _ in layers)
        need += reqs * hint.block_table.stride(0) * hint.block_table.element_size()  # the metadata's copy
        if self.nbytes + need > self.max_bytes:
            return self._not("budget", f"staging it needs {need / 2**20:,.0f} MiB of device memory, over the "
                                       f"{self.max_bytes / 2**20:,.0f} MiB kvdbg keeps for staging "
                                       f"({self.nbytes / 2**20:,.0f} MiB in use)")
        program = _Program(hint.block_table.device, hint, layers, size, reqs)
        programs.append(program)
        self.nbytes += program.nbytes
        self._let_go()
        return program

    def likely_free(self) -> bool:
        """Whether a step of the size staged last would find a program free (or room for one more): a build asks
        it before leaving its copies to the program (``builder_hooks``); a guess, not a reservation."""
        if not self._programs:
            return self.nbytes < self.max_bytes
        programs = next(reversed(self._programs.values()))
        return len(programs) < PROGRAMS_PER_SIZE or any(program.reusable() for program in programs)

    def _let_go(self) -> None:
        """Past MAX_PROGRAMS, let the least recently used programs go (a held one is kept until released)."""
        total = sum(len(programs) for programs in self._programs.values())
        for key in list(self._programs):
            if total <= MAX_PROGRAMS:
                return
            programs = self._programs[key]
            for program in [p for p in programs if not p.held]:
                if total <= MAX_PROGRAMS:
                    break
                programs.remove(program)
                self.nbytes -= program.nbytes
                total -= 1
            if not programs:
                del self._programs[key]

    def _not(self, kind: str, why: str) -> None:
        self.not_staged[kind] = self.not_staged.get(kind, 0) + 1
        if kind not in self._said:
            self._said.add(kind)
            logger.info("kvdbg capture: a wanted step of a replayed CUDA graph was not staged on the device (%s); "
                        "it is captured from the engine's memory, the engine's thread waiting for the copies "
                        "(logged once; the exit line counts these steps)", why)
        return None


__all__ = ["GraphStager", "InGraphProgram", "StageHint", "StagedPages", "StagedStep", "stage_hint"]
