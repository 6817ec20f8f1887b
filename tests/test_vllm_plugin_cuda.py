"""The vLLM plugin on a CUDA engine: no hook waits for the engine's stream, and the snapshot is the step's.

The stand-in engine of tests/test_vllm_plugin.py, its cache, metadata and inputs
moved to the device. Before each of the plugin's hooks the test queues a long
sleep on the engine's stream (standing in for the layers the engine queued before
the hook): a hook that read a device tensor on the host would wait for it, and
the stream would be idle when the hook returns. (The stand-in attention itself
reads the device on the host, in the engine's own calls, which is not checked.)
"""

from __future__ import annotations

import collections

import pytest
import torch

from kvdbg import vllm_plugin

from kvdbg.vllm_plugin import state as plugin_state
from tests.test_vllm_plugin import StandinEngine, clean, enable, snapshots, standins  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# About 100 ms of the device at 2 GHz: far longer than a hook's host work, first calls included.
SLEEP_CYCLES = 200_000_000
HOOKS = ("after_build", "before_cache_update", "before_forward")


def on_device(engine: StandinEngine) -> None:
    for layer in engine.layers:
        layer.kv_cache = layer.kv_cache.cuda()


def device_common(engine: StandinEngine):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    common = engine.common()
    return CommonAttentionMetadata(
        query_start_loc=common.query_start_loc.cuda(), query_start_loc_cpu=common.query_start_loc_cpu,
        seq_lens=common.seq_lens.cuda(), num_reqs=common.num_reqs, num_actual_tokens=common.num_actual_tokens,
        max_query_len=common.max_query_len, max_seq_len=common.max_seq_len,
        block_table_tensor=common.block_table_tensor.cuda(), slot_mapping=common.slot_mapping.cuda(),
        causal=common.causal,
    )


class BusyHooks:
    """Per hook: whether the engine's stream was still busy when the hook returned (a sleep queued before it),
    while ``on``."""

    def __init__(self, monkeypatch):
        self.on = False
        self.still_busy: dict[str, list[bool]] = collections.defaultdict(list)
        for name in HOOKS:
            monkeypatch.setattr(plugin_state._PluginState, name, self._wrap(name, getattr(plugin_state._PluginState,
                                                                                         name)))

    def _wrap(self, name, original):
        def hook(state, *args, **kwargs):
            if not self.on:
                return original(state, *args, **kwargs)
            torch.cuda._sleep(SLEEP_CYCLES)
            result = original(state, *args, **kwargs)
            self.still_busy[name].append(not torch.cuda.current_stream().query())
            return result
        return hook


@pytest.fixture
def busy_before_hooks(monkeypatch):
    return BusyHooks(monkeypatch)


@pytest.mark.parametrize("sentinel", [False, True], ids=["capture", "capture-and-sentinel"])
def test_no_hook_waits_for_the_engines_stream_and_the_snapshots_hold_the_steps(standins, tmp_path, busy_before_hooks,
                                                                               sentinel):
    env = {"KVDBG_CAPTURE_BACKENDS": "FLEX_ATTENTION"}
    if sentinel:  # the sentinel's device checks keep device clones of the metadata beside the host copies
        env.update(KVDBG_SENTINEL="1", KVDBG_SENTINEL_INTERVAL="0", KVDBG_SENTINEL_DIR=str(tmp_path / "sentinel"))
    enable(standins, tmp_path / "capture", **env)
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, query_len=1, seq_lens=(40, 17, 90), layers=2)
    on_device(engine)
    runs = []
    for step in range(3):
        # The first step starts the writer and allocates (pinned memory, events), which may take longer than
        # the sleep: the later steps are the ones checked.
        busy_before_hooks.on = step > 0
        common = device_common(engine)
        inputs = tuple(t.cuda() for t in engine.inputs())
        runs.append((common, engine.step(common=common, inputs=inputs)[2]))
        if step == 0:
            assert vllm_plugin.active_capturer().flush(60)
    torch.cuda.synchronize()

    still_busy = busy_before_hooks.still_busy
    assert {name: len(v) for name, v in still_busy.items()} == {name: 4 if name != "after_build" else 2
                                                                for name in HOOKS}
    for name, busy in still_busy.items():
        assert all(busy), f"{name} waited for the engine's stream: {busy}"

    snaps = snapshots(tmp_path / "capture")
    assert len(snaps) == 6
    for snap in snaps:
        step_index = snap.meta.capture["step"]
        layer = int(snap.meta.layer.name.split(".")[2])
        common, seen = runs[step_index]
        run, step = seen[layer], snap.steps[0]
        assert torch.equal(step.block_table, common.block_table_tensor.cpu())
        assert torch.equal(step.seq_lens, common.seq_lens.cpu())
        assert torch.equal(step.query_start_loc, common.query_start_loc.cpu())
        assert torch.equal(step.slot_mapping, common.slot_mapping.cpu())
        assert torch.equal(step.query, run["query"].view(step.query.shape).cpu())
        assert torch.equal(step.key, run["key"].view(step.key.shape).cpu())
        assert torch.equal(step.output, run["output"].view(step.output.shape).cpu())
        # The pages as the step found them (the update wrote its slots before the forward).
        assert torch.equal(snap.kv_cache, run["cache_before"][snap.page_ids.long().cuda()].cpu())
        assert "read back" in snap.meta.capture["kv_layout_read_back"]


