"""One FlashInfer dump directory read as untrusted input: its calls, their records, arguments and tensors.

The format is the one ``flashinfer/api_logging.py`` (0.7.x) writes at ``FLASHINFER_LOGLEVEL=10``: per call a
directory ``<timestamp>_pid<pid>_<function>_call<NNNN>`` holding ``metadata.jsonl`` (``_dump_function_inputs``
appends the first record before the call runs, ``_dump_function_outputs`` a completed one after it), the
inputs as ``inputs.pt`` (``torch.save`` of a dict of tensors) or ``inputs.safetensors``
(``FLASHINFER_DUMP_SAFETENSORS=1``), the outputs likewise; and beside the calls ``session.jsonl``, every record
of every call in the order they were written. A record's ``input_metadata`` holds the arguments that are not
tensors, keyed ``arg_<i>`` (positional, ``self`` first for a method) and ``kwarg_<name>``; tensors are in the
tensor file under the same keys, a tensor inside a tuple under ``<key>__<i>`` (``_extract_value_for_dump``).

Nothing here trusts the files: ``.pt`` files load only through ``torch.load(weights_only=True)``; every file
must be a regular file of bounded size; a record must be a JSON object with the fields used.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvdbg.errors import KvdbgError


class DumpError(KvdbgError):
    """A dump directory or one of its files is unreadable, malformed or unsafe; the message names it."""


MAX_METADATA_BYTES = 64 * 1024 * 1024  # one call's metadata.jsonl (a few KB in practice)
MAX_SESSION_BYTES = 512 * 1024 * 1024  # session.jsonl of a long session (two records a call)
MAX_CALLS = 100_000  # FLASHINFER_DUMP_MAX_COUNT defaults to 1000
MAX_ARGUMENT_DEPTH = 8  # _extract_value_for_dump nests no deeper


@dataclass
class DumpCall:
    """One dumped call: its directory and the last (most complete) record of its metadata.jsonl."""

    path: Path
    record: dict[str, Any]
    _tensors: dict[str, dict] = field(default_factory=dict, repr=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def function(self) -> str:
        return self.record["function_name"]

    @property
    def instance(self) -> tuple[Any, Any] | None:
        """(process_id, self_id) of a wrapper method's call: what ties a wrapper's __init__, plan and run."""
        self_id = self.record.get("self_id")
        return None if self_id is None else (self.record.get("process_id"), self_id)

    @property
    def completed(self) -> bool:
        return self.record.get("execution_status") == "completed"

    @property
    def flashinfer_version(self) -> str:
        versions = self.record.get("versions")
        return str(versions.get("flashinfer", "unknown")) if isinstance(versions, dict) else "unknown"

    def tensors(self, kind: str) -> dict:
        """The call's ``inputs`` or ``outputs`` tensors by key ({} when the file is absent)."""
        if kind not in self._tensors:
            self._tensors[kind] = load_tensor_file(self.path, kind)
        return self._tensors[kind]

    def drop_tensors(self) -> None:
        """Let the loaded tensors go (a session is read one call at a time)."""
        self._tensors.clear()

    def arguments(self, legacy_positional: tuple[str, ...] = (), *, tensors: bool = True) -> dict[str, Any]:
        """The call's arguments by parameter name (``self`` left out): tensors, tuples of them, plain values.

        Positional arguments are named from the record's ``function_signature``; those past a ``*args``
        parameter take the names ``legacy_positional`` gives (FlashInfer's deprecated positional forms).
        ``tensors=False`` reads the record alone (a constructor's workspace buffer is never loaded): tensor
        arguments are then left out.
        """
        names, varargs = signature_parameters(self.record.get("function_signature"), self.name)
        inputs = self.tensors("inputs") if tensors else None
        meta = self.record.get("input_metadata")
        if not isinstance(meta, dict):
            raise DumpError(f"{self.name}: metadata field input_metadata is not an object")
        raw: dict[str, Any] = {}
        for key in list(meta) + [k for k in (inputs or ()) if "__" not in k]:
            if key in raw:
                continue
            if inputs is not None and key in inputs:
                value = inputs[key]
            else:
                value = _rebuild(meta[key], inputs, f"{self.name}: {key}", 0)
            if key.startswith("arg_") and key[4:].isdigit():
                index = int(key[4:])
                if index < len(names):
                    raw[names[index]] = value
                elif varargs and index - len(names) < len(legacy_positional):
                    raw[legacy_positional[index - len(names)]] = value
                else:
                    raise DumpError(f"{self.name}: positional argument {key} has no parameter in the recorded "
                                    f"signature of {self.function}")
            elif key.startswith("kwarg_"):
                raw[key[len("kwarg_"):]] = value
        raw.pop("self", None)
        return raw


