"""The engine stage's sentinel runs: a real vLLM (CPU_ATTN) checks its own attention on every step.

Two engines, each with ``KVDBG_SENTINEL=1`` (every step of both layers), every
(request, head) pair checked and no interval between captures:

    clean    no fault: over the whole run the sentinel writes nothing and says it checked every step
    faults   the test-only faults of tests/engine/sentinel_faults.py at three steps of the run:
             one head's output corrupted, a block-table entry wrong for the kernel only, NaN in a page.
             Each is caught at its step, its snapshot is written with the finding in its notes and one
             log line names the file and the first failing (request, head); ``kvdbg replay`` on each
             fails naming the fault (captured vs reference on the corrupted head or request, or the
             non-finite page)
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)

# kind -> (layer, step). Distinct steps and layers; the NaN comes last and on the last layer, because it
# stays in the cache (later steps of that layer repeat its signature and are deduplicated) and layer 1's
# output feeds only the logits, so nothing upstream turns NaN.
FAULTS = {"head": (1, 5), "page": (0, 8), "nan": (1, 11)}
LAYER = "model.layers.{}.self_attn.attn"
PROMPTS, TOKENS = 4, 16

SENTINEL_RUN = """
import sys
if sys.argv[2]:
    from tests.engine import sentinel_faults
    sentinel_faults.install(sys.argv[2])
from vllm import LLM, SamplingParams

def main():
    model, prompts, tokens = sys.argv[1], int(sys.argv[3]), int(sys.argv[4])
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=512,
              num_gpu_blocks_override=64, seed=0, gpu_memory_utilization=0.25)
    batch = [{"prompt_token_ids": [3 + (i * 37 + j * 101) % 500 for i in range(40 + 7 * j)]} for j in range(prompts)]
    out = llm.generate(batch, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), use_tqdm=False)
    print("generated", [len(o.outputs[0].token_ids) for o in out], flush=True)

if __name__ == "__main__":
    main()
