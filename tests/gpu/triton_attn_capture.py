"""On a GPU: vLLM 0.33's own TRITON_ATTN Triton kernels write a KV cache and compute attention; kvdbg captures
each step through its capture API, with the layout vLLM declares, and replays it.

One PASS/FAIL line per check; exit 0 only when every check passes:

- captured vs reference, per case (declared layout, cache dtype, batch): vLLM's
  ``triton_reshape_and_cache_flash`` writes the step's new K/V into per-layer views
  that vLLM's ``create_kv_cache_views`` made of one raw buffer, kvdbg reads the
  written slots back through the declared layout, vLLM's ``unified_attention``
  computes the output (3D kernel for decode, 2D for a mixed batch), and
  ``kvdbg replay --backend reference`` must find the captured output equal to its
  exact reference;
- a mis-declared layout fails: the same cache declared in another layout is refused
  by its strides, and its raw buffer read as if it were stored in that layout (what
  a reader guessing from the shape does) fails the read-back and fails captured vs
  reference.

Only vLLM's op modules are imported (``vllm.v1.attention.ops.triton_reshape_and_cache_flash``,
``...triton_unified_attention``, ``vllm.v1.kv_cache_interface``, ``vllm.v1.kv_cache_layout``
and what they import), from the wheel's Python files; its compiled modules are empty
stubs (none of them is called). The arguments are the ones ``TritonAttentionImpl``
passes (``vllm/v1/attention/backends/triton_attn.py``); the two launch constants its
metadata builder uses are read from that file's source, which is not imported.

Usage (from the repository root; see tests/gpu/run_triton_attn_capture.sh)::

    python tests/gpu/triton_attn_capture.py --so-modules .gpu-carry/vllm-so-modules.txt [--out DIR]

``--standin-kernels`` replaces the two Triton kernels by torch code, to test this
script on a machine without a GPU; its lines then say STAND-IN and prove nothing
about vLLM's kernels.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.metadata
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 8, 2, 128, 16, 400, 4096
FP8_SCALES = (0.05, 0.04)  # k, v


# --------------------------------------------------------------------------- vLLM's modules


def _install_stand_ins(so_modules_list: str) -> None:
    """Empty modules in place of vLLM's compiled extensions (not carried; nothing here calls them): the same
    stand-ins as the GPU harness's stub_site, loaded by path."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stub_site", "sitecustomize.py")
    spec = importlib.util.spec_from_file_location("kvdbg_gpu_stub_site", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.install(so_modules_list)


@dataclass
class VllmOps:
    write_cache: object  # triton_reshape_and_cache_flash
    attention: object  # unified_attention
    KVCacheLayout: object
    KVQuantMode: object
    interface: object  # vllm.v1.kv_cache_interface
    min_launch_grid_2d: int
    softmax_segments: int
    fp8_dtype: torch.dtype
    modules: int


def _module_constants(module: str, names: tuple[str, ...]) -> dict[str, int]:
    """Module-level integer constants read from ``module``'s source, without importing it."""
    spec = importlib.util.find_spec(module)
    source = spec.loader.get_source(module)
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                found[node.targets[0].id] = ast.literal_eval(node.value)
    missing = set(names) - set(found)
    if missing:
        raise SystemExit(f"{module} defines no {', '.join(sorted(missing))}")
    return found


def load_vllm(so_modules_list: str) -> VllmOps:
    _install_stand_ins(so_modules_list)
    cache_ops = importlib.import_module("vllm.v1.attention.ops.triton_reshape_and_cache_flash")
    attention_ops = importlib.import_module("vllm.v1.attention.ops.triton_unified_attention")
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    layout = importlib.import_module("vllm.v1.kv_cache_layout")
    platforms = importlib.import_module("vllm.platforms")
    constants = _module_constants("vllm.v1.attention.backends.triton_attn",
                                  ("MIN_LAUNCH_GRID_SIZE_2D", "NUM_PAR_SOFTMAX_SEGMENTS"))
    return VllmOps(cache_ops.triton_reshape_and_cache_flash, attention_ops.unified_attention, layout.KVCacheLayout,
                   interface.KVQuantMode, interface, constants["MIN_LAUNCH_GRID_SIZE_2D"],
                   constants["NUM_PAR_SOFTMAX_SEGMENTS"], platforms.current_platform.fp8_dtype(),
                   sum(1 for m in sys.modules if m == "vllm" or m.startswith("vllm.")))


# --------------------------------------------------------------------------- stand-ins (no GPU: tests this script)


def standin_write_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    block_size = key_cache.shape[1]
    fp8 = kv_cache_dtype.startswith("fp8")
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            block, offset = divmod(slot, block_size)
            for cache, x, scale in ((key_cache, key[t], k_scale), (value_cache, value[t], v_scale)):
                cache[block, offset] = ((x.float() / float(scale)).clamp(-448, 448) if fp8 else x).to(cache.dtype)


def standin_attention(q, k, v, out, cu_seqlens_q, seqused_k, softmax_scale, window_size, block_table, k_descale,
                      v_descale, **_):
    qsl, groups = cu_seqlens_q.tolist(), q.shape[1] // k.shape[2]
    for r, length in enumerate(seqused_k.tolist()):
        start, end = qsl[r], qsl[r + 1]
        blocks = block_table[r, :math.ceil(length / k.shape[1])].long()
        keys = k[blocks].flatten(0, 1)[:length].float().repeat_interleave(groups, 1) * float(k_descale[0, 0])
        values = v[blocks].flatten(0, 1)[:length].float().repeat_interleave(groups, 1) * float(v_descale[0, 0])
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), keys) * softmax_scale
        pos = torch.arange(length - (end - start), length, device=q.device).unsqueeze(1)
        key_pos = torch.arange(length, device=q.device).unsqueeze(0)
        hidden = key_pos > pos
        if window_size[0] >= 0:
            hidden |= key_pos < pos - window_size[0]
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1),
                                      values).to(out.dtype)


