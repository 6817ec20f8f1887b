"""kvdbg from Python: the main job and the debugging moves, without the command line.

    import kvdbg

    report = kvdbg.replay("snapshot.safetensors", backends=["flex"], device="cpu")
    report.passed, report.verdict.exit_code      # the CLI's verdict and exit code
    report.findings, report.comparisons          # Finding records; per-head diffs
    report.to_json()                             # what `kvdbg replay --json` prints

Every function takes a path or an already loaded :class:`kvdbg.Snapshot`, and
raises :class:`kvdbg.KvdbgError` subclasses on bad input (the CLI turns them
into its one-line errors, exit 2). The CLI commands are thin layers over these.
Importing this module does not import torch; each call does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvdbg.snapshot.pagemap import PageMap
    from kvdbg.replayer.runner import ReplayReport
    from kvdbg.snapshot.store import Snapshot


def load(snapshot: "str | Snapshot") -> "Snapshot":
    """A Snapshot: ``snapshot`` itself, or the file at that path, memory-mapped."""
    if isinstance(snapshot, str):
        from kvdbg.snapshot.store import load_snapshot

        return load_snapshot(snapshot)
    return snapshot


def _options(device: str, compile: bool | None, exact: bool):
    from kvdbg.backends.base import ReplayOptions

    return ReplayOptions(device=device, exact=exact, compile=compile)


def _check_ids(snap: "Snapshot", requests: Iterable[int] | None, heads: Iterable[int] | None):
    from kvdbg.errors import OptionError

    requests = None if requests is None else sorted(set(int(r) for r in requests))
    heads = None if heads is None else sorted(set(int(h) for h in heads))
    if heads and (heads[0] < 0 or heads[-1] >= snap.meta.layer.num_heads):
        raise OptionError(f"heads: {heads[-1] if heads[-1] >= 0 else heads[0]} is out of range: "
                          f"the layer has {snap.meta.layer.num_heads} heads")
    most = max((s.num_reqs for s in snap.steps), default=0)
    if requests and (requests[0] < 0 or requests[-1] >= most):
        raise OptionError(f"requests: {requests[-1] if requests[-1] >= 0 else requests[0]} is out of range: "
                          f"the snapshot has {most} requests")
    return requests, heads


def replay(snapshot: "str | Snapshot", backends: Iterable[str] | None = None, *, device: str = "cpu",
           steps: Iterable[int] | None = None, requests: Iterable[int] | None = None,
           heads: Iterable[int] | None = None, atol: float | None = None, rtol: float | None = None,
           exact: bool = False, compile: bool | None = None,
           progress: Callable[[str], None] | None = None) -> "ReplayReport":
    """Replay ``snapshot`` through the reference and ``backends`` and judge it: `kvdbg replay`.

    ``backends`` None runs the default set (a backend that cannot run gets a
    column saying why); a backend named here that cannot run raises
    BackendUnavailable. Names are kvdbg's or the engine's (``FLEX_ATTENTION``).
    ``steps`` replays only those steps (earlier steps' cache updates still
    apply); ``requests``/``heads`` narrow the comparisons (and ``requests`` the
    findings). ``atol``/``rtol`` None: the default tolerance of the dtype.
    """
    from kvdbg.backends import resolve_backend
    from kvdbg.replayer.runner import replay as run_replay

    snap = load(snapshot)
    named = list(dict.fromkeys(resolve_backend(b) for b in backends)) if backends is not None else []
    requests, heads = _check_ids(snap, requests, heads)
    names = list(named) if backends is not None else None
    if names is not None and "reference" not in names:
        names.insert(0, "reference")  # every comparison needs the exact answer
    result = run_replay(snap, names, _options(device, compile, exact),
                        steps=None if steps is None else list(steps), required=named, progress=progress)
    return result.judge(atol=atol, rtol=rtol, requests=requests, heads=heads)


def attention(snapshot: "str | Snapshot", backends: Iterable[str] | None = None, *, step: int | None = None,
              request: int | None = None, head: int | None = None, token: int | None = None,
              device: str = "cpu", report: "ReplayReport | None" = None,
              progress: Callable[[str], None] | None = None):
    """One query token's attention weights over the keys, the reference's and each backend's: `kvdbg attention`.

    What is not given comes from the worst failing head (else the worst head) of
    a replay, and its worst token; the weights are held against the outputs of
    that replay (``report``, when the caller has one, else replayed here: the
    step alone when step, request, head and token are all given).
    """
    from kvdbg.moves.attention import attention_picture, choose

    snap = load(snapshot)
    if report is None:
        steps = None if step is None or None in (request, head, token) else [step]
        report = replay(snap, backends, device=device, steps=steps, progress=progress)
    names = None if backends is None else _named(backends)
    chosen = choose(snap, report, step=step, request=request, head=head, token=token, backends=names)
    return attention_picture(snap, chosen, report, backends=names, progress=progress)


def _named(backends: Iterable[str]) -> list[str]:
    from kvdbg.backends import resolve_backend

    return list(dict.fromkeys(resolve_backend(b) for b in backends))


def error_pictures(report: "ReplayReport"):
    """A judged replay's request x head error maps and its error over steps (`replay --picture`)."""
    from kvdbg.judge.errormap import error_pictures as build

    return build(report)


