"""Staging a replayed graph's step on a CUDA device: the program run eagerly, then recorded and replayed as a
graph of its own, reads the pages the block table names at the time it runs, and waits for its holders."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdbg.vllm_plugin.graph_staging import GraphStager, StageHint

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _layers(count=3, blocks=40, page=16, heads=2, dim=32):
    gen = torch.Generator(device="cuda").manual_seed(0)
    # As vLLM hands a layer its cache: a permuted view ([2, blocks, page, heads, dim] seen, heads outside the page's
    # tokens in memory), whose staged copy must lie in memory the same way.
    caches = [torch.randn(2, blocks, heads, page, dim, device="cuda", generator=gen).to(torch.bfloat16)
              .permute(0, 1, 3, 2, 4) for _ in range(count)]
    queries = [torch.randn(16, 4, dim, device="cuda", generator=gen) for _ in range(count)]
    outputs = [torch.randn(16, 4, dim, device="cuda", generator=gen) for _ in range(count)]
    return [(f"l{i}", caches[i], 1, queries[i], outputs[i]) for i in range(count)]


def _expect(step, layers, table, lengths, page):
    ids, first = step.unique_ids()
    live = sorted({int(table[r, c]) for r, n in enumerate(lengths) for c in range(-(-n // page))})
    assert set(live) <= set(ids.tolist())
    for name, cache, dim, query, output in layers:
        staged = step.pages_for(name)
        where = staged.positions(np.array(live, dtype=np.int64)).cuda()
        torch.testing.assert_close(staged.pages.index_select(dim, where), cache.index_select(dim, torch.tensor(
            live, device="cuda")), rtol=0, atol=0)
        torch.testing.assert_close(step.layers[name].query, query[:12], rtol=0, atol=0)
        torch.testing.assert_close(step.layers[name].output, output[:12], rtol=0, atol=0)


def test_a_program_runs_eagerly_then_as_its_own_graph_and_reads_the_table_when_it_runs():
    layers = _layers()
    table = torch.randint(1, 40, (8, 24), dtype=torch.int32, device="cuda")  # the runner's persistent table
    lengths = [300, 77, 150]
    stager = GraphStager()
    hint = StageHint(table[:3], 3, torch.tensor(lengths), max(lengths))
    first = stager.stage(layers, hint, 16, 12).hold()
    torch.cuda.synchronize()
    _expect(first, layers, table.cpu(), lengths, 16)
    for name, cache, *_ in layers:  # laid out in memory as the cache is
        staged = first.layers[name].pages
        assert sorted(range(5), key=lambda d: -staged.stride(d)) == sorted(range(5), key=lambda d: -cache.stride(d))
    program = first.program
    assert program.graph is not None and program.held  # recorded after its eager run; held by the step
    assert stager.recordings == 1 and stager.recording_ms > 0
    first.release()
    # The next step: new table values and new buffers' contents, written on the engine's stream after the
    # first step; the recorded graph reads what they hold when it replays.
    table.random_(1, 40)
    for _, cache, _, query, output in layers:
        cache.mul_(2)
        query.add_(1)
        output.sub_(1)
    second = stager.stage(layers, hint, 16, 12).hold()
    assert second.program is program and stager.recordings == 1  # released: reused, by its graph
    torch.cuda.synchronize()
    _expect(second, layers, table.cpu(), lengths, 16)
    second.release()


def test_a_held_program_gets_a_twin_and_a_third_step_is_refused():
    layers = _layers(count=1)
    table = torch.randint(1, 40, (8, 24), dtype=torch.int32, device="cuda")
    hint = StageHint(table[:3], 3, None, 150)
    stager = GraphStager()
    a = stager.stage(layers, hint, 16, 12).hold()
    b = stager.stage(layers, hint, 16, 12).hold()
    assert a.program is not b.program
    assert stager.stage(layers, hint, 16, 12) is None and stager.not_staged == {"held": 1}
    a.release()
    torch.cuda.synchronize()  # a's run done on the device: its positions' buffer may be written again
    c = stager.stage(layers, hint, 16, 12)
    assert c.program is a.program
    torch.cuda.synchronize()
    _expect(c, layers, table.cpu(), [150, 150, 150], 16)


def test_the_metadata_is_staged_by_the_recorded_graph_as_the_step_left_it():
    """The program's graph copies the runner's block table, lengths and offsets after the step (its first, eager
    run and its replays alike), the counts from a page-locked buffer of its own; what the runner writes next
    never reaches them."""
    layers = _layers(count=2)
    table = torch.randint(1, 40, (8, 24), dtype=torch.int32, device="cuda")
    seq_lens = torch.zeros(8, dtype=torch.int32, device="cuda")
    offsets = torch.zeros(9, dtype=torch.int32, device="cuda")
    stager = GraphStager()
    for run in range(3):  # eager and recorded, then replayed twice
        lengths = [300 - run, 77 + run, 150]
        seq_lens[:3] = torch.tensor(lengths, dtype=torch.int32)
        offsets[:4] = torch.tensor([0, 4, 8, 12], dtype=torch.int32) + run
        table.random_(1, 40)
        expected = (table[:3, :20].cpu(), seq_lens[:3].cpu(), offsets[:4].cpu())
        hint = StageHint(table[:3, :20], 3, torch.tensor(lengths), max(lengths), seq_lens[:3], offsets[:4], 4)
        step = stager.stage(layers, hint, 16, 12).hold()
        assert step.with_metadata and step.program.host_counts.is_pinned()
        table.random_(1, 40)  # the runner's next step, queued after the program
        seq_lens.fill_(1)
        offsets.fill_(2)
        for got, want in zip(step.metadata(), expected):
            assert got.device.type == "cpu" and torch.equal(got, want)
        _expect(step, layers, expected[0], lengths, 16)
        step.release()
    assert stager.recordings == 1


def test_staging_over_its_device_budget_is_refused_in_words():
    layers = _layers(count=2)
    table = torch.randint(1, 40, (8, 24), dtype=torch.int32, device="cuda")
    stager = GraphStager(max_bytes=1024)
    assert stager.stage(layers, StageHint(table[:3], 3, None, 150), 16, 12) is None
    assert stager.not_staged == {"budget": 1}


def test_a_builds_metadata_copied_to_the_host_matches_it_on_the_device():
    from kvdbg.capture.buffers import HostCopiesReady, copies_to_host

    table = torch.randint(0, 1000, (8, 24), dtype=torch.int32, device="cuda")[:5]
    lengths = torch.randint(1, 400, (5,), dtype=torch.int32, device="cuda")
    slots = torch.randint(-1, 2**33, (9,), dtype=torch.int64, device="cuda")
    host = copies_to_host([table, lengths, slots, None])
    HostCopiesReady(table.device).synchronize()
    assert host[3] is None
    for got, want in zip(host[:3], (table, lengths, slots)):
        assert got.device.type == "cpu" and got.is_pinned() and torch.equal(got, want.cpu())


def test_the_kept_current_stream_is_torchs_and_follows_a_stream_context():
    from kvdbg.capture.buffers import current_stream

    device = torch.device("cuda")
    assert current_stream(device) == torch.cuda.current_stream(device)
    assert current_stream(device) is current_stream(torch.device("cuda", torch.cuda.current_device()))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current_stream(device) == side and current_stream(device).cuda_stream == side.cuda_stream
    assert current_stream(device) == torch.cuda.current_stream(device)


def test_a_staged_span_goes_to_the_host_in_one_copy_and_its_pages_are_picked_there():
    from kvdbg.capture.buffers import HostBuffers, StepCopies

    staged = torch.randn(64, 2, 16, 8, 64, device="cuda").to(torch.bfloat16)  # pages first: spans are contiguous
    positions = torch.tensor([40, 3, 17, 3, 39])
    for buffers in (None, HostBuffers()):  # 38 pages of 32 KiB: pooled when a pool is given
        copies = StepCopies(staged.device, buffers)
        host, within = copies.block(staged, 0, positions)
        copies.close()
        copies.wait()
        assert host.is_pinned() and host.shape[0] == 38 and within.tolist() == [37, 0, 14, 0, 36]
        assert torch.equal(host.index_select(0, within), staged.cpu().index_select(0, positions))
        copies.release()
    # As vLLM lays a TRITON_ATTN cache out (LBNHC): pages outermost in memory, heads and tokens swapped in the
    # view: the span is one dense run, copied in memory order and handed back in the cache's axes.
    permuted = staged.permute(0, 2, 1, 3, 4)
    copies = StepCopies(staged.device)
    host, within = copies.block(permuted, 0, positions)
    copies.close()
    copies.wait()
    assert host.shape == (38, 16, 2, 8, 64) and host.stride() == permuted[:38].stride()
    assert torch.equal(host.index_select(0, within), permuted.cpu().index_select(0, positions))
    copies.release()
    planes = torch.randn(2, 64, 16, 8, 64, device="cuda").to(torch.bfloat16)  # K and V planes outside the pages
    assert StepCopies(staged.device).block(planes, 1, positions) is None


def test_a_span_and_copies_issued_ahead_are_taken_by_the_capture_that_follows_not_copied_again():
    """The graph capture thread issues a staged step's copies for every layer before planning any: the plan's
    block within that span and its copies of the query and output rows take what was issued."""
    from kvdbg.capture.buffers import HostBuffers, StepCopies

    staged = torch.randn(64, 16, 2, 8, 64, device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3, 4)
    query = torch.randn(32, 4, 64, device="cuda").to(torch.bfloat16)
    copies = StepCopies(staged.device, HostBuffers())
    assert copies.span_ahead(staged, 0, 0, 50)
    pooled = list(copies.pooled)
    early_query = copies.ahead(query)
    positions = torch.tensor([40, 3, 17, 3, 49])
    host, within = copies.block(staged, 0, positions)
    rows = copies.copy(early_query[:20])
    assert len(copies.pooled) == len(pooled) and all(a is b for a, b in zip(copies.pooled, pooled))  # no new copy
    assert rows.data_ptr() == early_query.data_ptr() and rows.shape[0] == 20
    assert host.shape[0] == 50 and within.tolist() == positions.tolist()
    beyond = copies.block(staged, 0, torch.tensor([3, 60]))  # outside the span: a copy of its own
    assert beyond is not None and beyond[0].shape[0] == 58
    copies.close()
    copies.wait()
    assert torch.equal(host.index_select(0, within), staged.cpu().index_select(0, positions))
    assert torch.equal(rows, query[:20].cpu())
    copies.release()
    discarded = StepCopies(staged.device, HostBuffers())
    assert discarded.span_ahead(staged, 0, 0, 10) and discarded.pooled
    discarded.discard()
    assert not discarded.pooled and discarded.block(staged, 0, torch.tensor([1]))[0].shape[0] == 1


def test_staging_recorded_into_a_graph_is_ordered_for_another_thread_by_the_graphs_own_event():
    """The program vLLM's staged graph runs (InGraphProgram), recorded after a slow kernel that stands for the
    model's forward: after a replay the recording thread makes no call, and a reader thread whose stream waits on
    the program's event (an external one, recorded by the graph) reads this replay's staging, never the last one's;
    each request's pages are worked out on the device from the lengths the graph read."""
    import threading

    from kvdbg.vllm_plugin.graph_staging import InGraphProgram

    layers = _layers()
    table = torch.randint(1, 40, (8, 24), dtype=torch.int32, device="cuda")  # the runner's buffers
    seq_lens = torch.zeros(8, dtype=torch.int32, device="cuda")
    offsets = torch.arange(9, dtype=torch.int32, device="cuda")
    hint = StageHint(table[:4], 3, None, 400, seq_lens[:4], offsets[:5], 4)
    program = InGraphProgram(table.device, hint, layers, 256, InGraphProgram.rows_for(hint), 16)
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(100_000_000)  # tens of milliseconds: the reader, unordered, would read first
        program.graph_body(12)
    for lengths in ([300, 77, 150], [17, 250, 33]):
        seq_lens[:3] = torch.tensor(lengths, dtype=torch.int32)
        table.random_(1, 40)
        for _, cache, _, query, _ in layers:
            cache.add_(1)
            query.add_(1)
        torch.cuda.synchronize()
        count = sum(-(-n // 16) for n in lengths)
        ids = torch.cat([table[r, : -(-n // 16)] for r, n in enumerate(lengths)]).long()
        expected = [(cache.index_select(dim, ids).cpu(), query[:12].cpu()) for _, cache, dim, query, _ in layers]
        graph.replay()
        step = program.staged_step(12, hint, program.serves(hint) == 2)
        read: dict = {}

        def reader():
            stream = torch.cuda.Stream()
            stream.wait_event(step.ready)
            with torch.cuda.stream(stream):
                read["ids"] = program.ids[:count].cpu()
                read["pages"] = [(step.layers[name].pages.narrow(1, 0, count).cpu(), step.layers[name].query.cpu())
                                 for name, *_ in layers]

        thread = threading.Thread(target=reader)
        thread.start()
        thread.join(30)
        assert read["ids"].long().tolist() == ids.cpu().tolist()
        for (pages, query), (want_pages, want_query) in zip(read["pages"], expected):
            torch.testing.assert_close(pages, want_pages, rtol=0, atol=0)
            torch.testing.assert_close(query, want_query, rtol=0, atol=0)
        assert step.sized() == count and step.counts.tolist() == [-(-n // 16) for n in lengths]
        # Held by a reader until its reads are done on the device; let go by the reader, not asked by the engine.
        step.hold()
        assert not program.reusable()
        step.release()  # pending until its reads are done on the device, asked by the capture thread
        program.poll_released(wait=True)
        assert program.reusable() and not program._pending
