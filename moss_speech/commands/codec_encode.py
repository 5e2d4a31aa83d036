"""`moss-speech codec encode`: WAV (any rate, mono or stereo) -> 12.5 Hz speech codes on stdout.

With --stream the audio is pushed in --piece-ms pieces as a live session would, and each code is
reported on stderr with the audio time at which it became known; stdout is the same in both modes.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from engines.audio.wav import AudioFormatError, read_wav
from engines.config import ConfigError
from engines.speech_in import SpeechEncoder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--codec", default="tiny-random", help="tiny-random | full-random | codec directory")
    parser.add_argument("--audio", required=True, help="input WAV (integer PCM, any rate, mono or stereo)")
    parser.add_argument("--stream", action="store_true", help="push the audio in small pieces, as live")
    parser.add_argument("--piece-ms", type=float, default=20.0, help="piece length for --stream")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the config's)")


def _to_16k(x: np.ndarray, rate: int) -> np.ndarray:
    if rate == 16000:
        return x
    import soxr  # only this command needs it; the engine itself takes 16 kHz PCM

    return soxr.resample(x, rate, 16000, quality="HQ").astype(np.float32, copy=False)


def run(args: argparse.Namespace) -> int:
    try:
        x, rate = read_wav(args.audio)
    except AudioFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if x.size == 0:
        print(f"error: {args.audio} holds no samples", file=sys.stderr)
        return 2
    if args.piece_ms <= 0:
        print("error: --piece-ms must be > 0", file=sys.stderr)
        return 2
    try:
        enc = SpeechEncoder.load(args.codec, device=args.device, dtype=args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pcm = _to_16k(x, rate)
    if args.codec in ("tiny-random", "full-random"):
        print(f"note: {args.codec} encoder has random weights; the codes carry no meaning", file=sys.stderr)
    if args.stream:
        stream = enc.open_stream()
        piece = max(1, round(args.piece_ms * 16))
        codes: list[int] = []
        for i in range(0, pcm.size, piece):
            new = stream.push(pcm[i:i + piece])
            for c in new:
                print(f"t={stream.samples_seen / 16000:7.3f}s code[{len(codes)}]={c}", file=sys.stderr)
                codes.append(c)
        for c in stream.finalize():
            print(f"finalize       code[{len(codes)}]={c}", file=sys.stderr)
            codes.append(c)
    else:
        codes = enc.encode(pcm)
    print(f"{args.audio}: {pcm.size / 16000:.3f} s at 16 kHz (from {rate} Hz) -> {len(codes)} codes",
          file=sys.stderr)
    print(" ".join(map(str, codes)))
    return 0
