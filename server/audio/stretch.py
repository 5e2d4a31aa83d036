"""An answer's audio played faster or slower at the same pitch (`audio.output.speed`): FFmpeg's `atempo` filter (WSOLA)
through PyAV, as a stream over the answer's chunks.

The filter holds back a window of ~60 ms of input; chunks go in as 20-ms frames so that what it holds stays that
small (a whole 400-ms chunk in one frame would come out a chunk late). `flush()` gives the held tail at the answer's
end. atempo takes 0.5-100 per instance, so speeds under 0.5 chain two.
"""

from __future__ import annotations

import av
import av.filter
import numpy as np

MIN_SPEED, MAX_SPEED = 0.25, 1.5  # the GA API's range
FRAME = 480  # 20 ms at 24 kHz


class Stretch:
    """PCM16 mono at `rate` in, the same played `speed` times as fast out (1/speed times as many samples)."""

    def __init__(self, speed: float, rate: int = 24000) -> None:
        if not MIN_SPEED <= speed <= MAX_SPEED:
            raise ValueError(f"speed must be in [{MIN_SPEED}, {MAX_SPEED}], got {speed}")
        self.speed, self.rate = speed, rate
        self._graph = av.filter.Graph()
        chain = [self._graph.add_abuffer(format="s16", sample_rate=rate, layout="mono", time_base=f"1/{rate}")]
        factors = [0.5, speed / 0.5] if speed < 0.5 else [speed]
        chain += [self._graph.add("atempo", f"{f:.6f}") for f in factors]
        chain.append(self._graph.add("abuffersink"))
        for a, b in zip(chain, chain[1:], strict=False):
            a.link_to(b)
        self._graph.configure()
        self._pts = 0
        self.closed = False

    def process(self, pcm16: bytes) -> bytes:
        x = np.frombuffer(pcm16, "<i2")  # [n]
        out = []
        for i in range(0, len(x), FRAME):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, i:i + FRAME]), format="s16", layout="mono")
            frame.sample_rate, frame.pts = self.rate, self._pts
            self._pts += frame.samples
            self._graph.push(frame)
            out += self._pull()
        return b"".join(out)

    def flush(self) -> bytes:
        """The samples the filter still holds (the end of the answer); nothing after the first call."""
        if self.closed:
            return b""
        self.closed = True
        self._graph.push(None)
        return b"".join(self._pull())

    def _pull(self) -> list[bytes]:
        out = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                return out
            out.append(frame.to_ndarray().astype("<i2").tobytes())
