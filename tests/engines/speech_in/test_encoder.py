"""Causal speech encoder: streaming == whole, batched == alone, emission timing, loader checks, CLI."""

from __future__ import annotations

import argparse
import json
import threading
import wave

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from engines.config import ConfigError
from engines.speech_in import (
    ENCODER_PRESETS,
    EncoderCheckpointError,
    EncoderConfig,
    EncoderInputError,
    SpeechEncoder,
    StreamClosedError,
    write_random_encoder,
)
from engines.speech_in.log_mel import mel_filterbank
from engines.speech_in.step_graphs import StepGraphs
from tests.engines.speech_in.encoder_helpers import (
    BATCH_PCMS,
    BATCH_SIZES,
    FEATURE_ATOL,
    FINALIZE_SPLITS,
    SR,
    STREAM_SIZE_IDS,
    STREAM_SIZES,
    WAIT_S,
    StepGate,
    batched_encode,
    check_batched_step_equals_each_alone,
    check_finalize_with_the_last_samples_equals_push_then_finalize,
    check_streaming_equals_whole,
    speech_like,
    stream_encode,
    whole_encode,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def enc() -> SpeechEncoder:
    return SpeechEncoder.load("tiny-random", device="cpu")


@pytest.mark.parametrize("sizes", STREAM_SIZES, ids=STREAM_SIZE_IDS)
def test_streaming_equals_whole(enc, sizes):
    check_streaming_equals_whole(enc, sizes)


def test_streaming_equals_whole_across_30s_segment(enc):
    pcm = speech_like(31.0, seed=3)  # crosses the 1500-frame position limit: model state restarts at 30 s
    whole, wf = whole_encode(enc, pcm)
    assert len(whole) == 388
    codes, f = stream_encode(enc, pcm, [8000, 4321])
    assert codes == whole
    torch.testing.assert_close(f, wf, atol=FEATURE_ATOL, rtol=0)


def test_encode_in_pieces_equals_encode_and_frees_its_slot(enc):
    """A voice prompt is encoded in pieces on the low-priority lane: the same codes as one whole forward."""
    pcm = speech_like(2.3, seed=5)
    in_use = enc.runner.kv.in_use
    assert enc.encode_in_pieces(pcm, piece_samples=4000) == enc.encode(pcm)
    assert enc.encode_in_pieces(pcm[:100]) == enc.encode(pcm[:100])
    assert enc.runner.kv.in_use == in_use


def test_code_emitted_as_soon_as_determined(enc):
    pcm = speech_like(0.5)
    s = enc.open_stream()
    # Code k needs sample 1280 k + 1160: the 25 ms window of mel frame 8k+6 (conv2 stride 2, pool 4).
    assert s.push(pcm[:1159]) == []
    assert len(s.push(pcm[1159:1160])) == 1
    assert s.push(pcm[1160:2439]) == []
    assert len(s.push(pcm[2439:2440])) == 1


@pytest.mark.parametrize("split", FINALIZE_SPLITS)
def test_finalize_with_the_last_samples_equals_push_then_finalize(enc, split):
    check_finalize_with_the_last_samples_equals_push_then_finalize(enc, split)


@pytest.mark.parametrize("n", [0, 1, 1160, 1280, 1281, 5000])
def test_finalize_pads_last_group_with_silence(enc, n):
    pcm = speech_like(1.0)[:n]
    s = enc.open_stream()
    codes = s.push(pcm) + s.finalize()
    assert len(codes) == -(-n // 1280)
    # The padding is silence: encoding the zero-padded signal gives the same codes.
    padded = np.concatenate([pcm, np.zeros(s.tail_padding() + (-n) % 1280 + 200, np.float32)])
    assert enc.encode(padded)[: len(codes)] == codes
    with pytest.raises(StreamClosedError):
        s.push(pcm)
    with pytest.raises(StreamClosedError):
        s.finalize()


def test_batched_step_equals_each_alone(enc):
    check_batched_step_equals_each_alone(enc)


def test_a_call_on_another_thread_leaves_this_threads_gpu_wait(enc):
    """The encoder worker reads last_gpu_wait_s after its own call; a voice prompt encoded meanwhile on another
    thread must not overwrite it."""
    enc.last_gpu_wait_s = -1.0  # (stands for the worker's last call: a value no call measures)
    theirs = []

    def other() -> None:
        s = enc.open_stream()
        enc.batch().step([(s, speech_like(0.5, seed=3))])
        theirs.append(enc.last_gpu_wait_s)
        s.close()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert enc.last_gpu_wait_s == -1.0 and theirs[0] >= 0


def test_many_streams_with_uneven_pushes_equal_each_alone(enc):
    """A step's rows, windows and kept tails are index arithmetic over every stream at once: twelve streams whose
    pushes give none, a few or many frames (some none at all in a step, some crossing a pooling group) match each
    stream encoded alone in one push."""
    pcms = [speech_like(0.4 + 0.15 * i, seed=20 + i) for i in range(12)]
    sizes = [[(0, 37, 5120, 160, 1500, 320)[(i + k) % 6] or 1 for k in range(3)] for i in range(12)]
    sizes[0] = [0, 2000]  # a stream with nothing new every other step
    alone = [whole_encode(enc, p) for p in pcms]
    for (codes, feats), (codes1, feats1) in zip(batched_encode(enc, pcms, sizes), alone, strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)


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


def test_bucketed_steps_equal_exact_ones(enc):
    """Steps padded to a graph's bucket (more streams, frames and keys than the step has; padding in the spare KV
    slot) give the codes and features of the exact shapes; steps without a bucket (a 1.5 s push: 75 frames) run
    exactly."""
    e = bucketed_encoder()
    graphs = e.runner.graphs
    pcms = [speech_like(t, seed=seed) for t, seed in BATCH_PCMS]
    exact = batched_encode(enc, pcms, BATCH_SIZES)
    for (codes, feats), (codes1, feats1) in zip(batched_encode(e, pcms, BATCH_SIZES), exact, strict=True):
        assert codes == codes1
        torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)
    assert graphs.replays > 10
    pcm = speech_like(2.3)
    replays = graphs.replays
    codes, feats = stream_encode(e, pcm, [24000, 320])
    # Pushes of 24000, 320 and the last 12480 samples (75, 2 and 39 frames), then the finalize: three in buckets.
    assert graphs.replays - replays == 3
    codes1, feats1 = stream_encode(enc, pcm, [24000, 320])
    assert codes == codes1
    torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)


