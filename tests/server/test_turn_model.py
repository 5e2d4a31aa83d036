"""The shipped end-of-turn model: its features are Whisper's log-mel, it loads and scores the sample sensibly, and
the batcher answers concurrent turns in shared calls off the event loop."""

from __future__ import annotations

import asyncio
import threading

import librosa
import numpy as np
import pytest

from server.audio.pcm import read_wav
from server.turn_model import (
    MODEL_PATH,
    WINDOW_SAMPLES,
    EndOfTurnQueue,
    SmartTurn,
    log_mel,
    main,
    pause_scores,
    threads_for,
)
from tests.paths import DATA


def whisper_log_mel(audio: np.ndarray) -> np.ndarray:
    """Whisper's feature extractor (chunk_length 8 s, normalised waveform) from librosa's parts."""
    x = np.pad(audio[-WINDOW_SAMPLES:], (WINDOW_SAMPLES - min(len(audio), WINDOW_SAMPLES), 0)).astype(np.float32)
    x = (x - x.mean()) / np.sqrt(x.var() + 1e-7)
    spec = np.abs(librosa.stft(x.astype(np.float64), n_fft=400, hop_length=160, window="hann", center=True,
                               pad_mode="reflect")) ** 2  # [201, 801]
    mel = librosa.filters.mel(sr=16000, n_fft=400, n_mels=80, htk=False, norm="slaney", dtype=np.float64) @ spec
    log = np.log10(np.maximum(mel, 1e-10))[:, :-1]
    log = np.maximum(log, log.max() - 8.0)
    return (log + 4.0) / 4.0


@pytest.fixture(scope="module")
def voice() -> np.ndarray:
    x, _ = read_wav(DATA / "speech_en_16k.wav", target_rate=16000)
    loud = np.flatnonzero(np.abs(x) > 0.02)
    return x[loud[0]:loud[-1] + 1]


def test_features_are_whispers_log_mel(voice):
    for audio in (voice, np.random.default_rng(0).standard_normal(10 * 16000).astype(np.float32) * 0.1):
        got = log_mel(audio)
        assert got.shape == (80, 800) and got.dtype == np.float32
        np.testing.assert_allclose(got, whisper_log_mel(audio), atol=2e-5)


def test_the_shipped_model_scores_a_finished_clause_above_a_cut_word(voice):
    assert MODEL_PATH.is_file() and (MODEL_PATH.parent / "LICENSE-smart-turn.txt").is_file()
    model = SmartTurn()
    pause = np.zeros(int(0.16 * 16000), np.float32)
    clause = np.concatenate([voice[:int(0.48 * 16000)], pause])  # the sample's first clause, then 160 ms of silence
    cut = voice[:int(1.2 * 16000)]  # mid-word, no pause
    both = model.complete([clause, cut])
    assert both[0] > 0.5 > both[1], both
    assert model.complete([cut])[0] == pytest.approx(both[1], abs=1e-5)  # a batch scores each turn alone


def test_more_threads_score_the_same(voice):
    turns = [voice[:int(0.48 * 16000)], voice[:int(1.2 * 16000)]]
    np.testing.assert_allclose(SmartTurn(threads=2).complete(turns), SmartTurn(threads=1).complete(turns), atol=1e-5)


def test_each_server_process_gets_half_its_share_of_the_cores_for_the_model_one_to_four():
    assert threads_for(1, cores=2) == 1 and threads_for(4, cores=2) == 1
    assert threads_for(4, cores=16) == 2 and threads_for(1, cores=16) == 4 and threads_for(1, cores=128) == 4
    assert threads_for(1) >= 1


