"""What the sentinel costs a real vLLM (CPU) engine's step at a given rate, against the engine with kvdbg off.

Usage (inside a venv with vLLM's CPU build, e.g. the engine stage's):
    .venv-engine/bin/python bench/sentinel_cost.py [--rate 0.01] [--rounds 20] [--out /tmp/kvdbg-sentinel-cost]

One process, one engine (vLLM in-process, CPU_ATTN, a 4-layer float16 model of
16 query / 4 KV heads of 64, 8 requests of ~200 tokens decoding 48 tokens each).
Rounds alternate, so that a neighbour's load falls on both sides alike:

    off   kvdbg's plugin unregistered: vLLM's own classes, nothing wrapped
    on    the plugin registered with only KVDBG_SENTINEL=<rate> (capture off): every layer's
          steps are drawn at that rate and checked (output non-finite check, 4 pairs exact)

Each round serves the same batch; its wall time and the process's CPU time
(all threads: torch's intra-op threads and the sentinel's) are divided by the
decode steps. Printed: the median over rounds of on / off for both clocks, the
quartiles of the per-pair ratios, the checks done, and, as a cross-check
whose noise does not depend on the rate, the ratio accounted from the hooks'
own time (measured in a short extra phase at rate 1, scaled to the rate).
Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PROMPTS, PROMPT_LEN, TOKENS = 8, 200, 48


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=None, help="sentinel rate (default: KVDBG_SENTINEL=on's)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds per side")
    parser.add_argument("--out", default="/tmp/kvdbg-sentinel-cost")
    args = parser.parse_args()

    from kvdbg.sentinel.config import DEFAULT_RATE
    from tests.engine.tiny_model import TinyModel, write_model

    rate = DEFAULT_RATE if args.rate is None else args.rate
    model = TinyModel("bench_sentinel", dtype="float16", num_layers=4, hidden_size=1024, num_heads=16,
                      num_kv_heads=4, intermediate_size=2048, vocab_size=1024, max_position_embeddings=1024)
    model_dir = write_model(model, os.path.join(args.out, "model"))
    os.environ.update(KVDBG_SENTINEL=str(rate), KVDBG_SENTINEL_DIR=os.path.join(args.out, "snapshots"),
                      KVDBG_CAPTURE_BACKENDS="CPU_ATTN", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    os.environ.pop("KVDBG_CAPTURE_DIR", None)

    from vllm import LLM, SamplingParams

    from kvdbg import vllm_plugin

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=1024,
              num_gpu_blocks_override=128, seed=0, gpu_memory_utilization=0.25, enable_prefix_caching=False)
    batch = [{"prompt_token_ids": [3 + (i * 37 + j * 101) % 1000 for i in range(PROMPT_LEN + 3 * j)]}
             for j in range(PROMPTS)]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0.0)

    def serve() -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        llm.generate(batch, params, use_tqdm=False)
        return (time.perf_counter() - wall) / TOKENS, (time.process_time() - cpu) / TOKENS

    def side(on: bool) -> None:
        if on and vllm_plugin._state is None:
            vllm_plugin.register()
        elif not on and vllm_plugin._state is not None:
            vllm_plugin.unregister()

    side(True)
    if vllm_plugin._state is None or vllm_plugin._state.sentinel is None:
        print("the plugin did not start the sentinel; see the log above", file=sys.stderr)
        return 1
    for on in (False, True):  # warm both sides
        side(on)
        serve()
    checks, pairs = [], []
    for _ in range(args.rounds):
        side(False)
        off = serve()
        side(True)
        before = vllm_plugin._state.sentinel.sentinel.counts["checked"]
        on = serve()
        checks.append(vllm_plugin._state.sentinel.sentinel.counts["checked"] - before)
        pairs.append((on, off))

    # The hooks' own time per layer-step, at rate 1 (every step) and with no step drawn (rate ~0).
    hooks_cls = type(vllm_plugin._state.sentinel)
    hook_names = ("after_forward", "before_cache_update")
    spent = {"wall": 0.0, "cpu": 0.0}
    originals = {name: getattr(hooks_cls, name) for name in hook_names}

    def timed(name):
        def run(self, *a, **k):
            wall, cpu = time.perf_counter(), time.process_time()
            try:
                return originals[name](self, *a, **k)
            finally:
                spent["wall"] += time.perf_counter() - wall
                spent["cpu"] += time.process_time() - cpu
        return run

    import dataclasses

    for name in hook_names:
        setattr(hooks_cls, name, timed(name))
    per_layer_step = {}
    try:
        for label, phase_rate in (("sampled", 1.0), ("unsampled", 1e-9)):
            hooks = vllm_plugin._state.sentinel
            hooks.sentinel.config = dataclasses.replace(hooks.sentinel.config, rate=phase_rate)
            spent.update(wall=0.0, cpu=0.0)
            serve()
            per_layer_step[label] = {k: v / (TOKENS * model.num_layers) for k, v in spent.items()}
    finally:
        for name, fn in originals.items():
            setattr(hooks_cls, name, fn)
    side(False)
    off_wall = statistics.median(off[0] for _, off in pairs)
    off_cpu = statistics.median(off[1] for _, off in pairs)

    def accounted(clock: str, step: float) -> float:
        hooks = rate * per_layer_step["sampled"][clock] + (1 - rate) * per_layer_step["unsampled"][clock]
        return 1 + hooks * model.num_layers / step

    wall_ratios = sorted(on[0] / off[0] for on, off in pairs)
    cpu_ratios = sorted(on[1] / off[1] for on, off in pairs)
    wall = statistics.median(on[0] for on, _ in pairs) / off_wall
    cpu = statistics.median(on[1] for on, _ in pairs) / statistics.median(off[1] for _, off in pairs)
    q = lambda xs: (xs[len(xs) // 4], xs[(3 * len(xs)) // 4])  # noqa: E731
    print(f"sentinel rate {rate:g}, {args.rounds} rounds per side of {PROMPTS} requests x {TOKENS} decode steps, "
          f"{model.num_layers} layers (CPU_ATTN, float16, {model.num_heads}/{model.num_kv_heads} heads of "
          f"{model.head_dim})")
    print(f"  step time off (median)        {off_wall * 1e3:8.2f} ms wall")
    print(f"  on / off, wall (median)       {wall:8.4f}   per-round quartiles {q(wall_ratios)[0]:.4f} .. "
          f"{q(wall_ratios)[1]:.4f}")
    print(f"  on / off, process CPU         {cpu:8.4f}   per-round quartiles {q(cpu_ratios)[0]:.4f} .. "
          f"{q(cpu_ratios)[1]:.4f}")
    print(f"  checks per round              {statistics.mean(checks):8.2f}   (expected {rate * TOKENS * model.num_layers:.2f})")
    for clock, step in (("wall", off_wall), ("cpu", off_cpu)):
        print(f"  hooks per layer-step, {clock:<4}    {per_layer_step['sampled'][clock] * 1e3:8.3f} ms checked, "
              f"{per_layer_step['unsampled'][clock] * 1e6:.2f} us not drawn -> accounted on / off "
              f"{accounted(clock, step):.4f}")
    print(json.dumps({"rate": rate, "rounds": args.rounds, "step_ms_off": off_wall * 1e3, "step_cpu_ms_off":
                      off_cpu * 1e3, "ratio_wall": wall, "ratio_cpu": cpu,
                      "ratio_accounted_wall": accounted("wall", off_wall), "ratio_accounted_cpu":
                      accounted("cpu", off_cpu), "checks_per_round": statistics.mean(checks),
                      "hooks_per_layer_step": per_layer_step}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
