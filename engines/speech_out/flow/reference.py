"""The flow over a whole sequence (prompt + answer) in one call: the published model's own two ways of decoding.

- `chunk_frames` set: the chunk models' streaming semantics (`flow-chunk-5.pt`, CosyVoice2's
  `CausalMaskedDiffWithXvec.inference(streaming=True)`): the encoder's and the estimator's attention are chunk-causal
  (a position sees its own chunk and every earlier one, chunks counted from the prompt's first code), the convolutions
  causal. Streaming decode (`full_context.py`) must equal this; tests compare the two.
- `chunk_frames` None: the offline model's semantics (`flow.pt`): full attention over prompt and answer.
Both take the initial noise of every frame, prompt frames included, so that a caller can compare like with like.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engines.cuda.precision import float32_matmuls


def chunk_blocked(n: int, chunk: int | None, device: torch.device) -> torch.Tensor | None:
    """[n, n] bool, True where a query may NOT attend a key under chunk-causal attention of `chunk` positions (None:
    full attention, nothing blocked)."""
    if chunk is None:
        return None
    i = torch.arange(n, device=device)
    return (i[None, :] // chunk) > (i[:, None] // chunk)


def chunk_masks(n: int, chunk_codes: int | None, ratio: int, device: torch.device
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """`chunk_blocked` of n codes in chunks of `chunk_codes`, and of their n * ratio frames (the encoder's stacks)."""
    return (chunk_blocked(n, chunk_codes, device),
            chunk_blocked(n * ratio, None if chunk_codes is None else chunk_codes * ratio, device))


def encode_masked(flow, codes: torch.Tensor, look: torch.Tensor, chunk_codes: int | None):
    """codes [N] long from a sequence's start through the encoder in one call under the chunk mask (None: full
    attention), `look` [<= pre_lookahead] long the real codes after them (absent ones are zeros).
    Returns mu [80, N * ratio], the encoder's conv caches after the codes and each layer's (k, v) of both stacks."""
    cfg, dev, dt = flow.cfg, flow.device, flow.dtype
    n, r, la = int(codes.shape[0]), cfg.token_mel_ratio, cfg.pre_lookahead
    seq = torch.cat([codes.to(dev), look.to(dev)])
    tok = flow.input_embedding(F.pad(seq, (0, n + la - seq.shape[0])))[None]  # [1, N + la, input]
    valid = (torch.arange(n + la, device=dev) < seq.shape[0])[None]
    enc = flow.encoder
    prefixes, up_prefixes = [None] * len(enc.encoders), [None] * len(enc.up_encoders)
    with float32_matmuls(flow.encoder_tf32):
        hid, cache, kvs, up_kvs = enc.forward_chunk(
            tok, valid, enc.empty_cache(1, dev, dt), torch.arange(n, device=dev)[None],
            torch.arange(n * r, device=dev)[None], prefixes, up_prefixes, *chunk_masks(n, chunk_codes, r, dev))
        return flow.encoder_proj(hid)[0].transpose(0, 1), cache, kvs, up_kvs  # mu [80, N * ratio]


@torch.inference_mode()
def encode_whole(flow, codes: torch.Tensor, chunk_codes: int | None) -> torch.Tensor:
    """codes [N] long (prompt + answer, no lookahead after them) -> mu [80, N * ratio] in the flow dtype."""
    return encode_masked(flow, codes, codes[:0], chunk_codes)[0]


@torch.inference_mode()
def solve_whole(flow, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor, z: torch.Tensor,
                chunk_frames: int | None) -> torch.Tensor:
    """The Euler solve (cosine schedule, classifier-free guidance) over a whole sequence: mu, cond, z [80, T]
    (z: every frame's initial noise), spks [80] -> mel [80, T]."""
    cfg = flow.cfg
    est = flow.decoder.estimator
    edt = est.final_proj.weight.dtype
    T = mu.shape[1]
    blocked = chunk_blocked(T, chunk_frames, mu.device)
    allowed = torch.ones(T, T, dtype=torch.bool, device=mu.device) if blocked is None else ~blocked
    zero = torch.zeros_like(mu)
    mu2, cond2 = torch.stack([mu, zero]).to(edt), torch.stack([cond, zero]).to(edt)
    spks2 = torch.stack([spks, torch.zeros_like(spks)]).to(edt)
    x = z
    for s in range(cfg.n_timesteps):
        t0, t1 = flow.t_span[s], flow.t_span[s + 1]
        t = torch.full((2,), t0, device=mu.device, dtype=mu.dtype)
        v = est(torch.stack([x, x]).to(edt), mu2, t, spks2, cond2, allowed)  # [2, 80, T]
        x = torch.add(x, v[0], alpha=(t1 - t0) * (1.0 + cfg.cfg_rate))
        x = torch.add(x, v[1], alpha=-(t1 - t0) * cfg.cfg_rate)
    return x


def reference_mel(flow, prompt_codes: torch.Tensor, prompt_mel: torch.Tensor, spks: torch.Tensor,
                  codes: torch.Tensor, z: torch.Tensor, chunk: bool) -> torch.Tensor:
    """The answer's mel [80, 4N] for answer codes [N] after a prompt (codes [P], mel [80, 4P]; spks [80] the projected
    x-vector), z [80, 4(P + N)] the initial noise; `chunk`: the chunk models' semantics, else the offline model's."""
    c = flow.stream.chunk_codes
    r = flow.cfg.token_mel_ratio
    dev, dt = flow.device, flow.dtype
    allc = torch.cat([prompt_codes.to(dev), codes.to(dev)])
    mu = encode_whole(flow, allc, c if chunk else None)
    cond = torch.zeros_like(mu)
    cond[:, :prompt_mel.shape[1]] = prompt_mel.to(dev, dt)
    mel = solve_whole(flow, mu, cond, spks.to(dev, dt), z.to(dev, dt), c * r if chunk else None)
    return mel[:, prompt_codes.shape[0] * r:]
