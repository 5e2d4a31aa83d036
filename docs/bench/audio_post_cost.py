"""CPU time of a session's audio in the formats and at the speeds it may ask for, per second of session: G.711
appends decoded (20-ms events), an answer's 0.4-s chunks encoded to mu-law, and an answer played at another speed.

    python3 docs/bench/audio_post_cost.py
"""

from __future__ import annotations

import timeit

import numpy as np

from server.audio.formats import PCM, PCMU, AnswerEncoder
from server.audio.stretch import Stretch

RATE = 24000
CHUNK = (0.3 * np.sin(2 * np.pi * 220 * np.arange(9600) / RATE) * 32767).astype("<i2").tobytes()  # 0.4 s


def _us(call, n: int) -> float:
    return min(timeit.repeat(call, number=n, repeat=5)) / n * 1e6


def main() -> None:
    appends = {"pcm (24 kHz)": (PCM, PCM.encode(np.full(480, 0.1, np.float32))),
               "pcmu (8 kHz)": (PCMU, PCMU.encode(np.full(160, 0.1, np.float32)))}
    for name, (fmt, raw) in appends.items():
        us = _us(lambda fmt=fmt, raw=raw: fmt.decode(raw), 3000)
        print(f"append of 20 ms, {name}: {us:.0f} us, {us * 50 / 1000:.2f} CPU-ms per second of user audio")
    encoder = AnswerEncoder(PCMU, RATE)
    us = _us(lambda: encoder.encode(CHUNK), 300)
    print(f"answer chunk to mu-law: {us:.0f} us, {us * 2.5 / 1000:.2f} CPU-ms per second of answer")
    for speed in (0.8, 1.25):
        stretch = Stretch(speed, RATE)
        us = _us(lambda stretch=stretch: stretch.process(CHUNK), 300)
        print(f"answer chunk at speed {speed}: {us:.0f} us, {us * 2.5 / 1000:.2f} CPU-ms per second of answer made")


if __name__ == "__main__":
    main()
