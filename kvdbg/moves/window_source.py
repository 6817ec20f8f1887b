"""`kvdbg window SNAP`: one request's window parameters read from a snapshot's header and lengths (no torch)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from kvdbg.errors import OptionError, SnapshotError
from kvdbg.snapshot import rules
from kvdbg.snapshot.format import LAYER_VALUE_TENSORS, read_header, read_index_tensor, read_small_tensor
from kvdbg.snapshot.rules import StepValues
from kvdbg.ts.window import ts_batch_not_run


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
    # Why FLASHINFER_TS does not run this step, as `kvdbg replay` judges it (None: it does): a prefill-shaped or
    # ragged batch vLLM builds its metadata for and never runs, in a snapshot with no output of its own from it.
    not_applicable: str | None = None
    # A batch of unequal query lengths the engine's own FLASHINFER_TS ran: replay's non_uniform_query_blocks.
    non_uniform: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def window_source(path: str | os.PathLike, step: int | None = None, request: int | None = None) -> WindowSource:
    """Read one request of one step (default: step 0, the longest request) from ``path``'s header and lengths.

    Only the header and the index tensors (page ids, every step's block table, lengths and slots) are read,
    with the standard library: no KV page is touched and torch is never imported. The file is held to the
    rules a replay loads it under (kvdbg.snapshot.rules): what a replay refuses is refused here, in its words.
    """
    header = read_header(path)
    meta = header.meta
    num_steps = meta.num_steps
    step = 0 if step is None else step
    if not 0 <= step < num_steps:
        raise OptionError(f"--step {step} is out of range: the snapshot has {num_steps} step(s)")
    prefix = meta.step_prefix(step)
    seq_lens = read_index_tensor(header, prefix + "seq_lens")
    starts = read_index_tensor(header, prefix + "query_start_loc")
    if not seq_lens:
        raise OptionError(f"step {step} of the snapshot has no request")
    _check_values(header)
    longest = request is None
    if request is None:
        request = max(range(len(seq_lens)), key=lambda r: (seq_lens[r], -r))
    if not 0 <= request < len(seq_lens):
        raise OptionError(f"--request {request} is out of range: step {step} has {len(seq_lens)} request(s)")
    return WindowSource(
        path=header.path, step=step, num_steps=num_steps, request=request, num_reqs=len(seq_lens), longest=longest,
        seq_len=int(seq_lens[request]), query_len=int(starts[request + 1] - starts[request]),
        window=meta.layer.sliding_window, page_size=meta.backend.page_size, causal=meta.layer.causal,
        max_model_len=meta.backend.max_model_len, max_decode_query_len=meta.backend.max_decode_query_len,
        not_applicable=_not_applicable(header, prefix, starts), non_uniform=_non_uniform(starts))


def _check_values(header) -> None:
    """Hold the file to the rules `kvdbg replay` loads it under (kvdbg.snapshot.rules, shared with
    kvdbg.snapshot.store's validation), over every step as a replay does, from the index tensors alone: window
    reads no page, but it never analyses a file a replay would refuse as bad input, and says why in the same
    words (the path first, as load_snapshot says it)."""
    meta = header.meta
    steps = []
    for step in range(meta.num_steps):
        prefix = meta.step_prefix(step)
        table = header.tensors[prefix + "block_table"]
        query = header.tensors[prefix + "query"]
        steps.append(StepValues(
            block_table=read_index_tensor(header, prefix + "block_table"),
            width=table.shape[1] if len(table.shape) == 2 else 0,
            seq_lens=read_index_tensor(header, prefix + "seq_lens"),
            query_start_loc=read_index_tensor(header, prefix + "query_start_loc"),
            num_tokens=query.shape[0] if query.shape else 0,
            slot_mapping=read_index_tensor(header, prefix + "slot_mapping")
            if prefix + "slot_mapping" in header.tensors else None))
    try:
        rules.check_values(meta, read_index_tensor(header, "page_ids"), steps)
        rules.check_layer_values({name: read_small_tensor(header, name) for name in LAYER_VALUE_TENSORS
                                  if name in header.tensors})
    except SnapshotError as exc:
        raise SnapshotError(f"{header.path}: {exc}") from None


def _not_applicable(header, prefix: str, starts: list[int]) -> str | None:
    """FLASHINFER_TS's rule for the batches it runs (backends.flashinfer_ts ``not_applicable``), from lengths."""
    meta = header.meta
    if meta.backend.name == "FLASHINFER_TS" and prefix + "output" in header.tensors:
        return None  # the engine ran it and kept its output: the findings say what went wrong
    return ts_batch_not_run([b - a for a, b in zip(starts, starts[1:])], meta.backend.max_decode_query_len)


def _non_uniform(starts: list[int]) -> str | None:
    lens = [b - a for a, b in zip(starts, starts[1:])]
    if min(lens) == max(lens):
        return None
    q = starts[-1] // len(lens)
    return (f"query lens {lens[:16]} are not uniform: the kernel views the flat query as {len(lens)} blocks of {q}, "
            "so some requests get other requests' tokens (kvdbg replay names them)")


def input_findings(path: str | os.PathLike, steps=None) -> tuple[list, frozenset[str]]:
    """Every finding a replay would make about the inputs of ``path`` without computing attention, and the
    sources that count for it (kvdbg.judge.verdict.input_counted): `map` and `window SNAP` judge these.

    For every request of every step (or of ``steps``): FLASHINFER_TS's builder and kernel preconditions and its
    window restriction (kvdbg.ts.window, backend ``flashinfer_ts``, where FLASHINFER_TS runs the step), and the
    paging findings of FLEX_ATTENTION's physical->logical map (kvdbg.snapshot.pagemap, source ``map``).
    Reads the header and index tensors only: no torch, no KV page.
    """
    from kvdbg.judge.findings import Finding
    from kvdbg.judge.verdict import input_counted
    from kvdbg.snapshot.pagemap import hazard_finding, paging_hazards
    from kvdbg.ts.window import analyze_window, cdiv

    header = read_header(path)
    meta = header.meta
    _check_values(header)
    ps, window, causal = meta.backend.page_size, meta.layer.sliding_window, meta.layer.causal
    found: list = []
    for step in range(meta.num_steps) if steps is None else steps:
        prefix = meta.step_prefix(step)
        seq_lens = read_index_tensor(header, prefix + "seq_lens")
        starts = read_index_tensor(header, prefix + "query_start_loc")
        entry = header.tensors[prefix + "block_table"]
        flat = read_index_tensor(header, prefix + "block_table")
        width = entry.shape[1] if len(entry.shape) == 2 else 0
        ts_runs = _not_applicable(header, prefix, starts) is None
        if ts_runs and _non_uniform(starts):
            found.append(Finding(code="non_uniform_query_blocks", backend="flashinfer_ts", step=step,
                                 message=_non_uniform(starts)))
        for r, length in enumerate(seq_lens):
            qlen = starts[r + 1] - starts[r]
            if qlen <= 0 or qlen > length:
                continue
            live = flat[r * width:r * width + min(width, cdiv(length, ps))]
            for h in paging_hazards(live, length, qlen, ps, window):
                found.append(hazard_finding(r, h, ps, length, backend="map", step=step))
            if not ts_runs:
                continue
            try:
                analysis = analyze_window(length, window, query_len=qlen, page_size=ps, causal=causal,
                                          max_model_len=meta.backend.max_model_len,
                                          max_decode_query_len=meta.backend.max_decode_query_len)
            except OptionError:
                continue  # lengths the builder cannot model: the replay's own findings say so
            for f in analysis.findings:
                f.step, f.request, f.requests = step, r, [r]
                f.message = f"request {r}: {f.message}"
                found.append(f)
            if analysis.applies and analysis.visibility.worst_extra > 0:
                found.append(Finding(
                    code="window_restriction_extra_keys", backend="flashinfer_ts", step=step, request=r,
                    message=f"request {r}: FLASHINFER_TS's page-aligned window restriction shows up to "
                            f"{analysis.visibility.worst_extra} key(s) outside a token's exact window (by design)",
                    details={"worst_extra": analysis.visibility.worst_extra}))
    return found, input_counted(meta.backend.name)


def step_tables(path: str | os.PathLike, step: int):
    """The step's block table (engine ids), lengths and stored page ids, for the flex picture (no torch)."""
    from kvdbg.moves.picture import StepTables

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


__all__ = ["WindowSource", "input_findings", "step_tables", "window_source"]
