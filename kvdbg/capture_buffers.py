"""Host copies of one engine step, made without waiting: reused host buffers on CPU, asynchronous copies on CUDA.

Capture copies a step's tensors out of the engine in the engine's own thread
(their memory is reused by the next step), so this is the part of a capture
the engine pays for. Everything here only copies; nothing validates, converts
or allocates more than the copy needs.

On CPU::

    small tensors (query, new K/V, block table, ...)   t.clone()          one copy each
    the step's pages                                   index_select(out=) into a reused buffer

A fresh 50 MB tensor costs eight times its copy in first-touch page faults; the
:class:`HostBuffers` pool keeps a few page buffers between steps so that only
the first capture of a size pays for them.

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
"""

from __future__ import annotations

import threading
from typing import Any

import torch

# Pages are gathered on a device in slices of this size. Up to one slice the copy is fully
# asynchronous; a larger capture keeps at most two slices in device memory, waiting for the
# older one, so a long-context capture never needs a second copy of its pages in device memory.
GATHER_CHUNK_BYTES = 64 * 1024**2
# Host buffers below this size are allocated per step (the allocator is fast for them).
POOLED_MIN_BYTES = 256 * 1024
# Free page buffers kept between steps.
POOL_KEEP = 2


class HostBuffers:
    """Host memory for copied pages, reused between steps (one pool per capturer; thread-safe).

    :meth:`take` returns a buffer of at least the size asked (a free one no more
    than twice that size, else a new one); :meth:`give` returns it once the
    writer is done with it. At most :data:`POOL_KEEP` free buffers, and never
    more than ``keep_bytes`` of them, are kept.
    """

    def __init__(self, keep_bytes: int | None = None):
        self.keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.last_size = 0  # the latest pooled size asked for: the size of the spare

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes >= POOLED_MIN_BYTES:
            self.last_size = nbytes
            with self._lock:
                fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
                if fits:
                    # By position: list.remove would compare tensors by value (elementwise), not by identity.
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buffer: torch.Tensor | None) -> None:
        if buffer is None or buffer.numel() < POOLED_MIN_BYTES or buffer.device.type != "cpu":
            return
        with self._lock:
            self._free.append(buffer)
            while len(self._free) > POOL_KEEP or (self.keep_bytes is not None
                                                  and sum(b.numel() for b in self._free) > self.keep_bytes):
                self._free.pop(0)

    def ensure_spare(self, limit_bytes: int) -> None:
        """Keep one free buffer of the latest size ready, its memory already touched (writer's thread).

        A fresh buffer costs its first user a page fault per 4 KiB, eight times
        the copy at 50 MB; made here, that cost falls on the writer instead of
        the engine. Only while the free buffers stay within ``limit_bytes``.
        """
        size = self.last_size
        if size < POOLED_MIN_BYTES:
            return
        with self._lock:
            if any(size <= b.numel() <= 2 * size for b in self._free):
                return
            if sum(b.numel() for b in self._free) + size > limit_bytes:
                return
        spare = torch.empty(size, dtype=torch.uint8)
        spare.fill_(0)
        self.give(spare)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


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
        self._side_used = False

    # ---------------------------------------------------------------- engine thread

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of ``t`` (contiguous); on CUDA issued on the current stream, not yet complete.

        Engines run under inference mode or ``no_grad``; a tensor that requires
        grad would keep its graph alive in the copy, so it is detached first.
        """
        if t.requires_grad:
            t = t.detach()
        if t.is_cpu:
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
            return torch.index_select(cache, dim, ids, out=out)
        if not self.cuda:
            return cache.index_select(dim, ids.to(cache.device)).to("cpu")
        return self._gather_cuda(cache, dim, ids, tuple(shape), page_bytes)

    def _gather_cuda(self, cache, dim, ids, shape, page_bytes) -> torch.Tensor:
        host = torch.empty(shape, dtype=cache.dtype, pin_memory=True)
        # Slices along the page dimension are contiguous only when it is the first one.
        per_chunk = max(1, GATHER_CHUNK_BYTES // max(1, page_bytes)) if dim == 0 else max(1, shape[dim])
        current = torch.cuda.current_stream(cache.device)
        side = _side_stream(cache.device)
        # Host ids go to the device from pinned memory, so even this copy does not wait.
        ids_device = ids.pin_memory().to(cache.device, non_blocking=True)
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
        self._side_used = True
        return host

    def close(self) -> None:
        """Mark the end of the copies issued so far on the current stream (CUDA); a no-op on CPU."""
        if self.cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
            self._events.append(event)

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


_SIDE_STREAMS: dict[Any, Any] = {}
_SIDE_LOCK = threading.Lock()


def _side_stream(device: torch.device):
    key = device.index if device.index is not None else torch.cuda.current_device()
    with _SIDE_LOCK:
        stream = _SIDE_STREAMS.get(key)
        if stream is None:
            stream = _SIDE_STREAMS[key] = torch.cuda.Stream(device=device)
        return stream


__all__ = ["GATHER_CHUNK_BYTES", "HostBuffers", "StepCopies"]
