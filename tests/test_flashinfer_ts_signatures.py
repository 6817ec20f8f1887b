"""The arguments FLASHINFER_TS passes bind to the installed flashinfer's real wrapper signatures.

Installs nothing: skipped unless flashinfer imports (it does on a CPU machine;
only its kernels need a Blackwell GPU). The backend runs through a recording
double standing in for ``BatchDecodePagedTSWrapper`` of the installed version,
then every recorded ``__init__``/``plan``/``run`` call is bound with
``inspect.signature(...).bind`` against the real class: a renamed or missing
keyword raises TypeError here, as it would on the GPU.
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

prims_ts = pytest.importorskip("flashinfer.attention.prims_ts")

import flashinfer  # noqa: E402

from kvdbg.backends.base import ReplayOptions  # noqa: E402
from kvdbg.backends import flashinfer_ts as ts  # noqa: E402
from kvdbg.backends.flashinfer_ts import gate as ts_gate  # noqa: E402
from kvdbg.snapshot.cache import working_cache  # noqa: E402
from kvdbg.replayer.runner import common_metadata  # noqa: E402
from kvdbg.moves.synth import SynthSpec, synth_snapshot  # noqa: E402

CASES = {
    "causal_q1": dict(seq_lens=(40, 77), causal=True),
    "dense_block": dict(seq_lens=(40, 77), causal=False, query_len=4),
    "dense_window": dict(seq_lens=(300, 77), causal=False, query_len=4, sliding_window=64),
    "causal_window": dict(seq_lens=(30, 50), causal=True, query_len=2, sliding_window=64),
    "fp8": dict(seq_lens=(40, 77), fp8=True, query_len=2, causal=False),
}


def _recorded_calls(monkeypatch, spec_kwargs):
    calls = []

    def make(**init_kwargs):
        calls.append(("__init__", init_kwargs))

        def plan(*args, **kwargs):
            assert not args, "FLASHINFER_TS passes plan() keywords only"
            calls.append(("plan", kwargs))

        def run(*args, **kwargs):
            assert not args, "FLASHINFER_TS passes run() keywords only"
            calls.append(("run", kwargs))
            kwargs["out"].zero_()
            return kwargs["out"]

        return types.SimpleNamespace(plan=plan, run=run)

    monkeypatch.setattr(ts_gate, "_import_prims_ts", lambda: (make, flashinfer.__version__))
    monkeypatch.setattr(ts_gate, "_probe_device", lambda device: ((10, 0), None))
    gate = ts.kernel_gate("cuda")
    assert gate.available, gate.reason
    snap = synth_snapshot(SynthSpec(num_heads=4, num_kv_heads=2, head_size=64, page_size=16, **spec_kwargs))
    inst = ts.create(snap.meta, ReplayOptions(), gate=gate)
    md = inst.builder.build(common_metadata(snap, 0))
    query = snap.steps[0].query
    out = torch.zeros((query.shape[0], 4, 64), dtype=inst.output_dtype)
    inst.impl.forward(query, working_cache(snap), md, out)
    return gate, calls


@pytest.mark.parametrize("case", sorted(CASES))
def test_recorded_calls_bind_to_the_installed_wrapper(monkeypatch, case):
    gate, calls = _recorded_calls(monkeypatch, CASES[case])
    assert [name for name, _ in calls] == ["__init__", "plan", "run"]
    wrapper = prims_ts.BatchDecodePagedTSWrapper
    for name, kwargs in calls:
        signature = inspect.signature(getattr(wrapper, name))
        bound = signature.bind(object(), **kwargs)  # raises TypeError on any keyword this release lacks
        assert set(kwargs) <= set(bound.arguments)
    print(f"flashinfer {flashinfer.__version__}: {gate.path}; {case}: __init__/plan/run bind")
