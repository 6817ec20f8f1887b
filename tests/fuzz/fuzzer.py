"""Mutation fuzzer: hostile snapshots through `info`, `info --check`, `map`, `replay` and `window`.

Usage::

    python -m tests.fuzz.fuzzer --count 10000 --seed 1 --out /tmp/kvdbg-fuzz --jobs 2

Every input starts from a bundled fixture or a small synthetic snapshot and gets
one to three mutations (bytes, truncation, header JSON, metadata, tensor values).
Each outcome must be exit 0, exit 1, or exit 2 with one ``Error: `` line on stderr.

How the limits are enforced. This process imports torch and the CLI once and
then acts as a fork server: each input runs in a freshly forked child that
inherits the warm interpreter and runs every command in-process through
click's ``CliRunner`` (output captured, exceptions recorded). The child reports
each finished command over a pipe, so

- a hang is a command that reports nothing for ``--timeout`` seconds (30): the
  child is SIGKILLed; the fork server itself is never touched, so nothing needs
  restarting;
- memory is the child's peak RSS (``os.wait4`` rusage ``ru_maxrss``, the
  kernel's own high-water mark) minus its RSS when it started; above
  ``2 x file size + 300 MB`` is a failure. The child also runs under
  ``RLIMIT_AS`` (its start-up address space + 2 x file size + 1.3 GB) so that a
  runaway allocation fails quickly instead of taking the machine down; a
  MemoryError that surfaces as kvdbg's "out of memory" line counts as a
  memory failure too.

Every failure is saved as ``fail-<index>.safetensors`` in the out dir with one
JSON line in ``failures.jsonl`` (index, mutations, command, kind, exit code,
last lines of output); ``summary.json`` holds the counts per outcome.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import select
import signal
import struct
import sys
import tempfile
import time

HOSTILE_INTS = [-(2**63), -(2**31), -2, -1, 0, 1, 2, 3, 7, 8, 15, 16, 17, 64, 4096, 2**31 - 1, 2**31,
                2**40, 2**48, 2**53 + 1, 2**63 - 1, 2**64]
HOSTILE_VALUES = HOSTILE_INTS + [None, True, False, 0.5, -0.0, 1e308, float("nan"), float("inf"), "x", "",
                                 "16", [], [1], {}, {"a": 1}, "y" * 5000]
DTYPE_TAGS = ["F16", "BF16", "F32", "F64", "U8", "I8", "I16", "I32", "I64", "F8_E4M3", "F8_E5M2", "BOOL",
              "F4", "bfloat16", "", None, 3]
ITEMSIZE = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
            "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}
META_FIELDS = [
    ("layer", "name"), ("layer", "num_heads"), ("layer", "num_kv_heads"), ("layer", "head_size"),
    ("layer", "scale"), ("layer", "causal"), ("layer", "sliding_window"), ("layer", "dtype"),
    ("layer", "kv_cache_dtype"), ("layer", "q_scale"), ("layer", "k_scale"), ("layer", "v_scale"),
    ("layer", "logits_soft_cap"), ("layer", "has_sinks"), ("layer", "has_alibi"),
    ("layer", "kv_sharing_target"), ("layer", "attn_type"),
    ("backend", "name"), ("backend", "page_size"), ("backend", "max_model_len"), ("backend", "num_gpu_blocks"),
    ("backend", "max_decode_query_len"), ("backend", "max_num_seqs"), ("backend", "max_num_batched_tokens"),
    ("kv_layout",), ("num_steps",), ("capture",), ("notes",), ("layer",), ("backend",),
]
META_STRINGS = {
    "dtype": ["float16", "bfloat16", "float32", "float64", "int8"],
    "kv_cache_dtype": ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
    "kv_layout": ["pages,heads,tokens,2*dim", "2,pages,tokens,heads,dim", "pages,tokens,heads,dim"],
    "attn_type": ["decoder", "encoder"],
}
INDEX_TENSORS = ("page_ids", "block_table", "seq_lens", "query_start_loc", "slot_mapping")
FLOAT_TENSORS = ("kv_cache", "query", "key", "value", "output")


# --------------------------------------------------------------------------- file surgery


class Parsed:
    """A safetensors file split into its header object and data section, to mutate and re-serialise."""

    def __init__(self, blob: bytes):
        (n,) = struct.unpack("<Q", blob[:8])
        self.header = json.loads(blob[8:8 + n])
        self.data = bytearray(blob[8 + n:])

    @property
    def meta(self) -> dict:
        return json.loads(self.header["__metadata__"]["kvdbg.meta"])

    @meta.setter
    def meta(self, value) -> None:
        self.header["__metadata__"]["kvdbg.meta"] = json.dumps(value)

    def tensor_names(self, kinds=None) -> list[str]:
        names = [n for n in self.header if n != "__metadata__"]
        if kinds is not None:
            names = [n for n in names if n.rsplit(".", 1)[-1] in kinds]
        return sorted(names)

    def to_bytes(self) -> bytes:
        raw = json.dumps(self.header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + bytes(self.data)

    def view(self, name: str):
        """A writable torch view of one tensor's bytes in the data section."""
        import torch

        info = self.header[name]
        tag = info["dtype"]
        dtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                 "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                 "I64": torch.int64, "F8_E4M3": torch.uint8, "F8_E5M2": torch.uint8, "BOOL": torch.uint8}[tag]
        begin, end = info["data_offsets"]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        count = (end - begin) // itemsize
        if count <= 0:
            return None
        return torch.frombuffer(self.data, dtype=dtype, count=count, offset=begin).view(-1)


