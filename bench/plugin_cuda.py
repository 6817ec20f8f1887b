"""What the vLLM plugin's hooks cost the engine's thread on a GPU whose stream is busy, per captured step.

Usage (a CUDA machine; torch only, no vLLM):
    python bench/plugin_cuda.py [--steps 30] [--busy-us 0,500] [--layers 4] [--out /tmp/kvdbg-plugin-cuda]

A real engine reaches a layer's hooks with the device still running the
kernels it queued before (the host leads the device). A hook that reads a
device tensor on the host waits for all of them; one that only issues copies
does not. This runs the vLLM stand-ins of the tests (tests/vllm_standins: vLLM's
classes and call order, plain-torch attention) on the device with kvdbg's plugin
capturing one layer of ``--layers``, and queues ``--busy-us`` of device work
(a sleep kernel) on the engine's stream before each of the plugin's three hooks
(the build's, the cache update's, the forward's), standing in for that queued work.

Printed per busy time: the wall time of the plugin's hooks per captured step
(median; the hooks of the steps' other layers excluded), and how many hooks
returned with the engine's stream still busy (none waited for it) out of how
many ran. The stand-in attention itself reads the device on the host (it is no
kernel), so the engine's step time says nothing here and is not printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "vllm_standins"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _cuda import cycles_per_us  # noqa: E402

HOOKS = ("after_build", "before_cache_update", "before_forward")


def run(busy_us: float, steps: int, layers: int, out: str, clock: float) -> dict:
    from kvdbg import vllm_plugin
    from kvdbg.vllm_plugin import state as plugin_state
    from tests.test_vllm_plugin import StandinEngine
    from vllm.v1.attention.backend import CommonAttentionMetadata

    directory = os.path.join(out, f"busy{int(busy_us)}")
    shutil.rmtree(directory, ignore_errors=True)
    os.environ.update(KVDBG_CAPTURE_DIR=directory, KVDBG_CAPTURE_BACKENDS="FLEX_ATTENTION",
                      KVDBG_CAPTURE_LAYERS="*.layers.1.*", KVDBG_CAPTURE_MAX="unlimited")
    vllm_plugin.register()
    spent: dict[str, list[float]] = {name: [] for name in HOOKS}
    busy_after = [0, 0]
    recording = [False]
    originals = {name: getattr(plugin_state._PluginState, name) for name in HOOKS}
    cycles = int(busy_us * clock)

    def timed(name, original):
        def hook(self, *args, **kwargs):
            if cycles:
                torch.cuda._sleep(cycles)
            t0 = time.perf_counter()
            result = original(self, *args, **kwargs)
            elapsed = time.perf_counter() - t0
            captured = result is not None and result is not False
            if recording[0] and captured:
                spent[name].append(elapsed)
                busy_after[0] += not torch.cuda.current_stream().query()
                busy_after[1] += 1
            return result
        return hook

    for name in HOOKS:
        setattr(plugin_state._PluginState, name, timed(name, originals[name]))
    try:
        engine = StandinEngine("FLEX_ATTENTION", causal=True, window=None, query_len=1, seq_lens=(60,),
                               layers=layers, num_blocks=64, num_heads=8, num_kv_heads=2, head_size=64)
        for layer in engine.layers:
            layer.kv_cache = layer.kv_cache.cuda()
        for step in range(steps + 3):
            recording[0] = step >= 3  # the first steps allocate (pinned memory, events)
            c = engine.common()
            common = CommonAttentionMetadata(
                query_start_loc=c.query_start_loc.cuda(), query_start_loc_cpu=c.query_start_loc_cpu,
                seq_lens=c.seq_lens.cuda(), num_reqs=c.num_reqs, num_actual_tokens=c.num_actual_tokens,
                max_query_len=c.max_query_len, max_seq_len=c.max_seq_len,
                block_table_tensor=c.block_table_tensor.cuda(), slot_mapping=c.slot_mapping.cuda(), causal=c.causal)
            engine.step(common=common, inputs=tuple(t.cuda() for t in engine.inputs()))
            torch.cuda.synchronize()
        capturer = vllm_plugin.active_capturer()
        capturer.flush(600)
        written, dropped = len(capturer.written), sum(capturer.dropped.values())
    finally:
        for name in HOOKS:
            setattr(plugin_state._PluginState, name, originals[name])
        vllm_plugin.unregister()
    # One build per step and one update and forward of the captured layer: their sum per step.
    per_step = [sum(parts) for parts in zip(*(spent[name] for name in HOOKS))]
    return {"busy_us": busy_us, "hooks_us_per_step": statistics.median(per_step) * 1e6,
            "by_hook_us": {name: statistics.median(v) * 1e6 for name, v in spent.items()},
            "hooks_returned_busy": busy_after[0], "hooks_timed": busy_after[1], "written": written,
            "dropped": dropped}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--busy-us", default="0,500", help="device work queued before each hook, in microseconds")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--out", default="/tmp/kvdbg-plugin-cuda")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device here", file=sys.stderr)
        return 2
    clock = cycles_per_us()
    rows = [run(float(b), args.steps, args.layers, args.out, clock) for b in args.busy_us.split(",")]
    import kvdbg

    print(f"kvdbg from {os.path.dirname(kvdbg.__file__)}")
    print(f"vLLM plugin hooks on {torch.cuda.get_device_name()}, torch {torch.__version__}; layer 1 of "
          f"{args.layers} captured, {args.steps} steps; sleep kernel at {clock:.0f} cycles/us")
    for r in rows:
        parts = ", ".join(f"{name} {us:.0f}" for name, us in r["by_hook_us"].items())
        print(f"  busy {r['busy_us']:6.0f} us before each hook: hooks {r['hooks_us_per_step']:8.1f} us per captured "
              f"step ({parts}); returned with the stream busy {r['hooks_returned_busy']}/{r['hooks_timed']}; "
              f"wrote {r['written']}, dropped {r['dropped']}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
