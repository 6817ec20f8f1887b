"""Write FlashInfer level-10 dumps with FlashInfer's own logging code, on a machine without a GPU.

    python -m tests.flashinfer_dumps.make_dumps OUT_DIR      (FlashInfer 0.7.2.post1 importable)

FlashInfer's ``flashinfer_api`` decorator (``flashinfer/api_logging.py``) writes a call's inputs
(``_dump_function_inputs``: the call's directory, ``inputs.pt`` or ``inputs.safetensors``, the first
``metadata.jsonl`` record and its ``session.jsonl`` line) *before* the function body runs. On a CPU the
bodies then fail (the wrappers' constructors pin host memory; ``plan`` and ``run`` need CUDA), and this
script catches that: the inputs on disk are exactly what FlashInfer writes on a GPU, with ``"device":
"cpu"`` in the records. Nothing computes a kernel output here, so the output of each ``run`` is computed
below by ``attention_from_flashinfer_args``, a float64 reading of FlashInfer's documented semantics
written from the call's own arguments (it shares no code with kvdbg), and written into the call's
directory by FlashInfer's own ``_dump_function_outputs`` (``outputs.pt``, the ``completed`` record).
Dumps with outputs from real kernels come from tests/gpu/flashinfer_dump_gpu.py on a GPU.

Each session runs in a process of its own, since FlashInfer reads FLASHINFER_LOGLEVEL, FLASHINFER_DUMP_DIR
and FLASHINFER_DUMP_SAFETENSORS once, at import. Sessions:

``torch``        inputs.pt: a decode wrapper (NHD, K/V as a tuple, GQA 8/2, planned twice and run twice),
                 a prefill wrapper (NHD, causal, ragged queries, window) whose calls interleave with the
                 decode wrapper's, a decode wrapper (HND, one 5-D cache tensor, bf16, window, soft cap,
                 sinks, sm_scale), a prefill wrapper (HND, not causal, soft cap), a wrapper planned and
                 never run, and ``rmsnorm`` (not attention).
``safetensors``  FLASHINFER_DUMP_SAFETENSORS=1: one HND decode wrapper.
``more``         inputs.pt: an HND decode wrapper over an FP8 (e4m3) cache with k_scale and v_scale; the one-shot
                 ``trtllm_batch_decode_with_kv_cache`` (HND, one 5-D cache tensor, bmm1/bmm2 scales, window,
                 sinks) and ``trtllm_batch_context_with_kv_cache`` (NHD, a (k, v) tuple, causal, ragged queries).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

SESSIONS = {"torch": "0", "safetensors": "1", "more": "0"}


# ----------------------------------------------------------------------------- an independent answer

def _pages_of(kv_indptr, kv_indices, kv_last_page_len, page_size, request):
    pages = kv_indices[int(kv_indptr[request]):int(kv_indptr[request + 1])].tolist()
    kv_len = (len(pages) - 1) * page_size + int(kv_last_page_len[request])
    return pages, kv_len


def attention_from_flashinfer_args(q, k_cache, v_cache, kv_layout, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                                   *, causal, window_left=-1, logits_soft_cap=0.0, sm_scale=None, sinks=None):
    """Paged attention as FlashInfer's docs define it, in float64, one request and head at a time.

    Request r's keys are its pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]`` in order, the last one holding
    ``kv_last_page_len[r]`` tokens. Query row i of a request with ``qo_len`` rows and ``kv_len`` keys sits at
    ``kv_len - qo_len + i``; causal: it sees keys up to there; ``window_left`` w >= 0: and none before
    ``position - w``. Logits ``sm_scale * q.k``, capped ``c * tanh(x / c)``; a sink logit joins the
    denominator only.
    """
    import torch

    head_dim = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
    num_qo_heads, num_kv_heads = q.shape[1], k_cache.shape[2 if kv_layout == "NHD" else 1]
    page_size = k_cache.shape[1 if kv_layout == "NHD" else 2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for request in range(len(kv_last_page_len)):
        pages, kv_len = _pages_of(kv_indptr, kv_indices, kv_last_page_len, page_size, request)
        if kv_layout == "NHD":
            keys = torch.cat([k_cache[p] for p in pages])[:kv_len].double()  # [kv_len, Hkv, D]
            values = torch.cat([v_cache[p] for p in pages])[:kv_len].double()
        else:
            keys = torch.cat([k_cache[p].transpose(0, 1) for p in pages])[:kv_len].double()
            values = torch.cat([v_cache[p].transpose(0, 1) for p in pages])[:kv_len].double()
        start, end = int(qo_indptr[request]), int(qo_indptr[request + 1])
        qo_len = end - start
        for row in range(qo_len):
            position = kv_len - qo_len + row
            visible = torch.ones(kv_len, dtype=torch.bool)
            key_pos = torch.arange(kv_len)
            if causal:
                visible &= key_pos <= position
            if window_left >= 0:
                visible &= key_pos >= position - window_left
            for head in range(num_qo_heads):
                kv_head = head // (num_qo_heads // num_kv_heads)
                logits = (keys[:, kv_head] @ q[start + row, head].double()) * sm_scale
                if logits_soft_cap and logits_soft_cap > 0:
                    logits = logits_soft_cap * torch.tanh(logits / logits_soft_cap)
                logits = logits.masked_fill(~visible, float("-inf"))
                peak = logits.max()
                if sinks is not None:
                    peak = torch.maximum(peak, sinks[head].double())
                weights = torch.exp(logits - peak)
                denominator = weights.sum() + (torch.exp(sinks[head].double() - peak) if sinks is not None else 0.0)
                out[start + row, head] = (weights @ values[:, kv_head]) / denominator
    return out


# ----------------------------------------------------------------------------- driving FlashInfer's decorator

def _call(fn, *args, **kwargs):
    """Call a decorated FlashInfer function: the decorator dumps the inputs first; the CPU body then fails."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # expected on a machine without CUDA
        return f"{type(exc).__name__}"
    return "ran"