def _rebuild(value: Any, tensors: dict | None, where: str, depth: int) -> Any:
    """A recorded argument as a value: tensors by their key (None: tensors not loaded), tuples and lists of
    them, dtypes by name."""
    if depth > MAX_ARGUMENT_DEPTH:
        raise DumpError(f"{where}: arguments nested deeper than FlashInfer writes them")
    if not isinstance(value, dict):
        return value
    kind = value.get("type")
    if kind == "torch.Tensor":
        key = value.get("tensor_key")
        if tensors is None:
            return None
        if key is None or key not in tensors:
            raise DumpError(f"{where}: tensor {key!r} is recorded but not in the inputs file")
        return tensors[key]
    if kind in ("tuple", "list") and isinstance(value.get("items"), list):
        if value.get("truncated"):
            raise DumpError(f"{where}: the {kind} was recorded truncated")
        return tuple(_rebuild(item, tensors, where, depth + 1) for item in value["items"])
    if kind == "torch.dtype":
        return str(value.get("value", "")).removeprefix("torch.")
    return value  # an object recorded by its repr (the wrapper's self): kept as the record


def signature_parameters(signature: Any, where: str) -> tuple[list[str], bool]:
    """The positional parameter names of a recorded ``str(inspect.signature(f))`` and whether ``*args`` follows.

    ``"(self, q: torch.Tensor, x: Union[int, Tuple[int, int]] = (1, 2), *args, k=None) -> T"`` gives
    ``(["self", "q", "x"], True)``: commas inside brackets, parentheses or quotes do not split.
    """
    if not isinstance(signature, str) or not signature.startswith("("):
        raise DumpError(f"{where}: metadata field function_signature is missing or not a signature")
    params, depth, quote, current = [], 0, None, []
    for ch in signature[1:]:
        if quote:
            current.append(ch)
            if ch == quote:
                quote = None
            continue
        if ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                params.append("".join(current))
                break
            depth -= 1
        elif ch == "," and depth == 0:
            params.append("".join(current))
            current = []
            continue
        current.append(ch)
    else:
        raise DumpError(f"{where}: metadata field function_signature is not closed")
    names: list[str] = []
    for param in params:
        name = param.split(":", 1)[0].split("=", 1)[0].strip()
        if not name:
            continue
        if name.startswith("*") or name == "/":
            return names, name.startswith("*") and not name.startswith("**") and name != "*"
        names.append(name)
    return names, False


# ----------------------------------------------------------------------------- files


def regular_file_size(path: Path, limit: int | None = None, what: str = "dump's file of this kind",
                      error: type[KvdbgError] = DumpError) -> int:
    """The size of ``path``, which must be a regular file (a FIFO or device would hang or never end) of at most
    ``limit`` bytes; ``error`` (naming ``what``) otherwise. Shared by every importer's reader."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise error(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{path}: not a regular file")
    if limit is not None and st.st_size > limit:
        raise error(f"{path}: {st.st_size} bytes, more than the {limit} a {what} may have")
    return st.st_size



def read_last_record(path: Path) -> dict[str, Any]:
    """The last record of a call's metadata.jsonl: the completed one when the call finished."""
    regular_file_size(path, MAX_METADATA_BYTES)
    try:
        lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    except OSError as exc:
        raise DumpError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if not lines:
        raise DumpError(f"{path}: empty; FlashInfer writes a record before the call runs")
    try:
        record = json.loads(lines[-1])
    except (ValueError, RecursionError) as exc:
        raise DumpError(f"{path}: last record is not JSON ({str(exc)[:80]})") from None
    if not isinstance(record, dict):
        raise DumpError(f"{path}: last record is not a JSON object")
    if not isinstance(record.get("function_name"), str) or not record["function_name"]:
        raise DumpError(f"{path}: record field function_name is missing or not a string")
    for key in ("self_id", "process_id"):
        if key in record and record[key] is not None and (not isinstance(record[key], int)
                                                          or isinstance(record[key], bool)):
            raise DumpError(f"{path}: record field {key} is not an integer")
    return record


