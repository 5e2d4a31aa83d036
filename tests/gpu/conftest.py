"""Fixtures shared by the GPU tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def preload(monkeypatch, preload_limit):
    """The decode kernel's first tile read before the PDL wait or after it, as `preload_limit` (PRELOAD_LIMITS)
    says."""
    from engines.kernels.lm import paged_decode

    monkeypatch.setattr(paged_decode, "PRELOAD_MAX_PROGRAMS", preload_limit)
