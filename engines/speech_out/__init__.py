"""Speech out: streaming codec decoder (codes -> 80-bin mel by flow matching -> 24 kHz PCM by a vocoder).

Public API (what the engine/server uses):

    from engines.speech_out import CodecDecoder, Voice, BadCodesError

    dec = CodecDecoder.load("tiny-random" | "full-random" | "/path/to/MOSS-Speech-Codec",
                            device="cuda", vocoder="bigvgan" | "hift", context="full" | "window",
                            cuda_graphs=False, estimator_dtype="float32" | "bfloat16", cache_gib=None)
    # A preset has BigVGAN and HiFT with random weights; a real codec directory has HiFT (`flow/hift.pt`)
    # and BigVGAN only if `bigvgan/` holds a generator trained on the codec mel (else ConfigError).

    s = dec.open_stream(session_id, voice=None, seed=1234)  # voice: Voice (None: the decoder's default voice)
    pcm = s.push(codes)      # float32 np.ndarray at 24 kHz, possibly empty; codes: ints in [0, 16384)
    pcm = s.finalize()       # last partial chunk (no lookahead) + held crossfade tail
    s.close()                # frees the session state (and, with full context, its cache pages)
    pcm = dec.stream_all(codes, voice=None, seed=1234)  # the same stream, all codes at once
    pcm = dec.decode(codes)  # offline: the offline flow's one full-attention call (load with offline=True)

    s.add(codes); jobs = s.take_jobs()  # ready chunks in order (finishing=True: the rest, the last one final)
    pcms = dec.run_jobs(jobs_of_many_sessions)  # at most one job per session, decoded as one batch: PCM per job,
    # or the DecoderCacheFull that ends a job's answer (full context: no page for it even after forgetting)
    pcms = dec.run_jobs_or_raise(jobs)  # the same, that error raised (a stream on its own, a bench)

Streaming schedule: chunks of 5 codes, each decoded once its 3 lookahead codes are in; 4 mel frames and 1920
samples per code; a stream of N codes yields exactly N x 1920 samples over push + finalize. With full context (the
default: `flow/full_context.py`) each chunk sees the prompt and every earlier chunk, as the chunk model was trained,
and an answer's first job is the voice prompt's last 3-7 codes and its first codes up to a chunk boundary: its first
audio waits for 8-12 codes (`DecodeStream.first_audio_codes`; 10 with the bundled voice). `context="window"` is an
approximation with bounded memory (the prompt and the last 4 chunks in the encoder, 20 earlier frames in the
estimator; docs/fidelity.md has its measured distance), whose first audio waits for 8 codes.
Bad codes (negative, >= 16384, non-integer, not 1-D) raise BadCodesError (a ValueError).
Voices: `Voice.random(seed)`, `Voice.empty()`, `Voice.from_wav(path, encode=..., campplus=...)`.
Random codec directories: `engines.speech_out.random_codec.write_random_codec(dir, "tiny-random")`.

Where this differs from the reference (CosyVoice2-style) streaming, by design or for lack of facts:
- Vocoder: 8 frames of left mel context per window; the last 2 frames (40 ms) are held back and crossfaded
  with the next window. HiFT harmonic phases are carried across windows; noise comes from the session RNG.
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
