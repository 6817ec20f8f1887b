"""`kvdbg shrink --emit-script`: a standalone script (torch + safetensors only) reproducing a backend's mismatch.

The script loads one step's tensors -- the cache already holding the step's new
keys and values, the block table as indices into the stored pages, lengths,
query -- and runs, in plain torch and written out line by line:

- the failing backend's computation as kvdbg replays it: for ``flex`` the
  paged ``flex_attention`` call with vLLM's physical-to-logical map, mask_mod
  and the BlockMask built from the page table (``BlockMask.from_kv_blocks``,
  the same kv_num_blocks / kv_indices as kvdbg's flex backend); for
  ``flashinfer_ts`` the builder's decisions (uniform query blocks, no-op batch,
  the page-aligned window restriction of dense windowed layers, plan and
  scales) and the prims_ts kernel contract (requests that break a
  precondition are left unwritten);
- an exact float64 reference over the logical KV with the exact mask;

then compares them per request x head with kvdbg's rule and tolerance, prints
the mismatch, and exits 1 when it reproduces, 0 when it does not (2: the
tensors cannot be read). It never imports kvdbg: a kernel maintainer runs it
with ``python repro.py``.

Tensors small enough (``EMBED_LIMIT_BYTES``) are embedded in the script as
base64; larger ones go to ``<script stem>.safetensors`` beside it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kvdbg.util.atomic import check_output
from kvdbg.errors import OptionError

if TYPE_CHECKING:
    from kvdbg.snapshot.store import Snapshot

# Tensor bytes up to which the data goes into the script itself (base64 adds a third).
EMBED_LIMIT_BYTES = 96 * 1024
SUPPORTED = ("flex", "flashinfer_ts")
DATA_MODES = ("auto", "embed", "file")


@dataclass
class ReproScript:
    """What was written, and what kvdbg itself saw on the same tensors."""

    script: str
    data_file: str | None  # None: the tensors are embedded in the script
    embedded: bool
    tensor_bytes: int
    backend: str
    step: int
    kvdbg_failing_heads: list[tuple[int, int]]  # (request, head) the backend fails on in kvdbg's replay
    verified_exit: int | None = None  # the script's exit code when run here (None: not run)
    verified_output: str | None = None

    @property
    def reproduces(self) -> bool | None:
        """Exit 1 *and* the script's own REPRODUCED line: a crash can never pass for a reproduction."""
        if self.verified_exit is None:
            return None
        return self.verified_exit == 1 and "\nREPRODUCED:" in "\n" + (self.verified_output or "")

    def to_json(self) -> dict:
        out = asdict(self)
        out["kvdbg_failing_heads"] = [list(p) for p in self.kvdbg_failing_heads]
        out["reproduces"] = self.reproduces
        return out


def data_path_for(script: str) -> str:
    """``repro.py`` -> ``repro.safetensors`` beside it."""
    root, _ = os.path.splitext(script)
    return root + ".safetensors"


def check_targets(script: str, *, data: str = "auto", overwrite: bool = False, avoid: tuple[str, ...] = ()) -> None:
    """Refuse before any work: an existing script or data file (without ``overwrite``), or a clash with ``avoid``."""
    if data not in DATA_MODES:
        raise OptionError(f"--script-data must be one of {', '.join(DATA_MODES)}, got {data!r}")
    if not script.endswith(".py"):
        raise OptionError(f"--emit-script {script}: name the script *.py (its tensors go beside it as *.safetensors)")
    targets = [script] + ([] if data == "embed" else [data_path_for(script)])
    for target in targets:
        for other in avoid:
            if other and os.path.abspath(other) == os.path.abspath(target):
                raise OptionError(f"--emit-script {script} would write {target}, which is also the shrunk "
                                  "snapshot or the input; choose another script name")
        if os.path.isdir(target):
            raise OptionError(f"--emit-script: {target} is a directory")
        # In auto mode the data may go to a file: an existing one is refused before the work, not after.
        check_output(target, overwrite=overwrite, what="--emit-script:")


