"""`moss-speech` command line: each subcommand lives in the module that owns it.

A command module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported only
when its subcommand runs, so `generate` never imports the server and `serve` never imports
benchmarks.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command path, module, help)
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("serve",), "moss_speech.commands.serve", "serve the realtime API and the web page"),
    (("generate",), "moss_speech.commands.generate", "generate one answer and print both channels"),
    (("write-checkpoint",), "engines.lm.loader.random_checkpoint", "write a random checkpoint in the real layout"),
    (("check-weights",), "moss_speech.commands.check_weights", "check a model and codec's files, keys, shapes, dtypes"),
    (("bench", "engine"), "moss_speech.commands.bench_engine", "time prefill and decode against their floors"),
    (("bench", "codec"), "moss_speech.commands.bench_codec", "time codec chunks at several batch sizes"),
    (("bench", "turn"), "moss_speech.commands.bench_turn", "engine TTFA of a spoken turn, incremental vs at once"),
    (("bench", "encoder"), "moss_speech.commands.bench_encoder", "time the speech encoder per step of audio"),
    (("bench", "refill"), "moss_speech.commands.bench_refill", "re-prefill of a cut conversation beside answers"),
    (("bench", "sessions"), "moss_speech.commands.bench_sessions", "the server process's CPU per real-time session"),
    (("bench", "capacity"), "moss_speech.loadtest.capacity", "raise concurrency until TTFA or underruns break"),
    (("bench", "soak"), "moss_speech.loadtest.soak", "sessions churning for long: memory, KV and TTFA drift"),
    (("codec", "decode"), "moss_speech.commands.codec_decode", "codes -> 24 kHz WAV"),
    (("codec", "encode"), "moss_speech.commands.codec_encode", "WAV -> 12.5 Hz codes"),
    (("loadtest",), "moss_speech.loadtest.run", "simulated users against a running server"),
]


def _match(argv: list[str]) -> tuple[tuple[str, ...], str] | None:
    for path, module, _ in COMMANDS:
        if tuple(argv[: len(path)]) == path:
            return path, module
    return None


def _usage() -> str:
    lines = ["usage: moss-speech COMMAND [options]", "", "commands:"]
    lines += [f"  {' '.join(path):<18} {help_text}" for path, _, help_text in COMMANDS]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    found = _match(argv)
    if found is None:
        print(_usage(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    path, module = found
    mod = importlib.import_module(module)
    parser = argparse.ArgumentParser(prog="moss-speech " + " ".join(path))
    mod.add_arguments(parser)
    args = parser.parse_args(argv[len(path):])
    return int(mod.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
