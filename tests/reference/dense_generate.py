"""Reference generation loop over the dense model: MODEL_CONTRACT §3 written out plainly, greedy only.

Independent of engines/sampler and engines/scheduler: one sequence, whole history recomputed each step.
"""

from __future__ import annotations

import torch

from engines.tokens import AUDIO_PAD, EOSP, MODALITY_PAD, SOSP, TEXT_STOP_TOKENS

from .dense_model import DenseMossSpeech


def _penalize(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    logits = logits.clone()
    for tok in set(history):
        v = logits[tok]
        logits[tok] = v / penalty if v > 0 else v * penalty
    return logits


def dense_greedy(model: DenseMossSpeech, rows: list[tuple[int, int]], max_new_tokens: int,
                 min_new_tokens: int = 0, text_penalty: float = 1.1, audio_penalty: float = 1.1
                 ) -> list[tuple[int, int, str]]:
    """Returns (text, audio, mode) per generated row."""
    rows = list(rows)
    last_text, last_audio = rows[-1]
    if last_text == MODALITY_PAD:
        mode = "audio"
    elif last_audio == AUDIO_PAD:
        mode = "text"
    else:
        mode = "text"
    out = []
    for step in range(max_new_tokens):
        t_last, a_last = rows[-1]
        if mode == "text" and t_last == SOSP:
            mode = "audio"
        elif mode == "audio" and a_last == EOSP:
            mode = "text"
        text_logits, audio_logits = model.forward(torch.tensor(rows))
        tl = text_logits[-1].float()
        al = audio_logits[-1].float().clone()
        al[EOSP + 1:] = float("-inf")
        if step < min_new_tokens:
            al[EOSP] = float("-inf")
        tl = _penalize(tl, [r[0] for r in rows], text_penalty)
        al = _penalize(al, [r[1] for r in rows], audio_penalty)
        text = int(torch.argmax(tl))
        audio = int(torch.argmax(al))
        if mode == "audio":
            text = MODALITY_PAD
        rows.append((text, audio))
        out.append((text, audio, mode))
        if text in TEXT_STOP_TOKENS:
            break
    return out