def emit_repro_script(snapshot: "Snapshot", backend: str, script: str, *, step: int = 0, data: str = "auto",
                      overwrite: bool = False, device: str = "cpu", source: str | None = None) -> ReproScript:
    """Write ``script`` (and its tensors) reproducing ``backend`` against the exact reference on ``step``."""
    import torch
    from safetensors.torch import save

    from kvdbg.util.atomic import atomic_write, write_text_atomic
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.snapshot.cache import apply_step_update, working_cache
    from kvdbg.judge.compare import compare_step, default_tolerance
    from kvdbg.replayer.runner import replay

    if backend not in SUPPORTED:
        raise OptionError(f"--emit-script writes out {' and '.join(SUPPORTED)} only; {backend} runs code the "
                          "script cannot carry (choose --backend flex or flashinfer_ts)")
    check_targets(script, data=data, overwrite=overwrite)
    if not 0 <= step < len(snapshot.steps):
        raise OptionError(f"--step {step} is out of range: the snapshot has {len(snapshot.steps)} step(s)")
    result = replay(snapshot, ["reference", backend], ReplayOptions(device=device), steps=[step], required=[backend])
    replayed = result.steps[0]
    run = replayed.runs[backend]
    if run.error is not None:
        raise OptionError(f"{backend} raised on this snapshot ({run.error}); there is no computation to write out")
    if run.not_applicable is not None:
        raise OptionError(f"{backend} does not run this step ({run.not_applicable}); nothing to reproduce")
    judged = [c for c in compare_step(replayed, snapshot.meta) if c.actual == backend and c.expected == "reference"]
    failing = sorted({(h.request, h.head) for c in judged for h in c.failed})

    cache = working_cache(snapshot)
    for earlier in range(step + 1):
        apply_step_update(snapshot, cache, earlier)
    s = snapshot.steps[step]
    layer, meta = snapshot.meta.layer, snapshot.meta
    output = run.output.detach().cpu().clone()
    if run.written is not None:
        output[~run.written.cpu()] = float("nan")
    tensors = {
        "kv_cache": cache.cpu().contiguous(),
        "block_table": snapshot.stored_block_table(step).to(torch.int32).contiguous(),
        "engine_block_table": s.block_table.to(torch.int32).contiguous(),
        "page_ids": snapshot.page_ids.to(torch.int64).contiguous(),
        "seq_lens": s.seq_lens.to(torch.int32).contiguous(),
        "query_start_loc": s.query_start_loc.to(torch.int32).contiguous(),
        "query": s.query.contiguous(),
        "kvdbg_output": output.contiguous(),
    }
    # A step whose query is FP8 keeps the replay's widening for the kernel's e4m3 rounding of P.
    tol = default_tolerance(layer.dtype, fp8=layer.is_fp8, fp8_query=replayed.fp8_query_allowance)
    config = {
        "backend": backend, "source": source or snapshot.path or "a snapshot in memory", "step": step,
        "kv_layout": meta.kv_layout, "page_size": meta.backend.page_size,
        "num_heads": layer.num_heads, "num_kv_heads": layer.num_kv_heads, "head_size": layer.head_size,
        "scale": float(layer.scale), "causal": bool(layer.causal), "sliding_window": layer.sliding_window,
        "dtype": layer.dtype, "fp8": layer.is_fp8, "q_scale": float(layer.q_scale),
        "k_scale": float(layer.k_scale), "v_scale": float(layer.v_scale),
        "logits_soft_cap": layer.logits_soft_cap, "null_page": snapshot.null_page_index(),
        "atol": tol.atol, "rtol": tol.rtol, "tolerance": tol.source,
    }
    if backend == "flex":
        from kvdbg.backends.flex import Q_BLOCK_SIZE

        config["q_block_size"] = Q_BLOCK_SIZE
    else:
        from kvdbg.backends.flashinfer_ts import _buffer_rows

        instance = _ts_instance(snapshot, device)
        config.update({
            "max_decode_query_len": meta.backend.max_decode_query_len,
            "max_model_len": meta.backend.max_model_len,
            "buffer_rows": _buffer_rows(meta, meta.backend.max_decode_query_len),
            "nonpositive_is_inactive": bool(instance.gate.contract.nonpositive_is_inactive),
            "contract": instance.gate.contract.label,
        })
    payload = save(tensors, metadata={"repro": json.dumps(config)})
    embedded = data == "embed" or (data == "auto" and len(payload) <= EMBED_LIMIT_BYTES)
    data_file = None if embedded else data_path_for(script)
    if data_file is not None:
        atomic_write(data_file, lambda fh: fh.write(payload), overwrite=overwrite, what="--emit-script data")
    text = script_text(config, payload if embedded else None,
                       None if data_file is None else os.path.basename(data_file))
    try:
        write_text_atomic(script, text, overwrite=overwrite, what="--emit-script")
    except BaseException:
        if data_file is not None and not overwrite:
            os.unlink(data_file)  # ours: written a moment ago, and no script names it
        raise
    os.chmod(script, os.stat(script).st_mode | 0o111)
    return ReproScript(script=script, data_file=data_file, embedded=embedded, tensor_bytes=len(payload),
                       backend=backend, step=step, kvdbg_failing_heads=failing)


