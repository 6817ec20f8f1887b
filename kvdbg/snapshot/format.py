"""Snapshot format v1, the file: the safetensors header read and bounded, the structure checked against the
metadata (``kvdbg.snapshot.meta``), headers written, small index tensors read; without torch.

Everything here reads only the safetensors header (and, on request, a few small
integer tensors) with the standard library, so that ``kvdbg info`` stays instant
on multi-GB files. docs/snapshot-format.md is the specification this implements.
The metadata's names are re-exported here: ``from kvdbg.snapshot.format import SnapshotMeta`` keeps working.
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Mapping

from kvdbg.errors import SnapshotError
from kvdbg.snapshot.meta import (
    ATTN_TYPES, BackendMeta, CROSS_ATTN_TYPE, DTYPE_TO_ST, ENCODER_SELF_ATTN_TYPES, FORMAT_KEY, FORMAT_VERSION,
    FORMAT_VERSIONS_READ, FORMAT_VERSION_MASKS, FP8_STORAGE_DTYPES, GLOBAL_TENSORS, INDEX_DTYPES, KV_CACHE_DTYPES,
    LAYER_FIELDS_WRITTEN_WHEN_SET, LAYER_VALUE_TENSORS, LAYOUTS, LAYOUT_KV_PLANES, LAYOUT_VLLM, LayerMeta,
    MASK_FIELDS, MAX_HEADER_BYTES, MAX_HEADS, MAX_HEAD_SIZE, MAX_META_BYTES, META_KEY, MODEL_DTYPES, OUTPUTS_KEY,
    STEP_TENSORS, STEP_TENSORS_REQUIRED, STEP_TENSORS_UPDATE, ST_DTYPES, SnapshotMeta, canonical_backend_name,
    format_version, parse_meta, step_prefix
)


# --------------------------------------------------------------------------- header


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the safetensors header declares it."""

    name: str
    dtype: str  # kvdbg/torch name, e.g. "bfloat16"
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """The parsed header of a snapshot file: metadata, tensor directory and sizes."""

    path: str
    file_size: int
    data_start: int  # absolute offset of the data section
    metadata: dict[str, str]
    tensors: dict[str, TensorEntry]
    meta: SnapshotMeta

    def step_tensor(self, step: int, name: str) -> TensorEntry | None:
        return self.tensors.get(self.meta.step_prefix(step) + name)


def _open_regular(path: str):
    """Open ``path`` for reading in binary mode, refusing anything but a regular file before reading a byte.

    Every snapshot reader comes through here. A named pipe would block ``open()`` until a writer appears (and
    a character device never ends), so the path is stat'ed first and opened non-blocking; the open file is
    stat'ed again, so a path swapped for a pipe in between is refused too.
    """
    mode = os.stat(path).st_mode
    if stat.S_ISDIR(mode):
        raise IsADirectoryError(path)
    if not stat.S_ISREG(mode):
        raise SnapshotError(f"{path}: not a regular file ({_file_type(mode)}); a snapshot is a .safetensors file")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise SnapshotError(f"{path}: not a regular file ({_file_type(mode)}); a snapshot is a .safetensors file")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory")):
        if test(mode):
            return name
    return "not a plain file"


