"""One flashinfer-bench dataset read as untrusted input: its definitions, its workload lines and their blobs.

The layout is flashinfer-bench's ``TraceSet`` (``flashinfer_bench/data/trace_set.py``): under the dataset root,
``definitions/**/*.json`` hold one Definition each (``name``, ``op_type``, ``axes``, ``inputs``, ``outputs``,
``reference``, ``tags``, ``description``), ``workloads/**/*.jsonl`` one Trace a line whose ``workload`` holds
``uuid``, ``axes`` (the values of the definition's ``var`` axes) and ``inputs`` (a name to ``{"type": "random"}``,
``{"type": "scalar", "value": v}`` or ``{"type": "safetensors", "path": p, "tensor_key": k}``, ``p`` relative to
the root, usually ``./blob/workloads/<op_type>/<definition>/<definition>_<uuid>.safetensors``), and
``traces/`` the benchmark results (evaluations, never tensors).

Nothing here trusts the files: every file read must be a regular file inside the root (a symbolic link that
leads out of it, a named pipe, an absolute or ``..`` blob path and a URI are refused), of bounded size; every
JSON value is checked for the type it is used as; a blob's header (shape, dtype) is read and compared with what
the definition and the workload's axes declare before its data is; a Git LFS pointer is named as one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from kvdbg.errors import KvdbgError
from kvdbg.importers.dumpdir import regular_file_size


class DatasetError(KvdbgError):
    """A dataset, one of its files or one workload is unreadable, inconsistent or unsafe; the message names it."""


MAX_DEFINITION_BYTES = 16 * 1024 * 1024  # one definition (a few KB: its reference code is the bulk)
MAX_DEFINITIONS = 100_000
MAX_JSONL_BYTES = 1024 * 1024 * 1024  # one workloads/*.jsonl (a line is a few hundred bytes)
MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_WORKLOADS = 1_000_000
MAX_WALK_DEPTH = 8  # definitions/<op_type>/... and workloads/<op_type>/... are two deep
MAX_NAME_CHARS = 256  # a definition's name, a workload's uuid, an input's name
# Axis values index int32 tensors in every kernel these definitions describe.
MAX_AXIS = 2**31 - 1
LFS_POINTER = b"version https://git-lfs.github.com/spec/v1"


def _regular_file(path: Path, limit: int | None, what: str) -> int:
    """The size of ``path``, a regular file of at most ``limit`` bytes (the dump reader's rule)."""
    return regular_file_size(path, limit, what, DatasetError)


def find_dataset(path: str | os.PathLike) -> tuple[Path, Path | None] | None:
    """``(root, jsonl)`` when ``path`` is a flashinfer-bench dataset (a directory holding ``definitions/``:
    ``jsonl`` None) or a ``.jsonl`` file inside one (the nearest directory above it holding ``definitions/``);
    None otherwise (a FlashInfer dump, or nothing at all)."""
    given = Path(path)
    try:
        if given.is_dir():
            return (given, None) if (given / "definitions").is_dir() else None
        if given.suffix == ".jsonl" and given.exists():
            for parent in given.resolve().parents:
                if (parent / "definitions").is_dir():
                    return parent, given.resolve()
    except OSError:
        return None
    return None


@dataclass
class Definition:
    """One definition file: its name, where it is (relative to the root), and its JSON object."""

    name: str
    where: str
    data: dict[str, Any]


@dataclass
class WorkloadLine:
    """One line of a workloads file: the definition it names and its workload, or why it cannot be read."""

    where: str  # "workloads/gqa_paged/x.jsonl:3"
    definition: str = ""
    uuid: str = ""
    axes: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    error: str = ""  # the line's problem ("" when it reads)


def _short(value: Any) -> str:
    return repr(value)[:60]


def _name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise DatasetError(f"{where} must be a non-empty string of at most {MAX_NAME_CHARS} characters, got "
                           f"{_short(value)}")
    return value


class Dataset:
    """A dataset root and what it holds, read as untrusted input (see the module doc)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self._real_root = os.path.realpath(self.root)
        self.definitions: dict[str, Definition] = {}
        self.duplicates: dict[str, list[str]] = {}  # a name more than one file gives: every file giving it
        self.unreadable: list[str] = []  # definition files that could not be read, each with why
        self._read_definitions()

    # ------------------------------------------------------------------ paths

    def relative(self, path: Path) -> str:
        try:
            return Path(os.path.relpath(path, self.root)).as_posix()
        except ValueError:
            return str(path)

    def inside(self, path: Path) -> bool:
        """Whether ``path``, its symbolic links followed, stays inside the root."""
        real = os.path.realpath(path)
        return os.path.commonpath([real, self._real_root]) == self._real_root

    def _files(self, top: str, suffix: str, limit: int) -> list[Path]:
        """Regular files named ``*suffix`` under ``root/top``, sorted; links and folders leading out are skipped."""
        base = self.root / top
        if not base.is_dir():
            return []
        found: list[Path] = []
        for folder, dirs, files in os.walk(base, followlinks=False):
            depth = len(Path(folder).relative_to(base).parts)
            if depth >= MAX_WALK_DEPTH:
                dirs[:] = []
            dirs.sort()
            for name in sorted(files):
                if name.endswith(suffix):
                    found.append(Path(folder) / name)
                    if len(found) > limit:
                        raise DatasetError(f"{base}: more than {limit} {suffix} files")
        return found

    def checked_file(self, path: Path, limit: int | None, what: str) -> int:
        if not self.inside(path):
            raise DatasetError(f"{path}: leads outside the dataset root {self.root} (a symbolic link); kvdbg reads "
                               "only files inside the dataset")
        return _regular_file(path, limit, what)

    # ------------------------------------------------------------------ definitions

    def _read_definitions(self) -> None:
        for path in self._files("definitions", ".json", MAX_DEFINITIONS):
            where = self.relative(path)
            try:
                self.checked_file(path, MAX_DEFINITION_BYTES, "definition")
                try:
                    data = json.loads(path.read_bytes())
                except (ValueError, RecursionError) as exc:
                    raise DatasetError(f"{where}: not JSON ({str(exc)[:80]})") from None
                if not isinstance(data, dict):
                    raise DatasetError(f"{where}: not a JSON object")
                name = _name(data.get("name"), f"{where}: field name")
            except (DatasetError, OSError) as exc:
                self.unreadable.append(str(exc))
                continue
            if name in self.definitions or name in self.duplicates:
                first = self.definitions.pop(name, None)
                self.duplicates.setdefault(name, [first.where] if first else []).append(where)
                continue
            self.definitions[name] = Definition(name, where, data)

    def definition(self, name: str) -> Definition:
        """The definition named ``name``, or the reason there is not exactly one readable."""
        if name in self.duplicates:
            files = ", ".join(self.duplicates[name])
            raise DatasetError(f"definition {name!r} is given by more than one file ({files}); which one the workload "
                               "means is not guessed")
        found = self.definitions.get(name)
        if found is None:
            extra = (f" ({len(self.unreadable)} definition file(s) unreadable, first: {self.unreadable[0]})"
                     if self.unreadable else "")
            raise DatasetError(f"no definition named {name!r} under definitions/{extra}")
        return found

    # ------------------------------------------------------------------ workloads

    def workload_files(self, only: Path | None = None) -> list[Path]:
        if only is not None:
            return [only]
        files = self._files("workloads", ".jsonl", MAX_WORKLOADS)
        if not files:
            raise DatasetError(f"{self.root}: no workloads/**/*.jsonl files (a flashinfer-bench dataset keeps its "
                               "workloads there)")
        return files

    def workloads(self, only: Path | None = None) -> Iterator[WorkloadLine]:
        """Every workload line of the dataset (or of the one file ``only``), in file and line order."""
        count = 0
        for path in self.workload_files(only):
            rel = self.relative(path)
            self.checked_file(path, MAX_JSONL_BYTES, "workloads file")
            with open(path, "rb") as fh:
                number = 0
                while raw := fh.readline(MAX_LINE_BYTES + 1):  # a line is never read whole past the bound
                    number += 1
                    if len(raw) > MAX_LINE_BYTES:
                        while (rest := fh.readline(MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                            pass
                        yield WorkloadLine(f"{rel}:{number}", error=f"{rel}:{number}: a line longer than "
                                                                    f"{MAX_LINE_BYTES} bytes")
                        continue
                    if not raw.strip():
                        continue
                    count += 1
                    if count > MAX_WORKLOADS:
                        raise DatasetError(f"{rel}: more than {MAX_WORKLOADS} workloads")
                    yield _workload_line(raw, f"{rel}:{number}")

    # ------------------------------------------------------------------ blobs

    def blob_path(self, raw: Any, where: str) -> Path:
        """The file a ``safetensors`` input's ``path`` names, inside the root (checked before it is opened)."""
        if not isinstance(raw, str) or not raw or len(raw) > 4096 or "\x00" in raw:
            raise DatasetError(f"{where}.path must be a non-empty string, got {_short(raw)}")
        if "://" in raw or raw.startswith(("/", "\\", "~")) or (len(raw) > 1 and raw[1] == ":"):
            raise DatasetError(f"{where}.path {raw!r} is not relative to the dataset root: kvdbg reads blobs only "
                               "inside the dataset (an untrusted workload could otherwise put any file of this "
                               "machine into a snapshot); copy the file into the dataset and name it relatively")
        path = self.root / raw
        if not self.inside(path):
            raise DatasetError(f"{where}.path {raw!r} leads outside the dataset root {self.root}; kvdbg reads blobs "
                               "only inside the dataset")
        self.checked_file(path, None, "blob")
        with open(path, "rb") as fh:
            head = fh.read(len(LFS_POINTER))
        if head == LFS_POINTER:
            raise DatasetError(f"{where}.path {raw!r} is a Git LFS pointer, not the tensors: fetch it first "
                               f"(git lfs pull --include {raw.removeprefix('./')!r} in the dataset)")
        return path


def _workload_line(raw: bytes, where: str) -> WorkloadLine:
    line = WorkloadLine(where)
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        line.error = f"{where}: not JSON ({str(exc)[:80]})"
        return line
    try:
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: not a JSON object")
        line.definition = _name(record.get("definition"), f"{where}: field definition")
        workload = record.get("workload")
        if not isinstance(workload, dict):
            raise DatasetError(f"{where}: field workload is missing or not an object")
        line.uuid = _name(workload.get("uuid"), f"{where}: field workload.uuid")
        for key in ("axes", "inputs"):
            if not isinstance(workload.get(key), dict):
                raise DatasetError(f"{where}: field workload.{key} is missing or not an object")
        line.axes, line.inputs = workload["axes"], workload["inputs"]
    except DatasetError as exc:
        line.error = str(exc)
    return line


def read_tensor(path: Path, key: Any, shape: list[int], dtype: str, where: str, handles: dict):
    """Tensor ``key`` of the safetensors file ``path``: its header's shape and dtype must be ``shape`` and
    ``dtype`` (checked before any data is read). ``handles`` keeps each file open once per workload."""
    from kvdbg.snapshot.store import dtype_name

    if not isinstance(key, str) or not key:
        raise DatasetError(f"{where}.tensor_key must be a non-empty string, got {_short(key)}")
    try:
        from safetensors import safe_open

        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt", device="cpu")
        fh = handles[path]
        if key not in fh.keys():
            raise DatasetError(f"{where}: tensor_key {key!r} is not in {path.name} (it holds "
                               f"{', '.join(sorted(fh.keys())[:8]) or 'nothing'})")
        found = list(fh.get_slice(key).get_shape())
        if found != shape:
            raise DatasetError(f"{where}: {path.name}[{key!r}] has shape {found}, but the definition's shape with "
                               f"the workload's axes is {shape}")
        tensor = fh.get_tensor(key)
    except DatasetError:
        raise
    except Exception as exc:  # safetensors' own refusal of a malformed header or a truncated file
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise DatasetError(f"{where}: {path.name} is not a readable safetensors file ({first})") from None
    if dtype_name(tensor.dtype) != dtype:
        raise DatasetError(f"{where}: {path.name}[{key!r}] is {dtype_name(tensor.dtype)}, but the definition "
                           f"declares {dtype}")
    return tensor
