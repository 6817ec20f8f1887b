"""`kvdbg report` rendering: GitHub-flavoured Markdown, and the rich tables as SVG images."""

from __future__ import annotations

import io
import re
import shlex

from kvdbg.snapshot.info import layer_features
from kvdbg.judge.findings import explain_command
from kvdbg.render.markdown import md_code, md_escape, md_table
from kvdbg.render.util import human_bytes
from kvdbg.moves.report import BugReport

MAX_TABLE_ROWS = 32


def _fmt(value: float) -> str:
    """Three significant digits, as the terminal tables print them (2.36e-01)."""
    from kvdbg.render.replay import _fmt as fmt

    return fmt(value)


def _row_error(failed: bool, value: float) -> str:
    """A row's max abs: a failing row's comes from its failing heads; when they hold no finite number, say so."""
    return "no finite error" if failed and value != value else _fmt(value)


def _explain_line(codes) -> str:
    """The pointer to `kvdbg explain`, as a Markdown line."""
    command = explain_command(codes)
    return f"What {'a code' if command.endswith('CODE') else 'it'} means and what to do: {md_code(command)}."


def _fence(text: str, info: str = "") -> str:
    longest = max((len(m) for m in re.findall(r"`{3,}", text)), default=2)
    fence = "`" * (longest + 1)
    return f"{fence}{info}\n{text}\n{fence}"


def _elided(rows: list[list[str]], total: int, what: str) -> str:
    if total <= len(rows):
        return ""
    return f"\n\n_… {total - len(rows)} more {what} not shown._"


# --------------------------------------------------------------------------- sections


def _environment(r: BugReport) -> str:
    env = r.environment
    gpus = "; ".join(f"{name} (compute capability {cap})" for name, cap in env.gpus) or "none"
    rows = [
        ["OS", md_escape(env.os)],
        ["Python", md_escape(env.python)],
        ["torch", md_escape(f"{env.torch}, built with {env.torch_cuda_build}")],
        ["CUDA available", "yes" if env.cuda_available else "no"],
        ["GPUs", md_escape(gpus)],
        *[[md_escape(name), md_escape(version)] for name, version in env.packages.items()],
        ["kvdbg", md_escape(env.kvdbg)],
        ["replay device", md_escape(r.device)],
    ]
    return "## Environment\n\n" + md_table(["item", "value"], rows)


def _snapshot(r: BugReport) -> str:
    s = r.summary
    layer, backend = s.layer, s.backend
    window = layer["sliding_window"]
    mask = ("causal" if layer["causal"] else "dense (non-causal)") + (f", sliding window {window}" if window
                                                                      else ", no sliding window")
    dtypes = f"model {layer['dtype']}, kv cache {layer['kv_cache_dtype']} (stored {s.kv_cache_dtype_stored})"
    if layer["kv_cache_dtype"] != "auto":
        dtypes += f", scales q {layer['q_scale']:.6g} k {layer['k_scale']:.6g} v {layer['v_scale']:.6g}"
    capture = ", ".join(f"{k}={v}" for k, v in sorted(s.capture.items()) if not isinstance(v, (dict, list)))
    rows = [
        ["file", md_code(r.path)],
        ["sha256", md_code(r.sha256)],
        ["size", md_escape(f"{human_bytes(s.file_size)} ({s.file_size} bytes); {s.stored_pages} stored pages × "
                          f"{human_bytes(s.page_bytes)} = {human_bytes(s.referenced_page_bytes)}")],
        ["format", md_escape(f"kvdbg v{s.format_version}, layout {s.kv_layout}")],
        ["layer", md_code(layer["name"])],
        ["heads", md_escape(f"Hq {layer['num_heads']} / Hkv {layer['num_kv_heads']}, head_size "
                           f"{layer['head_size']}, scale {layer['scale']:.6g}")],
        ["mask", md_escape(mask)],
        ["dtypes", md_escape(dtypes)],
        ["backend", md_escape(f"{backend['name']}: page_size {backend['page_size']}, max_model_len "
                             f"{backend['max_model_len']}, max_decode_query_len {backend['max_decode_query_len']}, "
                             f"engine pages {backend['num_gpu_blocks']}")],
        ["steps", str(s.num_steps)],
        ["capture", md_escape(capture or "-")],
    ]
    features = layer_features(layer, {t.name for t in s.tensors})
    if features:
        rows.insert(rows.index(["mask", md_escape(mask)]) + 1, ["features", md_escape(", ".join(features))])
    if s.notes:
        rows.append(["notes", md_escape(s.notes)])
    parts = ["## Snapshot\n\n" + md_table(["field", "value"], rows)]
    for step in s.steps:
        shown = step.requests[:MAX_TABLE_ROWS]
        table = md_table(["request", "seq_len", "query_len", "live pages"],
                         [[str(q.index), str(q.seq_len), str(q.query_len), str(q.live_pages)] for q in shown],
                         align=["right"] * 4)
        title = (f"Step {step.step}: {step.num_reqs} requests, {step.num_tokens} query tokens, "
                 f"table width {step.table_width}")
        parts.append(f"### {md_escape(title)}\n\n{table}"
                     + _elided(shown, len(step.requests), "requests"))
    return "\n\n".join(parts)