def _ts_instance(snapshot: "Snapshot", device: str):
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.backends import get_backend

    return get_backend("flashinfer_ts").create(snapshot.meta, ReplayOptions(device=device))


def run_script(script: str, *, timeout: float = 600.0, python: str | None = None) -> tuple[int, str]:
    """Run ``script`` in an isolated interpreter (``-I``: no PYTHONPATH, no user site, no cwd on the path)."""
    try:
        done = subprocess.run([python or sys.executable, "-I", os.path.abspath(script)], capture_output=True,
                              text=True, timeout=timeout, cwd=os.path.dirname(os.path.abspath(script)))
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return done.returncode, done.stdout + done.stderr


# --------------------------------------------------------------------------- the script's text


def script_text(config: dict, embedded: bytes | None, data_file: str | None) -> str:
    import base64
    import textwrap

    backend = config["backend"]
    what = FLEX_WHAT if backend == "flex" else TS_WHAT
    where = ("embedded below (base64 of a safetensors file)" if embedded is not None
             else f"read from {data_file} beside this script")
    header = HEADER.format(backend=backend, source=config["source"], step=config["step"], what=what, where=where)
    if embedded is not None:
        blob = "\n".join(textwrap.wrap(base64.b64encode(embedded).decode("ascii"), 100))
        data = f'DATA_FILE = None\nEMBEDDED = """\n{blob}\n"""\n'
    else:
        data = f"DATA_FILE = {data_file!r}\nEMBEDDED = None\n"
    body = FLEX_BODY if backend == "flex" else TS_BODY
    import pprint

    literal = pprint.pformat(config, sort_dicts=False, width=110)
    return "".join([header, f"CONFIG = {literal}\n\n", data, COMMON_BODY, body, MAIN_BODY])


FLEX_WHAT = ("vLLM FLEX_ATTENTION's paged flex_attention call: the physical->logical page map (null block "
             "masked), its mask_mod, and the BlockMask built from the page table")
TS_WHAT = ("vLLM FLASHINFER_TS's builder (uniform query blocks, page-aligned window restriction for dense "
           "windowed layers, plan and scales) and the prims_ts kernel contract in plain torch")

HEADER = '''#!/usr/bin/env python3
"""Standalone reproduction: {backend} against an exact reference, on step {step} of {source}.

Runs {what};
and an exact float64 attention over the logical KV with the exact mask. Compares them per
(request, head) with |a - e| <= atol + rtol*|e|; a non-finite or unwritten element always fails.

Tensors: {where}.
Needs only torch (with torch.nn.attention.flex_attention for flex) and safetensors.
Exit 1: the mismatch reproduces; 0: it does not; 2: the tensors cannot be read or the script failed.
Written by kvdbg, which it does not need: torch and safetensors are enough.
"""

import base64
import os
import sys
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch without numpy: not needed here
import torch  # noqa: E402
from safetensors.torch import load, load_file  # noqa: E402

'''

