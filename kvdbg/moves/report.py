"""`kvdbg report`: everything a bug report about a snapshot needs, computed once (rendering is in render/report.py).

The environment is collected the way vLLM's and PyTorch's ``collect_env`` do it:
versions from package metadata, never by importing flashinfer or vllm (either
can take seconds to import, or fail to, on the very machine the report is for).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from kvdbg._version import __version__
from kvdbg.errors import KvdbgError, OptionError, SnapshotError

if TYPE_CHECKING:
    from kvdbg.judge.compare import Comparison
    from kvdbg.judge.findings import Finding
    from kvdbg.snapshot.pagemap import PageMap
    from kvdbg.replayer.runner import ReplayReport
    from kvdbg.snapshot.store import Snapshot
    from kvdbg.snapshot.info import InfoSummary
    from kvdbg.judge.verdict import Verdict

__all__ = ["Environment", "WindowRow", "BackendSummary", "BugReport", "ReportPictures", "build_pictures", "collect_environment", "file_sha256",
           "build_report", "reproduce_command", "snapshot_sha256", "write_text_atomic", "MAX_WORST_HEADS"]

MAX_WORST_HEADS = 3
# Distribution names to look up; the first one installed wins (flashinfer was renamed on its index).
PACKAGES = {
    "flashinfer": ("flashinfer-python", "flashinfer"),
    "vllm": ("vllm",),
    "safetensors": ("safetensors",),
    "numpy": ("numpy",),
    "rich": ("rich",),
    "click": ("click",),
}


@dataclass
class Environment:
    os: str
    python: str
    torch: str
    torch_cuda_build: str  # CUDA (or ROCm) version torch was built with, or "none (CPU-only build)"
    cuda_available: bool
    gpus: list[tuple[str, str]]  # (name, compute capability "major.minor")
    packages: dict[str, str]  # distribution -> version, or "not installed"
    kvdbg: str


@dataclass
class WindowRow:
    """FLASHINFER_TS's dense-window page restriction for one request (kvdbg.ts.window.analyze_window)."""

    step: int
    request: int
    seq_len: int
    query_len: int
    applies: bool
    start_page: int
    pages_dropped: int
    restricted_seq_len: int
    worst_extra: int  # keys the kernel sees that the exact window excludes (worst query token)
    drift: int
    findings: list[str]  # violation codes
    note: str  # why nothing is restricted, when nothing is


@dataclass
class BackendSummary:
    name: str
    engine_name: str | None
    status: str  # "ran", "raised", "unavailable"
    kernel: str  # what ran, or why it could not
    emulated: bool
    verdict: str  # "pass", "FAIL", "not compared"
    failed_heads: int
    heads_compared: int
    max_abs: float  # FAIL: over the failing heads only (NaN: none of them holds a finite error); else every head
    worst: list[tuple[int, int, int, float]]  # (step, request, head, max abs) of the worst failing heads
    finding_counts: dict[str, int]  # code -> count, errors and warnings
    error_findings: int


@dataclass
class BugReport:
    path: str
    sha256: str
    environment: Environment
    summary: "InfoSummary"
    page_maps: list["PageMap"]  # one per step, with its anomalies
    window: list[WindowRow]  # empty unless the layer has a window and FLASHINFER_TS is involved
    window_reason: str  # why there is no window section, when there is none
    replay: "ReplayReport"
    backends: list[BackendSummary]
    command: str
    device: str
    sweep: Any = None  # (kvdbg.moves.sweeper.SweepResult, its Verdict) when asked for (report --sweep)
    pictures: "ReportPictures | None" = None  # when asked for (report --html / --svg): build_pictures

    @property
    def comparisons(self) -> list["Comparison"]:
        return self.replay.comparisons

    @property
    def findings(self) -> list["Finding"]:
        return self.replay.findings

    @property
    def verdict(self) -> "Verdict":
        """The same verdict and exit code as `kvdbg replay` on this snapshot: the replay's own."""
        return self.replay.verdict

    @property
    def failed(self) -> bool:
        return self.verdict.status == "fail"


# --------------------------------------------------------------------------- environment and digest


def _package_version(names: Sequence[str]) -> str:
    from importlib import metadata

    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "not installed"


def collect_environment() -> Environment:
    import torch

    if torch.version.cuda:
        build = f"CUDA {torch.version.cuda}"
    elif getattr(torch.version, "hip", None):
        build = f"ROCm {torch.version.hip}"
    else:
        build = "none (CPU-only build)"
    available = bool(torch.cuda.is_available())
    gpus = []
    if available:
        for index in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(index)
            gpus.append((torch.cuda.get_device_name(index), f"{major}.{minor}"))
    return Environment(
        os=f"{platform.platform()} ({platform.machine()})",
        python=f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
        torch=torch.__version__,
        torch_cuda_build=build,
        cuda_available=available,
        gpus=gpus,
        packages={name: _package_version(dists) for name, dists in PACKAGES.items()},
        kvdbg=__version__,
    )


