"""The sentinel's checks of staged graph steps in a process of their own (``KVDBG_SENTINEL_PROCESS``, on by default).

A check is a hundred-odd torch calls and some milliseconds of Python. In the
engine's process it runs in a worker thread, and that thread holds Python's
lock between its calls: the engine's thread, which wants the lock back after
each of its own torch calls, waits. On an H100 (docs/benchmarks.md, section
10) a drawn step then cost +3.6 ms and the steps after it +3.9 ms, where the
same steps with the check replaced by a sleep cost +1.4 and +0.2 ms.

So a staged step's check goes to a child process, which has a lock of its own,
and no thread of the engine's process takes part: the engine's thread sends
it and reads the answer, at its hooks, without waiting::

    engine's thread (its hooks)                     checker process (python -m kvdbg.sentinel.child)
    the step drawn: its layers staged, handed over  -
    a later hook: the staging's event done?         -
                  send "share" once per buffer ->   open the buffer (CUDA IPC), keep it
                  send "define" once per layer ->   keep its constants (a CaptureLayer)
                  send "template" once per      ->  keep the layers' query, output and pages as views
                  staging program                   of the buffers
                  send "check" (the template's  ->  the layers' inputs: the template's, with the step's
                  key, the step's metadata and      metadata; check_layers() on its own CUDA context
                  its graph's rows
                  by value)
    each hook while it is out: an answer back?  <-  the CheckResults (plain data; a passed one as a
                                                    PassedCheck: its pairs as ints, made PairResults if read)

(At first the worker thread sent the check and waited for its answer: it woke
a dozen times a check, after the staging's event and on the socket, each
time taking the lock back from the engine's thread.)

Only staged steps go there: their query, output and pages lie in buffers
kvdbg keeps for the life of a staging program, so each buffer is opened once;
their metadata (the build's host copies, and each request's staged pages)
travels by value: a device tensor made for one step would be a new buffer to
share (an IPC handle, an event, a reference count) and for the child to open,
every check. Their layers' constants go once too, and so do the views of the
buffers a staging program's steps are read through (a template): a check
then carries its step's metadata alone, where pickling every layer's inputs
again took the engine's thread some 250 us a check on an H100 host. A step
checked from the engine's own tensors (eager mode, or a graph step's copies
that are not staged) stays in the worker thread. The engine sends a check only after its
staging's event is done, and lets the staging go only when the answer is
back, as it does for a check in the thread.

If the child cannot start, dies or does not answer (60 s), it is said once as
a warning and ended, and the checks it had not answered go to the worker
thread, as do later ones. The child exits when its socket closes (the
engine's process ended or closed it). It holds a CUDA context of its own on
the engine's device (a few hundred MiB) and the check's working memory. Its
threads are scheduled as batch work (:func:`kvdbg.sentinel.child.behind_the_engine`):
woken by a check, none takes the core of the engine's thread that sent it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import logging
import operator
import os
import pickle
import queue
import random
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

from kvdbg.sentinel.config import REFERENCE_PLACES

logger = logging.getLogger("kvdbg.sentinel")

__all__ = ["CheckerProcess", "CheckerProcessError"]

# Seconds the child may take to start (import torch and kvdbg, make its CUDA context), and to answer one check.
START_SECONDS = 120.0
CHECK_SECONDS = 60.0
# The longest a hook's look for answers (answers(None)) skips the socket after a check went to work.
TOO_SOON_NS = 20_000_000
# Tensors whose references are kept (see CheckerProcess._refs); past it they are worked out again.
REFS_KEPT = 4096
_CALL = weakref.ref.__call__  # a weak reference's object (mapped over a template's references)
# Checks' layers whose parts the child keeps (see CheckerProcess._template); past it the least recently used is
# forgotten (a template per staging program and set of sampled layers; one program serves every graph size).
TEMPLATES_KEPT = 16
# A step's own fields of a check's inputs (kvdbg.sentinel.checker.StepInputs), sent with every check; the others
# (the layer's query, output and pages: kvdbg's staged buffers) go once, in a template.
STEP_FIELDS = ("block_table", "seq_lens", "query_start_loc", "causal", "max_pages", "rows")
_STEP = operator.attrgetter(*STEP_FIELDS)  # a check's inputs' STEP_FIELDS as a tuple, in one call


class CheckerProcessError(RuntimeError):
    """The checker process could not start, died, or did not answer in time (the message says which)."""


class CheckerProcess:
    """The engine's side: starts the child, shares buffers with it once, and asks it to check steps.

    Not thread-safe: one thread (the engine's, through DeferredChecks.poll_remote) submits checks and reads their
    answers. ``device``: the engine's device (a CPU device runs the same protocol with every tensor sent by value:
    the tests' way in; with ``share_host``, a template's host tensors are shared as a CUDA step's staged buffers
    are).
    """

    def __init__(self, device: Any, *, start_seconds: float = START_SECONDS, check_seconds: float = CHECK_SECONDS,
                 command: list[str] | None = None, reference: str = "host", share_host: bool = False):
        import torch

        if reference not in REFERENCE_PLACES:
            raise ValueError(f"reference must be {' or '.join(REFERENCE_PLACES)}, got {reference!r}")

        self.device = torch.device(device)
        self.check_seconds = check_seconds
        # Host tensors shared as buffers too (torch moves each storage into shared memory), as CUDA ones are: the
        # tests' way into the protocol of staged steps on a CPU. Off, a host tensor travels by value.
        self.share_host = share_host
        self._shared: dict[int, tuple[Any, int]] = {}  # a storage's data_ptr: (weak reference, key)
        # id(layer): (weak reference, key) of each CaptureLayer the child was given once: a check names its layers
        self._layers: dict[int, tuple[Any, int]] = {}
        # id(tensor): (weak reference, its reference): a program's staged views are the same objects step after
        # step, and working a reference out again takes torch calls under Python's lock
        self._refs: dict[int, tuple] = {}
        # The ids of a check's layers and of their staged buffers' tensors: (their weak references, the template's
        # key, the storage and layer keys it names), oldest first (_template)
        self._templates: collections.OrderedDict = collections.OrderedDict()
        # Storages shared with, layers given to, and templates made for the child so far (each once, unless let go)
        self.shares = self.defines = self.templates = 0
        self.last_times = (0, 0)  # the last check's (pickling and sending), the last answer's wait since its send, ns
        self._out: collections.deque = collections.deque()  # each outstanding check's send time (perf_counter_ns)
        self._since = 0  # when the oldest outstanding check became the one the child works on (its time limit's start)
        # How long after that a hook's look (answers(None)) does not ask the socket, nor whether the child lives:
        # half the last check's time in the child, at most TOO_SOON_NS. A hook of the engine's thread looks every
        # step while a check is out (the socket's poll and the child's, two system calls); an answer takes some steps
        # (11 ms on an H100 host).
        self._too_soon = 0
        self._next_key = 0
        self._torch = torch
        index = "" if self.device.type != "cuda" else str(self.device.index if self.device.index is not None
                                                               else torch.cuda.current_device())
        command = command or [sys.executable, "-m", "kvdbg.sentinel.child"]
        ours, theirs = socket.socketpair()
        try:
            self._process = subprocess.Popen(command + [str(theirs.fileno()), index or "cpu", reference],
                                             pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                             env=_child_environment())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        from multiprocessing.connection import Connection

        self._conn = Connection(ours.detach())
        try:
            kind, self.info = self._receive(start_seconds, "to start")  # ("ready", its pid, torch and device)
            if kind != "ready":
                raise CheckerProcessError(f"the checker process (pid {self.pid}) said {kind!r} where it should "
                                          "have said it was ready")
        except BaseException:
            self.close(0.0)
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def submit(self, entries: list, *, pairs: Any, seed: int, step: int | None) -> None:
        """Send :func:`kvdbg.sentinel.checker.check_layers` of ``entries`` (pairs drawn from ``seed``) to the child,
        without waiting: its answer comes back through :meth:`answers`, in the order of the submissions. The
        engine's thread calls this once the step's staging is done on the device (the child reads the buffers as
        they are). Raises CheckerProcessError when the child is gone."""
        began = time.perf_counter_ns()
        # ("share", key, handle), ("define", key, layer) and ("template", key, parts) messages the check needs first
        first: list = []
        payload = io.BytesIO()
        try:
            key = self._template(entries, first)
            part = entries if key is None else [_STEP(inputs) for _, inputs in entries]
            _Pickler(payload, self, first).dump((key, part, pairs, seed, step))
        except BaseException:  # nothing sent: what it was about to give the child is not the child's
            keys = {message[1] for message in first}
            self.shares -= sum(message[0] == "share" for message in first)
            self.defines -= sum(message[0] == "define" for message in first)
            self.templates -= sum(message[0] == "template" for message in first)
            for known in (self._shared, self._layers):
                for name in [n for n, (_, key) in known.items() if key in keys]:
                    del known[name]
            for ids in [ids for ids, (_, key, _) in self._templates.items() if key in keys]:
                del self._templates[ids]
            self._refs.clear()
            raise
        for message in first:
            self._send(message)
        self._send(("check", payload.getvalue()))
        sent = time.perf_counter_ns()
        if not self._out:
            self._since = sent
        self._out.append(sent)
        self.last_times = (sent - began, 0)

    @property
    def outstanding(self) -> int:
        """Checks submitted and not answered yet."""
        return len(self._out)

    def answers(self, timeout: float | None = 0.0) -> list:
        """The answers the child sent back since the last call, oldest first, each ``("ok", its CheckResults)`` (a
        passed one a PassedCheck) or ``("error", the check's own error in words)``; with ``timeout``, waiting up to
        that many seconds for every outstanding check's. Raises CheckerProcessError when the child died, or took
        over ``check_seconds`` for a check (counted from its send, or from the answer before it when it waited behind
        that one; the child is then ended); the checks still outstanding are then lost (the caller checks them
        otherwise). ``timeout=None``: a hook's look, every step while a check is out, which asks nothing (the socket,
        the child: two system calls) before half the last check's time in the child (at most ``TOO_SOON_NS``) has
        passed since the oldest outstanding check went to work; else as ``timeout=0``."""
        got = []
        if timeout is None:
            if self._out and time.perf_counter_ns() - self._since < self._too_soon:
                return got
            timeout = 0.0
        deadline = time.monotonic() + timeout
        while self._out:
            ready = self._conn.poll(max(0.0, min(0.5, deadline - time.monotonic())))  # the lock let go while it waits
            if not ready:
                if self._process.poll() is not None:
                    raise self._exited("to answer a check")
                if time.perf_counter_ns() - self._since > self.check_seconds * 1e9:
                    self._process.kill()
                    raise CheckerProcessError(f"the checker process (pid {self.pid}) took over {self.check_seconds:g} "
                                              "s to answer a check; it was ended")
                if time.monotonic() >= deadline:
                    break
                continue
            try:
                data = self._conn.recv_bytes()
            except (EOFError, OSError):  # its end closed: it exited, or is exiting
                raise self._exited("to answer a check") from None
            sent = self._out.popleft()
            now = time.perf_counter_ns()
            self._too_soon = min((now - self._since) // 2, TOO_SOON_NS)
            self._since = now  # the next check's time counts from here: it waited behind this one
            try:
                kind, value = pickle.loads(data)
            except Exception as exc:  # that check's answer alone is lost
                kind, value = "error", f"its answer could not be read ({type(exc).__name__}: {exc})"
            self.last_times = (self.last_times[0], time.perf_counter_ns() - sent)
            got.append((kind, value))
        return got

    def _template(self, entries: list, first: list) -> int | None:
        """The key of the template the child holds for these layers' parts that stay from one check to the next
        (each layer, and its query, output and pages: kvdbg's staged buffers whole, the same objects every step
        a staging program stages, whatever its graph's rows), made first (a ``template`` added to ``first``) when
        it holds none; a check then sends only each layer's ``STEP_FIELDS``. None when a part is a host tensor (it
        travels by value: its values are the step's) or missing."""
        objects: list = []
        shape: list = []
        for layer, inputs in entries:
            stack = inputs.stack
            if stack is None:
                objects += (layer, inputs.query, inputs.kv_cache, inputs.output)
                shape.append((4, None, inputs.max_model_len))
            else:
                held = stack[0]
                objects += (layer, inputs.query, inputs.kv_cache, inputs.output, held.pages, held.query, held.output)
                shape.append((7, stack[1], inputs.max_model_len))
        ids = (tuple(map(id, objects)), tuple(shape))
        known = self._templates.get(ids)
        if known is not None:
            # Each still the object it was (then still where it was when the template was made: on the device)
            if all(map(operator.is_, map(_CALL, known[0]), objects)):
                self._templates.move_to_end(ids)  # the least recently used goes first past the bound
                return known[1]
            self._forget_template(ids)  # an object let go, its id another's now
        at = 0
        for count, _, _ in shape:  # each layer's parts after the layer itself
            for part in objects[at + 1:at + count]:
                if part is None or not (part.is_cuda or self.share_host):
                    return None
            at += count
        pickler = _Pickler(io.BytesIO(), self, first, self.share_host)
        pickler.dump([(layer, _without_step(inputs)) for layer, inputs in entries])
        key, self._next_key = self._next_key, self._next_key + 1
        first.append(("template", key, pickler.file.getvalue()))
        self.templates += 1
        self._templates[ids] = ([weakref.ref(obj) for obj in objects], key, frozenset(pickler.named))
        while len(self._templates) > TEMPLATES_KEPT:
            self._forget_template(next(iter(self._templates)))
        return key

    def _forget_template(self, ids: tuple) -> None:
        _, key, _ = self._templates.pop(ids)
        self._send(("forget", key))

    def _forget_named(self, key: int) -> None:
        """The child is told to forget a storage or layer: and the templates that name it."""
        for ids in [ids for ids, (_, _, named) in self._templates.items() if key in named]:
            self._forget_template(ids)

    def reference(self, tensor: Any, first: list) -> tuple:
        """A CUDA tensor as (key, offset, shape, stride, dtype) of a storage the child holds; its storage shared
        first (a ``share`` added to ``first``) when the child does not hold it yet, or holds a freed one at that
        address."""
        cached = self._refs.get(id(tensor))
        if cached is not None and cached[0]() is tensor:  # a staged view seen before: its storage is alive and held
            return cached[1]
        from torch.multiprocessing.reductions import StorageWeakRef

        storage = tensor.untyped_storage()
        known = self._shared.get(storage.data_ptr())
        if known is None or known[0].expired():  # new, or a freed storage's address taken by another
            if known is not None:
                self._send(("forget", known[1]))
                self._forget_named(known[1])
            key, self._next_key = self._next_key, self._next_key + 1
            whole = self._torch.empty(0, dtype=self._torch.uint8, device=tensor.device).set_(
                storage, 0, (storage.nbytes(),), (1,))
            from multiprocessing.reduction import ForkingPickler

            import torch.multiprocessing  # noqa: F401  (registers torch's CUDA IPC reductions with ForkingPickler)

            first.append(("share", key, bytes(ForkingPickler.dumps(whole))))
            self.shares += 1
            known = self._shared[storage.data_ptr()] = (StorageWeakRef(storage), key)
        ref = (known[1], tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), str(tensor.dtype)[6:])
        if len(self._refs) > REFS_KEPT:
            self._refs.clear()
        self._refs[id(tensor)] = (weakref.ref(tensor), ref)
        return ref

    def layer_key(self, layer: Any, first: list) -> int:
        """The key the child knows ``layer`` (a CaptureLayer) by: given to it once (a ``define`` added to
        ``first``), then named by its key, so a check carries its layers' constants (an engine layout, per-head
        values) once in the engine's life, not once a step."""
        known = self._layers.get(id(layer))
        if known is not None and known[0]() is layer:
            return known[1]
        if known is not None:  # a layer let go, its id another's now
            self._send(("forget", known[1]))
            self._forget_named(known[1])
        key, self._next_key = self._next_key, self._next_key + 1
        first.append(("define", key, pickle.dumps(layer, protocol=pickle.HIGHEST_PROTOCOL)))
        self.defines += 1
        self._layers[id(layer)] = (weakref.ref(layer), key)
        return key

    def alive(self) -> bool:
        return self._process.poll() is None

    def close(self, timeout: float = 5.0) -> None:
        """Ask the child to stop, and end it if it does not within ``timeout``."""
        try:
            self._send(("stop",))
        except (OSError, CheckerProcessError):
            pass
        try:
            self._conn.close()
        except OSError:
            pass
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, message: tuple) -> None:
        try:
            self._conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))
        except (OSError, ValueError) as exc:
            raise CheckerProcessError(f"the checker process (pid {self.pid}) is gone: {exc}") from None

    def _receive(self, seconds: float, what: str) -> Any:
        deadline = time.monotonic() + seconds
        try:
            while not self._conn.poll(0.5):  # the lock is let go while polling
                if self._process.poll() is not None:
                    raise self._exited(what)
                if time.monotonic() > deadline:
                    self._process.kill()
                    raise CheckerProcessError(f"the checker process (pid {self.pid}) took over {seconds:g} s {what}; "
                                              "it was ended")
            return pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):  # its end closed: it exited, or is exiting
            raise self._exited(what) from None

    def _exited(self, what: str) -> CheckerProcessError:
        try:
            code = self._process.wait(2.0)
        except subprocess.TimeoutExpired:
            return CheckerProcessError(f"the checker process (pid {self.pid}) closed its end of the socket")
        before = " before it was ready to start" if what == "to start" else ""
        return CheckerProcessError(f"the checker process (pid {self.pid}) exited with code {code}{before}")


