"""The GPU engine stage's sentinel runs: vLLM 0.33 on TRITON_ATTN checks its own attention on every step.

The GPU twin of tests/engine/sentinel_case.py, judged by its functions (``judge_clean``, ``judge_faults``).
Three engines, each a process of its own started by tests/gpu/engine_stage.py (``--parts sentinel``): the plain
model, ``KVDBG_SENTINEL=1`` (every step of both layers), every (request, head) pair checked, no interval between
captures, capture itself off (the sentinel alone), 4 requests x 16 tokens (all four prefilled in step 0, then
15 decode steps of four):

    faults        eager; the test-only faults of tests/gpu/triton_faults.py (TRITON_ATTN's forward wrapped before
                  kvdbg's plugin wraps it) at the CPU stage's steps: one head's output moved (layer 1 step 5), a
                  block-table entry wrong for the kernel only (layer 0 step 8), NaN in a page (layer 1 step 11).
                  Each is caught at its step and captured once, one log line names the file and the first failing
                  (request, head), and ``python -m kvdbg replay --json --backend reference,vllm --device cuda`` on
                  each exits 1 failing the corrupted head, request 0, or naming the non-finite page
    clean         eager, no fault: nothing written; the exit line says every step the plugin counted was checked,
                  none wrong
    clean_graphs  FULL_DECODE_ONLY, no fault: the same, and the decode steps, replayed from full CUDA graphs, were
                  handed to the sentinel from the graph's copies (``SentinelHooks.after_graph_replay``, counted by a
                  test-only wrapper); as every counted step was checked, those were

On a GPU a check runs in the sentinel's worker thread and is collected at the layer's next hook; the engine's
shutdown (``engine_core.shutdown()``, which runs the worker's wrapped ``shutdown``) collects the last ones and says
the exit line, as ``vllm serve`` does on exit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from tests.engine import sentinel_case

# run -> (mode, faults as kind:layer:step)
FAULT_SPEC = ",".join(f"{kind}:{layer}:{step}" for kind, (layer, step) in sentinel_case.FAULTS.items())
RUNS = {
    "faults": ("eager", FAULT_SPEC),
    "clean": ("eager", ""),
    "clean_graphs": ("FULL_DECODE_ONLY", ""),
}
# Enough for the four prompts (202 tokens) in one step: the later steps are uniform decodes of four, which
# FULL_DECODE_ONLY replays from its graph of 4.
MAX_BATCHED_TOKENS = 256
REPLAY_SECONDS = 300


def directory(out: str, run: str) -> str:
    return os.path.join(out, f"plain-sentinel_{run}")


def prompts() -> list[dict]:
    """The CPU case's prompts: four of 40, 47, 54 and 61 tokens with no page in common."""
    return [{"prompt_token_ids": [3 + (i * 37 + j * 101) % 500 for i in range(40 + 7 * j)]}
            for j in range(sentinel_case.PROMPTS)]


# --------------------------------------------------------------------------- in the engine's process


def _count_graph_steps() -> dict:
    """Count the steps the plugin's graph path hands the sentinel (test-only: wraps the hook's class)."""
    from kvdbg.vllm_plugin.sentinel_hooks import SentinelHooks

    seen = {"handed": 0, "without_metadata": 0, "staged": 0}
    original = SentinelHooks.after_graph_replay

    def after_graph_replay(self, state, sampled, staged=None):  # a step's sampled layers, (slot, step, ctx) each
        seen["handed"] += len(sampled)
        seen["without_metadata"] += sum(ctx is None for _, _, ctx in sampled)
        seen["staged"] += len(sampled) if staged is not None else 0  # checked from kvdbg's staged copies
        return original(self, state, sampled, staged)

    SentinelHooks.after_graph_replay = after_graph_replay
    return seen


