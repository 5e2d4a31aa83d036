"""Frozen, validated configuration: the model's shape and the engine's limits."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from engines.tokens import EOSP, MODALITY_PAD, SOSP


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# EngineConfig.kv_dtype -> the cache's element type (None: the model dtype).
KV_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8": torch.float8_e4m3fn}
FP8_MAX = 448.0  # the largest finite e4m3 value: K/V beyond it are stored saturated


def to_cache(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values in a cache's element type: an fp8 cache stores them saturated at +-FP8_MAX (the GPU write
    kernels do the same: engines/kernels/cache_value.py), rounded to nearest even."""
    if dtype == torch.float8_e4m3fn:
        return x.clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


def cache_views(x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in the cache's element type, the cache) as an indexed copy writes them: an fp8 cache's as bytes (indexing
    has no fp8 kernels on every device). Read an fp8 cache's gathered bytes back with `.view(cache.dtype)`."""
    x = to_cache(x, cache.dtype)
    if cache.element_size() == 1:
        return x.view(torch.uint8), cache.view(torch.uint8)
    return x, cache


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} not one of {sorted(_DTYPES)}")
    return _DTYPES[name]


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the MOSS-Speech language model as published."""

    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    vocab_size: int = 151680  # text channel
    audio_vocab_size: int = 16512  # audio channel
    num_shared_layers: int = 32
    num_modality_layers: int = 4  # per tail: text and audio
    max_position_embeddings: int = 40960
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "vocab_size", "audio_vocab_size", "num_shared_layers",
                  "num_modality_layers", "max_position_embeddings"):
            v = getattr(self, f)
            _require(isinstance(v, int) and v > 0, f"ModelConfig.{f} must be a positive int, got {v!r}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0,
                 f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                 f"num_key_value_heads ({self.num_key_value_heads})")
        _require(self.head_dim % 2 == 0, f"head_dim must be even for RoPE, got {self.head_dim}")
        _require(self.rms_norm_eps > 0, f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        # Real special ids must exist in both vocabularies.
        _require(self.vocab_size > 151667, f"vocab_size {self.vocab_size} cannot hold modality_pad 151667")
        _require(self.audio_vocab_size > 16384, f"audio_vocab_size {self.audio_vocab_size} cannot hold eosp 16384")
        parse_dtype(self.torch_dtype)

    @property
    def num_attention_layers(self) -> int:
        """Shared trunk plus both tails: 40 at full size (config.json's num_hidden_layers says 36)."""
        return self.num_shared_layers + 2 * self.num_modality_layers

    @property
    def num_hidden_layers(self) -> int:
        return self.num_shared_layers + self.num_modality_layers

    @property
    def dtype(self) -> torch.dtype:
        return parse_dtype(self.torch_dtype)

    def kv_bytes_per_row(self, dtype: torch.dtype | None = None) -> int:
        elem = torch.empty((), dtype=dtype or self.dtype).element_size()
        return self.num_attention_layers * 2 * self.num_key_value_heads * self.head_dim * elem

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a checkpoint's config.json: missing keys are an error, and so are values of keys the model does not
        read but would change (`unsupported_config_values`); other keys are named by `ignored_config_keys`."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: invalid JSON ({e})") from None
        known = {f.name for f in fields(cls)}
        required = known - {"max_position_embeddings", "torch_dtype", "rope_theta", "rms_norm_eps"}
        missing = sorted(required - raw.keys())
        if missing:
            raise ConfigError(f"{path}: missing keys {missing}")
        unsupported = unsupported_config_values(raw)
        if unsupported:
            raise ConfigError(f"{path}: " + "; ".join(unsupported))
        layers = raw["num_shared_layers"] + raw["num_modality_layers"]
        if "num_hidden_layers" in raw and raw["num_hidden_layers"] != layers:
            raise ConfigError(
                f"{path}: num_hidden_layers {raw['num_hidden_layers']} != num_shared_layers "
                f"{raw['num_shared_layers']} + num_modality_layers {raw['num_modality_layers']}")
        return cls(**{k: v for k, v in raw.items() if k in known})

    def to_json_dict(self) -> dict:
        d = asdict(self)
        d["num_hidden_layers"] = self.num_hidden_layers
        d["architectures"] = ["MossSpeechForCausalLM"]
        return d