# --------------------------------------------------------------------------- mutators
# Each takes (rng, blob) and returns (new blob, one-line description).


def m_random_bytes(rng, blob):
    out = bytearray(blob)
    k = rng.choice([1, 2, 8, 64])
    for _ in range(k):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out), f"random_bytes x{k}"


def m_header_bytes(rng, blob):
    (n,) = struct.unpack("<Q", blob[:8])
    out = bytearray(blob)
    for _ in range(rng.choice([1, 3])):
        out[8 + rng.randrange(max(1, n))] = rng.choice(b'{}[]",:0123456789-eE.ntfx \\')
    return bytes(out), "header_bytes"


def m_truncate(rng, blob):
    cut = rng.choice([0, 3, 8, 9, rng.randrange(len(blob)), len(blob) - 1, len(blob) - rng.randrange(1, 4096)])
    cut = max(0, min(len(blob), cut))
    return blob[:cut], f"truncate at {cut}"


def m_header_len(rng, blob):
    (n,) = struct.unpack("<Q", blob[:8])
    value = rng.choice([0, 1, 2, n - 1, n + 1, n + 8, len(blob), 100 * 1024 * 1024 + 1, 2**63, 2**64 - 1])
    return struct.pack("<Q", value % 2**64) + blob[8:], f"header_len {value}"


def m_append(rng, blob):
    return blob + rng.randbytes(rng.choice([1, 7, 4096])), "append junk"


def m_tensor_dtype(rng, blob):
    p = Parsed(blob)
    name = rng.choice(p.tensor_names())
    tag = rng.choice(DTYPE_TAGS)
    p.header[name]["dtype"] = tag
    if tag in ITEMSIZE and rng.random() < 0.6:  # keep offsets consistent so deeper checks see it
        info = p.header[name]
        nbytes = math.prod(info["shape"]) * ITEMSIZE[tag]
        if nbytes <= info["data_offsets"][1] - info["data_offsets"][0]:
            info["data_offsets"][1] = info["data_offsets"][0] + nbytes
    return p.to_bytes(), f"dtype {name} -> {tag}"


def m_tensor_shape(rng, blob):
    p = Parsed(blob)
    name = rng.choice(p.tensor_names())
    info = p.header[name]
    shape = list(info["shape"])
    how = rng.randrange(7)
    if how == 0 and shape:
        shape.pop(rng.randrange(len(shape)))
    elif how == 1:
        shape.insert(rng.randrange(len(shape) + 1), rng.choice([1, 2, 0]))
    elif how == 2 and shape:
        shape[rng.randrange(len(shape))] = rng.choice(HOSTILE_VALUES)
    elif how == 3 and shape:
        i = rng.randrange(len(shape))
        shape[i] = max(0, shape[i] + rng.choice([-1, 1]))
    elif how == 4 and len(shape) >= 2:
        shape = shape[::-1]
    elif how == 5:
        shape = [1] * rng.choice([0, 9, 50])
    else:
        shape = rng.choice([None, "3", {}, [1.5], [[1]], [-1]])
    info["shape"] = shape
    if rng.random() < 0.5 and isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape):
        tag = info["dtype"]
        info["data_offsets"][1] = info["data_offsets"][0] + math.prod(shape) * ITEMSIZE.get(tag, 1)
    return p.to_bytes(), f"shape {name} -> {str(shape)[:60]}"