def page_map(snapshot: "str | Snapshot", *, step: int = 0, request: int | None = None) -> "PageMap":
    """Physical-to-logical page map of one step, with its anomalies: `kvdbg map`."""
    from kvdbg.snapshot.pagemap import page_map as build

    return build(load(snapshot), step, request)


def window(seq_len: int, window: int | None, **kwargs: Any):
    """The FLASHINFER_TS window restriction and per-token visibility: `kvdbg window` (no torch)."""
    from kvdbg.ts.window import analyze_window

    return analyze_window(seq_len, window, **kwargs)


def shrink(snapshot: "str | Snapshot", backend: str | None = None, **kwargs: Any):
    """The smallest snapshot that still fails the same way: `kvdbg shrink`."""
    from kvdbg.backends import resolve_backend
    from kvdbg.moves.shrinker import shrink as run

    return run(load(snapshot), None if backend is None else resolve_backend(backend), **kwargs)


def poison(snapshot: "str | Snapshot", backends: Iterable[str] | None = None, *, device: str = "cpu",
           compile: bool | None = None, **kwargs: Any):
    """Replay with NaN in every slot a correct backend must not read: `kvdbg poison`."""
    from kvdbg.backends import resolve_backend
    from kvdbg.moves.poisoner import poison as run

    names = None if backends is None else [resolve_backend(b) for b in backends]
    return run(load(snapshot), names, _options(device, compile, False), required=names or (), **kwargs)


def sweep(snapshot: "str | Snapshot", knobs: "str | Iterable[str]", backends: Iterable[str] | None = None, *,
          device: str = "cpu", compile: bool | None = None, **kwargs: Any):
    """The snapshot replayed with one knob changed at a time (placement, kv-dtype, ...): `kvdbg sweep`."""
    from kvdbg.backends import resolve_backend
    from kvdbg.moves.sweeper import parse_knobs
    from kvdbg.moves.sweeper import sweep as run

    names = None if backends is None else [resolve_backend(b) for b in backends]
    return run(load(snapshot), parse_knobs(knobs), names, _options(device, compile, False),
               required=names or (), **kwargs)


def diff(path_a: str, path_b: str, **kwargs: Any):
    """Two snapshots of one step, or two saved-output files: what differs: `kvdbg diff`."""
    from kvdbg.moves.snapdiff import diff_files

    return diff_files(path_a, path_b, **kwargs)


__all__ = ["attention", "diff", "error_pictures", "load", "page_map", "poison", "replay", "shrink", "sweep", "window"]
