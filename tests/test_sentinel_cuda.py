"""The sentinel's device path: checks run in a worker on a side stream, collected later; same verdicts as on CPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.utils._pytree
import torch.utils._python_dispatch

from kvdbg.sentinel.checker import DeferredChecks, Sentinel, check_step
from kvdbg.sentinel.config import SentinelConfig
from tests.test_sentinel import ALL_PAIRS, CPU_ATTN, HQ, D, _layer, make_step

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def on_device(inputs):
    return dataclasses.replace(inputs, **{name: getattr(inputs, name).cuda()
                                          for name in ("query", "kv_cache", "block_table", "seq_lens",
                                                       "query_start_loc", "output")})


@pytest.mark.parametrize("kw", [{}, {"kv_layout": CPU_ATTN}, {"kv_cache_dtype": "fp8", "k_scale": 0.05,
                                                                "v_scale": 0.02, "dtype": "float16"},
                                {"sinks": [0.5, -1.0, 2.0, 0.0], "sliding_window": 6}],
                         ids=["bf16", "cpu_attn_layout", "fp8", "sinks_window"])
def test_device_checks_agree_with_host_checks(kw):
    layer = _layer(**kw)
    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, pairs=len(ALL_PAIRS), seed=0))
    deferred = DeferredChecks(sentinel, torch.device("cuda"), process=False)
    honest = make_step(layer, fp8=layer.kv_cache_dtype.startswith("fp8"))
    wrong = make_step(layer, fp8=layer.kv_cache_dtype.startswith("fp8"))
    wrong.output.view(-1, HQ, D)[1:5, 3] += 1.0
    for step, inputs in enumerate((honest, wrong)):
        host = check_step(layer, inputs, pairs=ALL_PAIRS, step=step)
        deferred.submit(layer, on_device(inputs), step)
        job = deferred.collect(layer.name, timeout=60)
        assert job is not None and job.error is None, job.error
        device = job.result
        assert [(p.request, p.head, p.passed) for p in device.pairs] == \
            [(p.request, p.head, p.passed) for p in host.pairs]
        assert device.passed == host.passed == (step == 0)


def test_the_engine_stream_does_not_wait_for_the_check():
    layer = _layer()
    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, seed=0))
    deferred = DeferredChecks(sentinel, torch.device("cuda"), process=False)
    inputs = on_device(make_step(layer))
    # Once before, untimed: CUDA loads a kernel on its first launch, and that load waits for the device.
    deferred.submit(layer, inputs, 0)
    assert deferred.collect(layer.name, timeout=120).result.passed
    # A long kernel on the engine's stream: submit must return before it ends (no host sync in submit).
    big = torch.randn(8192, 8192, device="cuda")
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        big = big @ big / 8192
    kept = deferred.submit(layer, inputs, 1)
    submitted_before_end = not torch.cuda.current_stream().query()
    job = deferred.collect(layer.name, timeout=120)
    assert submitted_before_end and job.result.passed
    # The copies the worker checks were taken on the engine's stream, after what it had queued.
    # Byte for byte (the output's padding rows hold NaN, which never equals itself).
    assert torch.equal(kept.output.cpu().view(torch.int16), inputs.output.cpu().view(torch.int16))


@pytest.mark.parametrize("kw", [{}, {"kv_cache_dtype": "fp8", "k_scale": 0.05, "v_scale": 0.02, "dtype": "float16"},
                                {"sinks": [0.5, -1.0, 2.0, 0.0]}], ids=["bf16", "fp8", "sinks"])
def test_a_staged_steps_layers_are_one_job_with_each_layers_own_verdict(kw):
    from tests.test_sentinel import _one_step_of_layers

    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, pairs=len(ALL_PAIRS), seed=0))
    deferred = DeferredChecks(sentinel, torch.device("cuda"), process=False)
    entries = _one_step_of_layers(3, **kw)
    entries[2][1].output.view(-1, HQ, D)[1:5, 1] += 1.0  # layer 2 only: request 1, head 1
    host = [check_step(layer, inputs, pairs=ALL_PAIRS, step=6) for layer, inputs in entries]
    shared = on_device(entries[0][1])
    on_gpu = [(layer, dataclasses.replace(on_device(inputs), block_table=shared.block_table,
                                          seq_lens=shared.seq_lens, query_start_loc=shared.query_start_loc))
              for layer, inputs in entries]
    ready = torch.cuda.Event()
    ready.record()
    job = deferred.submit_staged(on_gpu, 6, ready)
    assert job.done.wait(120) and job.error is None, job.error
    assert [r.layer for r in job.results] == [layer.name for layer, _ in entries]
    for device, alone in zip(job.results, host):
        assert [(p.request, p.head, p.passed) for p in device.pairs] == \
            [(p.request, p.head, p.passed) for p in alone.pairs]
    assert [r.passed for r in job.results] == [True, True, False]
    assert [(p.request, p.head) for p in job.results[2].failed_pairs] == [(1, 1)]


class _DeviceCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch calls with a CUDA tensor among their arguments or a CUDA device asked for: kernels and
    copies, and views too (no device work, but as many either way); not stream waits."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.is_cuda for t in flat) or \
                str((kwargs or {}).get("device", "")).startswith("cuda"):
            self.count += 1
        return func(*args, **(kwargs or {}))


_FP8 = {"kv_cache_dtype": "fp8", "k_scale": 0.05, "v_scale": 0.02, "dtype": "float16"}


@pytest.mark.parametrize("kw", [{}, _FP8, {**_FP8, "fp8_query": True}, {"sinks": [0.5, -1.0, 2.0, 0.0],
                                                                      "sliding_window": 6}],
                         ids=["bf16", "fp8", "fp8_query", "sinks"])
@pytest.mark.parametrize("stacked", [False, True], ids=["apart", "stacked"])
def test_a_reference_worked_out_on_the_host_finds_what_the_device_finds_with_few_device_calls(kw, stacked,
                                                                                                 monkeypatch):
    # The checker process works a CUDA step's reference out on the host (KVDBG_SENTINEL_REFERENCE=host): the device
    # only picks the sampled pairs' rows and pages and checks every output row for non-finite values. The verdicts,
    # the pairs and their differences are the device's, and the device sees a fraction of the calls.
    import random

    from kvdbg.backends.reference import ReferenceImpl
    from kvdbg.sentinel.checker import check_layers
    from tests.test_sentinel import _one_step_of_layers, _stacked

    kw = dict(kw)
    fp8_query = kw.pop("fp8_query", False)
    entries = _one_step_of_layers(3, **kw)
    if fp8_query:  # the engine quantised the query too: the tolerance grows with the values the pairs read
        entries = [(layer, dataclasses.replace(inputs, query=inputs.query.to(torch.float8_e4m3fn)))
                   for layer, inputs in entries]
    entries[1][1].output.view(-1, HQ, D)[1:5, 2] += 0.5  # layer 1: request 1, head 2
    entries[2][1].output.view(-1, HQ, D)[5, 3] = float("nan")  # layer 2: request 2's token, head 3
    if stacked:
        host = _stacked(entries)
        stack = host[0][1].stack[0]
        gpu = type(stack)(pages=stack.pages.cuda(), query=stack.query.cuda(), output=stack.output.cuda())
        entries = [(layer, dataclasses.replace(on_device(inputs), kv_cache=gpu.pages[at], query=gpu.query[at],
                                               output=gpu.output[at], stack=(gpu, at)))
                   for layer, inputs in host for at in [inputs.stack[1]]]
    else:
        entries = [(layer, on_device(inputs)) for layer, inputs in entries]
    seen = []
    forward = ReferenceImpl.forward

    def recording(self, query, pages, *args, **kwargs):
        seen.append((query.device.type, pages.device.type))
        return forward(self, query, pages, *args, **kwargs)

    import kvdbg.sentinel.checker as checker

    results, calls, forwards = {}, {}, {}
    for where in (None, "cpu", "past the bound"):
        seen.clear()
        if where == "past the bound":  # a pick too large to copy: its reference stays on the device
            monkeypatch.setattr(checker, "HOST_REFERENCE_BYTES", 0)
        ReferenceImpl.forward = recording
        try:
            with _DeviceCalls() as counted:
                results[where] = check_layers(entries, pairs=ALL_PAIRS, rng=random.Random(5), step=4,
                                              reference_device=where and "cpu")
        finally:
            ReferenceImpl.forward = forward
        calls[where], forwards[where] = counted.count, len(seen)
        assert seen and all(s == (("cpu", "cpu") if where == "cpu" else ("cuda", "cuda")) for s in seen), seen
    device, host = results[None], results["cpu"]
    assert [(r.layer, r.passed, r.tolerance) for r in host] == [(r.layer, r.passed, r.tolerance) for r in device] \
        == [(r.layer, r.passed, r.tolerance) for r in results["past the bound"]]
    if fp8_query:
        assert host[0].tolerance != checker.default_tolerance(entries[0][0].dtype, fp8=True)  # the allowance
    assert [r.passed for r in host] == [True, False, False]
    assert (host[2].nonfinite.request, host[2].nonfinite.head) == (2, 3)
    assert [(p.request, p.head) for p in host[1].failed_pairs] == [(1, 2)]
    for a, b in zip(device, host):
        assert [(p.request, p.head, p.passed) for p in a.pairs] == [(p.request, p.head, p.passed) for p in b.pairs]
        for p, q in zip(a.pairs, b.pairs):
            if p.diff is not None:  # float32 on two machines: a few ulps of the values compared
                assert q.diff.max_abs == pytest.approx(p.diff.max_abs, rel=1e-4, abs=1e-4, nan_ok=True)
    # Fewer device calls than the reference on the device makes, and a bounded number each reference call (a layer
    # with per-head values, sinks, makes a reference call and a pick per head). Both run the failing pairs'
    # comparison on the host (compare() copies there first), so that part is in neither count.
    assert calls["cpu"] < calls[None] and calls["cpu"] < 120 * forwards["cpu"], (calls, forwards)


@pytest.mark.parametrize("reference", ["host", "device"])
def test_a_staged_step_is_checked_in_the_checker_process_on_buffers_it_shares_once(reference):
    # The engine's thread hands a staged step's check to kvdbg's checker process once its staging is done, and reads
    # the answer at a later poll; the process opens each of kvdbg's buffers once (CUDA IPC) and reads them in place: a
    # fault written into the same buffers after a first check is found by the second, with no buffer shared again.
    from tests.test_sentinel import _one_step_of_layers, _stacked

    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, pairs=len(ALL_PAIRS), seed=0,
                                       reference=reference))
    deferred = DeferredChecks(sentinel, torch.device("cuda"), process=True)
    assert deferred.process_ready(120), "the checker process did not start"
    assert deferred.remote._process.args[-1] == reference
    assert not DeferredChecks(sentinel, torch.device("cuda"), process=False).process_ready(0)
    entries = _stacked(_one_step_of_layers(3))
    stack = entries[0][1].stack[0]
    on_gpu_stack = type(stack)(pages=stack.pages.cuda(), query=stack.query.cuda(), output=stack.output.cuda())
    on_gpu = [(layer, dataclasses.replace(inputs, kv_cache=on_gpu_stack.pages[at], query=on_gpu_stack.query[at],
                                          output=on_gpu_stack.output[at], stack=(on_gpu_stack, at)))
              for (layer, inputs), (_, at) in zip(entries, [e[1].stack for e in entries])]
    results = []
    for step in (1, 2):
        if step == 2:  # the same buffers, now wrong in layer 1: request 1, head 2
            on_gpu_stack.output[1].view(-1, HQ, D)[1:5, 2] += 1.0
        ready = torch.cuda.Event()
        ready.record()
        job = deferred.submit_staged(on_gpu, step, ready)
        deferred.poll_remote(120)  # the engine's thread, waiting for it as the sentinel's close does
        assert job.done.is_set() and job.error is None, job.error
        results.append(job.results)
        if step == 1:
            shared = dict(deferred.remote._shared)
    assert len(shared) == 3 and deferred.remote._shared == shared  # the stack's three buffers, each shared once
    assert deferred.remote.templates == 1  # the layers' views went once; the second check sent its metadata alone
    host = check_step(entries[0][0], entries[0][1], pairs=ALL_PAIRS, step=1)
    assert [(p.request, p.head, p.passed) for p in results[0][0].pairs] == \
        [(p.request, p.head, p.passed) for p in host.pairs]
    assert all(r.passed for r in results[0])
    assert [r.passed for r in results[1]] == [True, False, True]
    assert [(p.request, p.head) for p in results[1][1].failed_pairs] == [(1, 2)]
    assert sentinel.staged_checks == {"process": 2}
    deferred.close()
    assert deferred.remote is None


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_a_staged_steps_metadata_goes_as_the_builds_host_copies_read_once_they_are_done(process):
    # A staged step's lengths and offsets are the build's host copies, issued on the engine's stream behind its work
    # (here a long one): the check reads them only once they are written. In the checker process each step's copies
    # travel by value, so only kvdbg's staging buffers are shared (once), and the layers are given once.
    from kvdbg.capture.buffers import HostCopiesReady
    from tests.test_sentinel import _one_step_of_layers, _stacked

    sentinel = Sentinel(SentinelConfig(directory="/tmp/unused", rate=1.0, pairs=len(ALL_PAIRS), seed=0))
    deferred = DeferredChecks(sentinel, torch.device("cuda"), process=process)
    assert deferred.process_ready(120) is process
    entries = _stacked(_one_step_of_layers(3))
    stack = entries[0][1].stack[0]
    on_gpu_stack = type(stack)(pages=stack.pages.cuda(), query=stack.query.cuda(), output=stack.output.cuda())
    on_gpu_stack.output[2].view(-1, HQ, D)[1:5, 1] += 1.0  # layer 2: request 1, head 1
    lengths, offsets = entries[0][1].seq_lens.cuda(), entries[0][1].query_start_loc.cuda()
    jobs = []
    for step in range(3):
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(20):  # the engine's stream busy for a while before the build's copies
            busy = busy @ busy / 64
        host = tuple(torch.zeros_like(t, device="cpu").pin_memory() for t in (lengths, offsets))
        host[0].copy_(lengths, non_blocking=True)
        host[1].copy_(offsets, non_blocking=True)
        copied = HostCopiesReady(torch.device("cuda"))
        ready = torch.cuda.Event()
        ready.record()
        step_entries = [(layer, dataclasses.replace(inputs, seq_lens=host[0], query_start_loc=host[1],
                                                    kv_cache=on_gpu_stack.pages[at], query=on_gpu_stack.query[at],
                                                    output=on_gpu_stack.output[at], stack=(on_gpu_stack, at)))
                        for (layer, inputs), (_, at) in zip(entries, [e[1].stack for e in entries])]
        jobs.append(deferred.submit_staged(step_entries, step, ready, host_ready=[copied]))
    deferred.poll_remote(120)
    for job in jobs:
        assert job.done.wait(120) and job.error is None, job.error
        assert [r.passed for r in job.results] == [True, True, False]
        assert [(p.request, p.head) for p in job.results[2].failed_pairs] == [(1, 1)]
    if process:
        assert deferred.remote.shares == 3 and deferred.remote.defines == 3  # the stack's buffers; the layers
    assert sentinel.staged_checks == {("process" if process else "thread"): 3}
    deferred.close()