def test_bucketed_steps_across_30s_segment(enc):
    e = bucketed_encoder(1)
    pcm = speech_like(31.0, seed=3)
    codes, feats = stream_encode(e, pcm, [8000, 4321])
    codes1, feats1 = stream_encode(enc, pcm, [8000, 4321])
    assert codes == codes1
    torch.testing.assert_close(feats, feats1, atol=FEATURE_ATOL, rtol=0)


def test_held_steps_replay_the_buckets_up_to_the_graphs_streams(enc):
    """Held audio's steps (`batch(urgent=False)`) of no more streams than the graphs hold replay their buckets, as
    urgent steps do; bigger ones run exactly. The codes equal each stream encoded alone."""
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(3)
    graphs = e.runner.graphs = EagerStepGraphs(e.runner, 2)
    graphs.capture()
    pcms = [speech_like(1.0, seed=i) for i in range(3)]
    streams = [e.open_stream() for _ in pcms]
    three = e.batch(urgent=False).step([(s, p[:5120]) for s, p in zip(streams, pcms, strict=True)])
    assert graphs.replays == 0  # 3 streams: no bucket
    two = e.batch(urgent=False).step([(s, p[5120:10240]) for s, p in zip(streams[:2], pcms[:2], strict=True)])
    assert graphs.replays == 1
    last = e.batch().finalize(streams, [pcms[0][10240:], pcms[1][10240:], pcms[2][5120:]])
    assert graphs.replays == 1
    assert [three[i] + (two[i] if i < 2 else []) + last[i] for i in range(3)] == [enc.encode(p) for p in pcms]


