"""MOSS-Speech serving model: shared trunk, then a text tail and an audio tail on the same hidden states.

The GPU kernels (engines/kernels/lm) are imported inside the CUDA branches: they need Triton, which a CPU-only machine
may lack.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.config import ModelConfig
from engines.cuda.streams import side_by_side
from engines.lm.model.batch import ForwardBatch
from engines.lm.model.layers import DecoderLayer, Embedding, Linear, RMSNorm
from engines.lm.model.rope import rope_cos_sin, rope_inv_freq
from engines.tokens import MODALITY_PAD


class MossSpeechModel(nn.Module):
    """Parameters are allocated uninitialised; fill them with engines.lm.loader.checkpoint.

    `layers` is flat in KV-cache order: shared 0..S-1, text tail S..S+M-1, audio tail S+M..S+2M-1.
    """

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        dtype = dtype or config.dtype
        h = config.hidden_size
        self.embed_tokens = Embedding(config.vocab_size, h, device, dtype)
        self.audio_embed = Embedding(config.audio_vocab_size, h, device, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, device, dtype) for _ in range(config.num_attention_layers))
        self.text_norm = RMSNorm(h, config.rms_norm_eps, device, dtype)
        self.audio_norm = RMSNorm(h, config.rms_norm_eps, device, dtype)
        self.text_lm_head = Linear(config.vocab_size, h, device, dtype)
        self.audio_lm_head = Linear(config.audio_vocab_size, h, device, dtype)
        self.register_buffer("inv_freq", rope_inv_freq(config.head_dim, config.rope_theta).to(device),
                             persistent=False)
        # CUDA: the stream the text tail runs on, beside the audio tail on the caller's stream (the tails only share
        # their input). None: one after the other. Set by the owner of the model's graphs (engines.lm.runner).
        self.tail_stream: torch.cuda.Stream | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def tail_layer_ranges(self) -> tuple[range, range, range]:
        """Layer indices (into `layers` and the KV cache) of the shared trunk, text tail, audio tail."""
        s, m = self.config.num_shared_layers, self.config.num_modality_layers
        return range(s), range(s, s + m), range(s + m, s + 2 * m)

    def embed(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, 2] -> [T, hidden]: text embedding unless the text token is modality_pad."""
        text_ids, audio_ids = rows[:, 0], rows[:, 1]
        is_audio = text_ids == MODALITY_PAD
        # Text rows may carry any audio id the sampler kept; only audio rows' ids are looked up for real.
        audio_ids = torch.where(is_audio, audio_ids, torch.zeros_like(audio_ids))
        return torch.where(is_audio[:, None], self.audio_embed(audio_ids), self.embed_tokens(text_ids))

    def forward(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """kv_cache: [num_attention_layers, 2, num_blocks, block_size, kv_heads, head_dim].

        Returns [2, R, hidden] at batch.logits_rows: 0 = text tail after text_norm, 1 = audio tail after audio_norm.
        """
        shared, text_tail, audio_tail = self.tail_layer_ranges()
        if batch.rows.is_cuda:
            from engines.kernels.lm.fused import embed_rope

            x, cos, sin = embed_rope(batch.rows, batch.positions, self.embed_tokens.weight, self.audio_embed.weight,
                                     self.inv_freq, MODALITY_PAD)  # [T, hidden], [T, head_dim] x2
        else:
            x = self.embed(batch.rows)  # [T, hidden]
            cos, sin = rope_cos_sin(batch.positions, self.inv_freq, x.dtype)  # [T, head_dim]
        # A decode batch whose every row needs logits takes them in order: no row selection in the last layers.
        out_rows = None if batch.is_decode and batch.logits_rows.shape[0] == batch.num_rows else batch.logits_rows
        residual = None
        for i in shared:
            x, residual = self.layers[i](x, residual, cos, sin, kv_cache[i], batch)

        def run_tail(tail: range, norm: RMSNorm) -> torch.Tensor:
            h, r = x, residual
            for i in tail:
                last = i == tail[-1]
                h, r = self.layers[i](h, r, cos, sin, kv_cache[i], batch, out_rows if last else None)
            return norm.add(h, r)[0]  # [R, hidden]

        if self.tail_stream is None or not x.is_cuda:
            return torch.stack([run_tail(text_tail, self.text_norm), run_tail(audio_tail, self.audio_norm)])
        # The tails are independent chains of latency-bound kernels: side by side, one's small kernels overlap the
        # other's weight streaming.
        audio, text = side_by_side([self.tail_stream], lambda: run_tail(audio_tail, self.audio_norm),
                                   lambda: run_tail(text_tail, self.text_norm))
        return torch.stack([text, audio])  # [2, R, hidden]

    def text_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab_size] float32 (head in the model dtype, then upcast)."""
        return self.text_lm_head(h).float()

    def audio_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, audio_vocab_size] float32."""
        return self.audio_lm_head(h).float()
