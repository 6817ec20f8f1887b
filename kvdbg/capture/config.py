"""What to capture and within which budgets: a frozen configuration, read from the KVDBG_CAPTURE_* variables once.

:meth:`CaptureConfig.from_env` parses and validates every variable at once and
raises :class:`~kvdbg.errors.OptionError` with one line naming the variable; a
:class:`~kvdbg.capture.capturer.Capturer` then holds the result and never reads the
environment again. No torch here: the vLLM plugin reads its configuration
before anything heavy is imported. docs/capture.md lists the variables.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kvdbg.errors import OptionError
from kvdbg.util.ranges import IntRanges, parse_ranges

__all__ = [
    "CaptureConfig",
    "LayerFilter",
    "parse_bytes",
    "parse_count",
    "AUTO_BACKENDS",
    "DEFAULT_BACKENDS",
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_SNAPSHOTS",
    "DEFAULT_QUEUE_BYTES",
    "QUEUE_SHARE_OF_AVAILABLE",
    "ENV_BACKENDS",
    "ENV_DIR",
    "ENV_LAYERS",
    "ENV_MAX",
    "ENV_MAX_BYTES",
    "ENV_QUEUE_BYTES",
    "ENV_RANKS",
    "ENV_STEPS",
    "auto_queue_bytes",
    "available_memory",
]

ENV_DIR = "KVDBG_CAPTURE_DIR"
ENV_BACKENDS = "KVDBG_CAPTURE_BACKENDS"
ENV_LAYERS = "KVDBG_CAPTURE_LAYERS"
ENV_STEPS = "KVDBG_CAPTURE_STEPS"
ENV_RANKS = "KVDBG_CAPTURE_RANKS"
ENV_MAX = "KVDBG_CAPTURE_MAX"
ENV_MAX_BYTES = "KVDBG_CAPTURE_MAX_BYTES"
ENV_QUEUE_BYTES = "KVDBG_CAPTURE_QUEUE_BYTES"
# Replaced by ENV_QUEUE_BYTES; a value left set is refused by name rather than ignored.
ENV_QUEUE_COUNT_REPLACED = "KVDBG_CAPTURE_QUEUE"

# KVDBG_CAPTURE_BACKENDS unset or "auto": the plugin wraps the backend of each attention layer the
# engine builds (its cache is then checked against what vLLM declares for the layer). Names instead
# wrap those backends only.
AUTO_BACKENDS = "auto"
DEFAULT_BACKENDS: tuple[str, ...] = ()
# A live engine left capturing by mistake must not fill a disk: these apply when the
# variables are unset (``unlimited`` lifts a cap explicitly).
DEFAULT_MAX_SNAPSHOTS = 32
DEFAULT_MAX_BYTES = 4 * 1024**3
# Bytes of snapshots that may wait for the background writer; past them a step is dropped and
# counted. "auto": QUEUE_SHARE_OF_AVAILABLE of the memory available when the writer starts (so after
# the engine has allocated its weights and cache), at least QUEUE_FLOOR_BYTES, at most max_bytes.
DEFAULT_QUEUE_BYTES = "auto"
QUEUE_SHARE_OF_AVAILABLE = 0.25
QUEUE_FLOOR_BYTES = 64 * 1024**2


# --------------------------------------------------------------------------- value parsers


@dataclass(frozen=True)
class LayerFilter:
    """Which layer names to capture: ``re:<regex>`` (searched), else comma-separated globs (whole name)."""

    pattern: str | None = None
    what: str = "layer pattern"

    def __post_init__(self) -> None:
        regex, globs = None, ()
        if self.pattern is not None and self.pattern.startswith("re:"):
            try:
                regex = re.compile(self.pattern[3:])
            except re.error as exc:
                raise OptionError(f"{self.what} {self.pattern!r} is not a valid regular expression: {exc}") from None
        elif self.pattern is not None:
            globs = tuple(g.strip() for g in self.pattern.split(",") if g.strip())
            if not globs:
                raise OptionError(f"{self.what} is empty; give globs like '*.layers.3.*' or 're:<regex>'")
        object.__setattr__(self, "_regex", regex)
        object.__setattr__(self, "_globs", globs)

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
    if not (text.isascii() and text.isdigit()) or len(text) > 18 or int(text) < (0 if zero_ok else 1):
        kind = "a non-negative integer" if zero_ok else "a positive integer or 'unlimited'"
        raise OptionError(f"{what} must be {kind}, got {text[:40]!r}")
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
    match = re.fullmatch(r"([0-9]{1,18}(?:\.[0-9]{1,9})?)\s*([A-Za-z]*)", text)
    if match is None or match.group(2).lower() not in _BYTE_UNITS:
        raise OptionError(f"{what} must be bytes like 500000, 512M or 4GiB, or 'unlimited'; got {text[:40]!r}")
    value = int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    if value <= 0:
        raise OptionError(f"{what} must be positive, got {text!r}")
    return value


def parse_backends(text: str | None, what: str = ENV_BACKENDS) -> tuple[str, ...] | None:
    """Comma-separated vLLM backend names, upper-cased; None when unset or ``auto`` (every layer's backend)."""
    if text is None or not text.strip() or text.strip().lower() == AUTO_BACKENDS:
        return None
    names = tuple(dict.fromkeys(n.strip().upper() for n in text.split(",") if n.strip()))
    if not names:
        raise OptionError(f"{what} names no backend; e.g. FLASH_ATTN,TRITON_ATTN, or {AUTO_BACKENDS} "
                          "(each attention layer's own backend)")
    if AUTO_BACKENDS.upper() in names:
        raise OptionError(f"{what}: {AUTO_BACKENDS!r} stands alone (each attention layer's own backend); "
                          f"got {text.strip()[:60]!r}")
    return names


# --------------------------------------------------------------------------- the configuration


@dataclass(frozen=True)
class CaptureConfig:
    """Where snapshots go, which steps are taken, and the budgets. Frozen: change it with ``replace``.

    The field defaults are the Python API's (no caps, writes in the caller's
    thread); :meth:`from_env` applies the variables' safer defaults instead.
    """

    directory: str
    layers: Callable[[str], bool] = field(default_factory=LayerFilter)
    steps: IntRanges | None = None  # None: every step
    ranks: IntRanges | None = None  # None: every rank
    max_snapshots: int | None = None  # None: no cap
    max_bytes: int | None = None
    # 0: finish() writes in the caller's thread. N > 0 or "auto": finish() only hands the copied step
    # to a background writer, which holds at most this many bytes of waiting snapshots; a step that
    # would go past them is dropped (counted, logged once, and said at exit).
    queue_bytes: int | str = 0
    rank: int | None = None  # this process's rank, when the caller fixes it
    engine: str | None = None  # recorded as provenance; None: "vllm <version>" when installed
    # vLLM backends the plugin wraps up front; empty: the backend of each attention layer, as it is built.
    backends: tuple[str, ...] = DEFAULT_BACKENDS
    backends_given: bool = False  # named by the user (a missing one is then a warning)
    # Snapshots announced at INFO (one line each); the rest at DEBUG, so a long capture stays readable.
    info_snapshot_lines: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", os.fspath(self.directory))
        if isinstance(self.layers, str) or self.layers is None:
            object.__setattr__(self, "layers", LayerFilter(self.layers, "layers"))
        elif not callable(self.layers):
            raise OptionError(f"layers must be a pattern, a callable or None, got {type(self.layers).__name__}")
        object.__setattr__(self, "steps", IntRanges.of(self.steps, "steps"))
        object.__setattr__(self, "ranks", IntRanges.of(self.ranks, "ranks"))
        for name in ("max_snapshots", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise OptionError(f"{name} must be a positive integer or None, got {value!r}")
        if self.queue_bytes != "auto" and (isinstance(self.queue_bytes, bool) or not isinstance(self.queue_bytes, int)
                                           or self.queue_bytes < 0):
            raise OptionError(f"queue_bytes must be a non-negative integer or 'auto', got {self.queue_bytes!r}")

    @property
    def background(self) -> bool:
        """Whether finish() hands steps to a background writer (else it writes in the caller's thread)."""
        return self.queue_bytes != 0

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "CaptureConfig":
        """The configuration the ``KVDBG_CAPTURE_*`` variables describe; OptionError naming a bad one."""
        env = os.environ if environ is None else environ
        directory = env.get(ENV_DIR, "").strip()
        if not directory:
            raise OptionError(f"{ENV_DIR} is not set; it names the directory snapshots are written to")

        def ranges(name: str) -> IntRanges | None:
            text = env.get(name, "")
            return parse_ranges(text, name) if text.strip() else None

        if env.get(ENV_QUEUE_COUNT_REPLACED, "").strip():
            raise OptionError(f"{ENV_QUEUE_COUNT_REPLACED} (a count of snapshots) was replaced by {ENV_QUEUE_BYTES} "
                              f"(a memory budget; default auto, 0 writes in the engine's thread): unset it")
        backends = parse_backends(env.get(ENV_BACKENDS))
        return cls(
            directory=directory,
            layers=LayerFilter(env.get(ENV_LAYERS) or None, ENV_LAYERS),
            steps=ranges(ENV_STEPS),
            ranks=ranges(ENV_RANKS),
            max_snapshots=parse_count(env.get(ENV_MAX), ENV_MAX, DEFAULT_MAX_SNAPSHOTS),
            max_bytes=parse_bytes(env.get(ENV_MAX_BYTES), ENV_MAX_BYTES, DEFAULT_MAX_BYTES),
            queue_bytes=parse_queue_bytes(env.get(ENV_QUEUE_BYTES)),
            backends=backends or DEFAULT_BACKENDS,
            backends_given=backends is not None,
        )

    def describe(self) -> str:
        def cap(value, unit):
            return "unlimited" if value is None else f"{value}{unit}"

        return (
            f"directory={self.directory} layers={self.layers} "
            f"steps={self.steps if self.steps is not None else 'all'} "
            f"ranks={self.ranks if self.ranks is not None else 'all'} "
            f"max={cap(self.max_snapshots, '')} max_bytes={cap(self.max_bytes, ' bytes')} "
            f"writer={self.describe_writer()}"
        )

    def describe_writer(self) -> str:
        if not self.background:
            return "in the caller's thread"
        if self.queue_bytes == "auto":
            return (f"background, queue up to {int(QUEUE_SHARE_OF_AVAILABLE * 100)}% of the memory available when "
                    "it starts")
        return f"background, queue up to {self.queue_bytes} bytes"


def parse_queue_bytes(text: str | None) -> int | str:
    """``auto`` (also when unset), ``0`` (no background writer) or bytes like ``512M``; ``unlimited`` is refused."""
    if text is None or not text.strip() or text.strip().lower() == "auto":
        return DEFAULT_QUEUE_BYTES
    if text.strip() == "0":
        return 0
    if text.strip().lower() == "unlimited":
        raise OptionError(f"{ENV_QUEUE_BYTES} cannot be unlimited (a slow disk would fill the memory); give bytes "
                          "like 2G, 'auto' or 0")
    return parse_bytes(text, ENV_QUEUE_BYTES, None)


def available_memory() -> int | None:
    """Bytes of memory available to new allocations without swapping (Linux ``MemAvailable``), else free pages."""
    try:
        with open("/proc/meminfo", "rb") as fh:
            for line in fh:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def auto_queue_bytes(max_bytes: int | None, available: int | None = None) -> tuple[int, str]:
    """The ``auto`` budget of the writer's queue and a phrase saying how it was chosen."""
    available = available_memory() if available is None else available
    if available is None:
        budget, why = QUEUE_FLOOR_BYTES, "the floor: available memory is unknown here"
    else:
        budget = max(QUEUE_FLOOR_BYTES, int(available * QUEUE_SHARE_OF_AVAILABLE))
        why = f"{int(QUEUE_SHARE_OF_AVAILABLE * 100)}% of the {available // 1024**2} MiB available"
    if max_bytes is not None and max_bytes < budget:
        budget, why = max_bytes, f"{ENV_MAX_BYTES}, below {why}"
    return budget, why