def test_a_kv_pool_growth_retires_the_graphs(enc, caplog):
    e = bucketed_encoder(2)
    graphs = e.runner.graphs
    streams = [e.open_stream() for _ in range(3)]  # reserved 2: the third grows the pool
    pcm = speech_like(0.5)
    with caplog.at_level("WARNING", logger="engines.audio"):
        codes = e.batch().finalize(streams, [pcm] * 3)
    assert "grew" in caplog.text and not graphs.graphs and graphs.replays == 0
    assert codes == [enc.encode(pcm)] * 3


def test_batch_refuses_duplicate_stream(enc):
    s = enc.open_stream()
    with pytest.raises(ValueError, match="twice"):
        enc.batch().step([(s, np.zeros(10, np.float32)), (s, np.zeros(10, np.float32))])


@pytest.mark.parametrize("bad, msg", [
    (np.array([0.0, np.nan], np.float32), "NaN"),
    (np.array([np.inf], np.float32), "NaN or infinite"),
    (np.zeros((2, 10), np.float32), "1-D"),
    (np.zeros(10, np.int16), "float"),
])
def test_bad_pcm_refused(enc, bad, msg):
    with pytest.raises(EncoderInputError, match=msg):
        enc.open_stream().push(bad)


def test_bfloat16_runs_and_keeps_timing():
    enc16 = SpeechEncoder.load("tiny-random", device="cpu", dtype="bfloat16")
    codes = enc16.encode(speech_like(1.0))
    assert len(codes) == 13 and all(0 <= c < 16384 for c in codes)


def test_mel_filterbank_is_slaney():
    fb = mel_filterbank(16000, 400, 128)
    assert fb.shape == (128, 201) and (fb >= 0).all()
    peaks = fb.argmax(axis=1)
    assert (np.diff(peaks) >= 0).all() and peaks[-1] > 190
    # Slaney normalisation: every triangle has unit area in Hz (check where filters span many FFT bins).
    area = fb.sum(axis=1) * (8000 / 200)
    # FFT-bin sampling of a triangle spanning ~5 bins moves its sum by up to ~10%.
    np.testing.assert_allclose(area[80:], 1.0, rtol=0.1)
    assert abs(area[80:].mean() - 1.0) < 0.01


def test_mel_frontend_puts_a_tone_in_its_band(enc):
    t = np.arange(SR) / SR
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    fe = enc.frontend
    mp = fe.plan([fe.new_state()], [tone], np.asarray([1000]))
    n = int(mp.counts[0])
    assert n == 100 - 1 and not mp.more  # frame t needs samples up to 160 t + 200
    peaks = torch.full((2,), float("-inf"))  # row 0 the stream's, row 1 the padding grid row's
    grid = torch.arange(n)  # one grid row of n cells
    frames = fe.log_mel(torch.from_numpy(mp.samples), torch.from_numpy(mp.starts[0] + 160 * np.arange(n)), grid,
                        torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([n - 1, n]), peaks, 2, n)
    assert frames.shape == (n, 128) and bool(torch.isfinite(peaks[0]))  # the stream's running peak written
    fb = mel_filterbank(16000, 400, 128)
    assert int(frames[50].argmax()) == int(fb[:, 25].argmax())  # FFT bin 25 = 1000 Hz


# ---- checkpoint layout and loader --------------------------------------------------------------------


def test_written_checkpoint_loads_and_matches_preset(enc, tmp_path):
    cfg = ENCODER_PRESETS["tiny-random"]
    (tmp_path / "config.json").write_text(json.dumps({"decoder_section": {"kept": True}}))
    write_random_encoder(tmp_path, cfg, seed=0)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["decoder_section"] == {"kept": True} and raw["quantize_position"] == cfg.num_layers
    assert EncoderConfig.from_dir(tmp_path) == cfg
    keys = load_file(str(tmp_path / "model.safetensors")).keys()
    assert "encoder.layers.0.self_attn.k_proj.weight" in keys and "encoder.codebook.weight" in keys
    assert "encoder.layers.0.self_attn.k_proj.bias" not in keys
    loaded = SpeechEncoder.load(tmp_path)
    pcm = speech_like(1.0)
    assert loaded.encode(pcm) == enc.encode(pcm)