"""

SENTINEL_LINE = re.compile(r"kvdbg sentinel: layer (\S+) step (\d+) is wrong.*first failing request (\d+) head (\d+)"
                           r".*snapshot (\S+\.safetensors)")
EXIT_LINE = re.compile(r"kvdbg sentinel in pid \d+: checked (\d+) step\(s\) \((\d+) .*?\), (\d+) wrong, (\d+) captured")


def _engine(out: str, model_dir: str, name: str, faults: str, env_base: dict) -> tuple[int, str, str, float]:
    directory = os.path.join(out, "plain", f"sentinel_{name}")
    env = dict(env_base, KVDBG_SENTINEL="1", KVDBG_SENTINEL_DIR=directory, KVDBG_SENTINEL_PAIRS="64",
               KVDBG_SENTINEL_INTERVAL="0", KVDBG_CAPTURE_BACKENDS="CPU_ATTN", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SENTINEL_RUN, model_dir, faults, str(PROMPTS), str(TOKENS)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    took = time.monotonic() - t0
    text = proc.stdout + proc.stderr
    with open(os.path.join(out, "logs", f"plain-sentinel_{name}.log"), "w") as f:
        f.write(text)
    ok = proc.returncode == 0 and "generated" in proc.stdout
    return (0 if ok else proc.returncode or 1), directory, text, took


def _snapshots(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".safetensors"))


def _replay(path: str) -> tuple[int, dict]:
    proc = subprocess.run([os.path.join(BIN, "kvdbg"), "replay", "--json", path], capture_output=True, text=True)
    try:
        return proc.returncode, json.loads(proc.stdout)
    except ValueError:
        return proc.returncode, {"error": proc.stderr.strip()[:300]}


def _failed_heads(data: dict) -> list[tuple[int, int]]:
    for comp in data.get("comparisons", []):
        if comp.get("actual") == "captured" and comp.get("expected") == "reference":
            return sorted((h["request"], h["head"]) for h in comp.get("heads", []) if not h.get("passed"))
    return []


def judge_clean(text: str, files: list[str], min_checked: int, label: str = "sentinel clean") -> tuple[list[str], str]:
    """A clean run, from its log and the snapshots in its directory: nothing written, one exit line with at least
    ``min_checked`` steps checked and none wrong, no layer the sentinel cannot check. (problems, the exit line)"""
    problems = []
    exits = [m for m in map(EXIT_LINE.search, text.splitlines()) if m]
    if files or len(exits) != 1 or int(exits[0][3]) or int(exits[0][4]) or int(exits[0][1]) < min_checked:
        problems.append(f"{label}: expected no snapshot and one exit line with every step checked and none "
                        f"wrong; got {len(files)} file(s), exit lines {[m[0] for m in exits]}")
    cannot = [line for line in text.splitlines() if "kvdbg sentinel cannot check" in line]
    if cannot:
        problems.append(f"{label}: {cannot[0][-200:]}")
    return problems, exits[0][0] if exits else "no exit line"


def judge_faults(text: str, files: list[str], faults: dict[str, tuple[int, int]] = FAULTS, replay=None,
                 label: str = "sentinel faults") -> tuple[list[str], list[str], str]:
    """A run with ``faults`` (kind -> (layer, step)), from its log and the snapshots in its directory: each fault
    fired once and was captured once at its layer and step, with the finding in the snapshot's notes and a log
    line naming the file; ``replay(path) -> (exit code, JSON)`` of each exits 1 and fails the corrupted head
    (head), request 0 (page) or names the non-finite page (nan); the exit line counts one capture per fault.
    (problems, what was caught, the exit line)"""
    from kvdbg.snapshot.store import load_snapshot

    from tests.engine.sentinel_faults import CORRUPTED_HEAD

    replay = replay or _replay
    problems = []
    fired = re.findall(r"sentinel fault fired: (\w+) (\S+) step (\d+)", text)
    if sorted(kind for kind, _, _ in fired) != sorted(faults):
        problems.append(f"{label}: the shim fired {fired}, expected {faults}")
    lines = {(m[1], int(m[2])): m for m in map(SENTINEL_LINE.search, text.splitlines()) if m}
    got = {}
    for path in files:
        meta = load_snapshot(path).meta
        got[meta.layer.name, meta.capture.get("step")] = (path, meta)
    want = {(LAYER.format(layer), step): kind for kind, (layer, step) in faults.items()}
    if sorted(got) != sorted(want):
        problems.append(f"{label}: expected snapshots of {sorted(want)}, got {sorted(got)}")
    caught = []
    for key, kind in sorted(want.items(), key=lambda kv: kv[0][1]):
        if key not in got:
            continue
        path, meta = got[key]
        line = lines.get(key)
        if line is None or os.path.abspath(line[5]) != os.path.abspath(path):
            problems.append(f"{label}: {kind}: no log line naming {os.path.basename(path)}")
        if not meta.notes.startswith(f"kvdbg sentinel, layer {key[0]} step {key[1]}:"):
            problems.append(f"{label}: {kind}: the snapshot's notes do not hold the finding: {meta.notes[:160]}")
        code, data = replay(path)
        failed = _failed_heads(data)
        codes = sorted({f.get("code") for f in data.get("findings", []) if f.get("severity") == "error"})
        if code != 1:
            problems.append(f"{label}: {kind}: kvdbg replay exit {code}, expected 1 (a failing step)")
        if kind == "head" and (not failed or {h for _, h in failed} != {CORRUPTED_HEAD}):
            problems.append(f"{label}: head: replay's captured vs reference failures {failed}, expected head "
                            f"{CORRUPTED_HEAD} only")
        if kind == "page" and (not failed or {r for r, _ in failed} != {0}):
            problems.append(f"{label}: page: replay's captured vs reference failures {failed}, expected "
                            "request 0 only")
        if kind == "nan" and "nonfinite_kv" not in codes:
            problems.append(f"{label}: nan: replay's error findings {codes} do not name the non-finite page")
        first = f"request {line[3]} head {line[4]}" if line else "?"
        caught.append(f"{kind}@{key[1]} ({first}; replay exit {code}, "
                      + (f"captured vs reference fails {len(failed)} pair(s)" if kind != "nan" else
                         f"findings {','.join(codes)}") + ")")
    exits = [m for m in map(EXIT_LINE.search, text.splitlines()) if m]
    if len(exits) != 1 or int(exits[0][4]) != len(faults):
        problems.append(f"{label}: expected one exit line with {len(faults)} captured; got {[m[0] for m in exits]}")
    return problems, caught, exits[0][0] if exits else "no exit line"


def sentinel_runs(out: str, model_dir: str, log, env_base: dict) -> list[str]:
    """The clean run and the fault run; the problems found (empty: both passed)."""
    problems = []
    rc, directory, text, took = _engine(out, model_dir, "clean", "", env_base)
    files = _snapshots(directory)
    found, exit_line = judge_clean(text, files, 2 * TOKENS)
    if rc != 0:
        problems.append(f"sentinel clean: the engine did not serve (exit {rc}); see logs/plain-sentinel_clean.log")
    else:
        problems += found
    log(f"plain LLM() sentinel clean    {took:5.1f} s: {exit_line}; {len(files)} snapshot(s)")

    spec = ",".join(f"{kind}:{layer}:{step}" for kind, (layer, step) in FAULTS.items())
    rc, directory, text, took = _engine(out, model_dir, "faults", spec, env_base)
    if rc != 0:
        return problems + [f"sentinel faults: the engine did not serve (exit {rc}); see logs/plain-sentinel_faults.log"]
    found, caught, exit_line = judge_faults(text, _snapshots(directory))
    log(f"plain LLM() sentinel faults   {took:5.1f} s: caught {'; '.join(caught) or 'nothing'}; {exit_line}")
    return problems + found
