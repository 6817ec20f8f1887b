"""What capture costs the engine's thread per captured step, against copying the snapshot, in a real vLLM (CPU).

Usage (inside a venv with vLLM's CPU build, e.g. the engine stage's):
    .venv-engine/bin/python bench/capture_cost.py [--steps 24] [--out /tmp/kvdbg-capture-cost]
        [--sizes small,medium,mid,large]

Runs vLLM in this process (CPU_ATTN) with kvdbg's plugin, once per snapshot
size, capturing layer 1 of 2 on every decode step through the background
writer (the default settings, but no count or byte cap):

    small   the engine stage's tiny model (2 KV heads of 64, float16), one request: ~55 KB per snapshot
    medium  8 KV heads of 128, float16, one request of 250 tokens: ~1.2 MB per snapshot
    mid     the same heads, 2 requests of 1 000 tokens: ~8.4 MB per snapshot
    large   the same heads, 4 requests of 3 100 tokens: ~50 MB per snapshot

The engine's thread is the main thread here. Every method the plugin wraps
(the builder's ``build``, the impl's ``do_kv_cache_update`` and ``forward``)
is timed twice: around the plugin's wrapper and around vLLM's own method
inside it; the difference is kvdbg's time on the engine's thread, summed per
decode step (one ``build`` per step). The ratios use the thread's CPU time
(``time.thread_time_ns``): on a shared machine the wall time of a 20 us hook
mostly says who else had the core. The wall time in the hooks is printed too
(and its ratio): it adds the engine thread's waits for a core and for the
interpreter lock while the writer's thread works, what the engine feels on a
machine with no core to spare. Each setting runs a warm burst of decode
steps, lets the writer drain (its page buffers go back to the pool), then the
measured burst: median over its decode steps (the warm burst's median is in
the JSON as ``first_burst_median_us``). Settings, in one process:

    unwrapped (timers only)      the timers around vLLM's own methods: their cost, taken off the others
    wrapped, nothing captured    kvdbg's plugin with no step selected
    one layer captured           kvdbg's plugin
    empty hooks (no kvdbg)       hooks at the same three points that only ask whether the layer is the captured
                                 one: what any capture by hooks pays before it copies a byte
    bare copies (no kvdbg)       hooks that copy each of the step's tensors once with one torch call and do
                                 nothing else: the floor of a capture made of torch calls
    bare copies, numpy           the same with numpy calls on views of the tensors (one thread, no dispatcher)
    empty hooks + copy in two    the empty hooks, and the forward's copying the snapshot's bytes with numpy in
                                 two calls, half before vLLM's forward and half after, as a capture copies
                                 the pages the forward reads and the output it writes: the floor of a
                                 capture by hooks (one native call after the forward could copy both, and
                                 would still cost the empty hooks plus one copy in place). A one-thread copy:
                                 at 51 MB torch's is faster, and this floor is a little high there
    copy of the bytes, in place  the forward hook copies the snapshot's bytes into a buffer made before,
                                 with torch (``copy_``)
    ... in place, one thread     the same with ``numpy.copyto``: one thread's plain copy
    unwrapped, after capture     the timers alone again: the engine's whole step after kvdbg's writer has run in
                                 the process, against the first setting's (a writer that made an OpenMP team of
                                 its own once slowed every later step of the engine)

and floors measured in a loop right after:

    copy of the bytes     one copy of as many bytes as the snapshot holds, into a buffer allocated before
                          (torch's ``copy_`` and numpy's ``copyto``)
    copy of the tensors   each of the snapshot's tensors copied once (clone)

The copy each ratio divides by is the faster of the two ways, in place and in
the loop alike. torch splits a copy of more than 32K elements across its
threads; in vLLM's process they are bound to cores, and handing half of a
54 KB copy to the other thread costs 2-25 us, depending on what else that
core runs, against about 2 us for the whole copy on one thread. A large copy
gains from the second thread. Taking the faster keeps the reference honest at
every size. The source of these copies is a buffer the hook reuses, warm in
the caches; a capture reads the pages where they lie in the engine's cache.

Also printed: the split by hook and the writer's count of written and dropped
steps. Reads nothing but its own output; prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CPU_ATTN_MODULE = "vllm.v1.attention.backends.cpu_attn"
# CPU time of the calling thread: what kvdbg takes from the engine's thread, unaffected by a neighbour's load
# (on a shared machine, wall time inside a 20 us hook mostly measures who else had the core).
CLOCK = time.thread_time_ns
# Wall time as well: what the engine's thread waited, its waits for the interpreter lock and for a core
# (the writer's thread competes for both) included. Summed per step beside the CPU time.
WALL = time.perf_counter_ns
BARE = "bare copies (no kvdbg)"
BARE_NP = "bare copies, numpy"
EMPTY = "empty hooks (no kvdbg)"
IN_SITU = "copy of the bytes, in place"
IN_SITU_ONE = "... in place, one thread"
FLOOR = "empty hooks + copy in two"
AFTER = "unwrapped, after capture"
LAYER_SUFFIX = ".layers.1.self_attn.attn"  # the captured layer (KVDBG_CAPTURE_LAYERS below)
HOOKS = (("CPUAttentionMetadataBuilder", "build"), ("CPUAttentionBackendImpl", "do_kv_cache_update"),
         ("CPUAttentionBackendImpl", "forward"))


@dataclass
class Size:
    name: str
    kv_heads: int
    head_dim: int
    prompts: list[int]  # prompt lengths
    max_model_len: int
    blocks: int
    batched_tokens: int


SIZES = {
    "small": Size("small", kv_heads=2, head_dim=64, prompts=[60], max_model_len=512, blocks=48, batched_tokens=64),
    "medium": Size("medium", kv_heads=8, head_dim=128, prompts=[250], max_model_len=512, blocks=48,
                   batched_tokens=512),
    "mid": Size("mid", kv_heads=8, head_dim=128, prompts=[1000] * 2, max_model_len=2048, blocks=140,
                batched_tokens=2048),
    "large": Size("large", kv_heads=8, head_dim=128, prompts=[3100] * 4, max_model_len=4096, blocks=520,
                  batched_tokens=4096),
}


@dataclass
class Ledger:
    """kvdbg's nanoseconds on the engine's thread, per step (a step starts with the builder's build):
    thread CPU time per hook in ``steps``, wall time per step in ``walls``."""

    steps: list[dict[str, int]] = field(default_factory=list)
    walls: list[int] = field(default_factory=list)
    _inner: int = 0
    _inner_wall: int = 0

    def start_step(self) -> None:
        self.steps.append(defaultdict(int))
        self.walls.append(0)

    def add(self, hook: str, ns: int, wall_ns: int) -> None:
        if not self.steps:
            self.start_step()
        self.steps[-1][hook] += ns
        self.walls[-1] += wall_ns

    def clear(self) -> None:
        self.steps.clear()
        self.walls.clear()


def install_timers(module, ledger: Ledger) -> None:
    """Time vLLM's own methods (inner) now, before the plugin wraps them."""
    import functools

    for cls_name, attr in HOOKS:
        cls = getattr(module, cls_name)
        original = cls.__dict__[attr]

        def make(original, hook):
            @functools.wraps(original)
            def inner(*args, **kwargs):
                t0, w0 = CLOCK(), WALL()
                try:
                    return original(*args, **kwargs)
                finally:
                    ledger._inner, ledger._inner_wall = CLOCK() - t0, WALL() - w0
            inner._bench_original = original
            return inner

        setattr(cls, attr, make(original, f"{cls_name}.{attr}"))


def install_outer(module, ledger: Ledger) -> None:
    """Time the plugin's wrappers (outer); outer minus inner is kvdbg's share."""
    import functools

    for cls_name, attr in HOOKS:
        cls = getattr(module, cls_name)
        wrapped = cls.__dict__[attr]
        hook = attr

        def make(wrapped, hook):
            @functools.wraps(wrapped)
            def outer(*args, **kwargs):
                if hook == "build":
                    ledger.start_step()
                ledger._inner = ledger._inner_wall = 0
                t0, w0 = CLOCK(), WALL()
                try:
                    return wrapped(*args, **kwargs)
                finally:
                    ledger.add(hook, CLOCK() - t0 - ledger._inner, WALL() - w0 - ledger._inner_wall)
            outer._bench_wrapped = wrapped
            return outer

        setattr(cls, attr, make(wrapped, hook))


def _originals(module) -> tuple:
    """vLLM's three methods as they stand now (inside the timers): what a setting's hooks call through."""
    return tuple(getattr(module, cls_name).__dict__[attr] for cls_name, attr in HOOKS)


def _install(module, hooks) -> None:
    """Put a setting's hooks (``build``, ``do_kv_cache_update``, ``forward``) in place; remove_bare takes
    them out."""
    for (cls_name, attr), hook in zip(HOOKS, hooks):
        cls = getattr(module, cls_name)
        hook._bench_bare = cls.__dict__[attr]
        setattr(cls, attr, hook)


def install_empty(module, layer_suffix: str, nbytes: int = 0) -> None:
    """Hooks at the same three points that only ask whether the layer is the captured one, then call through:
    what any capture made of Python hooks pays before it copies a byte.

    With ``nbytes``, the forward hook also copies that many bytes (numpy, one thread) into a buffer made
    before, half before vLLM's forward and half after it, as a capture copies the pages the forward reads
    and the output it writes: the floor of a capture by hooks.
    """
    import functools

    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    half = nbytes // 2
    first, second = (dst[:half], src[:half]), (dst[half:], src[half:])

    build, update, forward = _originals(module)

    @functools.wraps(build)
    def empty_build(self, *args, **kwargs):
        metadata = build(self, *args, **kwargs)
        if kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None) is not None:
            metadata._bare = None
        return metadata

    @functools.wraps(update)
    def empty_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        if layer.layer_name.endswith(layer_suffix):
            layer._bare = None
        return update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    @functools.wraps(forward)
    def empty_forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs):
        wanted = metadata is not None and layer.layer_name.endswith(layer_suffix)
        if wanted and nbytes:
            np.copyto(*first)
        result = forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs)
        if wanted:
            layer._bare = kwargs.get("output", args[0] if args else None)
            if nbytes:
                np.copyto(*second)
        return result

    _install(module, (empty_build, empty_update, empty_forward))


