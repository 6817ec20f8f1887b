"""FlashInfer's real paged kernels, dumped by FlashInfer's own level-10 logging, imported and replayed by kvdbg.

Run by tests/gpu/run_flashinfer_dump.sh on a Hopper GPU (FlashInfer carried). Three stages, each printed:

1. dump: a child process with FLASHINFER_LOGLEVEL=10 (FlashInfer reads it at import) runs one
   BatchDecodeWithPagedKVCacheWrapper call (NHD, GQA 8/2, fp16) and one BatchPrefillWithPagedKVCacheWrapper
   call (NHD, causal, window_left 127, ragged queries) on the GPU; FlashInfer writes each call's inputs and
   its kernel's output. ``--more`` adds an HND decode (one 5-D cache tensor, window_left 255, soft cap 30).
2. import + replay: `kvdbg import DUMP -o SNAPS` must import every run; `kvdbg replay SNAP --backend reference`
   must PASS each (the kernel's recorded output against kvdbg's exact reference).
3. planted: the decode run's recorded output gets +1.0 on request 1, head 3; importing that one call and
   replaying it must FAIL with exactly (request 1, head 3) failing.

Exit 0 only when every check passes. ``check_session`` (stages 2 and 3) runs on any dump with outputs; the CPU
tests run it over the committed dumps (tests/test_import_flashinfer.py), so it is known to work before a GPU
sees it.

    python tests/gpu/flashinfer_dump_gpu.py [--more] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PLANT_REQUEST, PLANT_HEAD, PLANT_DELTA = 1, 3, 1.0


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def say(text: str) -> None:
    print(text, flush=True)


# ----------------------------------------------------------------------------- stage 1 (child, on the GPU)


def _page_table(torch, kv_lens, page_size, num_pages, gen):
    """indptr, indices (a random placement) and last_page_len of requests of ``kv_lens`` keys."""
    counts = [-(-n // page_size) for n in kv_lens]
    order = torch.randperm(num_pages, generator=gen)[:sum(counts)]
    indptr = torch.tensor([0] + list(itertools.accumulate(counts)), dtype=torch.int32)
    last = torch.tensor([n - (c - 1) * page_size for n, c in zip(kv_lens, counts)], dtype=torch.int32)
    return indptr, order.to(torch.int32), last


def make_dumps(more: bool) -> None:
    """Run FlashInfer's wrappers on the GPU; FLASHINFER_LOGLEVEL/FLASHINFER_DUMP_DIR come from the parent."""
    import torch
    import flashinfer

    say(f"  flashinfer {flashinfer.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(46)
    page_size, heads, kv_heads, dim, pages = 16, 8, 2, 128, 256

    def cache(layout, dtype=torch.float16):
        shape = (pages, page_size, kv_heads, dim) if layout == "NHD" else (pages, kv_heads, page_size, dim)
        return [torch.randn(shape, generator=gen).to(dtype).to(dev) for _ in range(2)]

    k, v = cache("NHD")
    decode_lens = [700, 90, 1500, 33]
    indptr, indices, last = _page_table(torch, decode_lens, page_size, pages, gen)
    started = time.time()
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8, device=dev),
                                                           "NHD")
    decode.plan(indptr.to(dev), indices.to(dev), last.to(dev), heads, kv_heads, dim, page_size,
                q_data_type=torch.float16)
    q = torch.randn(len(decode_lens), heads, dim, generator=gen).half().to(dev)
    out = decode.run(q, (k, v))
    torch.cuda.synchronize()
    say(f"  decode NHD ran: output {list(out.shape)} in {time.time() - started:.0f} s (JIT build included)")

    prefill_kv, prefill_q = [300, 90, 700], [40, 1, 17]
    indptr, indices, last = _page_table(torch, prefill_kv, page_size, pages, gen)
    qo_indptr = torch.tensor([0, 40, 41, 58], dtype=torch.int32)
    started = time.time()
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(64 << 20, dtype=torch.uint8, device=dev), "NHD")
    prefill.plan(qo_indptr.to(dev), indptr.to(dev), indices.to(dev), last.to(dev), heads, kv_heads, dim, page_size,
                 causal=True, window_left=127, q_data_type=torch.float16)
    q = torch.randn(sum(prefill_q), heads, dim, generator=gen).half().to(dev)
    out = prefill.run(q, (k, v))
    torch.cuda.synchronize()
    say(f"  prefill NHD causal window ran: output {list(out.shape)} in {time.time() - started:.0f} s")

    if more:
        kh, vh = cache("HND")
        lens = [600, 45, 1200]
        indptr, indices, last = _page_table(torch, lens, page_size, pages, gen)
        started = time.time()
        hnd = flashinfer.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(64 << 20, dtype=torch.uint8, device=dev),
                                                            "HND")
        hnd.plan(indptr.to(dev), indices.to(dev), last.to(dev), heads, kv_heads, dim, page_size,
                 window_left=255, logits_soft_cap=30.0, q_data_type=torch.float16)
        q = torch.randn(len(lens), heads, dim, generator=gen).half().to(dev)
        out = hnd.run(q, torch.stack([kh, vh], dim=1))
        torch.cuda.synchronize()
        say(f"  decode HND window soft cap ran: output {list(out.shape)} in {time.time() - started:.0f} s")


# ----------------------------------------------------------------------------- stages 2 and 3 (any machine)


def kvdbg(*args: str) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "kvdbg", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}, timeout=900)
    return proc.returncode, proc.stdout, proc.stderr


def _replay_json(snapshot: Path) -> tuple[int, dict | None, str]:
    code, out, err = kvdbg("replay", snapshot, "--backend", "reference", "--json")
    try:
        return code, json.loads(out), err
    except ValueError:
        return code, None, (err or out)[-400:]


