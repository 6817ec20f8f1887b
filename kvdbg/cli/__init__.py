"""The ``kvdbg`` command line. Subcommands live in one module per topic and import torch lazily."""

from __future__ import annotations

import importlib

import click

from kvdbg._version import __version__

# name -> module:attribute; modules are imported only when a command is looked up.
COMMANDS = {
    "attention": "kvdbg.cli.attention:attention",
    "conform": "kvdbg.cli.conform:conform",
    "diff": "kvdbg.cli.diff:diff",
    "explain": "kvdbg.cli.explain:explain",
    "import": "kvdbg.cli.import_dump:import_dump",
    "info": "kvdbg.cli.info:info",
    "map": "kvdbg.cli.map:map_",
    "merge": "kvdbg.cli.merge:merge",
    "poison": "kvdbg.cli.poison:poison",
    "replay": "kvdbg.cli.replay:replay",
    "report": "kvdbg.cli.report:report",
    "shrink": "kvdbg.cli.shrink:shrink",
    "sweep": "kvdbg.cli.sweep:sweep",
    "synth": "kvdbg.cli.synth:synth",
    "triage": "kvdbg.cli.triage:triage",
    "window": "kvdbg.cli.window:window",
}


# Commands that read headers and numbers only, never tensors (nor torch, nor ctypes: they start instantly).
HEADER_ONLY = frozenset({"explain", "info", "triage", "window"})


def _one_line(exc: click.UsageError) -> click.UsageError:
    """Drop the context so click prints just ``Error: ...`` (no usage block): one line, exit 2."""
    exc.ctx = None
    return exc