def _no_downloads() -> None:
    """The trtllm functions' bodies fetch kernel binaries over the network after the dump is written: fail that at
    once instead (the body would fail on a CPU anyway). The decorator, which wrote the dump, is not touched."""
    import flashinfer.artifacts
    import flashinfer.jit.cubin_loader

    def refuse(*args, **kwargs):
        raise RuntimeError("make_dumps: no downloads (no GPU here; the dump is already written)")

    flashinfer.jit.cubin_loader.download_file = refuse
    flashinfer.artifacts.download_file = refuse


def _last_dump_dir(dump_root: Path, function: str) -> Path:
    lines = (dump_root / "session.jsonl").read_text().splitlines()
    for line in reversed(lines):
        record = json.loads(line)
        if record["function_name"] == function:
            return dump_root / Path(record["dump_dir"]).name
    raise RuntimeError(f"FlashInfer wrote no dump of {function}")


def _new_wrapper(cls, workspace, layout):
    """A wrapper whose ``__init__`` FlashInfer records (its body fails at pin_memory on a CPU-only torch)."""
    wrapper = object.__new__(cls)
    _call(cls.__init__, wrapper, workspace, layout)
    return wrapper


def _paged_cache(torch, gen, num_pages, page_size, num_kv_heads, head_dim, dtype, layout):
    shape = (num_pages, page_size, num_kv_heads, head_dim) if layout == "NHD" else \
        (num_pages, num_kv_heads, page_size, head_dim)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    return k, v


def _record_output(api_logging, dump_root, function, out):
    run_dir = _last_dump_dir(dump_root, function)
    api_logging._dump_function_outputs(str(run_dir), out)
    return run_dir