# --------------------------------------------------------------------------- one engine layer group


def allocate(ops: VllmOps, member, kv_cache_dtype: str, device: str, num_layers: int = 2):
    """vLLM's per-layer [B, H, N, C] views of one raw buffer in ``member``'s order (as its planner lays them out)."""
    interface = ops.interface
    fp8 = kv_cache_dtype == "fp8"
    spec = interface.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
        dtype=torch.uint8 if fp8 else torch.bfloat16,
        kv_quant_mode=ops.KVQuantMode.FP8_PER_TENSOR if fp8 else ops.KVQuantMode.NONE)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    layer_stride, block_stride, *_ = interface.compute_layout_strides(spec, NUM_BLOCKS, num_layers, member)
    size = spec.page_size_bytes * NUM_BLOCKS * num_layers
    tensor = interface.KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride,
                                     offset=0)
    raw = torch.zeros(size, dtype=torch.int8, device=device)
    views = interface.create_kv_cache_views(raw, spec, NUM_BLOCKS, member, tensor)
    return raw, dict(zip(names, views)), spec


@dataclass
class Batch:
    lengths: list[int]  # after this step
    query_lens: list[int]
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor


def make_batch(lengths, query_lens, device, seed) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()  # block 0: vLLM's null block
    width = max(math.ceil(n / BLOCK_SIZE) for n in lengths) + 2
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    for r, n in enumerate(lengths):
        need = math.ceil(n / BLOCK_SIZE)
        table[r, :need] = torch.tensor(pool[:need], dtype=torch.int32)
        pool = pool[need:]
    slots = [int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for r, (n, q) in enumerate(zip(lengths, query_lens)) for p in range(n - q, n)]
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    return Batch(list(lengths), list(query_lens), table.to(device), torch.tensor(slots, device=device),
                 torch.tensor(qsl, dtype=torch.int32, device=device))


