"""HiFT's harmonic source against the codec's 24 kHz SineGen2 formula (FunAudioLLM/CosyVoice and
OpenMOSS/MOSS-Speech, cosyvoice/hifigan/generator.py), and its phase carried across streaming windows."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from engines.speech_out.presets import preset_config
from engines.speech_out.vocoder.hift import HiFTGenerator


@pytest.fixture(scope="module")
def gen() -> HiFTGenerator:
    torch.manual_seed(0)
    return HiFTGenerator(preset_config("tiny-random").hift).eval()


def sinegen2_phase(f0_frames: torch.Tensor, n_harm: int, sr: int, up: int, rand_ini: torch.Tensor) -> torch.Tensor:
    """SineGen2._f02sine's phase (radians) written out step by step: f0 [B, T] per frame -> [B, T * up, H].

    f0 is nearest-upsampled to samples (HiFTGenerator.f0_upsamp); each harmonic's per-sample increment is taken
    mod 1, the initial phase noise is added to the first sample, then the increments are linearly resampled to frame
    rate, summed there, scaled by the upsampling factor and linearly resampled back to the sample rate."""
    f0 = f0_frames.repeat_interleave(up, dim=1)[:, :, None]  # [B, S, 1]
    fn = f0 * torch.arange(1, n_harm + 1, dtype=f0.dtype)[None, None, :]  # [B, S, H]
    rad = (fn / sr) % 1
    rad[:, 0, :] = rad[:, 0, :] + rand_ini
    rad = F.interpolate(rad.transpose(1, 2), scale_factor=1 / up, mode="linear").transpose(1, 2)
    phase = torch.cumsum(rad, dim=1) * 2 * math.pi
    return F.interpolate(phase.transpose(1, 2) * up, scale_factor=up, mode="linear").transpose(1, 2)


def _f0(frames: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    f0 = 80 + 220 * torch.rand(2, frames, generator=g)
    f0[1, 3:6] = 0  # an unvoiced stretch
    return f0


@torch.inference_mode()
def test_source_equals_the_sinegen2_formula(gen):
    cfg = gen.cfg
    hop, H = cfg.mel.hop, gen.n_harmonics
    f0 = _f0(12, seed=1)
    # The reference adds random initial phases to the first sample only, which frame-rate resampling never reads.
    rand_ini = torch.rand(2, H)
    rand_ini[:, 0] = 0
    phase = sinegen2_phase(f0, H, cfg.mel.sample_rate, hop, rand_ini)
    assert torch.equal(phase, sinegen2_phase(f0, H, cfg.mel.sample_rate, hop, torch.zeros(2, H)))
    uv = (f0.repeat_interleave(hop, dim=1) > cfg.voiced_threshold).float()[:, :, None]
    want = torch.tanh(gen.m_source.l_linear(cfg.nsf_alpha * torch.sin(phase) * uv)).squeeze(-1)
    zeros = torch.zeros(2, H)
    got, _ = gen._source(f0, zeros, torch.zeros(2, H, 12 * hop), keep_at=0)
    assert got.shape == want.shape == (2, 12 * hop)
    assert (got - want).abs().max().item() < 1e-4


@torch.inference_mode()
def test_noise_enters_as_the_reference_scales_it(gen):
    cfg = gen.cfg
    hop, H = cfg.mel.hop, gen.n_harmonics
    f0 = _f0(4, seed=2)
    noise = torch.randn(2, H, 4 * hop, generator=torch.Generator().manual_seed(3))
    phase = sinegen2_phase(f0, H, cfg.mel.sample_rate, hop, torch.zeros(2, H)).transpose(1, 2)
    uv = (f0.repeat_interleave(hop, dim=1) > cfg.voiced_threshold).float()[:, None]
    amp = uv * cfg.nsf_sigma + (1 - uv) * cfg.nsf_alpha / 3
    sines = cfg.nsf_alpha * torch.sin(phase) * uv + amp * noise
    want = torch.tanh(gen.m_source.l_linear(sines.transpose(1, 2))).squeeze(-1)
    got, _ = gen._source(f0, torch.zeros(2, H), noise, keep_at=0)
    assert (got - want).abs().max().item() < 1e-4


@torch.inference_mode()
def test_carried_phase_continues_the_one_shot_source(gen):
    """A window starting k frames later, from the carried phase, renders the one-shot call's source from half a
    frame in (before that it holds its first frame's phase, as the one-shot call does at its own start)."""
    hop, H = gen.cfg.mel.hop, gen.n_harmonics
    f0 = _f0(14, seed=4)
    f0[1] = 150.0  # voiced throughout: the sine, not the zero, is compared
    silent = torch.zeros(2, H, 14 * hop)
    whole, _ = gen._source(f0, torch.zeros(2, H), silent, keep_at=0)
    k = 5
    _, carried = gen._source(f0[:, : k + 3], torch.zeros(2, H), silent[..., : (k + 3) * hop], keep_at=k * hop)
    later, _ = gen._source(f0[:, k:], carried, silent[..., k * hop:], keep_at=0)
    start = k * hop + hop // 2
    assert (later[:, hop // 2:] - whole[:, start:]).abs().max().item() < 1e-4


def test_a_session_starts_every_harmonic_at_phase_zero():
    from engines.speech_out.vocoder.vocoder import HiFTVocoder

    voc = HiFTVocoder(preset_config("tiny-random").hift)
    st = voc.init_state(torch.zeros(80, 3), 4, torch.Generator().manual_seed(5))
    assert torch.equal(st.phase, torch.zeros(voc.generator.n_harmonics))