def engine_run(out: str, run: str, model_dir: str, make_llm) -> dict:
    """One sentinel engine, in this process; ``make_llm(model_dir, mode, **overrides)`` builds the stage's LLM."""
    mode, spec = RUNS[run]
    # Set before vLLM is imported: vLLM loads its plugins once per process.
    os.environ.pop("KVDBG_CAPTURE_DIR", None)
    os.environ.update(KVDBG_SENTINEL="1", KVDBG_SENTINEL_DIR=directory(out, run), KVDBG_SENTINEL_PAIRS="64",
                      KVDBG_SENTINEL_INTERVAL="0")
    from vllm import SamplingParams

    record = {"run": run, "mode": mode, "problems": [], "dir": directory(out, run)}
    if spec:
        from tests.gpu import triton_faults

        triton_faults.install(spec)
    graph_steps = _count_graph_steps()
    started = time.monotonic()
    llm = make_llm(model_dir, mode, max_num_batched_tokens=MAX_BATCHED_TOKENS)
    record["startup_s"] = round(time.monotonic() - started, 1)
    from kvdbg import vllm_plugin

    state = vllm_plugin._state
    if state is None or state.sentinel is None:
        record["problems"].append("the kvdbg plugin's sentinel is not active in the engine's process")
        return record
    params = SamplingParams(max_tokens=sentinel_case.TOKENS, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompts(), params, use_tqdm=False)
    record["generated"] = [len(r.outputs[0].token_ids) for r in results]
    print("generated", record["generated"], flush=True)
    hooks = state.sentinel
    if not hooks.capturer.flush(60):
        record["problems"].append("the sentinel's snapshots still unwritten after 60 s")
    try:
        llm.llm_engine.engine_core.shutdown()  # the worker's shutdown: the last checks collected, the exit line said
    except ImportError as exc:  # a compiled module the harness stands in for (vllm.cumem_allocator), after kvdbg's
        # own shutdown hook ran (its exit line is judged from the log): a harness note, not the sentinel's failure
        record.setdefault("notes", []).append(f"the engine's shutdown raised {exc!r}"[:300])
    except Exception as exc:
        record["problems"].append(f"the engine's shutdown raised {exc!r}"[:300])
    record["steps"] = sum(state._forward_counts.values())  # every step of every layer the plugin counted
    record["counts"] = dict(hooks.sentinel.counts)
    record["graph_steps"] = dict(graph_steps)
    if spec:
        from tests.gpu import triton_faults

        record["fired"] = [list(f) for f in triton_faults.fired()]
    return record


# --------------------------------------------------------------------------- judged in the stage's process


def cli_replay(path: str, seconds: float = REPLAY_SECONDS) -> tuple[int, dict]:
    """``kvdbg replay --json`` on the GPU, the columns the capture part judges with: (exit code, its JSON)."""
    try:
        proc = subprocess.run([sys.executable, "-m", "kvdbg", "replay", "--json", "--backend", "reference,vllm",
                               "--device", "cuda", path], capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return -1, {"error": f"kvdbg replay over {seconds:.0f} s"}
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, {"error": proc.stderr.strip()[-300:]}


def snapshots(folder: str) -> list[str]:
    return sentinel_case._snapshots(folder)


def judge(run: str, record: dict, text: str, replay_seconds: float = REPLAY_SECONDS) -> tuple[list[str], str]:
    """Run ``run``'s problems (empty: it passed) and one line saying what it showed, from its engine's record and
    ``text``, its stdout and stderr; each ``kvdbg replay`` gets ``replay_seconds``."""
    label = f"sentinel {run}"
    files = snapshots(record["dir"])
    counts, steps = record.get("counts") or {}, record.get("steps")
    if record.get("problems"):  # the stage reports the run's own problems
        return [], "not judged: the engine run failed"
    if steps is None:
        return [f"{label}: the engine stopped before serving"], "not judged"
    problems = []
    if record.get("generated") != [sentinel_case.TOKENS] * sentinel_case.PROMPTS:
        problems.append(f"{label}: generated {record.get('generated')} tokens, expected "
                        f"{[sentinel_case.TOKENS] * sentinel_case.PROMPTS}")
    if counts.get("errors"):
        problems.append(f"{label}: {counts['errors']} check(s) failed or did not come back (see the warning)")
    if counts.get("checked") != steps:
        problems.append(f"{label}: the sentinel checked {counts.get('checked')} of the {steps} steps the plugin "
                        "counted (every step, at KVDBG_SENTINEL=1)")
    handed = (record.get("graph_steps") or {}).get("handed", 0)
    if RUNS[run][0] == "eager" and handed:
        problems.append(f"{label}: {handed} step(s) handed over from CUDA graphs in an eager engine")
    if run == "faults":
        with ThreadPoolExecutor(len(files) or 1) as pool:  # one process each, at once
            replays = dict(zip(files, pool.map(lambda path: cli_replay(path, replay_seconds), files)))
        found, caught, exit_line = sentinel_case.judge_faults(text, files, replay=replays.__getitem__, label=label)
        fired = sorted(kind for kind, _, _ in record.get("fired", []))
        if fired != sorted(sentinel_case.FAULTS):
            found.append(f"{label}: the faults that fired in the engine: {record.get('fired')}")
        return problems + found, f"caught {'; '.join(caught) or 'nothing'}; {exit_line}"
    found, exit_line = sentinel_case.judge_clean(text, files, steps, label=label)
    if RUNS[run][0] != "eager":
        if not handed:
            found.append(f"{label}: no step replayed from a CUDA graph was handed to the sentinel")
        elif (record.get("graph_steps") or {}).get("without_metadata"):
            found.append(f"{label}: {record['graph_steps']['without_metadata']} graph step(s) came without the "
                         "metadata of their build (not checked)")
    return problems + found, f"{exit_line}; {handed} of the {steps} steps from CUDA graphs; {len(files)} snapshot(s)"


__all__ = ["RUNS", "engine_run", "judge"]
