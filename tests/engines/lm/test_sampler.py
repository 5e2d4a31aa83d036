"""The published sampling rules, one per test: masks, penalty, temperature, top-k, top-p, greedy, modes, stops."""

from __future__ import annotations

import torch

from engines.api import ChannelSampling, SamplingParams
from engines.config import PRESETS, EngineConfig
from engines.lm.engine import Engine
from engines.lm.sampler import (
    AUDIO_CHANNEL,
    ChannelTensors,
    apply_repetition_penalty,
    mask_audio_logits,
    sample_channel,
)
from engines.tokens import AUDIO_PAD, ENDOFTEXT, EOSP, IM_END, MODALITY_PAD, SOSP, start_mode

MC = PRESETS["tiny-random"]
V = 64


def tensors(n=1, greedy=False, **kw) -> ChannelTensors:
    return ChannelTensors.build([ChannelSampling(**kw)] * n, [greedy] * n, torch.device("cpu"))


def draw(logits: torch.Tensor, t: ChannelTensors, seeds: range, seen=None) -> list[int]:
    """Sample one row under many seeds."""
    b = len(seeds)
    lg = logits.expand(b, -1).clone()
    seen = torch.zeros_like(lg, dtype=torch.bool) if seen is None else seen.expand(b, -1)
    t = ChannelTensors(*(x.expand(b) if isinstance(x, torch.Tensor) else x for x in vars(t).values()))
    return sample_channel(lg, seen, t, torch.tensor(list(seeds)), torch.zeros(b, dtype=torch.long), 0).tolist()


def test_audio_ids_past_eosp_are_never_sampled():
    logits = torch.zeros(1, MC.audio_vocab_size)
    logits[0, 16400] = 100.0
    masked = mask_audio_logits(logits, torch.tensor([5]), torch.tensor([0]))
    assert torch.isinf(masked[0, EOSP + 1:]).all() and masked[0, EOSP] == 0
    t = tensors(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0)
    assert all(tok <= EOSP for tok in draw(masked, t, range(200)))


def test_eosp_masked_until_min_new_tokens():
    logits = torch.zeros(2, MC.audio_vocab_size)
    logits[:, EOSP] = 50.0
    masked = mask_audio_logits(logits, torch.tensor([2, 3]), torch.tensor([3, 3]))
    assert masked[0, EOSP] == float("-inf") and masked[1, EOSP] == 50.0


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    out = apply_repetition_penalty(logits, seen, torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_repetition_penalty_covers_prompt_history_including_pads():
    # Greedy would pick token 3; it is in the history, so the penalty hands the win to token 5.
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 5] = 2.0, 1.5
    seen = torch.zeros(1, V, dtype=torch.bool)
    seen[0, 3] = True
    t = tensors(greedy=True, repetition_penalty=1.5)
    assert draw(logits, t, range(1), seen) == [5]
    t1 = tensors(greedy=True, repetition_penalty=1.0)
    assert draw(logits, t1, range(1), seen) == [3]


def test_greedy_is_argmax_lowest_index_wins_ties():
    logits = torch.zeros(1, V)
    logits[0, [7, 9, 40]] = 3.0
    assert set(draw(logits, tensors(greedy=True), range(20))) == {7}
    # temperature 0 means greedy too
    assert set(draw(logits, tensors(temperature=0.0), range(20))) == {7}


def test_top_k_keeps_only_the_k_best():
    logits = torch.linspace(0, 1, V)[None]
    got = set(draw(logits, tensors(temperature=5.0, top_k=3, top_p=1.0, repetition_penalty=1.0), range(500)))
    assert got == {V - 1, V - 2, V - 3}


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    # probs ~ [0.5, 0.3, 0.2, tiny...]; top_p 0.6 keeps tokens until mass >= 0.6: {0, 1}
    logits = torch.full((1, V), -30.0)
    logits[0, :3] = torch.tensor([0.5, 0.3, 0.2]).log()
    got = set(draw(logits, tensors(temperature=1.0, top_k=0, top_p=0.6, repetition_penalty=1.0), range(400)))
    assert got == {0, 1}
    # With top_k=1 first, top-p sees only token 0.
    assert set(draw(logits, tensors(temperature=1.0, top_k=1, top_p=0.6), range(100))) == {0}


def test_temperature_flattens_and_sharpens():
    logits = torch.zeros(1, V)
    logits[0, 0] = 2.0
    cold = draw(logits, tensors(temperature=0.05, top_k=0, top_p=1.0, repetition_penalty=1.0), range(300))
    hot = draw(logits, tensors(temperature=100.0, top_k=0, top_p=1.0, repetition_penalty=1.0), range(300))
    assert set(cold) == {0}
    assert len(set(hot)) > 30
    # frequencies follow softmax(logits / T): at T=1 token 0 has p = e^2 / (e^2 + 63) ~ 0.105
    mid = draw(logits, tensors(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0), range(4000))
    assert 0.08 < mid.count(0) / 4000 < 0.13


