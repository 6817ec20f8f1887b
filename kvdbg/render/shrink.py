"""Tables for `kvdbg shrink`: sizes before and after, what each pass removed, the failure kept."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from kvdbg.render.fit import Column, FitTable
from kvdbg.render.util import elide, human_bytes
from kvdbg.moves.shrinker import ShrinkResult


def size_change(input_bytes: int, output_bytes: int) -> str:
    """How the file's size changed, said as it is: smaller by a ratio, or not smaller at all."""
    if output_bytes >= input_bytes:
        return (f"not smaller: nothing could be removed, and the shrink's notes add "
                f"{human_bytes(output_bytes - input_bytes)}" if output_bytes > input_bytes else
                "not smaller: nothing could be removed")
    ratio = input_bytes / output_bytes if output_bytes else float("inf")
    return f"{ratio:.1f}× smaller" if ratio >= 1.05 else f"{human_bytes(input_bytes - output_bytes)} smaller"


def render_shrink(r: ShrinkResult) -> Group:
    head = Text(f"shrunk {r.input_path or '<memory>'} → {r.output_path or '<memory>'}: "
                f"{human_bytes(r.input_bytes)} → {human_bytes(r.output_bytes)} "
                f"({size_change(r.input_bytes, r.output_bytes)}) in {r.seconds:.1f} s, {r.replays} replays",
                style="bold")
    passes = FitTable([Column("pass", priority=10), Column("candidates", whole=True, priority=7),
                       Column("removed", priority=8), Column("tensor bytes after", whole=True, priority=9)],
                      title="passes")
    for p in r.passes:
        passes.add_row(p.name, str(p.candidates), p.removed or "-", human_bytes(p.bytes_after))
    kept = Table(title="what remains", title_justify="left", show_header=False)
    kept.add_column("field", style="bold")
    kept.add_column("value")
    kept.add_row("steps", f"1 of {r.steps_before} (input step {r.signature.step})")
    kept.add_row("requests", f"{len(r.kept_requests)} (input ids {elide(r.kept_requests)})")
    kept.add_row("query heads", f"{len(r.kept_heads)} (input ids {elide(r.kept_heads)}; KV heads "
                 f"{elide(r.kept_kv_heads)})")
    kept.add_row("pages", f"{r.pages_after} of {r.pages_before}")
    kept.add_row("keys (sum of seq_lens)", f"{r.tokens_after} of {r.tokens_before}")
    fail = ", ".join(f"({req}, {h})" for req, h in r.failing_heads_after[:16])
    if len(r.failing_heads_after) > 16:
        fail += f", … {len(r.failing_heads_after) - 16} more"
    codes = sorted({c for c, _ in r.signature.error_findings})
    kept.add_row("failure kept", Text(f"{r.backend} fails on (request, head) {fail or 'none'}"
                                      + (f"; error findings {', '.join(codes)}" if codes else ""), style="red"))
    return Group(head, passes, kept)


def render_script(script) -> Group:
    """Where the repro script and its tensors went, and what running it here showed."""
    where = "embedded in the script" if script.embedded else f"in {script.data_file} (keep it beside the script)"
    lines = [Text(f"repro script {script.script}: {script.backend} vs an exact reference, torch + safetensors only; "
                  f"tensors ({human_bytes(script.tensor_bytes)}) {where}", style="bold")]
    if script.verified_exit is not None:
        ok = bool(script.reproduces)
        lines.append(Text(f"ran it here: exit {script.verified_exit} — "
                          + ("the mismatch reproduces" if ok else "it does NOT reproduce the mismatch"),
                          style="green" if ok else "bold red"))
        tail = (script.verified_output or "").rstrip().splitlines()
        lines.extend(Text("  " + line, style="dim") for line in tail[:12])
    return Group(*lines)
