"""Shared fixtures: a tiny random checkpoint in the release's layout, written once per session."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engines.config import PRESETS, ModelConfig


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    return PRESETS["tiny-random"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """Directory with config.json, 2 safetensors shards, index and stand-in tokenizer.json (tiny-random, seed 0)."""
    from engines.lm.loader.random_checkpoint import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"), "tiny-random", seed=0, num_shards=2)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors gain nothing from intra-op threads, and OpenMP barriers stall badly on an oversubscribed
    2-core CI box (10x slower); modules that opt in run on one thread, restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


SERVER_LOGGERS = ("server", "uvicorn", "uvicorn.error", "uvicorn.access")


@pytest.fixture(autouse=True)
def server_loggers_restored():
    """A test that runs `serve` in-process (setup_logging) points the server's loggers at the stderr pytest captured
    for that test, which is closed after it: every later log line would then fail (and print why), so each test
    leaves these loggers as it found them."""
    saved = {n: (lg.handlers[:], lg.level, lg.propagate) for n in SERVER_LOGGERS if (lg := logging.getLogger(n))}
    yield
    for n, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers[:], lg.level, lg.propagate = handlers, level, propagate
