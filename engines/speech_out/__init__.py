"""Speech out: streaming codec decoder (codes -> 80-bin mel by flow matching -> 24 kHz PCM by a vocoder).

Public API (what the engine/server uses):

    from engines.speech_out import CodecDecoder, Voice, BadCodesError

    dec = CodecDecoder.load("tiny-random" | "full-random" | "/path/to/MOSS-Speech-Codec",
                            device="cuda", vocoder="bigvgan" | "hift",
                            cuda_graphs=False, estimator_dtype="float32" | "bfloat16")
    # A preset has BigVGAN and HiFT with random weights; a real codec directory has HiFT (`flow/hift.pt`)
    # and BigVGAN only if `bigvgan/` holds a generator trained on the codec mel (else ConfigError).

    s = dec.open_stream(session_id, voice=None, seed=1234)  # voice: Voice (None = built-in / empty prompt)
    pcm = s.push(codes)      # float32 np.ndarray at 24 kHz, possibly empty; codes: ints in [0, 16384)
    pcm = s.finalize()       # last partial chunk (no lookahead) + held crossfade tail
    s.close()                # frees the session state
    pcm = dec.decode(codes, voice=None, seed=1234)  # offline: identical result to push-all + finalize

    s.add(codes); jobs = s.take_jobs()  # ready chunks in order (finishing=True: the rest, the last one final)
    pcms = dec.run_jobs(jobs_of_many_sessions)  # at most one chunk per session, decoded as one batch: PCM per job

Streaming schedule: 5 codes per chunk + 3 lookahead codes (the first chunk needs 8 codes), 4 mel frames
per code, 1920 samples per code; a stream of N codes yields exactly N x 1920 samples over push + finalize.
Bad codes (negative, >= 16384, non-integer, not 1-D) raise BadCodesError (a ValueError).
Voices: `Voice.random(seed)`, `Voice.empty()`, `Voice.from_wav(path, encode=..., campplus=...)`.
Random codec directories: `engines.speech_out.random_codec.write_random_codec(dir, "tiny-random")`.

Where this differs from the reference (CosyVoice2-style) streaming, by design or for lack of facts:
- Flow encoder: each chunk attends to the whole prompt, the previous `enc_left_chunks` (4) chunks and itself
  (the reference re-encodes all tokens so far each chunk). The prompt and the answer are separate segments
  for the lookahead and upsampling convolutions, so a voice's encoder state is computed once and shared.
  Streaming equals a dense full-sequence pass with that mask (tests/engines/speech_out/test_conformer_oracle.py).
- CFM estimator: each chunk is integrated over a window of the previous chunk's last 20 frames (their stored
  x_t trajectories, fixed) plus its own frames, with a block-causal mask. The first chunk's context is the
  prompt's last 20 frames placed on the straight flow path toward the prompt mel.
- Vocoder: 8 frames of left mel context per window; the last 2 frames (40 ms) are held back and crossfaded
  with the next window. HiFT harmonic phases are carried across windows; noise comes from the session RNG.
- "Offline" (`decode`) is the same chunk schedule in one call, so streamed == offline to float rounding.
- Key names/shapes follow the public CosyVoice2 layout with MOSS sizes (vocab 20480, upsample stride 4,
  up-conv kernel 9); they were not checked against the real MOSS-Speech-Codec files. The loader names every
  missing, unexpected or mis-shaped key. The Kaldi fbank feeding campplus.onnx is our own implementation.
"""

from engines.speech_out.codes import BadCodesError, validate_codes
from engines.speech_out.decoder import CodecDecoder
from engines.speech_out.mel_spec import CODEC_MEL, MelMismatchError, MelSpec
from engines.speech_out.stream import DecodeStream
from engines.speech_out.voice import Voice

__all__ = ["BadCodesError", "CODEC_MEL", "CodecDecoder", "DecodeStream", "MelMismatchError", "MelSpec", "Voice",
           "validate_codes"]
