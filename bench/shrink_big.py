"""Shrink a ≥ 50 MB synthetic failing snapshot; check the result still fails the same way; print sizes and time.

The input: 32 requests of ~2000 tokens, Hq 32 / Hkv 8, D 128, bf16, three decode
steps, one request reading engine page 0 (which vLLM's FLEX_ATTENTION masks as
its null block). Done when the output is under 1 MB and replaying it fails the
same backend on the same heads (renumbered).

    python bench/shrink_big.py [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from kvdbg.moves.shrinker import failure_signature, observe, same_failure, shrink
from kvdbg.snapshot.store import load_snapshot, save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot

SPEC = SynthSpec(seq_lens=tuple(1900 + 7 * i for i in range(32)), num_heads=32, num_kv_heads=8, head_size=128,
                 dtype="bfloat16", steps=3, use_page_zero=True, page_zero_request=13, seed=7)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", default=None, help="write the input and output here instead of a temp dir")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="kvdbg-shrink-")
    os.makedirs(work, exist_ok=True)
    src, dst = os.path.join(work, "big.safetensors"), os.path.join(work, "small.safetensors")

    t0 = time.perf_counter()
    save_snapshot(synth_snapshot(SPEC), src, overwrite=True)
    t_gen = time.perf_counter() - t0
    in_bytes = os.path.getsize(src)

    said: list[tuple[float, str]] = []

    def progress(message: str) -> None:
        said.append((time.perf_counter(), message))
        print("  " + message, file=sys.stderr)

    t0 = time.perf_counter()
    result = shrink(load_snapshot(src), progress=progress, output_path=dst, overwrite=True)
    t_shrink = time.perf_counter() - t0
    # The input's own replay (every backend, every step) ends where shrink announces the failure it keeps.
    t_input = next(t for t, message in said if message.startswith("failure:")) - t0
    candidates = result.replays - 1
    out_bytes = os.path.getsize(dst)

    # Independent check: replay the written file and map its failing heads back to the input's numbering.
    small = load_snapshot(dst)
    obs = observe(small, result.backend, 0)
    mapped = frozenset((result.kept_requests[r], result.kept_heads[h]) for r, h in obs.failing_heads)
    finds = frozenset((c, None if r is None else result.kept_requests[r]) for c, r in obs.error_findings)
    big_sig = failure_signature(load_snapshot(src), result.backend)  # recomputed from the file, not reused
    expected, expected_finds = big_sig.restricted(result.kept_requests, result.kept_heads)
    same = big_sig.backend == result.backend and bool(expected) and same_failure(mapped, finds, expected, expected_finds)
    # The same heads: every head that failed in the input, for the requests kept, fails in the output.
    input_heads = frozenset(p for p in big_sig.failing_heads if p[0] in result.kept_requests)
    same = same and input_heads <= mapped

    print(f"input   {in_bytes / 1e6:8.2f} MB  ({len(SPEC.seq_lens)} requests, {SPEC.steps} steps, "
          f"Hq {SPEC.num_heads}/Hkv {SPEC.num_kv_heads}, D {SPEC.head_size}, generated in {t_gen:.1f} s)")
    print(f"output  {out_bytes / 1e6:8.4f} MB  ({out_bytes} bytes; {len(result.kept_requests)} request(s), "
          f"{len(result.kept_heads)} query head(s), {result.pages_after} page(s), {result.tokens_after} keys)")
    print(f"ratio   {in_bytes / out_bytes:8.0f}x smaller; shrink took {t_shrink:.1f} s over {result.replays} replays")
    print(f"replays the input's {t_input:.1f} s, then {candidates} on candidates in {t_shrink - t_input:.1f} s "
          f"({(t_shrink - t_input) / candidates:.3f} s per replay)")
    for p in result.passes:
        print(f"  pass {p.name:<12} {p.candidates:3d} candidates  {p.removed or '-'}")
    print(f"backend {result.backend}: input fails on {len(result.signature.failing_heads)} (request, head) pairs; "
          f"input's failing heads of the kept requests {sorted(input_heads)}; output fails on "
          f"{sorted(obs.failing_heads)} "
          f"= input {sorted(mapped)}")
    ok = in_bytes >= 50e6 and out_bytes < 1e6 and same
    print("DONE-WHEN:", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