def m_tensor_offsets(rng, blob):
    p = Parsed(blob)
    names = p.tensor_names()
    name = rng.choice(names)
    info = p.header[name]
    begin, end = info["data_offsets"]
    size = end - begin
    other = p.header[rng.choice(names)]["data_offsets"]
    how = rng.randrange(7)
    if how == 0:  # overlap another tensor, same length
        info["data_offsets"] = [other[0], other[0] + size]
    elif how == 1:  # past the end of the file
        start = len(p.data) + rng.choice([0, 1, 4096, 2**40])
        info["data_offsets"] = [start, start + size]
    elif how == 2:
        info["data_offsets"] = [end, begin]
    elif how == 3:
        info["data_offsets"] = [rng.choice(HOSTILE_INTS), rng.choice(HOSTILE_INTS)]
    elif how == 4:
        info["data_offsets"] = rng.choice([None, [0], [0, 1, 2], ["0", "1"], [0.0, 1.0], {}, [True, False]])
    elif how == 5:  # shift by a few bytes: misaligned but in range
        shift = rng.choice([-3, -1, 1, 2, 5])
        info["data_offsets"] = [begin + shift, end + shift]
    else:
        info["data_offsets"] = [begin, end + rng.choice([-1, 1, 8])]
    return p.to_bytes(), f"offsets {name} -> {str(info['data_offsets'])[:60]}"


