"""Every layer's step: copy what the cache update will overwrite and the K/V it writes, hand the step
to the capturer before the forward runs, and its output after."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from kvdbg.vllm_plugin import vllm_facts
from kvdbg.vllm_plugin.graph_hooks import GraphSlot
from kvdbg.vllm_plugin.records import _EngineContext

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    from kvdbg.capture.capturer import CaptureBackend, PendingCapture, PreUpdate, StepTensors
    from kvdbg.capture.engine_layouts import EngineLayout

logger = logging.getLogger("kvdbg.capture")


class StepHooks:
    """The plugin state's hooks in ``do_kv_cache_update`` and ``forward`` (mixed into ``_PluginState``)."""

    # ---------------------------------------------------------------- cache update

    def before_cache_update(self, impl: Any, layer: Any, key, value, kv_cache, slot_mapping) -> bool:
        """Copy what the update will overwrite, and the K/V it writes; whether it copied them.

        The writer later reads the written slots back from the pages the forward's
        capture copies (after the update): a layer whose cache does not hold the K/V
        it was given is refused from then on, in one line. Its layout was declared
        wrongly, or its backend stores its content otherwise, and what kvdbg would
        store would be wrong.
        """
        try:
            if key is None or value is None or slot_mapping is None:
                return False
            name = getattr(layer, "layer_name", None)
            if name is None:
                return False
            if name not in self._declared:
                # No build has declared this layer yet: a run vLLM makes before serving (profiling, warm-up)
                # writes the cache with no metadata built, and its forward cannot be captured anyway.
                return False
            step = self._forward_counts.get(name, 0)  # the forward this update belongs to comes next
            if vllm_facts._graph_capturing(kv_cache):  # the forward records what the graph's steps need
                if self._recording is None and not self._recording_plain and self.capturer.layer_selected(name):
                    self.note_graph_recording(name)
                return False
            if not self.capturer.wants(name, step):
                return False
            kv_layout = self.engine_layout(impl, layer, self._info(impl), kv_cache)
            if kv_layout is None:
                self.capturer.skip(name, step)
                return False
            # The forward's rule for the model dtype, without its output buffer.
            target = self.capture_layer(impl, layer, kv_layout, getattr(layer, "dtype", key.dtype))
            slots, ready = self.host_slots(name, slot_mapping)
            pre = self.capturer.save_pre_update(target, key=key, value=value, slot_mapping=slots,
                                                kv_cache=kv_cache, step=step, check_written=True, ready=ready)
            if pre is None:
                return False
            self._pre_updates[name] = pre
            return True
        except Exception as exc:
            self.capturer.report(exc, f"{type(impl).__name__}.do_kv_cache_update")
            return False

    # ---------------------------------------------------------------- forward

    def before_forward(self, impl: Any, layer: Any, query, key, value, kv_cache, metadata, output) -> "PendingCapture | None":
        try:
            # Profiling runs carry no metadata. With capture off, wants() below still counts a step the
            # filters select as dropped, for the exit line.
            if metadata is None:
                return None
            name = getattr(layer, "layer_name", None)
            if name is None:
                return None
            if vllm_facts._graph_capturing(query):
                return self.record_in_graph(impl, layer, query, kv_cache, output)
            step = self._forward_counts.get(name, 0)
            self._forward_counts[name] = step + 1
            self._counts_epoch += 1
            if self._lent or self._worker_lent is not None:  # a layer's forward in Python: no quiet run's replay
                # goes on (graph_hooks._lend_builders)
                self._take_builders_back()
            pre = self._pre_updates.pop(name, None)
            if pre is not None and pre.step != step:
                pre = None
            if not self.capturer.wants(name, step):
                return None
            ctx = self._lookup(metadata)
            if ctx is None:
                ctx = (f"the {type(metadata).__name__} it received was not returned by a wrapped builder's build(), "
                       "so the engine-level metadata is unknown")
            model_dtype = output.dtype if output is not None else layer.dtype
            return self.start_capture(impl, layer, step, query, key, value, kv_cache, ctx, pre, model_dtype)
        except Exception as exc:
            self.capturer.report(exc, f"{type(impl).__name__}.forward", step_lost=True)
            return None

    def start_capture(self, impl: Any, layer: Any, step: int, query, key, value, kv_cache,
                      ctx: "_EngineContext | str", pre: "PreUpdate | None", model_dtype,
                      notes: str = "", staged: Any = None, copies: Any = None) -> "PendingCapture | None":
        """Begin capturing a step the filters want: its layout, its metadata (``ctx``, or why it is unknown),
        its copies. From a forward, or from the buffers a CUDA graph's replay wrote (``graph_hooks``); with
        ``staged``, the pages are read from their copy staged on the device (``graph_staging``); ``copies``: the
        step's host copies already issued (kvdbg.capture.buffers.StepCopies.ahead), taken over."""
        from kvdbg.capture.capturer import CaptureInputError

        if isinstance(ctx, str):  # the step's metadata is unknown: the step is lost, not the layer
            raise CaptureInputError(ctx)
        if ctx.deferred is not None:  # a step guessed to be a graph's runs eagerly: its build's copies now
            self.resolve(ctx)
        name = layer.layer_name
        kv_layout = self.engine_layout(impl, layer, self._info(impl), kv_cache)
        if kv_layout is None:
            self.capturer.skip(name, step)
            return None
        if ctx.refused is not None:
            self.capturer.failures["step:mask"] += 1
            self._say_refused(f"{ctx.builder} built a batch whose mask a snapshot cannot hold: {ctx.refused}; "
                              "such steps are not captured", key=f"step:{ctx.refused.split(' ')[0]}")
            self.capturer.skip(name, step)
            return None
        if ctx.max_model_len is None:
            raise CaptureInputError(f"{ctx.builder} has no vllm_config.model_config.max_model_len")
        target = self.capture_layer(impl, layer, kv_layout, model_dtype)
        backend, tensors, provenance = self.step_capture(impl, ctx, query, key, value, kv_cache, pre, layer,
                                                         kv_layout)
        tensors.staged, tensors.copies = staged, copies
        return self.capturer.begin(target, backend, tensors, step=step, info=provenance, notes=notes)

    def step_capture(self, impl: Any, ctx: _EngineContext, query, key, value, kv_cache, pre: "PreUpdate | None",
                     layer: Any, kv_layout: "EngineLayout") -> tuple["CaptureBackend", "StepTensors", dict[str, Any]]:
        """What :meth:`Capturer.begin` takes for one step: the backend's settings, the tensors, the provenance.

        The settings and the provenance are the same on every step of a layer (but for how its new K/V were
        taken), so they are made once per layer and builder and shared, read-only, by its snapshots.
        """
        from kvdbg.capture.capturer import StepTensors

        info = self._info(impl)
        # The context's tensors are the copies after_build made: capture keeps them without copying again
        # (on a device, its host copies, read once the build's event is passed).
        host = ctx.host
        meta = ctx if host is None else host
        tensors = StepTensors(query=query, kv_cache=kv_cache, block_table=meta.block_table, seq_lens=meta.seq_lens,
                              query_start_loc=meta.query_start_loc, causal=meta.causal, pre_update=pre,
                              metadata_copied=True, metadata_ready=None if host is None else host.ready)
        if pre is not None:
            how = "pre"
        elif info is not None and info.update_in_forward and key is not None and meta.slot_mapping is not None:
            tensors.key, tensors.value, tensors.slot_mapping = key, value, meta.slot_mapping
            how = "forward"
        else:
            how = "absent"
        name = layer.layer_name
        cache_key = (ctx.facts, info, kv_layout, how, id(self._declared.get(name)), self._parallel is None)
        cached = self._step_constants.get(name)
        if cached is None or cached[0] != cache_key:
            cached = self._step_constants[name] = (cache_key, *self._step_constants_for(impl, ctx, info, layer,
                                                                                          kv_layout, how))
        return cached[1], tensors, cached[2]

    def after_forward(self, pending: "PendingCapture | GraphSlot", output, result) -> None:
        try:
            if type(pending) is GraphSlot:  # a graph is being recorded: its copy of the output
                self.record_graph_output(pending, output if output is not None else result)
                return
            self.capturer.finish(pending, output if output is not None else result)
        except Exception as exc:  # finish does not raise; this guards the engine against a kvdbg bug anyway
            self.capturer.report(exc, "after forward", step_lost=True)
