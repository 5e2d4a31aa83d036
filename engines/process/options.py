"""The engine process's command-line options (`python -m engines.process.main --help`).

Apart from the engine process so that their definitions import neither torch nor the engine: `moss-speech serve`
offers each of them as a flag and a MOSS_* setting of its own (server/engine_options.py) and passes on what it is
given.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

CLIENT_TIMEOUT_S = 30.0  # as long as a server waits for our Pong before it declares us lost
MAX_TEXT_CHARS = 32_768  # a text is tokenized on the engine loop (~10-30 ms at this length)
MAX_OUTPUT_TOKENS = 2_048  # 164 s of speech


def _kv_gib(text: str) -> float | str:
    if text == "auto":
        return text
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB (a number) or auto, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _positive_gib(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GiB (a number), got {text!r}") from None
    if not 0 < v < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return v


def _non_negative_ms(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds (a number), got {text!r}") from None
    if not 0 <= v < math.inf:  # (NaN too)
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= low, else argparse's usage error naming the value."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {n}")
        return n
    return parse


_positive_int = int_at_least(1)


def parser() -> argparse.ArgumentParser:
    """The engine process's command line (config.ProcessConfig.from_args checks the options together)."""
    p = argparse.ArgumentParser(prog="python -m engines.process.main",
                                description="The engine process: owns the GPU, serves session messages over a "
                                            "ZeroMQ ROUTER socket.")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random", help="tiny-random | full-random | checkpoint dir")
    p.add_argument("--codec", default="tiny-random", help="tiny-random | full-random | codec dir | none")
    p.add_argument("--device", default="cpu", help="cpu | cuda[:N] | auto (cuda when there is a GPU)")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: model's, float32 on CPU)")
    p.add_argument("--endpoint", default="ipc:///tmp/moss-speech-engine.sock")
    p.add_argument("--vocoder", default=None, choices=["bigvgan", "hift"],
                   help="default: hift for a codec dir without bigvgan/, else bigvgan")
    p.add_argument("--ready-file", default=None)
    p.add_argument("--client-timeout-s", type=float, default=CLIENT_TIMEOUT_S,
                   help="close the sessions of a client (server process) silent for this long")
    p.add_argument("--kv-cache-gib", type=_kv_gib, default=None, metavar="GIB|auto",
                   help="the language model's KV pool; auto (the default on a GPU): the memory left free once "
                        "everything else is loaded, less a headroom (engines/lm/kv/sizing.py); on a CPU default 0.25")
    p.add_argument("--max-running", type=int, default=None)
    p.add_argument("--step-rows", type=_positive_int, default=None, metavar="N",
                   help="rows one step carries at most (decodes + prefill chunks; must exceed --max-running; default: "
                        "EngineConfig.prefill_token_budget, or twice --max-running when that is more). Under load "
                        "the user audio of every speaking session is prefilled in a few big steps, which a commit's "
                        "codes wait out before its answer can start")
    p.add_argument("--ramp-step-rows", type=int_at_least(0), default=None, metavar="N",
                   help="while a new answer makes its first rows, steps carry at most N rows (decodes + prefill "
                        "of users still speaking; committed turns are outside the cap; 0: no cap; default: "
                        "EngineConfig.ramp_step_rows in engines/config.py)")
    p.add_argument("--fp8-weights", action="store_true",
                   help="round the language model's weights to fp8 (per-row power-of-two scales) and read an fp8 "
                        "copy in decode steps: faster steps, other numerics than the published bf16 weights, and half "
                        "the weights' memory more (the bf16 weights stay for prefill; engines/lm/model/fp8.py)")
    p.add_argument("--fp8-only", action="store_true",
                   help="with --fp8-weights: keep only the fp8 copies, so the weights take half their bf16 memory "
                        "instead of 1.5x it (for an 80 GB GPU); steps over 32 rows run the fp8 GEMM, up to ~1.5x "
                        "slower than cuBLAS at prefill sizes")
    p.add_argument("--kv-dtype", choices=("auto", "fp8"), default="auto",  # EngineConfig.kv_dtype (no torch here)
                   help="the language model's KV cache: auto (the model dtype) or fp8 (e4m3, unit scale, saturated at "
                        "+-448): half the bytes, so the pool holds twice the rows and decode attention reads half as "
                        "much; other numerics than the published model")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-text-chars", type=_positive_int, default=MAX_TEXT_CHARS, metavar="N",
                   help="longest text a session may send (instructions, a text item), in characters; past it the "
                        "message is refused with input_too_large")
    p.add_argument("--max-output-tokens", type=_positive_int, default=MAX_OUTPUT_TOKENS, metavar="N",
                   help="longest answer a session may ask for, in rows (12.5 per second of speech); an answer's KV is "
                        "reserved whole when it starts. Past it the response is refused with input_too_large")
    p.add_argument("--voice", default=None, metavar="WAV",
                   help="the voice answers speak in when a session sets no voice prompt: an integer-PCM WAV of "
                        "8-192 kHz and at most 30 s (default: the bundled voice, synthesized speech; "
                        "docs/operations.md, Voice)")
    p.add_argument("--decoder-context", choices=("full", "window"), default="full",
                   help="what the codec decoder's flow sees of an answer's earlier chunks: full (the default), every "
                        "earlier chunk and the voice prompt, as the published chunk model was trained, its keys and "
                        "values kept in a cache of --decoder-cache-gib; window, the prompt and the last 4 chunks only: "
                        "bounded memory, an approximation of the model (docs/fidelity.md, Streaming decode context)")
    p.add_argument("--decoder-cache-gib", type=_positive_gib, default=None, metavar="GIB",
                   help="with --decoder-context full: memory for the flow's cached keys and values, 109 MiB per second "
                        "of answer audio in progress (bf16, the real model; 55 in fp8); when it runs short, answers "
                        "longer than ~11 s forget their oldest chunks (default: 40 on a GPU, 0.5 on a CPU)")
    p.add_argument("--decoder-cache-dtype", choices=("auto", "fp8"), default="auto",
                   help="with --decoder-context full: the element type of the flow's cached keys and values: auto "
                        "(the estimator's) or fp8 (e4m3, saturated at +-448): half the memory a second of answer "
                        "takes, so answers forget their oldest chunks later or never, for rounds ~5%% longer at the "
                        "same chunks; other numerics than the published model (docs/fidelity.md)")
    p.add_argument("--encode-every-ms", type=_non_negative_ms, default=80.0,
                   help="encode every session's held user audio together, in one batch, at most this often "
                        "(0: as it arrives)")
    p.add_argument("--encoder-thread", dest="encoder_thread", action=argparse.BooleanOptionalAction, default=None,
                   help="run the speech encoder's calls on a thread of their own, beside the engine steps, instead of "
                        "in the engine loop (default: on a GPU)")
    p.add_argument("--encoder-graphs", dest="encoder_graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on a GPU, replay the speech encoder's steps of up to 8 sessions as CUDA graphs (a commit's "
                        "step is ~60 torch calls and ~300 launches for a few ms of GPU work)")
    p.add_argument("--encoder-tf32", action="store_true",
                   help="on a GPU, run the speech encoder's float32 products (its GEMMs and attention) on TF32 tensor "
                        "cores instead of at float32 accuracy (3xTF32): ~3x less tensor-core work in its calls, other "
                        "numerics than float32 (features within ~3e-3 of their scale; streamed codes still equal "
                        "whole-utterance codes)")
    p.add_argument("--warm-up", dest="warm_up", action=argparse.BooleanOptionalAction, default=None,
                   help="run throw-away spoken turns before serving (default: on a GPU), so the first users do not "
                        "pay one-time kernel compiles and plan builds")
    p.add_argument("--first-lane", dest="first_lane", action=argparse.BooleanOptionalAction, default=None,
                   help="decode new answers' first chunks on a second codec thread with graphs of its own, while "
                        "rounds of playing answers pause between pieces of their work (default: on a GPU; "
                        "docs/performance.md, Capacity)")
    p.add_argument("--first-lanes", type=_positive_int, default=2, metavar="N",
                   help="with the first lane: this many lanes, each a thread with graphs of its own, so a new answer "
                        "whose first chunk is ready while another's is decoding need not wait for it (default 2: "
                        "at 256 sessions on an H200 p95 TTFA 214 / 206 ms against 265 / 209 with one, 2026-11-29)")
    p.add_argument("--codec-round-max", type=_positive_int, default=None, metavar="N",
                   help="most playing answers one codec round decodes (more only while more are about to run dry; "
                        "default engines/process/codec_pacing.py BULK_MAX); refused beside a first lane unless "
                        "--codec-round-period-ms 0 (rounds once a period take every answer due)")
    p.add_argument("--codec-round-period-ms", type=_non_negative_ms, default=200.0, metavar="MS",
                   help="with the first lane: rounds of playing answers start at most this often (sooner for one "
                        "about to run dry), each with every answer due before the next; 0: back to back, at most "
                        "--codec-round-max each (docs/performance.md, Capacity)")
    p.add_argument("--gpu-window", default=None, metavar="SESSIONS,SECONDS,PATH",
                   help="development: once SESSIONS sessions are open, record every kernel of the process for SECONDS "
                        "with the torch profiler, write them to PATH (.npz) and log each stream's busy time "
                        "(engines/process/observe/gpu_window.py)")
