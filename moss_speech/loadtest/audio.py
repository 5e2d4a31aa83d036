"""The simulated user's voice: a WAV read once, resampled to PCM16 24 kHz, cut into 20 ms frames."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moss_speech.loadtest.stats import SAMPLE_RATE

# The repository's espeak-ng sample; present in a checkout, absent from an installed wheel (then --audio is needed).
DEFAULT_WAV = Path(__file__).resolve().parents[2] / "tests" / "data" / "speech_en_16k.wav"


class AudioError(ValueError):
    pass


@dataclass(frozen=True)
class Utterance:
    pcm: np.ndarray  # [samples] int16 at 24 kHz, leading/trailing silence removed
    source: str

    @property
    def duration_s(self) -> float:
        return len(self.pcm) / SAMPLE_RATE

    def frames_b64(self, frame_ms: int) -> list[str]:
        """Base64 PCM16 frames of `frame_ms` (the last one zero-padded), encoded once and shared by all users."""
        return _frames_b64(self.pcm, frame_ms)


def _frames_b64(pcm: np.ndarray, frame_ms: int) -> list[str]:
    n = SAMPLE_RATE * frame_ms // 1000
    if n <= 0:
        raise AudioError(f"frame_ms must give at least one sample, got {frame_ms}")
    padded = np.zeros(-(-len(pcm) // n) * n, dtype="<i2")
    padded[: len(pcm)] = pcm
    return [base64.b64encode(padded[i : i + n].tobytes()).decode("ascii") for i in range(0, len(padded), n)]


def silence_frame_b64(frame_ms: int) -> str:
    return _frames_b64(np.zeros(SAMPLE_RATE * frame_ms // 1000, dtype="<i2"), frame_ms)[0]


def _trim(pcm: np.ndarray, rate: int, threshold: float = 0.02) -> np.ndarray:
    """Cut leading/trailing stretches quieter than `threshold` of full scale (10 ms windows), so 'speech end'
    is the end of the voice, not of the file."""
    win = max(1, rate // 100)
    nwin = len(pcm) // win
    if nwin == 0:
        return pcm
    x = pcm[: nwin * win].astype(np.float32).reshape(nwin, win) / 32768.0  # [windows, win]
    loud = np.flatnonzero(np.abs(x).max(axis=1) > threshold)
    if len(loud) == 0:
        raise AudioError("the WAV is silent (no 10 ms window above 2% of full scale)")
    return pcm[loud[0] * win : (loud[-1] + 1) * win]


def insert_pauses(utt: Utterance, min_ms: int, max_ms: int, every_s: float = 1.2, seed: int = 0) -> Utterance:
    """The utterance with a pause of MIN-MAX ms (seeded) at its quietest 10 ms in each stretch of `every_s`, away
    from its ends: speech that stops mid-turn, as people do between clauses."""
    if not 0 < min_ms <= max_ms:
        raise AudioError(f"pauses must be 0 < MIN <= MAX ms, got {min_ms}-{max_ms}")
    rng = np.random.default_rng(seed)
    win = SAMPLE_RATE // 100
    level = np.abs(utt.pcm[: len(utt.pcm) // win * win].astype(np.float32)).reshape(-1, win).max(axis=1)  # [windows]
    step, edge = int(every_s * 100), 30  # in 10 ms windows; no pause in the first or last 0.3 s
    cuts = [k + int(np.argmin(level[k:k + step])) for k in range(edge, len(level) - edge - step // 2, step)]
    pieces, last = [], 0
    for c in cuts:
        pieces += [utt.pcm[last:c * win], np.zeros(SAMPLE_RATE * int(rng.integers(min_ms, max_ms + 1)) // 1000, "<i2")]
        last = c * win
    pieces.append(utt.pcm[last:])
    return Utterance(pcm=np.concatenate(pieces), source=f"{utt.source} with pauses of {min_ms}-{max_ms} ms")


def load_utterance(path: str | Path | None) -> Utterance:
    """Integer-PCM WAV of any rate and channel count -> 24 kHz mono int16, trimmed. `None`: the repository's
    sample."""
    from server.audio.pcm import float32_to_pcm16, read_wav
    from server.audio.resample import AudioError as PcmError

    if path is None:
        if not DEFAULT_WAV.is_file():
            raise AudioError(f"no --audio given and the default sample {DEFAULT_WAV} is not there; "
                             "pass --audio speech.wav (integer PCM)")
        path = DEFAULT_WAV
    try:
        x, _ = read_wav(path, target_rate=SAMPLE_RATE)  # [samples] float32
    except PcmError as e:
        raise AudioError(str(e)) from None
    pcm16 = np.frombuffer(float32_to_pcm16(x), dtype="<i2")
    return Utterance(pcm=_trim(pcm16, SAMPLE_RATE), source=str(path))
