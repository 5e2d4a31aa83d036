"""Streaming codec decoder (flow + vocoders) on tiny random weights, CPU."""

from __future__ import annotations

import json
import math
import wave
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engines.audio.wav import write_wav
from engines.bench.codec_rounds import SteadyRounds
from engines.speech_out import BadCodesError, CodecDecoder, MelMismatchError, MelSpec, Voice
from engines.speech_out.checkpoint import CheckpointError
from engines.speech_out.config import HiFTConfig
from engines.speech_out.presets import DECODER_PRESETS
from engines.speech_out.random_codec import write_random_codec, write_random_decoder
from engines.speech_out.vocoder.vocoder import HiFTVocoder
from tests.engines.speech_out.campplus_stand_in import WEIGHT, write_campplus_stand_in
from tests.engines.speech_out.decoder_rounds import in_rounds

SPC = 1920  # samples per code
# Streamed vs offline run the same ops on the same shapes: equal up to float noise.
STREAM_TOL = 1e-6
# Batched vs alone: different batch shapes may pick different kernels; float32 rounding only.
BATCH_TOL = 1e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def hift_dec() -> CodecDecoder:
    return CodecDecoder.load("tiny-random", vocoder="hift")


@pytest.fixture(scope="module")
def bigvgan_dec() -> CodecDecoder:
    return CodecDecoder.load("tiny-random", vocoder="bigvgan")


def _codes(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 16384, n)


def _stream(dec: CodecDecoder, codes: np.ndarray, sizes: list[int], seed: int = 0, voice=None) -> list[np.ndarray]:
    s = dec.open_stream("t", voice=voice, seed=seed)
    parts, i, k = [], 0, 0
    while i < len(codes):
        n = sizes[k % len(sizes)]
        parts.append(s.push(codes[i:i + n]))
        i, k = i + n, k + 1
    parts.append(s.finalize())
    s.close()
    return parts


@pytest.mark.parametrize("vocoder", ["hift", "bigvgan"])
def test_streamed_equals_offline_and_length(vocoder, hift_dec, bigvgan_dec):
    dec = hift_dec if vocoder == "hift" else bigvgan_dec
    codes = _codes(27)
    offline = dec.decode(codes, seed=7)
    assert offline.shape == (27 * SPC,) and offline.dtype == np.float32
    assert np.isfinite(offline).all() and np.abs(offline).max() > 1e-4  # not silence
    parts = _stream(dec, codes, [1, 4, 2, 7, 3], seed=7)
    streamed = np.concatenate(parts)
    assert streamed.shape == offline.shape
    np.testing.assert_allclose(streamed, offline, atol=STREAM_TOL, rtol=0)
    # Nothing comes out before the first chunk's 5 + 3 codes; then 9600 samples per chunk minus the held tail.
    first = dec.open_stream("f", seed=7)
    assert first.push(codes[:7]).size == 0
    assert first.push(codes[7:8]).size == 5 * SPC - 2 * 480


def test_vocoder_outputs_are_copies_of_the_rendered_windows(hift_dec):
    """WindowedVocoder.finish hands out PCM and keeps tails that are copies, never views of `render`'s windows (on
    CUDA a pinned buffer that must go back to the allocator's cache); a final window keeps no tail."""
    dec = hift_dec
    M, F = dec.cfg.stream.voc_ctx_frames, dec.cfg.stream.chunk_codes * dec.cfg.flow.token_mel_ratio
    mel = torch.randn(2, dec.cfg.flow.output_size, F, generator=torch.Generator().manual_seed(3)) - 5
    states = [dec.windowed.new_state(dec.default_voice.mel, torch.Generator().manual_seed(i)) for i in range(2)]
    gens = [torch.Generator().manual_seed(10 + i) for i in range(2)]
    for step in range(2):  # a first window (no tail yet), then one crossfaded with it
        r = dec.windowed.render(mel, states, gens)
        assert r.frames == F and r.wav.shape[1] >= (M + F) * dec.windowed.hop
        pcm = dec.windowed.finish(r, states, [False, step == 1])
        assert [p.size for p in pcm] == ([F * dec.windowed.hop - dec.windowed.hold] * 2 if step == 0 else
                                         [F * dec.windowed.hop, F * dec.windowed.hop + dec.windowed.hold])
        for x in [*pcm, *(s.tail for s in states if s.tail is not None)]:
            assert not np.shares_memory(x, r.wav.numpy())
    assert states[0].tail is not None and states[1].tail is None  # the second session's last window was final


@pytest.mark.parametrize("n", [1, 4, 5, 8, 13])
def test_short_and_odd_lengths(hift_dec, n):
    out = hift_dec.decode(_codes(n, seed=n), seed=1)
    assert out.shape == (n * SPC,)
    assert hift_dec.decode([], seed=1).shape == (0,)


def test_seams_no_worse_than_signal(hift_dec):
    codes = _codes(43, seed=3)
    parts = _stream(hift_dec, codes, [5], seed=2)
    y = np.concatenate(parts)
    jumps = np.abs(np.diff(y))
    seams = np.cumsum([p.size for p in parts if p.size])[:-1]  # first sample of each new piece
    seam_jumps = jumps[seams - 1]
    assert seam_jumps.max() <= jumps.max()
    # A crossfade region must not be a discontinuity either: compare to the typical jump in the signal.
    assert seam_jumps.max() <= np.quantile(jumps, 0.999)


def test_same_seed_same_pcm_and_seed_matters(hift_dec):
    codes = _codes(16, seed=5)
    a = hift_dec.decode(codes, seed=11)
    b = hift_dec.decode(codes, seed=11)
    c = hift_dec.decode(codes, seed=12)
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-4


