"""The MMA profile prims_ts's decode planner picks for an FP8 step, as far as it decides how P is rounded (no torch).

FlashInfer's FP8 decode kernel rounds the unnormalised probabilities to e4m3
against a running maximum. How many running maxima there are depends on the
profile the planner chose for the launch:

- a *Swaps* profile (SwapsMmaAb, Q tiles of 8/16/32 rows) and every profile at
  head_dim 64 or 128 stream the 128-key tiles through two K/V instances, dealt
  in turn, each with its own running max, merged at the end;
- a *Keeps* profile (KeepsMmaAb, Q tiles of 64/128 rows) at head_dim 192 or 256
  has one K/V instance: every tile goes through one running max.

This module says which one the planner picks, as flashinfer-python 0.7.4's
``make_decode_config`` decides it (read from
``attention/prims_ts/kernels/fmha_decode/fmha_decode_config.py``; kvdbg's own
code, checked against that planner on a grid of shapes by the vLLM 0.33 stage,
tests/vllm033). For FLASHINFER_TS's FP8 plans (Q, K and V e4m3, a 16-bit
output, fixed query blocks, paged K/V):

1. A head ratio Hq/Hkv above 32 and at most 128 takes a Keeps tile (Q64 up to 64
   heads, else Q128) grouping whole query tokens -- unless grouped Keeps is not
   qualified for the layer, when only an exact 64- or 128-head group does,
   ungrouped (one token per CTA).
2. Otherwise a one-token query (and any ratio above 128) takes Swaps.
3. A multi-token query block is scored per candidate Q tile (Swaps 8/16/32,
   Keeps 64/128 when qualified; a tile must hold a whole head group): its CTAs
   ``batch * Hkv * ceil(q / tokens_per_tile)``, each with its split counts
   (1 up to the first that fills the GPU, at most one split per 512 keys for two
   instances, 256 for one; no split under a window), cost
   ``(mainloop[tile] * keys_per_split + reduction[tile] * 128 * splits) * waves``;
   the cheapest wins (ties: fewer waves, fewer splits, the wider tile), among
   direct launches only when every candidate's grid already fills the GPU.

Grouped Keeps is qualified at head_dim 192; at 256 without a sliding window; at
128 without a window and for multi-token queries; never at 64. The GPU's
size enters through its SM count: a B200's 148, flashinfer's own fallback,
unless the caller knows the GPU the step is meant for.
"""

from __future__ import annotations

from dataclasses import dataclass

# A B200's streaming multiprocessors: what flashinfer's planner assumes when it cannot ask the device.
B200_SMS = 148
# The grouped-Q selector's relative cost per Q tile for 8-bit K/V: per key of the main loop, and per split of
# the reduction (in units of 128 keys).
MAINLOOP_COST = {8: 1.0, 16: 1.2, 32: 1.48, 64: 1.68, 128: 2.2}
REDUCTION_COST = {8: 1.0, 16: 1.03, 32: 1.08, 64: 1.2, 128: 1.32}
KV_TILE = 128  # keys per tile of the FP8 kernels
MIN_TILES_PER_SPLIT = 2  # a split keeps at least this many loop iterations (of one tile per instance)


@dataclass(frozen=True)
class DecodeProfile:
    """The planner's choice for one plan, as it matters to FP8 P rounding."""

    keeps: bool  # KeepsMmaAb; else SwapsMmaAb
    tile_q: int | None  # query rows of one CTA (None: a Swaps tile this module does not pin down)
    q_tokens_per_cta: int  # query tokens one CTA holds: its rows share where the window's first tile is
    kv_instances: int  # K/V instances, each with its own running max: 1 or 2
    why: str  # the rule that decided, in words

    def describe(self) -> str:
        kind = ("Keeps" if self.keeps else "Swaps") + ("" if self.tile_q is None else f" Q{self.tile_q}")
        streams = "one K/V instance (one running max)" if self.kv_instances == 1 else \
            "two K/V instances (each tile to the next, each with its own running max)"
        return f"{kind} profile, {streams}: {self.why}"


