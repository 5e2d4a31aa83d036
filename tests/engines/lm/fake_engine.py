"""An Engine on the FakeModel with small blocks, prompts of stand-in rows, and a loop that steps it to the end."""

from __future__ import annotations

from engines.config import PRESETS, EngineConfig
from engines.lm.engine import Engine
from engines.tokens import AUDIO_PAD
from tests.fake_model import FakeModel

MC = PRESETS["tiny-random"]


def make_engine(block_size=4, blocks=64, **kw) -> tuple[Engine, FakeModel]:
    per_block = MC.kv_bytes_per_row() * block_size
    cfg = EngineConfig(block_size=block_size, kv_cache_bytes=per_block * blocks, **kw)
    model = FakeModel(MC)
    return Engine(model, MC, cfg), model


def prompt(n: int, base: int = 1000) -> list[tuple[int, int]]:
    return [(base + i, AUDIO_PAD) for i in range(n)]


def run_to_end(engine: Engine, max_steps: int = 10_000) -> dict[str, list]:
    out: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            break
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
        engine.check_integrity()
    return out