def test_loader_lists_every_bad_key(tmp_path):
    cfg = ENCODER_PRESETS["tiny-random"]
    write_random_encoder(tmp_path, cfg)
    state = load_file(str(tmp_path / "model.safetensors"))
    del state["encoder.layers.1.fc2.bias"]
    state["encoder.layers.0.fc1.weight"] = torch.zeros(3, 3)
    state["encoder.mystery.weight"] = torch.zeros(1)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(EncoderCheckpointError) as e:
        SpeechEncoder.load(tmp_path)
    msg = str(e.value)
    assert "missing 1: ['encoder.layers.1.fc2.bias']" in msg
    assert "unexpected 1: ['encoder.mystery.weight']" in msg
    assert "encoder.layers.0.fc1.weight: (3, 3) != expected (128, 64)" in msg


def test_loader_skips_known_unused_and_foreign_tensors(enc, tmp_path):
    cfg = ENCODER_PRESETS["tiny-random"]
    write_random_encoder(tmp_path, cfg)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["encoder.ema_count"] = torch.ones(16384)
    state["encoder.layers.2.fc1.weight"] = torch.zeros(128, 64)  # a layer past the quantizer
    state["decoder.something"] = torch.zeros(2)  # another codec part
    save_file(state, str(tmp_path / "model.safetensors"))
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["encoder_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(raw))
    pcm = speech_like(0.6)
    assert SpeechEncoder.load(tmp_path).encode(pcm) == enc.encode(pcm)


@pytest.mark.parametrize("change, msg", [
    ({"encoder_causal_convolution": False}, "causal convs"),
    ({"encoder_causal_attention": False, "quantize_causal_encoder": False}, "causal"),
    ({"pooling_type": "max"}, "pooling_type"),
    ({"pooling_position": 1}, "pooling_position"),
    ({"encoder_attention_heads": 5}, "multiple of num_heads"),
])
def test_config_refuses_non_streaming_variants(tmp_path, change, msg):
    write_random_encoder(tmp_path, ENCODER_PRESETS["tiny-random"])
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=msg):
        SpeechEncoder.load(tmp_path)


def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        SpeechEncoder.load(tmp_path)


# ---- CLI ---------------------------------------------------------------------------------------------


def test_cli_encode_stereo_48k(enc, tmp_path, capsys):
    import soxr

    from moss_speech.commands import codec_encode as cmd

    t = np.arange(48000) / 48000
    left = 0.4 * np.sin(2 * np.pi * 300 * t)
    right = 0.2 * np.sin(2 * np.pi * 700 * t)
    frames = np.round(np.stack([left, right], axis=1) * 32767).astype("<i2")
    path = tmp_path / "in.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(48000)
        w.writeframes(frames.tobytes())
    mono = (frames.astype(np.float32) / 32768.0).mean(axis=1)
    expect = enc.encode(soxr.resample(mono, 48000, 16000, quality="HQ").astype(np.float32))
    for stream in (False, True):
        parser = argparse.ArgumentParser()
        cmd.add_arguments(parser)
        argv = ["--audio", str(path)] + (["--stream"] if stream else [])
        assert cmd.run(parser.parse_args(argv)) == 0
        out = capsys.readouterr().out.split()
        assert [int(c) for c in out] == expect


def test_kv_slots_are_returned(enc):
    import gc

    base = enc.runner.kv.in_use
    a, b, c = enc.open_stream(), enc.open_stream(), enc.open_stream()
    assert enc.runner.kv.in_use == base + 3
    a.push(speech_like(0.3))
    a.finalize()
    b.close()
    del c
    gc.collect()
    assert enc.runner.kv.in_use == base
    # A reused slot holds stale rows from its last owner; they must not leak into the new stream.
    pcm = speech_like(0.7, seed=5)
    assert enc.encode(pcm) == SpeechEncoder.load("tiny-random").encode(pcm)


