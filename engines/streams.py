"""CUDA streams by urgency: the speech encoder's commits and new answers' first codec chunks run on the highest
priority, the language model's steps one level below them; the codec's rounds for answers already playing and the
speech encoder's held audio stay on the lowest. And independent chains of work side by side on streams of their own
(`side_by_side`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def high_priority_stream(device: torch.device | str) -> torch.cuda.Stream:
    """A new stream of the most urgent priority, in the SM partition of the current stream (engines.partition)."""
    from engines.partition import driver_stream

    return driver_stream(device, urgent=True)


def model_stream(device: torch.device | str) -> torch.cuda.Stream:
    """A new stream one priority level below the most urgent, for the language model's steps: ahead of the playing
    answers' codec rounds, behind the work a single answer waits for (its commit's codes, its first chunk), which is
    short beside a model step that every session's rows ride on."""
    from engines.partition import driver_stream

    return driver_stream(device, level=1)


def wait_releasing_gil(device: torch.device) -> None:
    """Wait for the current stream's work before a device-to-host read. Codec and speech encoder calls run on worker
    threads beside the engine loop: an event wait lets other Python threads run, where the read's own wait may hold
    the GIL for the whole call."""
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
