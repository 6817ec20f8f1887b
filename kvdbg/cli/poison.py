"""`kvdbg poison SNAP`."""

from __future__ import annotations

import sys

import click

from kvdbg.cli.common import (backend_option, console, default_snapshot, device_option, emit_json, guarded,
                              json_option, print_verdict, progress_printer, step_option, within)


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

    The verdict is the snapshot's, by kvdbg's one rule: the replay's
    comparisons and error findings, with a counted backend weighting a
    poisoned slot added as an error finding (reads_poisoned_slot). Reading
    only the keys FLASHINFER_TS's page-aligned window restriction keeps before
    the window is that backend's documented behaviour: "reads by design", a
    warning. Exit 0 pass; 1 fail; 2 bad input; 3 nothing verified.

    \b
    Examples:
      kvdbg poison                              # the bundled dflash fixture
      kvdbg poison snapshot.safetensors --backend flex --step 1 --json
    """
    from kvdbg import api
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.moves.poisoner import poison as run_poison

    backends = list(backend)
    snap = api.load(snapshot or default_snapshot())
    steps = within(step, len(snap.steps), "--step", f"the snapshot has {len(snap.steps)} step(s)")
    progress = progress_printer("poisoning")
    # The verdict is the snapshot's (kvdbg.judge.verdict.judge over the replay) with the reads added as findings.
    report = api.replay(snap, backends or None, device=device, steps=steps, progress=progress)
    result = run_poison(snap, backends or None, ReplayOptions(device=device), steps=steps, required=backends,
                        progress=progress)
    verdict = poison_verdict(result, report)
    if as_json:
        emit_json({**result.to_json(), "findings": [f.to_json() for f in poison_findings(result)],
                   "verdict": verdict.to_json()})
    else:
        from kvdbg.render.poison import render_poison

        out = console()
        out.print(render_poison(result))
        print_verdict(out, verdict)
    if verdict.exit_code:
        sys.exit(verdict.exit_code)


def poison_findings(result) -> list:
    """The reads as registered findings: a backend weighting a poisoned slot is an error (reads_poisoned_slot);
    one reading only the keys FLASHINFER_TS's window restriction shows by design, a warning."""
    from kvdbg.judge.findings import Finding

    found = []
    for s in result.steps:
        for b in s.backends:
            for r in b.regions:
                if r.status not in ("reads poisoned", "reads by design"):
                    continue
                slots = ", ".join(c.label for c in r.culprits[:4]) + (" …" if len(r.culprits) > 4 else "")
                requests = sorted({req for req, _, _ in r.outputs})
                if r.status == "reads poisoned":
                    found.append(Finding(code="reads_poisoned_slot", backend=b.backend, step=s.step,
                                         requests=requests, message=f"{b.backend} weights poisoned slots of region "
                                         f"{r.region} ({r.tokens} query token(s)): {slots}",
                                         details={"region": r.region}))
                else:
                    found.append(Finding(code="window_restriction_extra_keys", backend=b.backend, step=s.step,
                                         requests=requests, message=f"{b.backend} reads {slots} of region "
                                         f"{r.region}: keys FLASHINFER_TS's page-aligned window restriction shows "
                                         "by design", details={"region": r.region}))
    return found


def poison_verdict(result, report=None):
    """kvdbg.judge.verdict.judge over the replay (``report``: its comparisons and findings) and the reads as
    findings: fails when the replay fails or a counted backend weights a slot it must not; reads that FLASHINFER_TS's
    documented window restriction explains are named, never a failure. What the poisoning could not verify (no
    slot to poison, a backend whose outputs were already non-finite) is said after the verdict."""
    from dataclasses import replace

    from kvdbg.judge.verdict import judge

    found = poison_findings(result)
    counted = report.result.counted if report is not None else None
    verdict = judge(report.comparisons if report is not None else [],
                    (report.findings if report is not None else []) + found, counted)
    records = [b for s in result.steps for b in s.backends]
    ran = [b for b in records if b.observed]
    parts = []
    readers = sorted({f.backend for f in found if f.code == "reads_poisoned_slot"})
    if readers:
        regions = sorted({r.region for b in ran if b.backend in readers for r in b.regions
                          if r.status == "reads poisoned"})
        parts.append(f"{', '.join(readers)} read(s) slots it must not ({', '.join(regions)})")
    by_design = sorted({f.backend for f in found if f.code == "window_restriction_extra_keys"})
    if by_design:
        parts.append(f"{', '.join(by_design)} read(s) only the keys FLASHINFER_TS's page-aligned window restriction "
                     "shows by design (documented, not a failure)")
    if not any(r.slots for s in result.steps for r in s.regions):
        parts.append("poison: no slot to poison (every stored slot is one a backend must read)")
    blind = sorted({b.backend for b in records if b.ran and not b.observed} - {b.backend for b in ran})
    if blind:
        parts.append(f"every output of {', '.join(blind)} was already non-finite or unwritten before any poison, so "
                     "no read could show")
    clean = sorted({b.backend for b in ran} - set(readers) - set(by_design))
    if clean:
        parts.append(f"{', '.join(clean)} read nothing poisoned")
    skipped = sorted({b.backend for b in records if not b.ran})
    if skipped:
        parts.append(f"not poisoned: {', '.join(skipped)}")
    failed = sorted({f"{b.backend} with {r.region}" for b in ran for r in b.regions if r.status == "not run"})
    if failed:
        parts.append(f"not verified (the backend failed): {', '.join(failed)}")
    return replace(verdict, summary="; ".join([verdict.summary] + parts))
