"""Steps run as full CUDA graphs: what the graph must copy for capture, recorded into it, and the capture
itself once vLLM has replayed it.

A replayed graph runs no Python, so the per-layer hooks of ``step_hooks`` never see its steps. Two things
still do: the metadata builder (vLLM builds every step in Python, graphs or not, so ``builder_hooks`` keeps
the step's block table, lengths and query offsets as for any step) and vLLM's ``CUDAGraphWrapper.__call__``
(once per step, wrapped here). So:

- **while a graph is recorded** (once per batch size, at start-up), each attention layer's forward is also
  recorded copying its query and its output into buffers of the plugin's (one per layer, as large as the
  largest graph, allocated while the first graph is recorded, from the graph's pool). The copies run at
  every replay: a few hundred kilobytes of device-to-device copies per layer, no Python. They are recorded
  only for the layers capture's or the sentinel's filter selects; the writer holds its device work meanwhile
  (:meth:`~kvdbg.capture.writer.CaptureWriter.held_writer`: CUDA forbids, process-wide, what it does while a
  stream captures), and the sentinel's device checks still out (vLLM's warm-up steps just before) are collected
  before the recording starts, for the same reason;
- **after each replay**, the selected layers' steps are counted as if their forwards had run; for a step the filters
  want, the capture is begun from those buffers and the layer's cache (it lives outside the graph), with the
  metadata its build kept, and finished at once. Its copies are queued on the engine's stream after the
  graph's work and before the next step's: nothing the next step overwrites is read late. A step the
  sentinel samples is checked from the same buffers (its layer filter also chooses which layers get them);
  its device checks of a step are collected before the next replay, while the cache holds what it read.

Padding rows of a graph's batch (vLLM pads a batch up to the graph's size with requests of no tokens on the
null block) are not requests: the builder hook keeps only the rows with tokens, and the query rows past the
step's tokens are not stored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("kvdbg.capture")

# Where vLLM defines the wrapper that records and replays its CUDA graphs.
GRAPH_WRAPPER = ("vllm.compilation.cuda_graph", "CUDAGraphWrapper")


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


class _GraphBuffers:
    """A layer's buffers for its query and output: one each, rows for the largest graph; views per graph."""

    __slots__ = ("query", "output")

    def __init__(self, query: "torch.Tensor", output: "torch.Tensor | None" = None):
        self.query, self.output = query, output


class GraphHooks:
    """The plugin state's hooks for full CUDA graphs (mixed into ``_PluginState``)."""

    # ---------------------------------------------------------------- what a graph call is

    def graph_call(self, wrapper: Any) -> tuple[str, Any] | None:
        """What this call of vLLM's graph wrapper does, with the graph's batch descriptor (its key: a full graph
        of N tokens for uniform decode batches and one for mixed batches are two graphs): ``"record"`` a full
        graph (attention inside), ``"record_pieces"`` a piecewise one (attention runs in Python between its
        pieces, also while they record), ``"replay"`` a full one; None: no graph, or piecewise pieces replayed."""
        try:
            context = self._forward_context
            if context is None:
                from vllm.forward_context import get_forward_context, is_forward_context_available

                context = self._forward_context = (is_forward_context_available, get_forward_context)
            available, get = context
            if not available():
                return None
            forward = get()
            mode = forward.cudagraph_runtime_mode
            if mode is None or mode != wrapper.runtime_mode or getattr(mode, "name", "") == "NONE":
                return None
            batch = forward.batch_descriptor
            if batch is None:
                return None
            full = getattr(mode, "name", "") == "FULL"
            entry = wrapper.concrete_cudagraph_entries.get(batch)
            if entry is None or entry.cudagraph is None:
                return ("record" if full else "record_pieces"), batch
            return ("replay", batch) if full else None
        except Exception as exc:  # an unknown vLLM: say it once, capture what eager steps show
            self.capturer.report(exc, "CUDAGraphWrapper.__call__")
            return None

    def begin_graph_recording(self, batch: Any) -> None:
        """A full graph for ``batch`` (vLLM's batch descriptor) is about to be recorded: its selected layers are
        learnt anew."""
        self._graph_layers[batch] = []
        self._recording = batch

    def end_graph_recording(self) -> None:
        self._recording = None

    # ---------------------------------------------------------------- recording (inside the graph)

    def record_in_graph(self, impl: Any, layer: Any, query, kv_cache, output) -> GraphSlot | None:
        """Called for a layer's forward while a graph records: note the layer's place in the graph and, for a
        layer capture selects, record the copy of its query (the output's follows the forward)."""
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
        if buffers.output is None or buffers.output.shape[0] < rows or buffers.output.shape[1:] != output.shape[1:] \
                or buffers.output.dtype != output.dtype:
            size = max(rows, buffers.query.shape[0])
            buffers.output = output.new_empty((size, *output.shape[1:]))
        buffers.output[:rows].copy_(output[:rows])
        slot.output = buffers.output[:rows]

    # ---------------------------------------------------------------- after a replay

    def before_graph_replay(self) -> None:
        """A full graph is about to run a step: the sentinel collects its checks of the step before."""
        if self.sentinel is not None:
            self.sentinel.before_graph_replay(self)

    def after_graph_replay(self, batch: Any) -> bool:
        """The full graph for ``batch`` was replayed (its work is queued): count its selected layers' forwards (on
        every step, so only theirs), capture the steps wanted and hand the sentinel those it samples. Whether
        anything was copied for a capture."""
        slots = self._graph_layers.get(batch)
        if not slots:
            return False
        counts = self._forward_counts
        copied = False
        for slot in slots:
            name = slot.name
            step = counts.get(name, 0)
            counts[name] = step + 1
            built = self._graph_builds.get(name)
            ctx = built[1] if built is not None and built[0] == step else None
            if self.sentinel is not None and self.sentinel.sentinel.sampled(name, step):
                self.sentinel.after_graph_replay(self, slot, ctx, step)
            if not self.capturer.wants(name, step):
                continue
            try:
                if ctx is None:
                    from kvdbg.capture.capturer import CaptureInputError

                    raise CaptureInputError("no build of the metadata builder was seen for this step of a CUDA "
                                            "graph, so the step's block table and lengths are unknown")
                pending = self.start_capture(slot.impl, slot.layer, step, slot.query, None, None, slot.kv_cache,
                                             ctx, None, slot.output.dtype if slot.output is not None
                                             else slot.layer.dtype,
                                             notes=f"replayed from a full CUDA graph of {batch.num_tokens} "
                                                   "tokens")
                if pending is not None:
                    self.capturer.finish(pending, slot.output)
                    copied = True
            except Exception as exc:
                self.capturer.report(exc, "after a CUDA graph's replay", step_lost=True)
        return copied
