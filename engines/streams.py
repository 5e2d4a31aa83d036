"""CUDA streams by urgency: the language model's steps, the speech encoder and new answers' first codec chunks
run on the highest priority; the codec's rounds for answers already playing stay on the default (lowest)."""

from __future__ import annotations

import torch


def high_priority_stream(device: torch.device | str) -> torch.cuda.Stream:
    return torch.cuda.Stream(torch.device(device), priority=torch.cuda.Stream.priority_range()[1])