def _child_environment() -> dict:
    """The engine's environment, with the child's torch on one thread (its check is launches, not arithmetic, and
    the engine's cores are the engine's)."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class _Pickler(pickle.Pickler):
    """Pickles a check's arguments with each CUDA tensor as a reference to a storage the child holds, and each host
    tensor as its bytes (torch's own pickling of a tensor saves its whole storage through torch.save, tens of
    microseconds each, under Python's lock). Through ``reducer_override``, which pickle does not call for plain ints,
    strings and containers, and whose results it memoizes: a tensor named twice travels once, and is one tensor in
    the child (the check groups layers by their tensors' identity)."""

    def __init__(self, file, owner: CheckerProcess, first: list, share_host: bool = False):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._owner, self._first, self._tensor, self._layer = owner, first, owner._torch.Tensor, _layer_class()
        self.file, self._shared = file, share_host  # host tensors as shared buffers too (a template's, on a CPU)
        self.named: set[int] = set()  # the storages' and layers' keys it named

    def reducer_override(self, obj: Any) -> Any:
        if obj.__class__ is self._layer:
            key = self._owner.layer_key(obj, self._first)
            self.named.add(key)
            return _defined, (key,)
        if not isinstance(obj, self._tensor):
            return NotImplemented
        if obj.is_cuda or self._shared:
            ref = self._owner.reference(obj, self._first)
            self.named.add(ref[0])
            return _from_storage, ref
        try:  # a step's metadata (integers): its bytes in order through numpy, one torch call
            data = obj.numpy().tobytes()
        except (TypeError, RuntimeError):  # a type numpy lacks (bfloat16), or a tensor that needs its gradient
            flat = obj.detach().contiguous().reshape(-1)
            data = flat.view(self._owner._torch.uint8).numpy().tobytes() if flat.numel() else b""
        return _from_host, (str(obj.dtype)[6:], tuple(obj.shape), data)


@functools.cache
def _layer_class() -> type:
    """:class:`kvdbg.capture.inputs.CaptureLayer`, imported once (not on every check)."""
    from kvdbg.capture.inputs import CaptureLayer

    return CaptureLayer


def _without_step(inputs: Any) -> Any:
    """A check's inputs less the step's own fields (a template's part: :meth:`CheckerProcess._template`)."""
    return dataclasses.replace(inputs, **dict.fromkeys(STEP_FIELDS))


def _from_storage(key: int, offset: int, shape: tuple, stride: tuple, dtype: str) -> Any:
    """A view of a storage shared with the checker process: only its :class:`_Loader` makes one (it resolves this
    name to its own method, whatever name the child's module runs under)."""
    raise pickle.UnpicklingError("a shared storage's view is read only by the checker process's loader")


def _defined(key: int) -> Any:
    """A layer given to the checker process before (:meth:`CheckerProcess.layer_key`): only its :class:`_Loader`
    reads one."""
    raise pickle.UnpicklingError("a defined layer is read only by the checker process's loader")


class _Loader(pickle.Unpickler):
    """The child's reading of a check: each :func:`_from_storage` reference becomes a view of a storage it holds,
    each :func:`_defined` key the layer it was given."""

    def __init__(self, data: bytes, storages: dict, layers: dict, device: Any):
        super().__init__(io.BytesIO(data))
        self._storages, self._layers, self._device = storages, layers, device

    def find_class(self, module: str, name: str) -> Any:
        if module.endswith("sentinel.remote"):
            if name == "_from_storage":
                return self._view
            if name == "_defined":
                return self._layer
        return super().find_class(module, name)

    def _layer(self, key: int) -> Any:
        layer = self._layers.get(key)
        if layer is None:
            raise pickle.UnpicklingError(f"layer {key} was never given to the checker process")
        if isinstance(layer, _Unreadable):
            raise pickle.UnpicklingError(f"layer {key} given to the checker process could not be read there "
                                         f"({layer.error})")
        return layer

    def _view(self, key: int, offset: int, shape: tuple, stride: tuple, dtype: str) -> Any:
        import torch

        storage = self._storages.get(key)
        if storage is None:
            raise pickle.UnpicklingError(f"storage {key} was never shared with the checker process")
        return torch.empty(0, dtype=getattr(torch, dtype), device=self._device).set_(storage, offset, shape, stride)


class _Unreadable:
    """In the child: a layer whose definition it could not read, and why (each check naming it answers so)."""

    def __init__(self, error: str):
        self.error = error


def _from_host(dtype: str, shape: tuple, data: bytes) -> Any:
    """In the child: a host tensor from its bytes."""
    import torch

    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _from_template(templates: dict, key: int, part: list) -> list:
    """In the child: a check's entries from the template ``key`` and each layer's ``STEP_FIELDS`` in ``part``."""
    template = templates.get(key)
    if template is None:
        raise ValueError(f"template {key} was never given to the checker process")
    if isinstance(template, _Unreadable):
        raise ValueError(f"template {key} given to the checker process could not be read there ({template.error})")
    return [(layer, dataclasses.replace(inputs, **dict(zip(STEP_FIELDS, fields))))
            for (layer, inputs), fields in zip(template, part)]


def reference_device(target: Any, reference: str) -> Any:
    """Where the child works out the reference of a check whose inputs lie on ``target`` (``check_layers``'
    ``reference_device``; None: there too). ``host`` for a CUDA device: the child's device work is then the
    check's picking of rows and pages, a few kernels in one burst, where the whole check on the device is some
    eighty small ones, each a turn of the time slices its context and the engine's take on the device."""
    import torch

    return torch.device("cpu") if target.type == "cuda" and reference == "host" else None


def serve(conn: Any, device: str, check_layers: Any, reference: str = "host", facts: dict | None = None) -> int:
    """The child's loop: answer the engine's messages until it stops or its end closes (``check_layers``: a check's
    results as its answer carries them, :func:`kvdbg.sentinel.checker.check_layers` in the compact form of
    :func:`kvdbg.sentinel.checker.compact`, handed in by :mod:`kvdbg.sentinel.child`, so that this module, which
    the checker imports, imports nothing of it). ``reference``: where a CUDA step's reference is worked out
    (``KVDBG_SENTINEL_REFERENCE``, :func:`reference_device`); ``facts``: told in the ready message besides the
    child's pid, torch and device (the child's scheduling)."""
    import torch
    import torch.multiprocessing  # noqa: F401  (the CUDA IPC rebuild functions)

    from kvdbg.util.background import confine_torch_to_this_thread

    confine_torch_to_this_thread()
    if device == "cpu":
        target = torch.device("cpu")
    else:
        target = torch.device("cuda", int(device))
        torch.cuda.set_device(target)
        torch.empty(1, device=target)  # the CUDA context, now rather than on the first check
    on = reference_device(target, reference)
    conn.send_bytes(pickle.dumps(("ready", {**(facts or {}), "pid": os.getpid(), "torch": torch.__version__,
                                            "device": str(target)})))
    # Messages are read as they come, also while a check runs: the engine's thread, which sends them, never waits
    # on a full socket (a step's host tables may be larger than its buffer).
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        while True:
            try:
                inbox.put(conn.recv_bytes())
            except (EOFError, OSError):
                inbox.put(None)
                return

    threading.Thread(target=read, name="kvdbg-checker-inbox", daemon=True).start()
    storages: dict = {}
    layers: dict = {}
    templates: dict = {}
    while True:
        data = inbox.get()
        if data is None:
            return 0
        message = pickle.loads(data)
        kind = message[0]
        if kind == "stop":
            return 0
        if kind == "share":
            storages[message[1]] = pickle.loads(message[2]).untyped_storage()
        elif kind == "define":
            try:
                layers[message[1]] = pickle.loads(message[2])
            except Exception as exc:  # its checks answer why
                layers[message[1]] = _Unreadable(f"{type(exc).__name__}: {exc}")
        elif kind == "template":
            try:
                templates[message[1]] = _Loader(message[2], storages, layers, target).load()
            except Exception as exc:  # its checks answer why
                templates[message[1]] = _Unreadable(f"{type(exc).__name__}: {exc}")
        elif kind == "forget":
            storages.pop(message[1], None)
            layers.pop(message[1], None)
            templates.pop(message[1], None)
        elif kind == "check":
            try:
                key, part, pairs, seed, step = _Loader(message[1], storages, layers, target).load()
                entries = part if key is None else _from_template(templates, key, part)
                answer = ("ok", check_layers(entries, pairs=pairs, rng=random.Random(seed), step=step,
                                             reference_device=on))
            except Exception as exc:  # the check's own failure, for the engine to report
                answer = ("error", f"{type(exc).__name__}: {exc}")
            if target.type == "cuda":  # no read of the engine's buffers left on the device once it answers
                torch.cuda.current_stream(target).synchronize()
            conn.send_bytes(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
