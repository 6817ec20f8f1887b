"""Where the bundled fixture snapshots live, installed or in a checkout."""

from __future__ import annotations

import os
from importlib import resources

from kvdbg.errors import OptionError

DEFAULT_FIXTURE = "dflash.safetensors"
FIXTURES = (
    "causal_gqa.safetensors",
    "dflash.safetensors",
    "fp8_dense.safetensors",
    "prefix_page0.safetensors",
    "ts_causal_window.safetensors",
)


def fixture_path(name: str) -> str:
    """Absolute path of a bundled fixture (``name`` with or without ``.safetensors``)."""
    if not name.endswith(".safetensors"):
        name += ".safetensors"
    path = os.fspath(resources.files("kvdbg.fixtures") / name)
    if not os.path.isfile(path):
        raise OptionError(f"bundled fixture {name!r} is missing; choose from: {', '.join(FIXTURES)}")
    return path


def default_fixture() -> str:
    return fixture_path(DEFAULT_FIXTURE)
