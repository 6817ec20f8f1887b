"""kvdbg.vllm_plugin against the vLLM 0.33 stand-ins in tests/vllm_standins (no real vLLM here)."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from kvdbg import vllm_plugin

from kvdbg.vllm_plugin import state as plugin_state

from kvdbg.vllm_plugin import records

from kvdbg.vllm_plugin import vllm_facts
from kvdbg.snapshot.store import load_snapshot
from tests.helpers import ROOT

STANDINS = Path(__file__).parent / "vllm_standins"
ENV_VARS = ("KVDBG_CAPTURE_DIR", "KVDBG_CAPTURE_BACKENDS", "KVDBG_CAPTURE_LAYERS", "KVDBG_CAPTURE_STEPS",
            "KVDBG_CAPTURE_RANKS", "KVDBG_CAPTURE_MAX", "KVDBG_CAPTURE_MAX_BYTES", "KVDBG_CAPTURE_QUEUE_BYTES",
            "KVDBG_CAPTURE_QUEUE", "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "RANK")
WRAPPED = {
    "vllm.v1.attention.backends.flashinfer_ts": {"FlashInferTSImpl": ("forward", "do_kv_cache_update"),
                                                  "FlashInferTSMetadataBuilder": ("build",)},
    "vllm.v1.attention.backends.flex_attention": {"FlexAttentionImpl": ("forward", "do_kv_cache_update"),
                                                   "FlexAttentionMetadataBuilder": ("build",)},
    "vllm.v1.worker.worker_base": {"WorkerWrapperBase": ("shutdown", "execute_model")},
}


def _drop_vllm_modules():
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]


@pytest.fixture
def clean(monkeypatch):
    """No KVDBG_* variables, no plugin state, and no stand-in modules left behind."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    vllm_plugin.unregister()
    assert "vllm" not in sys.modules
    yield monkeypatch
    vllm_plugin.unregister()
    _drop_vllm_modules()


@pytest.fixture
def standins(clean):
    clean.syspath_prepend(str(STANDINS))
    return clean


def originals() -> dict[tuple[str, str, str], object]:
    import importlib

    out = {}
    for module, classes in WRAPPED.items():
        mod = importlib.import_module(module)
        for cls_name, attrs in classes.items():
            for attr in attrs:
                out[module, cls_name, attr] = getattr(mod, cls_name).__dict__[attr]
    return out


def current() -> dict[tuple[str, str, str], object]:
    return {key: sys.modules[key[0]].__dict__[key[1]].__dict__[key[2]] for key in originals()}


def enable(monkeypatch, directory, **env):
    monkeypatch.setenv("KVDBG_CAPTURE_DIR", str(directory))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    vllm_plugin.register()


# --------------------------------------------------------------------------- a small engine


class TSBackend:
    """Backend descriptor for FLASHINFER_TS: its real class name was not in the sources read, so the
    test supplies one; the plugin itself finds the impl and builder through their module."""

    forward_includes_kv_cache_update = False

    @staticmethod
    def get_name():
        return "FLASHINFER_TS"

    @staticmethod
    def get_impl_cls():
        from vllm.v1.attention.backends.flashinfer_ts import FlashInferTSImpl

        return FlashInferTSImpl

    @staticmethod
    def get_builder_cls():
        from vllm.v1.attention.backends.flashinfer_ts import FlashInferTSMetadataBuilder

        return FlashInferTSMetadataBuilder


@contextlib.contextmanager
def default_dtype(dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class StandinEngine:
    """One KV-cache group served by a stand-in backend: a cache, block tables, layers, steps."""

    def __init__(self, backend="FLASHINFER_TS", *, seq_lens=(300, 77, 150), query_len=4, causal=False,
                 window=64, page_size=16, num_blocks=72, num_heads=4, num_kv_heads=2, head_size=16,
                 fp8=False, layers=1, max_model_len=4096, seed=0, cache_layout="LBHNC"):
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
        from vllm.model_executor.layers.attention.attention import Attention
        from vllm.v1.attention.backends.flex_attention import FlexAttentionBackend
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVQuantMode, SlidingWindowSpec

        gen = torch.Generator().manual_seed(seed)
        self.gen = gen
        self.query_len, self.causal, self.page_size = query_len, causal, page_size
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.seq_lens = list(seq_lens)
        cache_dtype = "fp8" if fp8 else "auto"
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(max_model_len=max_model_len, num_attention_heads=num_heads),
            cache_config=CacheConfig(block_size=page_size, num_gpu_blocks=num_blocks, cache_dtype=cache_dtype),
            scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
            speculative_config=SpeculativeConfig(num_speculative_tokens=query_len - 1),
        )
        spec_cls = SlidingWindowSpec if window else FullAttentionSpec
        kv_dtype = torch.uint8 if fp8 else torch.bfloat16
        self.spec = spec_cls(block_size=page_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=kv_dtype,
                             sliding_window=window,
                             kv_quant_mode=KVQuantMode.FP8_PER_TENSOR if fp8 else KVQuantMode.NONE)
        self.vllm_config.cache_config.kv_cache_layout = cache_layout
        if isinstance(backend, type):
            self.backend = backend
        else:
            self.backend = TSBackend if backend == "FLASHINFER_TS" else FlexAttentionBackend
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.layers = []
        with default_dtype(torch.bfloat16):
            for name in self.names:
                layer = Attention(num_heads, head_size, head_size ** -0.5, num_kv_heads,
                                  cache_config=CacheConfig(cache_dtype=cache_dtype), per_layer_sliding_window=window,
                                  prefix=name, attn_backend=self.backend)
                if fp8:
                    layer.set_kv_scales(1.0, 0.05, 0.04)
                cache_shape = (num_blocks, num_kv_heads, page_size, 2 * head_size)
                if fp8:
                    cache = (torch.randn(cache_shape, generator=gen) * 8).to(torch.float8_e4m3fn).view(torch.uint8)
                else:
                    cache = torch.randn(cache_shape, generator=gen).to(torch.bfloat16)
                layer.kv_cache = _stored_in(cache, cache_layout)
                self.layers.append(layer)
        # Shuffled engine pages (page 0 stays vLLM's null block) and a stale tail of random ids.
        pool = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
        width = max(-(-n // page_size) for n in self.seq_lens) + 3
        self.block_table = torch.randint(1, num_blocks, (len(self.seq_lens), width), generator=gen, dtype=torch.int32)
        for r, length in enumerate(self.seq_lens):
            live = -(-length // page_size)
            self.block_table[r, :live] = torch.tensor(pool[:live], dtype=torch.int32)
            pool = pool[live:]
        self.builder = self.backend.get_builder_cls()(self.spec, self.names, self.vllm_config, torch.device("cpu"))

    def common(self):
        from vllm.v1.attention.backend import CommonAttentionMetadata

        num_reqs, q = len(self.seq_lens), self.query_len
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * q
        slots = []
        for r, length in enumerate(self.seq_lens):
            for pos in range(length - q, length):
                slots.append(int(self.block_table[r, pos // self.page_size]) * self.page_size + pos % self.page_size)
        return CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl.clone(),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32), num_reqs=num_reqs,
            num_actual_tokens=num_reqs * q, max_query_len=q, max_seq_len=max(self.seq_lens),
            block_table_tensor=self.block_table.clone(), slot_mapping=torch.tensor(slots, dtype=torch.int64),
            causal=self.causal,
        )

    def inputs(self):
        tokens = len(self.seq_lens) * self.query_len
        g = self.gen
        return (torch.randn(tokens, self.num_heads * self.head_size, generator=g).to(torch.bfloat16),
                torch.randn(tokens, self.num_kv_heads * self.head_size, generator=g).to(torch.bfloat16),
                torch.randn(tokens, self.num_kv_heads * self.head_size, generator=g).to(torch.bfloat16))

    def step(self, common=None, metadata=None, inputs=None):
        """One engine step: build the metadata, then run every layer's forward. Returns what each saw."""
        from vllm.forward_context import set_forward_context

        common = common or self.common()
        metadata = metadata if metadata is not None else self.builder.build(0, common)
        seen = []
        for name, layer in zip(self.names, self.layers):
            query, key, value = inputs or self.inputs()
            pre_update = layer.kv_cache.clone()
            with set_forward_context({name: metadata}, {name: layer}, {name: common.slot_mapping}):
                output = layer.forward(query, key, value)
            seen.append(dict(name=name, query=query, key=key, value=value, output=output,
                             cache_before=pre_update, cache_after=layer.kv_cache.clone()))
        self.seq_lens = [n + self.query_len for n in self.seq_lens]
        return common, metadata, seen


def _stored_in(cache: torch.Tensor, layout_name: str) -> torch.Tensor:
    """The logical [blocks, heads, tokens, 2*D] ``cache`` as a view of memory in ``layout_name``'s order (as vLLM's
    create_kv_cache_views hands a layer its cache)."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    order = KVCacheLayout[layout_name].layer_view_order
    storage = cache.permute(*order).contiguous()
    return storage.permute(*[order.index(axis) for axis in range(4)])


def snapshots(directory) -> list:
    state = vllm_plugin._state
    if state is not None:
        assert state.drain_graph_capture(10)  # steps of replayed graphs: captured by the plugin's thread
    capturer = vllm_plugin.active_capturer()
    if capturer is not None:
        assert capturer.flush(10)  # the plugin writes in the background
    if not os.path.isdir(directory):
        return []
    return [load_snapshot(os.path.join(directory, f)) for f in sorted(os.listdir(directory))]


def replay_with_standins(snap, backend):
    """Run the stand-in engine on nothing but the snapshot: a fresh cache holding the stored pages."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    meta, step = snap.meta, snap.steps[0]
    engine = StandinEngine(backend, seq_lens=step.seq_lens.tolist(), query_len=step.query_lens[0],
                           causal=meta.layer.causal, window=meta.layer.sliding_window,
                           page_size=meta.backend.page_size, num_blocks=meta.backend.num_gpu_blocks,
                           fp8=meta.layer.is_fp8, max_model_len=meta.backend.max_model_len, seed=123)
    layer = engine.layers[0]
    layer.set_kv_scales(meta.layer.q_scale, meta.layer.k_scale, meta.layer.v_scale)
    layer.kv_cache.zero_()
    layer.kv_cache.index_copy_(0, snap.page_ids.long(), snap.kv_cache)
    common = CommonAttentionMetadata(
        query_start_loc=step.query_start_loc, query_start_loc_cpu=step.query_start_loc,
        seq_lens=step.seq_lens, num_reqs=step.num_reqs, num_actual_tokens=step.num_tokens,
        max_query_len=max(step.query_lens), max_seq_len=int(step.seq_lens.max()),
        block_table_tensor=step.block_table, slot_mapping=step.slot_mapping, causal=meta.layer.causal,
    )
    hidden = meta.layer.num_heads * meta.layer.head_size
    kv_hidden = meta.layer.num_kv_heads * meta.layer.head_size
    inputs = (step.query.reshape(-1, hidden), step.key.reshape(-1, kv_hidden), step.value.reshape(-1, kv_hidden))
    _, _, seen = engine.step(common=common, inputs=inputs)
    return seen[0]


# --------------------------------------------------------------------------- switched off


def test_import_and_register_without_the_variable_touch_nothing():
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVDBG_")}
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), ROOT])
    code = ("import sys, kvdbg.vllm_plugin as p; p.register(); "
            "print(sorted(m for m in ('torch', 'vllm', 'kvdbg.capture.capturer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_unset_variable_patches_nothing(standins):
    before = originals()
    vllm_plugin.register()
    assert current() == before
    assert vllm_plugin.active_capturer() is None
    assert all(not hasattr(fn, "_kvdbg_original") for fn in before.values())


def test_without_vllm_one_line_and_nothing(clean, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(clean, tmp_path)
    assert vllm_plugin.active_capturer() is None
    logged = [r for r in caplog.records if r.name == "kvdbg.capture"]
    assert len(logged) == 1 and "vLLM is not importable" in logged[0].getMessage()


def test_bad_variable_logs_and_patches_nothing(standins, tmp_path, caplog):
    before = originals()
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="ten-twenty")
    assert current() == before and vllm_plugin.active_capturer() is None
    logged = [r for r in caplog.records if r.name == "kvdbg.capture"]
    assert len(logged) == 1 and "KVDBG_CAPTURE_STEPS" in logged[0].getMessage()


def test_register_is_idempotent_and_reversible(standins, tmp_path):
    before = originals()
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLASHINFER_TS,FLEX_ATTENTION")
    wrapped = current()
    assert all(wrapped[k] is not before[k] and wrapped[k]._kvdbg_original is before[k] for k in before)
    vllm_plugin.register()
    assert current() == wrapped
    engine = StandinEngine()
    engine.step()
    assert len(snapshots(tmp_path)) == 1  # wrapped twice would capture twice
    vllm_plugin.unregister()
    assert current() == before


def test_by_default_the_backend_of_each_layer_is_wrapped_when_the_layer_is_built(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    before = originals()
    enable(standins, tmp_path)
    worker = "vllm.v1.worker.worker_base"
    # Nothing is known about the engine's backends yet; only the worker's shutdown (the writer's drain) is wrapped.
    assert {k: v for k, v in current().items() if k[0] != worker} == {k: v for k, v in before.items() if k[0] != worker}
    engine = StandinEngine("FLASHINFER_TS", layers=2)
    after = current()
    ts = "vllm.v1.attention.backends.flashinfer_ts"
    assert all((after[k] is not before[k]) == (k[0] in (ts, worker)) for k in before)
    lines = [r.getMessage() for r in caplog.records if "wrapping FLASHINFER_TS" in r.getMessage()]
    assert len(lines) == 1 and "the backend of layer model.layers.0.self_attn.attn" in lines[0], lines
    vllm_plugin.register()
    StandinEngine("FLASHINFER_TS")
    assert current() == after
    engine.step()
    assert len(snapshots(tmp_path)) == 2  # both layers, each once
    vllm_plugin.unregister()
    assert current() == before


def test_unknown_backend_is_named_and_the_rest_wrapped(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    before = originals()
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="flashinfer_ts,NO_SUCH_BACKEND")
    after = current()
    ts, flex = "vllm.v1.attention.backends.flashinfer_ts", "vllm.v1.attention.backends.flex_attention"
    assert all(after[k] is not before[k] for k in before if k[0] == ts)
    assert all(after[k] is before[k] for k in before if k[0] == flex)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "NO_SUCH_BACKEND" in warnings[0] and "FLEX_ATTENTION" in warnings[0]


# --------------------------------------------------------------------------- capturing


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_flashinfer_ts_snapshot_holds_pre_restriction_metadata_and_output(standins, tmp_path, fp8):
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS", fp8=fp8)
    common, metadata, seen = engine.step()
    # The builder restricted the page table to the window: what the snapshot must NOT hold.
    assert not torch.equal(metadata.seq_lens, common.seq_lens)
    assert metadata.block_table.shape != common.block_table_tensor.shape

    (snap,) = snapshots(tmp_path)
    step, run = snap.steps[0], seen[0]
    assert torch.equal(step.block_table, common.block_table_tensor)
    assert torch.equal(step.seq_lens, common.seq_lens)
    assert torch.equal(step.query_start_loc, common.query_start_loc)
    assert torch.equal(step.slot_mapping, common.slot_mapping)
    assert torch.equal(step.output, run["output"].view(step.output.shape))
    assert torch.equal(step.query, run["query"].view(step.query.shape))
    assert torch.equal(step.key, run["key"].view(step.key.shape))
    # Pages as the step found them, although do_kv_cache_update wrote the slots before forward.
    assert torch.equal(snap.kv_cache, run["cache_before"][snap.page_ids.long()])
    assert not torch.equal(snap.kv_cache, run["cache_after"][snap.page_ids.long()])

    meta = snap.meta
    assert (meta.layer.causal, meta.layer.sliding_window, meta.layer.dtype) == (False, 64, "bfloat16")
    assert meta.layer.kv_cache_dtype == ("fp8_e4m3" if fp8 else "auto")
    assert (meta.layer.k_scale, meta.layer.v_scale) == ((0.05, 0.04) if fp8 else (1.0, 1.0))
    assert (meta.backend.name, meta.backend.page_size, meta.backend.num_gpu_blocks) == ("FLASHINFER_TS", 16, 72)
    assert (meta.backend.max_decode_query_len, meta.backend.max_model_len) == (4, 4096)
    assert meta.capture["engine"] == "vllm 0.33.0+kvdbg.standin"
    assert "FlashInferTSMetadataBuilder.build" in meta.capture["metadata_source"]
    assert meta.capture["step"] == 0 and meta.capture["pre_update_pages_restored"] > 0

    # The snapshot alone reproduces the engine's forward, bit for bit.
    vllm_plugin.unregister()
    replayed = replay_with_standins(snap, "FLASHINFER_TS")
    assert torch.equal(replayed["output"].view(step.output.shape), step.output)


def test_flex_attention_found_through_the_registry(standins, tmp_path):
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLEX_ATTENTION")
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, query_len=1, seq_lens=(40, 17))
    common, _, seen = engine.step()
    (snap,) = snapshots(tmp_path)
    assert snap.meta.backend.name == "FLEX_ATTENTION" and snap.meta.layer.causal
    assert snap.meta.backend.max_decode_query_len == 1
    assert "format default" in snap.meta.capture["max_decode_query_len_source"]
    assert torch.equal(snap.steps[0].block_table, common.block_table_tensor)
    assert torch.equal(snap.steps[0].output, seen[0]["output"].view(snap.steps[0].output.shape))
    vllm_plugin.unregister()
    replayed = replay_with_standins(snap, "FLEX_ATTENTION")
    assert torch.equal(replayed["output"].view(snap.steps[0].output.shape), snap.steps[0].output)


def test_each_layer_is_described_once_and_again_when_its_scales_change(standins, tmp_path, monkeypatch):
    from kvdbg.capture import capturer as capture

    built = []

    class CountedLayer(capture.CaptureLayer):
        def __post_init__(self):
            built.append(self.name)
            super().__post_init__()

    monkeypatch.setattr(capture, "CaptureLayer", CountedLayer)
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0-2,4")
    engine = StandinEngine("FLASHINFER_TS", layers=2, fp8=True, seq_lens=(100, 60))
    for _ in range(3):
        engine.step()
    assert sorted(built) == sorted(engine.names)  # 3 steps, each layer described once
    # vLLM may compute the FP8 scales in the first forward: the next capture records the new ones.
    engine.layers[1].set_kv_scales(1.0, 0.5, 0.25)
    engine.step()  # step 3: not captured, and nothing rebuilt for it
    engine.step()
    assert sorted(built) == sorted(engine.names + engine.names[1:])
    snaps = {(s.meta.layer.name, s.meta.capture["step"]): s for s in snapshots(tmp_path)}
    assert len(snaps) == 8
    assert (snaps[engine.names[1], 2].meta.layer.k_scale, snaps[engine.names[1], 4].meta.layer.k_scale) == (0.05, 0.5)
    assert snaps[engine.names[0], 4].meta.layer.k_scale == 0.05


def test_the_hooks_account_for_the_engine_time_of_copied_steps_apart_from_the_others(standins, tmp_path):
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="1", KVDBG_CAPTURE_LAYERS="*.layers.1.*")
    engine = StandinEngine("FLASHINFER_TS", layers=2)
    capturer = vllm_plugin.active_capturer()
    for _ in range(3):
        engine.step()
    capturer.flush(30)
    account = capturer.engine_time
    # One layer-step copied (layer 1, step 1). The other calls: the five other forwards, their five cache
    # updates, and the builds of steps 0 and 2, which keep nothing (no selected layer's next step is selected).
    assert account.steps == 1 and len(snapshots(tmp_path)) == 1
    assert account.other_calls == 5 + 5 + 2
    assert account.captured_ns > 0 and account.other_ns > 0
    line = capturer.summary()
    assert re.search(r"; engine's thread: [\d,.]+ ms copying 1 step\(s\) \([\d,]+ us each\), [\d,.]+ ms in 12 other "
                     r"hook call\(s\) \([\d,.]+ us each\)$", line), line


def test_a_build_whose_metadata_takes_no_attribute_is_kept_beside_it_and_its_step_captured(standins, tmp_path,
                                                                                            monkeypatch):
    """A backend whose metadata takes no attribute of kvdbg's (a frozen dataclass, __slots__): the build's context is
    kept in a side table by the object's identity, and its step is captured as any other."""
    from vllm.v1.attention.backends import flex_attention as flex

    class Sealed(flex.FlexAttentionMetadata):
        def __setattr__(self, name, value):
            if name.startswith("_kvdbg"):
                raise AttributeError(f"{type(self).__name__} takes no attribute {name!r}")
            object.__setattr__(self, name, value)

    real = flex.FlexAttentionMetadataBuilder.build

    def build(self, *args, **kwargs):
        metadata = real(self, *args, **kwargs)
        metadata.__class__ = Sealed
        return metadata

    monkeypatch.setattr(flex.FlexAttentionMetadataBuilder, "build", build)  # before kvdbg wraps it
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="1")
    engine = StandinEngine("FLEX_ATTENTION", layers=2, causal=True, window=None)
    for _ in range(3):
        engine.step()
    capturer = vllm_plugin.active_capturer()
    assert capturer.flush(30)
    assert vllm_plugin._state._side_table and not capturer.failures
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [1, 1]
    assert capturer.dropped["internal"] == 0


