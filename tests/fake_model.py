"""A stand-in for the serving model: no attention, fixed logits; lets scheduler tests run fast."""

from __future__ import annotations

import torch

from engines.config import ModelConfig
from engines.lm.model.batch import ForwardBatch


class FakeModel(torch.nn.Module):
    """Greedy decoding on it always yields (text_token, audio_token); it records every batch it ran."""

    def __init__(self, config: ModelConfig, text_token: int = 100, audio_token: int = 7):
        super().__init__()
        self.config = config
        self.text_token = text_token
        self.audio_token = audio_token
        self.batches: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        self.batches.append(batch)
        # Write each row's position into K so tests can check the slot mapping.
        k = kv_cache[:, 0].view(kv_cache.shape[0], -1, *kv_cache.shape[-2:])
        k[:, batch.slot_mapping] = batch.positions.to(kv_cache.dtype)[None, :, None, None]
        return torch.zeros(2, batch.logits_rows.shape[0], self.config.hidden_size)

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(h.shape[0], self.config.vocab_size)
        out[:, self.text_token] = 10.0
        return out

    def audio_logits(self, h: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(h.shape[0], self.config.audio_vocab_size)
        out[:, self.audio_token] = 10.0
        return out
