"""Programmatic dependent launch (PDL) for the Triton kernels of a step (Hopper and later).

A decode step at batch 1 is ~400 kernels of 1-60 us each, back to back in a CUDA graph; each boundary costs the
next kernel's launch while the GPU drains the previous kernel's tail. With PDL a kernel is launched while its
predecessor still runs and waits in `griddepcontrol.wait` until the predecessor has completed and its writes are
visible, so the launch and the programs' start-up overlap the predecessor's tail. (Reading weights early, into L2
before or after the wait - each GEMM its own first bytes, the attention kernel o_proj's weight - or o_proj's first
tiles into registers before the wait, measured slower.)

The rules every kernel here keeps (in `wait_then_trigger` / `trigger_then_wait`):
- Every program executes the wait, unconditionally, before it reads anything an earlier kernel wrote and before it
  writes anything: a kernel completes only after its own wait returned, so "my predecessor completed" implies
  "everything before it completed" along the whole chain.
- A kernel that streams weights or attends triggers its dependents only after its wait, so no more than two
  kernels ahead are launched and waiting. Tiny elementwise kernels trigger first, so the GEMM after them is
  launched during the tail of the GEMM before them.

Before Hopper the kernels launch as usual (the wait and trigger compile to nothing without the PDL constexpr).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# device index -> whether its launches use PDL (decided at the first launch; tests may set it)
_enabled: dict[int, bool] = {}


def enabled(device: torch.device) -> bool:
    """PDL for kernels launched on this device: Hopper or later."""
    if device.type != "cuda":
        return False
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _enabled:
        _enabled[idx] = torch.cuda.get_device_capability(idx)[0] >= 9
    return _enabled[idx]


def launch_kwargs(device: torch.device, allowed: bool = True) -> dict:
    """Keyword arguments of a kernel launch: the PDL constexpr of the kernel and the launch flag (PDL where the
    device has it and the caller `allowed` it for this launch)."""
    on = allowed and enabled(device)
    return {"PDL": on, "launch_pdl": on}


@triton.jit
def wait_then_trigger(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def trigger_then_wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