def install_bare(module, layer_suffix: str) -> None:
    """Wrap the hooks with the least any capture of a step does: each tensor copied once, nothing else.

    The same points as kvdbg's plugin: at the build, the block table, sequence
    lengths and query starts; before the cache update, the new K/V, their slots
    and the pages they overwrite (ids from the slots); at the forward, the query
    and the pages the step reads (ids from the block table), then the output.
    No checks, no metadata, no hand-off: the copies are dropped. Its time is the
    floor of a capture done with torch calls from Python.
    """
    import functools

    import torch

    build, update, forward = _originals(module)

    @functools.wraps(build)
    def bare_build(self, *args, **kwargs):
        metadata = build(self, *args, **kwargs)
        common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
        if common is not None:
            n = common.num_reqs
            metadata._bare = (common.block_table_tensor[:n].clone(), common.seq_lens[:n].clone(),
                              common.query_start_loc[: n + 1].clone())
        return metadata

    @functools.wraps(update)
    def bare_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        if layer.layer_name.endswith(layer_suffix):
            page = kv_cache.shape[2]  # tokens per page (CPU_ATTN's cache: [pages, kv heads, page, 2 * head])
            slots = slot_mapping.clone()
            ids = torch.tensor(sorted({s // page for s in slots.tolist() if s >= 0}), dtype=torch.int64)
            layer._bare = (key.clone(), value.clone(), slots, kv_cache.index_select(0, ids))
        return update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    @functools.wraps(forward)
    def bare_forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs):
        copied = None
        if metadata is not None and layer.layer_name.endswith(layer_suffix):
            bt, sl, qsl = metadata._bare
            page = kv_cache.shape[2]
            ids = sorted({p for row, n in zip(bt.tolist(), sl.tolist()) for p in row[: (n + page - 1) // page]})
            tokens = int(qsl[-1])
            # Into a buffer kept from the step before when the count matches (a fresh one pays page faults).
            kept = getattr(layer, "_bare_pages", None)
            if kept is None or kept.shape[0] != len(ids):
                kept = layer._bare_pages = kv_cache.new_empty((len(ids), *kv_cache.shape[1:]))
            copied = (query[:tokens].clone(),
                      torch.index_select(kv_cache, 0, torch.tensor(ids, dtype=torch.int64), out=kept))
        result = forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs)
        if copied is not None:
            output = kwargs.get("output", args[0] if args else None)
            copied += (output[:tokens].clone(),)
        return result

    _install(module, (bare_build, bare_update, bare_forward))


def install_bare_numpy(module, layer_suffix: str) -> None:
    """The bare copies made with numpy calls on views of the tensors (one thread, no torch dispatch)."""
    import functools

    import numpy as np
    import torch

    build, update, forward = _originals(module)

    def view(t):
        return t.numpy() if t.dtype != torch.bfloat16 else t.view(torch.int16).numpy()

    @functools.wraps(build)
    def bare_build(self, *args, **kwargs):
        metadata = build(self, *args, **kwargs)
        common = kwargs.get("common_attn_metadata", args[1] if len(args) > 1 else None)
        if common is not None:
            n = common.num_reqs
            metadata._bare = (common.block_table_tensor.numpy()[:n].copy(), common.seq_lens.numpy()[:n].copy(),
                              common.query_start_loc.numpy()[: n + 1].copy())
        return metadata

    @functools.wraps(update)
    def bare_update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs):
        if layer.layer_name.endswith(layer_suffix):
            cache = view(kv_cache)
            slots = slot_mapping.numpy().copy()
            ids = np.unique(slots[slots >= 0] // cache.shape[2])
            layer._bare = (view(key).copy(), view(value).copy(), slots, cache.take(ids, axis=0))
        return update(self, layer, key, value, kv_cache, slot_mapping, *args, **kwargs)

    @functools.wraps(forward)
    def bare_forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs):
        copied = None
        if metadata is not None and layer.layer_name.endswith(layer_suffix):
            bt, sl, qsl = metadata._bare
            cache = view(kv_cache)
            page = cache.shape[2]
            used = (sl + page - 1) // page
            ids = np.unique(np.concatenate([row[:k] for row, k in zip(bt, used.tolist())]))
            tokens = int(qsl[-1])
            kept = getattr(layer, "_bare_np_pages", None)  # not the torch setting's buffer
            if kept is None or kept.shape[0] != len(ids):
                kept = layer._bare_np_pages = np.empty((len(ids), *cache.shape[1:]), cache.dtype)
            copied = (view(query)[:tokens].copy(), np.take(cache, ids, axis=0, out=kept))
        result = forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs)
        if copied is not None:
            output = kwargs.get("output", args[0] if args else None)
            copied += (view(output)[:tokens].copy(),)
        return result

    _install(module, (bare_build, bare_update, bare_forward))


def install_copy(module, layer_suffix: str, nbytes: int, one_thread: bool = False) -> None:
    """Wrap the forward with one copy of ``nbytes`` into a buffer allocated (and touched) before: the copy
    of a snapshot's bytes at the point of the engine's thread where capture copies, measured as capture is.
    With torch's ``copy_`` (on torch's threads), or with ``one_thread`` numpy's ``copyto``."""
    import functools

    import numpy as np
    import torch

    impl_cls = getattr(module, HOOKS[1][0])
    forward = impl_cls.__dict__["forward"]
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    src_np, dst_np = src.numpy(), dst.numpy()

    @functools.wraps(forward)
    def copy_forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs):
        if metadata is not None and layer.layer_name.endswith(layer_suffix):
            if one_thread:
                np.copyto(dst_np, src_np)
            else:
                dst.copy_(src)
        return forward(self, layer, query, key, value, kv_cache, metadata, *args, **kwargs)

    impl_cls.forward = copy_forward
    copy_forward._bench_bare = forward


def remove_bare(module) -> None:
    for cls_name, attr in HOOKS:
        cls = getattr(module, cls_name)
        if hasattr(cls.__dict__[attr], "_bench_bare"):
            setattr(cls, attr, cls.__dict__[attr]._bench_bare)


def remove_outer(module) -> None:
    for cls_name, attr in HOOKS:
        cls = getattr(module, cls_name)
        outer = cls.__dict__[attr]
        if hasattr(outer, "_bench_wrapped"):
            setattr(cls, attr, outer._bench_wrapped)


def median_ns(fn, repeats: int = 200) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = CLOCK()
        fn()
        samples.append(CLOCK() - t0)
    return statistics.median(samples)


def floors(path: str) -> tuple[float, float, float, int]:
    """(copy of the file's bytes with torch, the same with numpy, copy of each tensor once) in ns, and the
    tensor count, for one snapshot."""
    import numpy as np
    import torch

    from kvdbg.snapshot.store import load_snapshot

    snap = load_snapshot(path)
    tensors = [t.clone() for t in snap.tensors().values()]  # in memory, as the engine's are
    nbytes = os.path.getsize(path)
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src).fill_(0)
    src_np, dst_np = src.numpy(), dst.numpy()
    repeats = 100 if nbytes > 10**7 else 2000
    copy_bytes = median_ns(lambda: dst.copy_(src), repeats)
    copy_bytes_one = median_ns(lambda: np.copyto(dst_np, src_np), repeats)
    copy_tensors = median_ns(lambda: [t.clone() for t in tensors], 20 if nbytes > 10**7 else 2000)
    return copy_bytes, copy_bytes_one, copy_tensors, len(tensors)