def fp8_decode_profile(*, head_dim: int, query_len: int, heads_per_kv: int, batch_size: int, num_kv_heads: int,
                       max_kv_len: int, window_left: int, sm_count: int = B200_SMS) -> DecodeProfile:
    """The profile prims_ts's planner picks for an FP8 decode plan with these arguments (see the module doc)."""
    windowed = window_left >= 0
    grouped_keeps = head_dim == 192 or (head_dim == 256 and not windowed) or \
        (head_dim == 128 and not windowed and query_len > 1)

    def profile(keeps: bool, tile_q: int | None, tokens: int, why: str) -> DecodeProfile:
        return DecodeProfile(keeps, tile_q, max(tokens, 1), 1 if keeps and head_dim > 128 else 2, why)

    def without_cost_model(why_swaps: str) -> DecodeProfile:
        if 32 < heads_per_kv <= 128:
            tile = 64 if heads_per_kv <= 64 else 128
            if grouped_keeps:
                return profile(True, tile, tile // heads_per_kv,
                               f"a head ratio of {heads_per_kv} (above 32) takes a grouped Keeps tile")
            if heads_per_kv == tile:
                return profile(True, tile, 1, f"a head ratio of exactly {tile} takes an ungrouped Keeps tile "
                                              "(grouped Keeps is not qualified here)")
        return profile(False, None, 1, why_swaps)

    if query_len <= 1:
        return without_cost_model(f"a one-token query with a head ratio of {heads_per_kv} takes Swaps")
    if heads_per_kv > 128:
        return without_cost_model(f"a head ratio of {heads_per_kv} (above 128) takes ungrouped Swaps head bands")
    candidates = [(keeps, tile) for keeps, tile in ((False, 8), (False, 16), (False, 32), (True, 64), (True, 128))
                  if tile >= heads_per_kv and (grouped_keeps or not keeps)]
    if not candidates:
        return without_cost_model(f"no grouped Q tile holds {heads_per_kv} heads")
    keys = min(max_kv_len, window_left + query_len) if windowed else max_kv_len
    scored = []
    for keeps, tile in candidates:
        tokens = tile // heads_per_kv
        base = batch_size * num_kv_heads * -(-query_len // tokens)
        instances = 1 if keeps and head_dim > 128 else 2
        for splits in _split_candidates(keys, base, instances, sm_count, allowed=not windowed):
            waves = -(-base * splits // sm_count)
            per_split = -(-(-(-keys // KV_TILE)) // splits) * KV_TILE
            cost = (MAINLOOP_COST[tile] * per_split + REDUCTION_COST[tile] * KV_TILE * splits) * waves
            scored.append(((cost, waves, splits, -tile), keeps, tile, tokens, base))
    if not any(base < sm_count for *_, base in scored):
        scored = [s for s in scored if s[0][2] == 1] or scored
    _, keeps, tile, tokens, _ = min(scored, key=lambda s: s[0])
    return profile(keeps, tile, tokens, f"the planner's cost model picks Q{tile} for {query_len} query tokens, "
                                        f"{batch_size} requests and {heads_per_kv} heads per KV head")


def _split_candidates(keys: int, base_ctas: int, instances: int, sm_count: int, *, allowed: bool) -> range:
    """Split counts the selector scores for one Q tile: 1, up to the first that fills the GPU, within the keys."""
    by_work = max(1, -(-keys // (KV_TILE * instances * MIN_TILES_PER_SPLIT)))
    if not allowed or base_ctas >= sm_count or by_work <= 1:
        return range(1, 2)
    return range(1, min(by_work, max(-(-sm_count // base_ctas), 2)) + 1)


def window_first_tiles(*, seq_len: int, query_len: int, window_left: int, q_tokens_per_cta: int) -> list[int]:
    """Per query token, the first KV tile its CTA computes: the kernel skips whole tiles before the window of
    the CTA's first token, and deals tiles to the K/V instances from there."""
    if window_left < 0:
        return [0] * query_len
    first = []
    for i in range(query_len):
        base = (i // q_tokens_per_cta) * q_tokens_per_cta
        first.append(max(0, seq_len - query_len + base - window_left) // KV_TILE)
    return first
