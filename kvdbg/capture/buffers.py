"""Host copies of one engine step, made without waiting: reused host buffers on CPU, asynchronous copies on CUDA.

Capture copies a step's tensors out of the engine in the engine's own thread
(their memory is reused by the next step), so this is the part of a capture
the engine pays for. Everything here only copies; nothing validates, converts
or allocates more than the copy needs.

On CPU::

    small tensors (query, new K/V, block table, ...)   t.clone()          one copy each
    the step's pages                                   index_select(out=) into a reused buffer
                                                       (from 4 MiB, runs of consecutive pages: copy_)

A fresh 50 MB tensor costs three to eight times its copy in first-touch page
faults; the :class:`HostBuffers` pool keeps the page buffers the writer gives
back, as many as the writer's memory budget leaves room for, so that only the
first captures of a burst pay for them. The writer gives the free ones back to
the system once capture has been idle for :data:`IDLE_RELEASE_SECONDS`.

On CUDA the engine's thread never waits for the device::

    current stream:  small tensors  ──D2H (pinned, non_blocking)──▶ host ─┐
                     pages ──index_select──▶ device copy              │
    side stream:     (waits for the current stream) device copy ──D2H (pinned)──▶ host
                                                                    event ─┴─▶ the writer waits on it

The pages are gathered on the current stream, so they are exactly what the
step read, then moved to the host on a side stream that overlaps the engine's
work. Pinned host memory comes from torch's caching host allocator (reused
once a copy is done). The writer thread calls :meth:`StepCopies.wait` before
it reads anything.

Each CUDA runtime call costs the engine's thread 10 to 30 µs, which is the
whole cost of a small step, so pages under :data:`SIDE_STREAM_MIN_BYTES`
(a decode step of a short sequence) skip the side stream: they go to the
host on the current stream, where their copy takes the device a few
microseconds, and the step records one event at its end instead of one per
stage (:meth:`StepCopies.mark` only remembers the stream).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

# Pages are gathered on a device in slices of this size. Up to one slice the copy is fully
# asynchronous; a larger capture keeps at most two slices in device memory, waiting for the
# older one, so a long-context capture never needs a second copy of its pages in device memory.
GATHER_CHUNK_BYTES = 64 * 1024**2
# Host buffers below this size are allocated per step (the allocator is fast for them).
POOLED_MIN_BYTES = 256 * 1024
# Pages below this size go to the host on the engine's stream (a copy of a few microseconds on the device),
# sparing the engine's thread the side stream's five runtime calls; larger ones overlap the engine's work.
SIDE_STREAM_MIN_BYTES = 256 * 1024
# Free page buffers kept between steps, at most (and never more bytes than the pool's keep_bytes).
POOL_KEEP = 64
# Free buffers are given back to the system after this long without a capture (the writer's idle timer).
IDLE_RELEASE_SECONDS = 30.0


def _headroom(nbytes: int, pinned: bool) -> int:
    """The size to allocate for ``nbytes``: a step's pages grow as its sequences do, so a buffer made to
    measure would fit no later step. Pinned memory comes from torch's caching host allocator in powers of
    two, so the power of two costs nothing more; other memory gets an eighth more (at most)."""
    if nbytes < POOLED_MIN_BYTES:
        return nbytes
    if pinned:
        return 1 << (nbytes - 1).bit_length()
    grain = 1 << max(0, nbytes.bit_length() - 5)  # a sixteenth to a thirty-second of the size
    return -(-(nbytes + (nbytes >> 4)) // grain) * grain  # a sixteenth more, rounded up to the grain


class HostBuffers:
    """Host memory for copied pages, reused between steps (one pool per capturer; thread-safe).

    :meth:`take` returns a buffer of at least the size asked (a free one no more
    than twice that size, else a new one); :meth:`give` returns it once the
    writer is done with it. At most :data:`POOL_KEEP` free buffers, and never
    more than ``keep_bytes`` of them, are kept (the capturer sets it to what its
    queue budget leaves free, so that waiting and free buffers together stay
    within the budget); :meth:`trim` gives them all back.
    """

    def __init__(self, keep_bytes: int | None = None):
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.last_size = 0  # the latest pooled size asked for: the size of the spare
        self.last_pinned = False  # and whether it was pinned

    def take(self, nbytes: int, pinned: bool = False) -> torch.Tensor:
        """A buffer of at least ``nbytes``; ``pinned``: page-locked, for asynchronous copies from a GPU.

        A new pinned buffer is dear (about 25 ms for 50 MB on an H200, ten times the copy it serves), so
        pinned buffers are pooled like the others, each kind apart.
        """
        if nbytes >= POOLED_MIN_BYTES:
            self.last_size, self.last_pinned = nbytes, pinned
            with self._lock:
                fits = [i for i, b in enumerate(self._free)
                        if nbytes <= b.numel() <= 2 * nbytes and b.is_pinned() == pinned]
                if fits:
                    # By position: list.remove would compare tensors by value (elementwise), not by identity.
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(_headroom(nbytes, pinned), dtype=torch.uint8, pin_memory=pinned)

    def give(self, buffer: torch.Tensor | None) -> None:
        if buffer is None or buffer.numel() < POOLED_MIN_BYTES or buffer.device.type != "cpu":
            return
        with self._lock:
            self._free.append(buffer)
            while len(self._free) > POOL_KEEP or (self.keep_bytes is not None
                                                  and sum(b.numel() for b in self._free) > self.keep_bytes):
                self._free.pop(0)  # the oldest first: sizes drift as sequences grow

    def trim(self) -> int:
        """Give every free buffer back to the system; returns the bytes released."""
        with self._lock:
            released = sum(b.numel() for b in self._free)
            self._free.clear()
        return released

    def ensure_spare(self, limit_bytes: int) -> None:
        """Keep one free buffer of the latest size ready, its memory already touched (writer's thread).

        A fresh buffer costs its first user a page fault per 4 KiB, eight times
        the copy at 50 MB; made here, that cost falls on the writer instead of
        the engine. Only while the free buffers stay within ``limit_bytes``.
        """
        size, pinned = self.last_size, self.last_pinned
        if size < POOLED_MIN_BYTES:
            return
        with self._lock:
            if any(size <= b.numel() <= 2 * size and b.is_pinned() == pinned for b in self._free):
                return
            if sum(b.numel() for b in self._free) + size > limit_bytes:
                return
        spare = torch.empty(_headroom(size, pinned), dtype=torch.uint8, pin_memory=pinned)
        spare.fill_(0)
        self.give(spare)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


def in_memory_order(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]] | None:
    """``tensor`` with its axes permuted into their order in memory (outermost first), and the permutation that
    gives its own axes back; None when its elements are not one dense run of memory (no single copy takes it)."""
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), d))
    physical = tensor.permute(*order)
    if not physical.is_contiguous():
        return None
    return physical, tuple(order.index(d) for d in range(tensor.dim()))


class StepCopies:
    """The host copies of one step, and what the writer must wait for before reading them.

    ``StepCopies(device, buffers)``; :meth:`copy` a tensor, :meth:`gather` pages,
    :meth:`close` once the step's copies are all issued (records the events),
    then :meth:`wait` in the writer. ``pooled`` lists the host buffers to
    :meth:`release` after the file is written.
    """

    def __init__(self, device: torch.device, buffers: HostBuffers | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.buffers = buffers
        self.pooled: list[torch.Tensor] = []
        self._events: list[Any] = []
        self._streams: list[Any] = []  # streams with copies that no event covers yet (see mark)
        # Copies issued ahead (:meth:`ahead`, :meth:`span_ahead`): host tensors still being written, which
        # :meth:`copy` hands back as they are, and staged spans :meth:`block` takes instead of copying again.
        self._ahead: set[int] = set()
        self._spans: list[tuple[torch.Tensor, int, int, int, torch.Tensor]] = []

    # ---------------------------------------------------------------- engine thread

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (contiguous); on CUDA issued on the current stream, not yet complete.

        Engines run under inference mode or ``no_grad``; a tensor that requires
        grad would keep its graph alive in the copy, so it is detached first.
        """
        if t.requires_grad:
            t = t.detach()
        if t.is_cpu:
            if self._ahead and t.untyped_storage().data_ptr() in self._ahead:
                return t  # issued ahead by these copies: the events the writer waits for cover it
            return t.clone(memory_format=torch.contiguous_format)
        if self.cuda:
            return t.to("cpu", non_blocking=True)  # pinned from torch's caching host allocator
        return t.to("cpu")  # another device type: a plain synchronous copy

    def gather(self, cache: torch.Tensor, dim: int, ids: torch.Tensor) -> torch.Tensor:
        """Host copy of ``cache.index_select(dim, ids)`` (``ids``: int64 on the host), in the cache's own layout."""
        shape = list(cache.shape)
        pages = shape[dim]
        shape[dim] = len(ids)
        element = cache.element_size()
        page_bytes = element * (cache.numel() // max(1, pages))
        nbytes = page_bytes * shape[dim]
        if cache.is_cpu:
            if nbytes < POOLED_MIN_BYTES or self.buffers is None:
                return cache.index_select(dim, ids)  # small: the allocator is quicker than a pool
            buffer = self.buffers.take(nbytes)
            self.pooled.append(buffer)
            out = buffer[:nbytes].view(cache.dtype).view(shape)
            runs = _runs(ids) if nbytes >= RUNS_MIN_BYTES else None
            if runs is None:
                return torch.index_select(cache, dim, ids, out=out)
            for start, first, count in runs:  # consecutive pages: copies that run on all the engine's threads
                out.narrow(dim, start, count).copy_(cache.narrow(dim, first, count))
            return out
        if not self.cuda:
            return cache.index_select(dim, ids.to(cache.device)).to("cpu")
        return self._gather_cuda(cache, dim, ids, tuple(shape), page_bytes, nbytes)

    def _gather_cuda(self, cache, dim, ids, shape, page_bytes, nbytes) -> torch.Tensor:
        # Host ids go to the device from pinned memory, so even this copy does not wait.
        ids_device = ids.pin_memory().to(cache.device, non_blocking=True)
        if nbytes < SIDE_STREAM_MIN_BYTES:
            # One gather, one copy to pinned memory, both on the current stream: the event that
            # close() records there covers them.
            return cache.index_select(dim, ids_device).to("cpu", non_blocking=True)
        if self.buffers is not None and nbytes >= POOLED_MIN_BYTES:
            buffer = self.buffers.take(nbytes, pinned=True)
            self.pooled.append(buffer)
            host = buffer[:nbytes].view(cache.dtype).view(shape)
        else:
            host = torch.empty(shape, dtype=cache.dtype, pin_memory=True)
        # Slices along the page dimension are contiguous only when it is the first one.
        per_chunk = max(1, GATHER_CHUNK_BYTES // max(1, page_bytes)) if dim == 0 else max(1, shape[dim])
        current = torch.cuda.current_stream(cache.device)
        side = _side_stream(cache.device)
        in_flight: list[Any] = []
        for start in range(0, max(1, shape[dim]), per_chunk):
            if len(in_flight) == 2:  # at most two slices of device memory: wait for the older one
                in_flight.pop(0).synchronize()
            pages = cache.index_select(dim, ids_device[start:start + per_chunk])  # on the current stream
            side.wait_stream(current)
            with torch.cuda.stream(side):
                host.narrow(dim, start, pages.shape[dim]).copy_(pages, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            pages.record_stream(side)  # the allocator keeps the slice until the side stream has read it
            in_flight.append(done)
        self._events.append(in_flight[-1])  # the side stream is in order: its last event covers every slice
        return host

    def block(self, source: torch.Tensor, dim: int,
              positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A host copy of the pages ``positions`` span in ``source`` (a device buffer of kvdbg's own that nothing
        overwrites meanwhile: a staged step's), as one copy on the current stream (one of kvdbg's own: the engine's
        would wait for it), and the positions within it:
        the writer picks the pages on the host (``index_select(dim, within)``). None where it does not apply (a
        CPU, or a span that is not one dense run of memory, whatever the order of its axes there: then
        :meth:`gather`).

        A gather on the device keeps at most two slices in device memory and waits for the older one, so the
        copies of a step's layers reach the device one wait apart; a staged buffer needs no slice, so each layer
        costs one copy, issued at once."""
        if not self.cuda or source.is_cpu or positions.numel() == 0:
            return None
        lo, hi = int(positions.min()), int(positions.max()) + 1
        for issued, issued_dim, first, end, host in self._spans:
            if issued is source and issued_dim == dim and first <= lo and hi <= end:
                return host, positions - first  # the span went to the host ahead (span_ahead)
        return self._span(source, dim, lo, hi, positions)

    def _span(self, source: torch.Tensor, dim: int, lo: int, hi: int,
              positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        dense = in_memory_order(source.narrow(dim, lo, hi - lo))
        if dense is None:
            return None
        # A vLLM cache is a permuted view (its layout names the order of its axes in memory): the span goes to
        # the host in that order, one copy, and is handed back in the cache's axes.
        span, back = dense
        nbytes = span.numel() * span.element_size()
        if self.buffers is not None and nbytes >= POOLED_MIN_BYTES:
            buffer = self.buffers.take(nbytes, pinned=True)
            self.pooled.append(buffer)
            host = buffer[:nbytes].view(span.dtype).view(span.shape)
        else:
            host = torch.empty(span.shape, dtype=span.dtype, pin_memory=True)
        host.copy_(span, non_blocking=True)  # the current stream: the event close() records there covers it
        return host.permute(*back), None if positions is None else positions - lo

    def ahead(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`copy`, issued before the capture that reads it is planned: a later :meth:`copy` of this host
        tensor, or of a view of it, hands it back as it is (still being written; the writer waits for the events
        :meth:`close` records). The graph capture thread issues a staged step's copies for every layer this way,
        before it plans any layer, so the device copies them back to back instead of one layer's Python apart."""
        host = self.copy(t)
        if not host.is_cpu or host is t:
            return host
        self._ahead.add(host.untyped_storage().data_ptr())
        return host

    def span_ahead(self, source: torch.Tensor, dim: int, lo: int, hi: int) -> bool:
        """Issue now the copy :meth:`block` would make of the pages ``lo`` to ``hi`` of ``source`` (a staged buffer);
        a later :meth:`block` within that span takes it instead. False where :meth:`block` would not apply."""
        if not self.cuda or source.is_cpu or hi <= lo:
            return False
        done = self._span(source, dim, lo, hi, None)
        if done is None:
            return False
        self._spans.append((source, dim, lo, hi, done[0]))
        return True

    def discard(self) -> None:
        """Copies issued ahead that no capture took over: once the device has made them, their buffers go back."""
        self.close()
        self.wait()
        self.release()
        self._spans.clear()
        self._ahead.clear()

    def mark(self) -> None:
        """Remember the current stream, whose copies so far :meth:`close` must cover (CUDA; a no-op on CPU).

        For an engine that may switch streams between a step's copies. It records
        no event: one recorded on that stream later, at :meth:`close`, comes after
        these copies all the same (a stream runs in order), and costs the engine's
        thread one runtime call less per step.
        """
        if self.cuda:
            stream = torch.cuda.current_stream(self.device)
            if stream not in self._streams:
                self._streams.append(stream)

    def close(self) -> None:
        """Mark the end of the copies issued so far (CUDA: an event on the current stream and on each
        stream :meth:`mark` remembered); a no-op on CPU."""
        if self.cuda:
            current = torch.cuda.current_stream(self.device)
            for stream in [current, *(s for s in self._streams if s != current)]:
                event = torch.cuda.Event()
                event.record(stream)
                self._events.append(event)
            self._streams.clear()

    # ---------------------------------------------------------------- writer thread

    def wait(self) -> None:
        """Block until every copy issued is complete (the writer calls it before reading)."""
        for event in self._events:
            event.synchronize()
        self._events.clear()

    def release(self) -> None:
        """Return pooled host buffers (call once nothing refers to them any more)."""
        if self.buffers is not None:
            for buffer in self.pooled:
                self.buffers.give(buffer)
        self.pooled.clear()


class HostCopiesReady:
    """One event after host copies issued on a device stream; :meth:`synchronize` waits for it, once.

    ``HostCopiesReady(device)`` right after :func:`copies_to_host` (it records on
    the current stream). The vLLM plugin copies a step's metadata to the host when
    the builder builds and waits for this event only when a hook first reads the
    copies: the device has usually passed the build by then, where a read of the
    device tensors in the hook would wait for every kernel queued before it.
    """

    __slots__ = ("_event",)

    def __init__(self, device: torch.device):
        self._event = torch.cuda.Event()
        self._event.record(current_stream(device))

    def synchronize(self) -> None:
        event = self._event
        if event is not None:
            event.synchronize()
            self._event = None  # later readers of the same copies pay nothing

    def query(self) -> bool:
        """Whether the copies are complete, without waiting (another thread may synchronize meanwhile)."""
        event = self._event
        return event is None or event.query()


_STREAMS: dict[tuple, Any] = {}


def current_stream(device: torch.device):
    """``torch.cuda.current_stream(device)``, the stream object kept per stream: torch makes a new Python object
    on every call, which costs the engine's thread about 8 us on the H200's host (``bench/staging_calls.py``),
    more than the copy or the event it is asked for."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = torch._C._cuda_getCurrentStream(index)  # (stream id, device index, device type): what torch reads
    stream = _STREAMS.get(raw)
    if stream is None:
        stream = _STREAMS[raw] = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])
    return stream


def copies_to_host(tensors: "list[torch.Tensor | None]") -> "list[torch.Tensor | None]":
    """Host copies of device tensors, issued on the current stream and not waited for (pinned memory from
    torch's caching host allocator): read them only after a :class:`HostCopiesReady` recorded after them.
    A tensor already on the host is cloned (``to`` would hand back the tensor itself).

    One ``to`` per tensor: a build's three to five small tensors cost the caller one torch call each (about 8 us
    on the H200's host). Joining them into one buffer first saves runtime copies but costs more torch calls
    (three a tensor, the join, a view back each): 70 us against about 35 (``bench/staging_calls.py``)."""
    return [None if t is None else t.clone() if t.is_cpu else t.to("cpu", non_blocking=True) for t in tensors]


# A CPU gather of at least RUNS_MIN_BYTES whose pages form at most MAX_RUNS runs of consecutive ids is
# copied run by run (below that, the calls a run costs are more than index_select's slower copy saves).
MAX_RUNS = 16
RUNS_MIN_BYTES = 4 * 1024**2


def _runs(ids: torch.Tensor) -> list[tuple[int, int, int]] | None:
    """(position in the gather, first page id, count) per run of consecutive ``ids``; None past MAX_RUNS runs.

    An engine hands out a request's pages mostly in order, so a long sequence's
    pages come in a few runs; ``copy_`` of a run uses all of torch's threads,
    where ``index_select`` copies page by page (a third slower at 50 MB).
    """
    values = ids.numpy()
    if values.size == 0:
        return None
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    if breaks.size >= MAX_RUNS:
        return None
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), int(values.size)]
    firsts = values[starts].tolist()
    return [(a, f, b - a) for a, b, f in zip(starts, ends, firsts)]


_SIDE_STREAMS: dict[Any, Any] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get(key)
        if stream is None:
            stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
        return stream


__all__ = ["GATHER_CHUNK_BYTES", "IDLE_RELEASE_SECONDS", "SIDE_STREAM_MIN_BYTES", "HostBuffers", "HostCopiesReady",
           "StepCopies", "copies_to_host", "current_stream", "in_memory_order"]