def test_hift_istft_equals_torch_istft():
    from engines.speech_out.vocoder.hift import istft

    n_fft, hop, win = 16, 4, torch.hann_window(16)
    g = torch.Generator().manual_seed(0)
    spec = torch.complex(torch.randn(3, 9, 41, generator=g), torch.randn(3, 9, 41, generator=g))
    spec[:, 0].imag = 0  # DC and Nyquist bins of a real signal's spectrum are real
    spec[:, -1].imag = 0
    want = torch.istft(spec, n_fft, hop, n_fft, window=win)
    got = istft(spec, n_fft, hop, win)
    assert got.shape == want.shape == (3, 40 * hop)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_hift_noise_as_input_gives_the_pcm_of_the_inline_draw_and_torch_istft(hift_dec, monkeypatch):
    """The graph-ready HiFT (noise drawn by render with each session's generator, graph-safe iSTFT) decodes the same
    PCM, for the same seed, as the previous form: noise drawn inline per session and torch.istft."""
    import engines.speech_out.vocoder.hift as hift_mod

    codes = _codes(17, seed=8)
    got = _stream(hift_dec, codes, [5, 3, 7], seed=21)
    gen = hift_dec.vocoder.generator

    def previous_render(mel, states, gens, keep_at):
        H, S = gen.n_harmonics, mel.shape[2] * hift_dec.vocoder.mel.hop
        noise = torch.stack([torch.randn(H, S, generator=g, device=mel.device, dtype=mel.dtype) for g in gens])
        wav, nxt = gen(mel, torch.stack([s.phase for s in states]), noise, keep_at)
        for b, s in enumerate(states):
            s.phase = nxt[b]
        return wav

    monkeypatch.setattr(hift_mod, "istft", lambda spec, n_fft, hop, w: torch.istft(spec, n_fft, hop, n_fft, window=w))
    monkeypatch.setattr(hift_dec.vocoder, "render", previous_render)
    want = _stream(hift_dec, codes, [5, 3, 7], seed=21)
    assert [p.shape for p in got] == [p.shape for p in want]
    np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-6, rtol=0)


def test_batch_equals_alone_with_different_voices(hift_dec):
    voices = [None, Voice.random(seed=5, n_codes=3), Voice.random(seed=6, n_codes=11), Voice.empty()]
    lengths = [13, 27, 9, 21]
    codes = [_codes(n, seed=20 + i) for i, n in enumerate(lengths)]
    alone = [hift_dec.decode(c, voice=v, seed=i) for i, (c, v) in enumerate(zip(codes, voices, strict=True))]
    streams = []
    for i, (c, v) in enumerate(zip(codes, voices, strict=True)):
        streams.append(hift_dec.open_stream(f"s{i}", voice=v, seed=i))
        streams[-1].add(c)
    got, batch_sizes = in_rounds(hift_dec, streams)
    assert max(batch_sizes) == 4  # really decoded together
    for i in range(4):
        y = got[i]
        assert y.shape == (lengths[i] * SPC,)
        np.testing.assert_allclose(y, alone[i], atol=BATCH_TOL, rtol=0)


def test_random_voices_of_one_seed_and_other_lengths_are_cached_apart(hift_dec):
    """The decoder caches prepared voices by name, so two random voices of one seed but other prompt lengths must not
    share one (the second decoded with the first's prompt)."""
    a, b = Voice.random(seed=12, n_codes=4), Voice.random(seed=12, n_codes=9)
    assert hift_dec.prepared(a).n_codes == 4 and hift_dec.prepared(b).n_codes == 9


def test_batch_of_sessions_at_different_points_equals_each_alone(hift_dec):
    """Sessions that start rounds apart have windows of different lengths in one batch (and two voices,
    interleaved): run_jobs orders them into runs (FlowModel._runs); each still gets its own PCM."""
    voices = [None, Voice.random(seed=8, n_codes=4)]
    n = 6
    codes = [_codes(5 * (3 + i % 4), seed=70 + i) for i in range(n)]
    alone = [hift_dec.decode(c, voice=voices[i % 2], seed=i) for i, c in enumerate(codes)]
    queues: list[deque] = [deque() for _ in range(n)]
    got: list[list[np.ndarray]] = [[] for _ in range(n)]
    runs_seen = []
    runs = hift_dec.flow._runs
    hift_dec.flow._runs = lambda states: runs_seen.append(r := runs(states)) or r
    try:
        for rnd in range(12):
            for i in range(n):
                if rnd == i % 3:  # starts staggered by a round: windows of 0, 5 and 10 codes side by side
                    s = hift_dec.open_stream(f"s{i}", voice=voices[i % 2], seed=i)
                    s.add(codes[i])
                    queues[i].extend(s.take_jobs(finishing=True))
            idx = [i for i, q in enumerate(queues) if q]
            if idx:
                for i, pcm in zip(idx, hift_dec.run_jobs([queues[i].popleft() for i in idx]), strict=True):
                    got[i].append(pcm)
    finally:
        del hift_dec.flow._runs  # the class's own again
    assert not any(queues)
    assert max(len(r) for r in runs_seen) >= 4  # really mixed: several (voice, window) runs in one batch
    for i in range(n):
        np.testing.assert_allclose(np.concatenate(got[i]), alone[i], atol=BATCH_TOL, rtol=0)


def _steady_round_ops(dec: CodecDecoder, batch: int, voices: list) -> dict[str, int]:
    """Torch ops (views left out) of one steady-state round of `batch` sessions with full encoder windows."""
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "_unsafe_view", "slice", "select", "expand", "transpose", "t", "permute", "unsqueeze", "squeeze",
             "alias", "as_strided", "detach", "empty", "split", "unbind", "reshape", "narrow", "lift_fresh"}

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in views:
                self.ops[name] = self.ops.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    rounds = SteadyRounds(dec, batch, voices=voices)
    for _ in range(dec.cfg.stream.steady_chunks):  # until every window is full
        rounds.feed()
        assert len(rounds.decode()) == batch
    rounds.feed()
    with Count() as c:
        assert len(rounds.decode()) == batch
    rounds.close()
    return c.ops


