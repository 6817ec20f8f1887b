"""kvdbg.ts.planner: which profile prims_ts's planner picks for an FP8 plan, on shapes worked through by hand.

The vLLM 0.33 stage (tests/vllm033/test_vllm033_ts_planner.py) holds the same function to flashinfer 0.7.4's own
planner on a grid of shapes; these cases say why each answer is what it is.
"""

from __future__ import annotations

import pytest

from kvdbg.ts.planner import fp8_decode_profile, window_first_tiles


def profile(head_dim, query_len, group, *, batch=8, kv_heads=8, max_kv_len=32768, window_left=-1):
    return fp8_decode_profile(head_dim=head_dim, query_len=query_len, heads_per_kv=group, batch_size=batch,
                              num_kv_heads=kv_heads, max_kv_len=max_kv_len, window_left=window_left)


@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_one_token_and_a_narrow_group_is_swaps_with_two_instances(head_dim):
    p = profile(head_dim, 1, 8)
    assert (p.keeps, p.kv_instances) == (False, 2)


@pytest.mark.parametrize("head_dim, instances", [(64, 2), (128, 2), (192, 1), (256, 1)])
def test_a_group_of_64_is_keeps_and_only_wide_heads_lose_the_second_instance(head_dim, instances):
    p = profile(head_dim, 1, 64)
    assert (p.keeps, p.tile_q, p.kv_instances) == (True, 64, instances)


def test_a_partial_wide_group_needs_grouped_keeps():
    assert profile(256, 1, 40).keeps and profile(256, 1, 40).q_tokens_per_cta == 1  # 40 heads in a Q64 tile
    # head_dim 256 with a window: grouped Keeps is not qualified, only an exact group of 64 or 128 keeps Keeps.
    assert not profile(256, 1, 40, window_left=1023).keeps
    assert profile(256, 1, 64, window_left=1023).keeps
    assert not profile(64, 1, 40).keeps  # head_dim 64 never groups Keeps


def test_multi_token_blocks_follow_the_cost_model():
    # 8 tokens x 8 heads = 64 rows: one Q64 Keeps CTA per KV head beats eight Swaps Q8 CTAs re-reading the keys.
    keeps = profile(256, 8, 8, batch=64, kv_heads=4)
    assert (keeps.keeps, keeps.tile_q, keeps.q_tokens_per_cta, keeps.kv_instances) == (True, 64, 8, 1)
    # 4 tokens x 8 heads on a short cache with one request: Swaps tiles that split the keys win.
    swaps = profile(256, 4, 8, batch=1, kv_heads=8, max_kv_len=1024)
    assert (swaps.keeps, swaps.kv_instances) == (False, 2)
    # A window makes a multi-token Keeps tile unqualified at head_dim 256.
    assert not profile(256, 8, 8, batch=64, kv_heads=4, window_left=4095).keeps


def test_the_first_tile_of_each_token_follows_its_cta():
    # L = 1000, 4 query tokens, window_left 300: token i's CTA starts at its first token's window.
    assert window_first_tiles(seq_len=1000, query_len=4, window_left=300, q_tokens_per_cta=1) == [5, 5, 5, 5]
    assert window_first_tiles(seq_len=1000, query_len=4, window_left=260, q_tokens_per_cta=1) == [5, 5, 5, 5]
    assert window_first_tiles(seq_len=1030, query_len=4, window_left=260, q_tokens_per_cta=2) == [5, 5, 6, 6]
    assert window_first_tiles(seq_len=1030, query_len=4, window_left=-1, q_tokens_per_cta=2) == [0, 0, 0, 0]


def test_the_profile_says_what_it_is():
    text = profile(256, 1, 64).describe()
    assert "Keeps Q64 profile, one K/V instance" in text and "head ratio of 64" in text
