"""Bounds on a voice prompt recording, checked from its WAV header alone before any of its samples are decoded: the
server checks a client's prompt with them, and the engine again before it encodes one (a prompt's encoding costs in
proportion to its length after resampling, and a header can claim any rate: 1 MiB at "400 Hz" is 16 minutes)."""

from __future__ import annotations

from pathlib import Path

from engines.audio.wav import AudioFormatError, read_wav_header

MIN_RATE = 8_000
MAX_RATE = 192_000
# The codec decoder takes prompts of up to 375 codes (engines/speech_out/config.py, max_prompt_codes): 30 s.
MAX_SECONDS = 30.0
# A prompt gives the decoder at least one code (80 ms; its mel and speaker features need 30 and 25 ms).
MIN_SECONDS = 0.08


def check_voice_prompt(wav: str | Path | bytes, max_seconds: float = MAX_SECONDS) -> float:
    """The prompt's duration in seconds; AudioFormatError saying why for a file that is not an integer-PCM WAV, whose
    sample rate is outside MIN_RATE..MAX_RATE, or that is shorter than MIN_SECONDS or longer than `max_seconds`."""
    h = read_wav_header(wav)
    if not MIN_RATE <= h.rate <= MAX_RATE:
        raise AudioFormatError(f"voice prompt sample rate {h.rate} Hz is outside {MIN_RATE}..{MAX_RATE} Hz")
    if h.channels < 1 or h.frames == 0:
        raise AudioFormatError("voice prompt holds no audio")
    if h.seconds < MIN_SECONDS:
        raise AudioFormatError(f"voice prompt of {h.seconds * 1000:.0f} ms is shorter than {MIN_SECONDS * 1000:.0f} ms "
                               "(one code of the speech decoder)")
    if h.seconds > max_seconds:
        raise AudioFormatError(f"voice prompt of {h.seconds:.1f} s is longer than {max_seconds:g} s")
    return h.seconds
