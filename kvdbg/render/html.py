"""`kvdbg report --html`: the report as one self-contained HTML file a browser opens with no network.

Everything is inline: the styles, the pictures (SVG from kvdbg.render.canvas),
the tables (rich's own HTML export of what the terminal shows, with inline
styles). No script, no web font, no external reference: the file renders the
same offline, attached to an issue or opened from a CI artefact.
"""

from __future__ import annotations

import html
import io
import shlex

from kvdbg.render.util import printable
from kvdbg.moves.report import BugReport


def _text(text: str) -> str:
    """Text from the snapshot or the run, for the page: control and invisible formatting characters written out
    (as the terminal and the Markdown report show them), then HTML-escaped."""
    return html.escape(printable(str(text)))

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", "DejaVu Sans", sans-serif; margin: 2em auto;
       max-width: 1100px; padding: 0 1em; color: #212121; line-height: 1.4; }
h1 { font-size: 1.6em; margin-bottom: .2em; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.8em; }
.verdict { font-weight: bold; padding: .6em .9em; border-radius: 4px; border: 2px solid; }
.verdict.fail { color: #b71c1c; background: #ffebee; border-color: #c62828; }
.verdict.pass { color: #1b5e20; background: #e8f5e9; border-color: #2e7d32; }
.verdict.unverified { color: #6d4c00; background: #fff8e1; border-color: #f9a825; }
table.facts { border-collapse: collapse; font-size: .9em; }
table.facts td, table.facts th { border: 1px solid #ddd; padding: .25em .6em; text-align: left;
                                  vertical-align: top; }
table.facts th { background: #f5f5f5; }
figure { margin: 1em 0; overflow-x: auto; }
figure svg { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption { color: #616161; font-size: .9em; }
pre.term { font-family: "DejaVu Sans Mono", Menlo, Consolas, "Liberation Mono", monospace; font-size: 12px;
           line-height: 1.25; background: #fafafa; border: 1px solid #eee; padding: .6em; overflow-x: auto; }
code, pre.cmd { font-family: "DejaVu Sans Mono", Menlo, Consolas, monospace; }
pre.cmd { background: #263238; color: #eceff1; padding: .6em; overflow-x: auto; }
nav a { margin-right: 1em; }
"""

TERMINAL_WIDTH = 110


def _terminal_html(*renderables) -> str:
    """What the terminal would show, as HTML with inline styles (rich's own export)."""
    from rich.console import Console

    from kvdbg.render.util import show_controls

    console = Console(record=True, width=TERMINAL_WIDTH, file=io.StringIO(), color_system="truecolor",
                      highlight=False, markup=False, emoji=False)
    show_controls(console)
    for renderable in renderables:
        console.print(renderable)
    return console.export_html(inline_styles=True, code_format='<pre class="term">{code}</pre>')


def _facts(rows: list[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{_text(k)}</th><td>{_text(v)}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _figure(ident: str, svg: str, caption: str) -> str:
    return f'<figure id="{ident}">{svg}<figcaption>{_text(caption)}</figcaption></figure>'


def render_html(r: BugReport) -> str:
    """The whole report as one HTML document (``r.pictures`` must be built: kvdbg.moves.report.build_pictures)."""
    from kvdbg.render.attention import AttentionText, attention_drawing
    from kvdbg.render.canvas import svg_text
    from kvdbg.render.drawing import layout
    from kvdbg.render.errormap import ErrorMapText, StepsText, errormap_drawing, steps_drawing
    from kvdbg.render.info import render_info
    from kvdbg.render.pagemap import render_page_map
    from kvdbg.render.replay import render_replay
    from kvdbg.render.report import scrub_paths
    from kvdbg.render.window import render_window

    pictures = r.pictures
    name = r.path.rsplit("/", 1)[-1]
    v = r.verdict
    status = {"fail": "fail", "pass": "pass"}.get(v.status, "unverified")
    parts = [f"<h1>kvdbg report: {_text(name)}</h1>",
             f'<p class="verdict {status}" id="verdict">{_text(v.summary)} (<code>kvdbg replay</code> exits '
             f"{v.exit_code})</p>",
             '<nav><a href="#heads">which heads</a><a href="#attention">where the attention went</a>'
             '<a href="#window">window</a><a href="#replay">replay</a><a href="#map">map</a>'
             '<a href="#environment">environment</a><a href="#reproduce">reproduce</a></nav>']
    s = r.summary
    layer, backend = s.layer, s.backend
    parts.append("<h2 id=\"snapshot\">Snapshot</h2>" + _facts([
        ("file", r.path), ("sha256", r.sha256),
        ("layer", f"{layer['name']}: Hq {layer['num_heads']} / Hkv {layer['num_kv_heads']}, head_size "
                  f"{layer['head_size']}, {'causal' if layer['causal'] else 'dense (non-causal)'}, sliding window "
                  f"{layer['sliding_window'] or 'none'}, model {layer['dtype']}, kv cache {layer['kv_cache_dtype']}"),
        ("backend", f"{backend['name']}: page_size {backend['page_size']}, max_model_len {backend['max_model_len']}"),
        ("steps", str(s.num_steps)), ("replay device", r.device)]))
    if pictures is not None:
        errors = pictures.errors
        parts.append('<h2 id="heads">Which heads are wrong</h2>')
        if errors.maps:
            parts.append(_figure("error-map", svg_text(errormap_drawing(errors, title=f"error map: {name}")),
                                 "Each comparison as a request x head map, graded against its atol; red: the cell "
                                 "fails replay's rule."))
            parts.append(_terminal_html(ErrorMapText(errors)))
        else:
            parts.append("<p>Nothing was compared.</p>")
        if errors.series:
            parts.append('<h3 id="steps">Error over steps</h3>')
            parts.append(_figure("error-steps", svg_text(steps_drawing(errors.series)),
                                 "The worst head's max abs error at each step; a red square marks a step with "
                                 "failing heads."))
            parts.append(_terminal_html(StepsText(errors.series)))
        parts.append('<h2 id="attention">Where the attention went</h2>')
        if pictures.attention is not None:
            a = pictures.attention
            parts.append(_figure("attention-picture", svg_text(attention_drawing(a)),
                                 f"Step {a.step}, request {a.request}, head {a.head}, query token {a.token}: "
                                 f"{a.chosen}."))
            parts.append(_terminal_html(AttentionText(a)))
        else:
            parts.append(f"<p>Not drawn: {_text(pictures.attention_reason)}</p>")
        parts.append('<h2 id="window">The window: what each backend sees of the request</h2>')
        if pictures.window is not None:
            parts.append(_figure("window-picture", svg_text(layout(pictures.window)),
                                 f"Request {pictures.window.request}: query tokens x keys, the exact mask against "
                                 "FLASHINFER_TS's kernel and flex."))
            parts.append(_terminal_html(render_window(pictures.window_analysis)))
        else:
            parts.append(f"<p>Not drawn: {_text(pictures.window_reason)}</p>")
    parts.append('<h2 id="replay">Replay</h2>' + _terminal_html(render_replay(r.replay)))
    parts.append('<h2 id="map">Page map</h2>' + _terminal_html(*(render_page_map(m) for m in r.page_maps)))
    parts.append('<h2 id="info">Snapshot summary</h2>' + _terminal_html(render_info(r.summary)))
    env = r.environment
    parts.append('<h2 id="environment">Environment</h2>' + _facts([
        ("OS", env.os), ("Python", env.python), ("torch", f"{env.torch}, built with {env.torch_cuda_build}"),
        ("CUDA available", "yes" if env.cuda_available else "no"),
        ("GPUs", "; ".join(f"{n} (compute capability {c})" for n, c in env.gpus) or "none"),
        *[(k, val) for k, val in env.packages.items()], ("kvdbg", env.kvdbg)]))
    check = f"echo {shlex.quote(r.sha256 + '  ' + name)} | sha256sum -c -"  # as the Markdown report quotes it
    parts.append('<h2 id="reproduce">Reproduce</h2>'
                 f"<p>With the snapshot saved as <code>{_text(name)}</code>:</p>"
                 f'<pre class="cmd">{_text(check)}\n{_text(r.command)}</pre>')
    parts.append(f'<p class="verdict {status}">{_text(v.summary)} (exit {v.exit_code})</p>')
    body = "\n".join(parts)
    return scrub_paths(f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
                       f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
                       f"<title>kvdbg report: {_text(name)}</title>\n<style>{STYLE}</style>\n</head>\n"
                       f"<body>\n{body}\n</body>\n</html>\n")


__all__ = ["render_html"]
