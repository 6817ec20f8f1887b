"""The temporary files of capture writes: how this process's are named, and which ones dead processes left.

A write goes to ``<TEMP_PREFIX><host>-<pid>-<random>.tmp`` beside its snapshot;
a later capture into the directory removes those of dead processes of its host
(:func:`stale_temp_files`), never another host's or a live process's.
"""

from __future__ import annotations

import os
import re
import socket

__all__ = ["TEMP_PREFIX", "stale_temp_files", "temp_file_prefix"]

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_HOST = _SAFE_NAME.sub("_", socket.gethostname()) or "host"
# Temp files of capture writes: <prefix><host>-<pid>-<random>.tmp. A process killed mid-write
# leaves one behind; a later capture into the directory removes those of dead processes of its host.
TEMP_PREFIX = ".kvdbg-capture-"
_TEMP_NAME = re.compile(r"^\.kvdbg-capture-(?P<host>.+)-(?P<pid>[0-9]+)-[A-Za-z0-9_]+\.tmp$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell: keep its files
    return True


def temp_file_prefix(pid: int | None = None) -> str:
    """How the temp files of capture writes by ``pid`` (default: this process) on this host begin."""
    return f"{TEMP_PREFIX}{_HOST}-{os.getpid() if pid is None else pid}-"


def stale_temp_files(directory: str) -> list[str]:
    """Capture temp files in ``directory`` left by dead processes of this host (never another host's or a live one's)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    stale = []
    for name in names:
        match = _TEMP_NAME.match(name)
        if match is None or match["host"] != _HOST:
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and not _pid_alive(pid):
            stale.append(os.path.join(directory, name))
    return sorted(stale)