def run_size(size: Size, steps: int, out: str) -> dict:
    import torch  # noqa: F401

    from tests.engine.tiny_model import TinyModel, write_model

    model = TinyModel(f"bench_{size.name}", dtype="float16", num_heads=size.kv_heads,
                      num_kv_heads=size.kv_heads, hidden_size=size.kv_heads * size.head_dim,
                      intermediate_size=size.kv_heads * size.head_dim, max_position_embeddings=size.max_model_len)
    model_dir = write_model(model, os.path.join(out, "models", size.name))
    capture_dir = os.path.join(out, "snapshots", size.name)
    os.environ.update(KVDBG_CAPTURE_DIR=capture_dir, KVDBG_CAPTURE_BACKENDS="CPU_ATTN",
                      KVDBG_CAPTURE_LAYERS="*.layers.1.*", KVDBG_CAPTURE_MAX="unlimited",
                      KVDBG_CAPTURE_MAX_BYTES="unlimited", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    import importlib

    from vllm import LLM, SamplingParams

    from kvdbg import vllm_plugin
    from kvdbg.capture.capturer import EngineTime
    from kvdbg.util.ranges import IntRanges

    llm = LLM(model=model_dir, skip_tokenizer_init=True, enforce_eager=True, block_size=32,
              max_model_len=size.max_model_len, num_gpu_blocks_override=size.blocks, seed=0,
              gpu_memory_utilization=0.25, enable_prefix_caching=False, max_num_batched_tokens=size.batched_tokens,
              max_num_seqs=8)
    module = importlib.import_module(CPU_ATTN_MODULE)
    ledger = Ledger()
    vllm_plugin.unregister()
    install_timers(module, ledger)
    prompts = [{"prompt_token_ids": [3 + (i * 37 + j * 11) % 500 for i in range(n)]} for j, n in enumerate(size.prompts)]

    def generate() -> None:
        llm.generate(prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True), use_tqdm=False)

    results = {}
    snapshot_bytes = 0
    for setting in ("unwrapped (timers only)", "wrapped, nothing captured", "one layer captured", EMPTY, BARE,
                    BARE_NP, FLOOR, IN_SITU, IN_SITU_ONE, AFTER):
        if setting == EMPTY:
            install_empty(module, LAYER_SUFFIX)
        elif setting == BARE:
            install_bare(module, LAYER_SUFFIX)
        elif setting == BARE_NP:
            install_bare_numpy(module, LAYER_SUFFIX)
        elif setting == FLOOR:
            install_empty(module, LAYER_SUFFIX, snapshot_bytes)
        elif setting in (IN_SITU, IN_SITU_ONE):
            install_copy(module, LAYER_SUFFIX, snapshot_bytes, one_thread=setting == IN_SITU_ONE)
        elif setting not in ("unwrapped (timers only)", AFTER):
            vllm_plugin.register()
            capturer = vllm_plugin.active_capturer()
            if setting == "wrapped, nothing captured":
                capturer.reconfigure(steps=IntRanges(()))
        install_outer(module, ledger)
        generate()  # warm: the first captures of a size allocate their buffers (timed apart, below)
        cold = [sum(s.values()) for s in ledger.steps[-steps:]]
        if setting in ("wrapped, nothing captured", "one layer captured"):
            # The writer gives the warm run's page buffers back to the pool, within its budget: the measured
            # run is a later burst of the same capture session.
            vllm_plugin.active_capturer().flush(600)
            # The plugin's own account of its hooks (the exit line's), for the measured burst alone.
            vllm_plugin.active_capturer().engine_time = EngineTime()
        ledger.clear()
        wall0, cpu0 = time.perf_counter(), time.thread_time()
        generate()
        wall, cpu = time.perf_counter() - wall0, time.thread_time() - cpu0
        decode = ledger.steps[-steps:]
        remove_outer(module)
        if setting in (EMPTY, BARE, BARE_NP, FLOOR, IN_SITU, IN_SITU_ONE):
            remove_bare(module)
        per_step = sorted(sum(s.values()) for s in decode)
        results[setting] = {
            "median_us": statistics.median(per_step) / 1e3,
            "wall_median_us": statistics.median(ledger.walls[-steps:]) / 1e3,
            "p90_us": per_step[int(0.9 * (len(per_step) - 1))] / 1e3,
            # The warm run: the session's first burst, which allocates (and first-touches) its page buffers.
            "first_burst_median_us": statistics.median(cold) / 1e3,
            "by_hook_us": {hook: statistics.median(s.get(hook, 0) for s in decode) / 1e3
                           for hook in ("build", "do_kv_cache_update", "forward")},
            # The whole generate() per step: what the engine feels, the writer's competition for the
            # cores and the interpreter lock included (noisy on a shared machine).
            "generate_wall_ms_per_step": wall / len(ledger.steps) * 1e3,
            "generate_engine_thread_cpu_ms_per_step": cpu / len(ledger.steps) * 1e3,
        }
        if setting in ("wrapped, nothing captured", "one layer captured"):
            capturer = vllm_plugin.active_capturer()
            capturer.flush(600)
            results[setting]["written"] = len(capturer.written)
            results[setting]["dropped"] = dict(capturer.dropped)
            results[setting]["summary"] = capturer.summary()
            account = capturer.engine_time
            if account.steps:
                results[setting]["own_account_us_per_step"] = account.captured_ns / account.steps / 1e3
            vllm_plugin.unregister()
        if setting == "one layer captured":
            names = sorted(os.listdir(capture_dir))
            sizes = sorted(os.path.getsize(os.path.join(capture_dir, n)) for n in names)
            snapshot_bytes = sizes[len(sizes) // 2]
            typical = os.path.join(capture_dir, names[[os.path.getsize(os.path.join(capture_dir, n))
                                                       for n in names].index(snapshot_bytes)])
    copy_torch, copy_one, copy_tensors, count = floors(typical)
    copy_bytes = min(copy_torch, copy_one)
    # The hooks' own timers cost the same in every setting: what kvdbg (or a bare capture) adds is the
    # setting's time less the timers-only run's. Two runs measure the timers alone, the first and the last;
    # the lower is taken (the first has been seen at three times the last on a busy machine, which would make
    # every difference below it negative).
    timer_runs = ("unwrapped (timers only)", AFTER)
    timers_from = min(timer_runs, key=lambda name: results[name]["median_us"])
    timers = results[timers_from]["median_us"] * 1e3
    captured = results["one layer captured"]["median_us"] * 1e3 - timers
    bare = results[BARE]["median_us"] * 1e3 - timers
    bare_np = results[BARE_NP]["median_us"] * 1e3 - timers
    empty = results[EMPTY]["median_us"] * 1e3 - timers
    floor = results[FLOOR]["median_us"] * 1e3 - timers
    in_situ_torch = results[IN_SITU]["median_us"] * 1e3 - timers
    in_situ_one = results[IN_SITU_ONE]["median_us"] * 1e3 - timers
    in_situ = min(in_situ_torch, in_situ_one)  # the faster way is the reference (see the module's notes)

    timers_wall = min(results[name]["wall_median_us"] for name in timer_runs) * 1e3

    def wall(setting: str) -> float:
        return results[setting]["wall_median_us"] * 1e3 - timers_wall

    def ratio(part: float, whole: float) -> float | None:
        """None where the reference is not above the timers' noise (a ratio to it would say nothing)."""
        return part / whole if whole > 0 else None

    captured_wall, in_situ_wall = wall("one layer captured"), min(wall(IN_SITU), wall(IN_SITU_ONE))
    return {"size": size.name, "snapshot_bytes": snapshot_bytes, "settings": results,
            "timers_us": timers / 1e3, "timers_from": timers_from,
            "copy_bytes_us": copy_bytes / 1e3, "copy_bytes_torch_us": copy_torch / 1e3,
            "copy_bytes_one_thread_us": copy_one / 1e3, "copy_tensors_us": copy_tensors / 1e3, "tensors": count,
            "kvdbg_us": captured / 1e3, "bare_us": bare / 1e3, "bare_numpy_us": bare_np / 1e3,
            "empty_hooks_us": empty / 1e3, "floor_us": floor / 1e3, "copy_in_engine_us": in_situ / 1e3,
            "empty_to_copy_in_engine": ratio(empty, in_situ), "floor_to_copy_in_engine": ratio(floor, in_situ),
            "copy_in_engine_torch_us": in_situ_torch / 1e3, "copy_in_engine_one_thread_us": in_situ_one / 1e3,
            "ratio_to_copy_bytes": ratio(captured, copy_bytes), "ratio_to_copy_in_engine": ratio(captured, in_situ),
            "ratio_to_bare": ratio(captured, bare), "bare_to_copy_bytes": ratio(bare, copy_bytes),
            "bare_to_copy_in_engine": ratio(bare, in_situ), "ratio_to_copy_tensors": ratio(captured, copy_tensors),
            "kvdbg_wall_us": captured_wall / 1e3, "copy_in_engine_wall_us": in_situ_wall / 1e3,
            "wall_ratio_to_copy_in_engine": ratio(captured_wall, in_situ_wall)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="decode steps per measured generate()")
    parser.add_argument("--out", default="/tmp/kvdbg-capture-cost")
    parser.add_argument("--sizes", default="small,medium,mid,large")
    parser.add_argument("--size", help=argparse.SUPPRESS)  # one size in this process (a child of the run)
    args = parser.parse_args()
    if args.size:
        print(json.dumps(run_size(SIZES[args.size], args.steps, args.out)))
        return 0
    import shutil
    import subprocess

    shutil.rmtree(args.out, ignore_errors=True)
    rows = []
    for name in args.sizes.split(","):
        # One engine per process: vLLM does not start two engines in one process cleanly.
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--size", name, "--steps", str(args.steps),
                               "--out", args.out], capture_output=True, text=True)
        with open(os.path.join(args.out, f"{name}.log"), "w") as f:
            f.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"engine-thread time per decode step in kvdbg's hooks (median over {args.steps} steps; CPU_ATTN, layer 1 "
          "of 2 captured, background writer)")
    for row in rows:
        print(f"\n{row['size']}: snapshot {row['snapshot_bytes']:,} bytes, {row['tensors']} tensors")
        for setting, r in row["settings"].items():
            hooks = ", ".join(f"{h} {v:.1f}" for h, v in r["by_hook_us"].items())
            extra = f"; wrote {r['written']}, dropped {sum(r['dropped'].values())}" if "written" in r else ""
            if "summary" in r and "turned off" in r["summary"]:
                extra += f" ({r['summary'].split('; capture turned off: ')[-1][:200]})"
            print(f"  {setting:<28}{r['median_us']:>10.1f} us (p90 {r['p90_us']:.1f}; first burst "
                  f"{r['first_burst_median_us']:.1f}; {hooks}){extra}")
            print(f"  {'':<28}wall time in the hooks: {r['wall_median_us']:.1f} us")
            print(f"  {'':<28}whole step: {r['generate_wall_ms_per_step']:.2f} ms wall, "
                  f"{r['generate_engine_thread_cpu_ms_per_step']:.2f} ms engine-thread CPU")
            if "own_account_us_per_step" in r:
                print(f"  {'':<28}the exit line's own account: {r['own_account_us_per_step']:.1f} us per step "
                      "copied (wall time, its timers included)")
        print(f"  {'copy of the bytes (loop)':<28}{row['copy_bytes_torch_us']:>10.1f} us   torch's copy_, repeated")
        print(f"  {'... one thread (loop)':<28}{row['copy_bytes_one_thread_us']:>10.1f} us   numpy's copyto, repeated")
        print(f"  {'copy of the tensors (loop)':<28}{row['copy_tensors_us']:>10.1f} us")
        first, last = (row["settings"][name]["median_us"] for name in ("unwrapped (timers only)", AFTER))
        print(f"  less the timers alone, {row['timers_us']:.1f} us (the lower of the first run's {first:.1f} and the "
              f"last's {last:.1f}):\n  what each adds to the engine's thread")
        print(f"    kvdbg                       {row['kvdbg_us']:>10.1f} us")
        print(f"    bare copies                 {row['bare_us']:>10.1f} us   each tensor copied once by a torch call")
        print(f"    bare copies, numpy          {row['bare_numpy_us']:>10.1f} us   the same by numpy calls")
        print(f"    empty hooks                 {row['empty_hooks_us']:>10.1f} us   hooks that copy nothing")
        print(f"    empty hooks + copy in two   {row['floor_us']:>10.1f} us   the floor of a capture by hooks")
        print(f"    copy of the bytes, in place {row['copy_in_engine_torch_us']:>10.1f} us")
        print(f"    ... in place, one thread    {row['copy_in_engine_one_thread_us']:>10.1f} us")
        print("  ratios to the faster copy of the bytes "
              f"({row['copy_bytes_us']:.1f} us in the loop, {row['copy_in_engine_us']:.1f} us in place):")
        print(f"  ratio: kvdbg / copy of the bytes (loop)      {_shown(row['ratio_to_copy_bytes'], 7)}")
        print(f"  ratio: kvdbg / copy of the bytes, in place   {_shown(row['ratio_to_copy_in_engine'], 7)}")
        print(f"  ratio: kvdbg / bare copies                   {_shown(row['ratio_to_bare'], 7)}")
        print(f"  ratio: bare copies / copy of the bytes (loop) {_shown(row['bare_to_copy_bytes'], 6)}")
        print(f"  ratio: bare copies / copy, in place          {_shown(row['bare_to_copy_in_engine'], 7)}")
        print(f"  ratio: empty hooks / copy, in place          {_shown(row['empty_to_copy_in_engine'], 7)}")
        print(f"  ratio: floor of capture by hooks / copy, in place {_shown(row['floor_to_copy_in_engine'], 5)}")
        steps = {name: row["settings"][name]["generate_wall_ms_per_step"]
                 for name in ("unwrapped (timers only)", "one layer captured", AFTER)}
        print(f"  the engine's whole step (wall, generate() per step): {steps['unwrapped (timers only)']:.2f} ms "
              f"before any capture, {steps['one layer captured']:.2f} ms capturing, {steps[AFTER]:.2f} ms unwrapped "
              "again after the capture settings")
        print(f"  in wall time (the writer's thread competes for the cores and the interpreter lock): kvdbg "
              f"{row['kvdbg_wall_us']:.1f} us, copy in place {row['copy_in_engine_wall_us']:.1f} us, ratio "
              f"{_shown(row['wall_ratio_to_copy_in_engine'], 0).strip()}")
    print(json.dumps(rows))
    return 0


def _shown(value: float | None, width: int) -> str:
    return f"{value:{width}.2f}" if value is not None else f"{'n/a':>{width}} (the reference is within the timers' noise)"


if __name__ == "__main__":
    sys.exit(main())
