"""`moss-speech generate`: one answer to a text prompt; prints the text channel and the audio codes."""

from __future__ import annotations

import argparse
import json
import sys

from engines.api import SamplingParams
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.prompt import PromptBuilder
from engines.process.tokenizer import load_tokenizer
from engines.tokens import EOSP


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-random", help="tiny-random, full-random or a checkpoint directory")
    p.add_argument("--prompt", required=True)
    p.add_argument("--output-modality", choices=["audio", "text"], default="audio")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    cfg = EngineConfig(device=args.device, dtype=dtype, max_model_len=max(4096, args.max_new_tokens + 1024),
                       kv_cache_bytes=512 * 1024 * 1024)
    engine = Engine.from_name(args.model, cfg, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    prompt = PromptBuilder(tokenizer)
    rows = (prompt.system_rows(None, args.output_modality) + prompt.text_turn_rows("user", args.prompt)
            + prompt.assistant_prefix_rows(args.output_modality))
    params = SamplingParams(max_new_tokens=args.max_new_tokens, seed=args.seed, greedy=args.greedy)
    engine.add_request("generate", rows, params)
    text_ids, codes, finish = [], [], None
    while engine.has_work():
        for o in engine.step():
            if o.mode == "text":
                text_ids.append(o.text_token)
            elif o.audio_token < EOSP:
                codes.append(o.audio_token)
            finish = o.finish_reason or finish
    text = tokenizer.decode(text_ids)
    if args.json:
        print(json.dumps({"text": text, "text_tokens": text_ids, "audio_codes": codes, "finish_reason": finish}))
    else:
        print(f"text: {text!r}")
        print(f"audio codes ({len(codes)}): {' '.join(map(str, codes))}")
        print(f"finish: {finish}")
    if args.model in ("tiny-random", "full-random"):
        print("note: random weights: the output is noise by design", file=sys.stderr)
    return 0