def history_slots(batch: Batch) -> torch.Tensor:
    """The slots of every token before this step's, to fill the cache with earlier steps' K/V."""
    table = batch.block_table.cpu()
    slots = [int(table[r, p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE
             for r, (n, q) in enumerate(zip(batch.lengths, batch.query_lens)) for p in range(n - q)]
    return torch.tensor(slots, device=batch.block_table.device)


class Layer:
    """One layer run as TritonAttentionImpl runs it (do_kv_cache_update, then forward), with kvdbg's capture."""

    def __init__(self, ops: VllmOps, name: str, kv_cache: torch.Tensor, kv_cache_dtype: str, window: int | None,
                 standin: bool):
        self.ops, self.name, self.kv_cache, self.window = ops, name, kv_cache, window
        self.kv_cache_dtype = kv_cache_dtype
        self.fp8 = kv_cache_dtype == "fp8"
        k, v = FP8_SCALES if self.fp8 else (1.0, 1.0)
        device = kv_cache.device
        self.k_scale, self.v_scale = torch.tensor(k, device=device), torch.tensor(v, device=device)
        self.k_scale_float, self.v_scale_float = k, v
        self.write = standin_write_cache if standin else ops.write_cache
        self.attend = standin_attention if standin else ops.attention

    def kv_views(self, kv_cache):
        # (B, H, N, 2*D) -> ((B, N, H, D), (B, N, H, D)), as TritonAttentionImpl splits its cache.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)
        if self.fp8:
            key_cache, value_cache = key_cache.view(self.ops.fp8_dtype), value_cache.view(self.ops.fp8_dtype)
        return key_cache, value_cache

    def cache_update(self, key, value, slot_mapping):
        key_cache, value_cache = self.kv_views(self.kv_cache)
        self.write(key, value, key_cache, value_cache, slot_mapping, self.kv_cache_dtype, self.k_scale, self.v_scale)

    def forward(self, query, batch: Batch, output):
        key_cache, value_cache = self.kv_views(self.kv_cache)
        num_seqs = len(batch.lengths)
        descale = (num_seqs, NUM_KV_HEADS)
        # The builder's scratch for the 3D (split-softmax) kernel: one row per sequence up to its threshold
        # (as it sizes it with max_num_seqs >= the threshold and no speculative decoding).
        segments, threshold = self.ops.softmax_segments, self.ops.min_launch_grid_2d // NUM_KV_HEADS
        rows = threshold
        padded = 1 << (HEAD_SIZE - 1).bit_length()
        device = query.device
        self.attend(
            q=query, k=key_cache, v=value_cache, out=output, cu_seqlens_q=batch.query_start_loc,
            max_seqlen_q=max(batch.query_lens), seqused_k=torch.tensor(batch.lengths, dtype=torch.int32,
                                                                        device=device),
            max_seqlen_k=max(batch.lengths), softmax_scale=HEAD_SIZE ** -0.5, causal=True,
            window_size=(self.window - 1, 0) if self.window else (-1, -1), block_table=batch.block_table, softcap=0,
            q_descale=None, k_descale=self.k_scale.expand(descale), v_descale=self.v_scale.expand(descale),
            seq_threshold_3D=threshold, num_par_softmax_segments=segments,
            softmax_segm_output=torch.empty(rows, NUM_HEADS, segments, padded, dtype=torch.float32, device=device),
            softmax_segm_max=torch.empty(rows, NUM_HEADS, segments, dtype=torch.float32, device=device),
            softmax_segm_expsum=torch.empty(rows, NUM_HEADS, segments, dtype=torch.float32, device=device),
            kv_quant_mode=self.ops.KVQuantMode.FP8_PER_TENSOR if self.fp8 else self.ops.KVQuantMode.NONE,
        )


# --------------------------------------------------------------------------- a case: run, capture, replay


@dataclass
class Case:
    name: str
    layout: str  # the KVCacheLayout member vLLM resolved (and the caches are in)
    kv_cache_dtype: str
    lengths: tuple[int, ...]
    query_lens: tuple[int, ...]
    window: int | None = None
    declare: str | None = None  # the layout declared to kvdbg, when not the real one (a mis-declaration)
    raw_view: bool = False  # hand kvdbg the raw buffer viewed as a contiguous [B, H, N, C] (what a shape-reader does)


def run_case(ops: VllmOps, case: Case, out_dir: str, device: str, standin: bool) -> dict:
    from kvdbg.capture.capturer import CaptureBackend, CaptureLayer, Capturer, StepTensors
    from kvdbg.capture.engine_layouts import LayoutError, check_written_kv

    member = ops.KVCacheLayout[case.layout]
    raw, views, spec = allocate(ops, member, case.kv_cache_dtype, device)
    name = next(iter(views))
    layer = Layer(ops, name, views[name], case.kv_cache_dtype, case.window, standin)
    batch = make_batch(case.lengths, case.query_lens, device, seed=len(case.name))
    gen = torch.Generator(device="cpu").manual_seed(7)

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)

    history = history_slots(batch)
    layer.cache_update(normal(len(history), NUM_KV_HEADS, HEAD_SIZE), normal(len(history), NUM_KV_HEADS, HEAD_SIZE),
                       history)
    tokens = sum(case.query_lens)
    # Logits of several units: attention is peaked, so a page read wrongly changes the output.
    query = normal(tokens, NUM_HEADS, HEAD_SIZE, scale=3.0)
    key, value = normal(tokens, NUM_KV_HEADS, HEAD_SIZE), normal(tokens, NUM_KV_HEADS, HEAD_SIZE)
    output = torch.empty(tokens, NUM_HEADS, HEAD_SIZE, dtype=torch.bfloat16, device=device)

    declared = f"vllm:{case.declare or case.layout}"
    kv_for_kvdbg = layer.kv_cache
    if case.raw_view:
        page_elems = spec.page_size_bytes // layer.kv_cache.element_size()
        kv_for_kvdbg = raw.view(layer.kv_cache.dtype)[:NUM_BLOCKS * page_elems].view(
            NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    capturer = Capturer(out_dir, queue_bytes=0)
    target = CaptureLayer(name=name, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE,
                          scale=HEAD_SIZE ** -0.5, dtype=torch.bfloat16, kv_cache_dtype=case.kv_cache_dtype,
                          kv_layout=declared, sliding_window=case.window, k_scale=layer.k_scale_float,
                          v_scale=layer.v_scale_float)
    backend = CaptureBackend(name="TRITON_ATTN", max_model_len=MAX_MODEL_LEN)
    info = {"kv_cache_layout": case.layout, "case": case.name,
            "kernels": "torch stand-ins (CPU test)" if standin else "vLLM 0.33 Triton: triton_reshape_and_cache_flash, "
                                                                    "unified_attention"}

    pre = capturer.save_pre_update(target, key=key, value=value, slot_mapping=batch.slot_mapping,
                                   kv_cache=kv_for_kvdbg, step=0)
    layer.cache_update(key, value, batch.slot_mapping)  # TritonAttentionImpl.do_kv_cache_update
    read_back = "not checked"
    if pre is not None:
        try:
            n = check_written_kv(target_layout(target), kv_for_kvdbg, key=key, value=value,
                                 slot_mapping=batch.slot_mapping, head_size=HEAD_SIZE,
                                 kv_cache_dtype=target.kv_cache_dtype, k_scale=target.k_scale,
                                 v_scale=target.v_scale)
            read_back = f"passed ({n} slots)"
        except LayoutError as exc:
            read_back = f"failed: {str(exc)[:160]}"
    info["kv_layout_read_back"] = read_back
    pending = capturer.begin(target, backend, StepTensors(
        query=query, kv_cache=kv_for_kvdbg, block_table=batch.block_table,
        seq_lens=torch.tensor(batch.lengths, dtype=torch.int32, device=device),
        query_start_loc=batch.query_start_loc, causal=True, pre_update=pre), step=0, info=info)
    layer.forward(query, batch, output)  # TritonAttentionImpl.forward
    if device != "cpu":
        torch.cuda.synchronize()
    path = capturer.finish(pending, output)
    result = {"case": case.name, "path": path, "read_back": read_back,
              "refused": None if path else "; ".join(f"{k} x{v}" for k, v in capturer.failures.items())}
    if path is None:
        return result
    replay = subprocess.run([sys.executable, "-m", "kvdbg", "replay", "--backend", "reference", "--json", path],
                            capture_output=True, text=True)
    result["replay_exit"] = replay.returncode
    try:
        data = json.loads(replay.stdout)
        comp = next(c for c in data["comparisons"] if (c["actual"], c["expected"]) == ("captured", "reference"))
        heads = comp["heads"]
        result["heads"] = len(heads)
        result["failed_heads"] = sum(1 for h in heads if not h["passed"])
        result["max_abs"] = max((h.get("max_abs") or 0.0) for h in heads) if heads else None
        result["min_cosine"] = min((h.get("cosine") if h.get("cosine") is not None else float("nan"))
                                   for h in heads) if heads else None
    except (ValueError, StopIteration, KeyError) as exc:
        result["replay_error"] = f"{type(exc).__name__}: {replay.stderr.strip()[-300:]}"
    for command in ("map", "info"):
        done = subprocess.run([sys.executable, "-m", "kvdbg", command, path], capture_output=True, text=True)
        result[f"{command}_exit"] = done.returncode
    return result


def target_layout(target):
    from kvdbg.capture.engine_layouts import engine_layout

    return engine_layout(target.kv_layout)


# --------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--so-modules", required=True, help="file listing vLLM's compiled module names (stubbed)")
    parser.add_argument("--out", default=None, help="where the snapshots go [default: a temporary directory]")
    parser.add_argument("--standin-kernels", action="store_true", help="torch in place of the Triton kernels (CPU)")
    parser.add_argument("--quick", action="store_true", help="the first case and the mis-declared layout only")
    args = parser.parse_args(argv)
    started = time.monotonic()
    device = "cpu" if args.standin_kernels else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("FAIL setup: no CUDA device (use --standin-kernels to test this script on a CPU)")
        return 1
    with open(args.so_modules) as f:
        so_modules = {line.strip() for line in f if line.strip()}
    ops = load_vllm(args.so_modules)
    import triton

    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    where = os.path.dirname(importlib.util.find_spec("vllm").origin)
    print(f"vLLM {importlib.metadata.version('vllm')} ops from {where}"
          f" ({ops.modules} vLLM modules imported, {len(so_modules)} compiled modules stubbed); torch "
          f"{torch.__version__}, triton {triton.__version__}, {gpu}; import took {time.monotonic() - started:.1f} s")
    tag = "STAND-IN KERNELS, NOT vLLM's: " if args.standin_kernels else ""
    out_dir = args.out or tempfile.mkdtemp(prefix="kvdbg-triton-attn-")
    cases = [
        Case("decode LBNHC bf16 (3D kernel)", "LBNHC", "auto", (1000, 517, 33, 250), (1, 1, 1, 1)),
        Case("mixed LBHNC bf16 window 128 (2D kernel)", "LBHNC", "auto", (700, 90, 301), (1, 64, 1), window=128),
        Case("decode LBNHC fp8 (3D kernel)", "LBNHC", "fp8", (1000, 517, 33, 250), (1, 1, 1, 1)),
    ]
    wrong = [
        Case("LBNHC cache declared LBHNC", "LBNHC", "auto", (1000, 517, 33, 250), (1, 1, 1, 1), declare="LBHNC"),
        Case("LBNHC raw buffer read as LBHNC", "LBNHC", "auto", (1000, 517, 33, 250), (1, 1, 1, 1), declare="LBHNC",
             raw_view=True),
    ]
    if args.quick:
        cases = cases[:1]
    ok = True
    for case in cases:
        t0 = time.monotonic()
        r = run_case(ops, case, os.path.join(out_dir, f"case{cases.index(case)}"), device, args.standin_kernels)
        passed = (r.get("path") and r.get("replay_exit") == 0 and r.get("heads") and r.get("failed_heads") == 0
                  and r["read_back"].startswith("passed") and r.get("map_exit") == 0 and r.get("info_exit") == 0)
        ok &= bool(passed)
        print(f"{'PASS' if passed else 'FAIL'} {tag}captured vs reference, {case.name}: "
              + (f"{r['heads'] - r['failed_heads']}/{r['heads']} request x head pass, max |diff| {r['max_abs']:.3g}, "
                 f"min cosine {r['min_cosine']:.7f}; read-back {r['read_back']}; replay exit {r['replay_exit']}, "
                 f"map exit {r['map_exit']}, info exit {r['info_exit']}" if r.get("heads") else
                 f"no comparison ({r.get('refused') or r.get('replay_error')}; read-back {r['read_back']})")
              + f" [{time.monotonic() - t0:.1f} s] {r.get('path') or ''}")
    strides = run_case(ops, wrong[0], os.path.join(out_dir, "wrong0"), device, args.standin_kernels)
    raw = run_case(ops, wrong[1], os.path.join(out_dir, "wrong1"), device, args.standin_kernels)
    refused = strides["path"] is None and "input" in (strides.get("refused") or "")
    caught = (raw.get("path") is not None and raw["read_back"].startswith("failed") and raw.get("replay_exit") == 1
              and (raw.get("failed_heads") or 0) > 0)
    ok &= refused and caught
    print(f"{'PASS' if refused and caught else 'FAIL'} {tag}mis-declared layout fails: the LBNHC cache declared "
          f"LBHNC is {'refused by its strides' if refused else 'NOT refused: ' + str(strides.get('path'))}; its raw "
          f"buffer read as LBHNC: read-back {raw['read_back'][:90]}, captured vs reference "
          + (f"{raw['failed_heads']}/{raw['heads']} request x head FAIL (replay exit {raw['replay_exit']}, min cosine "
             f"{raw['min_cosine']:.3f})" if raw.get("heads") else f"not compared ({raw.get('refused')})"))
    print(f"{'PASS' if ok else 'FAIL'} {tag}all checks, {time.monotonic() - started:.0f} s; snapshots in {out_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