class Counting:
    def __init__(self, gate: threading.Event | None = None, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.heard: list[int] = []  # samples of each turn the model ran
        self.gate = gate
        self.fail = fail

    def complete(self, turns: list[np.ndarray]) -> list[float]:
        if self.gate is not None:
            self.gate.wait(10)
        if self.fail:
            raise RuntimeError("model broke")
        self.batches.append(len(turns))
        self.heard += [len(a) for a in turns]
        return [float(len(a)) / WINDOW_SAMPLES for a in turns]


async def a_call_running() -> tuple[threading.Event, Counting, EndOfTurnQueue, asyncio.Future[float]]:
    """A queue whose first call (a 1 s turn) has started and waits on `gate`, in its thread."""
    gate = threading.Event()
    model = Counting(gate)
    eot = EndOfTurnQueue(load=lambda: model)
    first = asyncio.ensure_future(eot.complete(np.zeros(16000, np.float32)))
    await asyncio.sleep(0)
    return gate, model, eot, first


async def test_turns_are_answered_one_a_call_in_the_order_asked():
    gate, model, eot, first = await a_call_running()
    rest = [asyncio.ensure_future(eot.complete(np.zeros(n, np.float32))) for n in (32000, 48000, 10 * 16000)]
    gate.set()
    got = await asyncio.gather(first, *rest)
    assert got == [0.125, 0.25, 0.375, 1.0]  # (the last 8 s only)
    assert model.batches == [1, 1, 1, 1]
    assert model.heard == [16000, 32000, 48000, WINDOW_SAMPLES]


async def test_a_turn_answered_before_those_asked_after_it_is_not_held_for_them():
    gate, model, eot, first = await a_call_running()
    second = asyncio.ensure_future(eot.complete(np.zeros(32000, np.float32)))
    later = [asyncio.ensure_future(eot.complete(np.zeros(48000, np.float32))) for _ in range(3)]
    gate.set()
    assert await second == 0.25
    assert not all(t.done() for t in later)  # the second's answer came before the later turns were run
    await asyncio.gather(first, *later)


async def test_a_question_withdrawn_while_it_waits_is_never_run():
    gate, model, eot, first = await a_call_running()
    withdrawn = asyncio.ensure_future(eot.complete(np.zeros(32000, np.float32)))
    kept = asyncio.ensure_future(eot.complete(np.zeros(48000, np.float32)))
    await asyncio.sleep(0)
    withdrawn.cancel()
    gate.set()
    assert await asyncio.gather(first, kept) == [0.125, 0.375]
    assert model.heard == [16000, 48000]


async def test_every_questions_end_is_reported_and_answered_ones_timed():
    gate = threading.Event()
    model = Counting(gate)
    seen: list[tuple[str, float | None, float | None]] = []
    eot = EndOfTurnQueue(load=lambda: model, observe=lambda *end: seen.append(end))
    stale = asyncio.ensure_future(eot.complete(np.zeros(16000, np.float32)))
    await asyncio.sleep(0)  # its call runs (held by the gate)
    withdrawn = asyncio.ensure_future(eot.complete(np.zeros(16000, np.float32)))
    answered = asyncio.ensure_future(eot.complete(np.zeros(16000, np.float32)))
    await asyncio.sleep(0)
    stale.cancel()
    withdrawn.cancel()
    gate.set()
    assert await answered == 0.125
    assert [outcome for outcome, *_ in seen] == ["stale", "withdrawn", "answered"]
    assert seen[1][1:] == (None, None)  # never run
    for _, wait_s, call_s in (seen[0], seen[2]):  # run: the call is part of the wait
        assert 0 < call_s <= wait_s
    model.fail = True
    with pytest.raises(RuntimeError):
        await eot.complete(np.zeros(16000, np.float32))
    assert seen[-1][0] == "failed"


async def test_a_failing_observer_stops_no_question():
    def observe(outcome: str, wait_s: float | None, call_s: float | None) -> None:
        raise RuntimeError("metrics broke")

    eot = EndOfTurnQueue(load=lambda: Counting(), observe=observe)
    asked = asyncio.gather(*(eot.complete(np.zeros(n, np.float32)) for n in (16000, 32000)))
    assert await asyncio.wait_for(asked, 10) == [0.125, 0.25]


async def test_a_failing_model_fails_every_turn_waiting():
    eot = EndOfTurnQueue(load=lambda: Counting(fail=True))
    got = await asyncio.gather(*(eot.complete(np.zeros(16000, np.float32)) for _ in range(2)), return_exceptions=True)
    assert all(isinstance(e, RuntimeError) for e in got)


def test_pause_scores_judge_each_pause_a_little_into_it_and_the_end():
    t = np.arange(16000) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)  # 1 s
    gap = np.zeros(8000, np.float32)  # 500 ms
    audio = np.concatenate([gap, tone, gap, tone, np.zeros(2400, np.float32), tone])  # a 150 ms silence: no pause

    class Lengths:
        def complete(self, turns):
            return [len(x) / 16000 for x in turns]

    scores = pause_scores(Lengths(), audio)
    assert [(at, pause) for at, pause, _ in scores] == [(1.5, 500), (audio.size / 16000, 0)]
    assert scores[0][2] == pytest.approx(1.7)  # the audio up to 200 ms into the pause
    assert scores[1][2] == pytest.approx(audio.size / 16000)


def test_the_command_judges_each_pause_as_far_in_as_asked(capsys):
    wav = str(DATA / "speech_paused_en_16k.wav")
    main([wav])
    at_200 = capsys.readouterr().out.splitlines()
    main([wav, "--after-ms", "400"])
    at_400 = capsys.readouterr().out.splitlines()
    assert len(at_200) == len(at_400) >= 2 and at_200[-1] == at_400[-1]  # the end is judged where it ends
    assert at_200[:-1] != at_400[:-1] and all("pause of" in line for line in at_400[:-1])
    with pytest.raises(SystemExit):
        main([wav, "--after-ms", "-1"])
