"""`moss-speech codec decode`: codes file -> 24 kHz mono PCM16 WAV of exactly len(codes) x 1920 samples."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from engines.audio.wav import write_wav
from engines.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--codec", default="tiny-random", help="tiny-random | full-random | codec directory")
    p.add_argument("--codes", required=True, help="a text file of whitespace- or comma-separated codes, or a .npy file")
    p.add_argument("--out", required=True, help="output WAV path")
    p.add_argument("--vocoder", default="bigvgan", choices=["bigvgan", "hift"])
    p.add_argument("--stream", action="store_true",
                   help="feed codes 5 at a time through the chunk model, as the engine does (default: the offline "
                        "model, one call with full attention over prompt and answer, then the vocoder over it all)")
    p.add_argument("--context", default="full", choices=["full", "window"],
                   help="with --stream, what each chunk sees of earlier chunks: all of them, as the chunk model was "
                        "trained (full), or the prompt and the last 4 (window: bounded memory, an approximation)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="session seed for all sampled noise")
    p.add_argument("--voice", default=None, help="speaker prompt WAV (codes from the codec's encoder; x-vector from "
                   "flow/campplus.onnx when the codec has one, else zero)")


def read_codes(path: str | Path) -> np.ndarray:
    from engines.speech_out.codes import BadCodesError

    path = Path(path)
    if not path.is_file():
        raise BadCodesError(f"codes file {path} does not exist")
    if path.suffix == ".npy":
        arr = np.load(path, allow_pickle=False)
        return arr.reshape(-1) if arr.ndim == 2 and 1 in arr.shape else arr
    text = path.read_text().replace(",", " ").split()
    try:
        return np.array([int(t) for t in text], dtype=np.int64)
    except ValueError as e:
        raise BadCodesError(f"{path}: not a list of integers ({e})") from None


def _voice(args: argparse.Namespace):
    from engines.speech_in import SpeechEncoder
    from engines.speech_out import Voice

    enc = SpeechEncoder.load(args.codec, device=args.device)
    campplus = Path(args.codec) / "flow" / "campplus.onnx"
    return Voice.from_wav(args.voice, encode=lambda pcm: enc.encode(pcm),
                          campplus=campplus if campplus.is_file() else None)


def run(args: argparse.Namespace) -> int:
    from engines.speech_out import CodecDecoder

    try:
        codes = read_codes(args.codes)
        dec = CodecDecoder.load(args.codec, device=args.device, vocoder=args.vocoder,
                                context=getattr(args, "context", "full"), offline=not args.stream)
        voice = _voice(args) if getattr(args, "voice", None) else None
        if args.stream:
            s = dec.open_stream("cli", voice=voice, seed=args.seed)
            step = dec.cfg.stream.chunk_codes
            parts = [s.push(codes[i:i + step]) for i in range(0, len(codes), step)] + [s.finalize()]
            pcm = np.concatenate(parts)
        else:
            pcm = dec.decode(codes, voice=voice, seed=args.seed)
    except (ValueError, ConfigError) as e:  # BadCodesError and ConfigError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    write_wav(args.out, pcm, dec.sample_rate)
    print(f"{args.out}: {len(codes)} codes -> {pcm.shape[0]} samples at {dec.sample_rate} Hz "
          f"({pcm.shape[0] / dec.sample_rate:.2f} s), vocoder {args.vocoder}, codec {dec.source}")
    return 0
