"""Differential check of the ``vllm`` column (the installed vLLM's own code for the snapshot's backend).

Runs where vLLM is installed (the engine stage's venv), on random batches that
cover GQA ratios, page sizes, causal and dense masks, sliding windows, stale
table tails, prefix sharing, a live page 0, a page aliased at two logical
blocks and several steps:

- FLEX_ATTENTION batches: kvdbg's ``flex`` (its re-implementation) against
  ``vllm`` (vLLM's FLEX_ATTENTION). Every pair must agree within the dtype's
  tolerance; the summary also counts the batches that are bit-equal (both run
  torch's eager flex_attention on CPU over the same values, but over caches of
  different sizes and layouts, so the last bit may move).
- CPU_ATTN batches: ``vllm`` (vLLM's CPU_ATTN C++ kernel, fed the pages in its
  own K-transposed layout, and its own cache write of the new K/V) against
  kvdbg's exact reference, with the comparison replay itself makes (FP8
  caches included). kvdbg has no re-implementation of CPU_ATTN; this holds the
  column, and the reference's masks, to the engine's kernel.

    python -m tests.engine.vllm_differential --count 200 --cpu-attn-count 100 --seed 0 --jobs 2

Exit 0 when every batch agrees, 1 otherwise (each difference printed with its spec).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from kvdbg.backends.base import ReplayOptions
from kvdbg.errors import BackendUnavailable
from kvdbg.judge.compare import compare, compare_step, default_tolerance
from kvdbg.replayer.runner import replay
from kvdbg.moves.synth import SynthSpec, synth_snapshot


# vLLM's refusal of an FP8 cache in CPU_ATTN on a CPU without AVX-512 or AMX (an AMD CPU without AVX-512, for one),
# as it words it (vllm/v1/attention/backends/cpu_attn.py, _get_attn_isa).
VLLM_CPU_FP8_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def vllm_cpu_fp8() -> bool:
    """Whether vLLM's CPU_ATTN takes an FP8 cache on this CPU: it asks torch for AVX-512 or AMX, as here."""
    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def random_spec(rng: random.Random, index: int, backend: str = "FLEX_ATTENTION") -> tuple[SynthSpec, str | None]:
    """A random batch, and the table edit to apply after synthesis (None, "alias").

    CPU_ATTN batches keep to what vLLM's CPU_ATTN accepts: blocks of a multiple of 32 tokens, its head
    sizes, and FP8 caches (with a 16- or 32-bit model dtype) now and then.
    """
    cpu_attn = backend == "CPU_ATTN"
    page_size = rng.choice([32, 64] if cpu_attn else [16, 32, 64])
    num_kv_heads = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 4, 8])
    num_reqs = rng.randint(1, 5)
    causal = rng.random() < 0.6
    ragged = rng.random() < 0.3
    query_len = rng.choice([1, 1, 2, 4, 8])
    query_lens = tuple(rng.randint(1, 12) for _ in range(num_reqs)) if ragged else None
    qmax = max(query_lens) if query_lens else query_len
    seq_lens = tuple(rng.randint(qmax, 6 * page_size + 40) for _ in range(num_reqs))
    window = rng.choice([None, None, rng.randint(1, 3 * page_size)])
    shared = 0
    if rng.random() < 0.25 and min(seq_lens) - qmax >= page_size:
        shared = rng.randint(1, max(1, (min(seq_lens) - qmax) // page_size))
    dtype = rng.choice(["bfloat16", "float16", "float32"])
    fp8 = cpu_attn and dtype != "float32" and rng.random() < 0.25
    spec = SynthSpec(
        seq_lens=seq_lens, query_len=query_len, query_lens=query_lens, num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads, head_size=rng.choice([32, 64, 128] if cpu_attn else [16, 32, 64]),
        page_size=page_size, sliding_window=window, causal=causal, dtype=dtype, fp8=fp8,
        shuffle=rng.random() < 0.7, shared_prefix_pages=shared, use_page_zero=rng.random() < 0.2,
        page_zero_request=rng.randrange(num_reqs), stale_tail=rng.choice([0, 0, 2]),
        steps=rng.choice([1, 1, 1, 2, 3]), seed=index, backend=backend,
        # vLLM 0.32's CPU_ATTN writes new K/V into an FP8 cache rounding toward zero, where kvdbg's replay
        # (and the reference) round to nearest: FP8 batches keep their new K/V in the stored pages, so both
        # sides read the same bytes (tests/engine/test_vllm_column.py pins the write itself).
        new_kv=not fp8,
    )
    return spec, ("alias" if rng.random() < 0.15 else None)


def alias_a_page(snap, rng: random.Random) -> None:
    """Put one live page of a request at a second logical block of the same request (vLLM's block reuse)."""
    step = snap.steps[0]
    ps = snap.page_size
    for r in rng.sample(range(step.num_reqs), step.num_reqs):
        live = -(-int(step.seq_lens[r]) // ps)
        if live >= 2:
            a, b = rng.sample(range(live), 2)
            for s in snap.steps:
                s.block_table[r, a] = s.block_table[r, b]
            return


def check(index: int, rng: random.Random, backend: str = "FLEX_ATTENTION") -> dict:
    spec, edit = random_spec(rng, index, backend)
    snap = synth_snapshot(spec)
    if edit == "alias":
        alias_a_page(snap, rng)
    record = {"index": index, "backend": backend,
              "spec": {k: v for k, v in vars(spec).items() if v not in (None, 0, False, ())}, "edit": edit,
              "steps": []}
    if backend == "CPU_ATTN":
        return check_against_reference(snap, record)
    result = replay(snap, ["reference", "flex", "vllm"], ReplayOptions(), required=["vllm"])
    for step in result.steps:
        ours, theirs = step.runs["flex"].output, step.runs["vllm"].output
        tol = default_tolerance(snap.meta.layer.dtype)
        comp = compare(ours, theirs, step.common.query_start_loc, step.common.seq_lens, tol,
                       actual_name="flex", expected_name="vllm", step=step.step)
        same_nan = torch.equal(ours.isnan(), theirs.isnan())
        bit_equal = same_nan and torch.equal(torch.nan_to_num(ours), torch.nan_to_num(theirs))
        # Both NaN in the same places (a row that sees no key) is agreement, not a difference.
        agree = bit_equal or (same_nan and bool(torch.allclose(torch.nan_to_num(ours.float()),
                                                               torch.nan_to_num(theirs.float()),
                                                               atol=tol.atol, rtol=tol.rtol)))
        record["steps"].append({"step": step.step, "bit_equal": bit_equal, "agree": agree,
                                "max_abs": comp.max_abs, "failed_heads": len(comp.failed)})
    return record


def check_against_reference(snap, record: dict) -> dict:
    """vLLM's own CPU_ATTN (the ``vllm`` column) against kvdbg's reference, as replay compares them. An FP8 batch
    on a CPU where vLLM refuses FP8 caches is recorded as refused, with vLLM's words (drawn all the same, so that
    every batch after it is the one any other machine draws); any other refusal is raised."""
    try:
        result = replay(snap, ["reference", "vllm"], ReplayOptions(), required=["vllm"])
    except BackendUnavailable as exc:
        if snap.meta.layer.is_fp8 and not vllm_cpu_fp8() and VLLM_CPU_FP8_REFUSAL in str(exc):
            record["refused"] = str(exc)
            return record
        raise
    record["kernel"] = next(st.info.kernel for st in result.backends if st.name == "vllm")
    for step in result.steps:
        comp = next(c for c in compare_step(step, snap.meta) if c.actual == "vllm" and c.expected == "reference")
        record["steps"].append({"step": step.step, "bit_equal": False, "agree": comp.passed,
                                "max_abs": comp.max_abs, "failed_heads": len(comp.failed)})
    return record


def _check_seeded(job: tuple[int, int, str]) -> dict:
    index, seed, backend = job
    return check(index, random.Random(seed), backend)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=200, help="FLEX_ATTENTION batches (flex vs vllm)")
    parser.add_argument("--cpu-attn-count", type=int, default=100, help="CPU_ATTN batches (vllm vs reference)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (each one thread)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    # Batch i draws from its own generator, so a batch is the same whatever the number of workers.
    seeds = [(i, args.seed * 1_000_003 + i, "FLEX_ATTENTION") for i in range(args.count)]
    seeds += [(i, args.seed * 1_000_003 + 500_000 + i, "CPU_ATTN") for i in range(args.cpu_attn_count)]
    if args.jobs > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork"),
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:
            records = list(pool.map(_check_seeded, seeds))
    else:
        records = [_check_seeded(s) for s in seeds]
    bad = [r for r in records if not all(s["agree"] for s in r["steps"])]
    for r in bad:
        print("DIFFERENCE", json.dumps(r, default=str), file=sys.stderr)
    for backend, what in (("FLEX_ATTENTION", "flex vs vllm"), ("CPU_ATTN", "vllm vs reference")):
        mine = [r for r in records if r["backend"] == backend]
        steps = [s for r in mine for s in r["steps"]]
        kernels = sorted({r["kernel"] for r in mine if "kernel" in r})
        refused = sum("refused" in r for r in mine)
        print(f"vllm differential, {backend} ({what}): {len(mine)} random batches ({len(steps)} steps), "
              f"{sum(s['bit_equal'] for s in steps)} steps bit-equal, {sum(s['agree'] for s in steps)} within "
              f"tolerance, {sum(r in bad for r in mine)} batches with a difference"
              + (f"; ran {', '.join(kernels)}" if kernels else "")
              + (f"; {refused} FP8 batches not run: vLLM refuses FP8 caches on this CPU ({VLLM_CPU_FP8_REFUSAL})"
                 if refused else ""))
    print(f"vllm differential: {time.perf_counter() - started:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
