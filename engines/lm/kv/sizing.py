"""The KV pool's size when it is left to the engine (`--kv-cache-gib auto`, the default on a GPU): what the device has
free once everything else is loaded, less a headroom, and never more than the running sequences could fill.

Why: a fixed default small enough for a CPU (EngineConfig's 256 MiB) holds ~1,600 rows on a GPU, about two minutes
of conversation across all sessions, and the right figure depends on the card and on the other parts' options
(the speech encoder's KV slots alone are 29 GiB at --max-running 128).
"""

from __future__ import annotations

from engines.config import ConfigError, EngineConfig, ModelConfig

GIB = 2**30
# Left free after the pool for what is allocated later: the model's CUDA graphs and activations, cuBLAS workspaces,
# the warm-up turns, and per-round tensors of the codec and the speech encoder under load.
HEADROOM_BYTES = 6 * GIB


def fit_kv_cache_bytes(free_bytes: int, config: EngineConfig, model: ModelConfig,
                       headroom_bytes: int = HEADROOM_BYTES) -> int:
    """Bytes for the KV pool: `free_bytes` less the headroom, capped at max_running sequences of max_model_len rows,
    in whole blocks. ConfigError when that is less than one sequence of max_model_len rows."""
    per_block = config.block_bytes(model)
    seq_blocks = -(-config.max_model_len // config.block_size)
    blocks = min((free_bytes - headroom_bytes) // per_block, config.max_running * seq_blocks)
    if blocks < seq_blocks:
        raise ConfigError(
            f"{max(free_bytes - headroom_bytes, 0) / GIB:.1f} GiB of GPU memory is left for the KV pool "
            f"({free_bytes / GIB:.1f} GiB free less {headroom_bytes / GIB:.0f} GiB of headroom); one conversation of "
            f"--max-model-len {config.max_model_len} rows needs {seq_blocks * per_block / GIB:.2f} GiB: lower "
            "--max-model-len or --max-running, store K/V in half the bytes (--kv-dtype fp8), or give --kv-cache-gib")
    return blocks * per_block


# Rows of KV per running sequence below which the pool, not the GPU's speed, limits how many sessions run: a spoken
# turn and its answer take ~80-130 rows (~2-4 s of speech, a 4 s answer), so this is about two exchanges each.
THIN_ROWS_PER_SEQUENCE = 256


def thin_pool_warning(kv_cache_bytes: int, config: EngineConfig, model: ModelConfig) -> str | None:
    """A warning when the pool holds fewer than THIN_ROWS_PER_SEQUENCE rows per running sequence, else None: once
    the sequences together hold more, requests are refused (server_busy), however fast the GPU is."""
    rows = kv_cache_bytes // model.kv_bytes_per_row(config.kv_torch_dtype)
    per_seq = rows // config.max_running
    if per_seq >= THIN_ROWS_PER_SEQUENCE:
        return None
    return (f"the KV pool ({kv_cache_bytes / GIB:.1f} GiB) holds {rows} rows, {per_seq} per running sequence at "
            f"--max-running {config.max_running}: conversations are refused (server_busy) once together they hold "
            f"more. Lower --max-running, store K/V in half the bytes (--kv-dtype fp8), or free GPU memory "
            f"(--fp8-weights keeps a second copy of the weights; --fp8-only with it keeps only that copy)")
