"""placeholder"""
from __future__ import annotations


def peak_alloc_bytes(fn) -> int:
    """Peak bytes of tensors allocated (and not yet freed) while `fn()` runs, on CPU: torch's
    profiler records each op's own allocations and frees; summed in time order they give the live
    total at op granularity (tensors that exist before the call are not counted)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for ev in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += ev.self_cpu_memory_usage
        peak = max(peak, live)
    return peak
