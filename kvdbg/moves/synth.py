"""Deterministic synthetic snapshots: the fixtures and most tests are made with these."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from kvdbg._version import __version__
from kvdbg.snapshot.layout import join_kv, quantize_fp8
from kvdbg.errors import OptionError
from kvdbg.snapshot.format import (ATTN_TYPES, CROSS_ATTN_TYPE, ENCODER_SELF_ATTN_TYPES, LAYOUT_KV_PLANES, LAYOUT_VLLM,
                          LAYOUTS, MODEL_DTYPES, BackendMeta, LayerMeta, SnapshotMeta, canonical_backend_name)
from kvdbg.snapshot.store import Snapshot, Step, torch_dtype, validate

@dataclass(frozen=True)
class SynthSpec:
    """Everything that determines a synthetic snapshot; equal specs give equal bytes."""

    seq_lens: tuple[int, ...] = (9, 77, 200, 333)  # per request at the first step, query included
    query_len: int = 1
    query_lens: tuple[int, ...] | None = None  # ragged blocks instead of query_len for every request
    num_heads: int = 8
    num_kv_heads: int = 2
    head_size: int = 64
    page_size: int = 16
    sliding_window: int | None = None
    causal: bool = True
    dtype: str = "bfloat16"
    fp8: bool = False
    fp8_storage: str = "uint8"
    q_scale: float = 1.0
    k_scale: float = 1.0
    v_scale: float = 1.0
    layout: str = LAYOUT_VLLM
    shuffle: bool = True
    shared_prefix_pages: int = 0
    use_page_zero: bool = False
    page_zero_request: int | None = None
    stale_tail: int = 0  # extra block-table columns filled with stale non-zero ids
    steps: int = 1
    new_kv: bool = True
    seed: int = 0
    num_gpu_blocks: int | None = None
    max_model_len: int | None = None
    max_decode_query_len: int | None = None
    backend: str | None = None
    layer_name: str = "model.layers.0.self_attn.attn"
    notes: str = ""
    # Store each step's output as computed by this kvdbg backend, standing in for the engine's own.
    engine_output: str | None = None
    # Layer features. ``sinks`` / ``alibi_slopes``: one value per query head, or "auto" (sinks drawn from the
    # seed; ALiBi's geometric slopes for num_heads).
    sinks: tuple[float, ...] | str | None = None
    alibi_slopes: tuple[float, ...] | str | None = None
    alibi_sqrt: bool = False
    logits_soft_cap: float | None = None
    attn_type: str = "decoder"
    kv_sharing_target: str | None = None
    chunk_lookback: int | None = None
    extra_layer: dict = field(default_factory=dict)  # e.g. {"mm_prefix": True} to exercise rejections


# Bounds on what one spec may ask for, so that a mistyped option is refused at once rather than allocating
# gigabytes. The largest benchmark snapshot (bench/scaling.py's 8192 MiB row: 64 x 32768 tokens, Hkv 8, D 128,
# bf16) is 8 GiB of KV cache; building it peaks at about four times that (float32 draws, then their casts).
MAX_REQUESTS, MAX_TOKENS, MAX_STEPS = 4096, 2**22, 64
MAX_HEADS = 1024  # query or KV heads (models have up to 128)
MAX_HEAD_SIZE = 1024  # vLLM's largest is 576 (MLA)
MAX_STALE_TAIL = 65536  # block-table columns (a 1M-token max_model_len in pages of 16)
MAX_GPU_BLOCKS = 2**24  # the engine's page count: a random permutation of it is drawn (8 bytes a page)
MAX_PAGES = 2**22  # pages stored (held in Python lists while the block tables are made)
MAX_ENGINE_INT = 2**40  # --max-model-len, --max-decode-query-len: the format's bound on integers
MAX_SEED = 2**63 - 1
MAX_KV_BYTES = 8 * 2**30
MAX_STEP_BYTES = 2**30  # queries, new K/V, slot mappings and block tables of every step

_FEATURE_FIELDS = ("sinks", "alibi_slopes", "alibi_sqrt", "logits_soft_cap", "attn_type", "kv_sharing_target",
                   "chunk_lookback")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _check(spec: SynthSpec) -> None:
    def bad(msg: str) -> OptionError:
        return OptionError(msg)

    if not spec.seq_lens:
        raise bad("--seq-len needs at least one length")
    qlens = spec.query_lens or (spec.query_len,) * len(spec.seq_lens)
    if len(qlens) != len(spec.seq_lens):
        raise bad(f"--query-len gives {len(qlens)} lengths for {len(spec.seq_lens)} requests")
    cross = spec.attn_type == CROSS_ATTN_TYPE
    for i, (length, q) in enumerate(zip(spec.seq_lens, qlens)):
        if q < 0:
            raise bad(f"query length of request {i} must be >= 0, got {q}")
        if length <= 0 or length < q and not cross:
            raise bad(f"--seq-len[{i}] = {length} must be positive and hold the request's {q} query tokens")
    for name in ("num_heads", "num_kv_heads", "head_size", "page_size", "steps"):
        if getattr(spec, name) <= 0:
            option = f"--{name.replace('_', '-')}"  # the CLI's name
            raise bad(f"{option} must be positive, got {getattr(spec, name)}")
    for name, limit in (("num_heads", MAX_HEADS), ("num_kv_heads", MAX_HEADS), ("head_size", MAX_HEAD_SIZE),
                        ("stale_tail", MAX_STALE_TAIL)):
        if getattr(spec, name) > limit:
            raise bad(f"--{name.replace('_', '-')} must be at most {limit}, got {_shown_int(getattr(spec, name))}")
    if spec.num_heads % spec.num_kv_heads:
        raise bad(f"--num-heads {spec.num_heads} must be a multiple of --num-kv-heads {spec.num_kv_heads}")
    if spec.dtype not in MODEL_DTYPES:
        raise bad(f"--dtype must be one of {', '.join(MODEL_DTYPES)}, got {spec.dtype}")
    if spec.layout not in LAYOUTS:
        raise bad(f"--layout must be one of {', '.join(LAYOUTS)}, got {spec.layout}")
    if spec.sliding_window is not None and spec.sliding_window <= 0:
        raise bad(f"--window must be positive, got {spec.sliding_window}")
    if spec.sliding_window is not None and spec.sliding_window > MAX_ENGINE_INT:
        raise bad(f"--window must be at most 2**40 (the format's bound), got {_shown_int(spec.sliding_window)}")
    if spec.fp8_storage not in ("uint8", "float8_e4m3fn"):
        raise bad(f"--fp8-storage must be uint8 or float8_e4m3fn, got {spec.fp8_storage}")
    for name in ("q_scale", "k_scale", "v_scale"):
        value = getattr(spec, name)
        if not (math.isfinite(value) and value > 0):
            raise bad(f"--{name.replace('_', '-')} must be a finite positive number, got {value}")
    if spec.shared_prefix_pages < 0 or spec.stale_tail < 0:
        raise bad("--shared-prefix-pages and --stale-tail must be >= 0")
    if not 0 <= spec.seed <= MAX_SEED:
        raise bad(f"--seed must be from 0 to 2**63 - 1, got {_shown_int(spec.seed)}")
    # None is "auto"; 0 has no meaning (the format stores positive integers), so it is refused, not defaulted.
    for name, limit in (("num_gpu_blocks", MAX_GPU_BLOCKS), ("max_model_len", MAX_ENGINE_INT),
                        ("max_decode_query_len", MAX_ENGINE_INT)):
        value = getattr(spec, name)
        if value is not None and not 0 < value <= limit:
            raise bad(f"--{name.replace('_', '-')} must be a positive integer up to {limit} (or left out: "
                      f"automatic), got {_shown_int(value)}")
    if spec.shared_prefix_pages:
        for i, (length, q) in enumerate(zip(spec.seq_lens, qlens)):
            if length - q < spec.shared_prefix_pages * spec.page_size:
                raise bad(
                    f"request {i} (seq_len {length}, {q} query tokens) is too short to share "
                    f"{spec.shared_prefix_pages} full prefix pages of {spec.page_size} tokens"
                )
    if spec.page_zero_request is not None and not 0 <= spec.page_zero_request < len(spec.seq_lens):
        raise bad(f"--page-zero-request {spec.page_zero_request} is not a request index")
    if len(spec.seq_lens) > MAX_REQUESTS or max(spec.seq_lens) > MAX_TOKENS or spec.steps > MAX_STEPS:
        raise bad("synthetic snapshots are limited to 4096 requests, 4M tokens per request and 64 steps")
    pages = _stored_pages(spec)[0]
    if pages > MAX_PAGES:
        raise bad(f"synthetic snapshots are limited to {MAX_PAGES} pages; these options need {pages} (a larger "
                  "--page-size, fewer or shorter --seq-len, fewer --steps)")
    kv_bytes, step_bytes = synth_bytes(spec)
    if kv_bytes > MAX_KV_BYTES or step_bytes > MAX_STEP_BYTES:
        raise bad(f"synthetic snapshots are limited to {_size(MAX_KV_BYTES)} of KV cache and {_size(MAX_STEP_BYTES)} "
                  f"of step data; these options need {_size(kv_bytes)} and {_size(step_bytes)} (fewer or shorter "
                  "--seq-len, fewer heads, a smaller --head-size, --page-size, --stale-tail or --steps)")
    _check_features(spec, qlens)


def _shown_int(value: int) -> str:
    text = str(value)
    return text if len(text) <= 24 else f"{text[:20]}... ({len(text)} digits)"


def _size(nbytes: int) -> str:
    if nbytes < 2**30:
        return f"{nbytes / 2**20:.3g} MiB"
    return f"{nbytes / 2**30:.3g} GiB"


def _stored_pages(spec: SynthSpec) -> tuple[int, list[int]]:
    """(pages stored, pages of each request at its last step), as synth_snapshot counts them."""
    qlens = spec.query_lens or (spec.query_len,) * len(spec.seq_lens)
    grows = spec.attn_type != CROSS_ATTN_TYPE
    final_lens = [length + (spec.steps - 1) * q * grows for length, q in zip(spec.seq_lens, qlens)]
    pages_per_req = [_cdiv(n, spec.page_size) for n in final_lens]
    shared = spec.shared_prefix_pages
    return shared + sum(max(n - shared, 0) for n in pages_per_req), pages_per_req


def synth_bytes(spec: SynthSpec) -> tuple[int, int]:
    """Bytes of the KV cache and of all the steps' tensors ``spec`` makes, as stored; computed from the
    options alone (checked before anything is allocated). Call it on a spec whose counts are positive."""
    pages, pages_per_req = _stored_pages(spec)
    qlens = list(spec.query_lens or (spec.query_len,) * len(spec.seq_lens))
    model_bytes = 1 if spec.fp8 else torch_dtype(spec.dtype).itemsize
    kv_bytes = 2 * pages * spec.num_kv_heads * spec.page_size * spec.head_size * model_bytes
    tokens, requests = sum(qlens), len(qlens)
    table = requests * (max(pages_per_req) + spec.stale_tail) * 4 + (2 * requests + 1) * 4
    query = tokens * spec.num_heads * spec.head_size * model_bytes
    new_kv = (2 * tokens * spec.num_kv_heads * spec.head_size * torch_dtype(spec.dtype).itemsize + tokens * 8
              if spec.new_kv else 0)
    return kv_bytes, spec.steps * (table + query + new_kv)


def _check_features(spec: SynthSpec, qlens) -> None:
    for name, option in (("sinks", "--sinks"), ("alibi_slopes", "--alibi")):
        values = getattr(spec, name)
        if isinstance(values, str):
            if values != "auto":
                raise OptionError(f"{option} takes 'auto' or one number per query head, got {values!r}")
        elif values is not None:
            if len(values) != spec.num_heads:
                raise OptionError(f"{option} gives {len(values)} values for {spec.num_heads} query heads")
            if not all(math.isfinite(v) for v in values):
                raise OptionError(f"{option} values must be finite numbers")
    if spec.alibi_sqrt and spec.alibi_slopes is None:
        raise OptionError("--alibi-sqrt needs --alibi")
    if spec.logits_soft_cap is not None and not (math.isfinite(spec.logits_soft_cap) and spec.logits_soft_cap > 0):
        raise OptionError(f"--soft-cap must be a finite positive number, got {spec.logits_soft_cap}")
    if spec.attn_type not in ATTN_TYPES:
        raise OptionError(f"--attn-type must be one of {', '.join(ATTN_TYPES)}, got {spec.attn_type}")
    if spec.attn_type != "decoder":
        if spec.causal:
            raise OptionError(f"--attn-type {spec.attn_type} attends bidirectionally: give --mask dense")
        if spec.steps != 1:
            raise OptionError(f"--attn-type {spec.attn_type}: one step (--steps 1)")
    if spec.attn_type in ENCODER_SELF_ATTN_TYPES and list(spec.seq_lens) != list(qlens):
        raise OptionError(f"--attn-type {spec.attn_type} attends over the step's own tokens: every --seq-len "
                          "value must equal the request's query length")
    if spec.new_kv and (spec.attn_type == CROSS_ATTN_TYPE or spec.kv_sharing_target is not None):
        why = "a cross-attention decoder step" if spec.attn_type == CROSS_ATTN_TYPE else \
            "a layer that reads another layer's cache"
        raise OptionError(f"{why} writes no new K/V: give --no-new-kv")
    if spec.chunk_lookback is not None:
        if spec.chunk_lookback < 0:
            raise OptionError(f"--chunk-lookback must be >= 0, got {spec.chunk_lookback}")
        if spec.sliding_window is None or spec.sliding_window // (spec.chunk_lookback + 1) == 0:
            raise OptionError("--chunk-lookback needs --window of at least chunk_lookback + 1 tokens: the chunk "
                              "size is window // (chunk_lookback + 1)")


def _feature_fields(spec: SynthSpec) -> dict:
    fields = dict(logits_soft_cap=spec.logits_soft_cap, attn_type=spec.attn_type,
                  kv_sharing_target=spec.kv_sharing_target, chunk_lookback=spec.chunk_lookback)
    if spec.sinks is not None:
        fields["has_sinks"] = True
    if spec.alibi_slopes is not None:
        fields.update(has_alibi=True, alibi_sqrt=spec.alibi_sqrt)
    return fields


def alibi_slopes(num_heads: int) -> list[float]:
    """ALiBi's slopes for ``num_heads`` heads: a geometric series from 2**(-8/n) for the largest power of two
    ``n`` not above ``num_heads``; further heads take every other slope of the series for ``2n``."""
    def series(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    n = 1 << (num_heads.bit_length() - 1)
    return (series(n) + series(2 * n)[0::2])[:num_heads]


def _layer_values(spec: SynthSpec) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The sinks and ALiBi slopes tensors a spec asks for ("auto" sinks come from a generator of their own,
    so a spec without them keeps every other byte)."""
    sinks = spec.sinks
    if sinks == "auto":
        sinks = (torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(spec.seed + 1)) * 2).tolist()
    slopes = alibi_slopes(spec.num_heads) if spec.alibi_slopes == "auto" else spec.alibi_slopes
    return tuple(None if v is None else torch.tensor(list(v), dtype=torch.float32) for v in (sinks, slopes))

