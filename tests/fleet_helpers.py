"""Snapshots with known causes of failure, and replay functions that kill their worker, for the fleet tests.

Importable by the spawned worker processes (tests is a package on their sys.path) and by Ray tasks; torch is
imported only where a snapshot is made or replayed, so that a worker of env_replay starts in a moment.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

from kvdbg.replayer.batch import replay_file

# The causes planted by mixed_directory, by the kind of group kvdbg.fleet.triage must put them in.
CAUSES = ("flex_null_page", "wrong_capture", "poisoned_page", "corrupt", "pass")
SMALL = dict(seq_lens=(40, 70), num_heads=8, num_kv_heads=2, head_size=64)  # a head size prims_ts plans


def _snapshot(spec, *, rank: int | None = None, step: int | None = None):
    from kvdbg.moves.synth import synth_snapshot

    snap = synth_snapshot(spec)
    if rank is not None or step is not None:
        capture = dict(snap.meta.capture, rank=rank, step=step)
        snap = replace(snap, meta=replace(snap.meta, capture=capture))
    return snap


def write_cause(directory: str, cause: str, seed: int, name: str | None = None, seq_lens=None) -> str:
    """One snapshot failing (or passing) for ``cause``; returns its path. ``seq_lens`` for longer requests
    (passing snapshots only)."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec

    path = os.path.join(directory, name or f"{cause}_{seed}.safetensors")
    if cause == "flex_null_page":  # vLLM's null block in a live table entry: flex reads it, the reference does not
        snap = _snapshot(SynthSpec(**SMALL, query_len=2, use_page_zero=True, page_zero_request=1,
                                   engine_output="reference", backend="FLEX_ATTENTION", seed=seed))
    elif cause == "wrong_capture":  # the engine's own output is off: captured vs reference fails
        snap = _snapshot(SynthSpec(**SMALL, engine_output="reference", backend="FLASHINFER_TS", seed=seed))
        snap.steps[0].output.mul_(1.5)
    elif cause == "poisoned_page":  # NaN in request 0's first live page (every KV head), after the capture
        snap = _snapshot(SynthSpec(**SMALL, engine_output="reference", backend="FLASHINFER_TS", seed=seed))
        first = int(snap.steps[0].block_table[0, 0])
        stored = snap.page_ids.tolist().index(first)
        snap.kv_cache[stored] = float("nan")
    elif cause == "pass":
        spec = dict(SMALL, seq_lens=seq_lens or SMALL["seq_lens"])
        snap = _snapshot(SynthSpec(**spec, engine_output="reference", backend="FLASHINFER_TS", seed=seed),
                         rank=seed % 2, step=100 + seed)
    elif cause == "corrupt":  # a valid file cut in half: its tensors run past the end
        whole = write_cause(directory, "pass", seed, name=f".whole_{seed}.safetensors")
        data = open(whole, "rb").read()
        os.unlink(whole)
        with open(path, "wb") as fh:
            fh.write(data[: len(data) // 2])
        return path
    else:
        raise ValueError(cause)
    return save_snapshot(snap, path)


def mixed_directory(directory: str) -> dict[str, set[str]]:
    """Three files of flex on the null page, two of a wrong captured output, two with a poisoned page, one
    corrupt file, three passes; returns cause -> file names."""
    os.makedirs(directory, exist_ok=True)
    planted = {"flex_null_page": (0, 1, 2), "wrong_capture": (3, 4), "poisoned_page": (5, 6), "corrupt": (7,),
               "pass": (8, 9, 10)}
    out: dict[str, set[str]] = {}
    for cause, seeds in planted.items():
        for seed in seeds:
            out.setdefault(cause, set()).add(os.path.basename(write_cause(directory, cause, seed)))
    return out


def small_directory(directory: str, count: int, *, seed: int = 100, seq_lens=None) -> list[str]:
    """``count`` passing snapshots, quick to replay (``seq_lens`` longer ones: a run that lasts a while)."""
    os.makedirs(directory, exist_ok=True)
    return [write_cause(directory, "pass", seed + i, name=f"s{i:04d}.safetensors", seq_lens=seq_lens)
            for i in range(count)]


def dying_replay(path, options):
    """Kills its own worker process on files named ``die*`` (every time), ``die_once*`` (the first time: it
    leaves ``PATH.died`` beside the file), else replays as kvdbg does."""
    name = os.path.basename(path)
    if name.startswith("die_once"):
        marker = path + ".died"
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
    elif name.startswith("die"):
        os.kill(os.getpid(), signal.SIGKILL)
    return replay_file(path, options)


def rows(results: str) -> list[dict]:
    """The row records of a results file (a torn last line left out)."""
    out = []
    with open(results, "rb") as fh:
        for line in fh.read().split(b"\n"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("record") == "row":
                out.append(record)
    return out


def wait_for_rows(results: str, count: int, *, timeout: float, process=None) -> list[dict]:
    """Poll until the results file holds ``count`` rows (bounded; fails if ``process`` exits first)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = rows(results) if os.path.exists(results) else []
        if len(found) >= count:
            return found
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the run ended (exit {process.returncode}) with {len(found)} row(s)")
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} rows in {results} after {timeout} s")


def verdicts(records) -> dict[str, tuple]:
    """file name -> what must not depend on the executor: status, exit code, error codes, signature."""
    out = {}
    for r in records:
        name = os.path.basename(r["path"])
        sig = r.get("signature")
        out[name] = (r["status"], r["exit_code"], tuple(r["error_findings"]), sig and sig["key"])
    return out


def pinned_replay(path, options):
    """Replays as kvdbg does, after noting beside the file what this worker sees: its CUDA_VISIBLE_DEVICES, how
    many GPUs torch counts, and the device it was told to replay on (``PATH.PID.where``)."""
    import torch

    seen = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device_count": torch.cuda.device_count(), "device": options.device}
    with open(f"{path}.{os.getpid()}.where", "w", encoding="utf-8") as fh:
        json.dump(seen, fh)
    return replay_file(path, options)


def env_replay(path, options):
    """No replay at all (no torch): notes beside the file the CUDA_VISIBLE_DEVICES and the device this worker
    was given (``PATH.PID.where``), and returns a passing row. For testing the scheduler of several GPUs on a
    machine that has none."""
    from kvdbg.replayer.batch import FileResult

    with open(f"{path}.{os.getpid()}.where", "w", encoding="utf-8") as fh:
        json.dump({"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "device": options.device}, fh)
    time.sleep(0.05)
    return FileResult(path, "pass", 0, summary="PASS: scheduling only")
