"""The checks of tests/gpu/graph_stage.py, each run in a child process of its own once its engines are done.

Each reads the engines' records (what the probes saw: every served step's requests, tokens and lengths as the
scheduler counts them, the graph it was replayed from, the calls made during it) and the snapshots on disk, and
returns problems (the stage fails) and warnings (it says them).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter

from tests.gpu import graph_plan
from tests.gpu.engine_stage import judge

LOG_PATTERN = re.compile(r"kvdbg sentinel: layer (\S+) step (\d+) is wrong \((.*?)\): first failing request (\d+) "
                         r"head (\d+); (.*)$")
MIN_GRAPH_STEPS = 20  # wanted steps that must have been replayed from full graphs, per graph engine
ULPS_WARN = 8  # a float tensor further from the eager one than this (units in the last place) is said
ULPS_FAIL = 64  # and fails the stage past this
# What fails a piecewise attempt that served (the rest of the pair's checks is said only).
PIECEWISE_FAILURES = ("does not replay PASS", "engine_stage.judge", "unwanted steps", "without a snapshot",
                      "not judged", "attention forward(s)", "capture dropped", "capture failures")


def collapse(lines: list[str]) -> list[str]:
    """Problems that differ only in their layer and step numbers, said once with how many more there are."""
    groups: dict[str, list[str]] = {}
    for line in lines:
        key = re.sub(r"layers\.\d+|step \d+|\d+(\.\d+)?(e[-+]?\d+)?", "#", line)
        groups.setdefault(key, []).append(line)
    return [group[0] + (f" (and {len(group) - 1} more like it)" if len(group) > 1 else "")
            for group in groups.values()]


def read_record(out: str, name: str) -> dict:
    path = os.path.join(out, "records", f"{name}.json")
    if not os.path.exists(path):
        return {"name": name, "problems": ["no record: the engine did not run"], "served": False}
    with open(path) as fh:
        return json.load(fh)


def write_json(out: str, name: str, data: dict) -> str:
    os.makedirs(os.path.join(out, "records"), exist_ok=True)
    path = os.path.join(out, "records", f"{name}.json")
    with open(path + ".tmp", "w") as fh:
        json.dump(data, fh, default=str)
    os.replace(path + ".tmp", path)
    return path



def load_index(directory: str) -> tuple[dict, list[str]]:
    """``{(layer, step): path}`` of the snapshots in ``directory`` and the files that are not one (or twice one)."""
    from kvdbg import api

    index, odd = {}, []
    if not os.path.isdir(directory):
        return index, odd
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".safetensors"):
            odd.append(name)
            continue
        meta = api.load(path).meta
        key = (meta.layer.name, int(meta.capture.get("step")))
        if key in index:
            odd.append(name)
        index[key] = path
    return index, odd


def files_check(record: dict, index: dict, odd: list[str]) -> list[str]:
    """Exactly the wanted (layer, step) snapshots, nothing else."""
    if "base" not in record:
        return ["no start-up count: the wanted steps are unknown"]
    wanted = {(layer, record["base"] + s) for layer in record["layers"] for s in record["wanted_rel"]}
    found = set(index)
    problems = []
    if found - wanted:
        problems.append(f"{len(found - wanted)} snapshot(s) of unwanted steps: {sorted(found - wanted)[:6]}")
    if wanted - found:
        problems.append(f"{len(wanted - found)} wanted step(s) without a snapshot: {sorted(wanted - found)[:6]}")
    if odd:
        problems.append(f"other files in the capture directory: {odd[:6]}")
    return problems


def rel_steps(record: dict) -> dict[int, dict]:
    """The served steps by their number counted from the first served step."""
    base = record.get("base", 0)
    return {s["kvdbg_step"] - base: s for s in record.get("steps", [])}


def replayed(step: dict) -> dict | None:
    """The full graph a served step was replayed from (None: it ran in Python)."""
    return next((g for g in step.get("graphs", []) if g["kind"] == "replay"), None)


def graph_size(step: dict, cpu: bool = False) -> int | None:
    """The full graph a step was replayed from (its token count); in the dry run, the graph it would have been."""
    graph = replayed(step)
    if graph is not None:
        return graph["num_tokens"]
    return graph_plan.padded(sum(r[1] for r in step["rows"])) if cpu else None


def shape_of(step: dict) -> graph_plan.StepShape:
    return graph_plan.StepShape([graph_plan.Row(n, t, s, bool(d)) for n, t, s, d in step["rows"] if t])


def python_per_layer(record: dict, layers: int) -> tuple[list[str], dict]:
    """No attention forward and no per-layer kvdbg hook during a replayed step; kvdbg's graph hook once (the replay's
    hook, or a quiet run's count)."""
    problems, counts = [], Counter()
    for rel, step in sorted(rel_steps(record).items()):
        if replayed(step) is None:
            counts["eager_steps"] += 1
            counts["eager_forward_calls"] += step["forward_calls"]
            continue
        counts["replayed_steps"] += 1
        counts["forward_calls_in_replayed_steps"] += step["forward_calls"]
        counts["kvdbg_layer_hooks_in_replayed_steps"] += step["layer_hooks"]
        counts["kvdbg_graph_hooks"] += step["graph_hooks"]
        counts["told_quiet_ahead"] += step.get("quiet_replays", 0)
        if step["forward_calls"] or step["layer_hooks"] or step["forward_in_replay"] or step["graph_hooks"] != 1:
            problems.append(f"step {rel} (replayed from the {replayed(step)['num_tokens']}-token graph): "
                            f"{step['forward_calls']} attention forward(s), {step['layer_hooks']} per-layer kvdbg "
                            f"hook call(s), {step['graph_hooks']} graph hook call(s) (want 0, 0, 1)")
    if counts["eager_steps"] and counts["eager_forward_calls"] != counts["eager_steps"] * layers:
        problems.append(f"{counts['eager_forward_calls']} attention forwards in {counts['eager_steps']} eager steps "
                        f"of {layers} layers: the counting wrapper missed some")
    return problems, dict(counts)


