"""`moss-speech check-weights [MODEL_DIR] [--codec CODEC_DIR]`: every file, key, shape and dtype of a downloaded
model and codec (engines/weights_check.py), each problem named with what was expected; exit 1 on any."""

from __future__ import annotations

import argparse
import sys

from engines.weights_check import model_notes, problems_text, weights_problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None, help="the language model directory (fnlp/MOSS-Speech)")
    parser.add_argument("--codec", default=None, help="the codec directory (fnlp/MOSS-Speech-Codec)")


def run(args: argparse.Namespace) -> int:
    if args.model is None and args.codec is None:
        print("check-weights: give a model directory, --codec DIR, or both", file=sys.stderr)
        return 2
    for note in model_notes(args.model) if args.model else []:
        print(f"note: {note}")
    problems = weights_problems(args.model, args.codec)
    if problems:
        print(problems_text(problems), file=sys.stderr)
        return 1
    checked = " and ".join(x for x in (args.model, args.codec) if x)
    print(f"ok: {checked}: every expected file, key, shape and dtype")
    return 0