COMMON_BODY = r'''

def load_tensors():
    try:
        if EMBEDDED is not None:
            return load(base64.b64decode("".join(EMBEDDED.split())))
        return load_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), DATA_FILE))
    except Exception as exc:  # a missing or damaged data file
        print(f"cannot read the tensors: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(2)


def cdiv(a, b):
    return -(-a // b)


def kv_pages(kv_cache):
    """K and V as [pages, Hkv, page_size, D] views of the cache in its layout (FP8 bytes viewed as e4m3)."""
    if CONFIG["fp8"] and kv_cache.dtype == torch.uint8:
        kv_cache = kv_cache.view(torch.float8_e4m3fn)
    d = CONFIG["head_size"]
    if CONFIG["kv_layout"] == "pages,heads,tokens,2*dim":
        return kv_cache[..., :d], kv_cache[..., d:]  # the two halves of each token's 2*D row
    return kv_cache[0].permute(0, 2, 1, 3), kv_cache[1].permute(0, 2, 1, 3)  # "2,pages,tokens,heads,dim"


def exact_reference(t):
    """float64 attention over each request's logical keys, gathered through the block table.

    Query token i of a request with seq_len L and q query tokens sits at p = L - q + i. It sees key k when
    causal: k <= p; dense: k < L; with a sliding window w also |p - k| < w. Only those keys enter the sum.
    """
    ps, hq, hkv, d = CONFIG["page_size"], CONFIG["num_heads"], CONFIG["num_kv_heads"], CONFIG["head_size"]
    group, window, cap = hq // hkv, CONFIG["sliding_window"], CONFIG["logits_soft_cap"]
    k_pages, v_pages = kv_pages(t["kv_cache"])
    k_scale = CONFIG["k_scale"] if CONFIG["fp8"] else 1.0
    v_scale = CONFIG["v_scale"] if CONFIG["fp8"] else 1.0
    query = t["query"]
    q_scale = 1.0
    if CONFIG["fp8"] and query.dtype in (torch.uint8, torch.float8_e4m3fn):
        query, q_scale = query.view(torch.float8_e4m3fn), CONFIG["q_scale"]
    out = torch.full((query.shape[0], hq, d), float("nan"), dtype=torch.float64)
    starts, lens = t["query_start_loc"].tolist(), t["seq_lens"].tolist()
    for r, length in enumerate(lens):
        first, last = starts[r], starts[r + 1]
        q_len = last - first
        pages = t["block_table"][r, :cdiv(length, ps)].long()
        keys = (k_pages[pages].double() * k_scale).permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        values = (v_pages[pages].double() * v_scale).permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        for i in range(q_len):
            p = length - q_len + i
            k = torch.arange(length)
            seen = (k <= p) if CONFIG["causal"] else (k < length)
            if window is not None:
                seen &= (p - k).abs() < window
            idx = seen.nonzero().flatten()
            if idx.numel() == 0:
                continue
            for h in range(hq):
                kv = h // group
                s = (keys[kv, idx] @ (query[first + i, h].double() * q_scale)) * CONFIG["scale"]
                if cap:
                    s = cap * torch.tanh(s / cap)
                out[first + i, h] = torch.softmax(s, 0) @ values[kv, idx]
    return out

'''

