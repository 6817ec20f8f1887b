"""Setting a few environment variables for a while, and putting them back as they were."""

from __future__ import annotations

import os
from typing import Iterable, Mapping


def saved_environ(names: Iterable[str]) -> dict[str, str | None]:
    """The current values of ``names`` (None: unset), for :func:`restore_environ`."""
    return {name: os.environ.get(name) for name in names}


def restore_environ(saved: Mapping[str, str | None]) -> None:
    """Each variable of ``saved`` set back to its value, or unset where it was unset."""
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
