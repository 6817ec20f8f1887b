"""What another Python thread's wish for the GIL costs a thread that makes small torch calls (any machine, CPU).

Usage:
    python bench/gil_handover.py [--calls 10] [--elements 32768] [--iters 1000] [--switch-ms 5]

A torch call releases the GIL while it dispatches. When another thread of the process is waiting for the
GIL and wakes while the call runs (a free core), it takes it, and the caller waits to get it back before it
can go on: a hand-over, and a wait, at such a call. A thread running pure Python gives the lock back only
when the interpreter asks it to (after ``sys.getswitchinterval()``, 5 ms by default), so each such call
then costs the caller a whole interval. Run it on an idle machine: on a loaded one the other thread wakes
late and the hand-overs mostly do not happen (the bench says so when the load is over half the cores).

This is a reading of why the engine's thread's part of a wanted CUDA-graph step costs about four times more
inside vLLM's engine than in ``bench/staging_calls.py`` alone (docs/benchmarks.md §10); this bench measures
the mechanism on its own.

A *caller* thread makes ``--calls`` torch calls in a row (copies of ``--elements`` int64, a few µs each, as
long as a CUDA runtime call) ``--iters`` times. Each sequence is timed on the caller's thread: wall time
(``perf_counter_ns``), the thread's own CPU time (``time.thread_time_ns``: wall less CPU is time off the CPU,
waiting), and the thread's voluntary context switches (``getrusage(RUSAGE_THREAD)``: each wait for the GIL
is one). It runs beside three kinds of *other* thread:

- ``alone``: none;
- ``torch-worker``: one that makes small torch and numpy calls in a loop (as kvdbg's capture thread and writer
  do: work that releases the GIL often);
- ``python-worker``: one that runs pure Python (it gives the GIL back only when the interpreter asks it to,
  after ``sys.getswitchinterval()``);
- ``kvdbg-writer``: kvdbg's own snapshot write, over and over (validation, the safetensors header, the
  atomic write of a synthetic step of four requests, 8 query heads over 2 KV heads of 128, bfloat16), at the
  niceness kvdbg's background writer thread takes (kvdbg.capture.writer): what capturing costs an engine's
  thread while the steps after a capture are written.
- ``sentinel-check``: the sentinel's check of one drawn step, over and over, as its worker thread runs it
  (``kvdbg.sentinel.checker.check_layers``: the whole output's non-finite check and 4 (request, head) pairs a
  layer against the reference) on a step shaped as ``bench/graph_cost.py``'s engine: 8 layers, 64 decode
  requests of 129–255 tokens in pages of 16, 32 query heads over 8 KV heads of 128, bfloat16, an honest
  output. What a drawn step's check costs the engine's thread while it runs. The run also prints the check's
  own time and its number of torch calls (calls into torch's Python bindings: a tensor's attributes left out).
- ``sentinel-check-stacked``: the same check of the same step with the layers' copies in one buffer per kind, a
  layer per index (``graph_staging.StagedStack``), as a CUDA graph's staging lays alike layers out: the check
  then picks every layer's pages, query and output rows at once. Its own time and torch calls are printed too.

and the same with one call a sequence (``--calls 1``'s figure is printed beside), so the cost per call shows.
About two minutes with the defaults (beside pure Python each call waits a switch interval).
Prints one line per case, the ratios against ``alone`` from this one run, and ``GIL-HANDOVER {json}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import threading
import time


OTHERS = ("alone", "torch-worker", "python-worker", "kvdbg-writer", "sentinel-check", "sentinel-check-stacked")


def _sequence(calls: int, elements: int):
    """``calls`` torch calls in a row, each a copy of ``elements`` int64 (about as long as a CUDA runtime call at
    the default: a few µs, the GIL released meanwhile)."""
    import torch

    source = torch.arange(elements, dtype=torch.int64)
    target = torch.empty(elements, dtype=torch.int64)

    def run() -> None:
        for _ in range(calls):
            target.copy_(source)

    return run


def _time(run, iters: int) -> dict:
    for _ in range(20):
        run()
    wall, cpu, switches = [], [], []
    who = getattr(resource, "RUSAGE_THREAD", None)  # Linux; elsewhere no count of switches

    def switched() -> int:
        return 0 if who is None else resource.getrusage(who).ru_nvcsw

    began = time.perf_counter_ns()
    for _ in range(iters):
        before = switched()
        c0 = time.thread_time_ns()
        w0 = time.perf_counter_ns()
        run()
        w1 = time.perf_counter_ns()
        c1 = time.thread_time_ns()
        switches.append(switched() - before)
        wall.append(w1 - w0)
        cpu.append(c1 - c0)
    whole = time.perf_counter_ns() - began
    ordered = sorted(wall)
    return {"wall_us": statistics.median(wall) / 1e3, "wall_p90_us": ordered[int(0.9 * (iters - 1))] / 1e3,
            "wall_p99_us": ordered[int(0.99 * (iters - 1))] / 1e3, "wall_max_us": ordered[-1] / 1e3,
            "stalled": sum(w > 1_000_000 for w in wall) / iters,  # sequences that waited over a millisecond
            "mean_us": statistics.fmean(wall) / 1e3, "loop_us": whole / iters / 1e3,
            "cpu_us": statistics.median(cpu) / 1e3,
            "off_cpu_us": statistics.median([max(0, w - c) for w, c in zip(wall, cpu)]) / 1e3,
            "switches": statistics.fmean(switches) if who is not None else None}


class _Other:
    """A second thread of the process, of one kind, running until stopped."""

    def __init__(self, kind: str):
        self.kind, self.stop, self.loops = kind, threading.Event(), 0
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        import numpy as np
        import torch

        if self.kind == "kvdbg-writer":
            return self._write()
        if self.kind in ("sentinel-check", "sentinel-check-stacked"):
            return self._check(stacked=self.kind.endswith("stacked"))
        a = torch.zeros(2048)
        b = np.zeros(2048)
        while not self.stop.is_set():
            if self.kind == "torch-worker":
                a.add_(1.0)
                torch.index_select(a, 0, torch.arange(64))
                b += 1.0
            else:
                total = 0
                for i in range(2000):
                    total += i * i
            self.loops += 1

    def _write(self) -> None:
        import os
        import tempfile

        from kvdbg.capture.writer import writer_niceness
        from kvdbg.moves.synth import SynthSpec, synth_snapshot
        from kvdbg.snapshot.store import save_snapshot

        try:  # as kvdbg's writer thread does (Linux)
            me = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, me, writer_niceness(os.getpriority(os.PRIO_PROCESS, me)))
        except (AttributeError, OSError):
            pass
        snapshot = synth_snapshot(SynthSpec(seq_lens=(300, 77, 150, 512), num_heads=8, num_kv_heads=2,
                                            head_size=128, page_size=16))
        with tempfile.TemporaryDirectory(prefix="kvdbg-gil-") as directory:
            while not self.stop.is_set():
                path = os.path.join(directory, f"step{self.loops % 2}.safetensors")
                save_snapshot(snapshot, path, overwrite=True)
                self.loops += 1

    def _check(self, stacked: bool = False) -> None:
        import random

        from kvdbg.sentinel.checker import check_layers

        entries, rng = check_entries(stacked=stacked), random.Random(0)
        while not self.stop.is_set():
            check_layers(entries, pairs=4, rng=rng, step=self.loops)
            self.loops += 1

    def __enter__(self):
        self.thread.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def check_entries(layers: int = 8, requests: int = 64, heads: int = 32, kv_heads: int = 8, head_size: int = 128,
                  page_size: int = 16, seed: int = 0, stacked: bool = False) -> list:
    """A decode step of ``layers`` layers as the sentinel's worker is handed it (``(CaptureLayer, StepInputs)``
    each, the step's metadata tensors shared), with the output an honest kernel would give (bfloat16);
    ``stacked``: the layers' copies in one buffer per kind, as a graph's staging lays alike layers out."""
    import torch

    from kvdbg.capture.inputs import CaptureLayer
    from kvdbg.sentinel.checker import StepInputs
    from kvdbg.snapshot.meta import LAYOUT_VLLM

    g = torch.Generator().manual_seed(seed)
    seq_lens = (torch.randint(129, 256, (requests,), generator=g)).tolist()
    live = [-(-n // page_size) for n in seq_lens]
    pages, width = sum(live) + 1, max(live)
    order = (torch.randperm(pages - 1, generator=g) + 1).tolist()  # page 0: vLLM's null block
    table = torch.zeros(requests, width, dtype=torch.int32)
    used = 0
    for r, count in enumerate(live):
        table[r, :count] = torch.tensor(order[used:used + count], dtype=torch.int32)
        used += count
    qsl = torch.arange(requests + 1, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    group, scale = heads // kv_heads, head_size ** -0.5
    entries = []
    for layer_index in range(layers):
        layer = CaptureLayer(name=f"model.layers.{layer_index}.self_attn.attn", num_heads=heads,
                             num_kv_heads=kv_heads, head_size=head_size, scale=scale, dtype="bfloat16",
                             kv_layout=LAYOUT_VLLM)
        cache = torch.randn(pages, kv_heads, page_size, 2 * head_size, generator=g).to(torch.bfloat16)
        query = torch.randn(requests, heads, head_size, generator=g).to(torch.bfloat16)
        output = torch.empty(requests, heads, head_size, dtype=torch.bfloat16)
        for r, n in enumerate(seq_lens):
            kv = cache[table[r, :live[r]].long()].float()  # [pages, Hkv, page, 2D]
            kv = kv.permute(1, 0, 2, 3).reshape(kv_heads, -1, 2 * head_size)[:, :n]
            k, v = kv[..., :head_size].repeat_interleave(group, 0), kv[..., head_size:].repeat_interleave(group, 0)
            weights = torch.softmax((query[r].float().unsqueeze(1) @ k.transpose(1, 2)) * scale, dim=-1)
            output[r] = (weights @ v).squeeze(1).to(torch.bfloat16)
        inputs = StepInputs(query=query.view(requests, -1), kv_cache=cache, block_table=table, seq_lens=lens,
                            query_start_loc=qsl, causal=True, output=output.view(requests, -1), max_model_len=4096)
        entries.append((layer, inputs))
    if not stacked:
        return entries
    import dataclasses

    from kvdbg.vllm_plugin.graph_staging import StagedStack

    stack = StagedStack(*(torch.stack([getattr(inputs, kind) for _, inputs in entries])
                          for kind in ("kv_cache", "query", "output")))
    return [(layer, dataclasses.replace(inputs, kv_cache=stack.pages[i], query=stack.query[i],
                                        output=stack.output[i], stack=(stack, i)))
            for i, (layer, inputs) in enumerate(entries)]


def check_cost(iters: int = 50, stacked: bool = False) -> dict:
    """The sentinel's check of :func:`check_entries`'s step on this thread alone: median time, torch calls, and
    whether it passed (an honest step must)."""
    import random

    from torch.overrides import TorchFunctionMode

    from kvdbg.sentinel.checker import check_layers

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__qualname__", "") != "getset_descriptor.__get__":  # a tensor's attribute: no call into torch
                self.count += 1
            return func(*args, **(kwargs or {}))

    entries, rng = check_entries(stacked=stacked), random.Random(0)
    results = check_layers(entries, pairs=4, rng=rng, step=0)
    with Calls() as calls:
        check_layers(entries, pairs=4, rng=rng, step=0)
    times = []
    for step in range(iters):
        began = time.perf_counter_ns()
        check_layers(entries, pairs=4, rng=rng, step=step)
        times.append(time.perf_counter_ns() - began)
    return {"check_us": statistics.median(times) / 1e3, "torch_calls": calls.count,
            "passed": all(result.passed for result in results), "layers": len(entries)}


def _count(value: float | None) -> str:
    return "    ?" if value is None else f"{value:5.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10, help="torch calls a sequence [10]")
    parser.add_argument("--elements", type=int, default=32768,
                        help="int64 elements each call copies [32768: about 5 us, as long as a CUDA launch]")
    parser.add_argument("--iters", type=int, default=1000, help="sequences timed a case [1000]")
    parser.add_argument("--switch-ms", type=float, default=None,
                        help="the interpreter's switch interval for the run (default: as it is)")
    parser.add_argument("--others", default=",".join(OTHERS),
                        help=f"the other threads' kinds, comma-separated [{','.join(OTHERS)}]")
    args = parser.parse_args(argv)
    others = [kind.strip() for kind in args.others.split(",") if kind.strip()]
    unknown = [kind for kind in others if kind not in OTHERS]
    if unknown:
        print(f"gil_handover: --others: unknown kind(s) {', '.join(unknown)} (known: {', '.join(OTHERS)})",
              file=sys.stderr)
        return 2
    args.others = ["alone"] + [kind for kind in others if kind != "alone"]
    if args.calls < 1 or args.iters < 10 or args.elements < 1 or (args.switch_ms is not None
                                                                   and not 0 < args.switch_ms <= 1000):
        print("gil_handover: --calls and --elements must be >= 1, --iters >= 10, --switch-ms in (0, 1000]",
              file=sys.stderr)
        return 2
    if args.switch_ms is not None:
        sys.setswitchinterval(args.switch_ms / 1e3)
    import os

    import torch

    load, cores = os.getloadavg(), os.cpu_count() or 1  # the machine as the cases begin

    torch.set_num_threads(1)  # one intra-op thread: the caller's calls stay on the caller's thread
    cases = {}
    for kind in args.others:
        for calls in dict.fromkeys((1, args.calls)):
            run = _sequence(calls, args.elements)
            if kind == "alone":
                cases[(kind, calls)] = _time(run, args.iters)
            else:
                with _Other(kind):
                    cases[(kind, calls)] = _time(run, args.iters)
    print(f"gil_handover: {args.iters} sequences a case, calls of {args.elements} elements, switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms, Python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{cores} cores, load {load[0]:.2f} before the cases, {os.getloadavg()[0]:.2f} after")
    if max(load[0], os.getloadavg()[0]) > cores / 2:
        # A waiting thread takes the lock only if it wakes within the call: with no core free it wakes late and
        # the hand-overs this bench measures mostly do not happen.
        print("  (a loaded machine: the other thread wakes late and takes the lock less often than on an idle "
              "one; run it idle)")
    rows = []
    for (kind, calls), f in cases.items():
        alone = cases[("alone", calls)]
        ratio = f["wall_us"] / alone["wall_us"] if alone["wall_us"] else None
        loop = f["loop_us"] / alone["loop_us"] if alone["loop_us"] else None
        rows.append({"other": kind, "calls": calls, **f, "median_to_alone": ratio, "loop_to_alone": loop})
        print(f"  {kind:13s} {calls:2d} call(s): median {f['wall_us']:7.1f} us ({ratio:5.2f}x alone), p99 "
              f"{f['wall_p99_us']:8.1f}, max {f['wall_max_us']:8.1f}; stalled > 1 ms {f['stalled']:6.1%}; off the "
              f"CPU {f['off_cpu_us']:6.1f} us, switches {_count(f['switches'])} a sequence; a loop turn "
              f"{loop:5.2f}x alone")
    check = checks = None
    for kind in ("sentinel-check", "sentinel-check-stacked"):
        if kind in args.others:
            check = check_cost(iters=max(3, min(50, args.iters // 20)), stacked=kind.endswith("stacked"))
            checks = {**(checks or {}), kind: check}
            print(f"  the sentinel's check alone{', its layers stacked' if kind.endswith('stacked') else ''}: "
                  f"{check['check_us']:.0f} us a step of {check['layers']} layers, {check['torch_calls']} torch "
                  f"calls, {'passed' if check['passed'] else 'FAILED (not an honest step)'}")
    print("GIL-HANDOVER " + json.dumps({"switch_interval_ms": sys.getswitchinterval() * 1e3, "iters": args.iters,
                                        "cores": cores, "load_before": load[0], "load_after": os.getloadavg()[0],
                                        "elements": args.elements, "python": sys.version.split()[0],
                                        "torch": torch.__version__, "cases": rows,
                                        "sentinel_check": (checks or {}).get("sentinel-check"),
                                        "sentinel_checks": checks}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
