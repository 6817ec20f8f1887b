"""What the fleet benchmarks share: directories of synthetic captures, and one timed `kvdbg replay DIR` run."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.fleet_helpers import rows  # noqa: E402  (the results file's row records, as the tests read them)

# A small capture: 4 requests of 9-333 tokens, Hq 8 / Hkv 2, D 64, bf16, page 16, the engine's output stored
# (~330 KiB).
SMALL = dict(seq_lens=(9, 77, 200, 333), engine_output="reference", backend="FLASHINFER_TS")


def make_small(directory: str, count: int, *, prefix: str = "small", **spec) -> list[str]:
    """``count`` small captures in ``directory`` (made once: files already there are kept)."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot

    os.makedirs(directory, exist_ok=True)
    out = []
    for i in range(count):
        path = os.path.join(directory, f"{prefix}{i:05d}.safetensors")
        if not os.path.exists(path):
            save_snapshot(synth_snapshot(SynthSpec(**{**SMALL, **spec}, seed=i)), path)
        out.append(path)
    return out


def link_into(directory: str, paths: list[str], *, copies: int = 1) -> list[str]:
    """Hard links of ``paths`` in ``directory`` (``copies`` names each): a big file many times, no disk."""
    os.makedirs(directory, exist_ok=True)
    out = []
    for path in paths:
        stem = os.path.basename(path)[: -len(".safetensors")]
        for c in range(copies):
            target = os.path.join(directory, f"{stem}" + (f"-{c}" if copies > 1 else "") + ".safetensors")
            if not os.path.exists(target):
                os.link(path, target)
            out.append(target)
    return out


def steady_rate(records: list[dict]) -> float:
    """Files per second from the 10th finished row to the last: the workers' start-up left out."""
    stamps = sorted(datetime.datetime.fromisoformat(r["finished"]).timestamp() for r in records)
    first = max(0, len(stamps) // 10 - 1)
    span = stamps[-1] - stamps[first] if stamps else 0.0
    return (len(stamps) - 1 - first) / span if span > 0 else float("nan")


def run(label: str, directory: str, args: list[str], work: str, *, kill_after: int | None = None) -> dict:
    """``python -m kvdbg replay DIR --results FILE --json ARGS`` timed; with ``kill_after``, one worker process
    is killed (SIGKILL) once that many rows are written."""
    results = os.path.join(work, label.replace(" ", "_").replace("/", "_") + ".jsonl")
    if os.path.exists(results):
        os.unlink(results)
    command = [sys.executable, "-m", "kvdbg", "replay", directory, "--results", results, "--json", *args]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    killed = None
    if kill_after is not None:
        while process.poll() is None and killed is None:
            if os.path.exists(results) and len(rows(results)) >= kill_after:
                workers = _children(process.pid)
                if workers:
                    killed = workers[0]
                    os.kill(killed, signal.SIGKILL)
            time.sleep(0.2)
    out, err = process.communicate()
    wall = time.perf_counter() - started
    if process.returncode not in (0, 1, 2):
        raise SystemExit(f"{label}: exit {process.returncode}\n{err.decode()[-3000:]}")
    data = json.loads(out)
    written = rows(results)
    count = len(data["files"])
    verdicts = {os.path.basename(f["path"]): (f["status"], tuple(f["error_findings"])) for f in data["files"]}
    signatures = sorted((g["key"], g["count"]) for g in data["triage"]["groups"])
    return {"label": label, "files": count, "rows": len(written), "wall": wall, "overall": count / wall,
            "steady": steady_rate(written), "devices": data["run"]["devices"], "lost": data["run"]["workers_lost"],
            "verdicts": verdicts, "signatures": signatures, "killed": killed, "exit": process.returncode,
            "bytes": sum(f["size"] for r in written for f in r["files"])}


def _children(pid: int) -> list[int]:
    """Worker processes of ``pid`` (Linux /proc), multiprocessing's resource tracker left out."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                found += [int(c) for c in fh.read().split()]
    except OSError:
        return []
    workers = []
    for child in found:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as fh:
                if b"resource_tracker" not in fh.read():
                    workers.append(child)
        except OSError:
            continue
    return workers


def table(runs: list[dict], base: dict) -> None:
    print(f"{'run':<24} {'files':>6} {'wall s':>8} {'files/s':>8} {'steady/s':>9} {'vs base':>8} {'steady vs':>9}")
    for r in runs:
        print(f"{r['label']:<24} {r['files']:>6} {r['wall']:>8.1f} {r['overall']:>8.2f} {r['steady']:>9.2f} "
              f"{r['overall'] / base['overall']:>7.2f}x {r['steady'] / base['steady']:>8.2f}x")