# `kvdbg --help` lists the commands by what a user is doing, in the order they need them, each with what it
# answers and one example. Every command of COMMANDS is in exactly one group (a test holds them equal).
GROUPS = (
    ("Start here: judge a snapshot, or a directory of them", (
        ("replay", "the verdict: every backend against the exact reference",
         "kvdbg replay snap.safetensors"),
    )),
    ("Look", (
        ("info", "what the file holds, from its header (instant)", "kvdbg info snap.safetensors"),
        ("map", "block tables, the physical-to-logical page map, anomalies", "kvdbg map snap.safetensors"),
        ("window", "what FLASHINFER_TS's window restriction keeps",
         "kvdbg window --seq-len 9000 --window 4096"),
        ("explain", "what a finding code means and what to do", "kvdbg explain live_page_zero"),
    )),
    ("Dig into a failure", (
        ("attention", "where one query token's attention went, per backend",
         "kvdbg attention snap.safetensors"),
        ("poison", "which slots a backend reads that it must not", "kvdbg poison snap.safetensors"),
        ("sweep", "which knob (pages, dtype, window) flips the verdict", "kvdbg sweep snap.safetensors"),
        ("diff", "two snapshots of one step, input by input", "kvdbg diff good.safetensors bad.safetensors"),
    )),
    ("Hold an engine's backend to the exact answer", (
        ("conform", "which feature combinations a backend gets wrong", "kvdbg conform --backend CPU_ATTN"),
    )),
    ("Shrink and share", (
        ("shrink", "the smallest snapshot that still fails", "kvdbg shrink snap.safetensors -o small.safetensors"),
        ("report", "a Markdown or HTML bug report", "kvdbg report snap.safetensors -o bug.md"),
    )),
    ("Many captures (a fleet)", (
        ("triage", "a results file's failures grouped by cause", "kvdbg triage results.jsonl"),
        ("merge", "a step's tensor-parallel ranks as one snapshot",
         "kvdbg merge r0.safetensors r1.safetensors -o all.safetensors"),
    )),
    ("Make", (
        ("synth", "a deterministic synthetic snapshot", "kvdbg synth -o s.safetensors --seq-len 9000,1200"),
        ("import", "snapshots from a FlashInfer dump or a flashinfer-bench dataset",
         "kvdbg import flashinfer_dumps -o snaps/"),
    )),
)


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return [name for _, rows in GROUPS for name, _, _ in rows]

    def format_commands(self, ctx, formatter):
        """The commands by what a user is doing, each with its question and one example (no command is imported)."""
        for title, rows in GROUPS:
            with formatter.section(title):
                for name, what, example in rows:
                    formatter.write_text(f"{name:<11}{what}")
                    with formatter.indentation(), formatter.indentation(), formatter.indentation(), \
                            formatter.indentation(), formatter.indentation():
                        formatter.write_text(example)
        with formatter.section("Capture from a live engine"):
            formatter.write_text("no command: set KVDBG_CAPTURE_DIR (or KVDBG_SENTINEL) in vLLM's environment; "
                                 "see above")

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except click.UsageError as exc:
            raise _one_line(exc) from None

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if name is not None and not name.startswith("-") and self.get_command(ctx, name) is None:
            import difflib

            close = difflib.get_close_matches(name, list(COMMANDS), n=1, cutoff=0.5)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise click.UsageError(f"No such command {name!r}.{hint} Commands: {', '.join(sorted(COMMANDS))}.")
        resolved = super().resolve_command(ctx, args)
        if resolved[0] not in HEADER_ONLY:
            from kvdbg.util.memory import return_freed_memory

            return_freed_memory()  # this process will hold tensors: its peak is what is live (kvdbg.util.memory)
        return resolved

    def get_command(self, ctx, name):
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 80})
@click.version_option(__version__, prog_name="kvdbg")
def cli():
    """Inspect, replay and debug paged KV-cache snapshots of LLM serving engines.

    A snapshot is one attention layer's decode step(s) captured into a single
    safetensors file: KV pages, block table, lengths, query and the engine's
    output. kvdbg replays it through the engine's backends and an exact
    reference, and shows where they disagree. Start with `kvdbg replay SNAP`
    (its verdict names the failing backends and finding codes); `kvdbg
    explain CODE` says what a finding means and what to do.

    Exit codes: 0 clean; 1 a mismatch or an error finding (warnings and notes
    do not count); 2 bad input; 3 nothing could be compared; 130 interrupted.
    An option means the same in every command that takes it; indices are
    ranges (--request 0-3,7). Every table has a --json twin.

    Capture from a live vLLM: install kvdbg into the engine's environment with
    no extra (pip install -e .; pip's --dry-run names kvdbg alone) and set
    KVDBG_CAPTURE_DIR. Steps replayed from full CUDA graphs are captured too
    (to rule graphs out, serve with --enforce-eager). KVDBG_SENTINEL=0.01
    checks 1% of each layer's steps against the exact reference inside the
    engine and captures the wrong ones. docs/capture.md.
    """


def main(argv=None):
    """The console script: click's own handling, except that Ctrl-C exits 130 (as a shell expects), not 1.

    A header-only command (and the group's help) holds a few thousand objects for a few milliseconds: it runs
    without the cyclic garbage collector, and at exit its objects are frozen (gc.freeze) so that the
    interpreter's final collection does not walk them all once more. Together ~15 ms of a ~90 ms command
    (bench/cli_start.py); a caller running main() in its own process gets its collector back on return.
    """
    import sys

    args = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in args if not a.startswith("-")), None)  # the group's own options take no value
    if command is not None and command not in HEADER_ONLY:
        return _run(argv)
    import atexit
    import gc

    atexit.register(gc.freeze)
    enabled = gc.isenabled()
    gc.disable()
    try:
        _run(argv)
    finally:
        if enabled:
            gc.enable()


def _run(argv) -> None:
    import sys

    try:
        code = cli.main(args=argv, prog_name="kvdbg", standalone_mode=False)
    except (click.exceptions.Abort, KeyboardInterrupt):
        from kvdbg.judge.verdict import EXIT_INTERRUPTED  # here: `kvdbg --help` needs no verdict

        click.echo("kvdbg: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    sys.exit(code if isinstance(code, int) else 0)
