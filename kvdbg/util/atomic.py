"""Atomic, no-clobber file writes: every file kvdbg writes goes through here."""

from __future__ import annotations

import contextlib
import fnmatch
import os
from typing import BinaryIO, Callable, Iterable, Iterator

from kvdbg.errors import OptionError


TEMP_PREFIX = ".kvdbg-"
TEMP_SUFFIX = ".tmp"
# What a directory given as an input is read for (kvdbg.replayer.batch's pattern; kept here so that no writer imports it).
SNAPSHOT_PATTERN = "*.safetensors"

# The running command's inputs, which no write replaces, --force or not: files by (device, inode), and
# directories, whose snapshots (at any depth) are inputs too.
_input_files: set[tuple[int, int]] = set()
_input_dirs: list[str] = []


@contextlib.contextmanager
def inputs_protected(paths: Iterable[str | os.PathLike]) -> Iterator[None]:
    """While the block runs, :func:`atomic_write` refuses to replace any of ``paths`` (the command's inputs)
    or a snapshot inside one that is a directory, even with ``overwrite``. Paths that do not exist are skipped."""
    added_files, added_dirs = [], []
    for path in paths:
        try:
            st = os.stat(path)
        except (OSError, ValueError, TypeError):
            continue
        if os.path.isdir(path):
            added_dirs.append(os.path.realpath(path))
        else:
            added_files.append((st.st_dev, st.st_ino))
    _input_files.update(added_files)
    _input_dirs.extend(added_dirs)
    try:
        yield
    finally:
        _input_files.difference_update(added_files)
        for directory in added_dirs:
            _input_dirs.remove(directory)


def _is_input(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    if (st.st_dev, st.st_ino) in _input_files:
        return True
    if _input_dirs and fnmatch.fnmatch(os.path.basename(path), SNAPSHOT_PATTERN):
        real = os.path.realpath(path)
        return any(os.path.commonpath([real, d]) == d for d in _input_dirs)
    return False


def check_output(path: str | os.PathLike, *, overwrite: bool, what: str = "", exists: str = "") -> None:
    """Refuse what :func:`atomic_write` would refuse to replace: an input of the running command, always;
    without ``overwrite``, a file that exists (``exists``: the message's remedy, "pass --force" by default).
    Commands call it before their work too, so that a refusal costs none."""
    path = os.fspath(path)
    label = f"{what} {path}" if what else path
    if (_input_files or _input_dirs) and _is_input(path):
        raise OptionError(f"{label} is an input of this command, which it never replaces (--force or not): "
                          "write elsewhere")
    if not overwrite and os.path.exists(path):
        raise OptionError(f"{label} already exists; {exists or 'pass --force to replace it'}")


def check_distinct_outputs(outputs: Iterable[tuple[str, str | os.PathLike | None]]) -> None:
    """Refuse two of a command's outputs (``(option, path)``; None: not asked for) that name one file: the
    second would replace the first (with --force), or be refused after the first was written (without)."""
    seen: dict[str, str] = {}
    for option, path in outputs:
        if path is None:
            continue
        key = os.path.normcase(os.path.realpath(os.fspath(path)))
        if key in seen:
            raise OptionError(f"{option} {os.fspath(path)} is the file {seen[key]} writes too; give each output "
                              "its own name")
        seen[key] = option


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
    check_output(path, overwrite=overwrite, what=what)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise OptionError(f"cannot write {label}: directory {directory} does not exist")
    import tempfile  # only a write needs it: every command's input guard imports this module

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