def _paging(r: BugReport) -> str:
    parts = ["## Paging and window"]
    rows = [[str(m.step), md_escape(a.severity), md_code(a.code), "-" if a.request is None else str(a.request),
             md_escape(a.message)] for m in r.page_maps for a in m.anomalies]
    total = len(rows)
    if rows:
        parts.append("### Map anomalies\n\n" + md_table(["step", "severity", "code", "request", "message"],
                                                         rows[:MAX_TABLE_ROWS]) + _elided(rows[:MAX_TABLE_ROWS],
                                                                                          total, "anomalies")
                     + "\n\n" + _explain_line(a.code for m in r.page_maps for a in m.anomalies))
    else:
        parts.append("### Map anomalies\n\nNone: no live page 0, no page mapped twice, no stale tails.")
    if r.window:
        rows = [[str(w.step), str(w.request), str(w.seq_len), str(w.query_len), "yes" if w.applies else "no",
                 str(w.start_page), str(w.pages_dropped), str(w.restricted_seq_len), str(w.worst_extra),
                 str(w.drift), md_escape(", ".join(w.findings) or "-")] for w in r.window]
        shown = rows[:MAX_TABLE_ROWS]
        parts.append("### FLASHINFER_TS window restriction (per request)\n\n" + md_table(
            ["step", "request", "seq_len", "query_len", "restricted", "start page", "pages dropped",
             "kernel seq_len", "worst extra keys", "drift", "findings"], shown, align=["right"] * 10 + ["left"])
            + _elided(shown, len(rows), "requests"))
    else:
        parts.append(f"### Window restriction\n\nNot applicable: {md_escape(r.window_reason)}.")
    return "\n\n".join(parts)


def _replay(r: BugReport) -> str:
    rows = []
    for b in r.backends:
        worst = ", ".join(f"step {s} req {q} head {h} ({_fmt(m)})" for s, q, h, m in b.worst) or "-"
        findings = ", ".join(f"{code} ×{n}" for code, n in sorted(b.finding_counts.items())) or "-"
        verdict = b.verdict if b.verdict not in ("FAIL", "pass") else (
            f"**FAIL** ({b.failed_heads} of {b.heads_compared} heads)" if b.verdict == "FAIL"
            else f"pass ({b.heads_compared} heads)")
        # An unavailable backend's reason is a paragraph: it gets its own list below the table.
        ran = "-" if b.status == "unavailable" else md_escape(b.kernel) + (" *(emulated)*" if b.emulated else "")
        rows.append([md_code(b.name), md_escape(b.engine_name or "-"), md_escape(b.status), ran, verdict,
                     _row_error(b.verdict == "FAIL", b.max_abs) if b.verdict in ("FAIL", "pass") else "-",
                     md_escape(worst), md_escape(findings)])
    v = r.verdict
    verdict = {"fail": "**FAILED**", "pass": "**PASSED**"}.get(v.status, "**NOTHING VERIFIED**") + \
        f": {v.summary.split(': ', 1)[-1]} (`kvdbg replay` exits {v.exit_code})."
    parts = ["## Replay", verdict, md_table(
        ["backend", "engine name", "status", "what ran", "vs reference", "max abs", "worst heads", "findings"], rows)]
    unavailable = [b for b in r.backends if b.status == "unavailable"]
    if unavailable:
        parts.append("### Backends that did not run\n\n" + "\n".join(
            f"- {md_code(b.name)}: {md_escape(b.kernel or 'no reason given')}" for b in unavailable))
    findings = [f for f in r.findings if f.severity in ("error", "warning")]
    # A condition `map` already lists (same step, code and request) is not listed twice.
    mapped = {(a.step, a.code, a.request) for m in r.page_maps for a in m.anomalies}
    listed = [f for f in findings if (f.step, f.code, f.request) not in mapped]
    also = sorted({f"{f.backend}: {f.code}" for f in findings if (f.step, f.code, f.request) in mapped})
    if findings:
        section = "### Findings"
        if listed:
            frows = [[md_escape(f.severity), md_code(f.backend), "-" if f.step is None else str(f.step),
                      "-" if f.request is None else str(f.request), md_code(f.code), md_escape(f.message)]
                     for f in listed]
            shown = frows[:MAX_TABLE_ROWS]
            section += "\n\n" + md_table(["severity", "backend", "step", "request", "code", "message"], shown) \
                + _elided(shown, len(frows), "findings")
        if also:
            count = len(findings) - len(listed)
            section += (f"\n\n{count} finding(s) of the replay ({md_escape(', '.join(also))}) are the map anomalies "
                        "listed above, for the same steps and requests.")
        section += "\n\n" + _explain_line(f.code for f in findings)
        parts.append(section)
    captured = [c for c in r.comparisons if c.expected == "captured" or c.actual == "captured"]
    if captured:
        crows = [[str(c.step), md_code(c.actual), md_code(c.expected),
                  "pass" if c.passed else f"**FAIL** ({len(c.failed)} of {len(c.heads)} heads)",
                  _row_error(not c.passed, c.shown_max_abs)]
                 for c in captured]
        parts.append("### Against the engine's captured output\n\n"
                     + md_table(["step", "actual", "expected", "verdict", "max abs"], crows))
    tolerances = sorted({(c.tolerance.atol, c.tolerance.rtol, c.tolerance.source) for c in r.comparisons})
    if tolerances:
        parts.append("Pass rule: an element passes when \\|a − e\\| ≤ atol + rtol·\\|e\\| (e: expected); "
                     "tolerances used: " + "; ".join(md_escape(f"atol {a:g}, rtol {t:g} ({s})")
                                                     for a, t, s in tolerances) + ".")
    return "\n\n".join(parts)


