"""The process-wide TF32 switch of float32 matmuls held per caller (engines/cuda/precision.py): the flow encoder
launches on its own setting, the speech encoder always on IEEE float32, and no thread launches under another's."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from engines.cuda.precision import float32_matmuls
from engines.speech_in import SpeechEncoder
from engines.speech_out import CodecDecoder

WAIT_S = 60.0  # bound on a wait for another thread: a hang fails the test instead of blocking it


def _switch() -> bool:
    return torch.backends.cuda.matmul.allow_tf32


def _set_switch(on: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = on


@pytest.fixture(autouse=True)
def _restore_the_switch():
    before = _switch()  # (a property of torch's cuBLAS module, which monkeypatch cannot restore)
    yield
    _set_switch(before)


def test_the_switch_is_set_inside_and_restored_after():
    before = _switch()
    with float32_matmuls(not before):
        assert _switch() is (not before)
        with float32_matmuls(before):  # re-entrant on one thread
            assert _switch() is before
        assert _switch() is (not before)
    assert _switch() is before


class WatchedLock:
    """The switch's lock, telling when a thread has to wait for it (another holds it)."""

    def __init__(self) -> None:
        self._lock, self.contended = threading.RLock(), threading.Event()

    def __enter__(self) -> WatchedLock:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()


def test_a_second_thread_waits_until_the_first_block_ends(monkeypatch):
    lock = WatchedLock()
    monkeypatch.setattr("engines.cuda.precision._lock", lock)
    inside, release, seen = threading.Event(), threading.Event(), []

    def tf32_caller():
        with float32_matmuls(True):
            inside.set()
            assert release.wait(WAIT_S)
            seen.append(("tf32 block ends", _switch()))

    def fp32_caller():
        assert inside.wait(WAIT_S)
        with float32_matmuls(False):
            seen.append(("fp32 block", _switch()))

    a, b = threading.Thread(target=tf32_caller), threading.Thread(target=fp32_caller)
    a.start()
    b.start()
    assert lock.contended.wait(WAIT_S)
    assert b.is_alive() and seen == []  # blocked while the TF32 block holds the switch
    release.set()
    a.join(WAIT_S)
    b.join(WAIT_S)
    assert seen == [("tf32 block ends", True), ("fp32 block", False)]


def _encode_switch(dec: CodecDecoder, monkeypatch) -> list[bool]:
    """The switch as the flow encoder's layers see it, over one streamed chunk."""
    seen = []
    enc = dec.flow.encoder
    inner = enc.forward_chunk

    def spy(*a, **k):
        seen.append(_switch())
        return inner(*a, **k)

    monkeypatch.setattr(enc, "forward_chunk", spy)
    dec.open_stream("s", seed=0).push(np.arange(8) * 97 % 16384)
    return seen


def test_the_flow_encoder_launches_on_its_own_setting(monkeypatch):
    _set_switch(True)  # someone else's choice: not the flow's
    plain = CodecDecoder.load("tiny-random", vocoder="hift")
    assert not plain.flow.encoder_tf32 and set(_encode_switch(plain, monkeypatch)) == {False}
    assert _switch() is True  # restored
    tf32 = CodecDecoder.load("tiny-random", vocoder="hift", encoder_tf32=True)
    assert tf32.lane().flow.encoder_tf32
    _set_switch(False)
    assert set(_encode_switch(tf32, monkeypatch)) == {True}
    assert _switch() is False


def test_hift_and_the_speaker_projection_launch_on_ieee_float32():
    """The vocoder's f0 classifier and source merge and the flow's speaker projection (linears that may launch on the
    codec's other thread while the flow encoder holds TF32) pin IEEE float32."""
    dec = CodecDecoder.load("tiny-random", vocoder="hift", encoder_tf32=True)
    gen = dec.vocoder.generator
    seen: dict[str, list[bool]] = {"classifier": [], "l_linear": [], "spk": []}
    hooks = [m.register_forward_hook(lambda *_, name=name: seen[name].append(_switch()))
             for name, m in (("classifier", gen.f0_predictor.classifier), ("l_linear", gen.m_source.l_linear),
                             ("spk", dec.flow.spk_embed_affine_layer))]
    _set_switch(True)
    try:
        dec.open_stream("s", seed=0).push(np.arange(8) * 97 % 16384)
    finally:
        for h in hooks:
            h.remove()
    assert all(v and set(v) == {False} for v in seen.values()), seen
    assert _switch() is True


def test_the_speech_encoder_launches_on_ieee_float32(monkeypatch):
    enc = SpeechEncoder.load("tiny-random", device="cpu")
    seen = []
    inner = enc.runner.forward  # (the eager step's launches; a graph's replay launches none it chose)
    monkeypatch.setattr(enc.runner, "forward", lambda *a, **k: seen.append(_switch()) or inner(*a, **k))
    _set_switch(True)
    s = enc.open_stream()
    s.push(np.zeros(16000, np.float32))
    s.finalize()
    assert seen and set(seen) == {False}
    assert _switch() is True
