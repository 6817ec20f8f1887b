"""Atomic, no-clobber file writes: every file kvdbg writes goes through here."""

from __future__ import annotations

import os
import tempfile
from typing import BinaryIO, Callable

from kvdbg.errors import OptionError


TEMP_PREFIX = ".kvdbg-"
TEMP_SUFFIX = ".tmp"


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, overwrite: bool = False,
                 what: str = "", temp_prefix: str = TEMP_PREFIX) -> str:
    """Write ``path`` through ``write(fh)`` into a temp file beside it, then move it into place.

    The file appears whole or not at all. An existing file is replaced only with
    ``overwrite``; without it, a file that appears meanwhile is not clobbered
    either (``link`` refuses). ``what`` prefixes error messages (e.g. "--output").
    The temp file is named ``<temp_prefix><random>.tmp`` (a process killed
    mid-write leaves it behind; capture puts its pid in the prefix to find its
    own later).
    """
    path = os.fspath(path)
    label = f"{what} {path}" if what else path
    if os.path.isdir(path):
        raise OptionError(f"{label} is a directory; give a file name")
    if os.path.exists(path) and not overwrite:
        raise OptionError(f"{label} already exists; pass --force to replace it")
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise OptionError(f"cannot write {label}: directory {directory} does not exist")
    try:
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix, suffix=TEMP_SUFFIX, dir=directory)
    except OSError as exc:
        raise OptionError(f"cannot write {label}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; the result is an ordinary user file
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise OptionError(f"{label} already exists; pass --force to replace it") from None
            except OSError:  # a file system without hard links
                if os.path.exists(path):
                    raise OptionError(f"{label} already exists; pass --force to replace it") from None
                os.replace(tmp, path)
    except OSError as exc:
        raise OptionError(f"cannot write {label}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def write_text_atomic(path: str | os.PathLike, text: str, *, overwrite: bool = False, what: str = "") -> str:
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")), overwrite=overwrite, what=what)
