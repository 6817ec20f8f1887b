"""What the sentinel checks and how often it may capture: a frozen configuration read from the KVDBG_SENTINEL* variables.

No torch here: the vLLM plugin reads it before anything heavy is imported.
:meth:`SentinelConfig.from_env` validates every variable at once and raises
:class:`~kvdbg.errors.OptionError` with one line naming the variable.
docs/capture.md (Sentinel) describes them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Callable, Mapping

from kvdbg.capture.config import ENV_DIR as ENV_CAPTURE_DIR
from kvdbg.capture.config import LayerFilter, parse_count
from kvdbg.errors import OptionError

__all__ = ["DEFAULT_INTERVAL", "DEFAULT_MAX", "DEFAULT_PAIRS", "DEFAULT_RATE", "ENV_DIR", "ENV_INTERVAL",
           "ENV_LAYERS", "ENV_MAX", "ENV_PAIRS", "ENV_PROCESS", "ENV_RATE", "ENV_SEED", "SentinelConfig", "parse_rate",
           "sentinel_requested"]

ENV_RATE = "KVDBG_SENTINEL"
ENV_LAYERS = "KVDBG_SENTINEL_LAYERS"
ENV_DIR = "KVDBG_SENTINEL_DIR"
ENV_PAIRS = "KVDBG_SENTINEL_PAIRS"
ENV_MAX = "KVDBG_SENTINEL_MAX"
ENV_INTERVAL = "KVDBG_SENTINEL_INTERVAL"
ENV_SEED = "KVDBG_SENTINEL_SEED"
ENV_PROCESS = "KVDBG_SENTINEL_PROCESS"
ENV_REFERENCE = "KVDBG_SENTINEL_REFERENCE"

# KVDBG_SENTINEL=on: the share of each selected layer's steps that is checked.
DEFAULT_RATE = 0.01
# (request, head) pairs computed exactly per checked step.
DEFAULT_PAIRS = 4
# Snapshots the sentinel writes per process at most, and the least seconds between two of them: a fault
# that fires on every step must not fill the disk or hold up the engine with writes.
DEFAULT_MAX = 8
DEFAULT_INTERVAL = 60.0

_ON = ("on", "true", "yes")
_OFF = ("", "0", "off", "false", "no")


def sentinel_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``KVDBG_SENTINEL`` asks for the sentinel (not validated: :meth:`SentinelConfig.from_env` does)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_RATE, "").strip().lower() not in _OFF


def parse_rate(text: str | None) -> float:
    """``KVDBG_SENTINEL``: a share of steps in (0, 1] (``0.01``, ``1%``), ``on`` (the default rate), or 0/off."""
    value = (text or "").strip().lower()
    if value in _OFF:
        return 0.0
    if value in _ON:
        return DEFAULT_RATE
    try:
        rate = float(value[:-1]) / 100 if value.endswith("%") else float(value)
    except ValueError:
        rate = math.nan
    if not math.isfinite(rate) or not 0 < rate <= 1:
        raise OptionError(f"{ENV_RATE} must be a share of steps in (0, 1] like 0.01 or 1%, 'on' ({DEFAULT_RATE}) or "
                          f"'off', got {(text or '')[:40]!r}")
    return rate


def _parse_seconds(text: str | None) -> float:
    value = (text or "").strip()
    if not value:
        return DEFAULT_INTERVAL
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise OptionError(f"{ENV_INTERVAL} must be seconds >= 0 between two sentinel snapshots, got {value[:40]!r}")
    return seconds


def _parse_pairs(text: str | None) -> int:
    pairs = parse_count(text, ENV_PAIRS, DEFAULT_PAIRS)
    if pairs is None:  # "unlimited": every pair is the whole reference, not a sample
        raise OptionError(f"{ENV_PAIRS} must be a positive integer (pairs checked per sampled step), got 'unlimited'")
    return pairs


def _parse_seed(text: str | None) -> int | None:
    value = (text or "").strip()
    if not value:
        return None
    if not (value.isascii() and value.isdigit()) or len(value) > 18:
        raise OptionError(f"{ENV_SEED} must be a non-negative integer, got {value[:40]!r}")
    return int(value)


# Where the checker process works out a CUDA step's reference: the host (from the sampled pairs' rows and pages,
# copied over in one go) or the device those lie on.
REFERENCE_PLACES = ("host", "device")


def _parse_reference(text: str | None) -> str:
    value = (text or "").strip().lower()
    if not value:
        return REFERENCE_PLACES[0]
    if value not in REFERENCE_PLACES:
        raise OptionError(f"{ENV_REFERENCE} must be host or device (where the checker process works out a CUDA "
                          f"step's reference), got {value[:40]!r}")
    return value


def _parse_switch(text: str | None, name: str, default: bool) -> bool:
    value = (text or "").strip().lower()
    if not value:
        return default
    if value in ("1",) + _ON:
        return True
    if value in _OFF:
        return False
    raise OptionError(f"{name} must be on or off (1/0), got {value[:40]!r}")


@dataclass(frozen=True)
class SentinelConfig:
    """Which steps are checked, how much of each, and how often a disagreement may be captured."""

    directory: str
    rate: float = DEFAULT_RATE
    layers: Callable[[str], bool] = field(default_factory=LayerFilter)
    pairs: int = DEFAULT_PAIRS
    max_snapshots: int | None = DEFAULT_MAX  # None: no cap
    interval: float = DEFAULT_INTERVAL  # least seconds between two snapshots
    seed: int | None = None  # None: a fresh one per process (said in the active line)
    # Checks of staged graph steps in a process of their own (kvdbg.sentinel.remote), where their Python does not
    # hold the lock the engine's thread wants.
    process: bool = True
    # Where the checker process works out a CUDA step's reference (REFERENCE_PLACES): on the host, the device runs
    # only the picking of the sampled pairs' rows and pages, a few kernels in one burst, beside the engine's.
    reference: str = REFERENCE_PLACES[0]

    def __post_init__(self) -> None:
        object.__setattr__(self, "directory", os.fspath(self.directory))
        if isinstance(self.layers, str) or self.layers is None:
            object.__setattr__(self, "layers", LayerFilter(self.layers, "layers"))
        if not 0 < self.rate <= 1:
            raise OptionError(f"rate must be in (0, 1], got {self.rate!r}")
        if isinstance(self.pairs, bool) or not isinstance(self.pairs, int) or self.pairs < 1:
            raise OptionError(f"pairs must be a positive integer, got {self.pairs!r}")
        if self.max_snapshots is not None and (not isinstance(self.max_snapshots, int) or self.max_snapshots < 1):
            raise OptionError(f"max_snapshots must be a positive integer or None, got {self.max_snapshots!r}")
        if not self.interval >= 0:
            raise OptionError(f"interval must be seconds >= 0, got {self.interval!r}")
        if self.reference not in REFERENCE_PLACES:
            raise OptionError(f"reference must be one of {', '.join(REFERENCE_PLACES)}, got {self.reference!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "SentinelConfig":
        """The configuration the ``KVDBG_SENTINEL*`` variables describe; OptionError naming a bad one."""
        env = os.environ if environ is None else environ
        rate = parse_rate(env.get(ENV_RATE))
        if rate == 0:
            raise OptionError(f"{ENV_RATE} is not set or off; set it to a share of steps (e.g. 0.01)")
        directory = env.get(ENV_DIR, "").strip() or env.get(ENV_CAPTURE_DIR, "").strip()
        if not directory:
            raise OptionError(f"{ENV_RATE} is set but neither {ENV_DIR} nor {ENV_CAPTURE_DIR} names a directory for "
                              "the snapshots of wrong steps")
        return cls(
            directory=directory,
            rate=rate,
            layers=LayerFilter(env.get(ENV_LAYERS) or None, ENV_LAYERS),
            pairs=_parse_pairs(env.get(ENV_PAIRS)),
            max_snapshots=parse_count(env.get(ENV_MAX), ENV_MAX, DEFAULT_MAX),
            interval=_parse_seconds(env.get(ENV_INTERVAL)),
            seed=_parse_seed(env.get(ENV_SEED)),
            process=_parse_switch(env.get(ENV_PROCESS), ENV_PROCESS, True),
            reference=_parse_reference(env.get(ENV_REFERENCE)),
        )

    def describe(self, seed: int | None = None) -> str:
        cap = "unlimited" if self.max_snapshots is None else str(self.max_snapshots)
        seed = self.seed if seed is None else seed
        return (f"rate={self.rate:g} layers={self.layers} pairs={self.pairs} directory={self.directory} "
                f"max={cap} interval={self.interval:g}s seed={seed} process={'on' if self.process else 'off'}"
                + (f" reference={self.reference}" if self.process else ""))