def test_the_account_says_nothing_when_no_hook_was_timed():
    from kvdbg.capture.capturer import EngineTime

    account = EngineTime()
    assert account.describe() == ""
    account.other_ns, account.other_calls = 1_500_000, 3
    assert account.describe() == "engine's thread: 1.5 ms in 3 other hook call(s) (500.0 us each)"
    account.captured_ns, account.steps = 2_460_000_000, 5000
    assert account.describe() == ("engine's thread: 2,460.0 ms copying 5000 step(s) (492 us each), 1.5 ms in 3 "
                                  "other hook call(s) (500.0 us each)")


def test_a_layer_that_cannot_be_described_is_skipped_and_the_engine_runs_on(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS", fp8=True)
    engine.layers[0].set_kv_scales(1.0, float("nan"), 0.04)
    _, _, seen = engine.step()
    engine.step()
    assert snapshots(tmp_path) == [] and seen[0]["output"].shape[0] > 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "layer.k_scale" in warnings[0], warnings
    assert vllm_plugin.active_capturer().active  # bad input, not a bug: capture stays on


def test_later_builds_do_not_leak_into_an_earlier_capture(standins, tmp_path):
    """The builder rewrites its buffers in place on every build; the capture keeps its own copy."""
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS")
    common = engine.common()
    engine_table = common.block_table_tensor.clone()
    metadata = engine.builder.build(0, common)
    common.block_table_tensor.fill_(5)  # the runner refills its block-table buffer for the next batch
    engine.step(common=common, metadata=metadata)
    (snap,) = snapshots(tmp_path)
    assert torch.equal(snap.steps[0].block_table, engine_table)


class SeenOnDevice:
    """A host tensor as the plugin sees a device one: its identity (memory, shape, strides, dtype, a CUDA
    device) and ``to("cpu")``. The device's registry of build-time host copies runs on CPU with it."""

    def __init__(self, t: torch.Tensor):
        self.t, self.is_cpu, self.is_cuda = t, False, True
        self.shape, self.dtype, self.device = t.shape, t.dtype, torch.device("cuda", 0)

    def data_ptr(self):
        return self.t.data_ptr()

    def stride(self):
        return self.t.stride()

    def to(self, device, non_blocking=False):
        return self.t.clone()


class Builder:
    def __init__(self, *layer_names):
        self.layer_names = list(layer_names)


@pytest.fixture
def slots_registry(monkeypatch):
    """A plugin state whose builds copy their slot mappings as on a device (the event stood in)."""
    from kvdbg.capture import buffers as capture_buffers

    class Ready:
        def __init__(self, device):
            pass

        def synchronize(self):
            pass

    monkeypatch.setattr(capture_buffers, "HostCopiesReady", Ready)
    state = plugin_state._PluginState(capturer=None)
    rows = (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))

    def build(builder, slot_mapping):  # what after_build does with a device build's slot mapping
        state._host_slots.pop(slot_mapping.data_ptr(), None)
        state._copy_to_host(builder, rows, slot_mapping, None, False)

    return state, build


def test_a_build_time_copy_of_the_slots_serves_only_its_layers_next_update(slots_registry):
    """The copy is taken for the tensor the build was given, for the builder's layers, before their next forward."""
    state, build = slots_registry
    drafter, target = Builder("drafter.attn"), Builder("model.layers.0.attn")
    buffer = torch.full((8,), -1, dtype=torch.int64)
    buffer[:2] = torch.tensor([100, 101])
    build(drafter, SeenOnDevice(buffer[:2]))
    slots, ready = state.host_slots("drafter.attn", SeenOnDevice(buffer[:2]))
    assert slots.tolist() == [100, 101] and ready is not None  # the fast path: no device read
    given = SeenOnDevice(buffer[:2])
    assert state.host_slots("model.layers.0.attn", given) == (given, None)  # another builder's layer
    state._forward_counts["drafter.attn"] = 1  # the drafter's forward ran: the copy was for it only
    assert state.host_slots("drafter.attn", given) == (given, None)


def test_a_slot_mapping_rewritten_without_a_build_is_read_from_the_device(slots_registry):
    """A drafter's first pass builds with the target's slot mapping and hands its update a view of its own
    buffer, which an earlier build registered: that older copy is never taken."""
    state, build = slots_registry
    drafter = Builder("drafter.attn")
    buffer = torch.full((8,), -1, dtype=torch.int64)
    buffer[:2] = torch.tensor([100, 101])
    build(drafter, SeenOnDevice(buffer[:2]))  # step 0: built with its own buffer
    state._forward_counts["drafter.attn"] = 1
    build(drafter, SeenOnDevice(torch.tensor([200, 201])))  # step 1: built with the target's tensor
    buffer[:2] = torch.tensor([200, 201])  # and its own buffer rewritten, no build seeing it
    given = SeenOnDevice(buffer[:2])
    assert state.host_slots("drafter.attn", given) == (given, None)


def test_a_longer_view_of_a_built_buffer_is_read_from_the_device(slots_registry):
    """Built with ``buffer[:5]``, the update handed ``buffer[:8]`` (padding): an earlier build's copy of
    ``buffer[:8]`` is never taken."""
    state, build = slots_registry
    drafter = Builder("drafter.attn")
    buffer = torch.arange(100, 108, dtype=torch.int64)
    build(drafter, SeenOnDevice(buffer[:8]))  # step 0: eight requests
    state._forward_counts["drafter.attn"] = 1
    buffer[:] = torch.tensor([200, 201, 202, 203, 204, -1, -1, -1])
    build(drafter, SeenOnDevice(buffer[:5]))  # step 1: five requests, padded to eight for the graph
    given = SeenOnDevice(buffer[:8])
    assert state.host_slots("drafter.attn", given) == (given, None)
    slots, _ = state.host_slots("drafter.attn", SeenOnDevice(buffer[:5]))
    assert slots.tolist() == [200, 201, 202, 203, 204]


def test_a_build_lets_go_of_any_copy_at_its_buffers_address(slots_registry):
    """A later build that copies nothing (a quiet run's, or one no capture wants) lets go of the copy an earlier build
    made of its buffer, whatever view of it either was given: the copy is found by the buffer's address, and
    taken only for the very view it was made of."""
    state, build = slots_registry
    drafter = Builder("drafter.attn")
    buffer = torch.arange(100, 108, dtype=torch.int64)
    build(drafter, SeenOnDevice(buffer[:8]))
    kept = SeenOnDevice(buffer[:8])
    shorter = SeenOnDevice(buffer[:5])  # the same address, another view: not the copy's
    assert state.host_slots("drafter.attn", shorter) == (shorter, None)
    slots, ready = state.host_slots("drafter.attn", kept)
    assert slots.tolist() == list(range(100, 108)) and ready is not None
    state._host_slots.pop(shorter.data_ptr(), None)  # what the next build's hook does: of five rows, copying nothing
    assert state.host_slots("drafter.attn", kept) == (kept, None)


def test_a_new_copy_at_a_kept_address_is_the_last_to_be_let_go(slots_registry):
    """Copies are let go oldest first past the few kept: a build that copies its buffer again puts its copy last."""
    from kvdbg.vllm_plugin.vllm_facts import _HOST_SLOTS_KEPT

    state, build = slots_registry
    first = torch.arange(100, 104, dtype=torch.int64)
    others = [torch.full((4,), i, dtype=torch.int64) for i in range(_HOST_SLOTS_KEPT)]
    build(Builder("a"), SeenOnDevice(first))
    for i, other in enumerate(others[:-1]):
        build(Builder(f"o{i}"), SeenOnDevice(other))
    build(Builder("a"), SeenOnDevice(first))  # copied again: the newest
    build(Builder("last"), SeenOnDevice(others[-1]))  # one past the kept: the oldest goes, not "a"'s
    assert len(state._host_slots) == _HOST_SLOTS_KEPT
    slots, ready = state.host_slots("a", SeenOnDevice(first))
    assert slots.tolist() == [100, 101, 102, 103] and ready is not None


def test_a_causal_tensor_on_the_host_is_copied_at_build_not_kept(slots_registry):
    """A runner that keeps a per-request causal tensor on the host and rewrites it: the build's copy holds."""
    state, build = slots_registry
    causal = torch.tensor([True, False])
    host = state._copy_to_host(Builder("a"), (torch.zeros(2, 3, dtype=torch.int32),) * 3,
                               SeenOnDevice(torch.tensor([1, 2])), None, causal)
    causal.fill_(False)
    assert host.causal.tolist() == [True, False]


def run_filtered(monkeypatch, directory, steps=4, **env):
    enable(monkeypatch, directory, **env)
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(100, 60))
    for _ in range(steps):
        engine.step()
    return sorted((s.meta.layer.name.split(".")[2], s.meta.capture["step"], s.meta.capture["rank"])
                  for s in snapshots(directory))


@pytest.mark.parametrize("env, expected", [
    ({"KVDBG_CAPTURE_LAYERS": "*.layers.1.*", "KVDBG_CAPTURE_STEPS": "2-"}, [("1", 2, 0), ("1", 3, 0)]),
    ({"KVDBG_CAPTURE_LAYERS": r"re:layers\.0\.", "KVDBG_CAPTURE_STEPS": "0,3"}, [("0", 0, 0), ("0", 3, 0)]),
    ({"KVDBG_CAPTURE_STEPS": "1-2"}, [("0", 1, 0), ("0", 2, 0), ("1", 1, 0), ("1", 2, 0)]),
    ({"KVDBG_CAPTURE_RANKS": "1", "RANK": "0"}, []),
    ({"KVDBG_CAPTURE_RANKS": "1-2", "RANK": "1", "KVDBG_CAPTURE_STEPS": "0"}, [("0", 0, 1), ("1", 0, 1)]),
    ({"KVDBG_CAPTURE_MAX": "3"}, [("0", 0, 0), ("0", 1, 0), ("1", 0, 0)]),
], ids=["layers-glob", "layers-regex", "steps", "other-rank", "this-rank", "max"])
def test_filters(standins, tmp_path, env, expected):
    assert run_filtered(standins, tmp_path / "snaps", **env) == expected
    if not expected:
        assert not (tmp_path / "snaps").exists()


def test_a_layer_filter_changed_between_steps_takes_effect_at_the_next_build(standins, tmp_path):
    """The builder's selected layers are kept per configuration: each change of the filter applies to the next
    step, however often the configuration was replaced (a freed configuration's id may be given to the next)."""
    enable(standins, tmp_path, KVDBG_CAPTURE_LAYERS="*.layers.0.*")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(100, 60))
    capturer = vllm_plugin.active_capturer()
    engine.step()
    expected = [("0", 0)]
    for step in range(1, 7):
        layer = str(step % 2)
        capturer.select_layers(f"*.layers.{layer}.*")
        capturer.reconfigure(max_snapshots=100 + step)  # a second replacement between the same two builds
        engine.step()
        expected.append((layer, step))
    assert sorted((s.meta.layer.name.split(".")[2], s.meta.capture["step"]) for s in snapshots(tmp_path)) \
        == sorted(expected)
    assert not capturer.failures and not capturer.dropped


def test_byte_budget_too_small_writes_nothing_and_the_engine_runs_on(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path / "snaps", KVDBG_CAPTURE_MAX_BYTES="2K")
    engine = StandinEngine("FLASHINFER_TS")
    _, _, seen = engine.step()
    engine.step()
    assert not (tmp_path / "snaps").exists()
    assert seen[0]["output"].isfinite().all()
    budget = [r for r in caplog.records if "KVDBG_CAPTURE_MAX_BYTES" in r.getMessage()]
    assert len(budget) == 1


def test_metadata_from_an_unwrapped_build_is_reported_once(standins, tmp_path, caplog):
    engine = StandinEngine("FLASHINFER_TS")
    metadata = engine.builder.build(0, engine.common())  # built before the plugin was registered
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLASHINFER_TS")
    engine.builder.build(0, engine.common())  # a wrapped build declares the layers' cache
    engine.step(metadata=metadata)
    _, _, seen = engine.step(metadata=metadata)
    assert snapshots(tmp_path) == []
    assert seen[0]["output"].isfinite().all()
    reported = [r for r in caplog.records if "wrapped builder" in r.getMessage()]
    assert len(reported) == 1


def test_a_capture_bug_turns_capture_off_without_touching_the_engine(standins, tmp_path, caplog, monkeypatch):
    from kvdbg.capture import capturer as capture

    def broken(*args, **kwargs):
        raise RuntimeError("bug inside kvdbg")

    monkeypatch.setattr(capture, "plan_capture", broken)
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS")
    _, _, seen = engine.step()
    engine.step()
    assert snapshots(tmp_path) == []
    assert seen[0]["output"].isfinite().all()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "bug inside kvdbg" in errors[0].getMessage() and errors[0].exc_info
    assert not vllm_plugin.active_capturer().active


def test_entry_point_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    assert project["entry-points"]["vllm.general_plugins"] == {"kvdbg": "kvdbg.vllm_plugin:register"}
    assert callable(vllm_plugin.register)


# --------------------------------------------------------------------------- telling the user


_BACKENDS_MADE: dict[tuple[str, bool], type] = {}


def _backend_named(backend_name, *, mla=False):
    """A backend class reporting ``backend_name`` whose impl and builder are new subclasses of the flex stand-in's."""
    from vllm.v1.attention.backends.flex_attention import (
        FlexAttentionBackend,
        FlexAttentionImpl,
        FlexAttentionMetadataBuilder,
    )

    if (backend_name, mla) not in _BACKENDS_MADE:
        impl = type(f"{backend_name}Impl", (FlexAttentionImpl,), {})
        builder = type(f"{backend_name}Builder", (FlexAttentionMetadataBuilder,), {})
        _BACKENDS_MADE[backend_name, mla] = type(backend_name, (FlexAttentionBackend,), {
            "get_name": staticmethod(lambda: backend_name), "is_mla": classmethod(lambda cls: mla),
            "get_impl_cls": staticmethod(lambda: impl), "get_builder_cls": staticmethod(lambda: builder)})
    return _BACKENDS_MADE[backend_name, mla]


def _layer_on(backend_name, *, mla=False):
    """An attention layer whose backend class reports ``backend_name`` (the impl is the flex stand-in's)."""
    from vllm.model_executor.layers.attention.attention import Attention

    with default_dtype(torch.bfloat16):
        return Attention(4, 16, 0.25, 2, prefix=f"layer.on.{backend_name}",
                         attn_backend=_backend_named(backend_name, mla=mla))