def session_torch(dump_root: Path) -> None:
    import torch
    import flashinfer
    from flashinfer import api_logging

    gen = torch.Generator().manual_seed(46)
    workspace = torch.zeros(64, dtype=torch.uint8)
    decode_cls = flashinfer.BatchDecodeWithPagedKVCacheWrapper
    prefill_cls = flashinfer.BatchPrefillWithPagedKVCacheWrapper
    i32 = dict(dtype=torch.int32)

    # A decode wrapper and a prefill wrapper alive together, their plan and run calls interleaved: only the
    # instance a record names (self_id) says which plan a run used.
    decode = _new_wrapper(decode_cls, workspace, "NHD")
    prefill = _new_wrapper(prefill_cls, workspace, "NHD")
    k_nhd, v_nhd = _paged_cache(torch, gen, 12, 16, 2, 64, torch.float16, "NHD")
    d_indptr = torch.tensor([0, 3, 4, 5], **i32)
    d_indices = torch.tensor([7, 2, 9, 0, 4], **i32)
    d_last = torch.tensor([5, 16, 3], **i32)
    _call(decode.plan, d_indptr, d_indices, d_last, 8, 2, 64, 16, q_data_type=torch.float16)
    p_qo = torch.tensor([0, 4, 5, 12], **i32)
    p_indptr = torch.tensor([0, 3, 5, 6], **i32)
    p_indices = torch.tensor([1, 3, 5, 6, 8, 10], **i32)
    p_last = torch.tensor([8, 1, 12], **i32)
    _call(prefill.plan, p_qo, p_indptr, p_indices, p_last, 8, 2, 64, 16, causal=True, window_left=15,
          q_data_type=torch.float16)
    q_decode = torch.randn(3, 8, 64, generator=gen).to(torch.float16)
    q_prefill = torch.randn(12, 8, 64, generator=gen).to(torch.float16)
    _call(prefill.run, q_prefill, (k_nhd, v_nhd))
    _record_output(api_logging, dump_root, "BatchPrefillWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q_prefill, k_nhd, v_nhd, "NHD", p_qo, p_indptr, p_indices, p_last,
                                                  causal=True, window_left=15).to(torch.float16))
    _call(decode.run, q_decode, (k_nhd, v_nhd))
    _record_output(api_logging, dump_root, "BatchDecodeWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q_decode, k_nhd, v_nhd, "NHD", torch.arange(4), d_indptr, d_indices,
                                                  d_last, causal=True).to(torch.float16))
    # The same decode wrapper planned again (another batch) and run: its run pairs with this second plan.
    d2_indptr = torch.tensor([0, 2, 4], **i32)
    d2_indices = torch.tensor([11, 6, 3, 7], **i32)
    d2_last = torch.tensor([9, 2], **i32)
    _call(decode.plan, d2_indptr, d2_indices, d2_last, 8, 2, 64, 16, q_data_type=torch.float16,
          logits_soft_cap=30.0)
    q_decode2 = torch.randn(2, 8, 64, generator=gen).to(torch.float16)
    _call(decode.run, q_decode2, (k_nhd, v_nhd))
    _record_output(api_logging, dump_root, "BatchDecodeWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q_decode2, k_nhd, v_nhd, "NHD", torch.arange(3), d2_indptr,
                                                  d2_indices, d2_last, causal=True,
                                                  logits_soft_cap=30.0).to(torch.float16))

    # HND decode: one 5-D tensor [pages, 2, Hkv, page_size, D], bf16, window, soft cap, sinks, sm_scale.
    hnd = _new_wrapper(decode_cls, workspace, "HND")
    k_hnd, v_hnd = _paged_cache(torch, gen, 10, 8, 4, 64, torch.bfloat16, "HND")
    kv_hnd = torch.stack([k_hnd, v_hnd], dim=1)
    h_indptr = torch.tensor([0, 4, 5, 8, 10], **i32)
    h_indices = torch.tensor([3, 1, 8, 5, 0, 9, 2, 6, 4, 7], **i32)
    h_last = torch.tensor([6, 8, 1, 8], **i32)
    _call(hnd.plan, h_indptr, h_indices, h_last, 16, 4, 64, 8, window_left=11, logits_soft_cap=12.0,
          sm_scale=0.11, q_data_type=torch.bfloat16)
    q_hnd = torch.randn(4, 16, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(16, generator=gen)
    _call(hnd.run, q_hnd, kv_hnd, sinks=sinks)
    _record_output(api_logging, dump_root, "BatchDecodeWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q_hnd, k_hnd, v_hnd, "HND", torch.arange(5), h_indptr, h_indices,
                                                  h_last, causal=True, window_left=11, logits_soft_cap=12.0,
                                                  sm_scale=0.11, sinks=sinks).to(torch.bfloat16))

    # HND prefill, not causal (every query row sees the request's keys), soft cap.
    dense = _new_wrapper(prefill_cls, workspace, "HND")
    k2, v2 = _paged_cache(torch, gen, 6, 16, 2, 64, torch.float16, "HND")
    n_qo = torch.tensor([0, 3, 4], **i32)
    n_indptr = torch.tensor([0, 2, 3], **i32)
    n_indices = torch.tensor([5, 1, 3], **i32)
    n_last = torch.tensor([4, 9], **i32)
    _call(dense.plan, n_qo, n_indptr, n_indices, n_last, 4, 2, 64, 16, causal=False, logits_soft_cap=20.0,
          q_data_type=torch.float16)
    q_dense = torch.randn(4, 4, 64, generator=gen).to(torch.float16)
    _call(dense.run, q_dense, (k2, v2))
    _record_output(api_logging, dump_root, "BatchPrefillWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q_dense, k2, v2, "HND", n_qo, n_indptr, n_indices, n_last,
                                                  causal=False, logits_soft_cap=20.0).to(torch.float16))

    # Planned, never run: nothing to import.
    idle = _new_wrapper(decode_cls, workspace, "NHD")
    _call(idle.plan, d_indptr, d_indices, d_last, 8, 2, 64, 16)
    # Not attention: listed and skipped.
    _call(flashinfer.rmsnorm, torch.randn(4, 64, generator=gen).half(), torch.ones(64).half())


