"""The feature matrix of `kvdbg conform`: which features, which levels, and the synthetic step of each cell.

Every feature here is one the snapshot format models and kvdbg's reference
computes exactly (docs/snapshot-format.md); the backend decides which of them
it takes (the conform runner asks it, level by level). A *cell* is a
combination (one level per factor) in one batch kind:

- ``decode``: every request has one query token;
- ``prefill``: every request prefills a chunk: three whole prompts, and one
  chunk continuing a request whose earlier tokens are cached;
- ``mixed``: decode requests and prefill chunks in one batch.

Sizes straddle the page and the window: with page size P and window W, the
lengths are P - 1, P + 1, W + 1 (or 2P), and one long request reaching W + P +
its query block past the start, so that its first page lies wholly before
every query token's window (where vLLM puts the null block). Windows are never
page-aligned: ``short`` is P/2 + 3 tokens (inside one page), ``long`` 2P + 5.
The soft cap is 2.0, so that it changes logits of unit scale by tens of
percent: a backend that ignored it could not pass.

``chunk_lookback`` is TRITON_ATTN's chunked attention (chunks of W // 2
tokens, a query seeing its own chunk and the one before), so it needs a
window, as the null block does.

Page placement (``pages``): ``fresh`` scattered engine ids; ``prefix``
a first page shared by every request (prefix caching; every length grows by
P, and a prefill chunk starts after it); ``stale`` two block-table
columns of recycled, non-zero ids past each request's live pages;
``null_block`` engine page 0 (vLLM's null block) in the long request's first
table entry, before its window, as vLLM's sliding-window manager leaves it (so
only with a window).

FP8 cells store the step's new K/V in the cache pages rather than writing them
during the step: vLLM 0.32's CPU_ATTN writes FP8 rounding toward zero where
kvdbg's replay rounds to nearest (tests/engine/test_vllm_column.py pins it), a
difference of the cache write, not of attention.
"""

from __future__ import annotations

import zlib
from typing import Mapping

from kvdbg.moves.conform.covering import Factor

FACTORS = (
    Factor("window", ("none", "short", "long")),
    Factor("chunk_lookback", ("off", "on")),
    Factor("sinks", ("off", "on")),
    Factor("soft_cap", ("off", "on")),
    Factor("alibi", ("off", "on", "sqrt")),
    Factor("gqa", ("1", "4")),
    Factor("head_size", ("64", "128")),
    Factor("page_size", ("32", "16", "64")),
    Factor("kv_cache", ("auto", "fp8")),
    Factor("dtype", ("bfloat16", "float16", "float32")),
    Factor("mask", ("causal", "dense")),
    Factor("pages", ("fresh", "prefix", "stale", "null_block")),
)
FACTOR_NAMES = tuple(f.name for f in FACTORS)
KINDS = ("decode", "prefill", "mixed")
SOFT_CAP = 2.0
NUM_KV_HEADS = 2
FP8_SCALES = (0.05, 0.03, 0.04)  # q, k, v: `kvdbg synth --fp8`'s defaults
STALE_TAIL = 2
CHUNK_LOOKBACK = 1  # TRITON_ATTN's chunked attention: chunks of window // 2, a query sees its own and the one before
NUM_GPU_BLOCKS = 256  # every cell's engine cache: fixed, so the kinds of one combination share one backend


# Levels that need a window: the null block sits before one; chunked attention cuts one into chunks.
NEEDS_WINDOW = (("pages", "null_block"), ("chunk_lookback", "on"))


def allowed(row: Mapping[str, str]) -> bool:
    """The constraint: a level of NEEDS_WINDOW only with a window."""
    return row.get("window", "none") != "none" or not any(row.get(name) == level for name, level in NEEDS_WINDOW)


def completed(row: Mapping[str, str]) -> dict[str, str]:
    """``row`` made allowed with the least added: the short window for a level that needs one."""
    row = dict(row)
    if not allowed(row):
        row["window"] = "short"
    return row


def factors_named(names) -> tuple[Factor, ...]:
    """The factors ``names`` gives, in the matrix's order; the others stay at their baselines."""
    from kvdbg.errors import OptionError

    wanted = [n.strip().replace("-", "_") for n in names if n.strip()]
    unknown = [n for n in wanted if n not in FACTOR_NAMES]
    if unknown:
        raise OptionError(f"--features: unknown feature {unknown[0]!r} (choose from: "
                          f"{', '.join(n.replace('_', '-') for n in FACTOR_NAMES)})")
    if not wanted:
        raise OptionError("--features: give at least one feature")
    return tuple(f for f in FACTORS if f.name in wanted)


