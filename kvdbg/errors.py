"""Exceptions kvdbg raises for bad input, with messages ready to show a user."""

from __future__ import annotations


class KvdbgError(Exception):
    """Base class: bad input or an unusable request. The CLI prints it on one line, exit 2."""

    exit_code = 2


class SnapshotError(KvdbgError):
    """A snapshot file is unreadable, malformed or inconsistent; the message names the field."""


class OptionError(KvdbgError):
    """A command-line option or API argument is invalid."""


class BackendUnavailable(KvdbgError):
    """A backend was requested that cannot run here (the message says why)."""