# config.json keys the serving model does not read, each with the value(s) it implements: another value would change
# the model, so it is refused by name rather than ignored.
_FIXED_KEYS: dict[str, tuple] = {
    "rope_scaling": (None,), "use_sliding_window": (False,), "tie_word_embeddings": (False,),
    "attention_bias": (False,), "hidden_act": ("silu",), "modality_pad_token_id": (MODALITY_PAD,),
    "sosp_token_id": (SOSP,), "eosp_token_id": (EOSP,),
}
# Keys with no effect on inference (bookkeeping of transformers, training-only settings, or settings that only act
# through a refused value above).
INERT_CONFIG_KEYS = frozenset({
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id",
    "eos_token_id", "pad_token_id", "initializer_range", "use_cache", "attention_dropout", "sliding_window",
    "max_window_layers", "num_hidden_layers", "layer_types", "channels", "_name_or_path",
})


def unsupported_config_values(raw: dict) -> list[str]:
    """config.json values the serving model does not implement, one phrase each."""
    out = [f"{k} {raw[k]!r} unsupported (expected {' or '.join(repr(v) for v in ok)})"
           for k, ok in _FIXED_KEYS.items() if k in raw and raw[k] not in ok]
    layer_types = raw.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        out.append(f"layer_types {sorted(set(layer_types))} unsupported (expected every layer 'full_attention')")
    return out


def ignored_config_keys(raw: dict) -> list[str]:
    """config.json keys that are neither read, nor checked, nor known to be inert."""
    known = {f.name for f in fields(ModelConfig)} | _FIXED_KEYS.keys() | INERT_CONFIG_KEYS
    return sorted(raw.keys() - known)


PRESETS: dict[str, ModelConfig] = {
    # Small dims, real vocab sizes and special ids: runs on a laptop CPU.
    "tiny-random": ModelConfig(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_shared_layers=2, num_modality_layers=2, max_position_embeddings=8192,
        torch_dtype="float32",
    ),
    # Real dims, random weights: for GPU benchmarks.
    "full-random": ModelConfig(),
}


def model_config_for(name_or_path: str) -> ModelConfig:
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    return ModelConfig.from_json(name_or_path)