def test_round_ops_grow_with_the_batch_only_by_each_sessions_noise_draws(hift_dec):
    """Per-session host work of a round is its own RNG draws (the flow's noise and HiFT's source noise); keys, windows
    and seams go as one op per run of sessions with the same voice (~25 us of host time per op on a GPU, held with
    the GIL by the codec's thread while the engine loop waits for it). Sessions of two voices, interleaved, are
    ordered into two runs."""
    voices = [None, Voice.random(seed=7, n_codes=6)]
    small, large = _steady_round_ops(hift_dec, 4, voices), _steady_round_ops(hift_dec, 8, voices)
    grown = {k: large.get(k, 0) - small.get(k, 0) for k in set(small) | set(large)}
    assert {k: v for k, v in grown.items() if v} == {"randn": 2 * (8 - 4)}


def test_state_is_bounded(hift_dec):
    s = hift_dec.open_stream("b", seed=0)
    sizes = []
    for i in range(12):
        s.push(_codes(5, seed=100 + i))
        sizes.append(s.state_bytes())
    enc_left = hift_dec.cfg.stream.enc_left_chunks
    assert len(set(sizes[enc_left + 1:])) == 1  # constant once the attention window is full
    assert s.flow_state.win_kv.shape[2] == enc_left * 5


@pytest.mark.parametrize("bad", [[1, 16384], [-1, 3], np.array([1.0, 2.0]), [[1, 2], [3, 4]], [True, False]])
def test_bad_codes_refused(hift_dec, bad):
    s = hift_dec.open_stream("x")
    with pytest.raises(BadCodesError) as e:
        s.push(bad)
    assert isinstance(e.value, ValueError)
    with pytest.raises(BadCodesError):
        hift_dec.decode(bad)


def test_mel_mismatch_refused():
    cfg = DECODER_PRESETS["tiny-random"]
    other = MelSpec(sample_rate=22050, n_mels=80, hop=256, n_fft=1024, win=1024, fmin=0, fmax=8000)
    hcfg = HiFTConfig(base_channels=16, nb_harmonics=1, f0_channels=8, upsample_rates=(8, 8), istft_hop=4,
                      upsample_kernel_sizes=(16, 16), source_resblock_kernel_sizes=(3, 3),
                      source_resblock_dilations=((1,), (1,)), resblock_kernel_sizes=(3,), resblock_dilations=((1,),),
                      mel=other)
    ref = CodecDecoder.load("tiny-random", vocoder="hift")
    with pytest.raises(MelMismatchError) as e:
        CodecDecoder(cfg, ref.flow, HiFTVocoder(hcfg), "test", Voice.empty())
    assert "hop=256" in str(e.value) and "hop=480" in str(e.value)


