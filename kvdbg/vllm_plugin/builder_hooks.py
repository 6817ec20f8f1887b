"""Every build of the metadata builder: keep the step's engine-level metadata (host copies for capture,
device clones for the sentinel) for the forwards of its layers, and decide there whether a step is wanted.

A wanted build that a full CUDA graph will likely replay (its padded tokens and rows are a recorded full
graph's: vLLM pads only such a batch), and whose metadata staging will likely copy, copies nothing: its
context keeps the runner's buffers (:class:`~kvdbg.vllm_plugin.records._Deferred`); the staging program,
launched by the engine's thread right after the replay, copies them on the device as the graph read them
(``graph_staging``), and the graph capture thread reads them back. Should the step run eagerly after all,
its first hook (the cache update's, else the forward's) makes the build's copies then; should staging not
serve it, the engine's thread makes them right after the replay: either way before anything of the step is
read and before the runner's next step rewrites its buffers."""

from __future__ import annotations

import logging
from itertools import repeat
from typing import Any

from kvdbg.vllm_plugin import vllm_facts
from kvdbg.vllm_plugin.records import _EngineContext, _HostMetadata, _builder_facts, deferred_context
from kvdbg.vllm_plugin.vllm_facts import (
    _ENGINE_ATTR, _HOST_SLOTS_KEPT, _SIDE_TABLE_SIZE, _parallel_facts, _requests_with_tokens, _rows,
    _step_refusal, _tensor_key
)

logger = logging.getLogger("kvdbg.capture")


_STAGE_HINT: Any = None


def _stage_hint() -> Any:
    """graph_staging.stage_hint, imported once (an import statement in a hook is a lookup on every build)."""
    global _STAGE_HINT
    if _STAGE_HINT is None:
        from kvdbg.vllm_plugin.graph_staging import stage_hint

        _STAGE_HINT = stage_hint
    return _STAGE_HINT


