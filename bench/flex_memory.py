"""CPU flex replay: peak RSS against 1.5 x the capture's size + torch's own RSS (512 MiB and 2 GiB captures).

Usage:
    python bench/flex_memory.py [--dir /tmp] [--sizes 512,2048] [--keep] [--checkout]

For each size (MiB: 64 requests x 2048 or 8192 tokens, Hq 32 / Hkv 8, D 128,
bf16, page 16), synthesises the capture under --dir unless it is there, runs
`kvdbg replay CAPTURE --backend flex` in a child process on the CPU (the
replay always adds the reference) and prints its peak RSS (the kernel's
ru_maxrss for that child, from os.wait4) against the limit
1.5 x file size + torch's own RSS, where torch's own is the peak RSS of a child
that runs `import torch, torch._dynamo` (flex needs Dynamo) measured in the
same run. The captures this script made are deleted at the end unless --keep.
Which kvdbg runs: as in bench/cli_start.py (the installed script, or
``--checkout``). Memory does not depend on the machine's load; the wall time
printed beside it does.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _big import make_capture  # noqa: E402
from _launch import REPO, child_env, describe, kvdbg_command  # noqa: E402

TOKENS = {512: 2048, 2048: 8192}


def peak_rss(argv: list[str], env: dict[str, str]) -> tuple[int, float, int]:
    """(peak RSS in bytes of the child itself, wall seconds, exit code). Linux: ru_maxrss is in KiB."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not a maximum over all children
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_maxrss * 1024, time.perf_counter() - start, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp", help="where the captures are made (default /tmp)")
    parser.add_argument("--sizes", default="512,2048", help="capture sizes in MiB, of 512 and 2048")
    parser.add_argument("--keep", action="store_true", help="keep the captures this script made")
    parser.add_argument("--checkout", action="store_true",
                        help="time this checkout (python -m kvdbg, PYTHONPATH=checkout), not the installed script")
    args = parser.parse_args()
    env = child_env(args.checkout, CUDA_VISIBLE_DEVICES="")
    kvdbg = kvdbg_command(args.checkout)
    torch_rss, _, _ = peak_rss([sys.executable, "-c", "import torch, torch._dynamo"], env)
    print(describe(kvdbg, env))
    print(f"{os.cpu_count()} CPUs, python {sys.version.split()[0]}, load average {os.getloadavg()[0]:.2f}; "
          f"torch's own RSS (import torch, torch._dynamo): {torch_rss / 2**20:.0f} MiB")
    print(f"{'capture':>9s} {'peak RSS':>9s} {'limit':>9s} {'peak/limit':>10s} {'peak-torch/file':>15s} {'wall':>7s}")
    for size in (int(s) for s in args.sizes.split(",")):
        path = os.path.join(args.dir, f"kvdbg-bench-flex-{size}m.safetensors")
        made = not os.path.exists(path)
        make_capture(path, TOKENS[size])
        try:
            file_size = os.path.getsize(path)
            rss, wall, code = peak_rss([*kvdbg, "replay", path, "--backend", "flex"], env)
            limit = 1.5 * file_size + torch_rss
            note = "" if code in (0, 1) else f"  (exit {code})"
            print(f"{file_size / 2**20:7.0f}Mi {rss / 2**20:7.0f}Mi {limit / 2**20:7.0f}Mi {rss / limit:9.3f}x "
                  f"{(rss - torch_rss) / file_size:14.2f}x {wall:6.1f}s{note}")
        finally:
            if made and not args.keep:
                os.unlink(path)


if __name__ == "__main__":
    main()