def session_safetensors(dump_root: Path) -> None:
    import torch
    import flashinfer
    from flashinfer import api_logging

    gen = torch.Generator().manual_seed(47)
    wrapper = _new_wrapper(flashinfer.BatchDecodeWithPagedKVCacheWrapper, torch.zeros(64, dtype=torch.uint8), "HND")
    k, v = _paged_cache(torch, gen, 5, 16, 2, 64, torch.float16, "HND")
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    indices = torch.tensor([4, 0, 2], dtype=torch.int32)
    last = torch.tensor([7, 16], dtype=torch.int32)
    _call(wrapper.plan, indptr, indices, last, 4, 2, 64, 16, q_data_type=torch.float16)
    q = torch.randn(2, 4, 64, generator=gen).to(torch.float16)
    _call(wrapper.run, q, (k, v))
    _record_output(api_logging, dump_root, "BatchDecodeWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q, k, v, "HND", torch.arange(3), indptr, indices, last,
                                                  causal=True).to(torch.float16))


def _indptr_form(torch, block_tables, seq_lens, page_size):
    """A block table and lengths as FlashInfer's indptr/indices/last_page_len (for the float64 answer)."""
    counts = [-(-int(n) // page_size) for n in seq_lens]
    indptr = torch.tensor([0] + [sum(counts[:i + 1]) for i in range(len(counts))])
    indices = torch.cat([block_tables[r, :c] for r, c in enumerate(counts)])
    last = torch.tensor([int(n) - (c - 1) * page_size for n, c in zip(seq_lens, counts)])
    return indptr, indices, last


def session_more(dump_root: Path) -> None:
    import torch
    import flashinfer
    import flashinfer.decode
    import flashinfer.prefill
    from flashinfer import api_logging

    _no_downloads()
    gen = torch.Generator().manual_seed(48)
    workspace = torch.zeros(64, dtype=torch.uint8)
    i32 = dict(dtype=torch.int32)

    # FP8 e4m3 cache, fp16 query and output: FlashInfer folds k_scale into the softmax scale and v_scale into
    # the output, the same as dequantising the pages with them.
    fp8 = _new_wrapper(flashinfer.BatchDecodeWithPagedKVCacheWrapper, workspace, "HND")
    k, v = _paged_cache(torch, gen, 8, 16, 2, 64, torch.float32, "HND")
    k8, v8 = (k * 4).to(torch.float8_e4m3fn), (v * 4).to(torch.float8_e4m3fn)
    indptr = torch.tensor([0, 3, 5], **i32)
    indices = torch.tensor([6, 1, 4, 0, 7], **i32)
    last = torch.tensor([11, 16], **i32)
    _call(fp8.plan, indptr, indices, last, 8, 2, 64, 16, q_data_type=torch.float16,
          kv_data_type=torch.float8_e4m3fn)
    q = torch.randn(2, 8, 64, generator=gen).half()
    _call(fp8.run, q, (k8, v8), k_scale=0.25, v_scale=0.25)
    _record_output(api_logging, dump_root, "BatchDecodeWithPagedKVCacheWrapper.run",
                   attention_from_flashinfer_args(q, k8.double() * 0.25, v8.double() * 0.25, "HND", torch.arange(3),
                                                  indptr, indices, last, causal=True).to(torch.float16))

    # One-shot decode: HND, one [P, 2, Hkv, page_size, D] tensor, a block table with a stale tail.
    k, v = _paged_cache(torch, gen, 9, 16, 2, 64, torch.bfloat16, "HND")
    kv = torch.stack([k, v], dim=1)
    block_tables = torch.tensor([[8, 2, 5, 3], [1, 0, 7, 7], [4, 6, 0, 0]], **i32)
    seq_lens = torch.tensor([60, 17, 30], **i32)
    q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16)
    sinks = torch.randn(8, generator=gen)
    _call(flashinfer.decode.trtllm_batch_decode_with_kv_cache, q, kv, workspace, block_tables, seq_lens, 64,
          bmm1_scale=0.1, bmm2_scale=1.0, window_left=20, sinks=[sinks])
    ip, ix, lp = _indptr_form(torch, block_tables, seq_lens, 16)
    _record_output(api_logging, dump_root, "trtllm_batch_decode_with_kv_cache",
                   attention_from_flashinfer_args(q, k, v, "HND", torch.arange(4), ip, ix, lp, causal=True,
                                                  window_left=20, sm_scale=0.1, sinks=sinks).to(torch.bfloat16))

    # One-shot context (prefill): NHD, a (k, v) tuple, causal, ragged queries.
    k, v = _paged_cache(torch, gen, 7, 16, 2, 64, torch.float16, "NHD")
    block_tables = torch.tensor([[3, 6, 0], [5, 1, 2]], **i32)
    seq_lens = torch.tensor([40, 35], **i32)
    cum_q = torch.tensor([0, 6, 9], **i32)
    cum_kv = torch.tensor([0, 40, 75], **i32)
    q = torch.randn(9, 8, 64, generator=gen).half()
    _call(flashinfer.prefill.trtllm_batch_context_with_kv_cache, q, (k, v), workspace, block_tables, seq_lens, 6, 40,
          0.125, 1.0, 2, cum_q, cum_kv, kv_layout="NHD")
    ip, ix, lp = _indptr_form(torch, block_tables, seq_lens, 16)
    _record_output(api_logging, dump_root, "trtllm_batch_context_with_kv_cache",
                   attention_from_flashinfer_args(q, k, v, "NHD", cum_q, ip, ix, lp, causal=True,
                                                  sm_scale=0.125).to(torch.float16))


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--session":
        name, root = argv[1], Path(argv[2])
        {"torch": session_torch, "safetensors": session_safetensors, "more": session_more}[name](root)
        return 0
    if len(argv) != 1:
        print(__doc__.splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name, safetensors in SESSIONS.items():
        root = out / name
        if root.exists():
            print(f"{root} exists; give an empty OUT_DIR", file=sys.stderr)
            return 2
        env = dict(os.environ, FLASHINFER_LOGLEVEL="10", FLASHINFER_DUMP_DIR=str(root),
                   FLASHINFER_DUMP_SAFETENSORS=safetensors, FLASHINFER_LOGDEST=str(out / f"{name}.log"))
        subprocess.run([sys.executable, "-m", "tests.flashinfer_dumps.make_dumps", "--session", name, str(root)],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        calls = sorted(p.name for p in root.iterdir() if p.is_dir())
        print(f"{root}: {len(calls)} calls dumped by FlashInfer")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