def m_huge_tensor(rng, blob):
    """A tensor declaring a terabyte (or more) with self-consistent offsets."""
    p = Parsed(blob)
    name = rng.choice(p.tensor_names())
    info = p.header[name]
    itemsize = ITEMSIZE.get(info["dtype"], 1)
    shape = list(info["shape"]) or [1]
    shape[0] = rng.choice([2**40 // itemsize // max(1, math.prod(shape[1:])), 2**47, 2**31, 10**9])
    info["shape"] = shape
    info["data_offsets"] = [info["data_offsets"][0], info["data_offsets"][0] + math.prod(shape) * itemsize]
    return p.to_bytes(), f"huge {name} {shape}"


def m_tensor_set(rng, blob):
    p = Parsed(blob)
    names = p.tensor_names()
    how = rng.randrange(5)
    if how == 0:
        name = rng.choice(names)
        del p.header[name]
        return p.to_bytes(), f"drop {name}"
    if how == 1:
        name = rng.choice(names)
        new = rng.choice(["step.0." + name, name + "x", "step.1." + name.split(".")[-1], "step.-1.query",
                          "step.99.query", "extra"])
        p.header[new] = p.header.pop(name)
        return p.to_bytes(), f"rename {name} -> {new}"
    if how == 2:
        p.header["extra"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
        return p.to_bytes(), "add empty unknown tensor"
    if how == 3:
        p.header[rng.choice(names)] = rng.choice([None, 1, "x", [], {"dtype": "F32"}])
        return p.to_bytes(), "entry not a tensor"
    p.header["__metadata__"] = rng.choice([None, [], "x", {"kvdbg.format": 1}, {"kvdbg.format": "1"},
                                           {**p.header["__metadata__"], "kvdbg.format": rng.choice(["2", "", "1 "])},
                                           {**p.header["__metadata__"], "extra": {"a": 1}}])
    return p.to_bytes(), "metadata replaced"


def m_header_shape(rng, blob):
    how = rng.randrange(4)
    if how == 0:
        depth = rng.choice([100, 5000, 200000])
        raw = ("[" * depth + "]" * depth).encode()
    elif how == 1:
        raw = rng.choice([b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe{}", b'{"a":NaN}'])
    elif how == 2:  # duplicate keys: JSON parsers keep the last one
        (n,) = struct.unpack("<Q", blob[:8])
        text = blob[8:8 + n].decode().rstrip()
        dup = '"kv_cache":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        raw = ("{" + dup + text[1:]).encode()
        raw += b" " * (-len(raw) % 8)
        return struct.pack("<Q", len(raw)) + raw + blob[8 + n:], "duplicate key"
    else:
        p = Parsed(blob)
        for i in range(rng.choice([1000, 100000])):
            p.header[f"t{i}"] = {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]}
        return p.to_bytes(), "many tensors"
    raw += b" " * (-len(raw) % 8)
    p_data = Parsed(blob).data
    return struct.pack("<Q", len(raw)) + raw + bytes(p_data), f"header replaced ({len(raw)} bytes)"


def m_meta_field(rng, blob):
    p = Parsed(blob)
    meta = p.meta
    path = rng.choice(META_FIELDS)
    key = path[-1]
    if rng.random() < 0.3 and key in META_STRINGS:
        value = rng.choice(META_STRINGS[key])
    elif rng.random() < 0.15:
        value = "__delete__"
    else:
        value = rng.choice(HOSTILE_VALUES)
    obj = meta
    for part in path[:-1]:
        obj = obj[part]
    if value == "__delete__":
        obj.pop(key, None)
    else:
        obj[key] = value
    p.meta = meta
    return p.to_bytes(), f"meta {'.'.join(path)} = {str(value)[:40]}"


def m_meta_consistent(rng, blob):
    """Small plausible metadata changes that keep the header structurally valid more often."""
    p = Parsed(blob)
    meta = p.meta
    layer, backend = meta["layer"], meta["backend"]
    how = rng.randrange(7)
    if how == 0:
        backend["max_model_len"] = rng.choice([1, 8, 100, 2**31 - 1, 2**40])
    elif how == 1:
        backend["num_gpu_blocks"] = rng.choice([1, 2, backend["num_gpu_blocks"] - 1, 2**31, 2**40])
    elif how == 2:
        layer["sliding_window"] = rng.choice([1, 2, 15, 16, 17, 4096, 2**31, 2**40])
    elif how == 3:
        layer["causal"] = not layer["causal"]
    elif how == 4:
        backend["max_decode_query_len"] = rng.choice([1, 2, 7, 8, 2**31, 2**40])
    elif how == 5:
        layer["scale"] = rng.choice([1e-300, 1e300, 1e30, 2**-149, 1.0])
        for k in ("q_scale", "k_scale", "v_scale"):
            if rng.random() < 0.5:
                layer[k] = rng.choice([1e-300, 1e-45, 1e38, 1e300])
    else:
        layer["kv_cache_dtype"] = rng.choice(["auto", "fp8"])
    p.meta = meta
    return p.to_bytes(), f"meta consistent #{how}"


def m_meta_raw(rng, blob):
    p = Parsed(blob)
    how = rng.randrange(6)
    if how == 0:
        depth = rng.choice([50, 1000, 100000])
        meta = p.meta
        meta["capture"] = json.loads("[" * min(depth, 900) + "]" * min(depth, 900)) if depth < 1000 else {}
        raw = json.dumps(meta)
        if depth >= 1000:
            raw = raw[:-1] + ',"deep":' + "[" * depth + "]" * depth + "}"
        p.header["__metadata__"]["kvdbg.meta"] = raw
    elif how == 1:
        meta = p.meta
        meta["notes"] = "n" * rng.choice([2**20, 2**20 - 500, 3 * 2**20])
        p.meta = meta
    elif how == 2:
        p.header["__metadata__"]["kvdbg.meta"] = rng.choice(["", "{", "[]", "null", "1", '"x"', "NaN", "{}",
                                                             '{"layer": {}, "backend": {}}'])
    elif how == 3:
        meta = p.meta
        meta["capture"] = {f"k{i}": "v" * 20 for i in range(rng.choice([100, 30000]))}
        p.meta = meta
    elif how == 4:
        meta = p.meta
        meta["num_steps"] = rng.choice([0, 1, 2, 3, 4096, 4097, 2**40])
        p.meta = meta
    else:
        meta = p.meta
        meta["kv_layout"] = rng.choice(META_STRINGS["kv_layout"])
        p.meta = meta
    return p.to_bytes(), f"meta raw #{how}"


def _pick_tensor(rng, p, kinds):
    names = p.tensor_names(kinds)
    return rng.choice(names) if names else None


def m_index_values(rng, blob):
    p = Parsed(blob)
    name = _pick_tensor(rng, p, INDEX_TENSORS)
    if name is None:
        return blob, "no index tensor"
    view = p.view(name)
    if view is None or view.numel() == 0:
        return blob, f"{name} empty"
    meta = p.meta
    blocks = meta["backend"]["num_gpu_blocks"]
    n = view.numel()
    how = rng.randrange(8)
    info = view.dtype
    big = 2**31 - 1 if info.itemsize == 4 else 2**63 - 1
    if how == 0:
        for _ in range(rng.choice([1, 3])):
            view[rng.randrange(n)] = rng.choice([-1, -2, -big - 1, big, 0, blocks, blocks - 1, blocks + 1,
                                                 2**20, int(view[rng.randrange(n)])])
    elif how == 1:  # duplicates
        i, j = rng.randrange(n), rng.randrange(n)
        view[i] = view[j]
    elif how == 2:
        view[:] = view.flip(0).clone()
    elif how == 3:
        view[:] = 0
    elif how == 4:
        view[:] = view.clone()[rng.randrange(n)]
    elif how == 5:
        view[rng.randrange(n)] = -rng.choice([1, 5, 1000])
    elif how == 6:
        view.add_(rng.choice([-1, 1, 16, -16]))
    else:
        import torch

        view[:] = torch.randint(-5, max(6, blocks + 5), (n,), generator=torch.Generator().manual_seed(rng.randrange(2**31)),
                                dtype=view.dtype)
    return p.to_bytes(), f"index {name} #{how}"


def m_qsl_chaos(rng, blob):
    p = Parsed(blob)
    name = _pick_tensor(rng, p, ("query_start_loc",))
    if name is None:
        return blob, "no qsl"
    view = p.view(name)
    n = view.numel()
    how = rng.randrange(5)
    if how == 0:
        view[-1] = view[-1] + rng.choice([-1, 1])
    elif how == 1 and n > 2:
        view[1] = view[-1]
    elif how == 2:
        view[0] = rng.choice([-1, 1])
    elif how == 3 and n > 2:
        i = rng.randrange(1, n - 1)
        view[i] = view[i] + rng.choice([-3, 3, 2**30])
    else:
        view[:] = 0
    return p.to_bytes(), f"qsl #{how}"


def m_float_values(rng, blob):
    import torch

    p = Parsed(blob)
    name = _pick_tensor(rng, p, FLOAT_TENSORS)
    if name is None:
        return blob, "no float tensor"
    info = p.header[name]
    tag = info["dtype"]
    if tag not in ("F16", "BF16", "F32", "F64", "U8", "F8_E4M3"):
        return blob, f"{name} has dtype {tag}"
    tdtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
              "U8": torch.float8_e4m3fn, "F8_E4M3": torch.float8_e4m3fn}[tag]
    begin, end = info["data_offsets"]
    count = (end - begin) // torch.empty(0, dtype=tdtype).element_size()
    if count <= 0:
        return blob, f"{name} empty"
    flat = torch.frombuffer(p.data, dtype=torch.uint8, count=end - begin, offset=begin).view(tdtype)
    shape = info["shape"]
    # A "page": one slice along the page dimension of kv_cache, or a token row elsewhere.
    if name == "kv_cache" and len(shape) >= 4:
        pages = shape[1] if len(shape) == 5 else shape[0]
        per = count // max(1, pages if len(shape) == 4 else 2 * pages)
        unit = rng.randrange(max(1, count // max(1, per)))
        sl = slice(unit * per, (unit + 1) * per)
    else:
        per = max(1, count // max(1, shape[0] if shape else 1))
        unit = rng.randrange(max(1, count // per))
        sl = slice(unit * per, (unit + 1) * per)
    how = rng.randrange(7)
    region = flat[sl]
    if how == 0:
        region[rng.randrange(region.numel())] = float("nan")
    elif how == 1:
        region[rng.randrange(region.numel())] = rng.choice([float("inf"), float("-inf")])
    elif how == 2:
        region.zero_()
    elif how == 3:  # denormals
        tiny = torch.finfo(tdtype).smallest_normal / 4 if tdtype.is_floating_point else 0
        region.fill_(tiny)
    elif how == 4:
        region.fill_(torch.finfo(tdtype).max)
    elif how == 5:
        flat.zero_()
    else:
        region.fill_(float("nan"))
    return p.to_bytes(), f"float {name} unit {unit} #{how}"


def m_page_games(rng, blob):
    """Page 0 and duplicate pages in live block-table entries, kept consistent with page_ids."""
    p = Parsed(blob)
    bts = p.tensor_names(("block_table",))
    if not bts or "page_ids" not in p.header:
        return blob, "no block table"
    bt = p.view(rng.choice(bts))
    ids = p.view("page_ids")
    if bt is None or ids is None or bt.numel() == 0:
        return blob, "empty"
    how = rng.randrange(3)
    if how == 0:  # rename a stored page to engine page 0 everywhere
        victim = int(bt[rng.randrange(bt.numel())])
        ids[ids == victim] = 0
        for name in bts:
            t = p.view(name)
            if t is not None:
                t[t == victim] = 0
    elif how == 1:
        bt[rng.randrange(bt.numel())] = bt[rng.randrange(bt.numel())]
    else:
        bt[:] = bt[0]
    return p.to_bytes(), f"pages #{how}"


MUTATORS = [
    (m_random_bytes, 3), (m_header_bytes, 3), (m_truncate, 3), (m_header_len, 2), (m_append, 1),
    (m_tensor_dtype, 3), (m_tensor_shape, 4), (m_tensor_offsets, 4), (m_huge_tensor, 2), (m_tensor_set, 3),
    (m_header_shape, 1), (m_meta_field, 6), (m_meta_consistent, 5), (m_meta_raw, 2),
    (m_index_values, 8), (m_qsl_chaos, 3), (m_float_values, 8), (m_page_games, 4),
]


def mutate(rng: random.Random, blob: bytes) -> tuple[bytes, list[str]]:
    names = [m for m, _ in MUTATORS]
    weights = [w for _, w in MUTATORS]
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 2, 3])):
        fn = rng.choices(names, weights)[0]
        try:
            blob, what = fn(rng, blob)
        except Exception as exc:  # the previous mutation made the file unparseable for this one
            what = f"{fn.__name__} skipped ({type(exc).__name__})"
        done.append(f"{fn.__name__}: {what}")
    return blob, done


# --------------------------------------------------------------------------- commands


def window_args(rng: random.Random) -> list[str]:
    pool = [-1, 0, 1, 2, 7, 8, 15, 16, 17, 100, 4096, 9000, 2**31, 10**6, 10**12, 2**63]
    args = ["window", "--seq-len", str(rng.choice(pool + [9000, 9000]))]
    if rng.random() < 0.7:
        args += ["--window", str(rng.choice(pool))]
    if rng.random() < 0.7:
        args += ["--query-len", str(rng.choice(pool[:8] + [10**6, 10**9, 2**62]))]
    if rng.random() < 0.5:
        args += ["--page-size", str(rng.choice(pool))]
    if rng.random() < 0.5:
        args += ["--mask", rng.choice(["dense", "causal"])]
    if rng.random() < 0.3:
        args += ["--max-model-len", str(rng.choice(pool))]
    if rng.random() < 0.3:
        args += ["--max-decode-query-len", str(rng.choice(pool))]
    if rng.random() < 0.3:
        args.append("--full")
    if rng.random() < 0.3:
        args.append("--json")
    return args


def commands_for(rng: random.Random, path: str, *, default_backends: float) -> list[list[str]]:
    def maybe_json(args):
        return args + (["--json"] if rng.random() < 0.3 else [])

    cmds = [maybe_json(["info", path]), maybe_json(["info", "--check", path])]
    map_args = ["map", path]
    if rng.random() < 0.2:
        map_args += ["--step", str(rng.choice([0, 1, 2, -1, 2**40]))]
    if rng.random() < 0.2:
        map_args += ["--request", str(rng.choice([0, 1, 3, -1, 2**40, "0-1", "1,9"]))]
    if rng.random() < 0.1:
        map_args.append("--full")
    cmds.append(maybe_json(map_args))
    replay_args = ["replay", path]
    if rng.random() >= default_backends:
        replay_args += ["--backend", "reference"]
    if rng.random() < 0.1:
        replay_args += ["--step", str(rng.choice([0, 1, -1, 2**40]))]
    if rng.random() < 0.1:
        replay_args += ["--head", rng.choice(["0", "0-3", "5-1", "x", "-3", "0-100000000000", "99"])]
    if rng.random() < 0.1:
        replay_args += ["--request", rng.choice(["0", "1-2", "0-100000000000", "7"])]
    if rng.random() < 0.05:
        replay_args += [rng.choice(["--atol", "--rtol"]), rng.choice(["nan", "-1", "inf", "0"])]
    if rng.random() < 0.1:
        replay_args.append(rng.choice(["--exact", "--explain", "--full"]))
    cmds.append(maybe_json(replay_args))
    cmds.append(window_args(rng))
    return cmds


def classify(exit_code: int, exception, stderr: str, stdout: str) -> str | None:
    """None when the outcome is acceptable, else the kind of failure."""
    if exception is not None and not isinstance(exception, SystemExit):
        if isinstance(exception, MemoryError):
            return "memory"
        return "traceback"
    if "Traceback (most recent call last)" in stderr + stdout:
        return "traceback"
    if exit_code in (0, 1, 3):  # 3: a replay that could compare nothing (kvdbg.judge.verdict)
        return None
    if exit_code != 2:
        return "bad_exit"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if not lines or not lines[-1].startswith("Error: "):
        return "bad_error_line"
    # click's own usage errors (a non-integer option value) print usage lines first; kvdbg's are one line.
    if len(lines) > 1 and not (lines[0].startswith("Usage:") and all(
            ln.startswith(("Usage:", "Try ")) for ln in lines[:-1])):
        return "multiline_error"
    if "out of memory" in lines[-1]:
        return "memory"
    return None


# --------------------------------------------------------------------------- the fork server


def _vm_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def child_main(cmds: list[list[str]], file_size: int, wfd: int) -> None:
    """Runs in the forked child: every command in-process, one JSON line per finished command."""
    from click.testing import CliRunner

    from kvdbg.cli import cli

    start_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    limit = _vm_bytes() + 2 * file_size + 1300 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.write(wfd, (json.dumps({"start_kb": start_kb}) + "\n").encode())
    for args in cmds:
        runner = CliRunner()
        try:
            result = runner.invoke(cli, args, env={"COLUMNS": "120", "NO_COLOR": "1"})
            exc = result.exception
            kind = classify(result.exit_code, exc, result.stderr, result.stdout)
            tail = (result.stderr + result.stdout)[-1500:]
            if kind in ("traceback", "memory") and result.exc_info is not None and exc is not None:
                import traceback

                tail = "".join(traceback.format_exception(*result.exc_info))[-3000:]
            rec = {"exit": result.exit_code, "kind": kind, "tail": tail if kind else ""}
        except BaseException as exc:  # the runner itself broke: count it against the input
            rec = {"exit": None, "kind": "traceback", "tail": f"{type(exc).__name__}: {exc}"[:1500]}
        os.write(wfd, (json.dumps(rec) + "\n").encode())
    os._exit(0)


class Job:
    def __init__(self, index, path, cmds, file_size, mutations):
        self.index, self.path, self.cmds, self.file_size, self.mutations = index, path, cmds, file_size, mutations
        self.records: list[dict] = []
        self.buf = b""
        self.start_kb = None
        self.started = time.monotonic()
        self.last = self.started
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                child_main(cmds, file_size, w)
            finally:
                os._exit(3)
        os.close(w)
        self.pid, self.fd = pid, r

    def feed(self) -> bool:
        """Read what the child wrote; False at EOF."""
        chunk = os.read(self.fd, 65536)
        if not chunk:
            return False
        self.last = time.monotonic()
        self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            rec = json.loads(line)
            if "start_kb" in rec:
                self.start_kb = rec["start_kb"]
            else:
                self.records.append(rec)
        return True


def make_seeds(out_dir: str) -> list[str]:
    """The fixtures plus a few small synthetic snapshots (fast to replay, every feature covered)."""
    from kvdbg.snapshot.store import save_snapshot
    from kvdbg.moves.synth import SynthSpec, synth_snapshot
    from tests.helpers import FIXTURES

    seeds = sorted(os.path.join(FIXTURES, f) for f in os.listdir(FIXTURES) if f.endswith(".safetensors"))
    specs = [
        SynthSpec(seq_lens=(20, 40), num_heads=4, num_kv_heads=2, head_size=16, seed=11),
        SynthSpec(seq_lens=(9, 33, 17), query_len=2, num_heads=4, num_kv_heads=1, head_size=16, causal=False,
                  sliding_window=8, seed=12),
        SynthSpec(seq_lens=(30, 50), num_heads=2, num_kv_heads=2, head_size=16, fp8=True, q_scale=0.05,
                  k_scale=0.03, v_scale=0.04, seed=13),
        SynthSpec(seq_lens=(40, 24), num_heads=4, num_kv_heads=2, head_size=16, steps=2, shared_prefix_pages=1,
                  use_page_zero=True, stale_tail=2, layout="2,pages,tokens,heads,dim", seed=14),
        SynthSpec(seq_lens=(12,), num_heads=2, num_kv_heads=1, head_size=8, page_size=4, dtype="float32",
                  new_kv=False, seed=15),
    ]
    seed_dir = os.path.join(out_dir, "seeds")
    os.makedirs(seed_dir, exist_ok=True)
    for i, spec in enumerate(specs):
        path = os.path.join(seed_dir, f"small{i}.safetensors")
        save_snapshot(synth_snapshot(spec), path, overwrite=True)
        seeds.append(path)
    return seeds


def run(count: int, seed: int, out_dir: str, *, jobs: int = 2, timeout: float = 30.0,
        default_backends: float = 0.03, quiet: bool = False) -> dict:
    import torch

    torch.set_num_threads(1)  # one thread per child: forking a process with a live OpenMP pool can deadlock
    import kvdbg.cli.info  # noqa: F401  warm every command module once, before forking
    import kvdbg.cli.map  # noqa: F401
    import kvdbg.cli.replay  # noqa: F401
    import kvdbg.cli.window  # noqa: F401
    import kvdbg.replayer.runner  # noqa: F401
    import kvdbg.render.info  # noqa: F401
    import kvdbg.render.pagemap  # noqa: F401
    import kvdbg.render.replay  # noqa: F401
    import kvdbg.render.window  # noqa: F401
    from kvdbg.backends import DEFAULT_ORDER, get_backend

    for name in DEFAULT_ORDER:
        get_backend(name)

    os.makedirs(out_dir, exist_ok=True)
    seeds = make_seeds(out_dir)
    blobs = {p: open(p, "rb").read() for p in seeds}
    # Small seeds replay in milliseconds; the fixtures still get a fair share.
    weights = [1 if os.path.basename(os.path.dirname(p)) == "fixtures" else 3 for p in seeds]
    work = tempfile.mkdtemp(prefix="inputs-", dir=out_dir)
    failures_path = os.path.join(out_dir, "failures.jsonl")
    open(failures_path, "w").close()
    counts: dict = {"inputs": 0, "commands": 0, "exit": {}, "per_command": {}, "failures": {}}
    t0 = time.monotonic()
    running: dict[int, Job] = {}
    next_index = 0

    def start(index: int) -> Job:
        rng = random.Random(f"{seed}:{index}")
        base = rng.choices(seeds, weights)[0]
        blob, mutations = mutate(rng, blobs[base])
        # One file per input: a slow child still has its input memory-mapped while
        # faster ones finish, and rewriting that file under it raises SIGBUS.
        path = os.path.join(work, f"in{index}.safetensors")
        with open(path, "wb") as fh:
            fh.write(blob)
        cmds = commands_for(rng, path, default_backends=default_backends)
        return Job(index, path, cmds, len(blob), [os.path.basename(base)] + mutations)

    def record_failure(job: Job, command, kind: str, exit_code, tail: str) -> None:
        counts["failures"][kind] = counts["failures"].get(kind, 0) + 1
        saved = os.path.join(out_dir, f"fail-{job.index}.safetensors")
        if not os.path.exists(saved):
            with open(job.path, "rb") as src, open(saved, "wb") as dst:
                dst.write(src.read())
        line = {"index": job.index, "seed": seed, "input": saved, "mutations": job.mutations,
                "command": [a if a != job.path else saved for a in (command or [])], "kind": kind,
                "exit": exit_code, "tail": tail[-3000:]}
        with open(failures_path, "a") as fh:
            fh.write(json.dumps(line) + "\n")
        if not quiet:
            print(f"FAIL #{job.index} {kind}: {' '.join(line['command'][:1] + line['command'][2:])} "
                  f"[{'; '.join(job.mutations)}] :: {tail.strip().splitlines()[-1] if tail.strip() else ''}",
                  file=sys.stderr, flush=True)

    def finish(job: Job, hung: bool) -> None:
        if hung:
            os.kill(job.pid, signal.SIGKILL)
        _, status, usage = os.wait4(job.pid, 0)
        os.close(job.fd)
        counts["inputs"] += 1
        for args, rec in zip(job.cmds, job.records):
            counts["commands"] += 1
            key = args[0] + (" --check" if "--check" in args else "")
            per = counts["per_command"].setdefault(key, {})
            outcome = str(rec["exit"]) if rec["kind"] is None else rec["kind"]
            per[outcome] = per.get(outcome, 0) + 1
            if rec["kind"] is None:
                counts["exit"][str(rec["exit"])] = counts["exit"].get(str(rec["exit"]), 0) + 1
            else:
                record_failure(job, args, rec["kind"], rec["exit"], rec["tail"])
        done = len(job.records)
        if hung:
            record_failure(job, job.cmds[done] if done < len(job.cmds) else None, "hang", None,
                           f"no progress for {timeout:.0f} s")
        elif done < len(job.cmds):
            record_failure(job, job.cmds[done], "child_died", None, f"wait status {status}")
        grown_kb = usage.ru_maxrss - (job.start_kb or usage.ru_maxrss)
        limit_kb = (2 * job.file_size + 300 * 2**20) // 1024
        counts["max_rss_growth_mb"] = max(counts.get("max_rss_growth_mb", 0), grown_kb // 1024)
        if grown_kb > limit_kb:
            record_failure(job, None, "memory", None, f"peak RSS grew {grown_kb // 1024} MB (limit {limit_kb // 1024} MB)")
        os.unlink(job.path)  # failures were copied to the out dir above

    while next_index < count or running:
        while next_index < count and len(running) < jobs:
            job = start(next_index)
            running[job.fd] = job
            next_index += 1
        ready, _, _ = select.select(list(running), [], [], 1.0)
        for fd in ready:
            job = running[fd]
            if not job.feed():
                del running[fd]
                finish(job, hung=False)
        now = time.monotonic()
        for fd, job in list(running.items()):
            if now - job.last > timeout:
                del running[fd]
                finish(job, hung=True)
        if not quiet and counts["inputs"] and counts["inputs"] % 500 == 0 and not ready == []:
            pass
    counts["wall_s"] = round(time.monotonic() - t0, 1)
    counts["total_failures"] = sum(counts["failures"].values())
    counts["command_line"] = " ".join(["python -m tests.fuzz.fuzzer", f"--count {count}", f"--seed {seed}",
                                       f"--out {out_dir}", f"--jobs {jobs}"])
    with open(os.path.join(out_dir, "summary.json"), "w") as fh:
        json.dump(counts, fh, indent=2)
    for name in os.listdir(work):
        os.unlink(os.path.join(work, name))
    os.rmdir(work)
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.fuzzer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--jobs", type=int, default=2, help="inputs in flight at once (one forked child each)")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds without progress that count as a hang")
    parser.add_argument("--default-backends", type=float, default=0.03,
                        help="fraction of inputs replayed with the default backend set instead of reference only")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    counts = run(args.count, args.seed, args.out, jobs=args.jobs, timeout=args.timeout,
                 default_backends=args.default_backends, quiet=args.quiet)
    print(json.dumps({k: v for k, v in counts.items()}, indent=2))
    return 1 if counts["total_failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