def token_check(eager: dict, graph: dict) -> tuple[list[str], dict[str, int]]:
    """The two engines' tokens per request; the first diverging index of each request that diverged."""
    problems, diverged = [], {}
    a, b = eager.get("outputs", {}), graph.get("outputs", {})
    if set(a) != set(b):
        problems.append(f"requests finished differ: {sorted(a)} vs {sorted(b)}")
    for name in sorted(set(a) & set(b)):
        at = graph_plan.first_divergence(a[name], b[name])
        if at is not None:
            diverged[name] = at
            problems.append(f"request {name}: tokens differ from generated token {at} on "
                            f"({a[name][at:at + 3]} vs {b[name][at:at + 3]})")
    return problems, diverged


def schedule_check(eager: dict, graph: dict, plan_name: str) -> tuple[list[str], list[str]]:
    """Both engines ran the same batches (requests, tokens, lengths) in the same order; warnings where the plan's
    model of the scheduler says otherwise."""
    problems, warnings = [], []
    a, b = rel_steps(eager), rel_steps(graph)
    if sorted(a) != sorted(b):
        problems.append(f"served steps differ: {len(a)} vs {len(b)}")
    for rel in sorted(set(a) & set(b)):
        if a[rel]["rows"] != b[rel]["rows"]:
            problems.append(f"step {rel}: batches differ: {a[rel]['rows']} vs {b[rel]['rows']}")
            break
    plan, _ = graph_plan.PLANS[plan_name]
    model = graph_plan.simulate(plan)
    seen = [sorted((n, t, s) for n, t, s, _ in step["rows"] if t) for _, step in sorted(a.items())]
    said = [sorted((r.name, r.tokens, r.seq_len) for r in shape.rows) for shape in model]
    if seen != said:
        first = next((i for i, (x, y) in enumerate(zip(seen, said)) if x != y), min(len(seen), len(said)))
        warnings.append(f"the engine's batches differ from graph_plan.simulate's from step {first} "
                        f"(the checks use the engine's own account)")
    return problems, warnings


def request_rows(snapshot, rows: list) -> list[str]:
    """The request name of each row of a one-step snapshot (rows with tokens, in batch order, as the probe saw)."""
    names = [r[0] for r in rows if r[1]]
    if len(names) != snapshot.steps[0].num_reqs:
        raise ValueError(f"the snapshot has {snapshot.steps[0].num_reqs} requests, the step {len(names)}")
    return names