def test_the_backend_in_use_is_named_once_when_not_wrapped(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLASHINFER_TS,FLEX_ATTENTION")
    for _ in range(2):
        _layer_on("CPU_ATTN")
        _layer_on("FLASHMLA", mla=True)
        _layer_on("FLEX_ATTENTION")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "backend is CPU_ATTN, which is not wrapped" in warnings[0]
    assert "Set KVDBG_CAPTURE_BACKENDS=CPU_ATTN, or unset it" in warnings[0]
    assert "FLASHMLA (layer layer.on.FLASHMLA) is an MLA backend" in warnings[1]
    vllm_plugin.unregister()
    from vllm.model_executor.layers.attention.attention import Attention

    assert not hasattr(Attention.__init__, "_kvdbg_original")


def test_by_default_every_backend_is_wrapped_once_and_mla_is_refused_once(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    for _ in range(2):
        for name in ("TRITON_ATTN", "FLASH_ATTN"):
            _layer_on(name)
        _layer_on("FLASHMLA", mla=True)
    lines = [r for r in caplog.records if r.getMessage().startswith("kvdbg capture: ") and r.levelno >= logging.INFO]
    said = [(r.levelno, r.getMessage()) for r in lines]
    assert len(said) == 3, said
    assert said[0][0] == logging.INFO and "wrapping TRITON_ATTN (TRITON_ATTNImpl, TRITON_ATTNBuilder), the " \
        "backend of layer layer.on.TRITON_ATTN" in said[0][1]
    assert "wrapping FLASH_ATTN" in said[1][1]
    assert said[2][0] == logging.WARNING and "backend FLASHMLA not wrapped: it is an MLA backend" in said[2][1]
    assert vllm_plugin._state.wrapped == ["TRITON_ATTN", "FLASH_ATTN"]


def test_a_named_backend_this_vllm_lacks_is_said_and_the_rest_wrapped(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLEX_ATTENTION,ROCM_ATTN")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "backend ROCM_ATTN not wrapped: the vLLM backend registry does not resolve it" \
        in warnings[0]
    assert vllm_plugin._state.wrapped == ["FLEX_ATTENTION"]


def test_lines_reach_stderr_without_any_logging_setup(tmp_path):
    """vLLM configures only its own logger: the plugin's lines must still show in a plain run."""
    code = ("from kvdbg import vllm_plugin; vllm_plugin.register(); "
            "import logging; logging.getLogger('kvdbg.capture').debug('not shown at debug level')")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVDBG_", "VLLM_"))}
    env.update(KVDBG_CAPTURE_DIR=str(tmp_path), PYTHONPATH=os.pathsep.join([str(STANDINS), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    lines = [line for line in out.stderr.splitlines() if "[kvdbg]" in line]
    assert len(lines) == 1 and "kvdbg capture active in pid" in lines[0], out.stderr
    assert f"directory={tmp_path}" in lines[0]
    assert "wrapping the backend of each attention layer as the engine builds it (KVDBG_CAPTURE_BACKENDS unset)" \
        in lines[0]
    env["VLLM_CONFIGURE_LOGGING"] = "0"  # the user owns logging: nothing added
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env, cwd=ROOT)
    assert "[kvdbg]" not in out.stderr


def test_cpu_attn_layout_follows_the_kernel_variant_and_amx_is_refused_once(standins, tmp_path, caplog):
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvdbg.capture.engine_layouts import CPU_ATTN_K_TRANSPOSED

    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    state = vllm_plugin._state
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    state._declared["l"] = records._Declared(spec, KVCacheLayout.LBHNC, None, 1, "CPUAttentionMetadataBuilder")
    info = records._ImplInfo("CPU_ATTN", False, "test")
    impl = SimpleNamespace(kv_cache_dtype="auto", num_kv_heads=2, head_size=16)
    cache = torch.zeros(4, 2, 32, 32, dtype=torch.bfloat16)

    def layer(isa):
        return SimpleNamespace(isa=isa, layer_name="l", attn_backend=None)

    assert state.engine_layout(impl, layer("vec"), info, cache).name == CPU_ATTN_K_TRANSPOSED
    assert state.engine_layout(impl, layer("vec16"), info, cache).name == CPU_ATTN_K_TRANSPOSED
    for _ in range(3):
        assert state.engine_layout(impl, layer("amx"), info, cache) is None
    fp8 = SimpleNamespace(kv_cache_dtype="fp8", num_kv_heads=2, head_size=16)
    assert state.engine_layout(fp8, layer("vec"), info, cache) is None
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "CPU_ATTN's 'amx' kernel variant" in warnings[0] and "not verified" in warnings[0]
    assert "kv_quant_mode NONE but the layer's kv_cache_dtype is 'fp8'" in warnings[1]
    assert state.capturer.failures["layout:CPU_ATTN"] == 4


# --------------------------------------------------------------------------- the layout vLLM declares


def test_the_snapshot_says_what_vllm_declared_and_that_the_written_slots_read_back(standins, tmp_path):
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS", seq_lens=(70, 33))
    engine.step()
    (snap,) = snapshots(tmp_path)
    cap = snap.meta.capture
    assert (cap["kv_layout_engine"], cap["kv_cache_layout"]) == ("vllm:LBHNC", "LBHNC")
    assert cap["kv_cache_layout_source"] == \
        "cache_config.get_resolved_kv_cache_layout() via FlashInferTSMetadataBuilder"
    assert cap["kv_cache_spec"]["class"] == "SlidingWindowSpec"
    assert (cap["kv_cache_spec"]["kv_quant_mode"], cap["kv_cache_spec"]["head_size_v"]) == ("NONE", 16)
    assert cap["kv_layout_read_back"] == ("passed: the 8 slots do_kv_cache_update wrote read back through "
                                          "vllm:LBHNC as the K/V it was given")


@pytest.mark.parametrize("cache_layout", ["LBNHC", "LHBNC", "BLHNC"])
def test_a_cache_stored_in_another_declared_order_is_read_by_logical_index(standins, tmp_path, cache_layout):
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS", cache_layout=cache_layout, seq_lens=(70, 33))
    assert engine.layers[0].kv_cache.is_contiguous() == (cache_layout == "BLHNC")  # BLHNC: one layer is LBHNC
    _, _, seen = engine.step()
    (snap,) = snapshots(tmp_path)
    assert snap.meta.capture["kv_cache_layout"] == cache_layout
    assert torch.equal(snap.kv_cache, seen[0]["cache_before"][snap.page_ids.long()])
    vllm_plugin.unregister()
    replayed = replay_with_standins(snap, "FLASHINFER_TS")
    assert torch.equal(replayed["output"].view(snap.steps[0].output.shape), snap.steps[0].output)


def test_strides_that_disagree_with_the_declared_layout_are_refused_once(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS", layers=2)  # caches stored LBHNC ...
    engine.vllm_config.cache_config.kv_cache_layout = "LBNHC"  # ... declared LBNHC
    for _ in range(2):
        _, _, seen = engine.step()
    assert snapshots(tmp_path) == [] and seen[0]["output"].isfinite().all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "kvdbg capture refused: FLASHINFER_TS layer model.layers.0.self_attn.attn: kv_cache strides" in warnings[0]
    assert "do not lay its axes out in the order [0, 2, 1, 3] that layout 'vllm:LBNHC' declares" in warnings[0]
    assert vllm_plugin.active_capturer().failures["layout:FLASHINFER_TS"] == 8  # 2 layers x 2 steps x (update, forward)


def _odd_backend():
    """A backend that declares dense content but writes each token's V where its K belongs, and K where V does."""
    from vllm._standin_math import write_cache
    from vllm.v1.attention.backends.flex_attention import FlexAttentionImpl

    backend = _backend_named("ODD_ATTN")
    impl = backend.get_impl_cls()
    if "do_kv_cache_update" not in impl.__dict__:
        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            write_cache(value, key, kv_cache[..., :self.head_size], kv_cache[..., self.head_size:], slot_mapping,
                        fp8=False, k_scale=1.0, v_scale=1.0)

        impl.do_kv_cache_update = do_kv_cache_update
        assert issubclass(impl, FlexAttentionImpl)
    return backend


def test_a_cache_whose_written_slots_do_not_read_back_is_refused_once(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    engine = StandinEngine(_odd_backend(), layers=2, causal=True, window=None, query_len=1, seq_lens=(40, 17))
    for _ in range(3):
        _, _, seen = engine.step()
    assert snapshots(tmp_path) == [] and seen[0]["output"].isfinite().all()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("kvdbg capture refused: ODD_ATTN layer model.layers.0.self_attn.attn: after "
                                  "do_kv_cache_update, read through layout 'vllm:LBHNC', slot ")
    assert "where the engine wrote" in warnings[0] and "nothing is captured from this layer" in warnings[0]
    capturer = vllm_plugin.active_capturer()
    assert capturer.failures["layout:ODD_ATTN"] == 2  # each layer refused once, then skipped
    assert capturer.active
    # The writer compares (the engine's thread only copies), so a later step may be copied before the refusal
    # is known: it is dropped, not written. Every step asked for is accounted for in the exit line.
    assert capturer.dropped == {"refused": 6} and len(capturer.written) == 0
    assert "6 refused by a check (see the warning)" in capturer.summary()


def test_without_a_background_writer_the_read_back_refuses_at_the_same_step(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_QUEUE_BYTES="0")
    engine = StandinEngine(_odd_backend(), layers=1, causal=True, window=None, query_len=1, seq_lens=(40, 17))
    engine.step()
    capturer = vllm_plugin.active_capturer()
    assert capturer.layer_refused("model.layers.0.self_attn.attn").startswith("read through layout 'vllm:LBHNC'")
    engine.step()
    assert snapshots(tmp_path) == [] and capturer.dropped == {"refused": 2}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "from step 0 on" in warnings[0], warnings


def test_a_batch_whose_mask_a_snapshot_cannot_hold_is_refused_once(standins, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS")
    for _ in range(2):
        common = engine.common()
        common.mm_req_doc_ranges = {0: [(0, 16)]}
        engine.step(common=common)
    engine.step()
    assert len(snapshots(tmp_path)) == 1  # the plain step
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "a batch whose mask a snapshot cannot hold: mm_req_doc_ranges set" in warnings[0]


class _Mode:
    """CUDAGraphMode's interface as the note reads it: a name, and the mode of decode and of mixed batches."""

    def __init__(self, name, decode, mixed):
        self.name, self._decode, self._mixed = name, decode, mixed

    def decode_mode(self):
        return _Mode(self._decode, self._decode, self._decode)

    def mixed_mode(self):
        return _Mode(self._mixed, self._mixed, self._mixed)


@pytest.mark.parametrize("mode, says", [
    (_Mode("NONE", "NONE", "NONE"), None),
    (_Mode("PIECEWISE", "PIECEWISE", "PIECEWISE"), None),
    (_Mode("FULL_AND_PIECEWISE", "FULL", "PIECEWISE"), "uniform decode batches of up to 512 tokens run as full CUDA "
     "graphs, replayed without Python, so kvdbg cannot see or capture those steps; it sees prefill and mixed"),
    (_Mode("FULL_DECODE_ONLY", "FULL", "NONE"), "cudagraph_mode is FULL_DECODE_ONLY: uniform decode batches"),
    (_Mode("FULL", "FULL", "FULL"), "cudagraph_mode is FULL: every batch of up to 512 tokens run as full CUDA graphs"),
])
def test_full_cuda_graphs_are_said_with_what_they_hide_and_what_to_do(mode, says):
    said = vllm_facts.cudagraph_note(mode, 512)
    if says is None:
        assert said == []
        assert vllm_facts.cudagraph_note(mode, 512, recorded=True) == []
        return
    [(level, line)] = said
    assert level == logging.WARNING and says in line and "\n" not in line
    assert "--enforce-eager" in line and '''--compilation-config '{"cudagraph_mode": "PIECEWISE"}''' in line
    # The copies are recorded into the graphs (vLLM's graph wrapper watched): one line at INFO says so.
    [(level, line)] = vllm_facts.cudagraph_note(mode, 512, recorded=True)
    assert level == logging.INFO and "are captured and checked too" in line and "cannot" not in line


def test_the_graph_line_is_said_once_per_process_at_the_first_build(standins, tmp_path, caplog):
    from types import SimpleNamespace

    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS")
    engine.vllm_config.compilation_config = SimpleNamespace(
        cudagraph_mode=_Mode("FULL_AND_PIECEWISE", "FULL", "PIECEWISE"), max_cudagraph_capture_size=256)
    engine.step()
    engine.step()
    vllm_plugin._state.note_graph_recording("x")  # already said: not again
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO and (
        "cudagraph_mode" in r.getMessage() or "CUDA graph" in r.getMessage())]
    assert len(said) == 1 and "decode batches of up to 256 tokens" in said[0], said


def test_a_step_recorded_into_a_cuda_graph_is_said_once_and_not_counted(standins, tmp_path, caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=2)
    monkeypatch.setattr(vllm_facts, "_graph_capturing", lambda t: True)
    engine.step()
    engine.step()
    monkeypatch.setattr(vllm_facts, "_graph_capturing", lambda t: False)
    engine.step()
    said = [r.getMessage() for r in caplog.records if "CUDA graph" in r.getMessage() and r.levelno >= logging.INFO]
    assert len(said) == 1 and "a CUDA graph is being recorded through layer model.layers.0.self_attn.attn" in said[0]
    assert "--enforce-eager" in said[0]
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [0, 0]  # recorded forwards are not steps


def test_the_writer_drains_at_the_worker_shutdown_and_says_one_line(standins, tmp_path, caplog):
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    enable(standins, tmp_path, VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS="3")
    capturer = vllm_plugin.active_capturer()
    assert capturer.config.queue_bytes == "auto"  # the plugin's default: the background writer
    engine = StandinEngine("FLASHINFER_TS")
    for _ in range(3):
        engine.step()
    worker = WorkerWrapperBase()
    worker.shutdown()
    assert worker.shut_down and len(os.listdir(tmp_path)) == 3  # drained before the worker's own shutdown
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kvdbg capture in pid")]
    assert len(lines) == 1
    said, spent = lines[0].split("; engine's thread: ")
    assert said == (f"kvdbg capture in pid {os.getpid()}: captured 3 snapshot(s), {capturer.bytes_written} bytes, "
                    f"into {tmp_path}; dropped 0")
    # What the hooks took from the engine's thread: the three steps they copied, each timed.
    account = capturer.engine_time
    assert account.steps == 3 and account.captured_ns > 0
    assert re.fullmatch(r"[\d,.]+ ms copying 3 step\(s\) \([\d,]+ us each\)(, .* other hook call\(s\) .*)?", spent)
    vllm_plugin.unregister()  # closes again: nothing more is said
    assert sum(r.getMessage().startswith("kvdbg capture in pid") for r in caplog.records) == 1


def test_each_snapshot_records_its_place_among_the_engine_ranks(standins, tmp_path):
    enable(standins, tmp_path)
    engine = StandinEngine("FLASHINFER_TS")
    engine.vllm_config.instance_id = "1764633600123456789"
    engine.vllm_config.parallel_config.tensor_parallel_size = 1
    engine.step()
    (snap,) = snapshots(tmp_path)
    capture = snap.meta.capture
    assert capture["engine_instance"] == "1764633600123456789"
    assert (capture["tp_rank"], capture["tp_size"]) == (0, 1)
    assert "total_num_kv_heads" in capture and "dp_rank" in capture


# --------------------------------------------------------------------------- steps replayed from full CUDA graphs


# The runner's persistent device buffers (vLLM keeps its block table, lengths and query offsets at one place, which
# its full graphs read): the padded batches below are written into them, as vLLM's runner writes its batches.
_RUNNER: dict[str, torch.Tensor] = {}


def _runner_buffer(name: str, shape: tuple, dtype=torch.int32) -> torch.Tensor:
    buffer = _RUNNER.get(name)
    if buffer is None or buffer.shape[0] < shape[0] or buffer.shape[1:] != shape[1:]:
        buffer = _RUNNER[name] = torch.zeros((max(64, shape[0]), *shape[1:]), dtype=dtype)
    return buffer


def _padded(common, *, reqs: int, tokens: int, table_buffer=None, persistent: bool = True):
    """``common`` as vLLM 0.33 pads it for a full CUDA graph of ``tokens``: requests of no tokens on the null block
    after the real ones (their offsets repeat the last, their lengths are 0), the padded tokens as its
    ``num_actual_tokens``; the block table, lengths and offsets written into the runner's persistent buffers
    (``table_buffer``, if given, for the block table), as vLLM does for its graphs. ``persistent=False``: new
    tensors every step (a runner that keeps no buffers)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    real = int(common.num_reqs)
    qsl = torch.cat([common.query_start_loc, common.query_start_loc[-1:].repeat(reqs - real)])
    table = torch.cat([common.block_table_tensor,
                       torch.zeros(reqs - real, common.block_table_tensor.shape[1], dtype=torch.int32)])
    seq_lens = torch.cat([common.seq_lens, torch.zeros(reqs - real, dtype=torch.int32)])
    if persistent and table_buffer is None:
        table_buffer = _runner_buffer("table", (reqs, table.shape[1]))
    if table_buffer is not None:
        table_buffer[:reqs, :table.shape[1]].copy_(table)
        table = table_buffer[:reqs, :table.shape[1]]
    if persistent:
        seq_lens = _runner_buffer("seq_lens", (reqs,))[:reqs].copy_(seq_lens)
        qsl = _runner_buffer("query_start_loc", (reqs + 1,))[:reqs + 1].copy_(qsl)
    slots = torch.cat([common.slot_mapping, torch.full((tokens - common.slot_mapping.shape[0],), -1,
                                                       dtype=torch.int64)])
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq_lens, num_reqs=reqs,
        num_actual_tokens=tokens, max_query_len=common.max_query_len,
        max_seq_len=common.max_seq_len, block_table_tensor=table, slot_mapping=slots, causal=common.causal)


def _padded_inputs(engine, tokens: int):
    return tuple(torch.cat([t, torch.zeros(tokens - t.shape[0], t.shape[1], dtype=t.dtype)])
                 for t in engine.inputs())


class _Batch(tuple):
    """A stand-in for vLLM's BatchDescriptor (hashable, with num_tokens): the key of one recorded graph."""

    num_tokens = property(lambda self: self[0])


class _FullMode:
    """A stand-in for vLLM's CUDAGraphMode.FULL (an enum member: hashable, with its name)."""

    name = "FULL"


def _run_as_graph(engine, common, inputs, tokens: int, monkeypatch, wrapper=None, through: bool = False):
    """What replaying a recorded full graph does, on the CPU: vLLM builds in Python (the wrapped build runs), the
    layers' kernels run with no Python hook (the originals), and the copies the plugin recorded into the graph
    write its buffers; then vLLM's graph wrapper returns and the plugin's replay hook runs. With ``wrapper`` (from
    :func:`_record_variants`), the plugin first chooses the variant to replay, and the staged one also runs its
    staging program after the layers, as the graph would. ``through``: the call goes through the plugin's patch of
    vLLM's graph wrapper (wrappers._wrap_graph_call), with a forward context that names the graph, as in vLLM."""
    import types

    from vllm.forward_context import set_forward_context

    state = vllm_plugin._state
    metadata = engine.builder.build(0, common)
    batch = _Batch((tokens,))

    def replay(*_):
        impl_cls = type(engine.layers[0].impl)
        with monkeypatch.context() as m:
            for attr in ("forward", "do_kv_cache_update"):
                wrapped = getattr(impl_cls, attr, None)
                if wrapped is not None and hasattr(wrapped, "_kvdbg_original"):
                    m.setattr(impl_cls, attr, wrapped._kvdbg_original)
            outputs = []
            for name, layer in zip(engine.names, engine.layers):
                query, key, value = inputs
                with set_forward_context({name: metadata}, {name: layer}, {name: common.slot_mapping}):
                    output = layer.forward(query, key, value)
                buffers = state._graph_buffers.get(name)
                if buffers is not None:  # the recorded copies, replayed with the graph
                    buffers.query[:tokens].copy_(query.view(buffers.query[:tokens].shape))
                    buffers.output[:tokens].copy_(output.view(buffers.output[:tokens].shape))
                outputs.append(output)
        if wrapper is not None and state._in_graph_ran is not None:  # the staged variant: its program, in the graph
            state._in_graph_ran[1].graph_body(tokens)
        engine.seq_lens = [n + engine.query_len for n in engine.seq_lens]
        return outputs

    if through:
        from kvdbg.vllm_plugin.wrappers import _wrap_graph_call

        wrapper.runtime_mode = mode = getattr(wrapper, "runtime_mode", None) or _FullMode()
        forward = types.SimpleNamespace(cudagraph_runtime_mode=mode, batch_descriptor=batch)
        state._forward_context = (lambda: True, lambda: forward)
        return _wrap_graph_call(state, replay)(wrapper)
    if wrapper is not None:
        state.choose_graph(wrapper, batch)
    outputs = replay()
    state.after_graph_replay(batch)
    return outputs


def _record_variants(tokens: int):
    """vLLM's wrapper, as kvdbg's has it record its graph of ``tokens`` twice more once the recording with the
    copies is done (:func:`_record_graph`): plain, then with kvdbg's staging after the forward (on the CPU the
    recording runs the forward, here nothing, and the staging program once). Returns the wrapper and its entry."""
    import types

    state = vllm_plugin._state
    batch = _Batch((tokens,))
    entry = types.SimpleNamespace(cudagraph="copies", output="copies")
    wrapper = types.SimpleNamespace(concrete_cudagraph_entries={batch: entry}, runnable=lambda: None)

    def record(name):
        def recorded():
            wrapper.runnable()
            entry.cudagraph = entry.output = name
        return recorded

    state.record_plain_graph(wrapper, batch, record("plain"))
    state.record_staged_graph(wrapper, batch, record("staged"))
    return wrapper, entry


def _record_graph(engine, tokens: int, reqs: int, monkeypatch):
    """vLLM recording its graph of ``tokens`` (a dummy batch), as the plugin's graph wrapper sees it."""
    state = vllm_plugin._state
    monkeypatch.setattr(vllm_facts, "_graph_capturing", lambda t: True)
    state.begin_graph_recording(_Batch((tokens,)))
    try:
        engine.step(common=_padded(engine.common(), reqs=reqs, tokens=tokens),
                    inputs=_padded_inputs(engine, tokens))
    finally:
        state.end_graph_recording()
        monkeypatch.setattr(vllm_facts, "_graph_capturing", lambda t: False)
    engine.seq_lens = [n - engine.query_len for n in engine.seq_lens]  # the recording's dummy step is no step


def _unstaged(monkeypatch):
    """Wanted graph steps captured the way they are when staging cannot serve them: read from the engine's memory
    by the capture thread, the engine's next step waiting for its copies."""
    from kvdbg.vllm_plugin.graph_hooks import GraphHooks

    monkeypatch.setattr(GraphHooks, "_stage", lambda self, items: None)


def _staged_spans_on_the_host(monkeypatch) -> list:
    """StepCopies.block as it works on a GPU (the staged span in one copy, the writer picking the step's pages
    from it), here on the host, where StepCopies gathers instead; returns the list of the spans it copied."""
    from kvdbg.capture.buffers import StepCopies

    spans = []

    def block(self, source, dim, positions):
        from kvdbg.capture.buffers import in_memory_order

        lo, hi = int(positions.min()), int(positions.max()) + 1
        span = source.narrow(dim, lo, hi - lo)
        if in_memory_order(span) is None:  # the GPU's rule: one dense run of memory, in any order of axes
            return None
        spans.append(span.shape[dim])
        return span.clone(), positions - lo

    monkeypatch.setattr(StepCopies, "block", block)
    return spans


@pytest.mark.parametrize("staged", [True, "span", False], ids=["staged", "staged-span", "unstaged"])
def test_a_step_replayed_from_a_full_cuda_graph_is_captured_from_the_graphs_copies(standins, tmp_path, caplog,
                                                                                     monkeypatch, staged):
    """The snapshot holds what the kernel saw in the replayed graph: the query and output its copies wrote, the
    cache after the step's update (pages the layer keeps outside the graph), the real requests' metadata; the
    same whether the step was staged on the device first (its pages gathered, or copied as one span that the
    writer picks them from) or read from the engine's memory."""
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    spans = _staged_spans_on_the_host(monkeypatch) if staged == "span" else None
    if not staged:
        _unstaged(monkeypatch)
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="1")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
    state = vllm_plugin._state
    tokens, reqs = 16, 4  # three real requests of 4 tokens each, padded to a graph of 16 tokens and 4 rows
    _record_graph(engine, tokens, reqs, monkeypatch)
    assert [slot.name for slot in state._graph_layers[_Batch((tokens,))]] == engine.names
    assert snapshots(tmp_path) == []  # recording a graph is no step
    for step in range(2):  # steps 0 and 1; only step 1 is wanted
        common = _padded(engine.common(), reqs=reqs, tokens=tokens)
        inputs = _padded_inputs(engine, tokens)
        outputs = _run_as_graph(engine, common, inputs, tokens, monkeypatch)
        caches = [layer.kv_cache.clone() for layer in engine.layers]  # the next step changes them
        state.await_graph_capture()  # what the next step's first hook does: the handed step's copies issued
        if step == 0:
            assert snapshots(tmp_path) == []
    assert state._forward_counts == {name: 2 for name in engine.names}
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["layer"])
    assert len(snaps) == 2 and {s.meta.capture["step"] for s in snaps} == {1}
    for snap, output, cache in zip(snaps, outputs, caches):
        assert f"replayed from a full CUDA graph of {tokens} tokens" in snap.meta.notes
        step = snap.steps[0]
        assert step.num_reqs == 3 and step.num_tokens == 12  # the padding rows are not requests
        assert step.seq_lens.tolist() == [304, 81, 154]  # step 1: four tokens past the first step
        torch.testing.assert_close(step.block_table[:, :20], common.block_table_tensor[:3, :20], rtol=0, atol=0)
        torch.testing.assert_close(step.query.reshape(12, -1), inputs[0][:12], rtol=0, atol=0)
        torch.testing.assert_close(step.output.reshape(12, -1), output[:12].reshape(12, -1), rtol=0, atol=0)
        # Every page stored is the cache as the kernel read it (after the step's update).
        torch.testing.assert_close(snap.kv_cache, cache[snap.page_ids.long()], rtol=0, atol=0)
        assert "absent" in snap.meta.capture["new_kv"]
    assert vllm_plugin.active_capturer().engine_time.staged == (1 if staged else 0)
    if spans is not None:  # one span a layer, more pages than the step reads (the host's bound, shared pages)
        assert len(spans) == len(engine.names) and all(n >= len(s.page_ids) for n, s in zip(spans, snaps))


def test_a_wanted_graph_step_is_captured_off_the_engines_thread_and_before_the_next_step_overwrites(
        standins, tmp_path, monkeypatch):
    """The engine's thread hands a wanted graph step over and goes on; the capture thread does the captures; the
    next step's first hook waits until they are issued, so what the next step overwrites (the graph's buffers,
    the cache) is never read late."""
    import time as clock

    _unstaged(monkeypatch)
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    import threading

    started, slow = threading.Event(), state.start_capture

    def slow_capture(*args, **kwargs):  # a capture thread that is still busy when the engine's thread goes on
        started.set()
        clock.sleep(0.25)
        return slow(*args, **kwargs)

    monkeypatch.setattr(state, "start_capture", slow_capture)
    common = _padded(engine.common(), reqs=4, tokens=16)
    before = clock.monotonic()
    outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch)
    assert clock.monotonic() - before < 0.2, "the engine's thread waited for the capture"
    job = state._graph_job
    assert job is not None and not job.finished.is_set()
    assert started.wait(5)  # the capture thread took the job
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]  # not yet: the thread is at it
    caches = [layer.kv_cache.clone() for layer in engine.layers]
    state.await_graph_capture()  # the next step's first hook
    assert job.finished.is_set() and state._graph_job is None
    for name, layer in zip(engine.names, engine.layers):  # the next step: overwrites what the capture read
        state._graph_buffers[name].output.fill_(7.0)
        layer.kv_cache.fill_(7.0)
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["layer"])
    assert len(snaps) == 2
    for snap, output, cache in zip(snaps, outputs, caches):
        torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), output[:12].reshape(12, -1), rtol=0,
                                   atol=0)
        torch.testing.assert_close(snap.kv_cache, cache[snap.page_ids.long()], rtol=0, atol=0)
    account = vllm_plugin.active_capturer().engine_time
    assert account.handed == 1 and account.waits == 1 and account.waited_ns > 0.2e9  # two layers of 0.25 s
    assert "1 graph step(s) handed to the capture thread" in account.describe()