def test_upcast_bf16_logits_to_float32():
    logits = torch.zeros(1, V, dtype=torch.bfloat16)
    logits[0, 11] = 1.0
    assert draw(logits, tensors(greedy=True), range(1)) == [11]


def test_seeded_sampling_reproduces_and_seeds_differ():
    logits = torch.randn(1, V)
    t = tensors(temperature=1.0, top_k=0, top_p=1.0)
    a, b = draw(logits, t, range(64)), draw(logits, t, range(64))
    assert a == b and len(set(a)) > 5
    steps = torch.arange(8)
    s1 = sample_channel(logits.expand(8, -1), torch.zeros(8, V, dtype=torch.bool),
                        ChannelTensors(*(x.expand(8) if isinstance(x, torch.Tensor) else x for x in vars(t).values())),
                        torch.full((8,), 9), steps, AUDIO_CHANNEL)
    assert len(set(s1.tolist())) > 1  # the step enters the noise


class ScriptedModel(torch.nn.Module):
    """Greedy decoding yields script[i] at generated row i (text, audio), read from the row's position (a step
    may be launched ahead and dropped, so counting calls would not do)."""

    def __init__(self, script, prompt_len):
        super().__init__()
        self.script = script
        self.prompt_len = prompt_len

    def forward(self, batch, kv_cache):
        self.step = int(batch.positions[batch.logits_rows[-1]]) - (self.prompt_len - 1)
        return torch.zeros(2, batch.logits_rows.shape[0], MC.hidden_size)

    def _one_hot(self, n, tok):
        out = torch.zeros(1, n)
        out[0, tok] = 10.0
        return out

    def text_logits(self, h):
        return self._one_hot(MC.vocab_size, self.script[self.step][0])

    def audio_logits(self, h):
        return self._one_hot(MC.audio_vocab_size, self.script[self.step][1])


def run_script(prompt, script, **params):
    cfg = EngineConfig(block_size=4, kv_cache_bytes=MC.kv_bytes_per_row() * 512)
    model = ScriptedModel(script, len(prompt))
    engine = Engine(model, MC, cfg)
    engine.add_request("r", prompt, SamplingParams(greedy=True, max_new_tokens=len(script), **params))
    out = []
    while engine.has_work():
        out += engine.step()
    return out


def test_modes_switch_on_sosp_and_eosp_and_audio_mode_writes_modality_pad():
    script = [(200, 3), (SOSP, 4), (201, 5), (202, 6), (203, EOSP), (204, 7), (205, 8)]
    out = run_script([(150, AUDIO_PAD)], script, text=ChannelSampling(repetition_penalty=1.0),
                     audio=ChannelSampling(repetition_penalty=1.0))
    assert [o.mode for o in out] == ["text", "text", "audio", "audio", "audio", "text", "text"]
    # audio mode: text replaced by modality_pad; text mode: sampled audio token kept as is
    assert [(o.text_token, o.audio_token) for o in out] == [
        (200, 3), (SOSP, 4), (MODALITY_PAD, 5), (MODALITY_PAD, 6), (MODALITY_PAD, EOSP), (204, 7), (205, 8)]


def test_start_mode_from_last_prompt_row():
    script = [(300, 9)] * 3
    audio_prompt = run_script([(150, AUDIO_PAD), (MODALITY_PAD, 12)], script)
    assert {o.mode for o in audio_prompt} == {"audio"}
    spoken_prefix = run_script([(150, AUDIO_PAD), (SOSP, AUDIO_PAD)], script)
    assert {o.mode for o in spoken_prefix} == {"audio"}
    text_prompt = run_script([(150, AUDIO_PAD)], script)
    assert {o.mode for o in text_prompt} == {"text"}


def test_start_mode_tie_modality_pad_with_audio_pad_is_text():
    # The published generate loop sets audio on modality_pad, then text on audio_pad: the second check wins.
    assert start_mode((MODALITY_PAD, AUDIO_PAD)) == "text"
    assert start_mode((MODALITY_PAD, 12)) == "audio"
    assert start_mode((150, 12)) == "text"
    out = run_script([(150, AUDIO_PAD), (MODALITY_PAD, AUDIO_PAD)], [(300, 9)] * 2)
    assert {o.mode for o in out} == {"text"}


def test_stops_on_endoftext_and_im_end_keeping_the_row():
    for stop in (ENDOFTEXT, IM_END):
        out = run_script([(150, AUDIO_PAD)], [(201, 1), (stop, 2), (202, 3)],
                         text=ChannelSampling(repetition_penalty=1.0))
        assert [o.text_token for o in out] == [201, stop]
        assert out[-1].finished and out[-1].finish_reason == "stop"
    out = run_script([(150, AUDIO_PAD)], [(201, 1), (202, 2)])
    assert out[-1].finish_reason == "length" and len(out) == 2