def read_raw_header(path: str | os.PathLike) -> tuple[int, int, dict[str, str], dict[str, TensorEntry]]:
    """Read and check a safetensors header. Returns (file_size, data_start, metadata, tensors)."""
    path = os.fspath(path)
    try:
        with _open_regular(path) as fh:
            file_size = os.fstat(fh.fileno()).st_size
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise SnapshotError(
                    f"{path}: not a safetensors file ({file_size} bytes, shorter than the 8-byte header length)"
                )
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES:
                raise SnapshotError(
                    f"{path}: not a safetensors file (header length {header_len} is over the "
                    f"{MAX_HEADER_BYTES}-byte limit)"
                )
            if header_len > file_size - 8:
                raise SnapshotError(
                    f"{path}: truncated file or not a safetensors file (header declares {header_len} bytes, "
                    f"only {file_size - 8} follow)"
                )
            raw = fh.read(header_len)
    except IsADirectoryError:
        raise SnapshotError(f"{path}: is a directory, not a snapshot file") from None
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except PermissionError:
        raise SnapshotError(f"{path}: permission denied") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read ({exc.strerror or exc})") from None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise SnapshotError(f"{path}: not a safetensors file (header JSON nested too deeply)") from None
    except (UnicodeDecodeError, ValueError):
        raise SnapshotError(f"{path}: not a safetensors file (header is not JSON)") from None
    if not isinstance(obj, dict):
        raise SnapshotError(f"{path}: not a safetensors file (header is not a JSON object)")
    data_start = 8 + header_len
    data_size = file_size - data_start
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise SnapshotError(f"{path}: __metadata__ must map strings to strings")
    tensors: dict[str, TensorEntry] = {}
    for name, info in obj.items():
        label = f"tensor {name[:60]!r}"
        if not isinstance(info, dict):
            raise SnapshotError(f"{path}: {label} header entry is not an object")
        tag, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if tag not in ST_DTYPES:
            raise SnapshotError(f"{path}: {label} has unknown dtype {str(tag)[:20]!r}")
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 2**48 for d in shape)
        ):
            raise SnapshotError(f"{path}: {label} has a malformed shape {str(shape)[:60]}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise SnapshotError(f"{path}: {label} has malformed data_offsets {str(offsets)[:60]}")
        begin, end = offsets
        itemsize, dtype = ST_DTYPES[tag]
        expected = math.prod(shape) * itemsize
        if begin < 0 or end < begin or end - begin != expected:
            raise SnapshotError(
                f"{path}: {label} data_offsets [{begin}, {end}] do not hold its shape "
                f"{list(shape)} of {tag} ({expected} bytes)"
            )
        if end > data_size:
            raise SnapshotError(
                f"{path}: truncated file: {label} ends at data byte {end} but only {data_size} data bytes exist"
            )
        tensors[name] = TensorEntry(name, dtype, tuple(shape), begin, end)
    spans = sorted((t.begin, t.end, t.name) for t in tensors.values() if t.end > t.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise SnapshotError(f"{path}: tensors {n0[:40]!r} and {n1[:40]!r} overlap in the data section")
    return file_size, data_start, metadata, tensors


def read_header(path: str | os.PathLike) -> Header:
    """Read a snapshot's header, metadata and tensor directory, and check their structure."""
    path = os.fspath(path)
    file_size, data_start, metadata, tensors = read_raw_header(path)
    if FORMAT_KEY not in metadata:
        raise SnapshotError(
            f"{path}: missing __metadata__[{FORMAT_KEY!r}]: a safetensors file, but not a kvdbg snapshot"
        )
    version = metadata[FORMAT_KEY]
    if version not in FORMAT_VERSIONS_READ:
        raise SnapshotError(
            f"{path}: unknown {FORMAT_KEY} {version[:20]!r}; this kvdbg reads format "
            f"{' and '.join(FORMAT_VERSIONS_READ)} (upgrade kvdbg to read newer snapshots)"
        )
    if META_KEY not in metadata:
        raise SnapshotError(f"{path}: missing __metadata__[{META_KEY!r}]")
    try:
        meta = parse_meta(metadata[META_KEY])
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    header = Header(path, file_size, data_start, metadata, tensors, meta)
    try:
        check_structure(header)
    except SnapshotError as exc:
        raise SnapshotError(f"{path}: {exc}") from None
    return header


# The public header-only reader (no torch): kvdbg.open_snapshot.
open_snapshot = read_header


# --------------------------------------------------------------------------- structure


def kv_cache_shape(meta: SnapshotMeta, num_pages: int) -> tuple[int, ...]:
    """The shape ``kv_cache`` must have in the snapshot's layout for ``num_pages`` stored pages."""
    layer, ps = meta.layer, meta.backend.page_size
    if meta.kv_layout == LAYOUT_VLLM:
        return (num_pages, layer.num_kv_heads, ps, 2 * layer.head_size)
    return (2, num_pages, ps, layer.num_kv_heads, layer.head_size)


def kv_storage_dtypes(layer: LayerMeta) -> tuple[str, ...]:
    return FP8_STORAGE_DTYPES if layer.is_fp8 else (layer.dtype,)


def _need(tensors: Mapping[str, TensorEntry], name: str) -> TensorEntry:
    entry = tensors.get(name)
    if entry is None:
        raise SnapshotError(f"missing required tensor {name!r}")
    return entry


def _check_dtype(entry: TensorEntry, allowed: tuple[str, ...], why: str = "") -> None:
    if entry.dtype not in allowed:
        raise SnapshotError(
            f"tensor {entry.name!r} has dtype {entry.dtype}, expected {' or '.join(allowed)}{why}"
        )


def _check_shape(entry: TensorEntry, expected: tuple[int | None, ...], what: str) -> None:
    if len(entry.shape) != len(expected):
        raise SnapshotError(
            f"tensor {entry.name!r} has rank {len(entry.shape)} (shape {list(entry.shape)}), expected {what}"
        )
    for got, want in zip(entry.shape, expected):
        if want is not None and got != want:
            raise SnapshotError(f"tensor {entry.name!r} has shape {list(entry.shape)}, expected {what}")


def check_structure(header: Header) -> None:
    """Check names, ranks, shapes and dtypes of every tensor against the metadata."""
    meta, tensors = header.meta, header.tensors
    layer = meta.layer
    page_ids = _need(tensors, "page_ids")
    _check_dtype(page_ids, INDEX_DTYPES)
    _check_shape(page_ids, (None,), "[num_stored_pages]")
    num_pages = page_ids.shape[0]
    if num_pages > meta.backend.num_gpu_blocks:
        raise SnapshotError(
            f"tensor 'page_ids' holds {num_pages} pages, more than backend.num_gpu_blocks "
            f"({meta.backend.num_gpu_blocks})"
        )
    kv = _need(tensors, "kv_cache")
    want = kv_cache_shape(meta, num_pages)
    _check_shape(kv, want, f"{list(want)} for layout {meta.kv_layout!r} and {num_pages} stored pages")
    _check_dtype(
        kv,
        kv_storage_dtypes(layer),
        " (an FP8 cache is stored as uint8 or float8_e4m3fn)" if layer.is_fp8
        else f" (kv_cache_dtype 'auto' stores the model dtype {layer.dtype})",
    )
    known = set(GLOBAL_TENSORS)
    hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_size
    for name, flag in LAYER_VALUE_TENSORS.items():
        entry = tensors.get(name)
        if entry is None:
            continue
        if not getattr(layer, flag):
            raise SnapshotError(f"tensor {name!r} is present but meta field layer.{flag} is false")
        _check_dtype(entry, ("float32",))
        _check_shape(entry, (hq,), f"[{hq}] (one value per query head, layer.num_heads)")
    if layer.kv_sharing_target is not None:
        for step in range(meta.num_steps):
            name = meta.step_prefix(step) + "slot_mapping"
            if name in tensors:
                raise SnapshotError(
                    f"tensor {name!r} writes new K/V, but layer.kv_sharing_target is set: a layer that reads "
                    f"another layer's cache ({layer.kv_sharing_target!r}) writes none")
    q_dtypes = (layer.dtype,) + (FP8_STORAGE_DTYPES if layer.is_fp8 else ())
    for step in range(meta.num_steps):
        prefix = meta.step_prefix(step)
        known.update(prefix + n for n in STEP_TENSORS)
        bt = _need(tensors, prefix + "block_table")
        _check_dtype(bt, INDEX_DTYPES)
        _check_shape(bt, (None, None), "[num_reqs, max_pages_per_req]")
        num_reqs = bt.shape[0]
        sl = _need(tensors, prefix + "seq_lens")
        _check_dtype(sl, INDEX_DTYPES)
        _check_shape(sl, (num_reqs,), f"[{num_reqs}] (one length per block-table row)")
        qsl = _need(tensors, prefix + "query_start_loc")
        _check_dtype(qsl, INDEX_DTYPES)
        _check_shape(qsl, (num_reqs + 1,), f"[{num_reqs + 1}] (num_reqs + 1 offsets)")
        q = _need(tensors, prefix + "query")
        _check_dtype(q, q_dtypes)
        _check_shape(q, (None, hq, d), f"[num_tokens, {hq}, {d}] (num_heads, head_size)")
        num_tokens = q.shape[0]
        update = [prefix + n for n in STEP_TENSORS_UPDATE]
        present = [n for n in update if n in tensors]
        if present and len(present) != len(update):
            missing = sorted(set(update) - set(present))
            raise SnapshotError(
                f"missing required tensor {missing[0]!r}: key, value and slot_mapping come together"
            )
        if present:
            for n in ("key", "value"):
                e = tensors[prefix + n]
                _check_dtype(e, (layer.dtype,))
                _check_shape(e, (num_tokens, hkv, d), f"[{num_tokens}, {hkv}, {d}] (num_tokens, num_kv_heads, head_size)")
            sm = tensors[prefix + "slot_mapping"]
            _check_dtype(sm, INDEX_DTYPES)
            _check_shape(sm, (num_tokens,), f"[{num_tokens}] (one slot per query token)")
        out = tensors.get(prefix + "output")
        if out is not None:
            _check_dtype(out, (layer.dtype,))
            _check_shape(out, (num_tokens, hq, d), f"[{num_tokens}, {hq}, {d}] (like query)")
    unknown = sorted(set(tensors) - known)
    if unknown:
        hint = " (a multi-step file names tensors step.N.*)" if unknown[0].startswith("step.") or meta.num_steps > 1 else ""
        raise SnapshotError(f"unexpected tensor {unknown[0][:60]!r}{hint}")


# --------------------------------------------------------------------------- writing


def write_safetensors(fh, tensors: list[tuple[str, str, tuple[int, ...], Any]], metadata: dict[str, str]) -> None:
    """Write a safetensors file to the open binary file ``fh``, deterministically.

    ``tensors`` holds (name, dtype name, shape, buffer of raw little-endian bytes).
    The safetensors library orders ``__metadata__`` keys differently from run to
    run; sorting everything here is what makes fixtures reproducible byte for byte.
    """
    ordered = sorted(tensors, key=lambda t: t[0])
    raw = safetensors_header([(name, dtype, shape, memoryview(buf).nbytes) for name, dtype, shape, buf in ordered],
                             metadata)
    fh.write(struct.pack("<Q", len(raw)))
    fh.write(raw)
    for _, _, _, buf in ordered:
        fh.write(memoryview(buf).cast("B"))


def safetensors_header(tensors: list[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """The JSON header :func:`write_safetensors` writes, padded; ``tensors`` holds (name, dtype, shape, bytes).

    A file is 8 bytes (the header's length), this header and the tensors' bytes.
    """
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for name, dtype, shape, nbytes in sorted(tensors, key=lambda t: t[0]):
        header[name] = {"dtype": DTYPE_TO_ST[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    return raw + b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned, as safetensors does


# --------------------------------------------------------------------------- small reads


_ARRAY_CODES = {"int32": "i", "int64": "q", "float32": "f"}


def read_small_tensor(header: Header, name: str) -> list:
    """Read a small int32/int64/float32 tensor with the standard library (no torch), flattened."""
    entry = header.tensors[name]
    code = _ARRAY_CODES.get(entry.dtype)
    if code is None:
        raise SnapshotError(f"tensor {name!r}: {entry.dtype} is read with torch, not here")
    values = array(code)
    if values.itemsize * entry.numel != entry.nbytes:  # platform without 4/8-byte codes
        raise SnapshotError(f"tensor {name!r}: cannot read {entry.dtype} on this platform")
    with open(header.path, "rb") as fh:
        fh.seek(header.data_start + entry.begin)
        values.frombytes(fh.read(entry.nbytes))
    if sys.byteorder != "little":
        values.byteswap()
    return values.tolist()


def read_index_tensor(header: Header, name: str) -> list[int]:
    """Read a small int32/int64 tensor with the standard library (no torch), flattened."""
    if header.tensors[name].dtype not in INDEX_DTYPES:
        raise SnapshotError(f"tensor {name!r}: {header.tensors[name].dtype} is not an index dtype")
    return read_small_tensor(header, name)


# The file's names and the metadata's (kvdbg.snapshot.meta), re-exported.
__all__ = ["ATTN_TYPES", "BackendMeta", "CROSS_ATTN_TYPE", "DTYPE_TO_ST", "ENCODER_SELF_ATTN_TYPES",
           "FORMAT_KEY", "FORMAT_VERSION", "FORMAT_VERSIONS_READ", "FORMAT_VERSION_MASKS",
           "FP8_STORAGE_DTYPES", "GLOBAL_TENSORS", "Header", "INDEX_DTYPES", "KV_CACHE_DTYPES",
           "LAYER_FIELDS_WRITTEN_WHEN_SET", "LAYER_VALUE_TENSORS", "LAYOUTS", "LAYOUT_KV_PLANES",
           "LAYOUT_VLLM", "LayerMeta", "MASK_FIELDS", "MAX_HEADER_BYTES", "MAX_HEADS", "MAX_HEAD_SIZE",
           "MAX_META_BYTES", "META_KEY", "MODEL_DTYPES", "OUTPUTS_KEY", "STEP_TENSORS",
           "STEP_TENSORS_REQUIRED", "STEP_TENSORS_UPDATE", "ST_DTYPES", "SnapshotMeta", "TensorEntry",
           "canonical_backend_name", "check_structure", "format_version", "kv_cache_shape",
           "kv_storage_dtypes", "open_snapshot", "parse_meta", "read_header", "read_index_tensor",
           "read_raw_header", "read_small_tensor", "safetensors_header", "step_prefix", "write_safetensors"]