FLEX_BODY = r'''

def flex_maps(t):
    """The index maps kvdbg's flex backend builds from the page table, as vLLM's FLEX_ATTENTION does.

    physical_to_logical[r, page]: the logical block of a stored page in request r's row, -1 when it holds
      none. Only live entries count (columns below cdiv(seq_len, page_size) holding a stored page); a page
      listed twice keeps its last column; the null block (engine page 0) is always -1.
    kv_num_blocks[b], kv_indices[b]: the stored pages query block b (q_block_size tokens of the batch) visits.
      Every token fetches its request's first cdiv(max_seq_len, page_size) table entries; entries wholly
      before its sliding window and the null block are skipped; pages are listed in order of first
      appearance, and kv_indices is as wide as the cache.
    """
    ps, qb = CONFIG["page_size"], CONFIG["q_block_size"]
    table, lens, starts = t["block_table"].tolist(), t["seq_lens"].tolist(), t["query_start_loc"].tolist()
    num_pages, null, window = pages_in_cache(t), CONFIG["null_page"], CONFIG["sliding_window"]
    num_reqs = len(lens)
    p2l = torch.full((num_reqs, num_pages), -1, dtype=torch.int64)
    for r in range(num_reqs):
        for col, page in enumerate(table[r][:cdiv(lens[r], ps)]):
            if page >= 0:
                p2l[r, page] = col  # later columns overwrite earlier ones: the last one wins
        if null is not None:
            p2l[r, null] = -1
    doc = [r for r in range(num_reqs) for _ in range(starts[r + 1] - starts[r])]
    tokens = len(doc)
    span = min(len(table[0]) if table else 0, cdiv(max(lens, default=0), ps))
    num_blocks = max(1, cdiv(tokens, qb))
    kv_num_blocks = torch.zeros(num_blocks, dtype=torch.int32)
    kv_indices = torch.zeros(num_blocks, max(1, num_pages), dtype=torch.int32)
    for b in range(num_blocks):
        listed = []
        for tok in range(b * qb, min(tokens, (b + 1) * qb)):
            r = doc[tok]
            p = tok - starts[r] + lens[r] - (starts[r + 1] - starts[r])
            first_col = max(0, p - (window - 1)) // ps if window is not None else 0
            for col in range(span):
                page = table[r][col]
                if page < 0 or page == null or col < first_col or page in listed:
                    continue
                listed.append(page)
        kv_num_blocks[b] = len(listed)
        kv_indices[b, :len(listed)] = torch.tensor(listed, dtype=torch.int32)
    return p2l, kv_num_blocks, kv_indices, torch.tensor(doc, dtype=torch.int64)


def pages_in_cache(t):
    kv = t["kv_cache"]
    return kv.shape[0] if CONFIG["kv_layout"] == "pages,heads,tokens,2*dim" else kv.shape[1]


def backend_output(t, compile_flex=False):
    """flex_attention over the whole physical cache, flattened to [1, Hkv, pages * page_size, D].

    The mask_mod maps a physical key index to its logical position through physical_to_logical and
    applies the logical mask (causal with decode offset L - q, window |p - k| < w). Eager flex_attention
    evaluates mask_mod on every (query, key) pair and ignores the BlockMask's block list, so in eager mode
    the list is applied explicitly: a key counts only in a page the query's block lists -- what the
    compiled kernel (--compile) does by skipping unlisted blocks.
    """
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    ps, qb, hq, d = CONFIG["page_size"], CONFIG["q_block_size"], CONFIG["num_heads"], CONFIG["head_size"]
    model_dtype = getattr(torch, CONFIG["dtype"])
    p2l, kv_num_blocks, kv_indices, doc = flex_maps(t)
    seq_lens = t["seq_lens"].long()
    starts = t["query_start_loc"].long()
    decode_offset = seq_lens - (starts[1:] - starts[:-1])
    causal, window = CONFIG["causal"], CONFIG["sliding_window"]
    num_pages = p2l.shape[1]
    listed = torch.zeros(kv_indices.shape[0], num_pages + 1, dtype=torch.bool)
    for b in range(kv_indices.shape[0]):
        listed[b, kv_indices[b, :kv_num_blocks[b]].long()] = True

    def mask_mod(b, h, q_idx, kv_idx):
        req = doc[q_idx]
        logical_block = p2l[req, kv_idx // ps]
        logical_k = logical_block * ps + kv_idx % ps
        valid = (logical_block >= 0) & (logical_k < seq_lens[req])
        logical_q = q_idx - starts[req] + decode_offset[req]
        keep = (logical_q >= logical_k) if causal else (logical_q >= 0)
        if window is not None:
            keep = keep & ((logical_q - logical_k).abs() < window)
        return valid & keep

    def listed_mask_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & listed[q_idx // qb, kv_idx // ps]

    tokens = doc.numel()
    block_mask = BlockMask.from_kv_blocks(
        kv_num_blocks[None, None], kv_indices[None, None], BLOCK_SIZE=(qb, ps),
        mask_mod=mask_mod if compile_flex else listed_mask_mod, seq_lengths=(tokens, num_pages * ps),
        compute_q_blocks=False)
    k_pages, v_pages = kv_pages(t["kv_cache"])
    query = t["query"]
    if CONFIG["fp8"]:  # vLLM's flex has no FP8 path: dequantised with the scales, as kvdbg replays it
        if query.dtype in (torch.uint8, torch.float8_e4m3fn):
            query = query.view(torch.float8_e4m3fn).float() * CONFIG["q_scale"]
        k_pages, v_pages = k_pages.float() * CONFIG["k_scale"], v_pages.float() * CONFIG["v_scale"]
    n, hkv = k_pages.shape[0], k_pages.shape[1]
    keys = k_pages.to(model_dtype).permute(1, 0, 2, 3).reshape(1, hkv, n * ps, d)
    values = v_pages.to(model_dtype).permute(1, 0, 2, 3).reshape(1, hkv, n * ps, d)
    q = query.to(model_dtype)[:tokens].permute(1, 0, 2).unsqueeze(0)  # [1, Hq, T, D]
    attend = torch.compile(flex_attention, fullgraph=True, dynamic=False) if compile_flex else flex_attention
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out = attend(q, keys, values, block_mask=block_mask, scale=CONFIG["scale"], enable_gqa=hq != hkv)
    output = out[0].permute(1, 0, 2).float()
    written = torch.ones(tokens, dtype=torch.bool)
    what = "flex_attention (" + ("compiled" if compile_flex else "eager") + ")"
    hidden = hidden_blocks(t, p2l)
    if hidden:
        what += "; live table entries the map does not point back to (their keys are masked): " + "; ".join(hidden)
    return output, written, what


def hidden_blocks(t, p2l):
    """Live logical blocks whose page the physical->logical map sends elsewhere (the null block, or a page
    listed twice): flex masks their keys although the exact mask shows them."""
    ps, null = CONFIG["page_size"], CONFIG["null_page"]
    table, engine, lens = t["block_table"].tolist(), t["engine_block_table"].tolist(), t["seq_lens"].tolist()
    out = []
    for r, length in enumerate(lens):
        for col, page in enumerate(table[r][:cdiv(length, ps)]):
            if page < 0 or int(p2l[r, page]) == col:
                continue
            why = ("the null block (engine page 0)" if page == null else
                   f"the page is listed again at block {int(p2l[r, page])}, which keeps it")
            out.append(f"request {r} block {col} (keys {col * ps}..{min(length, (col + 1) * ps) - 1}, "
                       f"engine page {engine[r][col]}): {why}")
    return out[:16]

'''

