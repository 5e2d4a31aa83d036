"""Causal Whisper-VQ speech encoder of the MOSS-Speech codec: 16 kHz PCM -> 12.5 Hz codes (0..16383).

Public API::

    from engines.speech_in import SpeechEncoder
    enc = SpeechEncoder.load("tiny-random" | "full-random" | "/path/to/MOSS-Speech-Codec",
                             device="cpu" | "cuda", dtype=None | "float32" | "bfloat16")
    codes = enc.encode(pcm)                  # whole utterance, float32 np.ndarray / tensor in [-1, 1]
    s = enc.open_stream()                    # one per user session
    codes = s.push(piece)                    # any piece size; codes as soon as they are determined
    codes = s.finalize()                     # last partial 80 ms completed with silence; stream closes
    out = enc.batch().step([(s1, p1), (s2, p2)])   # several sessions in one forward, same result as alone
    out = enc.batch().finalize([s1, s2])
    s.close()                                # abandon without flushing (frees the stream's KV slot)
    enc.reserve(64)                          # preallocate KV slots for 64 concurrent streams
    s.codes_out, s.samples_seen, s.last_features   # progress; pre-VQ features [n, d] of the last codes
    r = enc.refloor(turn_pcm, final=True)   # a committed turn's codes with the whole-segment log-mel floor,
    codes = r.apply(codes)                   # from its first that may change (None: none does)

Timing: code k covers samples [1280 k, 1280 k + 1280) and is known once sample 1280 k + 1160 has
arrived. A finalized stream of n samples has produced ceil(n / 1280) codes. Every 30 s (1500 frames at
50 Hz) the trunk restarts (positions, conv, KV), like the reference's 30 s windows.

Streaming equals whole-utterance encoding (same codes) in float32 (the default, as in the codec's
config): the pre-VQ features agree to float rounding (tested at atol 1e-4; ~1e-5 measured at full size).
bfloat16 is not chunking-invariant: different piece sizes give different matmul shapes and bf16 rounding
moves features by ~1% (full-random, 80 ms pieces: 1 code in 25 flipped). Use float32 where streaming
must equal offline; the encoder is ~0.34 B parameters, so float32 costs little.
Write a random codec encoder in the real layout with
`write_random_encoder(dir, ENCODER_PRESETS["tiny-random"])`.

Where this differs from the reference encoder (module docstrings of log_mel.py, segment_floor.py and model.py):
- the log-mel floor: while a turn streams, (running max - 8); the reference's (max - 8) over each whole 30 s
  segment once the turn is committed (`refloor`);
- edge padding: zeros before a stream's first sample, and a stream is framed across its 30 s segment ends; the
  reference reflects at each segment's edges;
- attention: strictly causal, where the reference's offline encoder attends within 4 s blocks.
"""

from engines.speech_in.config import EncoderConfig
from engines.speech_in.encoder import (
    EncoderBatch,
    EncoderInputError,
    EncoderStream,
    SpeechEncoder,
    StreamClosedError,
)
from engines.speech_in.presets import ENCODER_PRESETS, encoder_preset
from engines.speech_in.weights import EncoderCheckpointError, write_random_encoder

__all__ = [
    "ENCODER_PRESETS", "EncoderBatch", "EncoderCheckpointError", "EncoderConfig", "EncoderInputError",
    "EncoderStream", "SpeechEncoder", "StreamClosedError", "encoder_preset", "write_random_encoder",
]
