"""Write a random checkpoint of any preset in the release's layout (config.json, sharded safetensors,
index, and a tiny stand-in tokenizer.json). Dev tool: `moss-speech write-checkpoint`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from engines.config import PRESETS, ModelConfig, parse_dtype
from engines.lm.loader.checkpoint import INDEX_FILE
from engines.lm.loader.keys import checkpoint_shapes, is_norm_key, random_fill_
from engines.tokens import ENDOFTEXT, IM_END, IM_START, OBJECT_REF_START, STAND_IN_MARKS

SPECIAL_TOKENS = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END,
                  "<|object_ref_start|>": OBJECT_REF_START, **{name: i for i, name in STAND_IN_MARKS.items()}}


def _shard_plan(shapes: dict[str, tuple[int, ...]], num_shards: int) -> list[list[str]]:
    """Split keys, in order, into `num_shards` groups of about equal element count."""
    total = sum(torch.Size(s).numel() for s in shapes.values())
    plan: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for key, shape in shapes.items():
        shard = min(num_shards - 1, done * num_shards // total)
        plan[shard].append(key)
        done += torch.Size(shape).numel()
    return [keys for keys in plan if keys]


def write_random_checkpoint(out_dir: str | Path, preset_or_config: str | ModelConfig = "tiny-random", seed: int = 0,
                            num_shards: int = 2, dtype: str | torch.dtype | None = None) -> Path:
    """Write the checkpoint; shard by shard, so at full size the host holds one shard at a time."""
    config = PRESETS[preset_or_config] if isinstance(preset_or_config, str) else preset_or_config
    if dtype is not None:
        name = {v: k for k, v in (("bfloat16", torch.bfloat16), ("float16", torch.float16),
                                  ("float32", torch.float32))}[parse_dtype(dtype)]
        config = dataclasses.replace(config, torch_dtype=name)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config.to_json_dict(), indent=2) + "\n")
    shapes = checkpoint_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    plan = _shard_plan(shapes, max(1, num_shards))
    weight_map: dict[str, str] = {}
    total_bytes = 0
    for i, keys in enumerate(plan):
        file = f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors"
        tensors = {}
        for key in keys:
            t = random_fill_(torch.empty(shapes[key], dtype=torch.float32), is_norm_key(key), gen)
            tensors[key] = t.to(config.dtype)
            total_bytes += tensors[key].numel() * tensors[key].element_size()
            weight_map[key] = file
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        del tensors
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    write_stand_in_tokenizer(out / "tokenizer.json")
    return out


def write_stand_in_tokenizer(path: str | Path) -> None:
    """Byte-level BPE over the 256 byte symbols (ids 0..255, no merges) plus the real special-token ids.

    Any text round-trips; the chat-format special tokens encode to their real Qwen ids.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # dev tool only: engines stay torch-only

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update(SPECIAL_TOKENS)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))  # ids come from the vocab above
    tok.save(str(path))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny-random", choices=sorted(PRESETS), help="model shape")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=2, help="number of safetensors shards")
    parser.add_argument("--dtype", default=None, help="bfloat16|float16|float32 (default: the preset's)")


def run(args: argparse.Namespace) -> int:
    out = write_random_checkpoint(args.out, args.preset, seed=args.seed, num_shards=args.shards, dtype=args.dtype)
    print(f"wrote {args.preset} checkpoint to {out}")
    return 0