def test_the_workers_next_step_waits_for_a_handed_graph_step_before_its_first_device_work(standins, tmp_path,
                                                                                           monkeypatch):
    """vLLM's model runner may write cache pages before the step's first build (it zeroes newly allocated blocks of
    hybrid and mixed-precision caches, copies blocks for a partial prefix hit): a block freed after the handed step
    may be one of them, so the worker's next step waits for the capture thread before anything of it runs."""
    import threading
    import time as clock

    from vllm.v1.worker.worker_base import WorkerWrapperBase

    _unstaged(monkeypatch)
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    started, slow = threading.Event(), state.start_capture

    def slow_capture(*args, **kwargs):
        started.set()
        clock.sleep(0.2)
        return slow(*args, **kwargs)

    monkeypatch.setattr(state, "start_capture", slow_capture)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    assert started.wait(5) and state._graph_job is not None
    caches = [layer.kv_cache.clone() for layer in engine.layers]

    def zero_new_blocks():  # the next step's _update_states, before any build
        for layer in engine.layers:
            layer.kv_cache.zero_()
        return "stepped"

    assert WorkerWrapperBase().execute_model(zero_new_blocks) == "stepped"
    assert state._graph_job is None
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["layer"])
    assert len(snaps) == 2
    for snap, cache in zip(snaps, caches):
        assert snap.kv_cache.abs().sum() > 0
        torch.testing.assert_close(snap.kv_cache, cache[snap.page_ids.long()], rtol=0, atol=0)


def test_a_graph_capture_that_raises_is_reported_and_never_leaves_the_engine_waiting(standins, tmp_path,
                                                                                    monkeypatch):
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=1)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("a capture that cannot be made")

    monkeypatch.setattr(state, "start_capture", broken)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    state.await_graph_capture()
    assert snapshots(tmp_path) == [] and vllm_plugin.active_capturer().failures
    state.stop_graph_capture(5.0)
    assert state._graph_thread is None


def test_a_stuck_graph_capture_thread_never_hangs_the_engine(standins, tmp_path, monkeypatch):
    """Past GRAPH_CAPTURE_WAIT_S the engine's thread goes on: the step is given up and capture turned off, since
    the thread may still read what the next step overwrites."""
    import threading

    from kvdbg.vllm_plugin import graph_hooks

    _unstaged(monkeypatch)
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=2)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    release, slow = threading.Event(), state.start_capture

    def stuck(*args, **kwargs):
        release.wait(10)
        return slow(*args, **kwargs)

    monkeypatch.setattr(state, "start_capture", stuck)
    monkeypatch.setattr(graph_hooks, "GRAPH_CAPTURE_WAIT_S", 0.1)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    job = state._graph_job
    state.await_graph_capture()
    assert job.abandoned and not job.finished.is_set()
    assert "did not issue a step's copies within 0.1 s" in vllm_plugin.active_capturer().disabled_reason
    release.set()
    assert job.finished.wait(10)
    assert len(snapshots(tmp_path)) <= 1  # the layer it had begun, at most; the second was skipped


def _staged_engine(standins, tmp_path, monkeypatch, steps: str, layers: int = 2):
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS=steps)
    engine = StandinEngine("FLASHINFER_TS", layers=layers, seq_lens=(300, 77, 150), query_len=4)
    _record_graph(engine, 16, 4, monkeypatch)
    return engine, vllm_plugin._state


def _held_capture_thread(state, monkeypatch):
    """The capture thread stuck before it reads anything of its first job until the returned event is set."""
    import threading

    started, release, real = threading.Event(), threading.Event(), state._capture_graph_job

    def held(*args, **kwargs):
        started.set()
        assert release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(state, "_capture_graph_job", held)
    return started, release


