"""Inputs and drivers of the speech encoder's tests, and the streaming and batching checks that run on the CPU
(tests/engines/speech_in/test_encoder_*.py) and on CUDA (tests/gpu/test_speech_encoder*_gpu.py) with each one's encoder.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from engines.audio.wav import read_wav
from engines.profiling.log_mel_codes import encode, whole_segment_log_mel
from engines.speech_in import SpeechEncoder
from engines.speech_in.step_graphs import StepGraphs
from tests.paths import DATA

SR = 16000
FEATURE_ATOL = 1e-4  # pre-VQ features, float32: streaming vs whole and batched vs alone
WAIT_S = 60.0  # bound on a wait for another thread: a hang fails the test instead of blocking it


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """A chirp with noise and an amplitude envelope (incl. a quiet start), float32 at 16 kHz."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * SR)) / SR
    env = np.clip(t / 0.3, 0.02, 1.0) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))
    x = env * (0.3 * np.sin(2 * np.pi * 180 * t * (1 + 0.4 * t)) + 0.05 * rng.standard_normal(t.size))
    return x.astype(np.float32)


def speech_en(seconds: float) -> np.ndarray:
    """The first `seconds` of tests/data/speech_en_16k.wav (its first ~0.4 s are quiet), float32 at 16 kHz."""
    pcm, rate = read_wav(DATA / "speech_en_16k.wav")
    assert rate == SR
    return pcm[: int(seconds * rate)].astype(np.float32)


def whole_segment_codes(enc: SpeechEncoder, pcm: np.ndarray) -> list[int]:
    """The reference for a committed turn: its finalized stream's codes with every frame's features swapped for the
    dense whole-segment ones (engines/profiling/log_mel_codes.py)."""
    x = np.concatenate([pcm, np.zeros(enc.tail_padding(pcm.size), np.float32)])
    feats = torch.cat([whole_segment_log_mel(x, enc.cfg, enc.frontend), torch.zeros(1, enc.cfg.num_mel_bins)])
    return encode(enc, pcm, feats)


def stream_encode(enc: SpeechEncoder, pcm: np.ndarray, sizes) -> tuple[list[int], torch.Tensor]:
    s = enc.open_stream()
    codes, feats, i, k = [], [], 0, 0
    while i < pcm.size:
        n = sizes[k % len(sizes)]
        codes += s.push(pcm[i:i + n])
        if s.last_features is not None:
            feats.append(s.last_features)
        i += n
        k += 1
    codes += s.finalize()
    if s.last_features is not None:
        feats.append(s.last_features)
    return codes, torch.cat(feats)


def whole_encode(enc: SpeechEncoder, pcm: np.ndarray) -> tuple[list[int], torch.Tensor]:
    return stream_encode(enc, pcm, [pcm.size])


BATCH_PCMS = [(1.7, 1), (0.9, 2), (2.1, 3)]  # (seconds, seed) of three streams stepped together
BATCH_SIZES = [[320], [137, 2000], [960, 0, 50]]  # each stream's push sizes


def batched_encode(enc: SpeechEncoder, pcms: list[np.ndarray], sizes: list[list[int]]
                   ) -> list[tuple[list[int], torch.Tensor]]:
    """Each stream's codes and features with every stream still speaking stepped in one batch, then finalized in
    one call."""
    streams = [enc.open_stream() for _ in pcms]
    pos = [0] * len(pcms)
    codes: list[list[int]] = [[] for _ in pcms]
    feats: list[list[torch.Tensor]] = [[] for _ in pcms]
    batch = enc.batch()
    k = 0
    while any(p < pcm.size for p, pcm in zip(pos, pcms, strict=True)):
        items, idx = [], []
        for i, (pcm, sz) in enumerate(zip(pcms, sizes, strict=True)):
            if pos[i] < pcm.size:
                n = sz[k % len(sz)]
                items.append((streams[i], pcm[pos[i]:pos[i] + n]))
                idx.append(i)
                pos[i] += n
        for i, out in zip(idx, batch.step(items), strict=True):
            codes[i] += out
            if streams[i].last_features is not None:
                feats[i].append(streams[i].last_features)
        k += 1
    for i, (s, tail) in enumerate(zip(streams, batch.finalize(streams), strict=True)):
        codes[i] += tail
        if s.last_features is not None:
            feats[i].append(s.last_features)
    return [(c, torch.cat(f)) for c, f in zip(codes, feats, strict=True)]


class StepGate:
    """Steps of one kind (`urgent`) on an encoder wait inside their lane until `gate` is set; `inside` is set once
    one waits there."""

    def __init__(self, monkeypatch, e: SpeechEncoder, urgent: bool = False) -> None:
        self.gate, self.inside = threading.Event(), threading.Event()
        on_stream = e._on_stream

        def gated(urgent_step: bool = True):  # (a step enters its stream once inside its lane)
            if urgent_step == urgent:
                self.inside.set()
                assert self.gate.wait(WAIT_S), "the test never opened the gate"
            return on_stream(urgent_step)

        monkeypatch.setattr(e, "_on_stream", gated)


# Push sizes of the streaming check, and where the finalize check splits its samples.
STREAM_SIZES = [[320], [800], [2192], [37], [1, 5000, 17, 640, 0, 1279]]
STREAM_SIZE_IDS = ["20ms", "50ms", "137ms", "37samples", "irregular"]
FINALIZE_SPLITS = [0, 700, 1159, 1280, 3000]


def check_streaming_equals_whole(enc: SpeechEncoder, sizes: list[int], atol: float = FEATURE_ATOL) -> None:
    pcm = speech_like(2.3)
    whole, wf = whole_encode(enc, pcm)
    assert len(whole) == -(-pcm.size // 1280) == 29
    assert len(set(whole)) > 10, "random codebook should give varied codes, or the comparison is vacuous"
    codes, f = stream_encode(enc, pcm, sizes)
    assert codes == whole
    torch.testing.assert_close(f, wf, atol=atol, rtol=0)


def check_finalize_with_the_last_samples_equals_push_then_finalize(enc: SpeechEncoder, split: int) -> None:
    pcm = speech_like(0.3)
    a, b = enc.open_stream(), enc.open_stream()
    a.push(pcm[:split])
    b.push(pcm[:split])
    assert a.finalize(pcm[split:]) == b.push(pcm[split:]) + b.finalize()
    assert a.codes_out == b.codes_out == -(-len(pcm) // 1280)


def check_batched_step_equals_each_alone(enc: SpeechEncoder, atol: float = FEATURE_ATOL) -> None:
    pcms = [speech_like(t, seed=seed) for t, seed in BATCH_PCMS]
    alone = [stream_encode(enc, p, sz) for p, sz in zip(pcms, BATCH_SIZES, strict=True)]
    for (codes, feats), (codes1, feats1) in zip(batched_encode(enc, pcms, BATCH_SIZES), alone, strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=atol, rtol=0)


class EagerStepGraphs(StepGraphs):
    """StepGraphs' buckets with the step run eagerly on the padded inputs a graph would get: the padding (streams,
    frames, tokens, keys, groups, kept rows) on the CPU."""

    def _capture(self, key, inputs, static):
        return None, None, None

    def run(self, sz, flat):
        self.replays += 1
        return self.runner.forward(flat, sz)


def bucketed_encoder(max_batch: int = 4) -> SpeechEncoder:
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(max_batch)
    e.runner.graphs = EagerStepGraphs(e.runner, max_batch)
    e.runner.graphs.capture()
    return e
