"""A bundled fixture with one NaN in a live K slot, made with kvdbg's own load/save API (tests import it)."""

from __future__ import annotations

import os

from tests.helpers import FIXTURES

# prefix_page0's request 0 (seq_len 100 at step 0, 101 at step 1) reads engine page 33 through table column 3:
# keys 48..63. Slot 5 of it is key 53, well inside the causal mask of its query token (position 99), and no
# other request maps page 33, so exactly request 0's query heads of KV head 0 (heads 0..3) read the NaN.
NAN_SOURCE = "prefix_page0.safetensors"
NAN_REQUEST, NAN_COLUMN, NAN_KV_HEAD, NAN_SLOT, NAN_DIM = 0, 3, 0, 5, 7
NAN_KEY = NAN_COLUMN * 16 + NAN_SLOT  # 53 (page size 16)
NAN_HEADS = (0, 1, 2, 3)  # the query heads of KV head 0 (8 query heads over 2 KV heads)


def nan_in_live_k(path: str | os.PathLike, *, source: str = NAN_SOURCE, request: int = NAN_REQUEST,
                  column: int = NAN_COLUMN, kv_head: int = NAN_KV_HEAD, slot: int = NAN_SLOT,
                  dim: int = NAN_DIM) -> str:
    """Copy ``fixtures/<source>`` to ``path`` with K[page, kv_head, slot, dim] = NaN, where ``page`` is the page
    ``request``'s block-table ``column`` names at step 0. Returns the path written."""
    from kvdbg import load_snapshot, save_snapshot

    snap = load_snapshot(os.path.join(FIXTURES, source))
    keys, _ = snap.kv_views()  # views of the loaded (copy-on-write) cache: the fixture file is never changed
    stored = int(snap.stored_block_table(0)[request, column])
    assert stored >= 0, "the chosen table entry must name a stored page"
    keys[stored, kv_head, slot, dim] = float("nan")
    return str(save_snapshot(snap, path))


def with_index_entry(path: str | os.PathLike, name: str, index: int, value: int, *,
                     source: str = NAN_SOURCE) -> str:
    """Copy ``fixtures/<source>`` to ``path`` with element ``index`` (flat) of the int tensor ``name`` set to
    ``value``, byte for byte otherwise: a file kvdbg's save_snapshot would refuse to write, as a buggy capture
    or another tool may. The offset comes from kvdbg's own header reader (open_snapshot)."""
    import shutil
    import struct

    from kvdbg import open_snapshot

    shutil.copyfile(os.path.join(FIXTURES, source), path)
    header = open_snapshot(path)
    entry = header.tensors[name]
    code = {"int32": "<i", "int64": "<q"}[entry.dtype]
    with open(path, "r+b") as fh:
        fh.seek(header.data_start + entry.begin + index * struct.calcsize(code))
        fh.write(struct.pack(code, value))
    return str(path)
