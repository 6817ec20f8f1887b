"""The sentinel inside the vLLM plugin: sampled steps are checked after the forward and captured when wrong.

:mod:`kvdbg.vllm_plugin` calls two hooks around each wrapped backend:

- before ``do_kv_cache_update`` of a sampled step, the step's new K/V and
  the pages they overwrite are saved (the capture path's cheap pre-update copy);
  on CUDA, the check of this layer's previous sampled step is collected here,
  before the update can change what it read;
- after ``forward``, :class:`kvdbg.sentinel.checker.Sentinel` checks the output (on CPU
  in the engine's thread, on CUDA in :class:`kvdbg.sentinel.checker.DeferredChecks`).

A wrong step that the sentinel admits (new signature, under its cap and
interval) is captured through the sentinel's own :class:`kvdbg.capture.capturer.Capturer`
(the background writer): the cache after the update with the saved pages
restored is the state the step started from. One warning names the file and
the first failing (request, head); at exit one line counts what was checked.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvdbg.capture.capturer import Capturer
from kvdbg.capture.config import ENV_DIR as ENV_CAPTURE_DIR
from kvdbg.capture.config import CaptureConfig
from kvdbg.sentinel.checker import DeferredChecks, PagesOfLengths, Sentinel, SentinelFinding, StepInputs
from kvdbg.vllm_plugin import vllm_facts

if TYPE_CHECKING:
    from kvdbg.capture.capturer import CaptureLayer, PreUpdate
    from kvdbg.capture.engine_layouts import EngineLayout

logger = logging.getLogger("kvdbg.sentinel")

_UNREAD = object()  # _staged_checks: no build context read yet (None is one: no build seen)

# How long shutdown waits for the check of a last sampled device step.
COLLECT_SECONDS = 5.0


@dataclass
class _Waiting:
    """A device step handed to the worker: what capturing it needs if it turns out wrong."""

    impl: Any
    layer: Any
    target: "CaptureLayer"
    kv_layout: "EngineLayout"
    ctx: Any
    pre: "PreUpdate | None"
    key: Any
    value: Any
    inputs: StepInputs  # query and output are the worker's copies
    step: int
    staged: Any = None  # graph_staging.StagedStep held for this check (its pages, query and output)
    cache: Any = None  # with staged: the engine's cache of the layer (its layout and size; nothing is read)
    job: Any = None  # a staged check's job in the worker (the step's sampled layers), collected whenever done
    index: int = 0  # this layer's entry in the job


class SentinelHooks:
    """The sentinel's state in one engine process: the sampler, its capturer, saved pages, device checks."""

    def __init__(self, sentinel: Sentinel, capturer: Capturer):
        self.sentinel = sentinel
        self.capturer = capturer
        self._pre: dict[str, "PreUpdate"] = {}
        self._waiting: dict[str, _Waiting] = {}
        self._staged: list[_Waiting] = []  # checks of staged graph steps, in the worker; polled, never waited for
        self._deferred: DeferredChecks | None = None
        self._pages_for: Any = None  # the staged step whose pages per request _pages holds (_staged_pages)
        self._pages: list[int] = []
        self._said: set[str] = set()
        self._closed = False
        atexit.register(self.close)

    @classmethod
    def from_env(cls, engine: str | None = None) -> "SentinelHooks":
        sentinel = Sentinel.from_env()
        # Its own capturer: no filters (the sentinel chooses the steps) and no count cap (the sentinel's
        # KVDBG_SENTINEL_MAX is), the background writer and byte budget of capture's defaults.
        config = CaptureConfig.from_env({**os.environ, ENV_CAPTURE_DIR: sentinel.config.directory})
        capturer = Capturer(config, layers=None, steps=None, ranks=None, max_snapshots=None, info_snapshot_lines=0,
                            engine=engine)
        return cls(sentinel, capturer)

    def describe(self) -> str:
        return self.sentinel.describe()

    # ---------------------------------------------------------------- hooks

    def before_cache_update(self, state, impl: Any, layer: Any, key, value, kv_cache, slot_mapping) -> None:
        try:
            name = getattr(layer, "layer_name", None)
            if name is None:
                return
            if self._staged:
                self.poll_staged(state)
            if self._waiting and name in self._waiting:
                self._collect(state, name)
            step = state._forward_counts.get(name, 0)  # the forward this update belongs to comes next
            if not self.sentinel.sampled(name, step):  # first: the cost of a step not drawn is this lookup
                return
            if key is None or value is None or slot_mapping is None or vllm_facts._graph_capturing(kv_cache) \
                    or name not in state._declared:  # no build yet (profiling, warm-up): no step to check
                return
            kv_layout = state.engine_layout(impl, layer, state._info(impl), kv_cache)
            if kv_layout is None:
                return
            target = state.capture_layer(impl, layer, kv_layout, getattr(layer, "dtype", key.dtype))
            slots, ready = state.host_slots(name, slot_mapping)
            pre = self.capturer.save_pre_update(target, key=key, value=value, slot_mapping=slots,
                                                kv_cache=kv_cache, step=step, check_written=True, ready=ready)
            if pre is not None:
                self._pre[name] = pre
        except Exception as exc:
            self._failed(exc, "before the cache update")

    def after_forward(self, state, impl: Any, layer: Any, query, key, value, kv_cache, metadata, output) -> None:
        try:
            name = getattr(layer, "layer_name", None)
            if metadata is None or name is None:
                return
            if self._waiting and name in self._waiting:  # a layer with no cache update of its own (KV sharing)
                self._collect(state, name)
            step = state._forward_counts.get(name, 0) - 1  # the plugin counted this forward before it ran
            if not self.sentinel.sampled(name, step):
                return
            pre = self._pre.pop(name, None)
            if pre is not None and pre.step != step:
                pre = None
            if vllm_facts._graph_capturing(query):
                return
            self._check(state, impl, layer, step, query, key, value, kv_cache, state._lookup(metadata), output, pre)
        except Exception as exc:
            self._failed(exc, "after the forward")

    def quiet_replay_ready(self, state) -> bool:
        """Before a replay told quiet ahead (graph_hooks.quiet_replay): whether it may go with nothing else of the
        sentinel's, that is no check reading the engine's memory is out (:meth:`before_graph_replay` collects those
        before the replay); the staged checks that are done are collected here."""
        if self._waiting:
            return False
        if self._staged:
            try:
                self.poll_staged(state)
            except Exception as exc:
                self._failed(exc, "before a CUDA graph's replay")
        return True

    def before_graph_replay(self, state, *, recording: bool = False) -> None:
        """A full CUDA graph is about to run a step: the checks of the previous one that read the engine's memory
        are collected first, while the cache still holds what that step read (the graph's cache update comes
        next); checks of staged steps read kvdbg's own copies and are only collected when done. Before vLLM
        records a graph (``recording``) every check is collected: the worker then makes no CUDA call while a
        stream captures."""
        if recording and self._deferred is None and self.sentinel.config.process:
            self._start_worker()
        if not self._waiting and not self._staged:  # nearly every step: no check out
            return
        try:
            for name in list(self._waiting):
                self._collect(state, name)
            if self._staged:
                self.poll_staged(state, wait=COLLECT_SECONDS if recording else None)
        except Exception as exc:
            self._failed(exc, "before a CUDA graph's replay")

    def _start_worker(self) -> None:
        """The device worker, and with it the checker process, made before vLLM records its first graph: the
        process's start (seconds: torch, kvdbg, a CUDA context) is then over before the engine serves, where a
        worker made at the first sampled step would check that step and those drawn while the process starts in
        its own thread."""
        try:
            import torch

            if torch.cuda.is_available():
                self._deferred = DeferredChecks(self.sentinel, torch.device("cuda", torch.cuda.current_device()))
        except Exception as exc:
            self._failed(exc, "starting its device worker")

    def checker_ready(self, timeout: float) -> bool:
        """Whether this engine's staged steps are checked in the sentinel's checker process, waiting up to
        ``timeout`` seconds for it (for harnesses that time or prove that path; False without a device worker)."""
        return self._deferred is not None and self._deferred.process_ready(timeout)

    def after_graph_replay(self, state, sampled: list, staged: Any = None) -> None:
        """The sampled layers of a step replayed from a full CUDA graph, ``(slot, step, ctx)`` each: checked from
        the graph's copies of their query and output (``graph_hooks``), with the metadata their build kept (None:
        no build seen); with ``staged``, from the step's copies staged on the device (``graph_staging``): query,
        output and pages, all the step's layers handed to the worker as one job."""
        if staged is not None:
            batch = self._staged_checks(state, sampled, staged)
            if batch:
                self._check_staged(state, batch, staged)
            return
        for slot, step, ctx in sampled:
            try:
                self._check(state, slot.impl, slot.layer, step, slot.query, None, None, slot.kv_cache, ctx,
                            slot.output, None)
            except Exception as exc:
                self._failed(exc, "after a CUDA graph's replay")

    def _staged_checks(self, state, sampled: list, staged: Any) -> list[_Waiting]:
        """A staged step's sampled layers as one job's entries, each holding the staging. What the layers share is
        read once per build context (a step is staged with one: graph_hooks), not once per layer: whether its
        mask can be checked, its lengths and offsets; the pages each request holds once per staged step. A
        layer's check is given no block table: its requests' staged pages lie one after another, ``max_pages[r]``
        of them for request r (:class:`kvdbg.sentinel.checker.StepInputs`)."""
        batch: list[_Waiting] = []
        shared, shared_for = None, _UNREAD
        for slot, step, ctx in sampled:
            try:
                if ctx is not shared_for:
                    shared_for, shared = _UNREAD, None  # kept only once read whole: a failure is met by each layer
                    causal = self._checkable(ctx)
                    if causal is not None:
                        # The build's host copies of the lengths and offsets where it made them (a device build's:
                        # the check reads them on the host, and a device tensor made for one step would be a new
                        # buffer for the checker process to open, every check); the job waits for their copies
                        # (DeferredChecks).
                        host = ctx.host
                        seq_lens, offsets = (ctx.seq_lens, ctx.query_start_loc) if host is None else \
                            (host.seq_lens, host.query_start_loc)
                        shared = (causal, seq_lens, offsets, ctx.max_model_len)
                    shared_for = ctx
                if shared is None:
                    continue
                layer = slot.layer
                checked = self._graph_layer(state, slot)
                if checked is None:
                    continue
                kv_layout, target = checked
                copies = staged.layers[layer.layer_name]
                causal, seq_lens, offsets, max_model_len = shared
                max_pages = self._staged_pages(staged)
                # The copies' whole buffers and the graph's rows of them: the same objects for every graph the
                # program stages, so the checker process is given them once per program (kvdbg.sentinel.remote's
                # templates), not once per batch size.
                query, output = copies.whole or (copies.query, copies.output)
                inputs = StepInputs(query=query, kv_cache=copies.pages, block_table=None, seq_lens=seq_lens,
                                    query_start_loc=offsets, causal=causal, output=output,
                                    max_model_len=max_model_len, max_pages=max_pages, stack=copies.stack,
                                    rows=staged.rows if copies.whole else None)
                waiting = _Waiting(slot.impl, layer, target, kv_layout, ctx, None, None, None, inputs, step,
                                   cache=slot.kv_cache)
                waiting.staged = staged.hold()  # last: nothing after it can fail and leave the staging held
                batch.append(waiting)
            except Exception as exc:
                self._failed(exc, "after a CUDA graph's replay")
        return batch

    def _graph_layer(self, state, slot: Any) -> tuple | None:
        """(cache layout, capture layer) of a graph's layer the sentinel can check (:meth:`_checked_layer`), or None:
        kept on the slot of the recorded graph (the same impl, layer and cache every replay) once worked out, so
        that a drawn step asks none of it again, layer by layer; asked again should what else decides it change (the
        layer's declaration, its quantisation scales, a refusal of its layout by capture), and while it is None."""
        layer = slot.layer
        name = layer.layer_name
        declared = state._declared.get(name)
        scales = (getattr(layer, "_q_scale_float", None), getattr(layer, "_k_scale_float", None),
                  getattr(layer, "_v_scale_float", None))
        known = slot.checked
        if known is not None and known[0] is declared and known[1] == scales:
            return None if state.capturer.layer_refused(name) is not None else known[2]
        checked = self._checked_layer(state, slot.impl, layer, slot.kv_cache, slot.output)
        slot.checked = None if checked is None else (declared, scales, checked)
        return checked

    def _check_staged(self, state, batch: list[_Waiting], staged: Any) -> None:
        """A staged step's sampled layers, checked together (:func:`kvdbg.sentinel.checker.check_layers`: alike
        layers make one reference problem): on CUDA as one job in the worker, collected whenever it is done;
        on a CPU now, unless a worker was given for the CPU (the bench's and tests' way into that path there). Each
        layer holds the staging until its check is collected."""
        cache = batch[0].cache
        if getattr(cache, "is_cuda", False) or (self._deferred is not None and self._deferred.device == cache.device):
            try:
                if self._deferred is None:
                    self._deferred = DeferredChecks(self.sentinel, batch[0].cache.device)
                copies = {id(w.ctx.host): w.ctx.host.ready for w in batch if w.ctx.host is not None}
                job = self._deferred.submit_staged([(w.target, w.inputs) for w in batch], batch[0].step,
                                                   staged.ready, host_ready=list(copies.values()))
            except Exception as exc:
                for waiting in batch:  # never handed over: nobody else would let the staging go
                    waiting.staged.release()
                self._failed(exc, "after a CUDA graph's replay")
                return
            for index, waiting in enumerate(batch):
                waiting.job, waiting.index = job, index
                self._staged.append(waiting)
            return
        try:
            results = self.sentinel.check_layers([(w.target, w.inputs) for w in batch], batch[0].step)
        except Exception as exc:
            results = []
            self._failed(exc, "after a CUDA graph's replay")
        try:
            for waiting, result in zip(batch, results):
                finding = result.finding()
                if finding is not None:
                    try:  # one layer's capture failing leaves the others' as they are
                        self._capture(state, finding, waiting)
                    except Exception as exc:
                        self._failed(exc, "capturing a wrong step")
        finally:
            for waiting in batch:
                waiting.staged.release()

    def poll_staged(self, state, wait: float | None = None) -> None:
        """Collect the checks of staged steps that are done (with ``wait``, every one, within that many seconds in
        all), capture those found wrong from their staged copies, and let their staging go."""
        deadline = None if wait is None else time.monotonic() + wait
        deferred = self._deferred
        if deferred is not None and deferred.remote_out:  # the checker process's jobs: sent and read from this thread
            deferred.poll_remote(wait)
        for waiting in list(self._staged):
            job = waiting.job
            if job is not None and not job.done.is_set():
                if deadline is None or not job.done.wait(max(0.0, deadline - time.monotonic())):
                    continue
            self._staged.remove(waiting)
            read = False  # whether the engine's thread read the staging (a capture's copies, on its stream)
            try:
                if job is None or job.error is not None:
                    self._failed(job.error if job is not None else RuntimeError("no check"), "in the device check")
                    continue
                result = job.results[waiting.index]
                self.sentinel.record(result)
                finding = result.finding()
                if finding is not None:
                    read = True  # (kept should the capture raise midway)
                    read = self._capture(state, finding, waiting)
            finally:
                # A done job's reads are done on the device (the worker synchronises its stream, the checker process
                # its context, before the job is done): only a capture's copies, queued on the engine's stream, need
                # the next staging to wait for them (an event per layer, made and recorded on this thread).
                waiting.staged.release(issued=read)

    def _check(self, state, impl: Any, layer: Any, step: int, query, key, value, kv_cache, ctx, output,
               pre: "PreUpdate | None") -> None:
        """Check one sampled step of a layer (on CPU now; on CUDA in the worker, collected later) and capture it if
        wrong."""
        causal = self._checkable(ctx)
        if causal is None:
            return
        checked = self._checked_layer(state, impl, layer, kv_cache, output)
        if checked is None:
            return
        kv_layout, target = checked
        inputs = StepInputs(query=query, kv_cache=kv_cache, block_table=ctx.block_table, seq_lens=ctx.seq_lens,
                            query_start_loc=ctx.query_start_loc, causal=causal, output=output,
                            max_model_len=ctx.max_model_len)
        if getattr(kv_cache, "is_cuda", False):
            if self._deferred is None:
                self._deferred = DeferredChecks(self.sentinel, kv_cache.device)
            kept = self._deferred.submit(target, inputs, step)
            self._waiting[layer.layer_name] = _Waiting(impl, layer, target, kv_layout, ctx, pre, key, value, kept,
                                                       step)
            return
        result = self.sentinel.check(target, inputs, step)
        finding = result.finding()
        if finding is not None:
            self._capture(state, finding, _Waiting(impl, layer, target, kv_layout, ctx, pre, key, value, inputs,
                                                   step))

    def _checkable(self, ctx: Any) -> bool | None:
        """The mask of the step a build context describes (causal or not), or None when the step is not checked:
        no wrapped builder built it, the snapshot could not hold its mask, or its requests mix both masks (each
        said once)."""
        if ctx is None:
            self._say_once("metadata", "kvdbg sentinel: a sampled step's metadata was not built by a wrapped "
                           "builder; such steps are not checked")
            return None
        if ctx.refused is not None:  # a mask the reference cannot be given either (capture says it once)
            self._say_once(f"refused:{ctx.refused.split(' ')[0]}", f"kvdbg sentinel: steps whose mask a "
                           f"snapshot cannot hold are not checked ({ctx.refused})")
            return None
        causal = _causal(ctx.causal)
        if causal is None:
            self._say_once("causal", "kvdbg sentinel: a batch mixing causal and non-causal requests is not "
                           "checked")
        return causal

    def _checked_layer(self, state, impl: Any, layer: Any, kv_cache: Any, output: Any) -> tuple | None:
        """(cache layout, capture layer) of a layer the sentinel can check, or None (why is said once: by the
        plugin for a cache layout it refuses, by the sentinel for a layer or backend its reference cannot model)."""
        info = state._info(impl)
        kv_layout = state.engine_layout(impl, layer, info, kv_cache)
        if kv_layout is None:
            return None
        target = state.capture_layer(impl, layer, kv_layout, output.dtype)
        if not self.sentinel.can_check(target, info.backend_name if info else None):
            return None
        return kv_layout, target

    def _staged_pages(self, staged: Any) -> "list[int] | PagesOfLengths":
        """The pages each request of a staged step holds, one list made once for all its layers (their checks then
        share it, as :func:`kvdbg.sentinel.checker.check_layers` asks). For a step staged inside vLLM's graph, whose
        device counted them from the lengths it read, what the check works them out from once the lengths are on the
        host (:class:`~kvdbg.sentinel.checker.PagesOfLengths`): reading the count back here would make the engine's
        thread wait for the graph's work."""
        if self._pages_for is not staged:
            if staged.count < 0:
                program = staged.program
                self._pages = PagesOfLengths(program.page_size, program.width, program.size)
            else:
                staged.sized()
                self._pages = staged.counts.tolist()
            self._pages_for = staged
        return self._pages

    # ---------------------------------------------------------------- capture

    def _collect(self, state, name: str, timeout: float | None = None) -> None:
        waiting = self._waiting.pop(name)
        job = self._deferred.collect(name, timeout) if self._deferred is not None else None
        if job is None or not job.done.is_set():
            self.sentinel.counts["errors"] += 1
            return
        if job.error is not None:
            self._failed(job.error, "in the device check")
            return
        self.sentinel.record(job.result)
        finding = job.result.finding()
        if finding is not None:
            self._capture(state, finding, waiting)

    def _capture(self, state, finding: SentinelFinding, w: _Waiting) -> bool:
        """Capture a wrong step (when the sentinel admits its finding); whether its copies were begun (a staged step's
        staging was read then: its next use waits for them)."""
        if not self.sentinel.admit(finding):
            logger.debug("kvdbg sentinel: %s step %s is wrong again (%s); not captured", w.target.name, w.step,
                         finding.kind)
            return False
        cache = w.inputs.kv_cache if w.staged is None else w.cache
        step_inputs = w.inputs.cut()  # a staged step's whole buffers: the graph's rows of them are the step's
        query, output = step_inputs.query, step_inputs.output
        backend, tensors, provenance = state.step_capture(w.impl, w.ctx, query, w.key, w.value,
                                                          cache, w.pre, w.layer, w.kv_layout)
        if w.staged is not None:  # the pages from the step's staged copy, by engine page id
            tensors.staged = w.staged.pages_for(w.target.name)
        provenance["captured_by"] = f"the sentinel ({finding.kind})"
        pending = self.capturer.begin(w.target, backend, tensors, step=w.step, info=provenance,
                                      notes=finding.text())
        if pending is None:
            self._announce(finding, None)
            return True  # begun and given up: it may have issued copies before it was
        self.capturer.finish(pending, output, on_written=lambda path: self._announce(finding, path))
        return True

    def _announce(self, finding: SentinelFinding, path: str | None) -> None:
        request, head = finding.first
        r = finding.result
        what = "NaN/inf in the output" if finding.kind == "nonfinite" else "output disagrees with the exact reference"
        where = f"snapshot {path}" if path else "its snapshot was not written (see the capture line above)"
        logger.warning("kvdbg sentinel: layer %s step %s is wrong (%s): first failing request %d head %d; %s",
                       r.layer, r.step, what, request, head, where)

    # ---------------------------------------------------------------- failures and the end

    def _failed(self, exc: BaseException, where: str) -> None:
        self.sentinel.counts["errors"] += 1
        self._say_once(f"error:{type(exc).__name__}", f"kvdbg sentinel: a check failed {where}: {exc} (further "
                       "failures of this kind are counted in the exit line)", level=logging.WARNING)

    def _say_once(self, key: str, message: str, level: int = logging.INFO) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.log(level, "%s", message)

    def close(self, state=None, timeout: float = COLLECT_SECONDS) -> None:
        """Collect the device checks still out, let the writer drain, and say the one exit line: all of it
        within ``timeout`` seconds (a check not back by then is counted as an error)."""
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + timeout
        try:
            for name in list(self._waiting):
                if state is not None:
                    self._collect(state, name, max(0.0, deadline - time.monotonic()))
                else:
                    self._waiting.pop(name)
            if self._staged:
                if state is not None:
                    self.poll_staged(state, wait=max(0.0, deadline - time.monotonic()))
                self.sentinel.counts["errors"] += len(self._staged)  # not back in time, or no state to capture
                self._staged.clear()
            if self._deferred is not None:  # its checker process told to stop (a failure there is no reason to
                try:                            # leave the exit line unsaid)
                    self._deferred.close(max(0.0, min(5.0, deadline - time.monotonic())))
                except Exception as exc:
                    logger.debug("kvdbg sentinel: stopping its checker process failed: %s", exc)
            self.capturer.close(max(0.0, deadline - time.monotonic()))
            c = self.sentinel.counts
            level = logging.WARNING if c["failed"] or c["errors"] else logging.INFO
            logger.log(level, "%s", self.sentinel.summary())
        except Exception as exc:  # shutting down goes on whatever happens here
            logger.debug("kvdbg sentinel: closing failed: %s", exc)


def _causal(flag: Any) -> bool | None:
    """The batch's mask as one bool; None when a per-request tensor mixes both."""
    if hasattr(flag, "numel"):
        values = {bool(v) for v in flag.reshape(-1).tolist()}
        return values.pop() if len(values) == 1 else None
    return bool(flag)


__all__ = ["SentinelHooks"]
