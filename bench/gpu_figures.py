"""Two GPU figures from one run, with the checks they rest on: time to verdict and the emulation's share.

Usage (on a CUDA machine, from the repository root, kvdbg installed:
``pip install --no-deps --no-build-isolation -e .``):

    python bench/gpu_figures.py [--out DIR] [--budget 560] [--parts flex,breakdown,verdict,tests,verdict_pyc]
                                [--tests changed|all]

Parts, each in its own process, in this order, each given what is left of
``--budget`` seconds (a part that cannot finish in it is stopped and reported):

- ``flex``: the bundled fixtures replayed on CUDA with the flex column's eager
  step evaluated by kvdbg (``KVDBG_FLEX_EAGER=kvdbg``, the CUDA default) and by
  torch's eager ``flex_attention`` (``=torch``), in one process, kvdbg first:
  each column says which ran, the outputs agree within 4 ulps of the model
  dtype (and whether bit for bit), the verdicts agree, and kvdbg's replays
  import none of torch._dynamo, torch._inductor, sympy beyond what
  ``import torch`` imported.
- ``breakdown`` (figure 5): ``bench/gpu_breakdown.py --iters 30 --json``; passes
  when FLASHINFER_TS's emulation, build + forward back to back, reaches >= 80 %
  of the memory-bound limit.
- ``verdict`` (figure 4): ``bench/cuda_verdict.py --runs 5 --backend reference
  --backend flashinfer_ts --backend flex --diagnose --json``; passes when the
  cold and the warm-median replay of fixtures/dflash are both <= 2x ``import
  torch`` + CUDA init, as the machine's Python runs them.
- ``tests``: the CUDA tests this work touches (``--tests all``: every CUDA test
  of tests/test_flex.py and tests/test_flashinfer_ts_triton.py).
- ``verdict_pyc``: figure 4 again with a bytecode cache (``--pycache``), as a
  normal ``pip install`` runs; reported, not counted.

Prints each part's lines as it ends, then one line of JSON (last): every
part's status and seconds, both figures, and ``passed``. Exit 0 only when
every counted part passes. ``--out DIR`` keeps each part's whole output and
the JSON there.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("flex", "breakdown", "verdict", "tests", "verdict_pyc")
COUNTED = ("flex", "breakdown", "verdict", "tests")
FIXTURES = ("dflash", "prefix_page0", "fp8_dense", "causal_gqa")
HEAVY = ("torch._dynamo", "torch._inductor", "sympy")
CHANGED_TESTS = "on_cuda or written_tokens or leaves_out"
RESERVE_S = 10  # kept back for the summary


# --------------------------------------------------------------------------- the flex part (runs in a child)


def flex_child(device: str) -> dict:
    """Replay the fixtures with kvdbg's eager evaluation, then torch's, on ``device``; compare. Returns the record."""
    import torch

    torch.zeros(1, device=device)
    at_start = [m for m in HEAVY if m in sys.modules]
    import kvdbg
    from kvdbg.backends import flex as flex_module

    record: dict = {"heavy_after_import_torch": at_start, "fixtures": {}}
    runs, errors = {}, {}
    for impl in ("kvdbg", "torch"):  # kvdbg first: torch's call imports Dynamo for the rest of the process
        os.environ[flex_module.FLEX_EAGER_ENV] = impl
        for name in FIXTURES:
            t0 = time.perf_counter()
            try:
                report = kvdbg.replay(os.path.join(HERE, "fixtures", f"{name}.safetensors"), ["flex"],
                                      device=device)
                kernel = [s.info.kernel for s in report.result.backends if s.name == "flex"][0]
                outputs = [step.runs["flex"].output for step in report.result.steps]
                runs[impl, name] = (report.verdict.status, kernel, outputs, time.perf_counter() - t0)
            except Exception:  # one fixture's failure must not hide the others
                errors[name] = f"{impl}: " + " | ".join(traceback.format_exc().strip().splitlines()[-3:])
        if impl == "kvdbg":
            record["heavy_added_by_kvdbg_eager"] = [m for m in HEAVY if m in sys.modules and m not in at_start]
    ok = not record["heavy_added_by_kvdbg_eager"]
    for name in FIXTURES:
        if name in errors:
            record["fixtures"][name] = {"ok": False, "error": errors[name]}
            ok = False
            continue
        (v_ours, k_ours, o_ours, s_ours), (v_theirs, k_theirs, o_theirs, _) = runs["kvdbg", name], runs["torch", name]
        close = equal = True
        worst = 0.0
        for a, b in zip(o_ours, o_theirs):
            eps = torch.finfo(b.dtype).eps
            close &= bool(torch.allclose(a.float(), b.float(), atol=4 * eps, rtol=4 * eps, equal_nan=True))
            equal &= bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()))
            worst = max(worst, float((a.float() - b.float()).abs().nan_to_num(0.0).max()) if a.numel() else 0.0)
        fixture_ok = (close and len(o_ours) == len(o_theirs) and v_ours == v_theirs
                      and k_ours == flex_module.EAGER_MATH_KERNEL and k_theirs == "flex_attention (eager)")
        record["fixtures"][name] = {"ok": fixture_ok, "within_4_ulps": close, "bit_equal": equal,
                                    "max_abs_diff": worst, "verdicts": [str(v_ours), str(v_theirs)],
                                    "kernels": [k_ours, k_theirs], "kvdbg_replay_s": round(s_ours, 3)}
        ok &= fixture_ok
    record["ok"] = ok
    return record


# --------------------------------------------------------------------------- the parent


def run_part(name: str, argv: list[str], timeout: float, out_dir: str | None) -> tuple[str, str, float]:
    """(status, output, seconds) of one part's child: status "ran", "timeout after N s" or "error: ...".

    The child leads its own process group, so a part stopped at its time limit takes the processes it
    started (a replay being timed) with it instead of leaving them to run beside the next part.
    """
    t0 = time.perf_counter()
    output = ""
    try:
        # Unbuffered: what a part printed before it was stopped still comes back.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE,
                                start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            output, _ = proc.communicate(timeout=max(1.0, timeout))
            status = "ran" if proc.returncode == 0 else f"error: exit {proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            status = f"timeout after {timeout:.0f} s"
    except Exception as exc:  # the part could not even start
        status = f"error: {type(exc).__name__}: {exc}"
    seconds = time.perf_counter() - t0
    if out_dir:
        with open(os.path.join(out_dir, f"{name}.log"), "w") as fh:
            fh.write(output)
    return status, output, seconds


def last_json(output: str) -> dict | None:
    for line in reversed(output.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def shown(output: str, limit: int = 40) -> str:
    """A part's output for the console: without its JSON line, at most ``limit`` last lines."""
    lines = [line for line in output.rstrip().splitlines() if not line.startswith("{")]
    return "\n".join(lines[-limit:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="directory for each part's whole output and the JSON")
    parser.add_argument("--budget", type=float, default=560.0, help="seconds for every part together")
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--tests", choices=["changed", "all"], default="changed")
    parser.add_argument("--flex-child", action="store_true", help=argparse.SUPPRESS)
    # cpu: a smoke run of this script's own logic with tiny sizes (its figures mean nothing)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flex_child:
        print(json.dumps(flex_child(args.device)))
        return 0
    start = time.perf_counter()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    py = sys.executable
    smoke = [] if args.device == "cuda" else ["--device", args.device]
    commands = {
        "flex": [py, os.path.join("bench", "gpu_figures.py"), "--flex-child"] + smoke,
        "breakdown": [py, os.path.join("bench", "gpu_breakdown.py"), "--iters", "30", "--json"] +
                     (smoke + ["--requests", "4", "--seq-len", "512"] if smoke else []),
        "verdict": [py, os.path.join("bench", "cuda_verdict.py"), "--runs", "5", "--backend", "reference",
                    "--backend", "flashinfer_ts", "--backend", "flex", "--diagnose", "--json"] + smoke,
        "tests": [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "tests/test_flex.py",
                  "tests/test_flashinfer_ts_triton.py"] + (["-k", CHANGED_TESTS] if args.tests == "changed" else []),
        "verdict_pyc": [py, os.path.join("bench", "cuda_verdict.py"), "--runs", "3", "--json", "--pycache",
                        os.path.join("/tmp", f"kvdbg-figures-pycache-{os.getpid()}")] + smoke,
    }
    summary: dict = {"parts": {}, "figure4": None, "figure5": None}
    for name in parts:
        left = args.budget - (time.perf_counter() - start) - RESERVE_S
        if left < 5:
            summary["parts"][name] = {"status": "skipped: budget spent", "counted": name in COUNTED}
            print(f"== {name}: skipped (budget spent)", flush=True)
            continue
        if name == "tests" and importlib.util.find_spec("pytest") is None:
            summary["parts"][name] = {"status": "skipped: pytest is not installed", "counted": False}
            print(f"== {name}: SKIPPED (pytest is not installed here; not counted)", flush=True)
            continue
        status, output, seconds = run_part(name, commands[name], left, args.out)
        record = last_json(output)
        part: dict = {"status": status, "seconds": round(seconds, 1), "counted": name in COUNTED}
        if name == "flex":
            part["passed"] = status == "ran" and bool(record and record.get("ok"))
            if record:  # the whole record is in the part's log; the summary keeps it short
                part["detail"] = {"heavy_added_by_kvdbg_eager": record.get("heavy_added_by_kvdbg_eager"),
                                  "fixtures": {f: r.get("error") or [r["ok"], r["bit_equal"], r["max_abs_diff"]]
                                               for f, r in record.get("fixtures", {}).items()}}
        elif name == "breakdown":
            part["passed"] = status == "ran" and bool(record and record.get("met"))
            if record:
                summary["figure5"] = {"share": (record.get("figure") or {}).get("share"),
                                      "ms": (record.get("figure") or {}).get("ms"), "limit_ms": record.get("limit_ms"),
                                      "target": record.get("target"), "met": record.get("met"),
                                      "emulator": record.get("emulator"), "errors": record.get("errors")}
        elif name in ("verdict", "verdict_pyc"):
            part["passed"] = status == "ran" and bool(record and record.get("met"))
            if record:
                key = "figure4" if name == "verdict" else "figure4_pyc"
                summary[key] = {k: record.get(k) for k in ("regime", "baseline_median_s", "cold_s", "cold_ratio",
                                                            "warm_median_s", "warm_ratio", "target", "met")}
                summary[key]["ran"] = {b: str(k)[:60] for b, k in (record.get("ran") or {}).items()}
                summary[key]["per_backend"] = {b: round(v["ratio"], 3)
                                               for b, v in (record.get("per_backend") or {}).items()}
                if record.get("dynamo_baseline_s"):
                    summary[key]["dynamo_baseline_s"] = record["dynamo_baseline_s"]
        else:  # tests: pytest's own exit code
            part["passed"] = status == "ran"
            part["tail"] = output.strip().splitlines()[-1:] if output.strip() else []
        summary["parts"][name] = part
        verdict = "PASS" if part["passed"] else "FAIL"
        print(f"== {name}: {verdict} ({status}, {seconds:.0f} s{'' if part['counted'] else ', not counted'})")
        if name == "flex" and record:
            for fixture, r in record["fixtures"].items():
                if "error" in r:
                    print(f"  {fixture}: FAILED {r['error']}")
                    continue
                print(f"  {fixture}: ok={r['ok']} bit_equal={r['bit_equal']} max_abs_diff={r['max_abs_diff']:.3g} "
                      f"kernels={r['kernels']} verdicts={r['verdicts']} kvdbg replay {r['kvdbg_replay_s']} s")
            print(f"  heavy modules after import torch: {record['heavy_after_import_torch']}; "
                  f"added by kvdbg's eager replays: {record['heavy_added_by_kvdbg_eager']}")
        else:
            text = shown(output, 15 if name == "tests" else 45)
            if text:
                print(text)
        sys.stdout.flush()
    counted = [p for p in summary["parts"].values() if p["counted"]]
    summary["passed"] = bool(counted) and all(p.get("passed") for p in counted)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    line = json.dumps(summary, default=str)
    if args.out:
        with open(os.path.join(args.out, "summary.json"), "w") as fh:
            fh.write(line + "\n")
    print(line)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
