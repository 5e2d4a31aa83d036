"""Measured ceilings of the machine a benchmark runs on: memory bandwidth and matmul rate."""

from __future__ import annotations

import platform
import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int, warmup: int = 2) -> list[float]:
    """Wall seconds of each call after warm-up, synchronised around each call."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def cpu_model() -> str:
    """The CPU's marketing name where Linux says it (platform.processor() is often just the ISA)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({cpu_model()}, {torch.get_num_threads()} threads)"


def measure_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = median(timed(lambda: dst.copy_(src), device, repeats=10))
    return 2 * nbytes / t


def measure_matmul(device: torch.device, n: int, dtype: torch.dtype) -> float:
    """FLOP/s of an n x n x n matmul on random data."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = median(timed(lambda: a @ b, device, repeats=10))
    return 2 * n**3 / t


def replay_ms(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """ms per replay of a captured CUDA graph: one replay to warm, then `reps` back to back between two events."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def graphed_us(step, calls: int, reps: int) -> float:
    """us per call of `step` (`calls` launches, no host syncs), run once eagerly (compiles, warm-up), then captured as
    one CUDA graph and replayed `reps` times."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return replay_ms(graph, reps) * 1e3 / calls
