"""The log-mel comparison tool: its swap of the encoder's features is exact, and the reference features differ from
the served ones by the floor before a turn's loudest frame."""

from __future__ import annotations

import numpy as np
import torch

from engines.profiling.log_mel_codes import _reference_frames, encode, reference_log_mel, served_log_mel
from engines.speech_in import SpeechEncoder


def quiet_then_loud(seconds: float = 2.0) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000
    env = np.where(t < 0.7, 1e-4, 0.5)
    noise = np.random.default_rng(0).standard_normal(t.size)
    return (env * (np.sin(2 * np.pi * 220 * t) + 0.1 * noise)).astype(np.float32)


def test_swapping_in_the_served_features_gives_the_served_codes():
    enc = SpeechEncoder.load("tiny-random")
    pcm = quiet_then_loud()
    served = encode(enc, pcm, None)
    frontend = enc.runner.frontend
    assert encode(enc, pcm, _reference_frames(pcm, enc.cfg, frontend, served_log_mel)) == served
    assert encode(enc, pcm, _reference_frames(pcm, enc.cfg, frontend)) != served


def test_reference_and_served_features_differ_only_before_the_loudest_frame():
    enc = SpeechEncoder.load("tiny-random")
    pcm = quiet_then_loud()
    seg = np.concatenate([pcm, np.zeros(3000 * 160 - pcm.size, np.float32)])
    ref = reference_log_mel(seg, enc.cfg, enc.runner.frontend)
    ours = served_log_mel(seg, enc.cfg, enc.runner.frontend)
    assert ref.shape == ours.shape == (3000, 128)
    differ = (ref - ours).abs().amax(dim=1) > 1e-4
    loud = int(0.7 * 100) + 2  # frames from the loud part on see the segment's max
    assert differ[:loud - 4].all() and not differ[loud + 2:].any()
    assert torch.equal(differ.nonzero().flatten(), torch.arange(int(differ.sum())))  # one run from the start
