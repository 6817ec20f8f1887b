"""Staging a replayed graph's step, on the host (the program's CPU path): which program serves a step."""

from __future__ import annotations

import torch

from kvdbg.vllm_plugin.graph_staging import GraphStager, StageHint


def _layer(name, cache, query, output):
    return (name, cache, 0, query, output)


def test_a_layer_given_new_copy_buffers_by_a_later_recording_gets_a_program_that_reads_them():
    """A program copies a layer's query and output from the buffers the graph copies them into; a graph recorded
    later may give the layer larger ones, so the same layers and caches with other buffers are another program,
    never the one still reading the old buffers."""
    torch.manual_seed(0)
    cache = torch.randn(40, 2, 16, 2, 8)
    table = torch.randint(1, 40, (8, 24), dtype=torch.int32)
    hint = StageHint(table[:3], 3, None, 150)
    old_query, old_output = torch.randn(16, 4, 8), torch.randn(16, 32)
    stager = GraphStager()
    first = stager.stage([_layer("l0", cache, old_query, old_output)], hint, 16, 12)
    torch.testing.assert_close(first.layers["l0"].query, old_query[:12], rtol=0, atol=0)

    new_query, new_output = torch.randn(32, 4, 8), torch.randn(32, 32)  # the later recording's, larger
    second = stager.stage([_layer("l0", cache, new_query, new_output)], hint, 16, 12)
    assert second.program is not first.program
    torch.testing.assert_close(second.layers["l0"].query, new_query[:12], rtol=0, atol=0)
    torch.testing.assert_close(second.layers["l0"].output, new_output[:12], rtol=0, atol=0)

    same = [_layer("l0", cache, new_query, new_output)]  # the same buffers again, in a list of its own
    assert stager.stage(same, hint, 16, 12).program is second.program
    assert stager.stage(same, hint, 16, 12).program is second.program  # and that list kept


def _runner(rows=8, width=24, pages=40):
    """A runner's persistent buffers (block table, lengths, offsets) with a batch of three requests in them."""
    table = torch.randint(1, pages, (rows, width), dtype=torch.int32)
    seq_lens = torch.zeros(rows, dtype=torch.int32)
    seq_lens[:3] = torch.tensor([150, 40, 90], dtype=torch.int32)
    offsets = torch.zeros(rows + 1, dtype=torch.int32)
    offsets[1:4] = torch.tensor([4, 8, 12], dtype=torch.int32)
    offsets[4:] = 12
    return table, seq_lens, offsets


def _hint(table, seq_lens, offsets, n=3, rows=4):
    return StageHint(table[:n], n, None, 150, seq_lens[:n], offsets[:n + 1], rows)


def test_a_step_s_metadata_is_staged_as_the_graph_read_it_whatever_the_runner_writes_next():
    """The program copies the runner's block table, lengths and offsets after the replay: what the capture thread
    reads later is the step's, not the next step's; the block table keeps the build's columns."""
    torch.manual_seed(1)
    cache = torch.randn(40, 2, 16, 2, 8)
    table, seq_lens, offsets = _runner()
    step_table, step_lens, step_offsets = table[:3, :20].clone(), seq_lens[:3].clone(), offsets[:4].clone()
    stager = GraphStager()
    hint = StageHint(table[:3, :20], 3, None, 150, seq_lens[:3], offsets[:4], 4)
    staged = stager.stage([_layer("l0", cache, torch.randn(16, 4, 8), None)], hint, 16, 12)
    assert staged.with_metadata
    table.random_(1, 40)  # the runner's next step
    seq_lens.fill_(7)
    offsets.fill_(2)
    bt, sl, qsl = staged.metadata()
    assert bt.shape == (3, 20) and bt.dtype == torch.int32
    torch.testing.assert_close(bt, step_table, rtol=0, atol=0)
    assert sl.tolist() == step_lens.tolist() and qsl.tolist() == step_offsets.tolist()


