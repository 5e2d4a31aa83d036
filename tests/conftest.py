"""Shared fixtures: a tiny random checkpoint in the release's layout, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.config import PRESETS, ModelConfig


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return PRESETS["tiny-random"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Directory with config.json, 2 safetensors shards, index and stand-in tokenizer.json (tiny-random, seed 0)."""
    from engines.loader.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "tiny-random", seed=0, num_shards=2)