def compare_snapshots(e_path: str, g_path: str, e_rows: list, g_rows: list, diverged: dict, prompt_lens: dict,
                      floats_matter: bool = True, from_graph: bool = True) -> dict:
    """The graph engine's snapshot of a batch against the eager engine's, request by request (``from_graph``: the
    graph engine replayed this step from a full graph, so its snapshot holds the pages after the update and no
    new K/V; an eager snapshot holds the pages before it and the new K/V, which are written here first)."""
    import torch

    from kvdbg import api
    from kvdbg.snapshot.cache import apply_step_update

    E, G = api.load(e_path), api.load(g_path)
    result = {"problems": [], "floats": {}, "excluded_rows": 0}
    problems = result["problems"]
    if E.meta.layer != G.meta.layer:
        problems.append(f"layer metadata differs: {E.meta.layer} vs {G.meta.layer}")
    backend_fields = ("page_size", "max_model_len", "num_gpu_blocks", "max_decode_query_len", "max_num_seqs",
                      "max_num_batched_tokens")
    for name in backend_fields:
        if getattr(E.meta.backend, name) != getattr(G.meta.backend, name):
            problems.append(f"backend.{name} differs: {getattr(E.meta.backend, name)} vs {getattr(G.meta.backend, name)}")
    es, gs = E.steps[0], G.steps[0]
    e_names, g_names = request_rows(E, e_rows), request_rows(G, g_rows)
    exact = {n: bool(torch.equal(getattr(es, n), getattr(gs, n))) for n in ("block_table", "seq_lens",
                                                                             "query_start_loc")}
    exact["page_ids"] = bool(torch.equal(E.page_ids, G.page_ids))
    result["byte_exact"] = exact
    if e_names == g_names and not all(exact.values()):
        problems.append(f"metadata not byte-exact: {[n for n, ok in exact.items() if not ok]}")
    if from_graph and gs.slot_mapping is not None:
        problems.append("the graph snapshot carries new K/V: a graph replay hands none over")
    e_cache, g_cache = E.kv_cache.clone(), G.kv_cache.clone()
    apply_step_update(E, e_cache, 0)  # an eager snapshot holds the pages before the update, and its new K/V
    apply_step_update(G, g_cache, 0)
    e_k, e_v = E.kv_views(e_cache)
    g_k, g_v = G.kv_views(g_cache)
    ps = E.page_size
    kv_dtype = e_k.dtype
    stats = {k: graph_plan.FloatComparison() for k in ("query", "output", "pages")}
    e_qsl, g_qsl = es.query_start_loc.tolist(), gs.query_start_loc.tolist()
    for i, name in enumerate(e_names):
        if name not in g_names:
            problems.append(f"request {name} is not in the graph snapshot")
            continue
        j = g_names.index(name)
        length = int(es.seq_lens[i])
        # The lengths kvdbg recorded against the scheduler's own count (not read from any buffer a kernel reads).
        want = [r[2] for r in e_rows if r[1] and r[0] == name][0]
        if length != want or int(gs.seq_lens[j]) != want:
            problems.append(f"request {name}: seq_len {length} (eager) / {int(gs.seq_lens[j])} (graph), the "
                            f"scheduler counted {want}")
        pages = -(-length // ps)
        if not torch.equal(es.block_table[i, :pages], gs.block_table[j, :pages]):
            problems.append(f"request {name}: block table rows differ")
            continue
        if e_qsl[i + 1] - e_qsl[i] != g_qsl[j + 1] - g_qsl[j]:
            problems.append(f"request {name}: query lengths differ")
            continue
        if name in diverged and length > prompt_lens[name] + diverged[name]:
            result["excluded_rows"] += 1  # its input holds a token the engines sampled differently
            continue
        stats["query"].add(graph_plan.compare_floats(gs.query[g_qsl[j]:g_qsl[j + 1]],
                                                     es.query[e_qsl[i]:e_qsl[i + 1]]))
        if es.output is not None and gs.output is not None:
            stats["output"].add(graph_plan.compare_floats(gs.output[g_qsl[j]:g_qsl[j + 1]],
                                                          es.output[e_qsl[i]:e_qsl[i + 1]]))
        for p in range(pages):
            page = int(es.block_table[i, p])
            if page == 0:  # vLLM's null block (a page before the sliding window): nothing is read there
                continue
            live = min(ps, length - p * ps)
            se = int(E.to_stored_index(torch.tensor([page]))[0])
            sg = int(G.to_stored_index(torch.tensor([page]))[0])
            for a, b in ((g_k, e_k), (g_v, e_v)):
                stats["pages"].add(graph_plan.compare_floats(a[sg, :, :live], b[se, :, :live], kv_dtype))
    result["floats"] = {k: v.to_json() for k, v in stats.items()}
    if es.output is None or gs.output is None:
        problems.append("a snapshot holds no engine output")
    worst = max((v.max_ulps for v in stats.values()), default=0.0)
    result["max_ulps"] = worst
    if floats_matter and worst > ULPS_FAIL:
        problems.append(f"floats differ by up to {worst:.3g} units in the last place (> {ULPS_FAIL}): "
                        f"{ {k: round(v.max_ulps, 1) for k, v in stats.items()} }")
    return result


def replay_verdict(path: str, device: str) -> dict:
    """captured vs reference (vLLM's kernel output against exact attention): passed, failing requests, errors."""
    from kvdbg import api

    data = api.replay(path, ["reference"], device=device).to_json()
    comp = next((c for c in data.get("comparisons", []) if (c["actual"], c["expected"]) == ("captured", "reference")),
                None)
    errors = [f"{f.get('backend')}:{f.get('code')}" for f in data.get("findings", []) if f.get("severity") == "error"]
    if comp is None:
        return {"passed": False, "failing_requests": [], "errors": errors, "note": "no captured vs reference"}
    failing = sorted({h["request"] for h in comp.get("heads", []) if not h.get("passed")})
    return {"passed": bool(comp.get("heads")) and not failing and not errors, "failing_requests": failing,
            "errors": errors, "max_abs": comp.get("max_abs")}


def cli_replay(path: str, device: str) -> dict:
    """``kvdbg replay SNAP`` as a user types it (reference only): its exit code and its comparison rows."""
    done = subprocess.run([sys.executable, "-m", "kvdbg", "replay", path, "--backend", "reference", "--device",
                           device], capture_output=True, text=True, timeout=300)
    rows = [ln.strip() for ln in done.stdout.splitlines() if "captured vs reference" in ln or ln.startswith("FAIL")]
    return {"exit": done.returncode, "rows": rows[:4], "stderr": done.stderr.strip().splitlines()[-3:]}


def judge_sample(index: dict, steps: dict, base: int, limit: int) -> list[str]:
    """Snapshots to judge with engine_stage.judge: one per (kind, graph size) of the last layer first, then more."""
    picked, seen = [], set()
    keys = sorted(index, key=lambda k: (k[0] != max(x[0] for x in index), k[1]))
    for layer, step in keys:
        info = steps.get(step - base)
        graph = replayed(info) if info else None
        tag = (shape_of(info).kind if info else "?", graph["num_tokens"] if graph else None)
        if tag not in seen:
            seen.add(tag)
            picked.append(index[(layer, step)])
    for key in keys:
        if len(picked) >= limit:
            break
        if index[key] not in picked:
            picked.append(index[key])
    return picked[:limit]


def check_pair(out: str, model: str, eager_name: str, graph_name: str, args) -> dict:
    """Eager against graph engine of one model: every check of the comparison parts."""
    records = {n: read_record(out, n) for n in (eager_name, graph_name)}
    eager, graph = records[eager_name], records[graph_name]
    result = {"check": f"pair:{model}", "eager": eager_name, "graph": graph_name, "problems": [], "warnings": [],
              "graph_mode": graph.get("cudagraph_mode")}
    problems, warnings = result["problems"], result["warnings"]
    piecewise = graph_name.startswith("piecewise-")
    for rec in (eager, graph):
        problems += [f"{rec['name']}: {p}" for p in rec.get("problems", [])]
        outside = [k for k, inside in rec.get("probes_inside_kvdbg", {}).items() if not inside]
        if outside:
            problems.append(f"{rec['name']}: kvdbg's wrappers do not call the probes of {outside} (installed "
                            "after kvdbg's?): what is counted is not what kvdbg sees")
        for what in ("dropped", "failures"):
            if rec.get(what):
                problems.append(f"{rec['name']}: capture {what}: {rec[what]}")
    if not (eager.get("served") and graph.get("served")):
        return result
    if graph.get("requested_mode"):
        warnings.append(f"{graph_name}: vLLM refused {graph['requested_mode']} ({graph.get('fallback_reason')}); "
                        f"ran {graph['mode']}")
    p, diverged = token_check(eager, graph)
    result["diverged"] = diverged
    (warnings if args.allow_token_divergence else problems).extend(p)
    p, w = schedule_check(eager, graph, eager["plan"])
    problems += p
    warnings += w
    e_index, e_odd = load_index(os.path.join(out, eager_name, "snapshots"))
    g_index, g_odd = load_index(os.path.join(out, graph_name, "snapshots"))
    problems += [f"{eager_name}: {p}" for p in files_check(eager, e_index, e_odd)]
    problems += [f"{graph_name}: {p}" for p in files_check(graph, g_index, g_odd)]
    e_steps, g_steps = rel_steps(eager), rel_steps(graph)
    layers = len(graph["layers"])
    wanted = graph["wanted_rel"]
    # Which wanted steps the graph engine replayed from full graphs, and what they were.
    replays = {rel: replayed(g_steps[rel]) for rel in wanted if rel in g_steps}
    from_graphs = [rel for rel, g in replays.items() if g is not None]
    result["graph_steps"] = {"wanted": len(wanted), "replayed_from_graphs": len(from_graphs),
                             "by_graph": dict(Counter(f"{shape_of(g_steps[r]).kind} {len(shape_of(g_steps[r]).rows)}"
                                                      f"->{replays[r]['num_tokens']}" for r in from_graphs)),
                             "recorded_graphs": graph.get("recorded_graphs"),
                             "graph_variants": graph.get("graph_variants")}
    if not args.cpu and not piecewise:
        if len(from_graphs) < MIN_GRAPH_STEPS:
            problems.append(f"only {len(from_graphs)} wanted step(s) were replayed from full graphs "
                            f"(want >= {MIN_GRAPH_STEPS})")
        gaps = graph_plan.coverage_gaps([shape_of(g_steps[r]) for r in from_graphs])
        problems += [f"among the steps replayed from graphs: {g}" for g in gaps]
        if from_graphs and not (graph.get("graph_variants") or {}).get("recorded"):
            problems.append("no full graph was recorded a second time without kvdbg's copies: every step replayed "
                            "the graph with them")
        if from_graphs and not (graph.get("graph_variants") or {}).get("staged_in_graph"):
            problems.append("no wanted step was staged inside vLLM's graph (its variant with kvdbg's staging): "
                            "every one was staged by the engine's thread after the replay")
        if graph.get("cudagraph_mode") != graph["mode"]:
            warnings.append(f"vLLM resolved cudagraph_mode {graph['mode']} to {graph.get('cudagraph_mode')}")
    p, counts = python_per_layer(graph, layers)
    result["python_per_layer"] = counts
    problems += p
    # Every wanted (layer, step): the graph snapshot against the eager one of the same batch.
    base_e, base_g = eager.get("base", 0), graph.get("base", 0)
    prompt_lens = {a.name: a.prompt_len for a in graph_plan.PLANS[eager["plan"]][0]}
    totals = {k: graph_plan.FloatComparison() for k in ("query", "output", "pages")}
    compared, excluded, worst, exact = 0, 0, 0.0, Counter()
    notes_wrong = []
    for layer in graph["layers"]:
        for rel in wanted:
            ek, gk = (layer, base_e + rel), (layer, base_g + rel)
            if ek not in e_index or gk not in g_index or rel not in e_steps or rel not in g_steps:
                continue
            try:
                res = compare_snapshots(e_index[ek], g_index[gk], e_steps[rel]["rows"], g_steps[rel]["rows"],
                                        diverged, prompt_lens, floats_matter=not piecewise,
                                        from_graph=replays.get(rel) is not None)
            except Exception as exc:
                problems.append(f"{layer} step {rel}: comparison failed: {exc!r}"[:300])
                continue
            compared += 1
            excluded += res["excluded_rows"]
            worst = max(worst, res["max_ulps"])
            exact.update(k for k, ok in res["byte_exact"].items() if ok)
            for k, v in res["floats"].items():
                totals[k].add(graph_plan.FloatComparison(v["elements"], v["bit_equal"], v["max_ulps"], v["max_abs"]))
            problems += [f"{layer} step {rel}: {p}" for p in res["problems"]]
            from_graph = "full CUDA graph" in load_notes(g_index[gk])
            if (replays.get(rel) is not None) != from_graph and not args.cpu:
                notes_wrong.append(rel)
    result["compared"] = {"pairs": compared, "byte_exact": dict(exact), "excluded_rows": excluded,
                          "floats": {k: v.to_json() for k, v in totals.items()}}
    if notes_wrong:
        problems.append(f"snapshot notes disagree with the replays for steps {sorted(set(notes_wrong))[:8]}")
    if worst > ULPS_WARN:
        warnings.append(f"floats differ from the eager engine's by up to {worst:.3g} units in the last place")
    # Judged: every graph snapshot against the reference; a sample with engine_stage.judge (vllm column too).
    deadline = args.deadline
    device = "cpu" if args.cpu else "cuda"
    judged, failed, skipped = 0, [], 0
    for key in sorted(g_index):
        if time.time() > deadline - 5:
            skipped += 1
            continue
        try:
            verdict = replay_verdict(g_index[key], device)
        except Exception as exc:  # one snapshot that cannot be replayed is that snapshot's failure
            verdict = {"passed": False, "error": repr(exc)[:200]}
        judged += 1
        if not verdict["passed"]:
            failed.append(f"{key[0]} step {key[1] - base_g}: {verdict}")
    result["replayed_vs_reference"] = {"judged": judged, "failed": len(failed), "skipped_for_time": skipped}
    problems += [f"{graph_name} snapshot does not replay PASS: {f}"[:300] for f in failed]
    if skipped:
        problems.append(f"{skipped} graph snapshot(s) not judged within the time budget")
    sample = judge_sample(g_index, g_steps, base_g, args.judge_max)
    full, full_failed = 0, []
    for path in sample:
        if time.time() > deadline - 10:
            break
        full += 1
        try:
            found = judge(path, device)
        except Exception as exc:
            found = [f"judge raised {exc!r}"[:200]]
        if found:
            full_failed.append(f"{os.path.basename(path)}: {found}")
    result["engine_stage_judge"] = {"judged": full, "failed": len(full_failed)}
    problems += [f"engine_stage.judge: {f}"[:300] for f in full_failed[:4]]
    result["problems"] = collapse(problems)
    return result


def _passes(path: str, device: str) -> bool:
    try:
        return replay_verdict(path, device)["passed"]
    except Exception:
        return False


def load_notes(path: str) -> str:
    from kvdbg import api

    return api.load(path).meta.notes


def check_fault(out: str, name: str, args) -> dict:
    """The graph-only fault: caught by the sentinel on the faulty graph's steps only, its snapshots FAIL naming
    requests whose length was stale, the other graphs' steps clean; kvdbg's lengths are the scheduler's."""
    record = read_record(out, name)
    result = {"check": "fault", "problems": [], "warnings": []}
    problems, warnings = result["problems"], result["warnings"]
    problems += [f"{name}: {p}" for p in record.get("problems", [])]
    if not record.get("served"):
        return result
    device = "cpu" if args.cpu else "cuda"
    fault = record.get("fault", [])
    result["fault_recorded"] = fault
    if len(fault) != 1:
        problems.append(f"the fault wrapper fired {len(fault)} time(s) while graphs were recorded (want 1)")
    stale = fault[0]["stale_seq_lens"] if fault else []
    steps = rel_steps(record)
    base = record["base"]
    sizes = {base + rel: graph_size(s, args.cpu) for rel, s in steps.items()}
    faulty = sorted(step for step, size in sizes.items() if size == graph_plan.FAULT_GRAPH_SIZE)
    result["steps"] = {"faulty_graph": len(faulty), "other": len(sizes) - len(faulty),
                       "other_graphs": sorted({s for s in sizes.values() if s} - {graph_plan.FAULT_GRAPH_SIZE})}
    if not faulty:
        problems.append(f"no step was replayed from the {graph_plan.FAULT_GRAPH_SIZE}-token graph")
    by_step = {base + rel: s for rel, s in steps.items()}
    sentinel = record.get("sentinel") or {}
    findings = sentinel.get("findings", [])
    counts = sentinel.get("counts", {})
    result["sentinel"] = {"counts": counts, "findings": len(findings)}
    layers = record["layers"]
    if not findings:
        problems.append("the sentinel found no wrong step")
    outside = [f for f in findings if f["step"] not in faulty]
    if outside:
        problems.append(f"the sentinel found wrong steps outside the faulty graph: {outside[:4]}")
    flagged = {(f["layer"], f["step"]) for f in findings}
    result["sentinel"]["flagged_of_faulty"] = f"{len(flagged)}/{len(faulty) * len(layers)}"
    if counts.get("checked", 0) < len(steps) * len(layers):
        warnings.append(f"the sentinel checked {counts.get('checked', 0)} step(s) of {len(steps) * len(layers)}")
    checker = record.get("checker")
    if checker:
        result["sentinel"]["checker"], found = checker_check(checker, len(layers))
        problems += found
    if not args.cpu and record.get("checker_process") is False:  # the staged checks ran in the engine's thread
        warnings.append(f"the sentinel's checker process was not ready after {record.get('checker_wait_s')} s: its "
                        "staged checks ran in the engine's process")
    # Its log lines: layer, step and request named.
    said = [m.groups() for m in (LOG_PATTERN.search(line) for line in record.get("sentinel_log", [])) if m]
    result["sentinel"]["log_lines"] = [f"layer {g[0]} step {g[1]}: first failing request {g[3]} head {g[4]}"
                                       for g in said][:8]
    if not said:
        problems.append("no sentinel log line names a wrong step's layer, step and request")
    for layer, step, _, request, _, _ in said:
        if int(step) not in faulty or layer not in layers:
            problems.append(f"a sentinel line names layer {layer} step {step}, not a step of the faulty graph")
    # Its snapshots: FAIL naming requests whose length was stale; the lengths kvdbg recorded are the scheduler's.
    s_index, s_odd = load_index(os.path.join(out, name, "sentinel"))
    result["sentinel"]["snapshots"] = len(s_index)
    if not s_index:
        problems.append("the sentinel wrote no snapshot")
    verdicts = []
    for (layer, step), path in sorted(s_index.items()):
        if step not in faulty:
            problems.append(f"sentinel snapshot of step {step - base}, not a step of the faulty graph")
        verdicts.append(fault_verdict(path, by_step.get(step), stale, device, expect_fail=True))
    if s_index:
        first = sorted(s_index.values())[0]
        try:
            cli = cli_replay(first, device)
        except Exception as exc:
            cli = {"exit": None, "rows": [f"raised {exc!r}"[:200]]}
        result["sentinel"]["kvdbg_replay"] = cli
        if cli["exit"] != 1 or not any("req" in row for row in cli["rows"]):
            problems.append(f"`kvdbg replay` of a sentinel snapshot: exit {cli['exit']} (want 1 naming the "
                            f"requests): {cli['rows']}")
    # Capture's own snapshots of the same engine: the faulty graph's steps FAIL, every other step PASS.
    c_index, c_odd = load_index(os.path.join(out, name, "snapshots"))
    problems += files_check(record, c_index, c_odd)
    for (layer, step), path in sorted(c_index.items()):
        verdicts.append(fault_verdict(path, by_step.get(step), stale, device, expect_fail=step in faulty))
    result["snapshots"] = {"sentinel": len(s_index), "capture": len(c_index),
                           "verdicts": Counter(v["outcome"] for v in verdicts)}
    problems += [v["problem"] for v in verdicts if v.get("problem")]
    result["stale_named"] = sorted({r for v in verdicts for r in v.get("named", [])})
    result["problems"] = collapse(problems)
    return result


def checker_check(checker: dict, layers: int) -> tuple[dict, list[str]]:
    """What the sentinel's checks gave its checker process (graph_stage's record): each layer once, however many
    steps it checked, and storages only for kvdbg's staging buffers, once each (a step's own tensors, its metadata,
    would be shared by every check). The record with how many checks shared any, and the problems."""
    problems = []
    if checker["layers_given"] > layers:
        problems.append(f"the checker process was given {checker['layers_given']} layers for {layers}")
    by_check = checker.get("shares_by_check") or []
    added = [b - a for a, b in zip([0] + by_check, by_check)]
    if len(added) >= 3 and all(added[1:]):
        problems.append(f"every check sent to the checker process shared storages with it (by check: {added[:8]}): "
                        "a step's own tensors went there, where only kvdbg's buffers should go, once each")
    return {**checker, "checks_that_shared": sum(1 for n in added if n)}, problems


def fault_verdict(path: str, step: dict | None, stale: list, device: str, expect_fail: bool) -> dict:
    """One snapshot of the fault engine: replayed, its failing requests against those whose length was stale."""
    from kvdbg import api

    name = os.path.basename(path)
    if step is None:
        return {"outcome": "unknown step", "problem": f"{name}: its step was not served"}
    snap = api.load(path)
    lengths = snap.steps[0].seq_lens.tolist()
    rows = [r for r in step["rows"] if r[1]]
    scheduler = [r[2] for r in rows]
    try:
        verdict = replay_verdict(path, device)
    except Exception as exc:
        return {"outcome": "not replayed", "problem": f"{name}: replay raised {exc!r}"[:300]}
    failed = not verdict["passed"]
    out = {"outcome": ("FAIL" if failed else "PASS") + (" as expected" if failed == expect_fail else " unexpectedly")}
    if lengths != scheduler:
        out["problem"] = f"{name}: recorded seq_lens {lengths}, the scheduler counted {scheduler}"
        return out
    if not expect_fail:
        if not verdict["passed"]:
            out["problem"] = f"{name}: a step of another graph replays FAIL: {verdict}"
        return out
    stale_rows = {i for i, n in enumerate(lengths) if i < len(stale) and stale[i] != n}
    failing = set(verdict["failing_requests"])
    out["named"] = [rows[i][0] for i in sorted(failing) if i < len(rows)]
    if verdict["passed"]:
        out["problem"] = f"{name}: a step of the faulty graph replays PASS"
    elif not failing <= stale_rows:
        out["problem"] = f"{name}: failing requests {sorted(failing)} include ones whose length was not stale"
    return out


def check_piecewise(out: str, name: str, args) -> dict:
    """A torch.compile engine under piecewise graphs: did it start and serve; if so, its snapshots replay PASS."""
    record = read_record(out, name)
    result = {"check": name, "problems": [], "warnings": [], "started": "startup_s" in record,
              "served": bool(record.get("served")), "cudagraph_mode": record.get("cudagraph_mode")}
    if not record.get("served"):
        result["not_served"] = (record.get("problems") or ["?"])[0][:400]
        result["trace_tail"] = record.get("trace", [])[-4:]
        return result
    eager = read_record(out, "plain-eager")
    if eager.get("served"):
        # torch.compile changes the numbers, so the tokens may part from the eager engine's: only what kvdbg
        # answers for fails the attempt (its snapshots' verdicts, the steps on disk); the rest is said.
        pair = check_pair(out, "plain", "plain-eager", name, args)
        for problem in pair["problems"]:
            kvdbgs = any(k in problem for k in PIECEWISE_FAILURES)
            (result["problems"] if kvdbgs else result["warnings"]).append(problem)
        result["warnings"] += pair["warnings"]
        result["pair"] = {k: pair.get(k) for k in ("graph_steps", "python_per_layer", "compared",
                                                    "replayed_vs_reference", "engine_stage_judge")}
    else:
        index, odd = load_index(os.path.join(out, name, "snapshots"))
        result["problems"] += files_check(record, index, odd)
        device = "cpu" if args.cpu else "cuda"
        bad = [p for p in index.values() if not _passes(p, device)]
        result["replayed_vs_reference"] = {"judged": len(index), "failed": len(bad)}
        result["problems"] += [f"does not replay PASS: {os.path.basename(p)}" for p in bad[:4]]
    return result