def test_a_pool_growth_without_memory_changes_nothing_and_says_why(monkeypatch):
    """Every slot taken and no memory to grow: PoolFullError (server_busy) for the stream that asked, and the pool as it
    was (its CUDA graphs hold its tensors: a half-done growth would free tensors they still write), then a growth that
    can allocate goes ahead as before."""
    from engines.speech_in.slot_pool import PoolFullError

    e = SpeechEncoder.load("tiny-random", device="cpu")
    pool = e.runner.kv
    e.reserve(2)
    held = [e.open_stream() for _ in range(2)]
    first = speech_like(0.7, seed=2)
    codes = held[0].push(first[:4800])
    keys, values, gen = list(pool.keys), list(pool.values), pool.generation
    before = [t.clone() for t in keys]
    real_zeros, calls = torch.zeros, [0]

    def zeros(*args, **kwargs):  # the third layer tensor of the growth runs out
        calls[0] += 1
        if calls[0] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    with pytest.raises(PoolFullError, match=r"all 2 of the speech encoder's KV slots are in use, and growing the pool "
                                            r"to 4 needs [\d.]+ GiB more") as err:
        e.open_stream()
    assert err.value.code == "server_busy"
    assert pool.capacity == 2 and pool.generation == gen and pool.in_use == 2
    assert all(a is b for a, b in zip(pool.keys + pool.values, keys + values, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(pool.keys, before, strict=True))
    monkeypatch.setattr(torch, "zeros", real_zeros)
    third = e.open_stream()
    assert pool.capacity == 4 and all(torch.equal(a[:2], b[:2]) for a, b in zip(pool.keys, before, strict=True))
    pcm = speech_like(0.4, seed=3)
    fresh = SpeechEncoder.load("tiny-random")
    assert third.push(pcm) + third.finalize() == fresh.encode(pcm)
    # The growth copied the carried state (mel, conv and pooling tails, peak) of a stream in the middle of its audio.
    assert codes + held[0].push(first[4800:]) + held[0].finalize() == fresh.encode(first)


def test_reserved_kv_slots_serve_that_many_streams_without_growing():
    e = SpeechEncoder.load("tiny-random", device="cpu")
    pool = e.runner.kv
    e.reserve(3)
    assert pool.capacity == 3
    streams = [e.open_stream() for _ in range(3)]
    for s in streams:
        s.push(speech_like(0.2, seed=1))
    assert pool.capacity == 3 and pool.in_use == 3  # no growth (a growth copies every layer's cache)
    extra = e.open_stream()
    extra.push(speech_like(0.1))
    assert pool.capacity == 6  # the fourth doubles the pool
    e.reserve(2)
    assert pool.capacity == 6  # reserving less never shrinks


class CountedLanes(threading.Condition):
    """The encoder's `_lanes` condition, counting the threads blocked in it: a test waits until a call or a growth
    of the pool waits for its turn there, instead of sleeping and seeing that it has not finished."""

    def __init__(self) -> None:
        super().__init__()
        self.blocked = 0
        self._changed = threading.Condition()  # (taken with ours held, never the other way round)

    def wait(self, timeout=None):
        with self._changed:
            self.blocked += 1
            self._changed.notify_all()
        try:
            return super().wait(timeout)
        finally:
            with self._changed:
                self.blocked -= 1

    def until_blocked(self, n: int) -> None:
        with self._changed:
            assert self._changed.wait_for(lambda: self.blocked >= n, WAIT_S), f"{n} waiting, {self.blocked} came"


def _in_thread(fn, out: list) -> threading.Thread:
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    return t


def test_an_urgent_call_runs_beside_a_held_call_in_flight_and_a_growth_waits_for_both(enc, monkeypatch):
    """The encoder's two lanes: a commit's call (urgent) runs while a call of held audio is in flight; a growth of
    the KV pool (which moves every stream's rows) waits until no call is in flight, and no call starts meanwhile.
    Codes equal each stream alone."""
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(2)
    held, urgent = e.open_stream(), e.open_stream()
    pcm_h, pcm_u = speech_like(0.6, seed=51), speech_like(0.5, seed=52)
    gate = StepGate(monkeypatch, e)
    lanes = CountedLanes()
    monkeypatch.setattr(e, "_lanes", lanes)
    held_out: list = []
    t_held = _in_thread(lambda: e.batch(urgent=False).step([(held, pcm_h)]), held_out)
    assert gate.inside.wait(WAIT_S)
    assert e.batch().step([(urgent, pcm_u[:4000])]) == [enc.open_stream().push(pcm_u[:4000])]  # not waiting
    opened: list = []
    t_open = _in_thread(e.open_stream, opened)  # both slots taken: the pool must grow
    lanes.until_blocked(1)
    assert e._growing == 1 and opened == [] and e.runner.kv.capacity == 2  # waiting for the held call
    urgent_out: list = []
    t_urgent = _in_thread(lambda: e.batch().finalize([urgent], [pcm_u[4000:]]), urgent_out)
    lanes.until_blocked(2)
    assert urgent_out == [] and t_urgent.is_alive()  # a call does not start while a growth waits
    gate.gate.set()
    for t in (t_held, t_open, t_urgent):
        t.join(WAIT_S)
    assert e.runner.kv.capacity == 4 and len(opened) == 1
    alone = enc.open_stream()
    assert held_out == [[alone.push(pcm_h)]]
    alone.close()
    assert e.batch().finalize([held])[0] == enc.encode(pcm_h)[len(held_out[0][0]):]
    u_alone = enc.open_stream()
    u_alone.push(pcm_u[:4000])
    assert urgent_out == [[u_alone.finalize(pcm_u[4000:])]]
    opened[0].close()
    assert e.runner.kv.in_use == 0


def test_a_held_step_small_enough_for_the_urgent_graphs_goes_in_their_lane():
    """A held step of no more streams than the urgent graphs hold may replay them, so it waits for an urgent call in
    flight (one replay of a graph at a time); a bigger one runs beside it, and so does a small one once a growth of
    the pool has retired the graphs."""
    e = SpeechEncoder.load("tiny-random", device="cpu")
    e.reserve(8)
    e.runner.graphs = EagerStepGraphs(e.runner, 2)
    e.runner.graphs.capture()

    def busy_lane(urgent: bool, streams: int) -> set[str]:
        with e._lane(urgent, streams):
            return set(e._busy)

    assert [busy_lane(False, 2), busy_lane(False, 3), busy_lane(True, 3)] == [{"urgent"}, {"held"}, {"urgent"}]
    with pytest.MonkeyPatch.context() as mp:
        gate = StepGate(mp, e, urgent=True)
        streams = [e.open_stream() for _ in range(6)]
        lanes = CountedLanes()
        mp.setattr(e, "_lanes", lanes)
        pcm = speech_like(0.4, seed=53)
        outs: list[list] = [[], [], []]
        t_urgent = _in_thread(lambda: e.batch().step([(streams[0], pcm)]), outs[0])
        assert gate.inside.wait(WAIT_S)
        t_small = _in_thread(lambda: e.batch(urgent=False).step([(s, pcm) for s in streams[1:3]]), outs[1])
        t_big = _in_thread(lambda: e.batch(urgent=False).step([(s, pcm) for s in streams[3:6]]), outs[2])
        t_big.join(WAIT_S)
        lanes.until_blocked(1)  # the small step waits for the urgent lane
        assert outs[2] and t_small.is_alive() and not outs[1]
        gate.gate.set()
        t_urgent.join(WAIT_S)
        t_small.join(WAIT_S)
    alone = SpeechEncoder.load("tiny-random", device="cpu").open_stream().push(pcm)
    assert outs == [[[alone]], [[alone] * 2], [[alone] * 3]]
    assert e.runner.graphs.replays > 0
    more = [e.open_stream() for _ in range(3)]  # 9 streams: the pool grows, the graphs hold its old tensors
    assert e._lane_of(False, 2) == "held" and e._lane_of(True, 1) == "urgent"
    for s in streams + more:
        s.close()


def test_a_step_that_fails_gives_its_lane_back(monkeypatch):
    e = SpeechEncoder.load("tiny-random", device="cpu")
    s = e.open_stream()

    def broken(*_a, **_k):
        raise RuntimeError("the device failed")

    with monkeypatch.context() as mp:
        mp.setattr(e.runner, "run", broken)
        for urgent in (True, False):
            with pytest.raises(RuntimeError, match="the device failed"):
                e.batch(urgent).step([(s, speech_like(0.2))])
    assert e._busy == set()
    assert e.batch().step([(s, speech_like(0.2))]) == [SpeechEncoder.load("tiny-random").open_stream().push(
        speech_like(0.2))]
