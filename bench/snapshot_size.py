"""Snapshot size: file bytes against the bytes of the referenced pages, from ~1 MiB to 2 GiB.

Each case is written by `kvdbg synth` (Hq 32 / Hkv 8, D 128, bf16, page 16, one
decode token per request with its new K/V, unless the case says otherwise) into
a temporary folder and measured from its header alone. Columns:

- pages: bytes of the stored (referenced) KV pages;
- step data: the query, new key/value and output tensors, which a snapshot
  needs to replay (they grow with tokens, not with pages);
- overhead: everything else -- header JSON (metadata), padding and the index
  tensors (page_ids, block_table, seq_lens, query_start_loc, slot_mapping).

Target: overhead <= 1% of the page bytes + 64 KiB. Nothing is asserted.

    python bench/snapshot_size.py [--keep DIR] [--skip-2gb]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)

from kvdbg.snapshot.format import read_header  # noqa: E402  (header only: no torch)

STEP_DATA = ("query", "key", "value", "output")
HEADS = ["--num-heads", "32", "--num-kv-heads", "8", "--head-size", "128", "--dtype", "bfloat16"]

# name -> (seq_lens, extra synth options)
CASES = {
    "1 x 256 tokens": ([256], []),
    "4 x 1000, ragged": ([1000, 700, 300, 64], []),
    "256 x 16 tokens (many tiny requests)": ([16] * 256, []),
    "1 x 8192 + 255 x 16 (wide ragged table)": ([8192] + [16] * 255, []),
    "16 x 2048, q=8, 4 steps, stale tails": ([2048] * 16, ["--query-len", "8", "--steps", "4", "--stale-tail", "8"]),
    "4096 x 64 tokens (4096 requests)": ([64] * 4096, []),
    "64 x 1024": ([1024] * 64, []),
    "64 x 8192 (2 GiB, as bench/_big.py)": ([8192] * 64, []),
}


def synth(path: str, seq_lens: list[int], extra: list[str]) -> None:
    argv = [sys.executable, "-m", "kvdbg", "synth", "-o", path, "--seq-len", ",".join(map(str, seq_lens)),
            *HEADS, *extra, "--force"]
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE)


def measure(path: str) -> dict[str, int]:
    header = read_header(path)
    tensors = header.tensors
    pages = tensors["kv_cache"].nbytes
    step_data = sum(t.nbytes for name, t in tensors.items() if name.rsplit(".", 1)[-1] in STEP_DATA)
    index = sum(t.nbytes for name, t in tensors.items()
                if name != "kv_cache" and name.rsplit(".", 1)[-1] not in STEP_DATA)
    size = os.path.getsize(path)
    return {"file": size, "pages": pages, "step": step_data, "index": index,
            "header": size - pages - step_data - index, "overhead": size - pages - step_data}


def mib(n: int) -> str:
    return f"{n / 2**20:10.2f}"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", metavar="DIR", help="write the snapshots here and keep them (default: a temp dir)")
    ap.add_argument("--skip-2gb", action="store_true", help="leave out the 2 GiB case (~30 s and 2 GiB of disk)")
    args = ap.parse_args(argv)
    workdir = args.keep or tempfile.mkdtemp(prefix="kvdbg-size-")
    os.makedirs(workdir, exist_ok=True)
    print("Hq 32 / Hkv 8, D 128, bf16, page 16; MiB; overhead = header JSON + padding + index tensors")
    print(f"{'case':42s} {'file':>10s} {'pages':>10s} {'step data':>10s} {'index':>9s} {'header':>8s} "
          f"{'file/pages':>10s} {'overhead/pages':>14s} {'limit':>9s}  target")
    try:
        for n, (name, (seq_lens, extra)) in enumerate(CASES.items()):
            if args.skip_2gb and sum(seq_lens) * 4096 >= 2**31:
                continue
            path = os.path.join(workdir, f"size_{n}.safetensors")
            synth(path, seq_lens, extra)
            m = measure(path)
            limit = 0.01 * m["pages"] + 64 * 1024
            ok = "met" if m["overhead"] <= limit else f"MISSED by {human(m['overhead'] - limit)}"
            print(f"{name:42s} {mib(m['file'])} {mib(m['pages'])} {mib(m['step'])} {m['index'] / 1024:8.1f}K "
                  f"{m['header'] / 1024:7.1f}K {m['file'] / m['pages']:10.4f} "
                  f"{100 * m['overhead'] / m['pages']:13.3f}% {human(limit):>9s}  {ok}")
            if not args.keep:
                os.remove(path)
    finally:
        if not args.keep and not os.listdir(workdir):
            os.rmdir(workdir)


def human(n: float) -> str:
    return f"{n / 1024:.0f} KiB" if n < 2**20 else f"{n / 2**20:.1f} MiB"


if __name__ == "__main__":
    main()
