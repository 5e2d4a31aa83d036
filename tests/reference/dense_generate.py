"""Reference generation loop over the dense model: the published generation rules written out plainly, greedy only.

Independent of engines/lm and engines/lm: one sequence, whole history recomputed each step.

Two uses: `dense_greedy` generates, and `check_follows_greedy` judges rows another implementation generated. Two
numerically different paths (a paged engine and this dense model) sum in different orders, so where two logits lie
within rounding noise of each other (a near-tie) either token is right, and which one comes out depends on the CPU's
kernels. The judge therefore replays the other path's rows through the reference step by step (teacher forcing) and
accepts a token whose reference logit lies within `margin` of the reference's best; every other step must be the
reference's own choice, so a wrong model, cache or sampler still fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.tokens import AUDIO_PAD, EOSP, MODALITY_PAD, SOSP, TEXT_STOP_TOKENS

from .dense_model import DenseMossSpeech

# Rounding noise between two float32 paths over the tiny models stays under 1e-5 (a logit's scale is ~0.1-1); an
# e4m3 KV cache rounds each key and value to 3 mantissa bits, so one value landing on the other side of a rounding
# boundary moves logits by up to ~1e-3. Both margins are far below the logit gaps a wrong model, cache or RoPE makes.
FP32_MARGIN = 1e-4
FP8_KV_MARGIN = 2e-3


def _penalize(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    logits = logits.clone()
    for tok in set(history):
        v = logits[tok]
        logits[tok] = v / penalty if v > 0 else v * penalty
    return logits


def _start_mode(rows: list[tuple[int, int]]) -> str:
    last_text, last_audio = rows[-1]
    mode = "audio" if last_text == MODALITY_PAD else "text"
    if last_audio == AUDIO_PAD:  # checked second, so it wins the tie (modality_pad, audio_pad)
        mode = "text"
    return mode


def _step_logits(model: DenseMossSpeech, rows: list[tuple[int, int]], step: int, min_new_tokens: int,
                 text_penalty: float, audio_penalty: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's masked, penalised (text [vocab], audio [audio_vocab]) logits for the row after `rows`."""
    text_logits, audio_logits = model.forward(torch.tensor(rows))
    tl = text_logits[-1].float()
    al = audio_logits[-1].float().clone()
    al[EOSP + 1:] = float("-inf")
    if step < min_new_tokens:
        al[EOSP] = float("-inf")
    tl = _penalize(tl, [r[0] for r in rows], text_penalty)
    al = _penalize(al, [r[1] for r in rows], audio_penalty)
    return tl, al


def _next_mode(mode: str, rows: list[tuple[int, int]]) -> str:
    t_last, a_last = rows[-1]
    if mode == "text" and t_last == SOSP:
        return "audio"
    if mode == "audio" and a_last == EOSP:
        return "text"
    return mode


def dense_greedy(model: DenseMossSpeech, rows: list[tuple[int, int]], max_new_tokens: int,
                 min_new_tokens: int = 0, text_penalty: float = 1.1, audio_penalty: float = 1.1
                 ) -> list[tuple[int, int, str]]:
    """Returns (text, audio, mode) per generated row."""
    rows = list(rows)
    mode = _start_mode(rows)
    out = []
    for step in range(max_new_tokens):
        mode = _next_mode(mode, rows)
        tl, al = _step_logits(model, rows, step, min_new_tokens, text_penalty, audio_penalty)
        text = int(torch.argmax(tl))
        audio = int(torch.argmax(al))
        if mode == "audio":
            text = MODALITY_PAD
        rows.append((text, audio))
        out.append((text, audio, mode))
        if text in TEXT_STOP_TOKENS:
            break
    return out


@dataclass
class Verdict:
    """What `check_follows_greedy` found: `wrong` names the first step off the reference (None: none);
    `near_ties` counts steps where the other path took a token within the margin that was not the reference's."""
    wrong: str | None
    near_ties: int
    worst_deficit: float  # largest (reference best - reference logit of the token taken) over accepted steps

    @property
    def follows(self) -> bool:
        return self.wrong is None


def check_follows_greedy(model: DenseMossSpeech, rows: list[tuple[int, int]], got: list[tuple[int, int, str]],
                         max_new_tokens: int, min_new_tokens: int = 0, margin: float = FP32_MARGIN,
                         text_penalty: float = 1.1, audio_penalty: float = 1.1) -> Verdict:
    """Judges `got`, (text, audio, mode) rows another path generated greedily after `rows`, against the reference:
    each step's mode must be the reference's, each sampled token the reference's argmax or within `margin` of its
    best logit (a near-tie, continued from the token taken), the text channel modality_pad in audio mode, and the
    rows must end where the reference would (a stop token, or `max_new_tokens`)."""
    rows = list(rows)
    mode = _start_mode(rows)
    near_ties, worst, judged = 0, 0.0, 0
    for step in range(max_new_tokens):
        if step >= len(got):
            return Verdict(f"ended after {len(got)} rows, the reference goes on", near_ties, worst)
        mode = _next_mode(mode, rows)
        text, audio, got_mode = got[step]
        if got_mode != mode:
            return Verdict(f"step {step}: mode {got_mode}, the reference is in {mode}", near_ties, worst)
        tl, al = _step_logits(model, rows, step, min_new_tokens, text_penalty, audio_penalty)
        channels = [("audio", al, audio)]
        if mode == "audio":
            if text != MODALITY_PAD:
                return Verdict(f"step {step}: text {text} in audio mode", near_ties, worst)
        else:
            channels.append(("text", tl, text))
        for name, logits, token in channels:
            best = int(torch.argmax(logits))
            if token == best:
                continue
            deficit = float(logits[best] - logits[token])
            if not deficit <= margin:  # NaN or -inf (a masked token) fail too
                return Verdict(f"step {step}: {name} {token}, reference {best} ({deficit:.3g} above)", near_ties, worst)
            near_ties += 1
            worst = max(worst, deficit)
        rows.append((text, audio))
        judged += 1
        if text in TEXT_STOP_TOKENS:
            break
    if len(got) > judged:
        return Verdict(f"{len(got)} rows, the reference stops after {judged}", near_ties, worst)
    return Verdict(None, near_ties, worst)