def test_a_slot_mapping_buffer_reused_by_a_build_that_copied_nothing_is_read_from_the_device(standins, tmp_path):
    """A runner reuses its slot-mapping buffer: a host copy from an earlier build is never taken for a later one."""
    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLEX_ATTENTION", KVDBG_CAPTURE_STEPS="0")
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, query_len=1, seq_lens=(40, 17))
    on_device(engine)
    state = vllm_plugin._state
    slots = device_common(engine).slot_mapping
    buffer = torch.full((8,), -1, dtype=torch.int64, device="cuda")

    def common_on(buffer_values):
        common = device_common(engine)
        buffer[: len(buffer_values)] = buffer_values
        common.slot_mapping = buffer[: len(buffer_values)]
        return common

    engine.step(common=common_on(slots), inputs=tuple(t.cuda() for t in engine.inputs()))  # step 0: captured
    # Step 1 is not captured: its build copies nothing and must forget step 0's copy of the same buffer.
    later = common_on(slots + 1)
    engine.builder.build(0, later)
    assert state.host_slots(engine.names[0], later.slot_mapping) == (later.slot_mapping, None)
    (snap,) = snapshots(tmp_path)
    assert torch.equal(snap.steps[0].slot_mapping, slots.cpu())


def test_a_slot_mapping_the_update_gets_but_no_build_saw_is_read_from_the_device(standins, tmp_path):
    """A drafter's first pass: built with the target's slot mapping, its update handed a view of its own buffer,
    rewritten since an earlier build copied it. The step's own slots are saved, and they read back."""
    from vllm.forward_context import set_forward_context

    enable(standins, tmp_path, KVDBG_CAPTURE_BACKENDS="FLEX_ATTENTION")
    engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, query_len=1, seq_lens=(40, 17))
    on_device(engine)
    buffer = torch.full((8,), -1, dtype=torch.int64, device="cuda")
    first = device_common(engine)
    buffer[:2] = first.slot_mapping
    first.slot_mapping = buffer[:2]
    want = [first.slot_mapping.tolist()]
    engine.step(common=first, inputs=tuple(t.cuda() for t in engine.inputs()))  # built and updated with the buffer
    second = device_common(engine)  # the target's slot mapping, a tensor of its own
    buffer[:2] = second.slot_mapping  # the drafter's buffer rewritten; no build sees it
    want.append(second.slot_mapping.tolist())
    metadata = engine.builder.build(0, second)
    name, layer = engine.names[0], engine.layers[0]
    with set_forward_context({name: metadata}, {name: layer}, {name: buffer[:2]}):
        layer.forward(*(t.cuda() for t in engine.inputs()))
    snaps = snapshots(tmp_path)
    assert [snap.steps[0].slot_mapping.tolist() for snap in snaps] == want
    assert all("read back" in snap.meta.capture["kv_layout_read_back"] for snap in snaps)
