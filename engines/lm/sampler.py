"""Dual-channel sampler: the published generation rules, batched with per-row parameters.

Per channel, in order: float32 -> mask -> repetition penalty over the channel's whole history
-> temperature -> top-k -> top-p -> sample (greedy: argmax, lowest index wins ties).

Randomness is counter-based: the noise for a candidate token is a hash of (seed, generation
step, channel, token id). A seeded request therefore reproduces whatever else shares its batch,
and sampling needs no generator state, no host sync and no per-row launches. The GPU kernels
(engines/kernels/lm/topk_sample.py, sampling.py) are imported inside the CUDA branches: they need Triton, which a
CPU-only machine may lack.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.api import ChannelSampling
from engines.tokens import AUDIO_SAMPLEABLE, EOSP

TEXT_CHANNEL = 0
AUDIO_CHANNEL = 1
_M32 = 0xFFFFFFFF


def batch_top_k(ks: list[int]) -> int:
    """Top-k width for a batch; 0 when some row has top-k off (the sampler then sorts the whole vocabulary)."""
    return 0 if any(k == 0 for k in ks) else max(ks)


@dataclass
class ChannelColumns:
    """One channel's per-row parameters on the host, ready to go to the device in one copy with others."""

    floats: list[list[float]]  # [3][B]: temperature, top_p, repetition penalty
    ints: list[list[int]]  # [2][B]: top_k, greedy (temperature 0 counts as greedy)
    max_top_k: int

    @classmethod
    def of(cls, params: list[ChannelSampling], greedy: list[bool]) -> ChannelColumns:
        ks = [p.top_k for p in params]
        return cls(
            floats=[[p.temperature for p in params], [p.top_p for p in params],
                    [p.repetition_penalty for p in params]],
            ints=[ks, [int(g or p.temperature == 0) for g, p in zip(greedy, params, strict=True)]],
            max_top_k=batch_top_k(ks),
        )


@dataclass
class ChannelTensors:
    temperature: torch.Tensor  # [B] float32
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64, 0 = off
    penalty: torch.Tensor  # [B] float32
    greedy: torch.Tensor  # [B] bool or int (nonzero: greedy)
    max_top_k: int  # host-side: top-k width for the whole batch, 0 = some row has top-k off

    @classmethod
    def from_columns(cls, floats: torch.Tensor, ints: torch.Tensor, max_top_k: int) -> ChannelTensors:
        """floats [3, B] and ints [2, B] laid out as ChannelColumns, already on the device."""
        return cls(floats[0], floats[1], ints[0], floats[2], ints[1], max_top_k)

    @classmethod
    def build(cls, params: list[ChannelSampling], greedy: list[bool], device: torch.device) -> ChannelTensors:
        cols = ChannelColumns.of(params, greedy)
        return cls.from_columns(torch.tensor(cols.floats, dtype=torch.float32, device=device),
                                torch.tensor(cols.ints, dtype=torch.long, device=device), cols.max_top_k)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply), on int64 tensors holding values < 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor, channel: int) -> torch.Tensor:
    """[B] int64 seeds and steps -> [B] 32-bit keys unique per (seed, step, channel)."""
    k = _mix32((steps * 2 + channel) & _M32)
    k = _mix32(k ^ ((seeds >> 32) & _M32))
    return _mix32(k ^ (seeds & _M32))