TS_BODY = r'''

FP8_MAX = 448.0


def ts_builder(t):
    """What FLASHINFER_TS's builder hands the kernel: per-request seq_lens, the table it reads, the plan.

    One uniform query block: query_len = num_tokens // num_reqs (leftover tokens are never written); above
    max_decode_query_len the batch is a no-op. A dense (non-causal) windowed layer cannot pass its window
    to the kernel, so the builder keeps, per request, the pages from start_page = max(0, floor((L - span) /
    page_size)) on, span = window + query_len - 1, and hands seq_len L - start_page * page_size: one shared
    window start for the whole block, up to page_size - 1 (+ query_len - 1) keys too early. Its buffers
    are cdiv(window + max_decode_query_len - 1, page_size) + 1 columns wide (max_model_len / page_size
    without a window); a causal windowed layer keeps its table truncated to that width.
    """
    ps, window, causal = CONFIG["page_size"], CONFIG["sliding_window"], CONFIG["causal"]
    max_q = CONFIG["max_decode_query_len"]
    lens, table = t["seq_lens"].long(), t["block_table"].long()
    num_reqs, num_tokens = lens.numel(), t["query"].shape[0]
    query_len = num_tokens // num_reqs if num_reqs else 0
    plan = {"mask_type": "causal" if causal else "dense",
            "window_left": window - 1 if (causal and window is not None) else -1,
            "max_kv_len": window + max_q + ps if window is not None else CONFIG["max_model_len"]}
    note = None
    if query_len > max_q:
        note, query_len = f"query_len {query_len} > max_decode_query_len {max_q}: a no-op batch", 0
    if CONFIG["buffer_rows"] is not None and num_reqs > CONFIG["buffer_rows"]:
        note, query_len = f"{num_reqs} requests overflow the {CONFIG['buffer_rows']}-row buffers", 0
    width = cdiv(window + max_q - 1, ps) + 1 if window is not None else cdiv(CONFIG["max_model_len"], ps)
    if window is not None and not causal:
        span = window + query_len - 1
        start_page = torch.div(lens - span, ps, rounding_mode="floor").clamp_min(0)
        cols = (start_page[:, None] + torch.arange(width)[None, :]).clamp_max(table.shape[1] - 1)
        kernel_table = table.gather(1, cols)
        kernel_lens = lens - start_page * ps
    else:
        start_page = torch.zeros_like(lens)
        kernel_table = table[:, :min(table.shape[1], width)]
        kernel_lens = lens.clone()
    return query_len, kernel_lens, kernel_table, start_page, plan, note


def undefined_reason(seq_len, query_len, table_row, plan, num_pages):
    """The first kernel precondition a request breaks (its output is then undefined: left unwritten)."""
    ps = CONFIG["page_size"]
    if seq_len <= 0:
        return "inactive (seq_len <= 0)" if CONFIG["nonpositive_is_inactive"] else f"seq_len {seq_len} <= 0"
    if plan["mask_type"] == "causal" and seq_len < query_len:
        return f"seq_len {seq_len} < query_len {query_len}"
    if seq_len > plan["max_kv_len"]:
        return f"seq_len {seq_len} > max_kv_len {plan['max_kv_len']}"
    if cdiv(seq_len, ps) > table_row.numel():
        return f"needs {cdiv(seq_len, ps)} pages, table has {table_row.numel()} columns"
    live = table_row[:cdiv(seq_len, ps)]
    if bool(((live < 0) | (live >= num_pages)).any()):
        return "a live table entry is outside the cache"
    return None


def fp8_rounded_attention(scores, values):
    """softmax(scores) @ values with P rounded as prims_ts's FP8 path does (split count 1): keys in tiles of
    128, dealt to 2 streams with their own running max; P * 448 rounded to e4m3 for P.V, the sum unrounded."""
    tile, streams, p_scale = 128, 2, 448.0
    length = scores.shape[-1]
    tiles = cdiv(length, tile)
    padded = torch.nn.functional.pad(scores, (0, tiles * tile - length), value=float("-inf"))
    tiled = padded.unflatten(-1, (tiles, tile))
    tile_max = tiled.amax(-1)
    running = torch.empty_like(tile_max)
    for s in range(streams):
        running[..., s::streams] = torch.cummax(tile_max[..., s::streams], dim=-1).values
    empty = running == float("-inf")
    probs = torch.exp(tiled - running.masked_fill(empty, 0.0).unsqueeze(-1)) * p_scale
    rounded = probs.to(torch.float8_e4m3fn).float()
    overall = running.amax(-1, keepdim=True)
    weight = torch.exp(running - overall.masked_fill(overall == float("-inf"), 0.0)).masked_fill(empty, 0.0)
    denom = (probs.sum(-1) * weight).sum(-1, keepdim=True)
    weighted = (rounded * weight.unsqueeze(-1)).flatten(-2)[..., :length]
    return torch.matmul(weighted, values) / denom


def backend_output(t, compile_flex=False):
    """The prims_ts contract on the builder's output, in fp32: request b reads cdiv(seq_len, page_size) pages
    through its kernel table; "dense" sees every key below seq_len, "causal" is bottom-right aligned (row i
    sees keys [0, L - q + i]) and window_left >= 0 keeps the last window_left + 1 of those. Logits scaled by
    bmm1_scale = scale * q_scale * k_scale, the output by bmm2_scale = v_scale. The flat query is cut into
    blocks of query_len: token j goes to request j // query_len, whatever query_start_loc says."""
    hq, hkv, d, ps = CONFIG["num_heads"], CONFIG["num_kv_heads"], CONFIG["head_size"], CONFIG["page_size"]
    group = hq // hkv
    fp8 = CONFIG["fp8"]
    query_len, kernel_lens, kernel_table, start_page, plan, note = ts_builder(t)
    num_tokens = t["query"].shape[0]
    output = torch.full((num_tokens, hq, d), float("nan"))
    written = torch.zeros(num_tokens, dtype=torch.bool)
    if query_len == 0:
        return output, written, f"builder: {note or 'no query tokens'}"
    k_cache, v_cache = kv_pages(t["kv_cache"])
    num_pages = k_cache.shape[0]
    query = t["query"]
    if fp8:  # the kernel takes an e4m3 query: FP8 bytes as they are, a model-dtype query quantised by q_scale
        if query.dtype == torch.uint8:
            query = query.view(torch.float8_e4m3fn)
        elif query.dtype != torch.float8_e4m3fn:
            query = (query.float() / CONFIG["q_scale"]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    bmm1 = CONFIG["scale"] * CONFIG["q_scale"] * CONFIG["k_scale"]
    bmm2 = CONFIG["v_scale"]
    model_dtype = getattr(torch, CONFIG["dtype"])
    kernel_dtype = torch.float16 if (fp8 and model_dtype != torch.float16) else model_dtype
    num_reqs = kernel_lens.numel()
    q = query[:num_reqs * query_len].reshape(num_reqs, query_len, hq, d)
    skipped = []
    for b in range(num_reqs):
        length = int(kernel_lens[b])
        why = undefined_reason(length, query_len, kernel_table[b], plan, num_pages)
        if why is not None:
            skipped.append(f"request {b}: {why}")
            continue
        pages = kernel_table[b, :cdiv(length, ps)]
        keys = k_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        values = v_cache[pages].float().permute(1, 0, 2, 3).reshape(hkv, -1, d)[:, :length]
        qb = q[b].float().reshape(query_len, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv, G, q, D]
        scores = torch.matmul(qb, keys.unsqueeze(1).transpose(-1, -2)) * bmm1
        key_pos = torch.arange(length).unsqueeze(0)
        if plan["mask_type"] == "causal":
            last_key = (length - query_len + torch.arange(query_len)).unsqueeze(1)
            allowed = key_pos <= last_key
            if plan["window_left"] >= 0:
                allowed = allowed & (key_pos >= last_key - plan["window_left"])
        else:
            allowed = torch.ones(query_len, length, dtype=torch.bool)
        scores = scores.masked_fill(~allowed, float("-inf"))
        if fp8:
            result = fp8_rounded_attention(scores, values.unsqueeze(1)) * bmm2
        else:
            result = torch.matmul(torch.softmax(scores, dim=-1), values.unsqueeze(1)) * bmm2
        result = result.permute(2, 0, 1, 3).reshape(query_len, hq, d)
        seen = allowed.any(dim=1)
        rows = torch.arange(b * query_len, (b + 1) * query_len)[seen]
        output[rows] = result[seen].to(kernel_dtype).to(model_dtype).float()
        written[rows] = True
    restricted = ", ".join(f"request {b}: keys from {int(s) * ps}" for b, s in enumerate(start_page.tolist()) if s)
    what = (f"prims_ts contract ({plan['mask_type']}, window_left {plan['window_left']}, max_kv_len "
            f"{plan['max_kv_len']}, query_len {query_len})")
    if restricted:
        what += f"; window restriction: {restricted}"
    if skipped:
        what += "; not computed (precondition broken): " + "; ".join(skipped)
    return output, written, what

'''