def test_a_build_whose_lengths_lie_elsewhere_is_staged_without_its_metadata():
    """A program reads the buffers it was made for; a build that hands other ones (a runner that keeps none) is
    staged without metadata (its build's own copies are read), never with another step's."""
    cache = torch.randn(40, 2, 16, 2, 8)
    table, seq_lens, offsets = _runner()
    layers = [_layer("l0", cache, torch.randn(16, 4, 8), None)]
    stager = GraphStager()
    first = stager.stage(layers, _hint(table, seq_lens, offsets), 16, 12)
    assert first.with_metadata
    other = stager.stage(layers, _hint(table, seq_lens.clone(), offsets.clone()), 16, 12)
    assert other.program is first.program and not other.with_metadata and other.metadata() is None
    bare = stager.stage(layers, StageHint(table[:3], 3, None, 150), 16, 12)
    assert not bare.with_metadata and bare.metadata() is None


def test_stale_ids_outside_the_cache_are_clamped_never_indexed():
    """Entries past a request's pages hold whatever the runner left: the program reads pages only inside the cache."""
    cache = torch.randn(40, 2, 16, 2, 8)
    table, seq_lens, offsets = _runner()
    table[0, 5:] = 10**6
    table[1, 2:] = -5
    staged = GraphStager().stage([_layer("l0", cache, torch.randn(16, 4, 8), None)],
                                 _hint(table, seq_lens, offsets), 16, 12)
    ids = staged.program.ids[: staged.count]
    assert int(ids.min()) >= 0 and int(ids.max()) <= 39


