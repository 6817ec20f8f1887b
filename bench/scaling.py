"""Replay time and peak RSS per backend as the snapshot grows (CPU, and CUDA where present).

Usage:
    python bench/scaling.py measure --device cpu  --sizes 16,64,256,1024,2048 --dir /tmp/kvdbg-scaling --out cpu.json
    python bench/scaling.py measure --device cuda --sizes 16,256,2048,8192 --dir /tmp/kvdbg-scaling --out gpu.json
    python bench/scaling.py plot cpu.json gpu.json --png docs/scaling.png      # needs matplotlib

Each size is a synthetic capture of 64 requests (Hq 32 / Hkv 8, D 128, bf16,
page 16, q 1 unless --query-len): SIZE MiB of KV means 64 x (SIZE * 4) tokens,
so 2048 MiB is the 64 x 8192 case. Each row is one whole
`kvdbg replay SNAP --backend B --device D --json` in a child process of its
own: wall time and peak RSS (ru_maxrss from os.wait4; on CUDA also the replay's
peak GPU memory is not counted here). The replay always adds the reference,
so the flex row is reference + flex. Beside each size, the floor: a child that
imports torch and reads the file (on CUDA: and copies it to the GPU). All
numbers come from one run; `plot` draws them and prints the markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKENDS = ("reference", "flashinfer_ts", "flex")

FLOOR = """
import sys, torch
from safetensors import safe_open
device = sys.argv[2]
with safe_open(sys.argv[1], framework="pt") as f:
    for name in f.keys():
        t = f.get_tensor(name).to(device)
if device.startswith("cuda"):
    torch.cuda.synchronize()
"""


def child(argv: list[str], env: dict[str, str]) -> tuple[float, float, int, str]:
    """(wall s, peak RSS MiB, exit code, stdout) of one child process."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    out = proc.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    return wall, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), out


SYNTH = """
import sys
from kvdbg.snapshot.store import save_snapshot
from kvdbg.moves.synth import SynthSpec, synth_snapshot
mib, query_len = int(sys.argv[2]), int(sys.argv[3])
spec = SynthSpec(seq_lens=(mib * 4,) * 64, query_len=query_len, num_heads=32, num_kv_heads=8,
                 head_size=128, dtype="bfloat16")
save_snapshot(synth_snapshot(spec), sys.argv[1])
"""


def make(path: str, mib: int, query_len: int) -> None:
    """Synthesise in a child: a big parent would inflate every later child's ru_maxrss (fork copies it)."""
    if os.path.exists(path):
        return
    print(f"synthesising {path} ({mib} MiB)...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-c", SYNTH, path, str(mib), str(query_len)], check=True, cwd=REPO)


def measure(args) -> None:
    os.makedirs(args.dir, exist_ok=True)
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    rows = []
    for mib in [int(x) for x in args.sizes.split(",")]:
        path = os.path.join(args.dir, f"scaling-{mib}MiB-q{args.query_len}.safetensors")
        make(path, mib, args.query_len)
        size = os.path.getsize(path) / 2**20
        wall, rss, rc, _ = child([sys.executable, "-c", FLOOR, path, args.device], env)
        rows.append(dict(size_mib=mib, file_mib=size, backend="floor", device=args.device, wall_s=wall,
                         rss_mib=rss, exit=rc))
        print(f"{mib:6d} MiB  floor (import torch + read{' + copy' if args.device != 'cpu' else ''}) "
              f"{wall:7.2f} s {rss:8.0f} MiB", flush=True)
        for backend in args.backends.split(","):
            argv = [sys.executable, "-m", "kvdbg", "replay", path, "--backend", backend,
                    "--device", args.device, "--json"]
            wall, rss, rc, out = child(argv, env)
            kernel = forward = None
            try:
                doc = json.loads(out)
                for status in doc.get("backends", []):
                    if status.get("name") == backend:
                        kernel = (status.get("run") or status.get("info") or {}).get("kernel")
                forward = sum((step.get("runs") or {}).get(backend, {}).get("forward_s") or 0
                              for step in doc.get("steps", [])) or None
            except (ValueError, AttributeError):
                pass
            rows.append(dict(size_mib=mib, file_mib=size, backend=backend, device=args.device, wall_s=wall,
                             rss_mib=rss, exit=rc, kernel=kernel, forward_s=forward))
            print(f"{mib:6d} MiB  {backend:14s} {wall:7.2f} s {rss:8.0f} MiB  rss/file {rss / size:5.2f}x  "
                  f"exit {rc}  forward {forward or 0:.2f} s  {kernel or ''}", flush=True)
        if not args.keep:
            os.unlink(path)
    machine = dict(cpus=os.cpu_count(), python=sys.version.split()[0], device=args.device)
    try:
        import torch

        machine["torch"] = torch.__version__
        machine["threads"] = torch.get_num_threads()
        if args.device.startswith("cuda"):
            machine["gpu"] = torch.cuda.get_device_name()
    except Exception:
        pass
    with open(args.out, "w") as fh:
        json.dump(dict(machine=machine, query_len=args.query_len, rows=rows), fh, indent=1)
    print(f"wrote {args.out}", file=sys.stderr)


def plot(args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    print("| device | size | backend | wall s | peak RSS MiB | RSS / file |")
    print("| --- | --- | --- | --- | --- | --- |")
    for path in args.results:
        with open(path) as fh:
            doc = json.load(fh)
        device = doc["machine"]["device"]
        style = "-" if device == "cpu" else "--"
        for backend in ("floor",) + BACKENDS:
            rows = [r for r in doc["rows"] if r["backend"] == backend]
            if not rows:
                continue
            sizes = [r["file_mib"] for r in rows]
            color = f"C{(('floor',) + BACKENDS).index(backend)}"
            for ax, key in ((ax_t, "wall_s"), (ax_m, "rss_mib")):
                ax.plot(sizes, [r[key] for r in rows], style, marker="o", color=color, label=f"{backend} ({device})")
            for r in rows:
                print(f"| {device} | {r['size_mib']} MiB | {backend} | {r['wall_s']:.2f} | {r['rss_mib']:.0f} "
                      f"| {r['rss_mib'] / r['file_mib']:.2f}x |")
    sizes = sorted({r["file_mib"] for path in args.results for r in json.load(open(path))["rows"]})
    ax_m.plot(sizes, [1.5 * s for s in sizes], ":", color="grey", label="1.5 x file (target)")
    for ax, title, unit in ((ax_t, "whole `kvdbg replay` wall time", "seconds"),
                            (ax_m, "peak RSS of the replay process", "MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("snapshot size (MiB)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    ax_m.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)
    print(f"wrote {args.png}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--device", default="cpu")
    m.add_argument("--sizes", default="16,64,256,1024,2048", help="KV MiB per snapshot, comma-separated")
    m.add_argument("--backends", default=",".join(BACKENDS))
    m.add_argument("--query-len", type=int, default=1)
    m.add_argument("--dir", default="/tmp/kvdbg-scaling")
    m.add_argument("--out", required=True)
    m.add_argument("--keep", action="store_true", help="keep the synthesised snapshots")
    p = sub.add_parser("plot")
    p.add_argument("results", nargs="+")
    p.add_argument("--png", required=True)
    args = parser.parse_args()
    (measure if args.verb == "measure" else plot)(args)


if __name__ == "__main__":
    main()