def test_a_staged_graph_step_is_exact_however_late_the_capture_thread_reads_it(standins, tmp_path, monkeypatch):
    """The engine's thread stages the wanted step on its stream and goes on, never waiting; the next step then
    overwrites the graph's buffers, the caches and the runner's block table, lengths and offsets before the capture
    thread has read anything, and the snapshots still hold the step as the kernel saw it. The build copied none of
    its metadata: the staging program did, after the replay."""
    import time as clock

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0")
    started, release = _held_capture_thread(state, monkeypatch)
    table = torch.zeros(8, 64, dtype=torch.int32)  # the runner's persistent block table
    common = _padded(engine.common(), reqs=4, tokens=16, table_buffer=table)
    block_table = common.block_table_tensor[:3].clone()
    before = clock.monotonic()
    outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch)
    queries = [state._graph_buffers[name].query[:12].clone() for name in engine.names]
    assert clock.monotonic() - before < 0.5 and state._graph_job is None  # nothing for the next step to wait on
    assert started.wait(5)
    caches = [layer.kv_cache.clone() for layer in engine.layers]
    state.await_graph_capture()  # the next step's first hook: a no-op
    for name, layer in zip(engine.names, engine.layers):  # the next step, before the capture thread reads
        state._graph_buffers[name].query.fill_(7.0)
        state._graph_buffers[name].output.fill_(7.0)
        layer.kv_cache.fill_(7.0)
    table.random_(1, 70)
    common.seq_lens.fill_(5)
    common.query_start_loc.fill_(1)
    release.set()
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["layer"])
    assert len(snaps) == 2
    assert all(state._graph_builds[name][1].deferred is not None for name in engine.names)  # never copied
    for snap, output, query, cache in zip(snaps, outputs, queries, caches):
        step = snap.steps[0]
        assert step.seq_lens.tolist() == [300, 77, 150] and step.query_start_loc.tolist() == [0, 4, 8, 12]
        assert step.block_table.shape == block_table.shape
        torch.testing.assert_close(step.block_table, block_table, rtol=0, atol=0)
        torch.testing.assert_close(step.query.reshape(12, -1), query.reshape(12, -1), rtol=0, atol=0)
        torch.testing.assert_close(step.output.reshape(12, -1), output[:12].reshape(12, -1), rtol=0, atol=0)
        torch.testing.assert_close(snap.kv_cache, cache[snap.page_ids.long()], rtol=0, atol=0)
        live = {int(p) for r, n in enumerate([300, 77, 150]) for p in block_table[r, :-(-n // 16)]}
        assert set(snap.page_ids.tolist()) == live  # the pages the step read, not the bound's extra ones
    account = vllm_plugin.active_capturer().engine_time
    assert account.handed == 1 and account.staged == 1 and account.waits == 0
    assert "1 graph step(s) handed to the capture thread (1 staged on the device first)" in account.describe()


def test_a_wanted_step_replays_the_graph_with_the_staging_inside_and_costs_the_engines_thread_no_torch_op(
        standins, tmp_path, monkeypatch, caplog):
    """Each full graph is recorded a third time with kvdbg's staging after the forward. A step nothing wants replays
    the plain graph; a wanted one the staged graph, which works each request's pages out from the lengths the graph
    read: the engine's thread makes no torch call at the build or after the replay (none per layer, no program to
    launch, no event). The next step then overwrites the graph's buffers, the caches and the runner's buffers before
    the capture thread reads anything, and the snapshots still hold the step as the kernel saw it."""
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "1", layers=3)
    wrapper, entry = _record_variants(16)
    assert len(state._staged_variants) == 1 and "also recorded with kvdbg's staging in it" in caplog.text
    program = next(iter(state._staged_variants.values()))[1]
    started, release = _held_capture_thread(state, monkeypatch)
    calls = {"after_build": _TorchCalls(), "after_graph_replay": _TorchCalls(), "choose_graph": _TorchCalls()}
    for hook, counter in calls.items():
        def counted(*args, _real=getattr(state, hook), _counter=counter, **kwargs):
            with _counter:
                return _real(*args, **kwargs)

        monkeypatch.setattr(state, hook, counted)
    # The step's real requests are left to the capture thread (from the offsets the graph staged): the engine's
    # thread never reads the build's host offsets for them.
    from kvdbg.vllm_plugin import builder_hooks, vllm_facts

    counted_requests = []
    for module in (builder_hooks, vllm_facts):
        monkeypatch.setattr(module, "_requests_with_tokens", lambda common, _real=vllm_facts._requests_with_tokens: (
            counted_requests.append(1), _real(common))[1])
    replayed = []
    for step in range(2):
        for counter in calls.values():
            counter.names.clear()
        counted_requests.clear()
        common = _padded(engine.common(), reqs=4, tokens=16)
        inputs = _padded_inputs(engine, 16)
        outputs = _run_as_graph(engine, common, inputs, 16, monkeypatch, wrapper=wrapper)
        replayed.append(entry.cudagraph)
    assert replayed == ["plain", "staged"] and state.staged_replays == 1 and state._graph_job is None
    assert counted_requests == []
    reads = {"__get__", "__len__", "dim", "stride", "data_ptr", "numel", "numpy"}  # a tensor's facts, no op
    for hook, counter in calls.items():
        assert [n for n in counter.names if n not in reads] == [], (hook, counter.names)
    block_table = common.block_table_tensor[:3].clone()
    queries = [state._graph_buffers[name].query[:12].clone() for name in engine.names]
    caches = [layer.kv_cache.clone() for layer in engine.layers]
    assert started.wait(5)
    for name, layer in zip(engine.names, engine.layers):  # the next step, before the capture thread reads
        state._graph_buffers[name].query.fill_(7.0)
        state._graph_buffers[name].output.fill_(7.0)
        layer.kv_cache.fill_(7.0)
    common.block_table_tensor.random_(1, 70)
    common.seq_lens.fill_(5)
    common.query_start_loc.fill_(1)
    common.query_start_loc_cpu.fill_(16)  # the host's offsets too: every row "padding" if read now
    release.set()
    assert state.drain_graph_capture(10)
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["layer"])
    assert len(snaps) == 3 and {s.meta.capture["step"] for s in snaps} == {1}
    for snap, output, query, cache in zip(snaps, outputs, queries, caches):
        step = snap.steps[0]
        assert step.num_reqs == 3 and step.seq_lens.tolist() == [304, 81, 154]
        assert step.query_start_loc.tolist() == [0, 4, 8, 12]
        torch.testing.assert_close(step.block_table, block_table, rtol=0, atol=0)
        torch.testing.assert_close(step.query.reshape(12, -1), query.reshape(12, -1), rtol=0, atol=0)
        torch.testing.assert_close(step.output.reshape(12, -1), output[:12].reshape(12, -1), rtol=0, atol=0)
        torch.testing.assert_close(snap.kv_cache, cache[snap.page_ids.long()], rtol=0, atol=0)
        live = {int(p) for r, n in enumerate([304, 81, 154]) for p in block_table[r, :-(-n // 16)]}
        assert set(snap.page_ids.tolist()) == live
    account = vllm_plugin.active_capturer().engine_time
    assert account.handed == 1 and account.staged == 1 and account.in_graph == 1 and account.waits == 0
    assert "(1 staged on the device first, 1 of them inside vLLM's graph)" in account.describe()
    assert not program.held and program.reusable()


def test_a_wanted_build_tells_the_choice_of_graph_which_asks_nothing_again_unless_something_moved(
        standins, tmp_path, monkeypatch):
    """A build that finds every layer wanted at one step hands that to the next choice of graph, which then replays the
    staged variant without asking the filters again; the answer is not taken when a forward was counted since, the
    filters changed, or the program is held: the choice then asks as it always did."""
    import types

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-20", layers=3)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    batch = _Batch((16,))
    asked = []
    for name in ("_step_wants_copies", "_every_layer_wanted"):
        real = getattr(type(state), name)
        monkeypatch.setattr(type(state), name, lambda self, *a, _real=real, _name=name, **k: (
            asked.append(_name), _real(self, *a, **k))[1])
    epoch = state._counts_epoch
    outputs = _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                            monkeypatch, wrapper=wrapper)
    assert entry.cudagraph == "staged" and asked == [] and state._prepared is None
    assert state._counts_epoch > epoch  # the replay counted the layers' forwards
    assert state.drain_graph_capture(10) and state.capturer.flush(10)
    snaps = snapshots(tmp_path)
    assert len(snaps) == 3 and {s.meta.capture["step"] for s in snaps} == {0}
    for snap in snaps:
        layer = engine.names.index(snap.meta.capture["layer"])
        torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), outputs[layer][:12].reshape(12, -1),
                                   rtol=0, atol=0)

    def choose_after(change):
        asked.clear()
        engine.builder.build(0, _padded(engine.common(), reqs=4, tokens=16))
        # A step of the shape was staged inside the graph above: the build is kept on its ticket, as given.
        assert state._pending_build is not None and state._prepared is None
        change()
        state.choose_graph(wrapper, batch)
        state._in_graph_ran = None  # this test replays nothing: the choice is what it looks at
        return entry.cudagraph

    # A forward counted between the build and the choice (an eager forward moves the epoch as every count does):
    # asked again, and the layers no longer at one step replay the graph with the copies.
    def forward_counted():  # as an eager forward's hook counts it (the last lines check that hook moves the epoch)
        state._forward_counts[engine.names[0]] += 1
        state._counts_epoch += 1

    assert choose_after(forward_counted) == "copies" and asked[0] == "_step_wants_copies"
    state._forward_counts.update({n: 5 for n in engine.names})
    # The filters changed: asked again (and still wanted: the staged variant).
    assert choose_after(lambda: state.capturer.reconfigure(steps=None)) == "staged" and asked
    # The program held by a reader: asked again, and the graph with the copies replays.
    assert choose_after(program.hold) == "copies" and asked
    program.release(issued=False)
    # A choice that returns early (vLLM let the graph go) lets the build's answer go too: no later choice takes it.
    engine.builder.build(0, _padded(engine.common(), reqs=4, tokens=16))
    assert state._pending_build is not None  # a new step filter, the same layers: the ticket still holds
    state.choose_graph(types.SimpleNamespace(concrete_cudagraph_entries={}), batch)
    # The step runs as vLLM wills: its build kept for the hooks that read it, no answer left for a later choice.
    assert state._prepared is None and state._pending_build is None
    assert all(state._graph_builds[name][0] == state._forward_counts[name] for name in engine.names)
    before = state._counts_epoch
    engine.step(common=engine.common())  # an eager step counts each layer's forward
    assert state._counts_epoch >= before + len(engine.names)


def test_later_wanted_steps_of_a_shape_are_handed_on_its_ticket_and_each_snapshot_holds_its_own_step(
        standins, tmp_path, monkeypatch):
    """Once a wanted step of a shape was staged inside vLLM's graph, the shape's later wanted builds keep nothing (no
    context, no entry per layer): the choice of graph takes the staged variant on the ticket, the replay's hook counts
    the forwards and hands the build as given to the capture thread, which makes the step's context there. The
    engine's thread makes no torch call, each step is captured whole, and the next step's rewrites of the runner's
    buffers, the caches and the graph's buffers (made before the thread reads) reach none of it."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-3", layers=3)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    kept, made = [], []
    real_keep, real_job = state._keep_build, state._ticket_job
    monkeypatch.setattr(state, "_keep_build", lambda *a, **k: (kept.append(a[4]), real_keep(*a, **k))[1])
    monkeypatch.setattr(state, "_ticket_job", lambda fast: (made.append(fast[3][4]), real_job(fast))[1])
    calls = _TorchCalls()
    for hook in ("after_build", "choose_graph", "after_graph_replay"):
        def counted(*args, _real=getattr(state, hook), **kwargs):
            with calls:
                return _real(*args, **kwargs)

        monkeypatch.setattr(state, hook, counted)
    expected = []
    for step in range(4):
        calls.names.clear()
        started, release = _held_capture_thread(state, monkeypatch)
        common = _padded(engine.common(), reqs=4, tokens=16)
        outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch, wrapper=wrapper)
        assert entry.cudagraph == "staged"
        if step:  # handed on the ticket: the hooks read no tensor's data, made no op
            reads = {"__get__", "__len__"}
            assert [n for n in calls.names if n not in reads] == [], (step, calls.names)
            assert state._graph_builds[engine.names[0]][0] == 0  # the first step's entry: nothing kept since
        expected.append((common.block_table_tensor[:3].clone(), common.seq_lens[:3].tolist(),
                         [o[:12].clone() for o in outputs], [layer.kv_cache.clone() for layer in engine.layers]))
        assert started.wait(5)
        for name, layer in zip(engine.names, engine.layers):  # the next step's work, before the thread reads
            state._graph_buffers[name].output.fill_(7.0)
            layer.kv_cache.fill_(7.0)
        common.block_table_tensor.random_(1, 70)
        common.seq_lens.fill_(5)
        common.query_start_loc_cpu.fill_(16)
        release.set()
        assert state.drain_graph_capture(10)
        for layer, cache in zip(engine.layers, expected[-1][3]):  # the engine's cache as the step left it
            layer.kv_cache.copy_(cache)
        program.poll_released(wait=True)
    assert kept == [0] and made == [1, 2, 3] and len(state._tickets) == 1
    assert {state._forward_counts[n] for n in engine.names} == {4}
    snaps = snapshots(tmp_path)
    assert len(snaps) == 12 and state.capturer.dropped["internal"] == 0
    for snap in snaps:
        step, layer = snap.meta.capture["step"], engine.names.index(snap.meta.capture["layer"])
        table, seq_lens, outputs, caches = expected[step]
        assert snap.steps[0].num_reqs == 3 and snap.steps[0].seq_lens.tolist() == seq_lens
        torch.testing.assert_close(snap.steps[0].block_table, table, rtol=0, atol=0)
        torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), outputs[layer].reshape(12, -1), rtol=0,
                                   atol=0)
        torch.testing.assert_close(snap.kv_cache, caches[layer][snap.page_ids.long()], rtol=0, atol=0)
    account = vllm_plugin.active_capturer().engine_time
    assert account.handed == 4 and account.staged == 4 and account.in_graph == 4 and account.waits == 0
    assert not program.held


def test_a_staged_steps_metadata_and_page_ids_are_read_before_any_layer_is_captured(standins, tmp_path,
                                                                                     monkeypatch):
    """The capture thread reads a staged step's metadata and page ids back first, before the pages' copies (on a
    GPU, issued ahead for every layer: a read after them would wait behind them all) and before any layer's capture,
    which then finds them read; the step is captured whole."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-1", layers=3)
    wrapper, entry = _record_variants(16)
    seen = []
    real_start = state.start_capture

    def start_capture(*args, staged=None, **kwargs):
        seen.append((staged.step._metadata is not None, staged.step._unique is not None))
        return real_start(*args, staged=staged, **kwargs)

    monkeypatch.setattr(state, "start_capture", start_capture)
    for _ in range(2):
        common = _padded(engine.common(), reqs=4, tokens=16)
        _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch, wrapper=wrapper)
        assert entry.cudagraph == "staged" and state.drain_graph_capture(10)
    assert seen == [(True, True)] * 6
    assert len(snapshots(tmp_path)) == 6 and state.capturer.dropped["internal"] == 0


def _assert_each_snapshot_is_its_step(snaps, expected, engine):
    """Each snapshot holds its own step: the lengths and the layer's output (its 12 real tokens) the engine had at
    the step its metadata names (``expected``: step -> (seq_lens, each layer's output))."""
    for snap in snaps:
        seq_lens, outputs = expected[snap.meta.capture["step"]]
        layer = engine.names.index(snap.meta.capture["layer"])
        assert snap.steps[0].seq_lens.tolist() == seq_lens
        torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), outputs[layer].reshape(12, -1), rtol=0,
                                   atol=0)


def test_a_ticketed_step_through_vllms_graph_wrapper_is_told_without_the_choice_and_captured_whole(
        standins, tmp_path, monkeypatch):
    """Through kvdbg's patch of vLLM's graph wrapper, a step whose build was kept on its shape's ticket is told by
    ``ticket_replay`` alone (no ``graph_call``, no choice of graph): the staged variant replays and the replay's hook
    hands the step to the capture thread, each snapshot its own step. When the ticket cannot serve the call (the
    program still held, a forward counted since the build, another graph, vLLM's graphs let go), the call is asked
    as any other."""
    import types

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-20", layers=3)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    asked: list = []
    for hook in ("graph_call", "choose_graph", "ticket_replay"):
        def spied(*args, _real=getattr(state, hook), _name=hook, **kwargs):
            asked.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(state, hook, spied)

    def step(**change):
        asked.clear()
        common = _padded(engine.common(), reqs=4, tokens=16)
        outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch, wrapper=wrapper,
                                through=True, **change)
        assert state.drain_graph_capture(10)
        program.poll_released(wait=True)
        return common.seq_lens[:3].tolist(), [o[:12].clone() for o in outputs]

    expected = [step()]
    assert "choose_graph" in asked and len(state._tickets) == 1  # the shape's first wanted step earns the ticket
    for _ in range(2):
        expected.append(step())
        assert asked == ["ticket_replay"] and entry.cudagraph == "staged"
    # The program held by a reader: asked as any call, the graph with the copies replays, the step staged from the host.
    program.hold()
    expected.append(step())
    assert asked == ["ticket_replay", "graph_call", "choose_graph"] and entry.cudagraph == "copies"
    program.release(issued=False)
    # A forward counted between the build and the call: asked again, and still wanted on every layer (staged).
    real_build = engine.builder.build

    def build_then_count(*args, **kwargs):
        metadata = real_build(*args, **kwargs)
        state._counts_epoch += 1  # as any forward's count moves it (the layers still at one step)
        return metadata

    monkeypatch.setattr(engine.builder, "build", build_then_count)
    expected.append(step())
    assert asked == ["ticket_replay", "graph_call", "choose_graph"] and entry.cudagraph == "staged"
    monkeypatch.setattr(engine.builder, "build", real_build)
    # Each fact the ticket holds, moved after the build: not told on the ticket, the build still kept for the call's
    # other hooks, the entry as it was.
    batch = _Batch((16,))
    other = _Batch((8,))  # another graph of the same wrapper, with variants of its own (here the same entry)
    wrapper.concrete_cudagraph_entries[other] = entry
    state._graph_variants[(id(wrapper), other)] = state._graph_variants[(id(wrapper), batch)]
    mode = wrapper.runtime_mode
    pieces = types.SimpleNamespace(name="PIECEWISE")
    elsewhere = types.SimpleNamespace(concrete_cudagraph_entries=wrapper.concrete_cudagraph_entries, runtime_mode=mode)
    state._graph_variants[(id(elsewhere), batch)] = state._graph_variants[(id(wrapper), batch)]
    job, sentinel, config = object(), object(), state.capturer.config
    cases = {  # (the call's wrapper, its batch, its mode), then what else moved (and how it is put back)
        "another graph": ((wrapper, other, mode), None, None),
        "another wrapper": ((elsewhere, batch, mode), None, None),
        "another mode": ((wrapper, batch, pieces), None, None),
        "filters changed": ((wrapper, batch, mode), lambda: state.capturer.reconfigure(steps="0-30"),
                            lambda: state.capturer.reconfigure(steps="0-20")),
        "a capture out": ((wrapper, batch, mode), lambda: setattr(state, "_graph_job", job),
                          lambda: setattr(state, "_graph_job", None)),
        "the sentinel on": ((wrapper, batch, mode), lambda: setattr(state, "sentinel", sentinel),
                            lambda: setattr(state, "sentinel", None)),
        "a forward counted": ((wrapper, batch, mode), lambda: setattr(state, "_counts_epoch", state._counts_epoch + 1),
                              None),
        # Last (its tickets gone): vLLM's clear_graphs, which empties the wrapper's table in place (the same dict).
        "vLLM's graphs let go": ((wrapper, batch, mode), lambda: (state.forget_graphs(wrapper),
                                                                 wrapper.concrete_cudagraph_entries.clear()), None),
    }
    for case, ((called, seen, seen_mode), move, back) in cases.items():
        engine.builder.build(0, _padded(engine.common(), reqs=4, tokens=16))
        pending = state._pending_build
        assert pending is not None, case
        if move is not None:
            move()
        forward = types.SimpleNamespace(cudagraph_runtime_mode=seen_mode, batch_descriptor=seen)
        state._forward_context = (lambda: True, lambda: forward)
        before = (entry.cudagraph, state.staged_replays)
        assert state.ticket_replay(called) is None, case
        assert state._pending_build is pending and state._in_graph_ran is None, case
        assert (entry.cudagraph, state.staged_replays) == before, case
        if back is not None:
            back()
        state._settle_build()
    assert state.capturer.config is not config  # reconfigured back: a new configuration, the same filters
    snaps = snapshots(tmp_path)
    assert sorted({s.meta.capture["step"] for s in snaps}) == list(range(len(expected))) and len(snaps) == 15
    _assert_each_snapshot_is_its_step(snaps, expected, engine)
    account = vllm_plugin.active_capturer().engine_time
    assert account.handed == 5 and account.staged == 5 and account.in_graph == 4 and account.waits == 0
    assert state.capturer.dropped["internal"] == 0 and not program.held