MAIN_BODY = r'''

def compare(actual, written, expected, starts):
    """Per (request, head): elements outside |a - e| <= atol + rtol*|e|; non-finite or unwritten always fail."""
    atol, rtol = CONFIG["atol"], CONFIG["rtol"]
    a, e = actual.double(), expected.double()
    wrote = written.view(-1, 1, 1).expand_as(a)
    both = wrote & torch.isfinite(a) & torch.isfinite(e)
    err = torch.where(both, (a - e).abs(), torch.zeros_like(a))
    bad = ~both | (err > atol + rtol * e.abs().where(both, torch.zeros_like(e)))
    rows = []
    for r in range(len(starts) - 1):
        for h in range(a.shape[1]):
            part = slice(starts[r], starts[r + 1])
            failing = int(bad[part, h].sum())
            if failing:
                compared = both[part, h]
                worst = float(err[part, h][compared].max()) if bool(compared.any()) else float("nan")
                unwritten = int((~wrote[part, h]).sum())
                rows.append((r, h, failing, bad[part, h].numel(), worst, unwritten))
    return rows


def main():
    compile_flex = "--compile" in sys.argv[1:]
    t = load_tensors()
    print(f"{CONFIG['backend']} vs exact reference, step {CONFIG['step']} of {CONFIG['source']}")
    print(f"  {t['seq_lens'].numel()} request(s), seq_lens {t['seq_lens'].tolist()}, query tokens "
          f"{t['query'].shape[0]}, heads {CONFIG['num_heads']}/{CONFIG['num_kv_heads']}, head_size "
          f"{CONFIG['head_size']}, page_size {CONFIG['page_size']}, "
          f"{'causal' if CONFIG['causal'] else 'dense'}, window {CONFIG['sliding_window']}")
    actual, written, what = backend_output(t, compile_flex)
    print(f"  ran: {what}")
    expected = exact_reference(t)
    # What kvdbg's own replay of this backend produced on the same tensors: a check that this script is faithful.
    mine, theirs = actual.double(), t["kvdbg_output"].double()
    same_nan = torch.equal(torch.isnan(mine), torch.isnan(theirs))
    both = torch.isfinite(mine) & torch.isfinite(theirs)
    drift = float((mine - theirs).abs()[both].max()) if bool(both.any()) else 0.0
    print(f"  agrees with kvdbg's replay of {CONFIG['backend']}: "
          + (f"yes (max difference {drift:.3g})" if same_nan and drift <= CONFIG['atol'] else
             f"NO (max difference {drift:.3g}, unwritten tokens {'same' if same_nan else 'differ'})"))
    starts = t["query_start_loc"].tolist()
    rows = compare(actual, written, expected, starts)
    print(f"  rule: |a - e| <= {CONFIG['atol']:g} + {CONFIG['rtol']:g}*|e| ({CONFIG['tolerance']})")
    if not rows:
        print("does not reproduce: every (request, head) agrees with the exact reference")
        return 0
    print(f"REPRODUCED: {len(rows)} (request, head) pair(s) fail")
    print("  request  head  failing/elements   max abs err  unwritten")
    for r, h, failing, total, worst, unwritten in rows[:64]:
        print(f"  {r:7d}  {h:4d}  {failing:>8d}/{total:<8d}  {worst:11.4g}  {unwritten:9d}")
    if len(rows) > 64:
        print(f"  ... {len(rows) - 64} more")
    return 1


if __name__ == "__main__":
    try:
        code = main()
    except SystemExit:
        raise
    except BaseException:  # a crash is not a reproduction: exit 2, never 1
        import traceback

        traceback.print_exc()
        print("the script could not run to the end (exit 2)", file=sys.stderr)
        code = 2
    sys.exit(code)
'''

__all__ = ["DATA_MODES", "EMBED_LIMIT_BYTES", "ReproScript", "check_targets", "data_path_for", "emit_repro_script",
           "run_script", "script_text"]