class BuilderHooks:
    """The plugin state's hooks in ``builder.build`` (mixed into ``_PluginState``)."""

    # ---------------------------------------------------------------- builder

    def after_build(self, builder: Any, common: Any, metadata: Any) -> bool:
        """Keep copies of the step's metadata for the forwards of its layers; whether it did for a capture
        (not only for the sentinel)."""
        try:
            run = self._quiet_run
            if run is not None and run.epoch == self._counts_epoch and run.config is self.capturer.config \
                    and self._pending_build is None and common is not None:
                if run.step < run.horizon:
                    # A step of a quiet run (below) for a builder told before (its layers' declarations noted
                    # then): what every build keeps, nothing more.
                    known = self._quiet_builders.get(id(builder))
                    if known is not None and known[2] and known[0] is run.names and known[1] is run.config \
                            and metadata is not None:
                        self._prepared = None
                        self._last_builds[id(builder)] = (builder, common)
                        if self._host_slots and common.slot_mapping is not None:
                            self._host_slots.pop(common.slot_mapping.data_ptr(), None)
                        return False
                elif run.step == run.taken and self._tickets and self.sentinel is None and metadata is not None:
                    # The step the quiet run stopped at because capture's filters take it, nothing counted since its
                    # last replay: every layer of its graph is at its step, which the filters take. Told on its
                    # shape's ticket here, by this hook's own lines (_on_ticket's, the builder's selected layers
                    # those the ticket was last found to hold under the run's configuration): a wanted step is rare,
                    # so whatever it calls or reads is likely out of the processor's caches.
                    ticket = self._tickets.get((id(builder), common.num_actual_tokens, common.num_reqs))
                    if ticket is not None and ticket.builder is builder and ticket.covers \
                            and ticket.names is run.names and ticket.told is run.config \
                            and 0 < common.max_seq_len <= ticket.max_seq_len and common.causal.__class__ is bool \
                            and self.capturer.takes_all(len(ticket.selected)):
                        self._prepared = None
                        self._last_builds[id(builder)] = (builder, common)
                        if self._host_slots and common.slot_mapping is not None:
                            self._host_slots.pop(common.slot_mapping.data_ptr(), None)
                        self._pending_build = (ticket, builder, common, metadata, run.step, self._counts_epoch,
                                               run.config)
                        return True
            if self._pending_build is not None:  # an earlier build kept on a ticket that no hook read: kept now
                self._settle_build()
            self._prepared = None  # only the latest build tells the next choice of graph (see below)
            if metadata is None or common is None or (not self.capturer.active and self.sentinel is None):
                return False
            tickets = self._tickets
            if tickets and self.sentinel is None:
                # A step of a shape whose wanted step the staged graph served before: nothing kept now. The graph's
                # call (ticket_replay, or the choice of graph) hands it to the capture thread whole, or it is kept
                # as below (_settle_build) for whatever reads it otherwise. Told first, with the fewest calls.
                ticket = tickets.get((id(builder), common.num_actual_tokens, common.num_reqs))
                if ticket is not None and ticket.builder is builder and self._on_ticket(ticket, builder, common,
                                                                                         metadata):
                    return True
            self.declare(builder)
            # The buffers a full graph recorded next reads (vLLM builds its dummy batch just before recording it):
            # the graph's staged variant reads them too (graph_hooks.record_staged_graph).
            self._last_builds[id(builder)] = (builder, common)
            slot_mapping = common.slot_mapping
            if self._host_slots and slot_mapping is not None:
                # This build's buffer may be an earlier build's (runners reuse theirs): never read a stale copy.
                self._host_slots.pop(slot_mapping.data_ptr(), None)
            run = self._quiet_run
            if run is not None and run.epoch == self._counts_epoch and run.step < run.horizon \
                    and run.config is self.capturer.config:
                # A step of a run of a graph's replays that nothing can want (graph_hooks._QuietRun), told ahead: no
                # count moved since the run's last replay, so this builder's layers are at its step.
                known = self._quiet_builders.get(id(builder))
                if known is None or known[0] is not run.names or known[1] is not run.config:
                    known = self._quiet_builder(builder, run)
                if known[2]:
                    return False
            names = self._selected_layers(builder)
            # The step each layer's next forward will be: nothing is kept for a build no capture will use. Most
            # builds of an armed engine are of steps the step filter excludes, told by one search for every layer.
            counts = self._forward_counts
            lo = hi = None
            if names is None:
                for_capture = True
            elif not names:
                for_capture = False
            else:
                steps = list(map(counts.get, names, repeat(0)))
                lo, hi = min(steps), max(steps)
                if lo == hi:  # the usual case: the selected layers all at one step, told with one check
                    for_capture = self.capturer.selects_step(lo)
                    if for_capture and self._tickets and self.sentinel is None:
                        # A ticketed build the check above could not tell (the first after new filters: the layers
                        # kept per configuration only now made again), told the same way.
                        ticket = self._tickets.get((id(builder), common.num_actual_tokens, common.num_reqs))
                        if ticket is not None and ticket.builder is builder \
                                and self._on_ticket(ticket, builder, common, metadata):
                            return True
                else:
                    for_capture = not self.capturer.takes_no_step(lo, hi) and any(
                        self.capturer.selects(n, step) for n, step in zip(names, steps))
            if not for_capture and not self._sentinel_checks(builder):
                return False
            return self._keep_build(builder, common, metadata, names, lo, hi, self._counts_epoch,
                                    self.capturer.config) and for_capture
        except Exception as exc:
            self.capturer.report(exc, f"{type(builder).__name__}.build")
            return False

    def _on_ticket(self, ticket: Any, builder: Any, common: Any, metadata: Any) -> bool:
        """The build of a step its shape's ``ticket`` serves, kept on it (``_pending_build``) when capture wants every
        layer of the ticket at one step: the same layers selected (the list :meth:`_selected_layers` keeps per
        configuration), the lengths within the staged pages' reach, one causal flag. False: asked as any build.
        (A quiet run's end, whose step capture's filters take, is told in after_build's own lines.)"""
        capturer = self.capturer
        config = capturer.config
        names = ticket.selected
        hit = self._builder_layers.get(id(builder))
        if hit is None or hit[0] is not config or hit[2] is not names or hit[1] is not getattr(builder, "layer_names",
                                                                                                None) \
                or not 0 < common.max_seq_len <= ticket.max_seq_len or common.causal.__class__ is not bool:
            return False
        ticket.told = config
        steps = list(map(self._forward_counts.get, names, repeat(0)))
        lo = min(steps)
        if lo != max(steps) or not capturer.wants_all(len(names), lo):
            return False
        self._last_builds[id(builder)] = (builder, common)
        if self._host_slots and common.slot_mapping is not None:
            self._host_slots.pop(common.slot_mapping.data_ptr(), None)
        self._pending_build = (ticket, builder, common, metadata, lo, self._counts_epoch, config)
        return True

    def _quiet_builder(self, builder: Any, run: Any) -> tuple:
        """(the run's layer names, capture's configuration, whether every layer of the builder that capture selects
        or the sentinel checks is one of the run's graph's), kept per builder."""
        layers = set(run.names)
        selected = self._selected_layers(builder)
        covered = selected is not None and layers.issuperset(selected)
        if covered and self.sentinel is not None:
            sentinel = self.sentinel.sentinel
            covered = layers.issuperset(n for n in getattr(builder, "layer_names", None) or ()
                                        if sentinel.layer_selected(n))
        known = self._quiet_builders[id(builder)] = (run.names, run.config, covered)
        return known

    def _settle_build(self) -> None:
        """The build kept on a ticket (``_pending_build``: see after_build), kept now as any other build is, for a
        hook that reads it other than the staged graph's hand-over (an eager forward, a choice that did not take the
        ticket, the next build)."""
        pending, self._pending_build = self._pending_build, None
        if pending is None:
            return
        ticket, builder, common, metadata, step, epoch, config = pending
        try:
            self._keep_build(builder, common, metadata, ticket.selected, step, step, epoch, config)
        except Exception as exc:
            self.capturer.report(exc, f"{type(builder).__name__}.build")

    def _keep_build(self, builder: Any, common: Any, metadata: Any, names: Any, lo: Any, hi: Any,
                    epoch: int, config: Any) -> bool:
        """The step's context, kept on its metadata and, where a full graph may replay it, for each layer (``lo`` and
        ``hi``: the build's selected layers' lowest and highest step; ``epoch`` and ``config``: the counts' epoch and
        capture's configuration then); whether it was (not for a build while a graph records)."""
        slot_mapping = common.slot_mapping
        if vllm_facts._graph_capturing(common.seq_lens):
            return False
        causal = common.causal
        facts = self._builder_facts.get(id(builder))
        if facts is None:
            facts = self._builder_facts[id(builder)] = _builder_facts(builder)
            if self._parallel is None:
                self._parallel = _parallel_facts(getattr(builder, "vllm_config", None))
        # Only a backend that writes the new K/V inside forward needs them (the others' are saved before
        # do_kv_cache_update).
        tokens = None if slot_mapping is None or not self._update_in_forward else int(common.num_actual_tokens)
        buffers = (common.block_table_tensor, common.seq_lens, common.query_start_loc)
        hint = None
        if self._graph_layers:  # a full CUDA graph may run this step: what staging it needs
            # Its real requests worked out only when needed (StageHint.num_reqs): a step staged inside vLLM's
            # graph leaves them to the capture thread, from the query offsets it staged.
            hint = _stage_hint()(common, buffers, -1)
        prepare = False
        if hint is not None and self._graph_step(builder, common, tokens, causal):
            # Nothing copied, nothing sliced (a slice is a torch call): the staging program copies the
            # metadata after the graph's replay, as the graph read it, and the capture thread takes the real
            # requests' rows; should the step run eagerly after all, its first hook copies them.
            ctx = deferred_context(builder, common, metadata, facts, buffers, hint)
            # Every layer of the builder wanted at one step, told now: the choice of graph need not ask again
            # (GraphHooks._prepared_step).
            prepare = lo == hi and lo is not None and len(names) == len(getattr(builder, "layer_names", ()) or ())
        else:
            num_reqs = _requests_with_tokens(common) if hint is None else hint.num_reqs
            rows = (_rows(common.block_table_tensor, num_reqs), _rows(common.seq_lens, num_reqs),
                    _rows(common.query_start_loc, num_reqs + 1))
            ctx = self._copied(builder, metadata, rows, slot_mapping, tokens, causal, facts, common)
        self._stash(metadata, ctx)
        if self._graph_layers:  # its replay finds the context by layer
            ctx.stage = hint
            names = getattr(builder, "layer_names", None) or ()  # capture's and the sentinel's layers
            if prepare:  # every layer selected, all at one step (told above): one entry, shared
                self._graph_builds.update(dict.fromkeys(names, (lo, ctx)))
                if self.capturer.wants_all(len(names), lo):
                    self._prepared = (names, lo, ctx, epoch, config)
                return True
            steps = list(map(self._forward_counts.get, names, repeat(0)))
            if steps and steps.count(steps[0]) == len(steps):  # the usual case: one entry, shared
                self._graph_builds.update(dict.fromkeys(names, (steps[0], ctx)))
            else:
                self._graph_builds.update(zip(names, zip(steps, repeat(ctx))))
        return True

    def _copied(self, builder: Any, metadata: Any, rows: tuple, slot_mapping: Any, tokens: int | None, causal: Any,
                facts: Any, common: Any) -> _EngineContext:
        """The build's context with its copies: on a device, host copies for capture (device clones when the
        sentinel may check the step); on the host, clones."""
        host = self._copy_to_host(builder, rows, slot_mapping, tokens, causal) if rows[0].is_cuda else None
        if host is not None and self.sentinel is None:
            bt, sl, qsl, slots, causal = (host.block_table, host.seq_lens, host.query_start_loc,
                                          host.slot_mapping, host.causal)
        else:
            # Clones are stream-ordered copies on the engine's device: no host sync
            # here, and a later in-place update of the runner's buffers cannot reach them.
            bt, sl, qsl = (t.clone() for t in rows)
            slots = None if tokens is None else slot_mapping[:tokens].clone()
            causal = causal.clone() if hasattr(causal, "clone") else causal
        return _EngineContext(id(metadata), bt, sl, qsl, slots, causal, facts, _step_refusal(common), host)

    def _graph_step(self, builder: Any, common: Any, tokens: int | None, causal: Any) -> bool:
        """Whether a build's copies wait until its step is read (:class:`_Deferred`): a full CUDA graph recorded
        for the build's padded tokens and rows will likely replay it (vLLM pads only a full graph's batch), the
        staging program will likely copy its metadata (this builder's layers are every layer the graphs copy for
        kvdbg, and a program is likely free), and nothing else needs its copies now (the sentinel's device
        clones, a slot mapping for an update inside forward, a tensor ``causal``). A step guessed wrongly is
        still right: an eager step's first hook copies, and for a replayed step that staging did not serve the
        engine's thread copies right after the replay (its capture then waits for the graph's work)."""
        shapes = self._graph_shapes
        if not shapes or self.sentinel is not None or tokens is not None or hasattr(causal, "clone"):
            return False
        size = int(common.num_actual_tokens)
        if (size, int(common.num_reqs)) not in shapes and (size, None) not in shapes:
            return False
        if not self._covers_graph_layers(builder):
            return False
        if self._stager is None or self._stager.likely_free():
            return True
        return any(program.reusable() for program in self._in_graph_programs.values())

    def _covers_graph_layers(self, builder: Any) -> bool:
        """Whether the builder's layers are all those the recorded full graphs copy for kvdbg: staging serves a
        step only when one build holds every layer of it (a model of several cache groups has several builds);
        worked out once per builder and set of recorded graphs."""
        known = self._covers.get(id(builder))
        recorded = len(self._graph_layers)
        if known is not None and known[0] == recorded:
            return known[1]
        names = set(getattr(builder, "layer_names", None) or ())
        covers = bool(names) and all(slot.name in names for slots in self._graph_layers.values() for slot in slots)
        self._covers[id(builder)] = (recorded, covers)
        return covers

    def resolve(self, ctx: _EngineContext, slots: bool = True) -> None:
        """A deferred build's copies, now (engine's thread, before anything of its step is read on the host, and
        before the runner's next step rewrites its buffers): what the build would have copied. ``slots=False``:
        not the slot mapping (after a graph's replay, no cache update of the step is left to read it)."""
        deferred = ctx.deferred
        if deferred is None:
            return
        n = deferred.hint.num_reqs
        table, seq_lens, offsets = deferred.rows
        rows = (_rows(table, n), _rows(seq_lens, n), _rows(offsets, n + 1))
        if rows[0].is_cuda:
            host = self._copy_to_host(deferred.builder, rows, deferred.slot_mapping if slots else None, None,
                                      ctx.causal, ctx)
            ctx.block_table, ctx.seq_lens, ctx.query_start_loc, ctx.host = (host.block_table, host.seq_lens,
                                                                            host.query_start_loc, host)
        else:
            ctx.block_table, ctx.seq_lens, ctx.query_start_loc = (t.clone() for t in rows)
        ctx.deferred = None  # last: a copy that raised leaves the context deferred, never half resolved

    def _copy_to_host(self, builder: Any, rows: tuple, slot_mapping: Any, tokens: int | None,
                      causal: Any, deferred: _EngineContext | None = None) -> _HostMetadata:
        """Host copies of a device build's metadata and of its whole slot mapping, issued on the engine's
        stream (one copy a tensor) with one event after them: no hook of the step then reads device
        metadata (see _HostMetadata).

        The slot mapping is copied whole, as the builder has it, because do_kv_cache_update is given that
        tensor (found again in :meth:`host_slots`, for the builder's layers' next forwards only). For a
        ``deferred`` build, copied later, the forwards that were next when it built.
        """
        from kvdbg.capture.buffers import HostCopiesReady, copies_to_host

        tensor_causal = causal if hasattr(causal, "clone") else None
        bt, sl, qsl, slots, host_causal = copies_to_host([*rows, slot_mapping, tensor_causal])
        ready = HostCopiesReady(rows[0].device)
        if slots is not None:
            key, address = _tensor_key(slot_mapping), slot_mapping.data_ptr()
            self._host_slots.pop(address, None)  # the newest copy last, the first to be kept
            self._host_slots[address] = (key, slots, ready)
            while len(self._host_slots) > _HOST_SLOTS_KEPT:
                self._host_slots.popitem(last=False)
            counts, builds = self._forward_counts, self._graph_builds
            for name in getattr(builder, "layer_names", None) or ():  # a builder that names none: device reads
                if deferred is None:
                    self._slots_layers[name] = (key, counts.get(name, 0))
                else:
                    built = builds.get(name)
                    if built is not None and built[1] is deferred:
                        self._slots_layers[name] = (key, built[0])
        return _HostMetadata(bt, sl, qsl, None if tokens is None or slots is None else slots[:tokens],
                             causal if tensor_causal is None else host_causal, ready)

    def host_slots(self, name: str, slot_mapping: Any) -> tuple[Any, Any]:
        """``(slots, ready)`` for the slot mapping layer ``name``'s cache update was given: the host copy made
        when its builder built it, and what to wait for before reading it; on the host, or with no such copy,
        the tensor itself and None (read from the device: slower, never stale).

        The copy is taken only when that build was the layer's builder's latest copying one, was given this
        very tensor (the same memory, seen the same way), and the layer has run no forward since.
        """
        if self._pending_build is not None:  # the step runs eagerly after all: its build kept first
            self._settle_build()
        built = self._graph_builds.get(name)
        if built is not None and built[1].deferred is not None and built[0] == self._forward_counts.get(name, 0):
            self.resolve(built[1])  # the layer's step runs eagerly after all: its build's copies now
        if slot_mapping is None or slot_mapping.is_cpu or not self._host_slots:
            return slot_mapping, None
        key = _tensor_key(slot_mapping)
        if self._slots_layers.get(name) != (key, self._forward_counts.get(name, 0)):
            return slot_mapping, None
        kept = self._host_slots.get(slot_mapping.data_ptr())
        if kept is None or kept[0] != key:
            return slot_mapping, None
        return kept[1], kept[2]

    def _sentinel_checks(self, builder: Any) -> bool:
        """Whether the sentinel checks the next step of any of this builder's layers (it has its own layer filter)."""
        if self.sentinel is None:
            return False
        names = getattr(builder, "layer_names", None) or ()
        sentinel = self.sentinel.sentinel
        # The layers it checks, kept per builder (its names held: compared by identity); then one draw a step.
        hit = self._sentinel_layers.get(id(builder))
        if hit is None or hit[0] is not names:
            hit = self._sentinel_layers[id(builder)] = (names, [n for n in names if sentinel.layer_selected(n)])
        checked = hit[1]
        if not checked:
            return False
        steps = list(map(self._forward_counts.get, checked, repeat(0)))
        lo, hi = min(steps), max(steps)
        return sentinel.drawn(lo) if lo == hi else any(map(sentinel.drawn, set(steps)))

    def _selected_layers(self, builder: Any) -> "list[str] | None":
        """The builder's layers the layer filter selects (None: it names none), kept per builder and configuration:
        a model has dozens of layers and a build runs on every step."""
        # Held and compared by identity, not by id(): a configuration replaced twice may be freed and
        # its id given to the next one, and a builder's id to a later builder (with other layers).
        config = self.capturer.config
        names = getattr(builder, "layer_names", None)
        hit = self._builder_layers.get(id(builder))
        if hit is not None and hit[0] is config and hit[1] is names:
            return hit[2]
        selected = [n for n in names if self.capturer.layer_selected(n)] if names else None
        if hit is not None and hit[1] is names and hit[2] == selected:
            selected = hit[2]  # the same layers under new filters (a new step filter): the same list, which tickets hold
        self._builder_layers[id(builder)] = (config, names, selected)
        for ticket in self._tickets.values():  # to be found again (_on_ticket) before a quiet run's end is told on it
            if ticket.builder is builder:
                ticket.told = None
        return selected

    def _stash(self, metadata: Any, ctx: _EngineContext) -> None:
        try:
            setattr(metadata, _ENGINE_ATTR, ctx)
            return
        except (AttributeError, TypeError):  # frozen dataclass or __slots__: keep it beside
            pass
        self._side_table[id(metadata)] = (metadata, ctx)
        while len(self._side_table) > _SIDE_TABLE_SIZE:
            self._side_table.popitem(last=False)

    def _lookup(self, metadata: Any) -> _EngineContext | None:
        if self._pending_build is not None:
            self._settle_build()
        ctx = getattr(metadata, _ENGINE_ATTR, None)
        # A copy of a metadata object (e.g. update_block_table) carries the attribute
        # of the original, whose block table is another group's: refuse it.
        if isinstance(ctx, _EngineContext) and ctx.owner_id == id(metadata):
            return ctx
        entry = self._side_table.get(id(metadata))
        if entry is not None and entry[0] is metadata:
            return entry[1]
        return None