def test_bigvgan_config_mel_mismatch_refused_at_load(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    h = json.loads((tmp_path / "bigvgan" / "config.json").read_text())
    h.update(num_mels=100, hop_size=256, n_fft=1024, win_size=1024, fmax=12000)
    (tmp_path / "bigvgan" / "config.json").write_text(json.dumps(h))
    with pytest.raises(MelMismatchError) as e:
        CodecDecoder.load(tmp_path, vocoder="bigvgan")
    assert "n_mels=100" in str(e.value) and "n_mels=80" in str(e.value)


@pytest.mark.parametrize("vocoder", ["hift", "bigvgan"])
def test_written_checkpoint_loads_and_matches_preset(tmp_path, vocoder):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    assert (tmp_path / "flow" / "flow.pt").is_file() and (tmp_path / "flow" / "hift.pt").is_file()
    loaded = CodecDecoder.load(tmp_path, vocoder=vocoder)
    preset = CodecDecoder.load("tiny-random", vocoder=vocoder, seed=0)
    codes = _codes(12, seed=9)
    # Same weights; the written codec has no built-in voice, so compare with the same explicit voice.
    v = Voice.random(seed=3, n_codes=4)
    np.testing.assert_allclose(loaded.decode(codes, voice=v, seed=1), preset.decode(codes, voice=v, seed=1),
                               atol=1e-6, rtol=0)


def test_loader_names_missing_and_unexpected_keys(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    f = tmp_path / "flow" / "flow.pt"
    sd = torch.load(f, weights_only=True)
    sd.pop("encoder.after_norm.weight")
    sd["encoder.bogus.weight"] = torch.zeros(1)
    sd["encoder_proj.weight"] = torch.zeros(3, 3)
    torch.save(sd, f)
    with pytest.raises(CheckpointError) as e:
        CodecDecoder.load(tmp_path, vocoder="hift")
    msg = str(e.value)
    assert "encoder.after_norm.weight" in msg and "encoder.bogus.weight" in msg and "encoder_proj.weight" in msg
    assert str(f) in msg


def test_hift_accepts_old_weight_norm_names(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    f = tmp_path / "flow" / "hift.pt"
    sd = torch.load(f, weights_only=True)
    old = {}
    for k, v in sd.items():
        k = k.replace("parametrizations.weight.original0", "weight_g").replace("parametrizations.weight.original1",
                                                                               "weight_v")
        old["generator." + k] = v
    torch.save(old, f)
    a = CodecDecoder.load(tmp_path, vocoder="hift").decode(_codes(8), voice=Voice.random(1, 2), seed=0)
    b = CodecDecoder.load("tiny-random", vocoder="hift").decode(_codes(8), voice=Voice.random(1, 2), seed=0)
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_real_codec_without_bigvgan_says_use_hift(tmp_path):
    write_random_decoder(tmp_path, "tiny-random", seed=0)
    for p in (tmp_path / "bigvgan").iterdir():
        p.unlink()
    with pytest.raises(ValueError, match="hift"):
        CodecDecoder.load(tmp_path, vocoder="bigvgan")


def test_voice_from_wav_with_fake_encoder(tmp_path, hift_dec):
    # campplus.onnx is not written by the tests (no onnx builder dependency): the x-vector path is covered by
    # kaldi_fbank here and by campplus=None giving a zero x-vector.
    from engines.speech_out.voice import kaldi_fbank

    sr = 16000
    t = np.arange(int(0.9 * sr)) / sr
    pcm = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    path = tmp_path / "v.wav"
    write_wav(path, pcm, sr)
    v = Voice.from_wav(path, encode=lambda x: list(range(len(x) // 1280)), campplus=None)
    assert v.codes.shape[0] == 11 and v.mel.shape == (80, 44) and torch.count_nonzero(v.xvector) == 0
    fb = kaldi_fbank(torch.from_numpy(pcm))
    assert fb.shape == (1 + (len(pcm) - 400) // 160, 80) and torch.isfinite(fb).all()
    # The 220 Hz tone's band is the loudest.
    assert int(fb.mean(0).argmax()) < 20
    out = hift_dec.decode(_codes(6), voice=v, seed=0)
    assert out.shape == (6 * SPC,)


def test_cli_decode_writes_exact_length_wav(tmp_path):
    from moss_speech.commands import codec_decode as decode

    codes_file = tmp_path / "codes.txt"
    codes_file.write_text("1, 2 3\n4,5 6 7 8 9 10 11")
    out = tmp_path / "o.wav"
    args = SimpleNamespace(codec="tiny-random", codes=str(codes_file), out=str(out), vocoder="hift", stream=True,
                           device="cpu", seed=0, voice=None)
    assert decode.run(args) == 0
    with wave.open(str(out)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()) == (24000, 1, 2, 11 * SPC)
    # A WAV voice prompt goes through the codec's encoder; the output length does not depend on it.
    args.voice, args.stream = str(out), False
    assert decode.run(args) == 0
    with wave.open(str(out)) as w:
        assert w.getnframes() == 11 * SPC
    np.save(tmp_path / "c.npy", np.array([3, 16384]))
    args.codes = str(tmp_path / "c.npy")
    assert decode.run(args) == 2


def test_bf16_estimator_runs_close_to_float32():
    codes = _codes(13, seed=4)
    f32 = CodecDecoder.load("tiny-random", vocoder="hift")
    ref = f32.decode(codes, seed=0)
    other_seed = f32.decode(codes, seed=1)
    bf = CodecDecoder.load("tiny-random", vocoder="hift", estimator_dtype="bfloat16").decode(codes, seed=0)
    assert bf.shape == ref.shape and np.isfinite(bf).all()
    # bf16 rounding must move the waveform far less than changing the session's noise does.
    assert np.abs(ref - bf).max() < 0.1 * np.abs(ref - other_seed).max()


def test_campplus_xvector_through_onnxruntime(tmp_path):
    """A stand-in campplus.onnx (max over time of the fbank, then a fixed 80 x 192 matrix) checks the feature
    normalisation, the onnxruntime call and the output shape; the real CAM++ network is not available here."""
    from engines.speech_out.voice import campplus_xvector, kaldi_fbank

    path = write_campplus_stand_in(tmp_path / "campplus.onnx")
    wav = torch.from_numpy(np.random.default_rng(1).standard_normal(16000).astype(np.float32) * 0.1)
    got = campplus_xvector(wav, path)
    fb = kaldi_fbank(wav)
    want = (fb - fb.mean(0, keepdim=True)).amax(0).numpy() @ WEIGHT
    assert got.shape == (192,)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-3)


def test_whole_random_codec_dir_serves_both_halves(tmp_path):
    from engines.speech_in import SpeechEncoder

    write_random_codec(tmp_path, "tiny-random", seed=0)
    codes = SpeechEncoder.load(tmp_path).encode(np.zeros(16000, dtype=np.float32))
    pcm = CodecDecoder.load(tmp_path, vocoder="hift").decode(codes)
    assert len(codes) > 0 and pcm.shape == (len(codes) * SPC,)


def _reference_estimator(est, x, mu, t, spks, cond, mask):
    """The estimator written out straightforwardly (per-row time MLP, separate q/k/v GEMMs, bool mask, pad + conv,
    unfused LayerNorm/Mish) from the same weights: the optimised path must compute the same function."""
    import math

    import torch.nn.functional as F

    def causal_conv(conv, h):
        return F.conv1d(F.pad(h, (conv.kernel_size[0] - 1, 0)), conv.weight, conv.bias)

    def block(b, h):
        conv, norm = b.block[0], b.block[2]
        h = causal_conv(conv, h).transpose(1, 2)
        return F.mish(F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps).transpose(1, 2))

    def resnet(r, h, temb):
        h1 = block(r.block1, h) + r.mlp(temb)[:, :, None]
        return block(r.block2, h1) + r.res_conv(h)

    def transformer(tb, h):
        B, T, _ = h.shape
        a = tb.attn1
        n = tb.norm1(h)
        q, k, v = (m(n).view(B, T, a.h, a.dh).transpose(1, 2) for m in (a.to_q, a.to_k, a.to_v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + a.to_out[0](o.transpose(1, 2).reshape(B, T, a.h * a.dh))
        return h + tb.ff.net[2](F.gelu(tb.ff.net[0].proj(tb.norm3(h))))

    def attend(h, blocks):
        h = h.transpose(1, 2)
        for tb in blocks:
            h = transformer(tb, h)
        return h.transpose(1, 2)

    half = est.in_channels // 2
    freq = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(10000.0) / (half - 1)))
    ang = 1000.0 * t.float()[:, None] * freq[None]
    temb = est.time_mlp(torch.cat([ang.sin(), ang.cos()], dim=-1))
    h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)
    r, blocks, down = est.down_blocks[0]
    h = attend(resnet(r, h, temb), blocks)
    skip = h
    h = causal_conv(down, h)
    for r, blocks in est.mid_blocks:
        h = attend(resnet(r, h, temb), blocks)
    r, blocks, up = est.up_blocks[0]
    h = causal_conv(up, attend(resnet(r, torch.cat([h, skip], dim=1), temb), blocks))
    return est.final_proj(block(est.final_block, h))


@torch.inference_mode()
def test_merged_conv_weight_computes_block1_conv_and_res_conv(hift_dec):
    """The CUDA resnet's one conv weight (block1's conv | res_conv on the last tap) read as the CUDA kernels read it
    (an implicit GEMM over the shifted frames) gives both convs' outputs."""
    from engines.speech_out.flow.estimator import _conv_with_pointwise

    r = hift_dec.flow.decoder.estimator.mid_blocks[0][0]
    conv = r.block1.block[0]
    w, b = _conv_with_pointwise(conv, r.res_conv)
    k, cin, T = conv.kernel_size[0], conv.in_channels, 9
    x = torch.randn(2, cin, T, generator=torch.Generator().manual_seed(1))
    xp = torch.nn.functional.pad(x, (k - 1, 0))
    # out[:, :, t] = b + sum over taps of W[tap * Cin:(tap + 1) * Cin].T @ x[:, :, t - (k - 1) + tap]
    got = b[None, :, None] + sum(torch.einsum("bct,cn->bnt", xp[:, :, tap:tap + T], w[tap * cin:(tap + 1) * cin])
                                 for tap in range(k))
    want = torch.cat([conv(x), r.res_conv(x)], dim=1)
    assert w.shape == (k * cin, 2 * conv.out_channels)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_optimised_estimator_equals_straightforward_computation(hift_dec):
    """Time table per Euler step + fused q/k/v + additive window mask + fused tails == the plain computation."""
    flow = hift_dec.flow
    est = flow.decoder.estimator
    C, F_ = hift_dec.cfg.stream.est_ctx_frames, 4 * hift_dec.cfg.stream.chunk_codes
    W, B = C + F_, 3
    g = torch.Generator().manual_seed(0)
    x, mu, cond = (torch.randn(B, 80, W, generator=g) for _ in range(3))
    spks = torch.randn(B, 80, generator=g)
    idx = torch.arange(W)
    bool_mask = (idx[None, :] < C) | (idx[:, None] >= C)
    from engines.speech_out.flow.estimator import window_mask

    table = est.time_table(flow.t_span, torch.float32)
    h = torch.cat([x, mu, spks[:, :, None].expand_as(x), cond], dim=1)
    for s in range(flow.cfg.n_timesteps):
        t = torch.full((B,), flow.t_span[s])
        want = _reference_estimator(est, x, mu, t, spks, cond, bool_mask)
        got = est.run(h, table[s], window_mask(W, C, torch.device("cpu"), torch.float32))
        scale = want.abs().max()
        assert scale > 1e-3
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * float(scale))
        # The arbitrary-t entry point runs the same core.
        torch.testing.assert_close(est(x, mu, t, spks, cond, bool_mask), want, rtol=0, atol=1e-5 * float(scale))
    # The table follows the weights: an in-place change is noticed.
    w = est.mid_blocks[0][0].mlp[1].bias
    w.add_(1.0)
    try:
        assert not torch.equal(est.time_table(flow.t_span, torch.float32), table)
    finally:
        w.sub_(1.0)


def test_a_solve_in_pieces_gives_the_same_pcm_and_yields_between_them(hift_dec):
    """FlowModel.solve_parts: a full chunk's Euler steps run as consecutive pieces, with run_jobs' `between` after the
    encoder and each piece; a last partial chunk runs whole. The PCM is that of the whole solve, bit for bit."""
    codes = _codes(23, seed=5)
    want = hift_dec.decode(codes, seed=3)
    steps = hift_dec.cfg.flow.n_timesteps
    calls: list[int] = []
    hift_dec.flow.solve_parts = 2
    try:
        assert hift_dec.flow.step_ranges(4 * hift_dec.cfg.stream.chunk_codes) == [(0, steps // 2), (steps // 2, steps)]
        assert hift_dec.flow.step_ranges(4) == [(0, steps)]
        s = hift_dec.open_stream("pieces", seed=3)
        s.add(codes.tolist())
        jobs = s.take_jobs()
        got = [hift_dec.run_jobs([j], between=lambda: calls.append(1))[0] for j in jobs]
        tail = s.take_jobs(finishing=True)
        got += [hift_dec.run_jobs([j], between=lambda: calls.append(2))[0] for j in tail]
    finally:
        hift_dec.flow.solve_parts = 1
    np.testing.assert_array_equal(np.concatenate(got), want)
    assert len(jobs) == 4 and calls.count(1) == 4 * (1 + 2)  # encoder + 2 pieces per full chunk
    assert [len(j.codes) for j in tail] == [3] and calls.count(2) == 1 + 1  # a partial chunk: encoder + 1 piece


@torch.inference_mode()
def test_euler_equals_straightforward_solve(hift_dec):
    """The Euler solve with the prebuilt input buffer and fused CFG update == the step-by-step textbook solve."""
    flow, cfg = hift_dec.flow, hift_dec.cfg
    est = flow.decoder.estimator
    C, F_ = cfg.stream.est_ctx_frames, 4 * cfg.stream.chunk_codes
    B = 2
    g = torch.Generator().manual_seed(1)
    z = torch.randn(B, 80, F_, generator=g)
    ctx = torch.randn(B, cfg.flow.n_timesteps, 80, C, generator=g)
    mu, cond = (torch.randn(B, 80, C + F_, generator=g) for _ in range(2))
    spks = torch.randn(B, 80, generator=g)
    got_x, got_traj = flow.euler(z, ctx, mu, cond, spks)
    idx = torch.arange(C + F_)
    mask = (idx[None, :] < C) | (idx[:, None] >= C)
    x, r = z, cfg.flow.cfg_rate
    for s in range(cfg.flow.n_timesteps):
        torch.testing.assert_close(got_traj[:, s], x, rtol=0, atol=1e-5)
        t0, t1 = flow.t_span[s], flow.t_span[s + 1]
        xw = torch.cat([ctx[:, s], x], dim=2)
        t = torch.full((2 * B,), t0)
        v = _reference_estimator(est, torch.cat([xw, xw]), torch.cat([mu, 0 * mu]), t,
                                 torch.cat([spks, 0 * spks]), torch.cat([cond, 0 * cond]), mask)
        x = x + (t1 - t0) * ((1 + r) * v[:B] - r * v[B:])[:, :, C:]
    assert x.abs().max() > 1e-3
    torch.testing.assert_close(got_x, x, rtol=0, atol=1e-5 * float(x.abs().max()))


# ---- the encoder's static shapes (what lets EncoderGraphs replay it) -------------------------------------------------
def _table_gather_relative(attn, q: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """The former formulation, kept here as the reference: a sinusoid table over every query-key distance in
    [lo, hi], projected through linear_pos, then gathered per (query, key). q [B, T, H, dk] -> [B, H, T, K]."""
    from engines.speech_out.flow.conformer import sinusoid

    B, T, H, dk = q.shape
    dist = qpos[:, :, None] - kpos[:, None, :]  # [B, T, K]
    lo, hi = int(dist.min()), int(dist.max())
    p = attn.linear_pos(sinusoid(torch.arange(lo, hi + 1), H * dk)).view(-1, H, dk)  # [R, H, dk]
    bd_all = torch.einsum("bthd,rhd->bhtr", q + attn.pos_bias_v, p)  # [B, H, T, R]
    return bd_all.gather(-1, (dist - lo)[:, None].expand(B, H, T, kpos.shape[1]))


def _exact_relative(attn, q: torch.Tensor, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """The relative term in float64 (angles exact to ~1e-12): the ground truth both float32 forms are held to."""
    B, T, H, dk = q.shape
    D = H * dk
    w = torch.exp(torch.arange(0, D, 2, dtype=torch.float64) * (-math.log(10000.0) / D))
    ang = (qpos[:, :, None] - kpos[:, None, :]).double()[..., None] * w  # [B, T, K, D/2]
    table = torch.stack([ang.sin(), ang.cos()], -1).flatten(-2)  # [B, T, K, D]: sin on even, cos on odd channels
    g = torch.einsum("bthc,hcj->bhtj", (q + attn.pos_bias_v).double(), attn.linear_pos.weight.double().view(H, dk, D))
    return torch.einsum("bhtj,btkj->bhtk", g, table)


@torch.inference_mode()
@pytest.mark.parametrize("at", [30, 1000, 5000])
def test_relative_term_from_sin_cos_factors_equals_table_and_gather(at):
    from engines.speech_out.flow.conformer import KV, AttnContext, RelPosSelfAttention

    torch.manual_seed(0)
    D, H, T = 64, 4, 20
    attn = RelPosSelfAttention(D, H)
    attn.pos_bias_v.normal_()
    q = torch.randn(2, T, H, D // H)
    # Row 0: a 100-code prompt, then a 20-key window just behind queries at `at`; row 1: a 120-key window only.
    qpos = torch.stack([at + torch.arange(T), at // 2 + torch.arange(T)])
    ppos = torch.stack([torch.cat([torch.arange(100), at - 20 + torch.arange(20)]),
                        at // 2 - 120 + torch.arange(120)]).clamp(min=0)
    kpos = torch.cat([ppos, qpos], 1)
    z = torch.zeros(2, 120, H, D // H)
    got = attn.relative(q, AttnContext.build(qpos, KV(z, z, ppos, torch.ones(2, 120, dtype=torch.bool)), D,
                                             torch.float32))
    want = _table_gather_relative(attn, q, qpos, kpos)
    exact = _exact_relative(attn, q, qpos, kpos)
    assert got.shape == want.shape == (2, H, T, 140)
    scale = float(exact.abs().max())
    assert scale > 1.0
    # float32 angles pos * w are rounded by up to half an ulp of the position (2.4e-4 rad at 5000) in both forms (the
    # table rounds distance angles, the factors round query and key angles): measured |error| / scale is 5e-7 at 30,
    # 9e-6 at 1000, 5e-5 at 5000 for either form against float64, and the same between the two.
    tol = 2e-8 * max(at, 100) * scale
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=tol)
    torch.testing.assert_close(want.double(), exact, rtol=0, atol=tol)


def _args_at(dec: CodecDecoder, voice, done: int, codes_seed: int):
    """encode()'s inputs for the next full chunk of a fresh stream that has decoded `done` codes."""
    s = dec.open_stream("e", voice=voice, seed=0)
    s.push(_codes(done + dec.cfg.flow.pre_lookahead, seed=codes_seed))
    assert s.flow_state.codes_done == done
    return s.flow_state


@torch.inference_mode()
def test_prefix_padded_to_alignment_gives_the_unpadded_encoding(hift_dec):
    from engines.speech_out.flow.state import PREFIX_ALIGN, padded_prefix

    flow, r = hift_dec.flow, hift_dec.cfg.flow.token_mel_ratio
    state = _args_at(hift_dec, Voice.random(seed=3, n_codes=11), 10, 40)
    L, U = 11 + 10, (11 + 10) * r  # prompt + window keys of each stack
    codes = torch.as_tensor(_codes(8, seed=4))[None]
    args = list(flow.encode_inputs([state], codes, 5, [3]))
    X, kpos, kvalid, upX, up_kpos, up_kvalid = args[6:]
    assert X.shape[3] == padded_prefix(L) > L and upX.shape[3] == padded_prefix(U) > U
    assert X.shape[3] % PREFIX_ALIGN == 0 and upX.shape[3] % PREFIX_ALIGN == 0
    assert kvalid[:, :L].all() and not kvalid[:, L:].any() and up_kvalid[:, :U].all() and not up_kvalid[:, U:].any()
    trimmed = args[:6] + [X[:, :, :, :L], kpos[:, :L], kvalid[:, :L], upX[:, :, :, :U], up_kpos[:, :U],
                          up_kvalid[:, :U]]
    # Garbage in the padded keys and their positions must not matter: they are masked.
    g = torch.Generator().manual_seed(0)
    X, upX, kpos, up_kpos = X.clone(), upX.clone(), kpos.clone(), up_kpos.clone()
    X[:, :, :, L:] = 100 * torch.randn(X[:, :, :, L:].shape, generator=g)
    upX[:, :, :, U:] = 100 * torch.randn(upX[:, :, :, U:].shape, generator=g)
    kpos[:, L:], up_kpos[:, U:] = 777, -5
    padded = args[:6] + [X, kpos, kvalid, upX, up_kpos, up_kvalid]
    want, got = flow.encode(*trimmed), flow.encode(*padded)
    assert want[0].shape == (1, 80, 5 * r) and float(want[0].abs().max()) > 1e-2
    for a, b in zip(got, want, strict=True):
        # Same keys, only masked ones added: float32 softmax/matmul over a longer row, rounding only.
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_encode_real_rows_unchanged_by_rows_repeated_as_batch_padding(hift_dec):
    flow = hift_dec.flow
    states = [_args_at(hift_dec, None, 15, 50), _args_at(hift_dec, Voice.random(seed=5, n_codes=3), 5, 51),
              _args_at(hift_dec, Voice.random(seed=6, n_codes=40), 0, 52)]
    codes = torch.as_tensor(np.stack([_codes(8, seed=60 + i) for i in range(3)]))
    args = flow.encode_inputs(states, codes, 5, [3, 1, 0])
    want = flow.encode(*args)
    # As BucketGraphs.run pads a batch of 3 to the bucket of 4 (here 3 more rows to also repeat several times).
    got = flow.encode(*[torch.cat([t, t[-1:].expand(3, *t.shape[1:])]) for t in args])
    for a, b in zip(got, want, strict=True):
        assert a.shape[0] == 6 and b.shape[0] == 3
        torch.testing.assert_close(a[:3], b, rtol=0, atol=BATCH_TOL)
        torch.testing.assert_close(a[3:], b[2:].expand_as(a[3:]), rtol=0, atol=BATCH_TOL)


def test_precaptured_prefix_lengths_cover_every_full_chunk(hift_dec, monkeypatch):
    """EncoderGraphs.prefix_lengths(P) lists every (codes, frames) prefix length a full chunk of a voice with P
    prompt codes reaches, so the pre-captured graphs serve a whole answer (CUDA itself is tested in tests/gpu)."""
    from engines.speech_out.chunk_graphs import EncoderGraphs

    flow = hift_dec.flow
    seen = []
    real = flow.encode

    def spy(*args):
        if args[0].shape[1] == 5 + flow.cfg.pre_lookahead:
            seen.append((args[6].shape[3], args[9].shape[3]))
        return real(*args)

    monkeypatch.setattr(flow, "encode", spy)
    for voice in (None, Voice.empty(), Voice.random(seed=8, n_codes=30)):
        seen.clear()
        P = hift_dec.prepared(voice or hift_dec.default_voice).n_codes
        hift_dec.decode(_codes(47, seed=70), voice=voice)
        lengths = EncoderGraphs(flow).prefix_lengths(P)
        assert len(seen) == 9 and set(seen) == set(lengths)
    # The tiny preset's default voice: 25 prompt codes + windows of 0, 5, .. 20 codes = 25..45 keys (-> 32, 32, 64,
    # 64, 64), 4 frames per code = 100..180 keys (-> 128, 128, 160, 160, 192).
    assert EncoderGraphs(flow).prefix_lengths(25) == [(32, 128), (64, 160), (64, 192)]


def _replay_stand_in(monkeypatch):
    """graphs.capture_graph replaced by a stand-in whose replay re-runs the function on its static inputs (CPU)."""
    import engines.speech_out.chunk_graphs as graphs_mod

    class Replay:
        def __init__(self, fn, out):
            self.fn, self.out, self.replays = fn, out, 0

        def replay(self):
            self.replays += 1
            for o, new in zip(self.out, self.fn(), strict=True):
                o.copy_(new)

        def pool(self):
            return None

    def stand_in(fn, stream, pool=None):
        out = fn()
        return Replay(fn, out), out

    monkeypatch.setattr(graphs_mod, "capture_graph", stand_in)
    monkeypatch.setattr(graphs_mod, "private_stream", lambda device, urgent=None: None)
    return graphs_mod


def test_bucket_graphs_pad_to_the_smallest_captured_batch_up_to_the_power_of_two(monkeypatch):
    """A call replays the smallest captured batch that holds it (FINE_BUCKETS' 6 for 5 rows), never more than its
    power-of-two bucket (captured on first use, as before); outputs are its own rows; the counts say what ran."""
    graphs_mod = _replay_stand_in(monkeypatch)
    assert graphs_mod.buckets_up_to(3, graphs_mod.FINE_BUCKETS) == [1, 2, 3]
    assert graphs_mod.buckets_up_to(33, graphs_mod.FINE_BUCKETS)[-3:] == [28, 32, 40]
    assert graphs_mod.buckets_up_to(33) == [1, 2, 4, 8, 16, 32, 64]
    g = graphs_mod.BucketGraphs(lambda x, k: (x * k + 1,))
    for b in graphs_mod.buckets_up_to(12, graphs_mod.FINE_BUCKETS):
        g.ensure([torch.zeros(b, 3)], (2,))
    x = torch.arange(15.0).view(5, 3)
    (y,) = g.run([x], (2,))
    assert torch.equal(y, x * 2 + 1)
    assert g.last_batch == 6  # 5 rows ran as 6
    assert g.padded(12, [x], (2,)) == 12 and g.padded(9, [x], (2,)) == 12
    # Other static arguments or shapes: nothing captured for them, so the power of two (as before), captured now.
    assert g.padded(5, [x], (3,)) == 8
    n = len(g.graphs)
    (y,) = g.run([x], (3,))
    assert torch.equal(y, x * 3 + 1) and len(g.graphs) == n + 1 and (8, (3,), 3) in g.graphs
    g.ensure([torch.zeros(16, 3)], (4,))
    assert g.padded(3, [x], (4,)) == 4  # 16 is captured, but 3 rows are not padded past their bucket
    # An owner that captures no more (EncoderGraphs once frozen) runs a shape it lacks eagerly; captured ones replay.
    g.may_capture = lambda: False
    n, last = len(g.graphs), g.last_batch
    (y,) = g.run([x], (5,))
    assert torch.equal(y, x * 5 + 1) and len(g.graphs) == n and g.last_batch == last
    (y,) = g.run([x], (2,))
    assert torch.equal(y, x * 2 + 1) and g.last_batch == 6


def test_run_jobs_counts_its_solves(hift_dec):
    """CodecDecoder.counts: one solve per chunk length in a call, the partial ones, and rows as run (no graphs on CPU:
    as many as sessions); take_counts hands them over and starts again."""
    dec = hift_dec
    chunk, la = dec.cfg.stream.chunk_codes, dec.cfg.flow.pre_lookahead
    dec.take_counts()
    a, b, c = (dec.open_stream(n, seed=i) for i, n in enumerate("abc"))
    a.add(_codes(chunk + la, seed=1))
    b.add(_codes(chunk + la, seed=2))
    c.add(_codes(2, seed=3))
    dec.run_jobs(a.take_jobs() + b.take_jobs() + c.take_jobs(finishing=True))
    got = dec.take_counts()
    assert (got.solves, got.partial, got.rows, got.padded_rows) == (2, 1, 3, 3)
    assert dec.take_counts().solves == 0


def _decode_sessions(dec: CodecDecoder, lengths: list[int]) -> dict[str, np.ndarray]:
    """Sessions s0, s1, ... of `lengths` codes (seeds 80 + i), all given at once and finished, then decoded in
    rounds (in_rounds): each session's PCM."""
    streams = [dec.open_stream(f"s{i}", seed=i) for i in range(len(lengths))]
    for i, (s, n) in enumerate(zip(streams, lengths, strict=True)):
        s.add(_codes(n, seed=80 + i))
    return {f"s{i}": pcm for i, pcm in enumerate(in_rounds(dec, streams)[0])}


def test_encoder_graphs_bookkeeping_with_a_replay_stand_in(hift_dec, monkeypatch):
    """EncoderGraphs on CPU, its capture replaced by a stand-in that re-runs FlowModel.encode on the static inputs at
    every replay: the pre-captured keys are the ones decoding uses (no capture while decoding), full chunks go
    through the graphs (batch padded to the bucket, outputs sliced back) and the result equals eager decoding."""
    graphs_mod = _replay_stand_in(monkeypatch)
    dec = CodecDecoder.load("tiny-random", vocoder="hift")
    dec.flow.enc_graphs = graphs_mod.EncoderGraphs(dec.flow)
    assert dec.capture_graphs(3) == 3 * 3  # buckets 1, 2, 4 x 3 prefix lengths (no Euler / vocoder graphs on CPU)
    keys = set(dec.flow.enc_graphs.graphs)
    lengths = [13, 21, 9]
    got = _decode_sessions(dec, lengths)
    assert set(dec.flow.enc_graphs.graphs) == keys
    replays = {k[0]: g.replays for k, (g, _, _) in dec.flow.enc_graphs.graphs.items() if g.replays}
    assert replays.get(4), replays  # the first chunks of all three sessions: batch 3 padded to 4
    for i, n in enumerate(lengths):
        want = hift_dec.decode(_codes(n, seed=80 + i), seed=i)
        np.testing.assert_allclose(got[f"s{i}"], want, atol=BATCH_TOL, rtol=0)
    # Once pre-captured, another voice's prefix lengths run eagerly instead of capturing in the middle of an answer.
    voice = Voice.random(seed=8, n_codes=30)
    other = dec.decode(_codes(17, seed=90), voice=voice, seed=4)
    assert set(dec.flow.enc_graphs.graphs) == keys
    np.testing.assert_allclose(other, hift_dec.decode(_codes(17, seed=90), voice=voice, seed=4), atol=BATCH_TOL, rtol=0)


def test_encoder_graph_inputs_written_in_place(monkeypatch):
    """A full chunk whose encoder graph is captured writes its inputs straight into the graph's buffers and its index
    inputs' host mirror (EncoderGraphs.buffers, then replay_staged: no per-input copy through EncoderGraphs.run), and
    what those held before changes nothing: with every buffer and host array filled with large values before it is
    written (the prefix keys past each session's own are masked; rows past the batch are not read) the PCM is the
    same, bit for bit."""
    graphs_mod = _replay_stand_in(monkeypatch)
    lengths = [13, 21, 9]

    def decode_all(poison: bool) -> tuple[dict[str, np.ndarray], int, int]:
        dec = CodecDecoder.load("tiny-random", vocoder="hift")
        graphs = dec.flow.enc_graphs = graphs_mod.EncoderGraphs(dec.flow)
        dec.capture_graphs(3)
        calls = {"run": 0, "in_place": 0}
        run, buffers = graphs.run, graphs.buffers

        def counted_run(*a):
            calls["run"] += 1
            return run(*a)

        def poisoned_buffers(*a):
            got = buffers(*a)
            if got is not None:
                calls["in_place"] += 1
                if poison:
                    for t in got[1]:
                        t.fill_(1e3 if t.is_floating_point() else 3)
                    for a in got[2]:
                        a.fill(3)
            return got

        monkeypatch.setattr(graphs, "run", counted_run)
        monkeypatch.setattr(graphs, "buffers", poisoned_buffers)
        return _decode_sessions(dec, lengths), calls["run"], calls["in_place"]

    clean, runs, in_place = decode_all(poison=False)
    poisoned, _, _ = decode_all(poison=True)
    assert runs == 0 and in_place >= 2, (runs, in_place)  # batches 3 (padded to 4), 2 and 1: all captured
    for k in clean:
        np.testing.assert_array_equal(poisoned[k], clean[k])
