"""Streaming voice activity detection with Silero VAD (the model bundled in the `silero-vad` package).

One detector per session (the model is stateful across windows); it runs on CPU on 512-sample
windows of 16 kHz audio (32 ms), about a millisecond each. Thresholds and timing live in the session.
"""

from __future__ import annotations

import threading
import warnings

import numpy as np
import torch

# The package's own deprecation noise when it loads its model (loaded in worker threads, where
# catch_warnings would race): importlib path and torch.jit.load.
warnings.filterwarnings("ignore", category=DeprecationWarning, module="silero_vad")
warnings.filterwarnings("ignore", message=".*torch.jit.load.*is deprecated", category=DeprecationWarning)

_LOAD_LOCK = threading.Lock()

VAD_RATE = 16000
VAD_WINDOW = 512  # the only window size Silero accepts at 16 kHz


class SileroVad:
    window = VAD_WINDOW

    def __init__(self) -> None:
        from silero_vad import load_silero_vad

        # Sessions load concurrently in worker threads; catch_warnings is process-wide, so one at a time.
        with _LOAD_LOCK, warnings.catch_warnings():  # test runners reset the module-level filters
            warnings.simplefilter("ignore", DeprecationWarning)
            self._model = load_silero_vad()

    def prob(self, chunk: np.ndarray) -> float:
        """Speech probability of one window: float32 [512] at 16 kHz."""
        if chunk.shape != (VAD_WINDOW,):
            raise ValueError(f"VAD window must be {VAD_WINDOW} samples at {VAD_RATE} Hz, got shape {chunk.shape}")
        with torch.inference_mode():
            return float(self._model(torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.float32)), VAD_RATE))

    def probs(self, windows: np.ndarray) -> list[float]:
        """Consecutive windows [n, 512] of one stream, in order (the model state carries across)."""
        return [self.prob(w) for w in windows]

    def reset(self) -> None:
        self._model.reset_states()
