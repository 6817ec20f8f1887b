"""The sentinel's device path on a GPU: step time of a torch loop standing in for an engine, sentinel at a rate vs off.

Usage (a CUDA machine; no vLLM needed; kvdbg installed with pip install -e .):
    python3 bench/sentinel_cuda.py [--rate 0.01] [--rounds 10] [--steps 64]

The stand-in engine: L layers, each step per layer writes the new K/V of B
decoding requests into a paged bfloat16 cache ([blocks, Hkv, page, 2*D]),
runs paged attention (the pages gathered through the block table, SDPA with
GQA), and two projections of the hidden size standing for the rest of the
layer. The engine's thread never waits for the device within a step.

With the sentinel on, each (layer, step) is drawn at the rate; a drawn step's
query and output rows are copied on the engine's stream and
:class:`kvdbg.sentinel.checker.DeferredChecks` checks it in its worker thread on a
side stream; the engine collects the verdict before that layer's next cache
update (as the vLLM plugin does). Rounds of ``--steps`` steps alternate off
and on; printed: the median step time of each, their ratio, and the same at
rate 1 (every step checked) to show what the side stream hides. A fault run
then moves one head of one step's output and checks that the sentinel
reports exactly that step. Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvdbg.capture.prepare import CaptureLayer  # noqa: E402
from kvdbg.snapshot.format import LAYOUT_VLLM  # noqa: E402
from kvdbg.sentinel.checker import DeferredChecks, Sentinel, StepInputs  # noqa: E402
from kvdbg.sentinel.config import DEFAULT_RATE, SentinelConfig  # noqa: E402


class StandIn:
    def __init__(self, *, layers=8, requests=32, context=2048, hq=32, hkv=8, d=128, page=16, hidden=4096):
        dev, dt = torch.device("cuda"), torch.bfloat16
        self.layers, self.requests, self.hq, self.hkv, self.d, self.page = layers, requests, hq, hkv, d, page
        pages_per = -(-(context + 1024) // page)
        self.blocks = requests * pages_per + 1
        self.caches = [torch.randn(self.blocks, hkv, page, 2 * d, device=dev, dtype=dt) for _ in range(layers)]
        perm = torch.randperm(self.blocks - 1, device=dev) + 1
        self.table = perm[: requests * pages_per].view(requests, pages_per).to(torch.int32)
        self.seq_lens = torch.full((requests,), context, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(requests + 1, dtype=torch.int32, device=dev)
        self.w1 = torch.randn(hidden, hq * d, device=dev, dtype=dt) / hidden ** 0.5
        self.w2 = torch.randn(hidden, hidden, device=dev, dtype=dt) / hidden ** 0.5
        self.hidden = hidden
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        self.meta = [CaptureLayer(name=n, num_heads=hq, num_kv_heads=hkv, head_size=d, scale=d ** -0.5,
                                  dtype="bfloat16", kv_layout=LAYOUT_VLLM) for n in self.names]
        self.fault: tuple[int, int] | None = None  # (layer, step) whose output head 1 is moved

    def attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        length = int(self.seq_lens_host)
        live = -(-length // self.page)
        pages = self.caches[layer][self.table[:, :live].long()]  # [B, P, Hkv, page, 2D]
        kv = pages.permute(0, 2, 1, 3, 4).reshape(self.requests, self.hkv, live * self.page, 2 * self.d)[:, :, :length]
        k, v = kv[..., : self.d], kv[..., self.d:]
        out = torch.nn.functional.scaled_dot_product_attention(q.view(self.requests, self.hq, 1, self.d), k, v,
                                                               enable_gqa=True)
        return out.view(self.requests, self.hq, self.d)

    def run(self, steps: int, sentinel: Sentinel | None, deferred: DeferredChecks | None, start_step: int = 0):
        x = torch.randn(self.requests, self.hidden, device="cuda", dtype=torch.bfloat16)
        waiting = set()
        for s in range(start_step, start_step + steps):
            self.seq_lens_host = self.base_len + s
            self.seq_lens.fill_(self.seq_lens_host)
            for i in range(self.layers):
                name = self.names[i]
                if name in waiting:  # the layer's previous check, before its cache changes
                    waiting.discard(name)
                    job = deferred.collect(name)
                    sentinel.record(job.result)
                q = (x @ self.w1).view(self.requests, self.hq, self.d)
                pos = self.seq_lens_host - 1
                slot_page = self.table[:, pos // self.page].long()
                new = torch.randn(self.requests, self.hkv, 2 * self.d, device="cuda", dtype=torch.bfloat16)
                self.caches[i][slot_page, :, pos % self.page] = new
                out = self.attention(i, q)
                if self.fault == (i, s):
                    out[:, 1] += 1.0
                if sentinel is not None and sentinel.sampled(name, s):
                    inputs = StepInputs(query=q, kv_cache=self.caches[i], block_table=self.table,
                                        seq_lens=self.seq_lens.clone(), query_start_loc=self.qsl, causal=True,
                                        output=out, max_model_len=4096)
                    deferred.submit(self.meta[i], inputs, s)
                    waiting.add(name)
                x = x + (out.reshape(self.requests, -1) @ self.w1.T) @ self.w2 * 1e-3
        for name in waiting:
            job = deferred.collect(name)
            sentinel.record(job.result)
        torch.cuda.synchronize()


def timed(engine: StandIn, steps: int, sentinel=None, deferred=None) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.run(steps, sentinel, deferred)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    engine = StandIn()
    engine.base_len = 2048 - args.steps * 2
    results = {}
    for rate in (args.rate, 1.0):
        sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=rate, seed=0))
        deferred = DeferredChecks(sentinel, torch.device("cuda"))
        timed(engine, 4)
        timed(engine, 4, sentinel, deferred)
        off, on = [], []
        for _ in range(args.rounds):
            off.append(timed(engine, args.steps))
            on.append(timed(engine, args.steps, sentinel, deferred))
        ratios = sorted(b / a for a, b in zip(off, on))
        results[rate] = dict(off_ms=statistics.median(off) * 1e3, on_ms=statistics.median(on) * 1e3,
                             ratio=statistics.median(on) / statistics.median(off),
                             quartiles=(ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]),
                             checked=sentinel.counts["checked"], failed=sentinel.counts["failed"])
    # A fault: one head of one step's output; the sentinel at rate 1 must report that step and no other.
    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, pairs=engine.requests * engine.hq, seed=0))
    deferred = DeferredChecks(sentinel, torch.device("cuda"))
    engine.fault = (3, 5)
    engine.run(8, sentinel, deferred)
    engine.fault = None
    caught = [(f.result.layer, f.result.step, f.first) for f in sentinel.findings]
    fault_ok = caught == [(engine.names[3], 5, (0, 1))]

    print(f"stand-in engine on {torch.cuda.get_device_name()}: {engine.layers} layers, {engine.requests} requests x "
          f"{int(engine.base_len)}+ tokens, {engine.hq}/{engine.hkv} heads of {engine.d}, bfloat16")
    for rate, r in results.items():
        print(f"  rate {rate:<6g} step off {r['off_ms']:7.3f} ms, on {r['on_ms']:7.3f} ms: on / off {r['ratio']:.4f} "
              f"(quartiles {r['quartiles'][0]:.4f} .. {r['quartiles'][1]:.4f}); {r['checked']} checks, "
              f"{r['failed']} wrong")
    print(f"  fault (layer 3 step 5, head 1): reported {caught} -> {'caught' if fault_ok else 'NOT as expected'}")
    print(json.dumps({"device": torch.cuda.get_device_name(), "fault_caught": fault_ok,
                      **{f"rate_{rate:g}": r for rate, r in results.items()}}))
    return 0 if fault_ok and all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