def test_a_wanted_step_at_the_end_of_a_quiet_run_is_told_at_its_build_on_its_ticket_without_reading_a_count(
        standins, tmp_path, monkeypatch):
    """Capture armed for a few steps, as a user arms it: the graph's replays between two wanted steps run as a quiet
    run, which stops at the next step the filters take. That step's build is told on its shape's ticket right at the
    run's end, by the build's own lines, with the run's step (the layers' counts neither read nor written then; the
    builder's selected layers those the ticket holds under the run's configuration), its replay moves the run on,
    and its snapshots are those of the steps the filters named, each layer's from its own step, the counts after it
    what the engine's forwards make them. With capture off by then, or no room left under the snapshot limit, the
    step is asked as any other build: nothing kept on the ticket, nothing captured."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "2,5,8,11", layers=3)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    told, real = [], state._on_ticket

    def on_ticket(*args):
        told.append((args[4:], state._uncounted is not None))
        return real(*args)

    monkeypatch.setattr(state, "_on_ticket", on_ticket)
    expected, pending = {}, {}
    for step in range(12):
        if step == 11:  # capture off before the last wanted step: asked as any build, nothing kept or captured
            assert state.capturer.flush(10)  # (what turning it off finds with the writer is dropped)
            state.capturer.disable("the test is done with it")
        told.clear()
        common = _padded(engine.common(), reqs=4, tokens=16)
        real_build = engine.builder.build

        def build(*args, **kwargs):
            metadata = real_build(*args, **kwargs)
            pending[step] = (state._pending_build is not None, state._uncounted is not None)
            return metadata

        monkeypatch.setattr(engine.builder, "build", build)
        outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch, wrapper=wrapper,
                                through=True)
        monkeypatch.setattr(engine.builder, "build", real_build)
        assert state.drain_graph_capture(10)
        program.poll_released(wait=True)
        expected[step] = (common.seq_lens[:3].tolist(), [o[:12].clone() for o in outputs])
        if step in (5, 8):  # told at the run's end by the build's own lines (nothing asked of _on_ticket, which
            # reads the counts): kept on the ticket, the layers' counts still unwritten at the build
            assert told == [] and pending[step] == (True, True), step
            assert entry.cudagraph == "staged"
        elif step == 2:  # the shape's first wanted step: asked, and it earns the ticket
            assert told == [] and pending[step][0] is False
        elif step == 11:  # capture off: refused at the run's end, then asked as any build, which keeps nothing
            assert told == [] and pending[step][0] is False
        if step in (2, 5, 8, 11):  # every layer's forwards, read back (a read writes a quiet run's counts in)
            assert set(state._forward_counts.values()) == {step + 1}, step
    snaps = snapshots(tmp_path)
    assert sorted({s.meta.capture["step"] for s in snaps}) == [2, 5, 8] and len(snaps) == 9
    _assert_each_snapshot_is_its_step(snaps, expected, engine)
    assert state.capturer.dropped["internal"] == 0 and state.capturer.dropped["off"] == 3 and not program.held


def _kept_at_run_ends(engine, state, monkeypatch) -> dict:
    """{step: whether its build was kept on its shape's ticket} for each build at a quiet run's end (the step the run
    stopped at because capture's filters take it), filled as the engine builds."""
    kept, real_build = {}, engine.builder.build

    def build(*args, **kwargs):
        run = state._quiet_run
        at_end = run is not None and run.step == run.taken
        metadata = real_build(*args, **kwargs)
        if at_end:
            kept[run.step] = state._pending_build is not None
        return metadata

    monkeypatch.setattr(engine.builder, "build", build)
    return kept


def test_a_quiet_runs_end_that_the_snapshot_limit_leaves_no_room_for_is_not_told_on_the_ticket(
        standins, tmp_path, monkeypatch):
    """The snapshot limit reached by the wanted steps before: the step a quiet run stopped at is asked as any build
    (the limit turns capture off there), not kept on its ticket."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "2,7,12", layers=3)
    state.capturer.reconfigure(max_snapshots=6)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    kept = _kept_at_run_ends(engine, state, monkeypatch)
    for step in range(13):
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)
        assert state.drain_graph_capture(10) and state.capturer.flush(10)  # the limit counts the writer's too
        program.poll_released(wait=True)
    # Each a run's end: 2 before the shape has a ticket, 7 told on it, 12 refused (no room)
    assert kept == {2: False, 7: True, 12: False}
    assert sorted({s.meta.capture["step"] for s in snapshots(tmp_path)}) == [2, 7]
    assert not state.capturer.active and set(state._forward_counts.values()) == {13}


def test_a_quiet_runs_end_under_a_new_layer_filter_is_not_told_on_a_ticket_made_under_the_old_one(
        standins, tmp_path, monkeypatch):
    """A ticket holds the builder's selected layers under the filters it was made (or last found) under: once the
    layer filter selects fewer, the next quiet run's end is asked as any build, and only the layers now selected
    are captured."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "2,6,10", layers=3)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    kept = _kept_at_run_ends(engine, state, monkeypatch)
    for step in range(11):
        if step == 7:  # after step 6, told on the ticket: one layer selected from now on
            state.capturer.select_layers(engine.names[1])
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)
        assert state.drain_graph_capture(10)
        program.poll_released(wait=True)
    assert kept.get(6) is True and kept.get(10) is not True
    layers = sorted((s.meta.capture["step"], s.meta.capture["layer"]) for s in snapshots(tmp_path))
    assert layers == sorted([(2, n) for n in engine.names] + [(6, n) for n in engine.names] + [(10, engine.names[1])])
    assert state.capturer.dropped["internal"] == 0


def test_a_build_kept_on_its_ticket_is_kept_as_any_build_when_its_step_is_not_handed_on_it(
        standins, tmp_path, monkeypatch):
    """A ticketed build whose step does not replay the staged variant is kept as any build when something reads it:
    run eagerly (its forwards find their context), the program held (the graph with the copies replays and the step
    is staged as before), a step longer than the program's pages hold (told at the build), or a build that handed
    buffers other than those the graph read (the capture thread finds it and says the step lost, in words)."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-20", layers=2)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch,
                  wrapper=wrapper)
    assert len(state._tickets) == 1 and state.drain_graph_capture(10)
    program.poll_released(wait=True)
    # Run eagerly after all: the forwards' hooks keep the build first, and capture it as any eager step.
    engine.step(common=_padded(engine.common(), reqs=4, tokens=16))
    assert state._pending_build is None
    # The program held: the step replays the graph with the copies and is staged from the host.
    program.hold()
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch,
                  wrapper=wrapper)
    assert entry.cudagraph == "copies"
    program.release(issued=False)
    assert state.drain_graph_capture(10)
    # Longer than the program's pages hold at the shape's rows: the build tells it, and keeps its context.
    ticket = next(iter(state._tickets.values()))
    longest, ticket.max_seq_len = ticket.max_seq_len, 100
    engine.builder.build(0, _padded(engine.common(), reqs=4, tokens=16))
    assert state._pending_build is None and state._prepared is not None
    ticket.max_seq_len = longest
    snaps = snapshots(tmp_path)
    assert sorted({s.meta.capture["step"] for s in snaps}) == [0, 1, 2] and len(snaps) == 6
    for snap in snaps:
        if snap.meta.capture["step"] == 1:  # the eager step: the layer's own forward
            assert "full CUDA graph" not in (snap.meta.capture.get("notes") or "")


def test_a_tickets_longest_request_is_told_from_the_padded_rows_and_its_thread_reads_no_host_buffer(
        standins, tmp_path, monkeypatch):
    """A wanted step whose pages the cheap bound (padded rows x max_seq_len) does not tell is served on the build's
    bound, which works its real requests out; the shape's ticket still takes its longest request from the padded
    rows, so a later build that only the bound could tell goes the way every build went, on the engine's thread.
    The capture thread tells a ticketed step without the build's host buffers (the engine's again by then)."""
    import dataclasses
    import threading

    from kvdbg.vllm_plugin import vllm_facts

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-20", layers=2)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    monkeypatch.setattr(program, "size", 64)  # fewer positions than 4 rows of the longest request's pages

    def padded():  # with vLLM's host bound on each request's length, as its runner gives it
        common = _padded(engine.common(), reqs=4, tokens=16)
        return dataclasses.replace(common, seq_lens_cpu_upper_bound=common.seq_lens.clone())

    def step():
        _run_as_graph(engine, padded(), _padded_inputs(engine, 16), 16, monkeypatch, wrapper=wrapper)
        assert state.drain_graph_capture(10)
        program.poll_released(wait=True)
        return entry.cudagraph

    assert step() == "staged"  # on the bound: its 3 requests' 34 pages fit
    ticket = next(iter(state._tickets.values()))
    per_row = 64 // 4
    assert ticket.max_seq_len == (float("inf") if per_row >= program.width else per_row * program.page_size)
    engine.builder.build(0, padded())
    assert state._pending_build is None  # max_seq_len 308 is past the padded rows' 256: told at the build
    state._prepared = None
    # Nothing the capture thread tells reads the build's host buffers: a ticketed step over the cheap bound is
    # refused there, never worked out from them.
    engine_thread, real = threading.get_ident(), vllm_facts._requests_with_tokens
    monkeypatch.setattr(vllm_facts, "_requests_with_tokens", lambda common: real(common)
                        if threading.get_ident() == engine_thread else pytest.fail("host buffers read off the engine"))
    hint = state._graph_builds[engine.names[0]][1].stage
    from kvdbg.vllm_plugin.graph_staging import stage_hint

    fresh = stage_hint(hint.common, (hint.block_table, hint.seq_lens, hint.query_start_loc), -1)
    assert program.serves(fresh, host=False) == 0
    assert step() == "staged"
    assert sorted({s.meta.capture["step"] for s in snapshots(tmp_path)}) == [0, 1]


def test_a_ticketed_step_whose_build_handed_other_buffers_is_lost_in_words(standins, tmp_path, monkeypatch):
    """The capture thread checks that the build handed the buffers the graph read (the engine's thread no longer
    does): a build of new tensors replays the staged variant on its ticket and each layer's step is said lost,
    the program let go, nothing raised into vLLM."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-1", layers=2)
    wrapper, entry = _record_variants(16)
    program = next(iter(state._staged_variants.values()))[1]
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch,
                  wrapper=wrapper)
    assert state.drain_graph_capture(10)
    program.poll_released(wait=True)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16, persistent=False), _padded_inputs(engine, 16),
                  16, monkeypatch, wrapper=wrapper)
    assert entry.cudagraph == "staged" and state.drain_graph_capture(10)
    assert state.capturer.dropped["input"] == 2 and not program.held
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [0, 0]


def test_replays_nothing_can_want_are_told_ahead_until_a_step_the_filter_takes_or_a_count_moves(
        standins, tmp_path, monkeypatch):
    """Armed, a graph step nothing wants tells the steps after it at once, as far as the step filter takes none (at
    most QUIET_AHEAD): their builds and choices of graph ask no filter, their replays count each layer's forward. The
    first step the filter takes ends the run and is captured; an eager step (its counts move) or new filters end it
    too, and the next step is asked as before."""
    import threading

    from kvdbg.capture.config import IntRanges
    from kvdbg.vllm_plugin.graph_hooks import QUIET_AHEAD

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "6", layers=3)
    wrapper, entry = _record_variants(16)
    asked, engine_thread = [], threading.get_ident()
    for owner, name in ((type(state), "_step_wants_copies"), (type(state.capturer), "selects_step")):
        real = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda self, *a, _real=real, _name=name, **k: (
            threading.get_ident() == engine_thread and asked.append(_name), _real(self, *a, **k))[1])

    def graph_step():
        asked.clear()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch,
                      wrapper=wrapper)
        return entry.cudagraph, bool(asked)

    steps = [graph_step() for _ in range(9)]
    assert [graph for graph, _ in steps] == ["plain"] * 6 + ["staged", "plain", "plain"]
    assert [ask for _, ask in steps] == [True, False, False, False, False, False, True, True, False]
    assert {state._forward_counts[n] for n in engine.names} == {9}
    assert state._quiet_run.horizon == 8 + QUIET_AHEAD  # from step 8 on, no step the filter takes
    assert [s.meta.capture["step"] for s in snapshots(tmp_path)] == [6, 6, 6]
    engine.step(common=engine.common())  # an eager step: every layer's count moves on, the run's no longer holds
    assert graph_step() == ("plain", True) and graph_step() == ("plain", False)
    state.capturer.reconfigure(steps=IntRanges.of("12", "steps"))  # new filters: asked again, the run told anew
    assert graph_step() == ("staged", True)
    assert {state._forward_counts[n] for n in engine.names} == {13}
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [6, 6, 6, 12, 12, 12]


def test_a_quiet_runs_replays_through_vllms_wrapper_ask_nothing_and_choose_and_count_as_when_asked(
        standins, tmp_path, monkeypatch):
    """Through the plugin's patch of vLLM's graph wrapper, a replay of a quiet run (the same graph, nothing counted
    or handed between, the same filters) skips the graph call's questions altogether (graph_hooks.quiet_replay):
    the same variants are installed, the same forwards counted and the same steps captured as when every replay is
    asked; a replay of another graph, or a step the run did not tell, is asked as before."""
    from kvdbg.vllm_plugin.graph_hooks import GraphHooks

    def nine_steps(through):
        engine, state = _staged_engine(standins, tmp_path / str(through), monkeypatch, "6", layers=3)
        wrapper, entry = _record_variants(16)
        asked = []
        real = GraphHooks.graph_call
        monkeypatch.setattr(GraphHooks, "graph_call", lambda self, w: (asked.append(self._forward_counts.get(
            engine.names[0], 0)), real(self, w))[1])
        chosen = []
        for _ in range(9):
            _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                          monkeypatch, wrapper=wrapper, through=through)
            chosen.append(entry.cudagraph)
        assert state.drain_graph_capture(10)
        counts = {state._forward_counts[n] for n in engine.names}
        plain, nine = state.plain_replays, list(asked)
        # Another graph's replay (a batch of 32 tokens) is no step of the run: asked, and the run's next step too.
        _record_graph(engine, 32, 4, monkeypatch)
        other = _record_variants(32)[0]
        asked.clear()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=32), _padded_inputs(engine, 32), 32,
                      monkeypatch, wrapper=other, through=through)
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=through)
        after_other = list(asked)
        steps = sorted(s.meta.capture["step"] for s in snapshots(tmp_path / str(through)))
        monkeypatch.setattr(GraphHooks, "graph_call", real)
        vllm_plugin.unregister()
        return chosen, counts, plain, steps, nine, after_other

    chosen_each, counts_each, plain_each, steps_each, _, _ = nine_steps(False)
    chosen, counts, plain, steps, asked, after_other = nine_steps(True)
    assert (chosen, counts, plain, steps) == (chosen_each, counts_each, plain_each, steps_each)
    assert chosen == ["plain"] * 6 + ["staged", "plain", "plain"] and counts == {9} and steps == [6, 6, 6]
    # Through the wrapper, steps 1 to 5 (told at step 0) asked nothing; step 0, step 6 (the first the filter takes)
    # and step 7 (no run told yet) were asked; step 8 (told at step 7) is asked only while step 6's capture was
    # still being issued.
    assert asked[:3] == [0, 6, 7] and set(asked) <= {0, 6, 7, 8}
    assert after_other == [9, 10]  # both asked: the other graph is not the run's, and it moved the counts on


def test_a_quiet_run_lends_its_builders_vllms_own_build_and_takes_it_back_before_any_step_it_did_not_tell(
        standins, tmp_path, monkeypatch):
    """Once a quiet run's replay went through vLLM's graph wrapper, the builders whose layers the run holds get vLLM's
    own build, and the worker its own execute_model (graph_hooks._lend_builders): the run's next steps run no hook
    of kvdbg's but the graph wrapper's. They get the hooks back
    before the build of any step the run did not tell: the step the filter takes (captured as before), a step after
    an eager one, another graph's, new filters (from any thread), and when the plugin goes away."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    from kvdbg.capture.config import IntRanges

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "4", layers=3)
    _record_graph(engine, 32, 4, monkeypatch)
    other = _record_variants(32)[0]
    wrapper, entry = _record_variants(16)
    worker = WorkerWrapperBase()
    builds = []
    real = type(state).after_build
    monkeypatch.setattr(type(state), "after_build", lambda self, builder, *a: (builds.append(builder),
                                                                                real(self, builder, *a))[1])

    def graph_step(tokens=16, on=wrapper):
        builds.clear()
        worker.execute_model(lambda: _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=tokens),
                                                   _padded_inputs(engine, tokens), tokens, monkeypatch, wrapper=on,
                                                   through=True))
        return len(builds), lent()

    def lent():
        if "build" in vars(engine.builder):
            assert "execute_model" in vars(worker)  # lent together
        return "build" in vars(engine.builder)

    def worker_lent():
        return "execute_model" in vars(worker)

    # A host copy of another buffer's slot mapping, as a GPU engine's prefill step leaves (only read before the
    # forward it was made for): it does not keep the run from lending.
    state._host_slots[-1] = (("another buffer",), torch.zeros(4), None)
    # Step 0 asked (a run told to step 4); step 1 the run's first replay, its build hooked, then the builder lent;
    # steps 2 and 3 built with vLLM's own build; after step 3's replay the next step is the one the filter takes.
    assert [graph_step() for _ in range(4)] == [(1, False), (1, True), (0, True), (0, False)]
    assert entry.cudagraph == "plain" and {state._forward_counts[n] for n in engine.names} == {4}
    # The worker's execute_model stays vLLM's own past the run (its hook only waits for a capture that reads the
    # engine's memory; handing one over takes it back first), until an eager step, new filters or the plugin's end.
    assert worker_lent()
    assert graph_step() == (1, False) and entry.cudagraph == "staged"  # step 4: told by its hooked build, captured
    assert state.drain_graph_capture(10) and state.capturer.flush(10)
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [4, 4, 4]
    assert [graph_step() for _ in range(3)] == [(1, False), (1, True), (0, True)]  # steps 5 (asked) to 7
    assert worker_lent()
    engine.step(common=engine.common())  # an eager step 8: its layers' forwards take the builder back
    assert not lent() and not worker_lent() and {state._forward_counts[n] for n in engine.names} == {9}
    engine.seq_lens = [n - 9 * engine.query_len for n in engine.seq_lens]  # the stand-in's few pages: room again
    assert [graph_step() for _ in range(2)] == [(1, False), (1, True)]  # 9 asked, a run told anew
    assert graph_step(32, other) == (0, False)  # another graph's step 11 (its build lent): its call takes it back
    assert [graph_step() for _ in range(2)] == [(1, False), (1, True)]  # asked again: the counts moved
    assert {state._forward_counts[n] for n in engine.names} == {14}
    assert state.capturer.flush(10) and sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [4, 4, 4]
    state.capturer.reconfigure(steps=IntRanges.of("14", "steps"))  # new filters take it back at once: step 14 told
    assert not lent() and not worker_lent()
    assert graph_step() == (1, False) and entry.cudagraph == "staged"
    assert state.drain_graph_capture(10) and state.capturer.flush(10)
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [4, 4, 4, 14, 14, 14]
    assert [graph_step() for _ in range(2)] == [(1, False), (1, True)]
    assert worker_lent()
    vllm_plugin.unregister()  # the class's own build back, and nothing of kvdbg's on the builder or the worker
    assert not lent() and not worker_lent() and not hasattr(type(engine.builder).build, "_kvdbg_original")
    assert not hasattr(WorkerWrapperBase.execute_model, "_kvdbg_original")


def test_a_step_handed_over_unstaged_takes_the_workers_execute_model_back_so_the_next_step_waits_for_it(
        standins, tmp_path, monkeypatch):
    """The worker's execute_model stays vLLM's own past a quiet run, but a wanted step handed to the capture thread
    unstaged (read from the engine's memory) takes it back at once: the next step's hook waits for the copies before
    anything of it reaches the device."""
    import types

    from vllm.v1.worker.worker_base import WorkerWrapperBase

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "4", layers=2)
    batch = _Batch((16,))
    entry = types.SimpleNamespace(cudagraph="copies", output="copies")
    wrapper = types.SimpleNamespace(concrete_cudagraph_entries={batch: entry}, runnable=lambda: None)
    state.record_plain_graph(wrapper, batch, lambda: setattr(entry, "cudagraph", "plain"))
    _unstaged(monkeypatch)
    worker = WorkerWrapperBase()
    waits = []
    real_await = state.await_graph_capture
    monkeypatch.setattr(state, "await_graph_capture", lambda: (waits.append(state._graph_job), real_await())[1])

    found = []

    def step():  # vLLM's runner: it writes cache pages before any build of the step (new blocks zeroed, ...)
        found.append(state._graph_job)
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)

    def graph_step():
        worker.execute_model(step)
        return "execute_model" in vars(worker)

    assert [graph_step() for _ in range(4)] == [False, True, True, True]  # lent from the run's first replay on
    assert not graph_step()  # step 4, wanted: handed over unstaged, the worker's hook back
    assert state._graph_job is not None and waits == []
    graph_step()  # step 5: its execute_model hook waits for step 4's copies before the runner's first write
    assert len(waits) == 1 and waits[0] is not None and found[-1] is None and state._graph_job is None
    assert state.drain_graph_capture(10) and state.capturer.flush(10)
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [4, 4]


def test_new_filters_set_while_a_quiet_replay_is_queued_lend_nothing_and_the_next_step_is_captured(
        standins, tmp_path, monkeypatch):
    """Filters changed from another thread between a quiet replay's check of them and its lending (while vLLM queues
    the replay): the lending sees the new filters under its lock and lends nothing, so the next step, which they
    want, is built through kvdbg's hook and captured."""
    from kvdbg.capture.config import IntRanges

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "40", layers=3)
    wrapper, entry = _record_variants(16)
    real = type(state)._lend_builders

    def lend_after_new_filters(self, run):
        self.capturer.reconfigure(steps=IntRanges.of(str(run.step), "steps"))  # the step after this replay
        return real(self, run)

    monkeypatch.setattr(type(state), "_lend_builders", lend_after_new_filters)
    for _ in range(2):  # step 0 asked, a run told; step 1 the run's first replay, whose lending sees new filters
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)
    assert "build" not in vars(engine.builder)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch,
                  wrapper=wrapper, through=True)
    assert entry.cudagraph == "staged" and state.drain_graph_capture(10) and state.capturer.flush(10)
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [2, 2, 2]
    assert not state.capturer.dropped


def test_a_quiet_run_lends_nothing_over_another_tools_wrapper_of_kvdbgs_patch(standins, tmp_path, monkeypatch):
    """A tool that wraps the builder's build after kvdbg did (functools.wraps copies kvdbg's marks onto its wrapper)
    keeps its wrapper on every step: a quiet run lends vLLM's own method only over kvdbg's own patch."""
    import functools

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "40", layers=2)
    wrapper, _ = _record_variants(16)
    builder_cls = type(engine.builder)
    kvdbgs, seen = builder_cls.build, []

    @functools.wraps(kvdbgs)
    def traced(self, *args, **kwargs):
        seen.append(1)
        return kvdbgs(self, *args, **kwargs)

    monkeypatch.setattr(builder_cls, "build", traced)
    for _ in range(5):
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)
    assert hasattr(traced, "_kvdbg_original") and len(seen) == 5 and "build" not in vars(engine.builder)
    assert {state._forward_counts[n] for n in engine.names} == {5}


