"""Where the voice ended, for counting a pause's silence from there rather than from the VAD's first silent window.

Silero's speech probability stays above the threshold for a window or two after the voice falls silent (38-62 ms
after it fell 40 dB below its peak at the ends of the repository's speech samples, 16 kHz windows of 32 ms), so a
silence counted from its first silent window ends a turn that much later than `silence_duration_ms` of real
silence. The windows the VAD still called speech just before a pause, but whose level had already fallen QUIET_DB
below the turn's loudest, are counted as silence too: at most BACK_WINDOWS of them, and only while no louder window
follows them, so a noisy room (whose level never falls that far) counts as before.
"""

from __future__ import annotations

from collections import deque

import numpy as np

QUIET_DB = 40.0  # below the turn's loudest window: the voice has ended
BACK_WINDOWS = 2  # at most this many windows (64 ms at 16 kHz) are counted back


def level_db(window: np.ndarray) -> float:
    """A window's RMS level in dB (float samples in [-1, 1]; digital silence -inf)."""
    rms = float(np.sqrt(np.mean(np.square(window, dtype=np.float64)))) if len(window) else 0.0
    return 20.0 * np.log10(rms) if rms > 0 else float("-inf")


class VoiceEnd:
    """The levels of the last speech windows of a turn and its loudest one."""

    def __init__(self) -> None:
        self._recent: deque[float] = deque(maxlen=BACK_WINDOWS)
        self._peak = float("-inf")

    def start(self, window: np.ndarray) -> None:
        """A turn starts at this window (the VAD's first speech window)."""
        self._recent.clear()
        self._peak = float("-inf")
        self.speech(window)

    def resumed(self) -> None:
        """Speech again after a pause: windows before the pause are not this pause's."""
        self._recent.clear()

    def speech(self, window: np.ndarray) -> None:
        """A window the VAD called speech."""
        db = level_db(window)
        self._recent.append(db)
        self._peak = max(self._peak, db)

    def quiet_windows(self) -> int:
        """At a pause's first silent window: how many of the speech windows just before it were already quiet."""
        n = 0
        for db in reversed(self._recent):
            if db >= self._peak - QUIET_DB:
                break
            n += 1
        return n
