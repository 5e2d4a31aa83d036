"""CUDA streams by urgency: the speech encoder's commits and new answers' first codec chunks run on the highest
priority, the language model's steps one level below them; the codec's rounds for answers already playing and the
speech encoder's held audio stay on the lowest. And independent chains of work side by side on streams of their own
(`side_by_side`).

Every stream an owner here runs on is made by the driver (`driver_stream`): outside PyTorch's stream pool, never
freed, at the priority asked (engines.lm.step_graphs.private_stream says why graphs need streams of their own)."""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(rc: int, what: str) -> None:
    if rc != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUresult {rc} ({(msg.value or b'?').decode()})")


def _make_current(device: torch.device) -> None:
    """The device's primary context exists and is current (a runtime call makes it), so the driver can be asked."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.current_stream(idx).query()


@functools.cache
def _range(device_index: int) -> tuple[int, int]:
    """The device's (least, most) urgent stream priorities (CUDA: lower numbers are more urgent), asked once."""
    device = torch.device("cuda", device_index)
    least, greatest = ctypes.c_int(), ctypes.c_int()
    with torch.cuda.device(device):
        _make_current(device)  # (the first question may come before any CUDA work)
        _check(_driver().cuCtxGetStreamPriorityRange(ctypes.byref(least), ctypes.byref(greatest)),
               "cuCtxGetStreamPriorityRange")
    return least.value, greatest.value


def _priority(device: torch.device, level: int | None) -> int:
    """The CUDA priority `level` levels below the most urgent (never below the least); None: the least."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    least, greatest = _range(index)
    return least if level is None else min(greatest + level, least)


def driver_stream(device: torch.device | str | None = None, urgent: bool = False,
                  level: int | None = None) -> torch.cuda.ExternalStream:
    """A new non-blocking stream made by the driver (outside PyTorch's stream pool, never freed). `urgent`: the most
    urgent priority (else the least); `level`: that many priority levels below the most urgent instead."""
    device = torch.device("cuda") if device is None else torch.device(device)
    priority = _priority(device, level if level is not None else 0 if urgent else None)
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        _make_current(device)
        _check(_driver().cuStreamCreateWithPriority(ctypes.byref(handle), ctypes.c_uint(_STREAM_NON_BLOCKING),
                                                    ctypes.c_int(priority)), "cuStreamCreateWithPriority")
    return torch.cuda.ExternalStream(handle.value, device=device)


def level(stream: torch.cuda.Stream) -> int:
    """How many priority levels `stream` is below the most urgent (0: the most urgent). Asked first outside any
    capture (a query of a capturing stream's state would invalidate the capture); remembered per stream after
    that."""
    return _stream_level(stream.cuda_stream, stream.device_index)


def is_urgent(stream: torch.cuda.Stream) -> bool:
    """Whether `stream` has the most urgent priority."""
    return level(stream) == 0


@functools.cache  # by handle: streams here are never destroyed, and a stream keeps its priority
def _stream_level(handle: int, device_index: int) -> int:
    prio = ctypes.c_int()
    greatest = _range(device_index)[1]  # (asked first: the primary context exists)
    with torch.cuda.device(device_index):
        _check(_driver().cuStreamGetPriority(ctypes.c_void_p(handle), ctypes.byref(prio)), "cuStreamGetPriority")
    return prio.value - greatest


def high_priority_stream(device: torch.device | str) -> torch.cuda.Stream:
    """A new stream of the most urgent priority."""
    return driver_stream(device, urgent=True)


def model_stream(device: torch.device | str) -> torch.cuda.Stream:
    """A new stream one priority level below the most urgent, for the language model's steps: ahead of the playing
    answers' codec rounds, behind the work a single answer waits for (its commit's codes, its first chunk), which is
    short beside a model step that every session's rows ride on."""
    return driver_stream(device, level=1)


def wait_releasing_gil(device: torch.device) -> None:
    """Wait for the current stream's work before a device-to-host read. Speech encoder calls run on a worker thread
    beside the engine loop: an event wait lets other Python threads run, where the read's own wait may hold the GIL
    for the whole call. (The codec decoder's rounds wait on their own event the same way: queued.py.)"""
    if device.type == "cuda":
        ev = torch.cuda.Event()
        ev.record()
        ev.synchronize()


def side_by_side(streams: Sequence[torch.cuda.Stream], first: Callable[[], T], *others: Callable[[], T]) -> list[T]:
    """[first(), *others()]: others[i] enqueued on streams[i], then first on the current stream. Each branch starts
    after the work the current stream holds so far, and the current stream waits for every branch before its next
    work (also inside a CUDA graph capture: a fork and a join). Tensors cross streams only there: the inputs the
    branches read were made before the fork and are freed after the join, and what a branch returns is read by the
    current stream after the join, while the branch's stream touches it no more."""
    if len(others) > len(streams):
        raise ValueError(f"{len(others)} branches for {len(streams)} streams")
    main = torch.cuda.current_stream()
    used = streams[:len(others)]
    outs = []
    for stream, fn in zip(used, others, strict=True):
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            outs.append(fn())
    outs.insert(0, first())
    for stream in used:
        main.wait_stream(stream)
    return outs