def full_row(row: Mapping[str, str]) -> dict[str, str]:
    """``row`` with every factor it leaves out at its baseline, in the matrix's order."""
    return {f.name: row.get(f.name, f.baseline) for f in FACTORS}


def label(row: Mapping[str, str]) -> str:
    """The features a row turns on, e.g. ``window=short sinks page_size=64 fp8``; ``baseline`` for none."""
    parts = []
    for f in FACTORS:
        level = row.get(f.name, f.baseline)
        if level == f.baseline:
            continue
        if f.levels == ("off", "on") and level == "on":
            parts.append(f.name)
        elif f.name == "kv_cache":
            parts.append(level)
        else:
            parts.append(f"{f.name}={level}")
    return " ".join(parts) or "baseline"


def window_tokens(level: str, page_size: int) -> int | None:
    return {"none": None, "short": page_size // 2 + 3, "long": 2 * page_size + 5}[level]


def batch_shape(kind: str, page_size: int, window: int | None, pages: str) -> tuple[list[int], list[int], int]:
    """(seq_lens, query_lens, the long request's index) of a batch kind; see the module doc."""
    p = page_size
    long_q = {"decode": 1, "prefill": p + 1, "mixed": 3}[kind]
    long_len = max(3 * p + 2, (window or 0) + p + long_q + 1)
    third = window + 1 if window else 2 * p
    if kind == "decode":
        shape = [(p - 1, 1), (p + 1, 1), (third, 1), (long_len, 1)]
    elif kind == "prefill":
        shape = [(p - 1, p - 1), (p + 1, p + 1), (third, third), (long_len, long_q)]
    elif kind == "mixed":
        shape = [(p + 1, 1), (p - 1, p - 1), (third, third), (long_len, long_q)]
    else:
        raise ValueError(f"unknown batch kind {kind!r}")
    offset = p if pages == "prefix" else 0  # the shared page comes before every request's own tokens
    return [length + offset for length, _ in shape], [q for _, q in shape], 3


def seed_of(row: Mapping[str, str], kind: str, base: int) -> int:
    """A seed from the cell itself, so that a cell draws the same data whichever run or row order reaches it."""
    return (base * 1_000_003 + zlib.crc32(f"{label(row)}|{kind}".encode())) % (2**63 - 1)


def spec_for(backend: str, row: Mapping[str, str], kind: str, base_seed: int = 0):
    """The SynthSpec of one cell: ``row``'s features (the rest at baseline) in batch kind ``kind``."""
    from kvdbg.moves.synth import SynthSpec

    row = full_row(row)
    page_size = int(row["page_size"])
    window = window_tokens(row["window"], page_size)
    seq_lens, query_lens, long_request = batch_shape(kind, page_size, window, row["pages"])
    fp8 = row["kv_cache"] == "fp8"
    q_scale, k_scale, v_scale = FP8_SCALES if fp8 else (1.0, 1.0, 1.0)
    return SynthSpec(
        seq_lens=tuple(seq_lens), query_lens=tuple(query_lens), num_heads=NUM_KV_HEADS * int(row["gqa"]),
        num_kv_heads=NUM_KV_HEADS, head_size=int(row["head_size"]), page_size=page_size, sliding_window=window,
        causal=row["mask"] == "causal", dtype=row["dtype"], fp8=fp8, q_scale=q_scale, k_scale=k_scale,
        v_scale=v_scale, shared_prefix_pages=1 if row["pages"] == "prefix" else 0,
        use_page_zero=row["pages"] == "null_block", page_zero_request=long_request,
        stale_tail=STALE_TAIL if row["pages"] == "stale" else 0, new_kv=not fp8,
        seed=seed_of(row, kind, base_seed), num_gpu_blocks=NUM_GPU_BLOCKS, max_decode_query_len=1,
        backend=backend, sinks="auto" if row["sinks"] == "on" else None,
        alibi_slopes="auto" if row["alibi"] != "off" else None, alibi_sqrt=row["alibi"] == "sqrt",
        logits_soft_cap=SOFT_CAP if row["soft_cap"] == "on" else None,
        chunk_lookback=CHUNK_LOOKBACK if row["chunk_lookback"] == "on" else None,
        notes=f"kvdbg conform cell: {backend} {label(row)} ({kind})")


__all__ = ["FACTORS", "FACTOR_NAMES", "KINDS", "allowed", "batch_shape", "completed", "factors_named", "full_row",
           "label",
           "seed_of", "spec_for", "window_tokens"]
