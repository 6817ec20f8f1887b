"""Once per builder and per layer: the cache spec and layout the engine declares, whether capture can
read that cache, and the layer's constants for a snapshot (read from where vLLM keeps each feature)."""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any

from kvdbg.vllm_plugin.records import _Declared, _EngineContext, _ImplInfo
from kvdbg.vllm_plugin.vllm_facts import _backend_in_use, _per_head_scales, _spec_record, _supported_layouts

if TYPE_CHECKING:  # torch and the capture modules load only once capture is switched on
    from kvdbg.capture.capturer import CaptureBackend, CaptureLayer
    from kvdbg.capture.engine_layouts import EngineLayout

logger = logging.getLogger("kvdbg.capture")


class LayerHooks:
    """The plugin state's hooks for what a layer and its builder declare (mixed into ``_PluginState``)."""

    # ---------------------------------------------------------------- what the engine declares

    def declare(self, builder: Any) -> None:
        """Note, once per builder, the cache spec and layout it declares for its layers."""
        if id(builder) in self._builders:
            return
        self._builders[id(builder)] = builder
        vllm_config = getattr(builder, "vllm_config", None)
        cache_config = getattr(vllm_config, "cache_config", None)
        layout, missing = None, None
        if not hasattr(cache_config, "get_resolved_kv_cache_layout"):
            missing = ("this vLLM declares no KV-cache layout (cache_config.get_resolved_kv_cache_layout, "
                       "vLLM >= 0.32)")
        else:
            try:
                layout = cache_config.get_resolved_kv_cache_layout()
            except Exception as exc:
                missing = f"the engine has not resolved its KV-cache layout ({str(exc).splitlines()[0][:160]})"
        parallel = getattr(vllm_config, "parallel_config", None)
        declared = _Declared(
            spec=getattr(builder, "kv_cache_spec", None), layout=layout, missing=missing,
            decode_context_parallel_size=int(getattr(parallel, "decode_context_parallel_size", 1) or 1),
            builder=type(builder).__name__,
        )
        for name in getattr(builder, "layer_names", None) or ():
            self._declared[name] = declared
        self.note_cudagraphs(vllm_config)

    def engine_layout(self, impl: Any, layer: Any, info: "_ImplInfo | None", kv_cache: Any) -> "EngineLayout | None":
        """The layout this layer's declarations give its cache, checked against ``kv_cache``; None after saying
        once why it is refused.

        Runs twice per captured step (cache update and forward), so what does not change is kept: the layout
        per declaration, and the check of the cache tensor's strides per tensor.
        """
        name = layer.layer_name
        if self.capturer.layer_refused(name) is not None:
            return None
        declared = self._declared.get(name)
        # The same impl, layer, declaration and cache tensor as last time: nothing that decides the layout changed.
        fast = self._layout_fast.get(name)
        if fast is not None and fast[0] == id(impl) and fast[1]() is layer and fast[2] is declared \
                and fast[3]() is kv_cache and fast[4] == kv_cache.data_ptr():
            return fast[5]
        backend = info.backend_name if info is not None else type(impl).__name__
        variant = getattr(layer, "isa", None) if backend == "CPU_ATTN" else None
        kv_cache_dtype = str(getattr(impl, "kv_cache_dtype", getattr(layer, "kv_cache_dtype", "auto")))
        # Per-head scales matter only to an FP8 cache (one k and one v scale per layer is all a snapshot holds).
        per_head = kv_cache_dtype.startswith("fp8") and _per_head_scales(layer)
        key = (backend, id(declared), variant, kv_cache_dtype, per_head)
        cached = self._layouts.get(name)
        if cached is not None and cached[0] == key:
            result = cached[1]
            checked = self._checked.get(name)
            # The same tensor as last time (an engine's cache tensors live as long as the engine): checked already.
            if checked is not None and checked[0] is result and checked[1]() is kv_cache \
                    and checked[2] == kv_cache.data_ptr():
                self._remember_layout(name, impl, layer, declared, kv_cache, result)
                return result
        else:
            from kvdbg.capture.engine_layouts import LayerCacheDeclaration, LayoutError, declared_layout

            try:
                if declared is None:
                    raise LayoutError(f"{backend}: no wrapped metadata builder declared the cache of layer {name} "
                                      "(its spec and layout)")
                if declared.layout is None:
                    raise LayoutError(f"{backend}: {declared.missing}; nothing is captured")
                decl = LayerCacheDeclaration(
                    backend=backend, layout=declared.layout, spec=declared.spec, kv_cache_dtype=kv_cache_dtype,
                    supported_layouts=_supported_layouts(getattr(layer, "attn_backend", None)),
                    kernel_variant=variant, decode_context_parallel_size=declared.decode_context_parallel_size,
                    per_head_scales=per_head)
                result = declared_layout(decl, num_kv_heads=int(impl.num_kv_heads), head_size=int(impl.head_size))
            except LayoutError as exc:
                result = exc
            self._layouts[name] = (key, result)
        from kvdbg.capture.engine_layouts import LayoutError

        said_as = None
        if not isinstance(result, LayoutError):
            try:
                result.check(kv_cache, int(impl.num_kv_heads), int(impl.head_size))
                try:  # a weak reference: the plugin must never keep an engine's cache alive
                    self._checked[name] = (result, weakref.ref(kv_cache), kv_cache.data_ptr())
                except TypeError:  # not weakly referenceable: checked on every step
                    pass
                self._remember_layout(name, impl, layer, declared, kv_cache, result)
                return result
            except LayoutError as exc:
                # One line for all of a backend's layers: they share the engine's layout.
                result, said_as = LayoutError(f"{backend} layer {name}: {exc}; nothing is captured from it (nor, "
                                              "said no more, from its other layers)"), f"strides:{backend}"
        self.capturer.failures[f"layout:{backend}"] += 1
        self._say_refused(str(result), key=said_as)
        return None

    def _remember_layout(self, name: str, impl: Any, layer: Any, declared: Any, kv_cache: Any, layout: Any) -> None:
        try:  # weak references: the plugin must never keep an engine's layer or cache alive (the layer keeps
            # its impl alive, so the impl's id stays its own while the layer lives)
            self._layout_fast[name] = (id(impl), weakref.ref(layer), declared, weakref.ref(kv_cache),
                                       kv_cache.data_ptr(), layout)
        except TypeError:  # not weakly referenceable: the full check runs on every step
            pass

    def _say_refused(self, message: str, key: str | None = None) -> None:
        """One warning per distinct refusal (``key``, or the message itself)."""
        key = key or message
        if key not in self._refusals_said:
            self._refusals_said.add(key)
            logger.warning("kvdbg capture refused: %s", message)

    # ---------------------------------------------------------------- per layer, once

    def capture_layer(self, impl: Any, layer: Any, kv_layout: str, model_dtype: Any) -> "CaptureLayer":
        """The layer's constants for capture, built on its first step (CaptureInputError if they are unusable).

        Every feature the impl was built with is read from where vLLM 0.33 keeps it, so that replay models it
        or refuses it by name: the sink logits (``impl.sinks``, one per query head; FlashInfer keeps a float32
        copy there), the ALiBi slopes (``impl.alibi_slopes``, float32) and TRITON_ATTN's square-root variant
        (``layer.use_alibi_sqrt``), the soft cap (0 means none), the layer's own sliding window (per layer, so
        an interleaved model records each layer's), TRITON_ATTN's ``chunk_lookback`` (-1: off; on only with a
        window), the PrefixLM and R-SWA masks, the attention type and the KV-sharing target.
        """
        scales = (layer._q_scale_float, layer._k_scale_float, layer._v_scale_float)
        key = (id(impl), kv_layout, model_dtype, scales)
        cached = self._layers.get(layer.layer_name)
        if cached is not None and cached[0] == key:
            return cached[1]
        from kvdbg.capture.capturer import CaptureLayer

        attn_type = getattr(layer, "attn_type", getattr(impl, "attn_type", "decoder"))
        # The layer keeps the window in tokens (None: none); impls keep their own forms ((left, right) with -1
        # for none in FLASH_ATTN and TRITON_ATTN, -1 in CPU_ATTN), read only for a layer without the attribute.
        window = getattr(layer, "sliding_window", getattr(impl, "sliding_window", None))
        if isinstance(window, tuple):
            window = window[0] + 1
        if window is not None and window <= 0:
            window = None
        lookback = getattr(impl, "chunk_lookback", -1)
        built = CaptureLayer(
            name=layer.layer_name,
            num_heads=impl.num_heads,
            num_kv_heads=impl.num_kv_heads,
            head_size=impl.head_size,
            scale=impl.scale,
            dtype=model_dtype,
            kv_cache_dtype=str(getattr(impl, "kv_cache_dtype", getattr(layer, "kv_cache_dtype", "auto"))),
            kv_layout=kv_layout,
            sliding_window=window,
            q_scale=scales[0],
            k_scale=scales[1],
            v_scale=scales[2],
            logits_soft_cap=getattr(impl, "logits_soft_cap", None) or None,
            sinks=getattr(impl, "sinks", None),
            alibi_slopes=getattr(impl, "alibi_slopes", None),
            alibi_sqrt=bool(getattr(layer, "use_alibi_sqrt", getattr(impl, "use_alibi_sqrt", False))),
            chunk_lookback=int(lookback) if lookback is not None and lookback >= 0 and window else None,
            mm_prefix=bool(getattr(layer, "use_mm_prefix", False)),
            # RSWAAttention keeps its window only as this attribute (its KV cache spec needs the engine config).
            rswa_window=getattr(layer, "_rswa_window", None) or None,
            head_size_v=getattr(layer, "head_size_v", None),
            kv_sharing_target=getattr(layer, "kv_sharing_target_layer_name", None),
            attn_type=attn_type,
        )
        self._layers[layer.layer_name] = (key, built)
        return built

    def _step_constants_for(self, impl: Any, ctx: _EngineContext, info: "_ImplInfo | None", layer: Any,
                            kv_layout: "EngineLayout", how: str) -> tuple["CaptureBackend", dict[str, Any]]:
        from kvdbg.capture.capturer import CaptureBackend

        facts = ctx.facts
        backend_name = info.backend_name if info else type(impl).__name__
        backend = CaptureBackend(
            name=backend_name,
            max_model_len=int(facts.max_model_len),
            max_decode_query_len=facts.max_decode_query_len,
            max_num_seqs=facts.max_num_seqs,
            max_num_batched_tokens=facts.max_num_batched_tokens,
        )
        new_kv_note = {
            "pre": "saved before do_kv_cache_update; the pages it overwrote are restored",
            "forward": f"taken at forward ({info.update_source if info else ''} is true)",
            "absent": ("absent: no do_kv_cache_update preceded this forward (KV sharing, a fused update or "
                       "no new tokens); kv_cache holds the state attention read"),
        }[how]
        provenance = {
            "metadata_source": f"CommonAttentionMetadata as passed to {facts.builder}.build (before restriction)",
            "new_kv": new_kv_note,
            "max_decode_query_len_source": (f"{facts.builder}.query_len" if facts.max_decode_query_len is not None
                                            else "format default 1 (the builder has no query_len)"),
            "kv_cache_spec_block_size": facts.spec_block_size,
            "impl": type(impl).__name__,
            "attention_backend": _backend_in_use(layer, backend_name),
            "kernel_variant": getattr(layer, "isa", None) if backend_name == "CPU_ATTN" else None,
            **self._declaration_record(layer.layer_name, kv_layout),
            **(self._parallel or {}),
        }
        if how != "pre":
            provenance["kv_layout_read_back"] = ("not checked: no do_kv_cache_update wrote this step's K/V "
                                                 "before the forward")
        # With a pre-update, the writer reads the written slots back and says so in kv_layout_read_back.
        return backend, provenance

    def _declaration_record(self, name: str, kv_layout: "EngineLayout") -> dict[str, Any]:
        """Provenance: what vLLM declared for the layer's cache (built once per layer and layout)."""
        declared = self._declared[name]
        key = (id(declared), kv_layout)
        cached = self._records.get(name)
        if cached is not None and cached[0] == key:
            return cached[1]
        record = {
            "kv_cache_layout": getattr(declared.layout, "name", None),
            "kv_cache_layout_source": f"cache_config.get_resolved_kv_cache_layout() via {declared.builder}",
            "kv_cache_spec": _spec_record(declared.spec),
            "kv_layout_description": kv_layout.description,
        }
        self._records[name] = (key, record)
        return record

    def _info(self, impl: Any) -> "_ImplInfo | None":
        return self._impl_info.get(type(impl)) or next(
            (v for cls, v in self._impl_info.items() if isinstance(impl, cls)), None
        )
