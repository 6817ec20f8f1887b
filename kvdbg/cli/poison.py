"""`kvdbg poison SNAP`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (backend_option, console, default_snapshot, device_option, emit_json, guarded,
                              json_option, print_verdict, progress_printer, simple_verdict, step_option, within)


@click.command()
@click.argument("snapshot", required=False, type=click.Path(dir_okay=False))
@backend_option()
@step_option(extra="Earlier steps' cache updates still apply.")
@device_option()
@json_option
@guarded
def poison(snapshot, backend, step, device, as_json):
    """Write NaN into every slot a correct backend must not read, region by region, and see who reads it.

    Regions: stored pages no table entry references, stale table tails, tokens
    past seq_len in the last live page, keys before the first any query token
    of the request sees (the window), and the null block (engine page 0). A
    slot some request must see is never poisoned. Each region is replayed on
    its own (on a private copy of the cache, never the file) with NaN keys and
    then NaN values; an output that turns NaN with NaN keys was weighted by a
    slot it must not read, and the region is bisected to name those slots.

    Exit 0 when no backend reads a poisoned slot; 1 when one does; 2 on bad
    input; 3 when nothing was poisoned or no backend ran.

    \b
    Examples:
      kvdbg poison                              # the bundled dflash fixture
      kvdbg poison snapshot.safetensors --backend flex --step 1 --json
    """
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.moves.poisoner import poison as run_poison
    from kvdbg.snapshot.store import load_snapshot

    backends = list(backend)
    snap = load_snapshot(snapshot or default_snapshot())
    steps = within(step, len(snap.steps), "--step", f"the snapshot has {len(snap.steps)} step(s)")
    result = run_poison(snap, backends or None, ReplayOptions(device=device), steps=steps, required=backends,
                        progress=progress_printer("poisoning"))
    verdict = poison_verdict(result)
    if as_json:
        emit_json({**result.to_json(), "verdict": verdict.to_json()})
    else:
        from kvdbg.render.poison import render_poison

        out = console()
        out.print(render_poison(result))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def poison_verdict(result):
    """Fail when a backend weights a poisoned slot; unverified when nothing was poisoned or nothing ran."""
    from kvdbg.judge.verdict import EXIT_FINDING, EXIT_NOTHING_VERIFIED, EXIT_OK

    records = [b for s in result.steps for b in s.backends]
    # A backend whose every output was already non-finite or unwritten unpoisoned shows no read: it ran, but
    # it verified nothing.
    ran = [b for b in records if b.observed]
    readers = sorted({b.backend for b in ran if b.reads_poisoned})
    if readers:
        regions = sorted({r.region for b in ran if b.backend in readers for r in b.regions
                          if r.status == "reads poisoned"})
        return simple_verdict("fail", EXIT_FINDING, f"FAIL: {', '.join(readers)} read(s) slots it must not "
                                                    f"({', '.join(regions)})")
    poisoned = any(r.slots for s in result.steps for r in s.regions)
    if not poisoned:
        return simple_verdict("unverified", EXIT_NOTHING_VERIFIED,
                              "NOTHING VERIFIED: no slot to poison (every stored slot is one a backend must read)")
    blind = sorted({b.backend for b in records if b.ran and not b.observed} - {b.backend for b in ran})
    blind_text = (f"every output of {', '.join(blind)} was already non-finite or unwritten before any poison, so "
                  "no read could show") if blind else ""
    if not ran:
        return simple_verdict("unverified", EXIT_NOTHING_VERIFIED,
                              f"NOTHING VERIFIED: {blind_text or 'no backend ran'}")
    names = sorted({b.backend for b in ran})
    skipped = sorted({b.backend for b in records if not b.ran})
    tail = f"; not run: {', '.join(skipped)}" if skipped else ""
    if blind_text:
        tail += f"; {blind_text}"
    failed = sorted({f"{b.backend} with {r.region}" for b in ran for r in b.regions if r.status == "not run"})
    if failed:
        tail += f"; not verified (the backend failed): {', '.join(failed)}"
    return simple_verdict("pass", EXIT_OK, f"PASS: {', '.join(names)} read nothing poisoned{tail}")