def file_sha256(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    """SHA-256 of a file read in chunks, so multi-GB snapshots are never held in memory."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while chunk := fh.read(chunk_size):
                digest.update(chunk)
    except OSError as exc:
        raise SnapshotError(f"cannot read {path}: {exc.strerror or exc}") from None
    return digest.hexdigest()


# --------------------------------------------------------------------------- sections


def window_rows(snapshot, backends: Sequence[str]) -> tuple[list[WindowRow], str]:
    """The restriction per request of every step, when FLASHINFER_TS would restrict this layer's pages."""
    from kvdbg.ts.window import analyze_window

    layer, backend = snapshot.meta.layer, snapshot.meta.backend
    if layer.sliding_window is None:
        return [], "the layer has no sliding window"
    if backend.name != "FLASHINFER_TS" and "flashinfer_ts" not in backends:
        return [], f"captured from {backend.name}, and flashinfer_ts was not replayed"
    rows = []
    for s, step in enumerate(snapshot.steps):
        for r, (length, qlen) in enumerate(zip(step.seq_lens.tolist(), step.query_lens)):
            if qlen <= 0:
                continue
            try:
                a = analyze_window(int(length), layer.sliding_window, query_len=qlen, page_size=backend.page_size,
                                   causal=layer.causal, max_model_len=backend.max_model_len,
                                   max_decode_query_len=backend.max_decode_query_len)
            except OptionError as exc:  # a length the builder never sees (e.g. beyond max_model_len)
                rows.append(WindowRow(s, r, int(length), qlen, False, 0, 0, int(length), 0, 0, [], str(exc)))
                continue
            rows.append(WindowRow(
                step=s, request=r, seq_len=int(length), query_len=qlen, applies=a.applies,
                start_page=a.restriction.start_page if a.applies else 0,
                pages_dropped=a.restriction.pages_dropped if a.applies else 0,
                restricted_seq_len=a.builder.seq_len, worst_extra=a.visibility.worst_extra,
                drift=a.visibility.drift, findings=[v.code for v in a.findings], note=a.reason))
    return rows, ""


def backend_summaries(report: "ReplayReport") -> list[BackendSummary]:
    result, comparisons = report.result, report.comparisons
    out = []
    raised = {name for step in result.steps for name, run in step.runs.items() if run.error}
    for st in result.backends:
        if st.name == "reference":
            vs_ref: list = []
        else:
            vs_ref = [c for c in comparisons if c.actual == st.name and c.expected == "reference"]
        failed = [(c.step, h) for c in vs_ref for h in c.failed]
        failed.sort(key=lambda sh: (-sh[1].not_compared, -(sh[1].max_abs if sh[1].max_abs == sh[1].max_abs else 0.0)))
        findings = [f for f in result.findings if f.backend == st.name and f.severity in ("error", "warning")]
        counts: dict[str, int] = {}
        for f in findings:
            counts[f.code] = counts.get(f.code, 0) + 1
        if not st.available:
            status, kernel = "unavailable", st.reason or ""
        else:
            runs = [step.runs[st.name] for step in result.steps if st.name in step.runs]
            status = "raised" if st.name in raised else "ran"
            if runs and all(run.not_applicable is not None for run in runs):
                status = "not applicable"
            info = st.info
            kernel = (f"{info.kernel} on {info.device}, {'compiled' if info.compiled else 'eager'}, {info.dtype}"
                      if info else "")
        if st.name == "reference":
            verdict = "reference"
        elif not vs_ref:
            verdict = "not compared"
        else:
            verdict = "FAIL" if failed else "pass"
        out.append(BackendSummary(
            name=st.name, engine_name=st.engine_name, status=status, kernel=kernel,
            emulated=bool(st.info.emulated) if st.info else False, verdict=verdict,
            failed_heads=len(failed), heads_compared=sum(len(c.heads) for c in vs_ref),
            max_abs=_row_error([c for c in vs_ref if c.failed] if failed else vs_ref),
            worst=[(s, h.request, h.head, h.max_abs) for s, h in failed[:MAX_WORST_HEADS]],
            finding_counts=counts, error_findings=sum(f.severity == "error" for f in findings)))
    return out


def _row_error(comparisons) -> float:
    """The largest error the comparisons state (kvdbg.judge.compare.Comparison.shown_max_abs: a failing one's
    from its failing heads); NaN when none states a finite one."""
    finite = [e for c in comparisons if (e := c.shown_max_abs) == e]
    return max(finite) if finite else float("nan")


def reproduce_command(path: str, backends: Sequence[str], device: str = "cpu") -> str:
    parts = ["kvdbg", "replay", path]
    for name in backends:
        if name != "reference":  # replay always adds the reference
            parts += ["--backend", name]
    if device != "cpu":
        parts += ["--device", device]
    return " ".join(shlex.quote(p) for p in parts)


def build_report(snapshot: "str | os.PathLike | Snapshot", backends: Sequence[str] | None = None, *,
                 device: str = "cpu", progress: Callable[[str], None] | None = None) -> BugReport:
    """Summarise, map and replay one loaded snapshot (a path is loaded once); everything the report shows."""
    from kvdbg.backends.base import ReplayOptions
    from kvdbg.backends import DEFAULT_ORDER
    from kvdbg.snapshot.pagemap import page_map
    from kvdbg.replayer.runner import replay
    from kvdbg.snapshot.store import Snapshot, load_snapshot
    from kvdbg.snapshot.info import summarize_snapshot

    snap = snapshot if isinstance(snapshot, Snapshot) else load_snapshot(snapshot)
    if snap.path is None or snap.header is None or snap.header.meta is not snap.meta:
        raise OptionError("report: the snapshot must be one load_snapshot read from a file (its header, digest "
                          "and contents are reported); save it first (kvdbg.snapshot.store.save_snapshot)")
    path = snap.path
    summary = summarize_snapshot(snap)
    names = list(dict.fromkeys(backends)) if backends else list(DEFAULT_ORDER)
    if "reference" not in names:
        names.insert(0, "reference")
    if progress:
        progress("hashing the file")
    sha = snapshot_sha256(snap)
    page_maps = [page_map(snap, step=s) for s in range(len(snap.steps))]
    window, window_reason = window_rows(snap, names)
    options = ReplayOptions(device=device)
    result = replay(snap, names, options, required=[n for n in (backends or ()) if n != "reference"],
                    progress=progress)
    judged = result.judge()
    return BugReport(
        path=path, sha256=sha, environment=collect_environment(), summary=summary, page_maps=page_maps,
        window=window, window_reason=window_reason, replay=judged, backends=backend_summaries(judged),
        command=reproduce_command(os.path.basename(path), _replayed(result, explicit=bool(backends)), options.device),
        device=options.device)


def snapshot_sha256(snapshot: "Snapshot") -> str:
    """SHA-256 of the file ``snapshot`` was loaded from; refuses a file that changed since it was loaded."""
    from kvdbg.snapshot.store import _file_identity as file_identity

    sha = file_sha256(snapshot.path)
    loaded = snapshot.kv_source[0] if snapshot.kv_source else None
    try:
        now = file_identity(snapshot.path)
    except OSError as exc:
        raise SnapshotError(f"cannot read {snapshot.path}: {exc.strerror or exc}") from None
    if loaded is not None and now != loaded:
        raise SnapshotError(f"{snapshot.path} changed while the report was made; run kvdbg report again")
    return sha


def _replayed(result, *, explicit: bool) -> list[str]:
    """Backends the reproducing command names: those the report was asked for, else none (a plain replay runs the
    same defaults). Naming a default would judge it: a what-if column that fails would change the verdict."""
    return [st.name for st in result.backends if st.name != "reference"] if explicit else []


# --------------------------------------------------------------------------- pictures


@dataclass
class ReportPictures:
    """The pictures of a report: which heads are wrong, the error over steps, where the attention went, the window."""

    errors: Any  # kvdbg.judge.errormap.ErrorPictures
    attention: Any  # kvdbg.moves.attention.AttentionPicture, or None when it cannot be drawn (attention_reason says why)
    attention_reason: str
    window: Any  # kvdbg.moves.picture.Picture of the attention's request (its step), or None
    window_analysis: Any  # kvdbg.ts.window.WindowAnalysis behind it
    window_reason: str


def build_pictures(report: BugReport, progress: Callable[[str], None] | None = None) -> ReportPictures:
    """Every picture of ``report`` from its replay (nothing replayed again)."""
    from kvdbg.judge.errormap import error_pictures
    from kvdbg.snapshot.store import load_snapshot

    errors = error_pictures(report.replay)
    snap = load_snapshot(report.path)
    picture, reason = None, ""
    names = [st.name for st in report.replay.result.backends if st.available]
    if progress:
        progress("drawing where the attention went")
    try:
        from kvdbg.moves.attention import attention_picture, choose

        chosen = choose(snap, report.replay, step=None, request=None, head=None, token=None, backends=names)
        picture = attention_picture(snap, chosen, report.replay, backends=names)
    except KvdbgError as exc:  # e.g. a request with no query token to show
        reason = str(exc)
    window = analysis = None
    window_reason = ""
    step = picture.step if picture is not None else 0
    request = picture.request if picture is not None else None
    try:
        from kvdbg.moves.picture import picture as window_picture
        from kvdbg.ts.window import analyze_window
        from kvdbg.moves.window_source import step_tables, window_source

        source = window_source(report.path, step=step, request=request)
        analysis = analyze_window(source.seq_len, source.window, query_len=source.query_len,
                                  page_size=source.page_size, causal=source.causal,
                                  max_model_len=source.max_model_len,
                                  max_decode_query_len=source.max_decode_query_len)
        window = window_picture(analysis, step_tables(report.path, step), source.request)
    except KvdbgError as exc:
        window_reason = str(exc)
    return ReportPictures(errors, picture, reason, window, analysis, window_reason)


# --------------------------------------------------------------------------- writing


def write_text_atomic(path: str | os.PathLike, text: str, *, overwrite: bool = False) -> str:
    """Write ``text`` through a temporary file and a rename; never replace a file unless ``overwrite``."""
    from kvdbg.util.atomic import write_text_atomic as write

    return write(path, text, overwrite=overwrite)
