"""What re-encoding a committed turn with the whole-segment log-mel floor adds to the commit (the answer's latency).

    python3 -m engines.profiling.refloor_cost [--preset full-random] [--device cuda] [--seconds 2,5,15,30]
        [--wav tests/data/speech_en_16k.wav] [--iters 10] [--graphs]

Each turn is the recording repeated to the length asked (its quiet start first, so the running floor rises and the
turn is encoded again whole). Per length: the codes, the commit's own finalize call (the last partial code), the
re-encode (`SpeechEncoder.refloor`: the frame maxima and one batched encoder call), and the rows the engine then
prefills again (the codes the language model held before the commit, from the first that changed). Times are medians
of `--iters`, after one warm-up.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from engines.audio.wav import read_wav
from engines.bench.hardware import device_name, median, sync
from engines.speech_in import SpeechEncoder
from engines.speech_out.voice import resample


def turn(wav: np.ndarray, seconds: float) -> np.ndarray:
    n = int(seconds * 16000)
    return np.tile(wav, -(-n // wav.size))[:n].astype(np.float32)


def measure(enc: SpeechEncoder, pcm: np.ndarray, iters: int) -> dict[str, float]:
    """The commit of a turn streamed in 80 ms pieces: its finalize and its re-encode (ms), and what they change."""
    s = enc.open_stream()
    sent = []
    for i in range(0, pcm.size, 1280):
        sent += s.push(pcm[i:i + 1280])
    s.close()
    streamed = enc.encode(pcm)
    finalize, refloor = [], []
    r = None
    for _ in range(iters + 1):
        s = enc.open_stream()
        s.push(pcm[:-640])
        sync(enc.device)
        t0 = time.perf_counter()
        s.finalize(pcm[-640:])  # the audio the commit's call still holds: the last 40 ms
        sync(enc.device)
        t1 = time.perf_counter()
        r = enc.refloor(pcm, final=True)
        sync(enc.device)
        t2 = time.perf_counter()
        finalize.append(1000 * (t1 - t0))
        refloor.append(1000 * (t2 - t1))
    codes = streamed if r is None else streamed[: r.first] + r.codes
    first = next((i for i in range(len(sent)) if codes[i] != sent[i]), len(sent))
    return {"codes": len(codes), "codes changed": sum(a != b for a, b in zip(codes, streamed, strict=True)),
            "rows redone": len(sent) - first, "frames re-encoded": 0 if r is None else r.frames,
            "finalize ms": median(finalize[1:]), "refloor ms": median(refloor[1:])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="full-random")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seconds", default="2,5,15,30")
    p.add_argument("--wav", default="tests/data/speech_en_16k.wav")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--graphs", action="store_true", help="CUDA graphs for small steps (as the server)")
    args = p.parse_args()
    enc = SpeechEncoder.load(args.preset, device=args.device)
    if args.graphs:
        enc.reserve(8)
        enc.capture_graphs()
    wav, rate = read_wav(args.wav)
    wav = resample(torch.from_numpy(wav), rate, 16000).numpy()
    print(f"{args.preset} on {device_name(enc.device)}, float32, {args.wav}")
    for seconds in [float(x) for x in args.seconds.split(",")]:
        m = measure(enc, turn(wav, seconds), args.iters)
        print(f"{seconds:5.1f} s: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in m.items()))


if __name__ == "__main__":
    main()
