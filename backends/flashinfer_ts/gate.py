"""Can the real prims_ts kernel run here: the flashinfer import, its version and API generation, the GPU."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from kvdbg.ts.contract import STRICTEST, SUPPORTED_CAPABILITIES, ApiGeneration, api_for_version

MIN_FLASHINFER = (0, 7, 1)

# Named in the reason a GPU is refused, so a user sees at once which machine they are on.
_ARCH_NAMES = {7: "Volta/Turing", 8: "Ampere/Ada", 9: "Hopper, e.g. H100/H200", 12: "consumer Blackwell"}


# --------------------------------------------------------------------------- can the real kernel run here?


@dataclass(frozen=True)
class KernelGate:
    """Whether the real prims_ts kernel runs, and precisely why not when it does not."""

    available: bool
    reason: str | None = None  # why not; shown in RunInfo.notes of the emulated run
    wrapper_cls: Any = None  # flashinfer's BatchDecodePagedTSWrapper (or a test double)
    flashinfer_version: str | None = None
    capability: tuple[int, int] | None = None
    api: ApiGeneration | None = None  # the installed flashinfer's API generation (None: not installed/usable)
    api_note: str | None = None  # set when the installed release is newer than any kvdbg knows

    @property
    def contract(self) -> ApiGeneration:
        """The generation whose rules a batch is held to: the installed one, else the strictest known."""
        return self.api or STRICTEST

    @property
    def short_path(self) -> str:
        """``path`` in a few words, for a table column."""
        if self.api is None:
            return f"none usable: {STRICTEST.label} rules (strictest)"
        return f"{self.flashinfer_version}: {self.api.label}" + (" (newer, untested)" if self.api_note else "")

    @property
    def path(self) -> str:
        """Which FlashInfer calling path and rules apply, in words (``--explain``, the column's notes)."""
        if self.api is None:
            why = f"flashinfer {self.flashinfer_version} unusable" if self.flashinfer_version else \
                "no usable flashinfer installed"
            return f"{why}: held to the {STRICTEST.label}'s rules, the strictest kvdbg knows"
        path = f"flashinfer-python {self.flashinfer_version}, called with the {self.api.label}"
        return f"{path} ({self.api_note})" if self.api_note else path


def _import_prims_ts() -> tuple[Any, str]:
    """(BatchDecodePagedTSWrapper, flashinfer.__version__); raises ImportError where absent.

    Kept in its own function so tests can replace it, and so flashinfer is only
    ever imported when a replay asks for this backend.
    """
    from flashinfer.attention.prims_ts import BatchDecodePagedTSWrapper

    import flashinfer

    return BatchDecodePagedTSWrapper, str(getattr(flashinfer, "__version__", "unknown"))


def _probe_device(device: str) -> tuple[tuple[int, int] | None, str | None]:
    """(compute capability, None) for a usable CUDA replay device, else (None, why not)."""
    if not torch.cuda.is_available():
        built = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA device is visible"
        return None, f"no CUDA: {built} (torch {torch.__version__}); prims_ts needs a CUDA device"
    dev = torch.device(device)
    if dev.type != "cuda":
        return None, f"the replay runs on {device}; prims_ts needs CUDA tensors (replay with --device cuda)"
    return tuple(torch.cuda.get_device_capability(dev)), None


def parse_version(text: str) -> tuple[int, int, int] | None:
    """The release triple of a version string (``0.7.0.post1`` -> (0, 7, 0)); None if it has none."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


def _too_old_reason(version: str, parsed: tuple[int, int, int]) -> str:
    need = ".".join(map(str, MIN_FLASHINFER))
    if parsed[:2] == (0, 7):
        # The one release before the fix: the module imports, then the first plan() dies in codegen; and
        # its unchecked run() path passes the kernel only the page stride, assuming compact HND pages.
        why = ("its prims_ts code generation still passes a `context` keyword to Task._run_task_body_impl, "
               "which cutlass-dsl 4.8 removed, so the first plan() fails with a TypeError; and it requires "
               "compact K/V strides (head_dim-wide tokens): with validate=False it would read vLLM's K/V "
               "halves, whose token stride is 2*D, at the wrong addresses without any error")
    else:
        why = "earlier prims_ts builds do not accept vLLM's K/V halves with token stride 2*D"
    return f"flashinfer-python {version} is too old: FLASHINFER_TS needs >= {need} ({why})"


def kernel_gate(device: str, *, force_emulation: bool = False) -> KernelGate:
    """Check, in order: flashinfer importable, version, forced emulation, CUDA, compute capability.

    The installed release decides the calling path and the rules a batch is held to, emulated or not.
    """
    forced = "emulation requested (force_emulation): the real kernel was not tried"
    try:
        wrapper_cls, version = _import_prims_ts()
    except ImportError as exc:
        if force_emulation:
            return KernelGate(False, forced)
        need = ".".join(map(str, MIN_FLASHINFER))
        return KernelGate(False, f"flashinfer missing: flashinfer.attention.prims_ts does not import "
                                 f"({exc}); FLASHINFER_TS needs flashinfer-python >= {need}")
    parsed = parse_version(version)
    if parsed is None:
        return KernelGate(False, f"flashinfer reports version {version!r}, which kvdbg cannot compare with "
                                 f"{'.'.join(map(str, MIN_FLASHINFER))}", flashinfer_version=version)
    api, api_note = api_for_version(parsed)
    if api is None:
        return KernelGate(False, _too_old_reason(version, parsed), flashinfer_version=version)
    versioned = dict(flashinfer_version=version, api=api, api_note=api_note)
    if force_emulation:
        return KernelGate(False, forced, **versioned)
    capability, why = _probe_device(device)
    if capability is None:
        return KernelGate(False, why, **versioned)
    capability = (int(capability[0]), int(capability[1]))
    if capability not in SUPPORTED_CAPABILITIES:
        arch = _ARCH_NAMES.get(capability[0])
        shown = f"{capability[0]}.{capability[1]}" + (f" ({arch})" if arch else "")
        wanted = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_CAPABILITIES)
        return KernelGate(False, f"compute capability {shown} is not supported: prims_ts runs only on "
                                 f"{wanted} (B200, B300, Rubin)", capability=capability, **versioned)
    return KernelGate(True, None, wrapper_cls, capability=capability, **versioned)


def installed_api() -> ApiGeneration:
    """The installed flashinfer's API generation, else the strictest known (no flashinfer: nothing to run)."""
    try:
        _, version = _import_prims_ts()
    except ImportError:
        return STRICTEST
    parsed = parse_version(version)
    api = api_for_version(parsed)[0] if parsed is not None else None
    return api or STRICTEST
