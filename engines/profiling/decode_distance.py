"""How far the decoder's ways of decoding an answer are apart in mel: `python3 -m engines.profiling.decode_distance`.

On random weights (a preset), for answers of given lengths: the chunk model streamed with its full left context (the
served default; equal to the chunk model over the whole sequence, tests/engines/speech_out/flow/), the offline model's
semantics over the same noise (`flow.pt`: full attention, what `moss-speech codec decode` without --stream runs), and
the opt-in windowed stream (`--decoder-context window`) over the same noise of the answer's frames (no voice prompt,
so that every frame's noise lines up), the full-context stream in a cache that is always short, where an answer
keeps only its last `--kept` chunks (what a long answer does when the served cache runs short; compared from its
first forgotten chunk on), and the full-context stream with its cache in fp8 (`--decoder-cache-dtype fp8`). Prints
per answer length the mean absolute log-mel difference and the relative RMS of each pair. Random weights say how much
the algorithms differ, not what a listener hears with the trained ones.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator

import numpy as np
import torch

from engines.speech_out import CodecDecoder, Voice
from engines.speech_out.flow.full_context import KEPT_PAGES, FullContextFlow
from engines.speech_out.flow.reference import reference_mel


def _chunk_jobs(codes: np.ndarray, C: int, la: int) -> Iterator[tuple[torch.Tensor, int, int]]:
    """An answer's chunks as a stream decodes them one at a time: (row [1, C + la] with the chunk's codes and its real
    lookahead, zero-padded; n codes; n lookahead codes)."""
    for i in range(0, len(codes), C):
        n = min(C, len(codes) - i)
        look = list(codes[i + n:i + n + la])
        yield torch.tensor([list(codes[i:i + n]) + look + [0] * (la - len(look))]), n, len(look)


def _windowed_mel(dec: CodecDecoder, codes: np.ndarray, seed: int) -> torch.Tensor:
    """The windowed flow's mel of an answer (no voice prompt), chunk by chunk as a stream decodes it."""
    f, st = dec.flow, dec.cfg.stream
    voice = dec.prepared(Voice.empty(f.cfg.output_size, f.cfg.spk_embed_dim))
    gen = torch.Generator(device=f.device).manual_seed(seed)
    state = f.new_state(voice, gen)
    mels = [f.decode_chunk([state], row, n, [nl], [gen])[0]
            for row, n, nl in _chunk_jobs(codes, st.chunk_codes, f.cfg.pre_lookahead)]
    return torch.cat(mels, 1)


def _cached_mel(dec: CodecDecoder, codes: np.ndarray, seed: int, kept: int | None = None,
                cache_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The full-context stream's mel of an answer (no voice prompt), its cache's pages in `cache_dtype` (default the
    estimator's); with `kept`, in a cache always short: past `kept` chunks it forgets its oldest as it goes. Its noise
    is the windowed stream's of the same seed (`_answer_noise`)."""
    f, st = dec.flow, dec.cfg.stream
    pages = -(-len(codes) // st.chunk_codes) + 1
    fc = FullContextFlow(f, pages, kept_pages=kept or pages, low_water=pages if kept else 0, cache_dtype=cache_dtype)
    state = fc.new_state(fc.prepare_voice(torch.zeros(0, dtype=torch.long), torch.zeros(f.cfg.output_size, 0),
                                          torch.zeros(f.cfg.spk_embed_dim)))
    gen = torch.Generator(device=f.device).manual_seed(seed)
    torch.randn(f.cfg.output_size, st.est_ctx_frames, generator=gen, device=f.device, dtype=f.dtype)
    mels = []
    for row, n, nl in _chunk_jobs(codes, st.chunk_codes, f.cfg.pre_lookahead):
        fc.reserve(state, 1)
        mels.append(fc.decode_chunk([state], row, n, [nl], [gen])[0])
    fc.close(state)
    return torch.cat(mels, 1)


def _answer_noise(dec: CodecDecoder, n_codes: int, seed: int) -> torch.Tensor:
    """The noise the windowed stream of `seed` gives the answer's frames: its generator after the first context's
    draw, then a draw per chunk."""
    f, st = dec.flow, dec.cfg.stream
    gen = torch.Generator(device=f.device).manual_seed(seed)
    torch.randn(f.cfg.output_size, st.est_ctx_frames, generator=gen, device=f.device, dtype=f.dtype)
    r, C = f.cfg.token_mel_ratio, st.chunk_codes
    return torch.cat([torch.randn(f.cfg.output_size, min(C, n_codes - i) * r, generator=gen, device=f.device,
                                  dtype=f.dtype) for i in range(0, n_codes, C)], 1)


def _diff(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a - b).float()
    return {"mean_abs": round(float(d.abs().mean()), 4),
            "rel_rms": round(float(d.pow(2).mean().sqrt() / b.float().pow(2).mean().sqrt()), 4)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--codec", default="tiny-random", help="a preset (random weights)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, nargs="+", default=[2.0, 10.0, 20.0], help="answer lengths")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--kept", type=int, default=KEPT_PAGES, help=f"chunks a forgetting answer keeps ({KEPT_PAGES})")
    a = p.parse_args(argv)
    dec = CodecDecoder.load(a.codec, device=a.device, vocoder="hift", context="window")
    f = dec.flow
    spks = f.speaker(torch.zeros(f.cfg.spk_embed_dim))  # an empty voice's
    none = torch.zeros(0, dtype=torch.long)
    empty_mel = torch.zeros(f.cfg.output_size, 0)
    rows = []
    for seconds in a.seconds:
        n = int(round(seconds * 12.5))
        acc: dict[str, list[dict[str, float]]] = {"windowed_vs_full": [], "offline_vs_full": [],
                                                  "fp8_cache_vs_full": []}
        after = a.kept * dec.cfg.stream.chunk_codes * f.cfg.token_mel_ratio  # the first forgetting chunk's frame
        if after < n * f.cfg.token_mel_ratio:
            acc["forgetting_vs_full"] = []
        for seed in range(a.seeds):
            codes = np.random.default_rng(seed).integers(0, 16384, n)
            z = _answer_noise(dec, n, seed)
            t = torch.as_tensor(codes)
            full = reference_mel(f, none, empty_mel, spks, t, z, chunk=True)
            acc["offline_vs_full"].append(_diff(reference_mel(f, none, empty_mel, spks, t, z, chunk=False), full))
            acc["windowed_vs_full"].append(_diff(_windowed_mel(dec, codes, seed), full))
            acc["fp8_cache_vs_full"].append(_diff(_cached_mel(dec, codes, seed, cache_dtype=torch.float8_e4m3fn),
                                                  full))
            if "forgetting_vs_full" in acc:
                acc["forgetting_vs_full"].append(_diff(_cached_mel(dec, codes, seed, a.kept)[:, after:],
                                                       full[:, after:]))
        row = {"codec": a.codec, "seconds": seconds, **{k: {m: round(float(np.mean([x[m] for x in v])), 4)
                                                          for m in v[0]} for k, v in acc.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
