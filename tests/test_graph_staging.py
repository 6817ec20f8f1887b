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