def exponential_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise per candidate: keys [B], token_ids [B, K] -> [B, K] float32."""
    x = _mix32(_mix32(token_ids & _M32) ^ keys[:, None])
    u = ((x >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)  # (0, 1), 24 bits
    return -torch.log(u)


def mask_audio_logits(logits: torch.Tensor, num_generated: torch.Tensor, min_new_tokens: torch.Tensor) -> torch.Tensor:
    """Ids >= 16385 are never sampled; eosp waits until min_new_tokens rows were generated."""
    logits[:, AUDIO_SAMPLEABLE:] = float("-inf")
    block_eosp = num_generated < min_new_tokens  # [B]
    logits[:, EOSP] = torch.where(block_eosp, torch.full_like(logits[:, EOSP], float("-inf")), logits[:, EOSP])
    return logits


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL-style: seen tokens' positive logits are divided by the penalty, negative ones multiplied."""
    p = penalty[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) along the last dim (sorted, descending) for x [B, V]. On CUDA with a wide vocabulary in
    stages: the top k of every slice of at least 8k entries (many independent slices fill the GPU), then the top
    k of those candidates. One-stage top-k of a few rows runs in a single thread block: 81 us for one row of the
    16512-entry audio vocabulary on an H200, the sampler's largest kernel."""
    b, v = x.shape
    width = max(128, 1 << (8 * k - 1).bit_length())  # slice: a power of two >= 8k
    if not x.is_cuda or v < 8 * width:
        return torch.topk(x, k, dim=-1)
    n = -(-v // width)
    if n * width != v:  # padding ranks below every real entry, -inf included (indices clamped below)
        x = torch.nn.functional.pad(x, (0, n * width - v), value=float("-inf"))
    vals, idx = torch.topk(x.view(b, n, width), k, dim=-1)  # [B, n, k]
    idx = idx + torch.arange(0, n * width, width, device=x.device)[None, :, None]
    vals, sel = top_k(vals.view(b, n * k), k)  # [B, k]
    idx = torch.gather(idx.view(b, n * k), 1, sel)
    return vals, (idx.clamp_(max=v - 1) if n * width != v else idx)


def sample_audio(logits: torch.Tensor, seen: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor,
                 max_top_k: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The audio channel of a step: logits [B, V] float32 (left intact), seen [slots, V] bool (every slot's
    history), ints [>= 6, B] (slot, seed, step, min_new_tokens, top_k, greedy) and floats [>= 3, B] (temperature,
    top_p, penalty) per row, as the runner uploads them (StepSampling); max_top_k as ChannelColumns.max_top_k."""
    slots, seeds, steps, min_new = ints[:4]
    t = ChannelTensors.from_columns(floats[:3], ints[4:6], max_top_k)
    return sample_rows(logits, seen, slots, t, seeds, steps, AUDIO_CHANNEL, min_new, out)


def sample_rows(logits: torch.Tensor, seen: torch.Tensor, slots: torch.Tensor, t: ChannelTensors,
                seeds: torch.Tensor, steps: torch.Tensor, channel: int, min_new: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens [B] int64 of logits [B, V] float32 (left intact); row i's history is seen[slots[i]] ([slots, V]).
    With min_new ([B]) the audio channel's mask applies (mask_audio_logits). On CUDA with every row's top-k on
    and small, two fused launches (engines/kernels/lm/topk_sample.py) instead of ~35; else sample_channel.
    out: a [B] int64 view that receives the tokens."""
    if logits.is_cuda:
        from engines.kernels.lm import topk_sample

        if topk_sample.supported(logits, t.max_top_k):
            audio = min_new is not None
            return topk_sample.topk_sample(
                logits, seen, slots, t.temperature, t.top_p, t.top_k, t.penalty, t.greedy, seeds, steps, channel,
                t.max_top_k, mask_from=AUDIO_SAMPLEABLE if audio else None, gate_id=EOSP if audio else None,
                min_new=min_new, out=out)
    if min_new is not None:
        logits = mask_audio_logits(logits.clone(), steps, min_new)
    tokens = sample_channel(logits, seen[slots], t, seeds, steps, channel)
    if out is not None:
        out.copy_(tokens)
    return tokens


def sample_channel(logits: torch.Tensor, seen: torch.Tensor, t: ChannelTensors,
                   seeds: torch.Tensor, steps: torch.Tensor, channel: int) -> torch.Tensor:
    """logits [B, V] (already masked), seen [B, V] bool -> tokens [B] int64."""
    logits = apply_repetition_penalty(logits.float(), seen, t.penalty)
    greedy_tokens = torch.argmax(logits, dim=-1)
    greedy = t.greedy.bool()
    scaled = logits / torch.where(greedy, torch.ones_like(t.temperature), t.temperature)[:, None]
    if t.max_top_k > 0:
        vals, idx = top_k(scaled, min(t.max_top_k, scaled.shape[-1]))  # sorted, descending
    else:
        vals, idx = torch.sort(scaled, dim=-1, descending=True)
    pos = torch.arange(vals.shape[-1], device=vals.device)[None, :]
    k = torch.where(t.top_k > 0, t.top_k, torch.full_like(t.top_k, vals.shape[-1]))
    vals = vals.masked_fill(pos >= k[:, None], float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    # top-p: drop a token when the mass strictly above it already reaches top_p (the first always stays).
    mass_above = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_above >= t.top_p[:, None], 0.0)
    if idx.is_cuda:  # one launch instead of ~40 tiny int64 ops; bit-identical (tests/gpu)
        from engines.kernels.lm.sampling import race_noise

        noise = race_noise(seeds, steps, channel, idx)
    else:
        noise = exponential_noise(row_keys(seeds, steps, channel), idx)
    choice = torch.argmax(probs / noise, dim=-1, keepdim=True)  # exponential race == multinomial draw
    sampled = torch.gather(idx, -1, choice).squeeze(-1)
    return torch.where(greedy, greedy_tokens, sampled)
