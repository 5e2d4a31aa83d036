"""What re-encoding a committed turn with the whole-segment log-mel floor adds to the commit (the answer's latency)
when its max rose in its last audio (the worst case: the service otherwise rewinds the turn's stream while it is
spoken, docs/fidelity.md, section 4).

    python3 -m engines.profiling.refloor_cost [--preset full-random] [--device cuda] [--seconds 2,5,15,30]
        [--wav tests/data/speech_en_16k.wav] [--iters 10] [--graphs]

Each turn is the recording repeated to the length asked (its quiet start first, so the running floor rises and each
segment is encoded again). Per length: the codes and how many the whole-segment floor changed; the 30 s segments the
turn passed the end of, redone while it was spoken (off the commit's path); at the commit, the frames encoded again
(what is left: the last segment), its time beside the commit's own finalize call (the last partial code), and the
rows the engine then prefills again (the codes the language model held, from the first that changed). Commit times
are medians of `--iters`, after one warm-up.
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
    """A turn streamed in 80 ms pieces and committed with its last 40 ms still held: the segments it has passed
    are redone while it is spoken; at the commit, its finalize call and the re-encode of what is left (ms), the
    codes that changed and the rows the engine prefills again."""
    head, last = pcm[:-640], pcm[-640:]
    s = enc.open_stream()
    sent = [c for i in range(0, head.size, 1280) for c in s.push(head[i:i + 1280])]
    s.close()
    done = enc.segments_done(head.size)
    t0 = time.perf_counter()
    r = enc.refloor(head, False, 0, done, urgent=False) if done else None
    sent = sent if r is None else r.apply(sent)
    sync(enc.device)
    speaking_ms = 1000 * (time.perf_counter() - t0)
    finalize, refloor = [], []
    for _ in range(iters + 1):
        s = enc.open_stream()
        s.push(head)
        sync(enc.device)
        t0 = time.perf_counter()
        tail = s.finalize(last)  # the commit's call: the audio it still holds
        sync(enc.device)
        t1 = time.perf_counter()
        r = enc.refloor(pcm, True, done)
        sync(enc.device)
        t2 = time.perf_counter()
        finalize.append(1000 * (t1 - t0))
        refloor.append(1000 * (t2 - t1))
    codes = sent + tail if r is None else r.apply(sent + tail)
    first = next((i for i in range(len(sent)) if codes[i] != sent[i]), len(sent))
    streamed = enc.encode(pcm)
    return {"codes": len(codes), "codes changed": sum(a != b for a, b in zip(codes, streamed, strict=True)),
            "segments redone while spoken": done, "while spoken ms": speaking_ms,
            "frames redone at commit": 0 if r is None else r.frames, "rows redone at commit": len(sent) - first,
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
