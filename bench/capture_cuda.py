"""What capture costs the engine's thread per captured step on a GPU, against copying the snapshot to the host.

Usage (a CUDA machine; torch only, no vLLM):
    python bench/capture_cuda.py [--steps 40] [--sizes small,large] [--out /tmp/kvdbg-capture-cuda] [--phases]
    python bench/capture_cuda.py --device cpu --steps 5     # the same loop on CPU: a dry run of the script

A torch loop stands in for the engine: a paged KV cache on the device in
vLLM's ``pages,heads,tokens,2*dim`` layout, and per decode step the cache
update of the new K/V (on the device), then attention over every page
(a matmul-based stand-in that keeps the GPU busy), capture around it as an
engine integration calls it (``Capturer.begin`` before, ``finish`` after,
through the background writer), and the next step. The block table, lengths
and slots are given on the host, as an engine keeps them there.

    small   Hq 8 / Hkv 2, head 64, pages of 16, 1 request of 60 tokens: ~40 KB per snapshot
    large   Hq 32 / Hkv 8, head 128, pages of 16, 4 requests of 3 200 tokens: ~52 MB per snapshot

Engine-thread time per captured step is the wall time of ``begin`` plus
``finish``, median over a second burst of ``--steps`` steps of the same capture
session (the first burst, whose host buffers are new, is reported apart; a third
burst waits for the writer to finish before each captured step, so its figure
is the engine thread's own calls, and the difference from the second burst is
what the writer's Python work costs them in the interpreter lock); the floors are the
time to copy the snapshot's bytes from the device into pinned host memory and
back to a synchronised host (one copy), and to copy each of its tensors the
same way. Also printed: the engine step's wall time with and without capture
(the engine's stream synchronised at the end of each step, so this includes
whatever capture adds on the device), and a check that every snapshot written
holds the pages and output of its step bit for bit. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kvdbg.capture import capturer as capture  # noqa: E402
from kvdbg.capture.capturer import CaptureBackend, CaptureLayer, Capturer, StepTensors  # noqa: E402
from kvdbg.capture.prepare import CapturePlan, PendingCapture  # noqa: E402
from kvdbg.snapshot.format import LAYOUT_VLLM  # noqa: E402
from kvdbg.snapshot.store import load_snapshot  # noqa: E402


class Phases:
    """``--phases``: the engine thread's wall time in each part of ``begin`` and ``finish``, second burst only.

    Each part is wrapped in a timer (about a microsecond a call): the shape checks and small copies
    (``plan``), the page gather (``gather``), the output's copy (``output``) and the hand-off to the writer.
    """

    PARTS = (("plan", capture, "plan_capture"), ("gather", CapturePlan, "gather"),
             ("output", PendingCapture, "attach_output"), ("hand-off", Capturer, "_hand_to_writer"))

    def __init__(self):
        self.samples: dict[str, list[float]] = {name: [] for name, _, _ in self.PARTS}
        self.recording = False
        for name, owner, attr in self.PARTS:
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.recording:
                    self.samples[name].append(time.perf_counter() - t0)
        return timed

    def medians_us(self) -> dict[str, float]:
        medians = {name: statistics.median(v) * 1e6 for name, v in self.samples.items() if v}
        for values in self.samples.values():
            values.clear()
        return medians


@dataclass(frozen=True)
class Size:
    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    prompts: tuple[int, ...]
    page_size: int = 16


SIZES = {
    "small": Size("small", 8, 2, 64, (60,)),
    "large": Size("large", 32, 8, 128, (3200,) * 4),
}


class StandInEngine:
    """Decode steps over a paged cache on ``device``, with the step's metadata on the host."""

    def __init__(self, size: Size, device: str, steps: int):
        self.size, self.device = size, device
        gen = torch.Generator().manual_seed(0)
        self.lengths = list(size.prompts)
        per_request = [-(-(n + steps + 2) // size.page_size) for n in size.prompts]
        self.num_blocks = sum(per_request) + 8
        self.cache = torch.randn(self.num_blocks, size.num_kv_heads, size.page_size, 2 * size.head_size,
                                 generator=gen).to(torch.bfloat16).to(device)
        ids = torch.randperm(self.num_blocks - 1, generator=gen)[: sum(per_request)] + 1  # page 0 stays the null one
        width = max(per_request)
        self.block_table = torch.zeros(len(size.prompts), width, dtype=torch.int32)
        start = 0
        for r, n in enumerate(per_request):
            self.block_table[r, :n] = ids[start:start + n].to(torch.int32)
            start += n
        self.layer = CaptureLayer(name="model.layers.0.self_attn.attn", num_heads=size.num_heads,
                                  num_kv_heads=size.num_kv_heads, head_size=size.head_size,
                                  scale=size.head_size ** -0.5, dtype=torch.bfloat16, kv_layout=LAYOUT_VLLM)
        self.backend = CaptureBackend(name="FLEX_ATTENTION", max_model_len=max(self.lengths) + steps + 64)
        self.gen = torch.Generator(device=device).manual_seed(1)

    def step_tensors(self) -> tuple[StepTensors, torch.Tensor]:
        size, reqs = self.size, len(self.lengths)
        self.lengths = [n + 1 for n in self.lengths]
        seq_lens = torch.tensor(self.lengths, dtype=torch.int32)
        slots = torch.tensor([int(self.block_table[r, (n - 1) // size.page_size]) * size.page_size
                              + (n - 1) % size.page_size for r, n in enumerate(self.lengths)], dtype=torch.int64)
        query = torch.randn(reqs, size.num_heads, size.head_size, device=self.device, generator=self.gen,
                            dtype=torch.bfloat16)
        key = torch.randn(reqs, size.num_kv_heads, size.head_size, device=self.device, generator=self.gen,
                          dtype=torch.bfloat16)
        value = torch.randn_like(key)
        tensors = StepTensors(query=query, kv_cache=self.cache, block_table=self.block_table.clone(),
                              seq_lens=seq_lens, query_start_loc=torch.arange(reqs + 1, dtype=torch.int32),
                              causal=True, key=key, value=value, slot_mapping=slots)
        output = torch.empty_like(query)
        return tensors, output

    def update_and_attend(self, tensors: StepTensors, output: torch.Tensor) -> None:
        """The cache update, then a stand-in for attention that reads every page the step uses."""
        size = self.size
        slots = tensors.slot_mapping.to(self.device, non_blocking=True)
        pages, offsets = slots // size.page_size, slots % size.page_size
        self.cache[pages, :, offsets, : size.head_size] = tensors.key
        self.cache[pages, :, offsets, size.head_size:] = tensors.value
        table = tensors.block_table.to(self.device, non_blocking=True).long()
        group = size.num_heads // size.num_kv_heads
        for r in range(len(self.lengths)):
            kv = self.cache.index_select(0, table[r])  # [pages, Hkv, page, 2D]
            keys = kv[..., : size.head_size].permute(1, 0, 2, 3).reshape(size.num_kv_heads, -1, size.head_size)
            q = tensors.query[r].view(size.num_kv_heads, group, size.head_size)
            scores = torch.bmm(q, keys.transpose(1, 2)).softmax(-1)
            values = kv[..., size.head_size:].permute(1, 0, 2, 3).reshape(size.num_kv_heads, -1, size.head_size)
            output[r] = torch.bmm(scores, values).reshape(size.num_heads, size.head_size)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_s(fn, repeats: int, device: str) -> float:
    fn()
    sync(device)
    samples = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def run_size(size: Size, device: str, steps: int, out: str, phases: Phases | None = None) -> dict:
    directory = os.path.join(out, size.name)
    shutil.rmtree(directory, ignore_errors=True)
    total = 3 * steps + 2
    engine = StandInEngine(size, device, total)
    capturer = Capturer(directory, queue_bytes="auto")
    expected = {}
    captured_s, plain_s, engine_thread_s, first_burst_s, idle_writer_s = [], [], [], [], []
    for step in range(total):
        if step == steps:
            # A second burst of the same capture session: the writer has given the first burst's pinned
            # buffers back to the pool (within its budget), so this one copies into memory already pinned.
            capturer.flush(600)
        capture = step % 2 == 0 or step < 2  # alternate: steps without capture give the engine's own time
        idle_writer = capture and step >= 2 * steps + 2
        if idle_writer:
            # A third burst: the writer has written everything before each captured step, so the engine's
            # thread runs its calls alone; the difference from the second burst is the writer's share of
            # the interpreter (its Python work holds the GIL the engine's calls give up and take back).
            capturer.flush(600)
        tensors, output = engine.step_tensors()
        if phases is not None:
            phases.recording = capture and steps + 2 <= step < 2 * steps + 2
        sync(device)
        started = time.perf_counter()
        spent = 0.0
        if capture:
            t0 = time.perf_counter()
            pending = capturer.begin(engine.layer, engine.backend, tensors, step=step, rank=0)
            spent += time.perf_counter() - t0
        if capture and 2 * steps - 2 <= step < 2 * steps + 2:  # kept to check the files: the cache as the step found it
            expected[step] = (engine.cache.clone(), None)
        engine.update_and_attend(tensors, output)
        if capture:
            t0 = time.perf_counter()
            capturer.finish(pending, output)
            spent += time.perf_counter() - t0
            if step in expected:
                expected[step] = (expected[step][0], output.clone())
        sync(device)
        wall = time.perf_counter() - started
        if 2 <= step < steps and capture:
            first_burst_s.append(spent)
        if idle_writer:
            idle_writer_s.append(spent)
        elif steps + 2 <= step < 2 * steps + 2:
            (captured_s if capture else plain_s).append(wall)
            if capture:
                engine_thread_s.append(spent)
    if phases is not None:
        phases.recording = False
    drained = capturer.close(600)
    written = sorted(capturer.written)
    verified = 0
    for path in written:
        snap = load_snapshot(path)
        step = snap.meta.capture["step"]
        if step not in expected:
            continue
        cache, output = expected[step]
        pages = cache.index_select(0, snap.page_ids.long().to(device)).cpu()
        assert torch.equal(snap.kv_cache.view(torch.uint8), pages.view(torch.uint8)), f"{path}: pages differ"
        assert torch.equal(snap.steps[0].output.view(torch.uint8), output.cpu().view(torch.uint8)), \
            f"{path}: output differs"
        verified += 1
    sample = load_snapshot(written[len(written) // 2])
    nbytes = os.path.getsize(written[len(written) // 2])
    pin = device.startswith("cuda")
    tensors = [t.to(device) for t in sample.tensors().values()]
    hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for t in tensors]
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    copy_bytes = median_s(lambda: pinned.copy_(source), 50, device)
    copy_tensors = median_s(lambda: [h.copy_(t) for h, t in zip(hosts, tensors)], 50, device)
    per_step = statistics.median(engine_thread_s)
    return {
        "size": size.name, "device": device, "snapshot_bytes": nbytes, "tensors": len(tensors),
        "written": len(written), "dropped": dict(capturer.dropped), "drained": drained, "verified": verified,
        "first_burst_us": statistics.median(first_burst_s) * 1e6,
        "engine_thread_us": per_step * 1e6, "engine_thread_p90_us": sorted(engine_thread_s)[
            int(0.9 * (len(engine_thread_s) - 1))] * 1e6,
        "engine_thread_idle_writer_us": statistics.median(idle_writer_s) * 1e6,
        "phases_us": phases.medians_us() if phases is not None else None,
        "copy_bytes_us": copy_bytes * 1e6, "copy_tensors_us": copy_tensors * 1e6,
        "ratio_to_copy_bytes": per_step / copy_bytes, "ratio_to_copy_tensors": per_step / copy_tensors,
        "step_with_capture_ms": statistics.median(captured_s) * 1e3,
        "step_without_capture_ms": statistics.median(plain_s) * 1e3 if plain_s else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--sizes", default="small,large")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="/tmp/kvdbg-capture-cuda")
    parser.add_argument("--phases", action="store_true",
                        help="also time each part of begin and finish (second burst; adds a timer per part)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here (use --device cpu for a dry run)", file=sys.stderr)
        return 2
    phases = Phases() if args.phases else None
    rows = [run_size(SIZES[name], args.device, args.steps, args.out, phases) for name in args.sizes.split(",")]
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"capture through the background writer, {where}, torch {torch.__version__}; medians over the steps")
    for r in rows:
        print(f"\n{r['size']}: snapshot {r['snapshot_bytes']:,} bytes, {r['tensors']} tensors; wrote {r['written']}, "
              f"dropped {sum(r['dropped'].values())}, {r['verified']} checked bit for bit")
        print(f"  engine thread per captured step     {r['engine_thread_us']:10.1f} us (p90 "
              f"{r['engine_thread_p90_us']:.1f}; a later burst of the session)")
        print(f"  the same, first burst               {r['first_burst_us']:10.1f} us (its host buffers are new)")
        print(f"  the same, the writer idle           {r['engine_thread_idle_writer_us']:10.1f} us (third burst: "
              f"written out before each step)")
        if r["phases_us"]:
            print("  parts, second burst (medians)       " + ", ".join(f"{name} {us:.1f}"
                                                                  for name, us in r["phases_us"].items()) + " us")
        print(f"  copy of the bytes to the host       {r['copy_bytes_us']:10.1f} us")
        print(f"  copy of the tensors to the host     {r['copy_tensors_us']:10.1f} us")
        print(f"  ratio to the copy of the bytes      {r['ratio_to_copy_bytes']:10.2f}")
        print(f"  ratio to the copy of the tensors    {r['ratio_to_copy_tensors']:10.2f}")
        without = r["step_without_capture_ms"]
        print(f"  engine step, with / without capture {r['step_with_capture_ms']:.3f} / "
              f"{'-' if without is None else f'{without:.3f}'} ms")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