def test_a_program_s_positions_are_rewritten_only_once_its_last_run_is_done():
    """The positions go to the device from the program's own page-locked buffer: a run whose copy the device may not
    have made yet (no reader waited for it, its event not passed) keeps the program from the next step, which then
    gets a program of its own; each run's pages are its own."""
    torch.manual_seed(2)
    cache = torch.randn(40, 2, 16, 2, 8)
    table, seq_lens, offsets = _runner()
    layers = [_layer("l0", cache, torch.randn(16, 4, 8), None)]
    stager = GraphStager()
    first = stager.stage(layers, _hint(table, seq_lens, offsets), 16, 12)
    program = first.program

    class Pending:  # the run's event, not yet passed on the device
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    program.ready = event = Pending()
    assert not program.reusable()
    second = stager.stage(layers, _hint(table, seq_lens, offsets), 16, 12)
    assert second.program is not program
    event.done = True
    assert program.reusable()  # its event passed: asked once, then known
    event.done = False
    assert program.reusable()
    program.runs += 1  # another run, which a reader waits for
    assert not program.reusable()
    first.run = program.runs
    first.unique_ids()
    assert program.reusable()
    for staged in (first, second):  # every run staged the step's pages (block-table positions of its rows)
        ids, _ = staged.unique_ids()
        expected = {int(p) for r, n in enumerate([150, 40, 90]) for p in table[r, :-(-150 // 16)]}
        assert set(ids.tolist()) == expected


def test_graphs_of_other_batch_sizes_share_a_program_that_copies_every_graphs_rows():
    """A program copies the metadata of up to ``meta_rows`` rows (the largest graph's batch), so steps of graphs of
    other sizes share it rather than each making (and recording) programs of their own."""
    cache = torch.randn(40, 2, 16, 2, 8)
    table, seq_lens, offsets = _runner()
    layers = [_layer("l0", cache, torch.randn(16, 4, 8), None)]
    stager = GraphStager()
    small = stager.stage(layers, _hint(table, seq_lens, offsets, rows=4), 16, 12, meta_rows=8)
    large = stager.stage(layers, _hint(table, seq_lens, offsets, rows=8), 16, 12, meta_rows=8)
    assert large.program is small.program and small.with_metadata and large.with_metadata
    assert small.program.metadata[1].numel() == 8  # the lengths of every graph's rows


def test_whether_a_program_is_likely_free_for_the_next_step():
    """A build leaves its metadata to the program only when the size staged last has a program free or room for
    one more: with both held by readers, it copies as ever."""
    cache = torch.randn(40, 2, 16, 2, 8)
    table, seq_lens, offsets = _runner()
    layers = [_layer("l0", cache, torch.randn(16, 4, 8), None)]
    stager = GraphStager()
    assert stager.likely_free()
    first = stager.stage(layers, _hint(table, seq_lens, offsets), 16, 12).hold()
    assert stager.likely_free()  # room for a second program
    second = stager.stage(layers, _hint(table, seq_lens, offsets), 16, 12).hold()
    assert not stager.likely_free()
    first.release()
    assert stager.likely_free()
    second.release()


def test_the_program_lays_each_requests_pages_out_after_the_last_and_reads_the_first_entry_past_them():
    """The host hands the program only each request's number of pages (from its bound on the lengths); the
    program works out where each staged page is read in the block table: requests one after another, a request of
    no pages taking no place, a row's entries in order, the positions past the step's pages reading entry 0."""
    cache = torch.randn(40, 2, 16, 2, 8)
    table = torch.arange(1, 8 * 24 + 1, dtype=torch.int32).view(8, 24) % 40
    bound = torch.tensor([20, 0, 40, 1, 16], dtype=torch.int32)  # pages of 16: 2, 0, 3, 1, 1
    hint = StageHint(table[:5], 5, bound, 40)
    staged = GraphStager().stage([_layer("l0", cache, torch.randn(16, 4, 8), None)], hint, 16, 12)
    expected = [table[0, 0], table[0, 1], table[2, 0], table[2, 1], table[2, 2], table[3, 0], table[4, 0]]
    assert staged.count == 7 and staged.counts.tolist() == [2, 0, 3, 1, 1]
    program = staged.program
    assert program.ids[:7].tolist() == [int(t) for t in expected]
    assert set(program.ids[7:].tolist()) == {int(table[0, 0])}  # past the step's pages: entry 0 again
    assert staged.row_starts.tolist() == [0, 2, 2, 5, 6]
    torch.testing.assert_close(staged.pages_for("l0").pages[:7], cache.index_select(0, program.ids[:7].long()),
                               rtol=0, atol=0)
    # A later step of fewer requests run by the same program: the rows past it count no pages.
    again, layers = GraphStager(), [_layer("l0", cache, torch.randn(16, 4, 8), None)]
    first = again.stage(layers, StageHint(table[:5], 5, bound, 40, None, None, 5), 16, 12)
    fewer = again.stage(layers, StageHint(table[:5], 2, bound, 40, None, None, 5), 16, 12)
    assert fewer.program is first.program and fewer.count == 2
    assert fewer.program.ids.tolist() == [int(table[0, 0]), int(table[0, 1])] + [int(table[0, 0])] * 62


def test_copies_issued_ahead_are_all_given_back_when_a_layers_cannot_be_and_a_failure_falls_back_in_words(
        monkeypatch):
    """The graph capture thread's burst of copies: a layer whose pages cannot go in one copy (or a copy that
    raises) leaves nothing issued behind (each StepCopies made is discarded) and the step's layers are then read
    one by one; a raise is said once, never lost with the staged buffers still held."""
    from types import SimpleNamespace

    from kvdbg.capture import buffers
    from kvdbg.vllm_plugin.graph_hooks import GraphHooks

    made = []

    class Copies:
        def __init__(self, device, pool):
            self.discarded = False
            made.append(self)

        def span_ahead(self, pages, dim, lo, hi):
            if len(made) == 3:
                raise RuntimeError("pinned memory exhausted (a stand-in failure)")
            return len(made) < 2 or mode == "all"

        def ahead(self, t):
            return t

        def discard(self):
            self.discarded = True

    monkeypatch.setattr(buffers, "StepCopies", Copies)
    layer = SimpleNamespace(pages=torch.zeros(8, 2, 4), page_dim=0, query=torch.zeros(4, 2), output=None)
    staged = SimpleNamespace(layers={"a": layer, "b": layer, "c": layer}, count=8, sized=lambda: 8)
    job = SimpleNamespace(staged=staged, device="cpu",
                          items=[(SimpleNamespace(name=n), 0, None) for n in ("a", "b", "c")])
    notes = []
    capturer = SimpleNamespace(queue_would_take=lambda n: True, host_buffers=None,
                               _note_once=lambda key, text: notes.append(text))
    state = SimpleNamespace(capturer=capturer)
    state._copies_ahead = lambda j: GraphHooks._copies_ahead(state, j)

    mode = "second refuses"
    assert GraphHooks._issue_ahead(state, job) == {}
    assert len(made) == 2 and all(c.discarded for c in made)  # the first layer's burst given back too
    made.clear()
    mode = "all"
    assert GraphHooks._issue_ahead(state, job) == {}  # the third layer's copy raises
    assert len(made) == 3 and all(c.discarded for c in made)
    assert len(notes) == 1 and "copied one by one" in notes[0] and "stand-in failure" in notes[0]
    made.clear()
    capturer.queue_would_take = lambda n: False  # over the writer's queue: nothing issued at all
    assert GraphHooks._issue_ahead(state, job) == {} and not made


def test_alike_layers_are_staged_into_one_stack_and_unlike_ones_each_into_its_own():
    """Layers of one cache shape, type and paging and of one query and output shape get one buffer per kind, a layer
    per index: each layer's staged copies are that stack's, equal to what it stages alone, laid out as its cache."""
    torch.manual_seed(2)
    table, seq_lens, offsets = _runner()
    caches = [torch.randn(40, 2, 16, 2, 8) for _ in range(3)]
    queries, outputs = [torch.randn(16, 4, 8) for _ in range(3)], [torch.randn(16, 32) for _ in range(3)]
    layers = [_layer(f"l{i}", caches[i], queries[i], outputs[i]) for i in range(3)]
    staged = GraphStager().stage(layers, _hint(table, seq_lens, offsets), 16, 12)
    stack = staged.program.stack
    assert stack is not None and stack.pages.shape[0] == stack.query.shape[0] == stack.output.shape[0] == 3
    for i in range(3):
        copies = staged.layers[f"l{i}"]
        assert copies.stack[0] is stack and copies.stack[1] == i
        assert copies.pages.data_ptr() == stack.pages[i].data_ptr()
        assert copies.query.data_ptr() == stack.query[i].data_ptr()
        alone = GraphStager().stage([layers[i]], _hint(table, seq_lens, offsets), 16, 12)
        assert alone.program.stack is None and alone.layers[f"l{i}"].stack is None
        assert copies.pages.stride() == alone.layers[f"l{i}"].pages.stride()  # laid out as the layer's own would be
        count = staged.sized()
        torch.testing.assert_close(copies.pages[:count], alone.layers[f"l{i}"].pages[:count], rtol=0, atol=0)
        torch.testing.assert_close(copies.query, queries[i][:12], rtol=0, atol=0)
        torch.testing.assert_close(copies.output, outputs[i][:12], rtol=0, atol=0)
    permuted = [_layer(f"p{i}", torch.randn(40, 16, 2, 2, 8).transpose(1, 2), queries[i], outputs[i]) for i in range(2)]
    stacked = GraphStager().stage(permuted, _hint(table, seq_lens, offsets), 16, 12)  # a cache stored heads inside
    alone = GraphStager().stage(permuted[:1], _hint(table, seq_lens, offsets), 16, 12)
    assert stacked.program.stack is not None
    assert stacked.layers["p0"].pages.stride() == alone.layers["p0"].pages.stride() != \
        stacked.program.stack.pages[0].contiguous().stride()
    unlike = layers[:2] + [_layer("l2", torch.randn(40, 4, 16, 2, 8), queries[2], outputs[2])]  # more KV heads
    mixed = GraphStager().stage(unlike, _hint(table, seq_lens, offsets), 16, 12)
    assert mixed.program.stack is None and all(copies.stack is None for copies in mixed.layers.values())