def scrub_paths(text: str) -> str:
    """Local prefixes out of a report meant for a public issue: the virtualenv, then the home directory."""
    import os
    import sys

    prefixes = []
    if sys.prefix != getattr(sys, "base_prefix", sys.prefix):
        prefixes.append((sys.prefix, "<venv>"))
    home = os.path.expanduser("~")
    if home and home not in ("/", "~"):
        prefixes.append((home, "~"))
    for prefix, name in prefixes:
        text = text.replace(prefix.rstrip("/") + "/", name + "/").replace(prefix.rstrip("/"), name)
    return text


def render_markdown(r: BugReport) -> str:
    name = r.path.rsplit("/", 1)[-1]
    head = (f"# kvdbg report: {md_escape(name)}\n\n"
            f"Generated by kvdbg {md_escape(r.environment.kvdbg)}. Snapshot sha256 {md_code(r.sha256)}.")
    check = f"echo {shlex.quote(r.sha256 + '  ' + name)} | sha256sum -c -"
    reproduce = (f"## Reproduce\n\nWith the snapshot attached to this issue saved as {md_code(name)}:\n\n"
                 + _fence(f"{check}\n{r.command}", "bash"))
    v = r.verdict
    closing = f"**Verdict:** {md_escape(v.summary)} (`kvdbg replay` exits {v.exit_code})."
    sections = [head, _environment(r), _snapshot(r), _paging(r), _replay(r)]
    if r.sweep is not None:
        from kvdbg.render.sweep import sweep_markdown

        sweep_result, sweep_verdict = r.sweep
        sections.append(f"## Sweep: {md_escape(', '.join(sweep_result.knobs))}\n\n"
                        + sweep_markdown(sweep_result, sweep_verdict))
    return scrub_paths("\n\n".join(sections + [reproduce, closing]) + "\n")


# --------------------------------------------------------------------------- SVG


# rich's SVG export loads Fira Code from a CDN: offline the browser falls back to some other
# font and the box borders misalign. The images name local monospace fonts only.
_FONT_FACE = re.compile(r"@font-face\s*\{[^}]*\}\s*")
SVG_FONTS = "DejaVu Sans Mono, Menlo, Consolas, Liberation Mono, monospace"


def self_contained_svg(svg: str) -> str:
    """The SVG with no web font (nothing fetched when it is opened) and no local path prefix."""
    svg = _FONT_FACE.sub("", svg)
    svg = svg.replace("font-family: Fira Code, monospace", f"font-family: {SVG_FONTS}")
    return scrub_paths(svg)


def ran_backends(r: BugReport) -> list[str]:
    """The backends that really ran (not the ones asked for that could not)."""
    return [st.name for st in r.replay.result.backends if st.available]


def render_svgs(r: BugReport, *, width: int = 120) -> dict[str, str]:
    """The info, map and replay tables as self-contained SVG documents (rich's own export), by file stem."""
    from rich.console import Console

    from kvdbg.render.info import render_info
    from kvdbg.render.util import show_controls
    from kvdbg.render.pagemap import render_page_map
    from kvdbg.render.replay import render_replay

    def record(*renderables, title: str) -> str:
        console = Console(record=True, width=width, file=io.StringIO(), color_system="truecolor", highlight=False,
                          markup=False, emoji=False)  # the snapshot's text as given: no markup, no emoji codes
        show_controls(console)
        for renderable in renderables:
            console.print(renderable)
        return self_contained_svg(console.export_svg(title=title))

    name = r.path.rsplit("/", 1)[-1]
    steps = ", ".join(str(m.step) for m in r.page_maps)
    return {
        "info": record(render_info(r.summary), title=f"kvdbg info {name}"),
        "map": record(*(render_page_map(m) for m in r.page_maps), title=f"kvdbg map {name}: step(s) {steps}"),
        "replay": record(render_replay(r.replay),
                         title=f"kvdbg replay {name}: {', '.join(ran_backends(r))} ran on {r.device}"),
    }