def kv_torch_dtype(kv_dtype: str, dtype: str | torch.dtype) -> torch.dtype:
    """The KV cache's element type for EngineConfig.kv_dtype and the model dtype."""
    return KV_DTYPES[kv_dtype] or parse_dtype(dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Limits of one engine process."""

    block_size: int = 16  # rows per KV block
    kv_cache_bytes: int = 256 * 1024 * 1024  # KV pool size across all layers
    max_running: int = 64  # sequences decoded together
    prefill_token_budget: int = 512  # rows per step (decodes + prefill chunks)
    # While a sequence is in its first `ramp_rows` generated rows (a new answer: its first audio waits on each of
    # those steps; a request may say how many, Engine.add_request), a step carries at most `ramp_step_rows` rows
    # (decodes + prefill; prefill at least RAMP_MIN_PREFILL), so a long prefill beside it does not lengthen them.
    # Complete inputs (committed turns, whose answers come next) are outside the cap. 0: off.
    ramp_rows: int = 8
    ramp_step_rows: int = 64
    max_waiting: int = 256  # bounded admission queue
    max_model_len: int = 8192  # rows per conversation (history + answer)
    device: str = "cpu"
    dtype: str = "float32"
    cuda_graphs: bool = True  # used on CUDA devices only
    # Launch the next all-audio decode step before reading this one's tokens, so the GPU never waits for
    # the host between steps (Engine.step); tokens are identical either way.
    overlap: bool = True
    # Round the language model's weights to fp8 (e4m3, a power-of-two scale per row: engines/lm/model/fp8.py) and read
    # an fp8 copy in decode-sized GEMMs (half the bytes of a step). This changes the model's numerics against the
    # published bf16 weights, so it is off unless asked for.
    fp8_weights: bool = False
    # With fp8_weights: keep only the fp8 copies (the bf16 weights go, so the weights take half their bf16 memory
    # instead of 1.5x it), and steps of more than 32 rows run the fp8 GEMM (engines/kernels/lm/fp8_gemm.py) instead of
    # cuBLAS over bf16: level at 33-64 rows, up to ~1.5x slower at prefill sizes (H200). For GPUs where the bf16
    # weights beside the copies leave the KV pool thin (an 80 GB H100 at --max-running 128).
    fp8_only: bool = False
    # The KV cache's element type: "auto" keeps the model dtype; "fp8" stores K and V as e4m3 (unit scale, values
    # saturated at +-448), half the bytes of bf16: the pool holds twice the rows and the decode attention, which
    # reads every cached row of every running sequence each step, reads half as much. A numerics change (keys
    # keep 3 mantissa bits), so off unless asked for. The attention kernels convert each tile (to fp16 under bf16
    # queries: engines/kernels/cache_value.fp16_dots).
    kv_dtype: str = "auto"

    def __post_init__(self) -> None:
        for f in ("block_size", "kv_cache_bytes", "max_running", "prefill_token_budget", "max_model_len"):
            v = getattr(self, f)
            _require(isinstance(v, int) and not isinstance(v, bool) and v > 0,
                     f"EngineConfig.{f} must be a positive int, got {v!r}")
        for f in ("ramp_rows", "ramp_step_rows"):
            v = getattr(self, f)
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                     f"EngineConfig.{f} must be an int >= 0, got {v!r}")
        _require(isinstance(self.max_waiting, int) and self.max_waiting >= 0,
                 f"EngineConfig.max_waiting must be an int >= 0, got {self.max_waiting!r}")
        _require(self.prefill_token_budget > self.max_running,
                 f"prefill_token_budget ({self.prefill_token_budget}) must exceed max_running "
                 f"({self.max_running}) so prefill always makes progress beside full decode")
        parse_dtype(self.dtype)
        _require(isinstance(self.fp8_weights, bool),
                 f"EngineConfig.fp8_weights must be a bool, got {self.fp8_weights!r}")
        _require(isinstance(self.fp8_only, bool), f"EngineConfig.fp8_only must be a bool, got {self.fp8_only!r}")
        _require(not self.fp8_only or self.fp8_weights, "EngineConfig.fp8_only needs fp8_weights (it says which "
                 "weights an fp8 model keeps)")
        _require(not self.fp8_weights or self.torch_dtype in (torch.bfloat16, torch.float32),
                 f"EngineConfig.fp8_weights needs dtype bfloat16 or float32 (fp8 values are exact in those), "
                 f"got {self.dtype}")
        _require(self.kv_dtype in KV_DTYPES, f"EngineConfig.kv_dtype must be one of {sorted(KV_DTYPES)}, "
                 f"got {self.kv_dtype!r}")
        try:
            torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"EngineConfig.device {self.device!r}: {e}") from None

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        """The KV cache's element type."""
        return kv_torch_dtype(self.kv_dtype, self.dtype)

    def block_bytes(self, model: ModelConfig) -> int:
        """One KV block of `model` over every layer."""
        return model.kv_bytes_per_row(self.kv_torch_dtype) * self.block_size

    def num_blocks(self, model: ModelConfig) -> int:
        per_block = self.block_bytes(model)
        n = self.kv_cache_bytes // per_block
        if n < 1:
            raise ConfigError(f"kv_cache_bytes {self.kv_cache_bytes} holds no block of {per_block} bytes")
        return n