def test_a_quiet_runs_counts_are_written_at_their_first_read_and_an_eager_step_after_them_is_counted_right(
        standins, tmp_path, monkeypatch):
    """A replay of a quiet run leaves its layers' counts to their first read (graph_hooks.quiet_replayed: a dict write
    per layer was most of its Python): meanwhile the dict is off the state, so any read writes them first, and an
    eager step after the run's replays is counted and captured at the step they reached."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "5", layers=3)
    wrapper, entry = _record_variants(16)

    def graph_step():
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)

    for _ in range(4):  # step 0 asked, a run told to step 5; steps 1 to 3 its replays
        graph_step()
    assert "_forward_counts" not in vars(state) and state._uncounted is state._quiet_run
    assert {state._counts_off[n] for n in engine.names} == {1}  # written at step 0's replay, not since
    assert {state._forward_counts[n] for n in engine.names} == {4}  # read: written first
    assert "_forward_counts" in vars(state) and state._uncounted is None and state._counts_off is None
    graph_step()  # step 4: the run's again, off again
    assert "_forward_counts" not in vars(state) and entry.cudagraph == "plain"
    engine.step(common=engine.common())  # an eager step 5, which the filter takes
    assert {state._forward_counts[n] for n in engine.names} == {6}
    assert state.capturer.flush(10)
    assert sorted(s.meta.capture["step"] for s in snapshots(tmp_path)) == [5, 5, 5]
    # vLLM letting its graphs go ends a run: written then, so that nothing of kvdbg's holds the wrapper or a graph.
    for _ in range(3):
        graph_step()
    assert state._uncounted is state._quiet_run is not None
    state.forget_graphs(wrapper)
    assert state._uncounted is None and state._quiet_run is None and "_forward_counts" in vars(state)
    assert {state._forward_counts[n] for n in engine.names} == {9}


def test_a_quiet_run_is_not_replayed_as_such_once_vllm_replaced_its_graphs_and_a_failure_stays_out_of_vllm(
        standins, tmp_path, monkeypatch, caplog):
    """vLLM may let its graphs go by replacing a wrapper's table (elastic expert parallelism re-records them so, with
    no clear_graphs): a run told before is then no longer the replay's, whose call is asked again (a recording). A
    failure in the fast path is reported and the call asked as any other, never raised into vLLM."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "6", layers=2)
    wrapper, entry = _record_variants(16)
    for _ in range(2):  # step 0 asked, a run told; step 1 replayed as the run's
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch, wrapper=wrapper, through=True)
    run = state._quiet_run
    assert run is not None and run.step == 2 and entry.cudagraph == "plain"
    table = wrapper.concrete_cudagraph_entries
    wrapper.concrete_cudagraph_entries = {}
    assert state.quiet_replay(wrapper) is None and state.graph_call(wrapper)[0] == "record"
    wrapper.concrete_cudagraph_entries = table
    context = state._forward_context

    def broken():
        raise RuntimeError("no forward context")

    state._forward_context = (context[0], broken)
    assert state.quiet_replay(wrapper) is None and state._quiet_run is None
    assert "a CUDA graph's replay told quiet ahead" in caplog.text and "no forward context" in caplog.text
    state._forward_context = context


def test_a_staged_step_whose_requests_cannot_be_worked_out_after_the_replay_is_lost_in_words_not_raised(
        standins, tmp_path, monkeypatch):
    """A step the staged graph served without its metadata has its requests worked out right after the replay, from
    the build's host offsets; should that fail, each layer's step is counted lost and nothing reaches vLLM."""
    from kvdbg.vllm_plugin import vllm_facts
    from kvdbg.vllm_plugin.graph_staging import InGraphProgram

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0", layers=2)
    wrapper, entry = _record_variants(16)
    monkeypatch.setattr(InGraphProgram, "serves", lambda self, hint: 1)  # the program staged no metadata

    def broken(common):
        raise RuntimeError("offsets unreadable")

    monkeypatch.setattr(vllm_facts, "_requests_with_tokens", broken)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch,
                  wrapper=wrapper)
    assert entry.cudagraph == "staged" and state.drain_graph_capture(10)
    assert state.capturer.dropped["internal"] == 2 and snapshots(tmp_path) == []
    assert {state._forward_counts[n] for n in engine.names} == {1}
    assert not next(iter(state._staged_variants.values()))[1].held


def test_the_staged_variant_is_recorded_only_where_a_step_can_replay_it(standins, tmp_path, monkeypatch, caplog):
    """A step replays the staged variant only when capture wants, or the sentinel draws, every layer the graph copies
    for kvdbg. Capture's layer filter alone narrows those layers, and the variant serves them; the sentinel checking
    every layer the graph copies, it serves its draws; the sentinel checking a layer capture leaves out and capture
    one the sentinel leaves out, neither covers the graph's layers, and the third recording (with its staging's
    device memory) is not made, said once."""
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_LAYERS="model.layers.1.self_attn.attn", KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    _record_variants(16)
    assert [slot.name for slot in state._graph_layers[_Batch((16,))]] == ["model.layers.1.self_attn.attn"]
    assert len(state._staged_variants) == 1
    vllm_plugin.unregister()

    enable(standins, tmp_path / "with-sentinel", KVDBG_CAPTURE_LAYERS="model.layers.1.self_attn.attn",
           KVDBG_CAPTURE_STEPS="0", KVDBG_SENTINEL="0.5", KVDBG_CAPTURE_BACKENDS="FLASHINFER_TS")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
    state = vllm_plugin._state
    assert state.sentinel is not None
    _record_graph(engine, 16, 4, monkeypatch)
    _record_variants(16)
    assert len(state._graph_layers[_Batch((16,))]) == 2  # the sentinel checks both layers
    assert len(state._staged_variants) == 1 and "staging in it" in caplog.text
    assert "the sentinel draws replays that variant" in caplog.text
    vllm_plugin.unregister()

    enable(standins, tmp_path / "apart", KVDBG_CAPTURE_LAYERS="model.layers.1.self_attn.attn",
           KVDBG_CAPTURE_STEPS="0", KVDBG_SENTINEL="0.5", KVDBG_SENTINEL_LAYERS="model.layers.0.self_attn.attn",
           KVDBG_CAPTURE_BACKENDS="FLASHINFER_TS")
    engine = StandinEngine("FLASHINFER_TS", layers=2, seq_lens=(300, 77, 150), query_len=4)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    wrapper, entry = _record_variants(16)
    assert len(state._graph_layers[_Batch((16,))]) == 2  # capture's layer 1, the sentinel's layer 0
    assert state._graph_variants and not state._staged_variants and not state._in_graph_programs
    assert entry.cudagraph == "copies"  # given back the graph with the copies, as after any recording
    assert caplog.text.count("not recorded a third time with kvdbg's staging") == 1


def test_a_wanted_step_while_the_graphs_staging_is_still_read_replays_the_graph_with_the_copies(
        standins, tmp_path, monkeypatch):
    """Two wanted steps in a row, the capture thread still on the first: the second cannot replay the staged graph
    (its staging is held), so it replays the graph with the copies and is staged by the host's program; both exact."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-1")
    wrapper, entry = _record_variants(16)
    started, release = _held_capture_thread(state, monkeypatch)
    replayed, expected = [], []
    for step in range(2):
        common = _padded(engine.common(), reqs=4, tokens=16)
        outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch, wrapper=wrapper)
        replayed.append(entry.cudagraph)
        expected.append((common.seq_lens[:3].tolist(), [o[:12].clone() for o in outputs],
                         [layer.kv_cache.clone() for layer in engine.layers]))
    assert replayed == ["staged", "copies"]
    release.set()
    assert state.drain_graph_capture(10)
    snaps = snapshots(tmp_path)
    assert len(snaps) == 4
    for snap in snaps:
        seq_lens, outputs, caches = expected[snap.meta.capture["step"]]
        layer = engine.names.index(snap.meta.capture["layer"])
        assert snap.steps[0].seq_lens.tolist() == seq_lens
        torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), outputs[layer].reshape(12, -1), rtol=0,
                                   atol=0)
        torch.testing.assert_close(snap.kv_cache, caches[layer][snap.page_ids.long()], rtol=0, atol=0)
    account = vllm_plugin.active_capturer().engine_time
    assert account.staged == 2 and account.in_graph == 1 and state._stager.staged == 1


def test_a_staged_variant_missing_a_layers_copies_is_not_kept_and_cleared_graphs_let_their_staging_go(
        standins, tmp_path, monkeypatch, caplog):
    """vLLM lets its graphs go (after profiling their memory): the staged variants, their programs and the builds
    kept for the next recording go with them. A staged recording in which a layer finds no copy buffers would
    stage stale copies: it is said and not kept, and the graph's wanted steps are staged from the host."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "1")
    wrapper, entry = _record_variants(16)
    assert len(state._in_graph_programs) == 1 and state._last_builds
    state.forget_graphs(wrapper)
    assert not state._graph_variants and not state._staged_variants and not state._in_graph_programs
    assert not state._last_builds
    _record_graph(engine, 16, 4, monkeypatch)  # vLLM records the size again: its dummy build is kept again
    batch = _Batch((16,))
    entry = types_namespace(cudagraph="copies", output="copies")
    wrapper = types_namespace(concrete_cudagraph_entries={batch: entry}, runnable=lambda: None)
    state.record_plain_graph(wrapper, batch, lambda: setattr(entry, "cudagraph", "plain"))

    buffer = state._graph_buffers[engine.names[0]].query
    queries = [torch.zeros(16, *buffer.shape[1:], dtype=torch.float64),  # not the dtype the buffer was made for
               torch.zeros(16, *buffer.shape[1:], dtype=buffer.dtype)]

    def record():
        wrapper.runnable()
        query = queries.pop(0)
        if not queries:
            state._graph_buffers.pop(engine.names[0])  # as if the layer's buffers were gone by now
        assert state.record_in_graph(None, engine.layers[0], query, engine.layers[0].kv_cache, None) is None
        entry.cudagraph = "staged"

    caplog.set_level(logging.WARNING, logger="kvdbg.capture")
    before = buffer.clone()
    state.record_staged_graph(wrapper, batch, record)  # a query of another dtype: no copy into the buffer
    assert not state._staged_variants and entry.cudagraph == "copies"
    assert state._graph_buffers[engine.names[0]].query is buffer  # never a new buffer, nor written
    torch.testing.assert_close(buffer, before, rtol=0, atol=0)
    assert "with kvdbg's staging in it failed" in caplog.text and "that this recording's query fits" in caplog.text
    state.record_staged_graph(wrapper, batch, record)  # the layer's buffers gone
    assert not state._staged_variants and entry.cudagraph == "copies"
    assert state.capturer.failures["staged:RuntimeError"] == 2  # each said (the log line once)


def test_a_read_staging_inside_a_graph_is_let_go_by_the_capture_thread_once_the_device_has_made_the_copies(
        standins, tmp_path, monkeypatch):
    """A reader's release is pending until its copies are done on the device: the capture thread asks between its
    jobs (never the engine's thread), and the program serves the next wanted step only then; before a graph
    records, the engine's thread waits for every pending one (nothing may query the device while it records)."""
    import time as clock

    from kvdbg.vllm_plugin.graph_hooks import _GraphCaptureThread

    class Copies:  # the event after a reader's copies, as the device makes them
        def __init__(self):
            self.done, self.waited = False, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = self.done = True

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "1")
    _record_variants(16)
    program = next(iter(state._in_graph_programs.values()))
    copies = Copies()
    program.hold()
    program._pending.append(copies)  # what release() leaves on a GPU
    state._graph_thread = _GraphCaptureThread(state)
    clock.sleep(0.05)
    assert not program.reusable()  # the copies are not done: still held
    copies.done = True
    deadline = clock.monotonic() + 5
    while not program.reusable() and clock.monotonic() < deadline:
        clock.sleep(0.005)
    assert program.reusable() and not program._pending and not copies.waited
    program.hold()
    program._pending.append(Copies())
    state.before_graph_recording()  # waits for it
    assert program.reusable() and not program._pending


def types_namespace(**kwargs):
    import types

    return types.SimpleNamespace(**kwargs)


def test_the_staging_inside_a_graph_stages_what_the_hosts_program_does_from_the_lengths_alone():
    """The program recorded into vLLM's graph works each request's pages out on the device from the lengths (rows
    past the batch's requests at zero, as vLLM keeps them): the same page ids, pages and metadata as the host's
    program given the exact counts; a step over its positions is refused by name when read, never cut short."""
    from kvdbg.capture.inputs import CaptureInputError
    from kvdbg.vllm_plugin.graph_staging import InGraphProgram, StageHint, _Program

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(40, 2, 4, 2, 8, generator=gen)  # pages first, 4 tokens a page
    query, output = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    table = torch.randint(1, 40, (8, 10), dtype=torch.int32, generator=gen)
    seq_lens = torch.tensor([13, 1, 40, 7, 0, 0, 0, 0], dtype=torch.int32)
    offsets = torch.arange(9, dtype=torch.int32)
    hint = StageHint(table[:6], 4, None, 40, seq_lens[:6], offsets[:7], 6)
    layers = [("layer", cache, 0, query, output)]
    inside = InGraphProgram(None, hint, layers, 64, InGraphProgram.rows_for(hint), 4)
    assert inside.counts.numel() == 8 and inside.width == 10
    inside.graph_body(6)
    step = inside.staged_step(6, hint, inside.serves(hint) == 2)
    assert step.count == -1 and step.sized() == 4 + 1 + 10 + 2
    assert step.counts.tolist() == [4, 1, 10, 2]
    host = _Program(None, hint, layers, 64, 8)
    host.run(step.counts)
    torch.testing.assert_close(inside.ids[:17], host.ids[:17], rtol=0, atol=0)
    torch.testing.assert_close(inside.layers[0][7][:17], host.layers[0][7][:17], rtol=0, atol=0)
    torch.testing.assert_close(step.layers["layer"].query, query, rtol=0, atol=0)
    torch.testing.assert_close(step.layers["layer"].output, output, rtol=0, atol=0)
    bt, sl, qsl = step.metadata()
    assert sl.tolist() == [13, 1, 40, 7] and qsl.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(bt, table[:4], rtol=0, atol=0)
    # The host's bound decides before the replay; past the program's positions the step is refused, by name.
    small = InGraphProgram(None, hint, layers, 16, 8, 4)
    assert inside.serves(hint) and not small.serves(hint)  # 4 requests of up to 10 pages: 40 positions
    assert small.serves(StageHint(table[:6], 4, torch.tensor([13, 1, 16, 7]), 40, seq_lens[:6], offsets[:7], 6))
    seq_lens[:4] = 400  # 100 pages each, cut to the table's 10 columns: 40 pages
    inside.graph_body(6)
    assert inside.staged_step(6, hint, True).sized() == 40
    small.graph_body(6)
    with pytest.raises(CaptureInputError, match="reads 40 pages, more than the 16"):
        small.staged_step(6, hint, True).sized()


def test_a_step_staged_inside_a_graph_has_its_requests_worked_out_by_the_reader_from_the_staged_offsets():
    """A build that leaves its real requests unknown (``num_reqs`` -1) is served from the batch's padded rows, and
    the reader works the requests out from the query offsets the graph staged, by the host's rule (the padding rows
    of no tokens after them are not requests), even once the host's own offsets are rewritten."""
    import types

    from kvdbg.capture.inputs import CaptureInputError
    from kvdbg.vllm_plugin.graph_staging import InGraphProgram, StageHint, stage_hint

    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(40, 2, 4, 2, 8, generator=gen)
    query, output = torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)
    table = torch.randint(1, 40, (8, 10), dtype=torch.int32, generator=gen)
    seq_lens = torch.tensor([13, 1, 40, 7, 0, 0, 0, 0], dtype=torch.int32)
    offsets = torch.tensor([0, 1, 2, 3, 4, 4, 4, 0, 0], dtype=torch.int32)  # 4 requests, 2 padding rows
    host_offsets = offsets.clone()
    common = types.SimpleNamespace(max_seq_len=40, seq_lens_cpu_upper_bound=None, block_table_tensor=table[:6],
                                   num_reqs=6, query_start_loc_cpu=host_offsets)
    hint = stage_hint(common, (table[:6], seq_lens[:6], offsets[:7]), -1)
    assert hint.known_reqs == -1 and hint.most_reqs == 6
    # The program is made when vLLM records the graph (the recording's build: all its rows are requests).
    recorded = StageHint(table[:6], 6, None, 40, seq_lens[:6], offsets[:7], 6)
    inside = InGraphProgram(None, recorded, [("layer", cache, 0, query, output)], 64, 8, 4)
    assert inside.serves(hint) == 2 and hint.known_reqs == -1  # told from the 6 rows: 60 positions at most
    inside.graph_body(6)
    step = inside.staged_step(6, hint, True)
    assert step.num_reqs == -1 and step.batch_rows == 6
    host_offsets.fill_(16)  # the next step's offsets: the reader must not need the host's
    assert step.sized() == 4 + 1 + 10 + 2 and step.num_reqs == 4
    bt, sl, qsl = step.metadata()
    assert sl.tolist() == [13, 1, 40, 7] and qsl.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(bt, table[:4], rtol=0, atol=0)
    # Asked on the engine's thread during the step, the hint works them out from the host's offsets, once.
    later = stage_hint(types.SimpleNamespace(**{**vars(common), "query_start_loc_cpu": offsets.clone()}),
                       (table[:6], seq_lens[:6], offsets[:7]), -1)
    assert later.num_reqs == 4 and later.known_reqs == 4
    # A host bound on the lengths as long as the real requests, not the padded rows, is kept: when the rows' cheap
    # bound is over a small program's positions, the exact one is asked with the requests worked out then.
    small = InGraphProgram(None, recorded, [("layer", cache, 0, query, output)], 16, 8, 4)
    short = stage_hint(types.SimpleNamespace(**{**vars(common), "query_start_loc_cpu": offsets.clone(),
                                                "seq_lens_cpu_upper_bound": torch.tensor([13, 1, 16, 7])}),
                       (table[:6], seq_lens[:6], offsets[:7]), -1)
    assert short.seq_lens_bound is not None and short.known_reqs == -1
    assert small.serves(short) == 2 and short.known_reqs == 4  # 4 + 1 + 4 + 2 pages of 16 positions
    # A step whose offsets were not staged cannot be read without its requests: refused by name, never guessed.
    bare = inside.staged_step(6, StageHint(table[:6], -1, None, 40, seq_lens[:6], offsets[:7], 6, common), True)
    bare.with_metadata = False
    with pytest.raises(CaptureInputError, match="real requests were neither"):
        bare.sized()


