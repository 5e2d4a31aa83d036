"""The full-context cost tool's reading of a profiled round (engines/profiling/full_context_cost.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engines.profiling.full_context_cost import _kernel_span


def _event(device: bool, start_us: float, end_us: float) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(device_type=kind, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_busy_sums_the_gpus_work_and_the_span_shows_its_waits():
    prof = SimpleNamespace(events=lambda: [_event(True, 1000, 2000), _event(False, 0, 9000),  # host time ignored
                                           _event(True, 4000, 6000)])
    assert _kernel_span(prof) == (3.0, 5.0)  # 1 + 2 ms of kernels from 1 ms to 6 ms: 2 ms waiting


def test_a_round_without_gpu_work_is_empty():
    assert _kernel_span(SimpleNamespace(events=lambda: [_event(False, 0, 5)])) == (0.0, 0.0)