def check_session(dump: Path, work: Path, *, expect_runs: int | None = None) -> list[Check]:
    """Import ``dump`` and replay every snapshot (PASS), then plant a wrong output in a decode run (FAIL)."""
    checks: list[Check] = []
    work.mkdir(parents=True, exist_ok=True)
    snaps = work / "snaps"
    snaps.mkdir()  # a directory even for one run: `kvdbg import` then writes into it
    code, out, err = kvdbg("import", dump, "-o", snaps, "--json")
    if code != 0:
        return [Check("import", False, f"exit {code}: {err.strip()[-400:]}")]
    listing = json.loads(out)
    imported = [item for item in listing["items"] if item["status"] == "imported"]
    totals = listing["totals"]
    ok = bool(imported) and totals["refused"] == 0 and (expect_runs is None or len(imported) == expect_runs)
    checks.append(Check("import", ok, f"{totals} (expected {expect_runs or 'some'} imported, none refused)"))
    for item in imported:
        path = Path(item["output"])
        code, data, err = _replay_json(path)
        captured = [c for c in (data or {}).get("comparisons", []) if c.get("actual") == "captured"]
        ok = code == 0 and len(captured) == 1 and captured[0]["passed"]
        detail = (f"exit {code}, captured vs reference max abs {captured[0]['max_abs']:.3g} over "
                  f"{captured[0]['heads_compared']} heads") if captured else f"exit {code}: {err.strip()[-300:]}"
        checks.append(Check(f"replay {path.name}", ok, detail))

    decode = next((item for item in imported if item["function"].startswith("BatchDecode")
                   and item["snapshot"]["requests"] > PLANT_REQUEST
                   and item["snapshot"]["num_heads"] > PLANT_HEAD and item["snapshot"]["output"]), None)
    if decode is None:
        checks.append(Check("planted", False, "no decode run with enough requests and heads to plant in"))
        return checks
    planted_dump = work / "planted"
    shutil.copytree(dump, planted_dump)
    run_dir = planted_dump / decode["call"]
    import torch

    name = "outputs.pt" if (run_dir / "outputs.pt").exists() else "outputs.safetensors"
    if name == "outputs.pt":
        outputs = torch.load(run_dir / name, weights_only=True)
        key = "result" if "result" in outputs else "result_0"
        # a decode run has one query token per request (q_len_per_req 1): row r is request r
        outputs[key][PLANT_REQUEST, PLANT_HEAD] += PLANT_DELTA
        torch.save(outputs, run_dir / name)
    else:
        from safetensors.torch import load_file, save_file

        outputs = load_file(run_dir / name)
        key = "result" if "result" in outputs else "result_0"
        outputs[key][PLANT_REQUEST, PLANT_HEAD] += PLANT_DELTA
        save_file(outputs, run_dir / name)
    snapshot = work / "planted.safetensors"
    code, out, err = kvdbg("import", run_dir, "-o", snapshot)
    if code != 0:
        checks.append(Check("planted import", False, f"exit {code}: {err.strip()[-300:]}"))
        return checks
    code, data, err = _replay_json(snapshot)
    captured = [c for c in (data or {}).get("comparisons", []) if c.get("actual") == "captured"]
    failing = [(h["request"], h["head"]) for h in captured[0]["heads"] if not h["passed"]] if captured else None
    ok = code == 1 and failing == [(PLANT_REQUEST, PLANT_HEAD)]
    checks.append(Check("planted wrong output", ok,
                        f"exit {code} (want 1), failing (request, head) {failing} (want "
                        f"[({PLANT_REQUEST}, {PLANT_HEAD})])"))
    return checks


# ----------------------------------------------------------------------------- main


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--more", action="store_true", help="also an HND decode with window and soft cap")
    parser.add_argument("--out", default=None, help="keep the dumps and snapshots here (default: a temp dir)")
    parser.add_argument("--child-dump", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_dump:
        make_dumps(args.more)
        return 0

    import torch

    if not torch.cuda.is_available():
        say("FAIL: no CUDA device; this script runs FlashInfer's kernels on a GPU")
        return 2
    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="kvdbg-flashinfer-dump-"))
    work.mkdir(parents=True, exist_ok=True)
    dump = work / "dump"
    if dump.exists():
        say(f"FAIL: {dump} exists; give an empty --out")
        return 2
    say(f"stage 1: FlashInfer runs its kernels with FLASHINFER_LOGLEVEL=10 into {dump}")
    env = {**os.environ, "FLASHINFER_LOGLEVEL": "10", "FLASHINFER_DUMP_DIR": str(dump),
           "FLASHINFER_LOGDEST": str(work / "flashinfer.log")}
    started = time.time()
    child = subprocess.run([sys.executable, __file__, "--child-dump"] + (["--more"] if args.more else []),
                           env=env, text=True, capture_output=True)
    for line in child.stdout.splitlines():
        if line.startswith("  "):
            say(line)
    if child.returncode != 0:
        say(f"FAIL: the FlashInfer run exited {child.returncode}; its last lines:")
        say("\n".join((child.stdout + child.stderr).strip().splitlines()[-25:]))
        return 1
    calls = sorted(p.name for p in dump.iterdir() if p.is_dir())
    say(f"  {len(calls)} calls dumped in {time.time() - started:.0f} s: {', '.join(calls)}")
    say("stages 2 and 3: kvdbg import, replay, planted wrong output")
    checks = check_session(dump, work, expect_runs=3 if args.more else 2)
    for check in checks:
        say(f"  {'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    failed = [c for c in checks if not c.ok]
    say(f"{'PASS' if not failed else 'FAIL'}: {len(checks) - len(failed)} of {len(checks)} checks pass "
        f"(dumps and snapshots in {work})")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