def load_tensor_file(call_dir: Path, kind: str) -> dict:
    """``<kind>.pt`` or ``<kind>.safetensors`` of a call as {key: tensor}; {} when neither exists.

    ``.pt`` loads with ``torch.load(weights_only=True)`` (memory-mapped when it is torch's zip format), so a
    pickle that would build anything but tensors and plain containers is refused before any of it runs.
    """
    import torch

    pt, st = call_dir / f"{kind}.pt", call_dir / f"{kind}.safetensors"
    if os.path.lexists(pt):
        regular_file_size(pt)
        try:
            mmap = zipfile.is_zipfile(pt)
            with warnings.catch_warnings():  # torch warns about a file's pickle protocol: the error says enough
                warnings.simplefilter("ignore")
                loaded = torch.load(pt, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as exc:  # weights_only's UnpicklingError, a truncated zip, a malformed pickle
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            if "weights_only" in str(exc) or "Unsupported global" in str(exc) or "GLOBAL" in str(exc):
                raise DumpError(f"{pt}: refused: the pickle asks for more than tensors, so it was not loaded "
                                f"(torch.load weights_only=True: {first})") from None
            raise DumpError(f"{pt}: unreadable ({type(exc).__name__}: {first})") from None
        path = pt
    elif os.path.lexists(st):
        regular_file_size(st)
        try:
            from safetensors import safe_open

            with safe_open(str(st), framework="pt", device="cpu") as fh:
                loaded = {key: fh.get_tensor(key) for key in fh.keys()}
        except Exception as exc:
            raise DumpError(f"{st}: safetensors cannot read it ({str(exc).splitlines()[0][:160]})") from None
        path = st
    else:
        return {}
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in loaded.items()):
        raise DumpError(f"{path}: not a dict of named tensors, as FlashInfer writes")
    for key, tensor in loaded.items():
        # A pickled tensor may declare any size over a small storage with zero strides: copying it would
        # ask for memory the file never held. FlashInfer saves real tensors (GPU ones through .cpu()).
        if tensor.numel() * tensor.element_size() > tensor.untyped_storage().nbytes():
            raise DumpError(f"{path}: tensor {key!r} of shape {list(tensor.shape)} claims more elements than its "
                            "data in the file holds")
    return loaded


# ----------------------------------------------------------------------------- a session


def _is_call_dir(path: Path) -> bool:
    try:
        return path.is_dir() and not path.is_symlink() and os.path.lexists(path / "metadata.jsonl")
    except OSError:
        return False


def session_order(root: Path, names: set[str]) -> list[str]:
    """Call directory names in the order FlashInfer made them: first appearance in ``session.jsonl``.

    A directory's name starts with a millisecond timestamp, which ties for calls made within one
    millisecond (a plan and its run, often); session.jsonl's lines are in call order. Only the last
    component of each record's ``dump_dir`` is used, to find a directory among ``names``: a recorded path is
    never opened. Directories the session file does not name follow, by name.
    """
    order: list[str] = []
    seen: set[str] = set()
    session = root / "session.jsonl"
    if os.path.lexists(session):
        regular_file_size(session, MAX_SESSION_BYTES)
        with open(session, "rb") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    continue  # a line cut by a crash: the directories themselves are the truth
                dump_dir = record.get("dump_dir") if isinstance(record, dict) else None
                if isinstance(dump_dir, str):
                    name = dump_dir.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
                    if name in names and name not in seen:
                        seen.add(name)
                        order.append(name)
    order.extend(sorted(names - seen))
    return order


def read_session(path: str | os.PathLike) -> tuple[list[DumpCall], str | None]:
    """The calls of the dump at ``path`` in call order, and the one call asked for (None: all of them).

    ``path`` is a session directory (``FLASHINFER_DUMP_DIR``) or one call's directory; for one call the
    session around it is read too, since a wrapper's ``run`` needs its ``__init__`` and ``plan``.
    """
    path = Path(path)
    if not path.exists():
        raise DumpError(f"{path}: no such directory")
    if not path.is_dir():
        raise DumpError(f"{path}: not a directory; give FlashInfer's dump directory (FLASHINFER_DUMP_DIR) "
                        "or one call's directory in it")
    only = None
    if os.path.lexists(path / "metadata.jsonl"):
        only, root = path.name, path.parent
    else:
        root = path
    names: set[str] = set()
    try:
        with os.scandir(root) as entries:
            for entry in entries:
                if _is_call_dir(Path(entry.path)):
                    names.add(entry.name)
                    if len(names) > MAX_CALLS:
                        raise DumpError(f"{root}: more than {MAX_CALLS} call directories")
    except OSError as exc:
        raise DumpError(f"{root}: cannot list: {exc.strerror or exc}") from None
    if not names:
        raise DumpError(f"{path}: no FlashInfer call directories (each holds a metadata.jsonl); is this "
                        "FLASHINFER_DUMP_DIR of a run with FLASHINFER_LOGLEVEL=10?")
    calls = [DumpCall(root / name, read_last_record(root / name / "metadata.jsonl"))
             for name in session_order(root, names)]
    return calls, only
