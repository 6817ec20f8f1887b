"""What the CUDA benches share: the sleep kernel's clock, to queue a known amount of device work."""

from __future__ import annotations


def cycles_per_us() -> float:
    """The sleep kernel's clock, measured: cycles per microsecond."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    end.synchronize()
    return 50_000_000 / (start.elapsed_time(end) * 1e3)