class _TorchCalls(torch.overrides.TorchFunctionMode):
    """The torch functions and methods called while it is on (their names), but for those of the staging program's
    body, which runs eagerly on a CPU and is one graph launch on a GPU."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_a_wanted_graph_step_costs_the_engines_thread_a_handful_of_torch_calls(standins, tmp_path, monkeypatch):
    """A wanted step that a full graph replays: its build copies and slices nothing (the staging program copies the
    metadata after the replay), and the replay's hook makes a handful of torch calls whatever the number of
    layers (here 8): the positions to the device, the program, an event on a GPU; every torch call is a chance for
    another thread to take Python's lock from the engine's (docs/benchmarks.md, section 10)."""
    from kvdbg.vllm_plugin.graph_staging import _Program

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-1", layers=8)
    calls = {"after_build": _TorchCalls(), "after_graph_replay": _TorchCalls()}
    for hook, counter in calls.items():
        def counted(*args, _real=getattr(state, hook), _counter=counter, **kwargs):
            with _counter:
                return _real(*args, **kwargs)

        monkeypatch.setattr(state, hook, counted)
    body = _Program._body

    def uncounted(program):
        for counter in calls.values():
            counter.paused = True
        try:
            body(program)
        finally:
            for counter in calls.values():
                counter.paused = False

    monkeypatch.setattr(_Program, "_body", uncounted)
    for step in range(2):  # the first makes the program; the second reuses it, counted
        for counter in calls.values():
            counter.names.clear()
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        assert state.drain_graph_capture(10)  # the capture thread done: the program free again
    built, replayed = calls["after_build"].names, calls["after_graph_replay"].names
    reads = {"__get__", "__len__", "dim", "stride", "data_ptr", "numel", "numpy"}  # a tensor's facts, no op
    assert built and [n for n in built if n not in reads] == [] and len(built) <= 4, built
    # The positions' copy the one op (on a GPU, then the program's launch and its event); no call per layer.
    assert [n for n in replayed if n not in reads] == ["copy_"] and len(replayed) <= 20, replayed
    assert len(snapshots(tmp_path)) == 16 and state._stager.staged == 2 and len(state._stager._programs) == 1


def test_an_armed_graph_step_the_step_filter_excludes_is_let_go_for_all_its_layers_at_once(standins, tmp_path,
                                                                                             monkeypatch):
    """Armed, most steps are ones the step filter excludes: the build and the replay's hook tell so with one search
    for every layer (no per-layer filter call), each layer's count still moves on, and the wanted step is
    captured on every layer as before."""
    from kvdbg.capture.capturer import Capturer

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "3", layers=8)
    asked = []
    for name in ("selects", "wants"):
        real = getattr(Capturer, name)
        monkeypatch.setattr(Capturer, name, lambda self, *a, _real=real, _name=name, **k: (asked.append(_name),
                                                                                          _real(self, *a, **k))[1])
    for step in range(5):
        engine.seq_lens = [300, 77, 150]
        _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16,
                      monkeypatch)
        assert state.drain_graph_capture(10)  # the capture thread's own calls (a wanted step's) counted here
        assert set(state._forward_counts[n] for n in engine.names) == {step + 1}
        # excluded steps: no filter call at all; the wanted one: the layers asked one by one, as before
        assert (asked == []) == (step != 3), (step, asked)
        asked.clear()
    snaps = snapshots(tmp_path)
    assert len(snaps) == 8 and {snap.meta.capture["step"] for snap in snaps} == {3}


def test_a_wanted_step_whose_plain_graph_was_chosen_is_lost_in_words_never_read_stale(standins, tmp_path,
                                                                                     monkeypatch):
    """The graph without kvdbg's copies chosen before the replay, and the step wanted after it (the filters changed
    between): its layers' buffers hold an older step, so nothing is captured; each layer's step is counted lost."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0", layers=2)
    state._plain_ran = True  # as choose_graph leaves it when it installed the plain graph
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    assert state.drain_graph_capture(10) and state.capturer.flush(10)
    assert snapshots(tmp_path) == [] and sum(state.capturer.dropped.values()) == 2
    assert not state._plain_ran
    # The next step, with the graph with the copies replayed, is captured as ever.
    state.capturer.reconfigure(steps=None)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    assert state.drain_graph_capture(10) and state.capturer.flush(10)
    assert len(snapshots(tmp_path)) == 2


def test_a_step_told_unwanted_when_its_graph_was_chosen_is_only_counted_after_the_replay(standins, tmp_path,
                                                                                         monkeypatch):
    """The choice of the plain graph hands its answer to the replay's hook, which then only counts the step's forwards
    (nothing asked again); an answer that no longer holds is not taken: filters changed between (the step is said
    lost, as before), or capture off with a step its filters select (the hook counts it dropped)."""
    import types

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "1", layers=2)
    batch = next(iter(state._graph_layers))
    entry = types.SimpleNamespace(cudagraph="copies", output=None)
    wrapper = types.SimpleNamespace(concrete_cudagraph_entries={batch: entry})
    state.record_plain_graph(wrapper, batch, lambda: setattr(entry, "cudagraph", "plain"))
    state._forward_counts.update({n: 5 for n in engine.names})  # past the one step the filter takes
    asked = []
    real = type(state)._nothing_wanted
    monkeypatch.setattr(type(state), "_nothing_wanted",
                        lambda self, *a, **k: (asked.append(a[-1] if len(a) == 4 else False), real(self, *a, **k))[1])

    state.choose_graph(wrapper, batch)
    assert entry.cudagraph == "plain" and asked == [True]
    assert state.after_graph_replay(batch) is False
    assert asked == [True] and {state._forward_counts[n] for n in engine.names} == {6}

    # A forward counted between the choice and the replay's hook (none is today): the answer is not taken, and the
    # hook counts from the counts as they are.
    state.choose_graph(wrapper, batch)
    state._forward_counts[engine.names[0]] += 1
    state._counts_epoch += 1
    assert state.after_graph_replay(batch) is False and asked[-1] is False
    assert [state._forward_counts[n] for n in engine.names] == [8, 7]
    state._forward_counts.update({n: 6 for n in engine.names})

    state.choose_graph(wrapper, batch)
    state.capturer.reconfigure(steps=None)  # every step wanted now: the plain graph's buffers are stale
    assert state.after_graph_replay(batch) is False
    assert asked[-1] is False and sum(state.capturer.dropped.values()) == 2  # each layer's step said lost
    assert {state._forward_counts[n] for n in engine.names} == {7}

    state.capturer.disable("a test")
    state.choose_graph(wrapper, batch)
    assert entry.cudagraph == "plain" and state._quiet is None
    state.after_graph_replay(batch)
    assert state.capturer.dropped["off"] == 2 and {state._forward_counts[n] for n in engine.names} == {8}


def test_a_failing_choice_of_graph_replays_the_one_with_the_copies_and_never_raises_into_vllm(standins, tmp_path,
                                                                                           monkeypatch, caplog):
    import types

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0", layers=2)
    batch = next(iter(state._graph_layers))
    entry = types.SimpleNamespace(cudagraph="copies", output=None)
    wrapper = types.SimpleNamespace(concrete_cudagraph_entries={batch: entry})
    state.record_plain_graph(wrapper, batch, lambda: setattr(entry, "cudagraph", "plain"))
    assert entry.cudagraph == "copies" and state._graph_variants
    state.choose_graph(wrapper, batch)
    assert entry.cudagraph == "copies"  # step 0 is wanted
    state._forward_counts.update({n: 1 for n in engine.names})
    state.choose_graph(wrapper, batch)
    assert entry.cudagraph == "plain"  # step 1 is not

    def broken(self, batch, graph=None):
        raise RuntimeError("filter exploded")

    monkeypatch.setattr(type(state), "_step_wants_copies", broken)
    state.choose_graph(wrapper, batch)
    assert entry.cudagraph == "copies" and not state._plain_ran
    assert "choosing a CUDA graph to replay" in caplog.text and "filter exploded" in caplog.text


def test_a_layer_a_graph_runs_twice_is_counted_twice_a_step(standins, tmp_path, monkeypatch):
    """A graph whose slots name one layer twice (a layer run twice in one forward) counts that layer's forwards one
    by one, as an eager step would."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "100", layers=2)
    [slots] = state._graph_layers.values()
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    assert [state._forward_counts[n] for n in engine.names] == [1, 1]  # the graph's names now kept
    slots.append(slots[0])  # the graph records one more slot: its names are worked out again
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    assert [state._forward_counts[n] for n in engine.names] == [3, 2]


def test_a_build_guessed_to_be_a_graphs_that_runs_eagerly_is_copied_at_its_first_hook(standins, tmp_path,
                                                                                     monkeypatch):
    """vLLM pads only a full graph's batch, so a build of a recorded graph's tokens and rows is left uncopied; should
    its step run eagerly after all, its first hook (the cache update's) copies it, before the forward writes
    anything, and the snapshot is the step's, whatever the runner writes afterwards."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0")
    common = _padded(engine.common(), reqs=4, tokens=16)
    expected = (common.block_table_tensor[:3].clone(), common.seq_lens[:3].clone())
    real, deferred = state.after_build, []

    def build(*args, **kwargs):
        done = real(*args, **kwargs)
        deferred.append(state._graph_builds[engine.names[0]][1].deferred is not None)
        return done

    monkeypatch.setattr(state, "after_build", build)
    _, _, seen = engine.step(common=common, inputs=_padded_inputs(engine, 16))
    assert deferred == [True]  # left uncopied at the build
    ctx = state._graph_builds[engine.names[0]][1]
    assert ctx.deferred is None and ctx.block_table.data_ptr() != common.block_table_tensor.data_ptr()
    common.block_table_tensor.fill_(1)  # the runner's next step
    common.seq_lens.fill_(3)
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["layer"])
    assert len(snaps) == 2
    for snap, layer_seen in zip(snaps, seen):
        step = snap.steps[0]
        torch.testing.assert_close(step.block_table, expected[0], rtol=0, atol=0)
        assert step.seq_lens.tolist() == expected[1].tolist()
        torch.testing.assert_close(snap.kv_cache, layer_seen["cache_before"][snap.page_ids.long()], rtol=0, atol=0)
        assert "before do_kv_cache_update" in snap.meta.capture["new_kv"]  # taken at the cache update


def test_a_build_of_one_cache_group_among_several_copies_as_ever(standins, tmp_path, monkeypatch):
    """Staging serves a step only when one build holds every layer the graphs copy for kvdbg; a model of several
    cache groups builds once a group, so its builds make their copies as any build does (not left to a program
    that will not run)."""
    from types import SimpleNamespace

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0")
    assert state._covers_graph_layers(engine.builder)
    assert not state._covers_graph_layers(SimpleNamespace(layer_names=engine.names[:1]))
    assert not state._covers_graph_layers(SimpleNamespace(layer_names=None))
    common = _padded(engine.common(), reqs=4, tokens=16)
    assert state._graph_step(engine.builder, common, None, False)
    assert not state._graph_step(SimpleNamespace(layer_names=engine.names[:1]), common, None, False)
    assert not state._graph_step(engine.builder, _padded(engine.common(), reqs=4, tokens=12), None, False)


def test_a_deferred_build_whose_copy_fails_stays_deferred(standins, tmp_path, monkeypatch):
    """resolve marks a context resolved only once its copies are made: one that raised still says its tensors are
    the runner's, never passing them off as the step's own copies."""
    from kvdbg.vllm_plugin import builder_hooks

    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0")
    common = _padded(engine.common(), reqs=4, tokens=16)
    engine.builder.build(0, common)
    ctx = state._graph_builds[engine.names[0]][1]
    assert ctx.deferred is not None

    def broken(t, n):
        raise RuntimeError("no copy")

    monkeypatch.setattr(builder_hooks, "_rows", broken)
    with pytest.raises(RuntimeError):
        state.resolve(ctx)
    assert ctx.deferred is not None and ctx.host is None


def test_a_step_longer_than_its_hosts_bound_is_refused_not_half_captured(standins, tmp_path, monkeypatch, caplog):
    """The host bounds each request's pages when the builder builds (vLLM's seq_lens_cpu_upper_bound): a request
    longer than its bound has pages that were never staged, and its step is refused in words, not stored short."""
    import dataclasses

    caplog.set_level(logging.WARNING, logger="kvdbg.capture")
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0", layers=1)
    common = _padded(engine.common(), reqs=4, tokens=16)
    common = dataclasses.replace(common, seq_lens_cpu_upper_bound=torch.tensor([300, 40, 150, 0], dtype=torch.int32))
    _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch)
    assert snapshots(tmp_path) == []
    capturer = vllm_plugin.active_capturer()
    assert capturer.dropped["input"] == 1 and capturer.engine_time.staged == 1
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "was not staged" in said and "bounded" in said


def test_a_block_tables_stale_entries_within_the_bound_are_never_read_outside_the_cache(standins, tmp_path,
                                                                                       monkeypatch):
    """Without per-request bounds every row is read up to max_seq_len, through entries the runner left stale (other
    requests' pages): the snapshot keeps only the pages read, and the block table as the graph read it. (Ids
    outside the cache are clamped by the program: tests/test_graph_staging.py.)"""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0", layers=1)
    common = _padded(engine.common(), reqs=4, tokens=16)
    real_stage = state._stage

    def stale_then_stage(items):  # the runner's buffer past each row's pages, as the staging program reads it
        for r, n in enumerate([300, 77, 150]):
            common.block_table_tensor[r, -(-n // 16):] = 71 if r % 2 else 1
        return real_stage(items)

    monkeypatch.setattr(state, "_stage", stale_then_stage)
    outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch)
    caches = [layer.kv_cache.clone() for layer in engine.layers]
    [snap] = snapshots(tmp_path)
    assert vllm_plugin.active_capturer().engine_time.staged == 1
    torch.testing.assert_close(snap.kv_cache, caches[0][snap.page_ids.long()], rtol=0, atol=0)
    assert snap.page_ids.max() < 72 and snap.page_ids.min() >= 0
    assert 71 not in snap.page_ids.tolist()  # a stale entry, never a page the step read
    assert snap.steps[0].block_table[1, -1] == 71  # the table as the graph read it, stale tail and all
    torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), outputs[0][:12].reshape(12, -1), rtol=0,
                               atol=0)


def test_a_staging_program_still_held_is_never_reused(standins, tmp_path, monkeypatch):
    """Three wanted steps in a row while the capture thread holds the first: the second gets a second program, the
    third is captured the unstaged way (the engine's next step waits for it); all three are exact."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0-2", layers=1)
    started, release = _held_capture_thread(state, monkeypatch)
    table = torch.zeros(8, 64, dtype=torch.int32)
    seen = []
    for step in range(3):
        common = _padded(engine.common(), reqs=4, tokens=16, table_buffer=table)
        outputs = _run_as_graph(engine, common, _padded_inputs(engine, 16), 16, monkeypatch)
        seen.append((outputs[0][:12].clone(), engine.layers[0].kv_cache.clone()))
        if step == 0:
            assert started.wait(5)
        if step < 2:
            assert state._graph_job is None  # staged: nothing to wait for
    assert state._graph_job is not None  # the third: read from the engine's memory
    stager = state._stager
    assert stager.staged == 2 and stager.not_staged == {"held": 1}
    release.set()
    state.await_graph_capture()
    snaps = sorted(snapshots(tmp_path), key=lambda s: s.meta.capture["step"])
    assert [s.meta.capture["step"] for s in snaps] == [0, 1, 2]
    for snap, (output, cache) in zip(snaps, seen):
        torch.testing.assert_close(snap.steps[0].output.reshape(12, -1), output.reshape(12, -1), rtol=0, atol=0)
        torch.testing.assert_close(snap.kv_cache, cache[snap.page_ids.long()], rtol=0, atol=0)
    assert all(not p.held for programs in stager._programs.values() for p in programs)


def test_a_graph_replay_without_a_build_of_its_step_is_reported_not_guessed(standins, tmp_path, monkeypatch):
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=1)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    state._graph_buffers[engine.names[0]].output = torch.zeros_like(state._graph_buffers[engine.names[0]].query)
    assert state.after_graph_replay(_Batch((16,))) is False  # no build was seen for step 0
    assert snapshots(tmp_path) == []
    assert vllm_plugin.active_capturer().failures, "the lost step is counted"


def test_only_layers_capture_selects_get_graph_copies(standins, tmp_path, monkeypatch):
    enable(standins, tmp_path, KVDBG_CAPTURE_LAYERS="model.layers.1.self_attn.attn")
    engine = StandinEngine("FLASHINFER_TS", layers=2)
    state = vllm_plugin._state
    _record_graph(engine, 16, 4, monkeypatch)
    assert [slot.name for slot in state._graph_layers[_Batch((16,))]] == ["model.layers.1.self_attn.attn"]
    assert list(state._graph_buffers) == ["model.layers.1.self_attn.attn"]



def test_a_cache_update_before_any_build_is_no_refusal(standins, tmp_path, caplog):
    """vLLM's profiling and warm-up runs write the cache before any metadata is built: no layer is refused, no
    failure counted, and the first real steps are captured."""
    caplog.set_level(logging.INFO, logger="kvdbg.capture")
    enable(standins, tmp_path, KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLASHINFER_TS", layers=2)
    common = engine.common()
    for layer in engine.layers:
        key, value = engine.inputs()[1:]
        layer.impl.do_kv_cache_update(layer, key.view(-1, engine.num_kv_heads, engine.head_size),
                                      value.view(-1, engine.num_kv_heads, engine.head_size), layer.kv_cache,
                                      common.slot_mapping)
    capturer = vllm_plugin.active_capturer()
    assert not capturer.failures and not [r for r in caplog.records if "refused" in r.getMessage()]
    engine.step()
    assert len(snapshots(tmp_path)) == 2 and not capturer.failures


def test_a_wanted_step_that_cannot_be_handed_over_lets_its_staging_go(standins, tmp_path, monkeypatch):
    """A hand-over that fails loses the step (said, counted) but never leaves its staged buffers held."""
    engine, state = _staged_engine(standins, tmp_path, monkeypatch, "0", layers=1)

    def broken(job):
        raise RuntimeError("no capture thread")

    monkeypatch.setattr(state, "_hand_over", broken)
    _run_as_graph(engine, _padded(engine.common(), reqs=4, tokens=16), _padded_inputs(engine, 16), 16, monkeypatch)
    assert state._stager.staged == 1
    assert not any(p.held for programs in state._stager._programs.values() for p in programs)
    assert vllm_plugin.active_capturer().dropped["internal"] == 1


def test_the_exit_line_says_how_many_graph_steps_were_staged_and_what_recording_the_staging_cost():
    from kvdbg.capture.capturer import EngineTime

    line = EngineTime(handed=3, staged=2, staging_graphs=1, staging_ms=4.5).describe()
    assert ("3 graph step(s) handed to the capture thread (2 staged on the device first), 1 staging graph(s) "
            "recorded in 4.5 ms, once per size, 0.0 ms waiting for its copies before 0 next step(s)") in line