def synth_snapshot(spec: SynthSpec) -> Snapshot:
    """Build a snapshot from ``spec``. Only the referenced pages are generated and stored."""
    _check(spec)
    gen = torch.Generator().manual_seed(spec.seed)
    ps = spec.page_size
    qlens = list(spec.query_lens or (spec.query_len,) * len(spec.seq_lens))
    num_reqs = len(qlens)
    grows = spec.attn_type != CROSS_ATTN_TYPE
    final_lens = [length + (spec.steps - 1) * q * grows for length, q in zip(spec.seq_lens, qlens)]
    pages_per_req = [_cdiv(n, ps) for n in final_lens]
    shared = spec.shared_prefix_pages
    needed = shared + sum(n - shared for n in pages_per_req)
    num_gpu_blocks = spec.num_gpu_blocks
    if num_gpu_blocks is None:
        num_gpu_blocks = 2 * needed + 8 if spec.shuffle else needed + 1
    if num_gpu_blocks < needed + 1:
        raise OptionError(f"--num-gpu-blocks {num_gpu_blocks} is too small for the {needed} pages needed (+ null page 0)")

    # Engine ids: page 0 stays the null block unless a request is asked to use it.
    if spec.shuffle:
        pool = (torch.randperm(num_gpu_blocks - 1, generator=gen)[:needed] + 1).tolist()
    else:
        pool = list(range(1, needed + 1))
    shared_ids, pool = pool[:shared], pool[shared:]
    rows = []
    for n in pages_per_req:
        rows.append(shared_ids + pool[: n - shared])
        pool = pool[n - shared:]
    if spec.use_page_zero:
        req = spec.page_zero_request if spec.page_zero_request is not None else min(1, num_reqs - 1)
        rows[req][min(shared, len(rows[req]) - 1)] = 0
    width = max(pages_per_req) + spec.stale_tail
    used = sorted({i for row in rows for i in row})

    # Stored pages: every page any step reads or writes, in engine-id order.
    page_ids = torch.tensor(used, dtype=torch.int32)
    num_pages = len(used)
    hkv, d = spec.num_kv_heads, spec.head_size
    k_true = torch.randn(num_pages, hkv, ps, d, generator=gen)
    v_true = torch.randn(num_pages, hkv, ps, d, generator=gen)

    model_dtype = torch_dtype(spec.dtype)
    if spec.fp8:
        k_store = quantize_fp8(k_true, spec.k_scale)
        v_store = quantize_fp8(v_true, spec.v_scale)
    else:
        k_store, v_store = k_true.to(model_dtype), v_true.to(model_dtype)
    kv_cache = join_kv(k_store, v_store, spec.layout)
    if spec.fp8 and spec.fp8_storage == "uint8":
        kv_cache = kv_cache.view(torch.uint8)

    steps = []
    cross = spec.attn_type == CROSS_ATTN_TYPE
    for s in range(spec.steps):
        # A cross-attention step reads the encoder's keys: their number does not grow with the decoder's tokens.
        lens = [length + (0 if cross else s * q) for length, q in zip(spec.seq_lens, qlens)]
        table = torch.zeros(num_reqs, width, dtype=torch.int32)
        for r, row in enumerate(rows):
            live = _cdiv(lens[r], ps)
            table[r, :live] = torch.tensor(row[:live], dtype=torch.int32)
            tail = width - live
            if spec.stale_tail and tail > 0:
                stale = torch.randint(1, num_gpu_blocks, (tail,), generator=gen, dtype=torch.int32)
                table[r, live:] = stale
        qsl = torch.tensor([0] + list(_cumsum(qlens)), dtype=torch.int32)
        num_tokens = sum(qlens)
        query = torch.randn(num_tokens, spec.num_heads, d, generator=gen)
        query = quantize_fp8(query, spec.q_scale) if spec.fp8 else query.to(model_dtype)
        if spec.fp8 and spec.fp8_storage == "uint8":
            query = query.view(torch.uint8)
        step = Step(block_table=table, seq_lens=torch.tensor(lens, dtype=torch.int32), query_start_loc=qsl,
                    query=query)
        if spec.new_kv:
            slots = []
            for r, (length, q) in enumerate(zip(lens, qlens)):
                for pos in range(length - q, length):
                    slots.append(rows[r][pos // ps] * ps + pos % ps)
            step.key = torch.randn(num_tokens, hkv, d, generator=gen).to(model_dtype)
            step.value = torch.randn(num_tokens, hkv, d, generator=gen).to(model_dtype)
            step.slot_mapping = torch.tensor(slots, dtype=torch.int64)
        steps.append(step)

    layer = LayerMeta(
        name=spec.layer_name,
        num_heads=spec.num_heads,
        num_kv_heads=hkv,
        head_size=d,
        scale=1.0 / math.sqrt(d),
        causal=spec.causal,
        sliding_window=spec.sliding_window,
        dtype=spec.dtype,
        kv_cache_dtype="fp8_e4m3" if spec.fp8 else "auto",
        q_scale=spec.q_scale,
        k_scale=spec.k_scale,
        v_scale=spec.v_scale,
        **{**_feature_fields(spec), **spec.extra_layer},
    )
    backend_name = canonical_backend_name(spec.backend) if spec.backend else \
        ("FLASHINFER_TS" if spec.layout == LAYOUT_VLLM else "FLEX_ATTENTION")
    max_model_len = spec.max_model_len
    if max_model_len is None:
        max_model_len = max(32768, 1 << (max(final_lens) - 1).bit_length())
    backend = BackendMeta(
        name=backend_name,
        page_size=ps,
        max_model_len=max_model_len,
        num_gpu_blocks=num_gpu_blocks,
        max_decode_query_len=(spec.max_decode_query_len if spec.max_decode_query_len is not None
                              else max(max(qlens), 1)),
    )
    # Feature fields at their defaults are left out, so specs without them keep their bytes.
    defaults = SynthSpec()
    spec_record = {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()
                   if k not in _FEATURE_FIELDS or v != getattr(defaults, k)}
    meta = SnapshotMeta(
        layer=layer,
        backend=backend,
        kv_layout=spec.layout,
        num_steps=spec.steps,
        capture={"engine": "kvdbg synth", "kvdbg": __version__, "synth": spec_record},
        notes=spec.notes,
    )
    sinks, slopes = _layer_values(spec)
    snap = Snapshot(meta=meta, kv_cache=kv_cache, page_ids=page_ids, steps=steps, sinks=sinks, alibi_slopes=slopes)
    validate(snap)
    if spec.engine_output:
        _attach_engine_output(snap, spec.engine_output)
    return snap


def _attach_engine_output(snap: Snapshot, backend: str) -> None:
    """Replay every step through ``backend`` on CPU and store its output as the engine's."""
    from kvdbg.replayer.runner import replay

    result = replay(snap, [backend], required=[backend])
    for step, replayed in zip(snap.steps, result.steps):
        run = replayed.runs[backend]
        if run.output is None:
            raise OptionError(f"--engine-output {backend}: the backend produced no output ({run.error})")
        step.output = run.output.to(torch_dtype(snap.meta.layer.dtype))


def _cumsum(values):
    total = 0
    for v in values:
        total += v
        yield total


__all__ = ["SynthSpec", "alibi_slopes", "synth_bytes", "synth_snapshot", "LAYOUT_KV_PLANES", "LAYOUT_VLLM"]
