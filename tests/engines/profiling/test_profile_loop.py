"""The profilers' reading of a profile's device activity (engines/profiling/profile_loop.py `gpu_busy`, which
profile_loop and full_context_cost print)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engines.profiling.profile_loop import gpu_busy


def _event(device: bool, start_us: float, end_us: float) -> SimpleNamespace:
    kind = torch.autograd.DeviceType.CUDA if device else torch.autograd.DeviceType.CPU
    return SimpleNamespace(device_type=kind, time_range=SimpleNamespace(start=start_us, end=end_us))


def test_busy_is_the_time_the_gpu_works_and_the_span_shows_its_waits():
    prof = SimpleNamespace(events=lambda: [_event(True, 1000, 2000), _event(False, 0, 9000),  # host time ignored
                                           _event(True, 4000, 6000)])
    assert gpu_busy(prof) == (3.0, 5.0, 1)  # 1 + 2 ms of kernels from 1 ms to 6 ms: 2 ms waiting, one gap


def test_work_on_two_streams_at_once_counts_once():
    prof = SimpleNamespace(events=lambda: [_event(True, 0, 3000), _event(True, 1000, 2000), _event(True, 2500, 4000)])
    assert gpu_busy(prof) == (4.0, 4.0, 0)


def test_a_profile_without_gpu_work_is_empty():
    assert gpu_busy(SimpleNamespace(events=lambda: [_event(False, 0, 5)])) == (0.0, 0.0, 0)
