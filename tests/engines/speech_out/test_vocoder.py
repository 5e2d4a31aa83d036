"""Codec decoder vocoders: windowed outputs are copies of the rendered windows, HiFT's iSTFT equals torch's, and
HiFT noise passed in gives the PCM of the inline draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.engines.speech_out.decoder_rounds import _codes, _stream

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
