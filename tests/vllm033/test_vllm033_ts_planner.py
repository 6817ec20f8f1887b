"""kvdbg's reading of prims_ts's decode planner (kvdbg.ts.planner) against flashinfer-python 0.7.4's own planner.

``make_decode_config`` is pure Python over CuTe DSL types; it asks the device only for its SM count, which these
tests pin to a B200's (flashinfer's own fallback) so that the plans are the ones a B200 makes.
"""

from __future__ import annotations

import random

import cutlass  # flashinfer-python 0.7.4 requires nvidia-cutlass-dsl: the stage installs both, so no skip
import flashinfer.attention.prims_ts.kernels.fmha_decode.fmha_decode_config as config
import pytest

from kvdbg.ts import planner as ts_planner


class _B200:
    def get_device_multiprocessor_count(self):
        return ts_planner.B200_SMS

    def get_max_active_clusters(self, cluster_size):
        return max(ts_planner.B200_SMS // max(cluster_size, 1), 1)


@pytest.fixture
def planner(monkeypatch):
    monkeypatch.setattr(config.utils, "HardwareInfo", _B200)
    arch = config.arch_config_args((10, 0))

    def plan(head_dim, query_len, group, num_kv_heads, batch, max_kv_len, window_left, page_size=16):
        fp8 = cutlass.Float8E4M3FN
        return config.make_decode_config(
            headdim=head_dim, args=(arch, {}), seq_len_q=query_len, seq_len_kv=max_kv_len, batch_size=batch,
            num_heads_q=group * num_kv_heads, num_heads_kv=num_kv_heads, q_dtype=fp8, k_dtype=fp8, v_dtype=fp8,
            o_dtype=cutlass.Float16, qkv_layout="pagedKv", num_tokens_per_page=page_size,
            storage_tokens_per_page=page_size, mask_type="causal" if window_left >= 0 else "dense",
            sliding_window_causal=window_left >= 0, attention_window_size=window_left + 1 if window_left >= 0 else 0,
            auto_tuner=True, split_kv=True)
    return plan


def _shapes(count, seed):
    rnd = random.Random(seed)
    for _ in range(count):
        query_len = rnd.choice((1, 1, 2, 3, 4, 6, 7, 8, 12, 16, 32))
        max_kv_len = rnd.choice((64, 128, 300, 2048, 4096, 10000, 32768, 131072, 1 << 20))
        if query_len > max_kv_len:
            continue
        yield dict(head_dim=rnd.choice((64, 128, 192, 256)), query_len=query_len,
                   group=rnd.choice((1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 20, 24, 32, 33, 40, 48, 63, 64, 65, 96, 128)),
                   num_kv_heads=rnd.choice((1, 2, 4, 8, 16)), batch=rnd.choice((1, 2, 5, 8, 16, 37, 64, 100, 256, 1024)),
                   max_kv_len=max_kv_len, window_left=rnd.choice((-1, -1, 127, 1023, 8191)),
                   page_size=rnd.choice((4, 16, 64, 128)))


def test_the_fp8_profile_is_flashinfers_choice(planner):
    checked = 0
    for shape in _shapes(1500, seed=23):
        cfg = planner(**shape)
        ours = ts_planner.fp8_decode_profile(
            head_dim=shape["head_dim"], query_len=shape["query_len"], heads_per_kv=shape["group"],
            batch_size=shape["batch"], num_kv_heads=shape["num_kv_heads"], max_kv_len=shape["max_kv_len"],
            window_left=shape["window_left"])
        theirs_tokens = cfg.q_tokens_per_cta if cfg.groups_tokens_heads_q else 1
        assert (ours.keeps, ours.kv_instances) == (cfg.use_keeps_mma_ab, cfg.num_insts_kv), shape
        if ours.tile_q is not None:
            assert ours.tile_q == cfg.tile_size_q, shape
        if shape["query_len"] > 1 and shape["window_left"] >= 0:  # where the window's first tile depends on it
            assert ours.q_tokens_per_cta == theirs_tokens, shape
        assert cfg.tile_size_kv == ts_planner.KV_TILE
        checked += 1
    assert checked > 1000
