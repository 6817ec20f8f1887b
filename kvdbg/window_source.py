"""`kvdbg window SNAP`: one request's window parameters read from a snapshot's header and lengths (no torch)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from kvdbg.errors import OptionError
from kvdbg.format import read_header, read_index_tensor


@dataclass(frozen=True)
class WindowSource:
    """Where `kvdbg window` took L, W, q, page size and mask from."""

    path: str
    step: int
    num_steps: int
    request: int
    num_reqs: int
    longest: bool  # the request was chosen as the longest of its step
    seq_len: int
    query_len: int
    window: int | None
    page_size: int
    causal: bool
    max_model_len: int
    max_decode_query_len: int

    def to_json(self) -> dict:
        return asdict(self)


def window_source(path: str | os.PathLike, step: int | None = None, request: int | None = None) -> WindowSource:
    """Read one request of one step (default: step 0, the longest request) from ``path``'s header and lengths.

    Only the header and the step's ``seq_lens`` and ``query_start_loc`` are read,
    with the standard library: no KV page is touched and torch is never imported.
    """
    header = read_header(path)
    meta = header.meta
    num_steps = meta.num_steps
    step = 0 if step is None else step
    if not 0 <= step < num_steps:
        raise OptionError(f"--step {step} is out of range: the snapshot has {num_steps} step(s)")
    seq_lens = read_index_tensor(header, meta.step_prefix(step) + "seq_lens")
    starts = read_index_tensor(header, meta.step_prefix(step) + "query_start_loc")
    if not seq_lens:
        raise OptionError(f"step {step} of the snapshot has no request")
    longest = request is None
    if request is None:
        request = max(range(len(seq_lens)), key=lambda r: (seq_lens[r], -r))
    if not 0 <= request < len(seq_lens):
        raise OptionError(f"--request {request} is out of range: step {step} has {len(seq_lens)} request(s)")
    return WindowSource(
        path=header.path, step=step, num_steps=num_steps, request=request, num_reqs=len(seq_lens), longest=longest,
        seq_len=int(seq_lens[request]), query_len=int(starts[request + 1] - starts[request]),
        window=meta.layer.sliding_window, page_size=meta.backend.page_size, causal=meta.layer.causal,
        max_model_len=meta.backend.max_model_len, max_decode_query_len=meta.backend.max_decode_query_len)


def step_tables(path: str | os.PathLike, step: int):
    """The step's block table (engine ids), lengths and stored page ids, for the flex picture (no torch)."""
    from kvdbg.picture import StepTables

    header = read_header(path)
    prefix = header.meta.step_prefix(step)
    entry = header.tensors[prefix + "block_table"]
    flat = read_index_tensor(header, prefix + "block_table")
    width = entry.shape[1] if len(entry.shape) == 2 else 0
    rows = [flat[r * width:(r + 1) * width] for r in range(entry.shape[0])] if width else [[] for _ in range(
        entry.shape[0] if entry.shape else 0)]
    return StepTables(block_table=rows, seq_lens=read_index_tensor(header, prefix + "seq_lens"),
                      query_start_loc=read_index_tensor(header, prefix + "query_start_loc"),
                      page_ids=read_index_tensor(header, "page_ids"))


__all__ = ["WindowSource", "step_tables", "window_source"]
