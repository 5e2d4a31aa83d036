"""Engine on the GPU: CUDA-graph replay == eager, and greedy tokens follow the CPU dense reference (tiny model)."""

from __future__ import annotations

import random

import pytest
import torch

from engines.api import SamplingParams
from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.lm.loader.checkpoint import load_model
from engines.tokens import AUDIO_PAD, IM_END, IM_START, MODALITY_PAD, SOSP, audio_span_rows, text_rows
from tests.engines.lm.overlap_runs import ending_beside_ramping, requests
from tests.engines.lm.overlap_runs import make_engine as overlap_engine
from tests.engines.lm.overlap_runs import run as run_overlap
from tests.reference.dense_generate import FP8_KV_MARGIN, FP32_MARGIN, check_follows_greedy
from tests.reference.dense_model import dense_from_checkpoint

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")


def prompt(rng: random.Random, audio_out: bool) -> list[tuple[int, int]]:
    rows = text_rows([IM_START] + [rng.randrange(200, 150000) for _ in range(rng.randint(2, 30))] + [IM_END])
    rows += audio_span_rows([rng.randrange(16384) for _ in range(rng.randint(3, 40))])
    rows += text_rows([IM_START, 77])
    return rows + ([(SOSP, AUDIO_PAD)] if audio_out else [])


def _min_new(i: int, min_new: int) -> int:
    """Every second prompt must generate `min_new` rows; the others may stop early."""
    return min_new if i % 2 else 0


def run(engine: Engine, prompts: dict, steps: int, min_new: int = 0) -> dict:
    out = {rid: [] for rid in prompts}
    for i, (rid, rows) in enumerate(prompts.items()):
        engine.add_request(rid, rows, SamplingParams.greedy_params(steps, min_new_tokens=_min_new(i, min_new)))
    while engine.has_work():
        for o in engine.step():
            out[o.request_id].append((o.text_token, o.audio_token, o.mode))
        engine.check_integrity()
    return out


def assert_follow_dense(dense, prompts: dict, got: dict, steps: int, min_new: int = 0,
                        margin: float = FP32_MARGIN) -> None:
    """The engine's rows are the dense reference's greedy rows for the prompts, asked for as `run` asks the engine
    (near-ties within `margin` either way: the GPU's kernels sum in another order than the CPU's)."""
    for i, (rid, rows) in enumerate(prompts.items()):
        verdict = check_follows_greedy(dense, rows, got[rid], steps, min_new_tokens=_min_new(i, min_new), margin=margin)
        assert verdict.follows, f"{rid}: {verdict.wrong}"


def make(ckpt, dtype: str, graphs: bool, fp8_weights: str = "", kv_dtype: str = "auto") -> Engine:
    """fp8_weights: "beside" (copies beside the rounded bf16 weights) or "only" (copies alone), or none."""
    model = load_model(ckpt, device="cuda", dtype=dtype)
    if fp8_weights:
        from engines.lm.model import fp8_copies

        fp8_copies.apply(model, keep_weights=fp8_weights == "beside")
    mc = model.config
    cfg = EngineConfig(device="cuda", dtype=dtype, block_size=16, kv_cache_bytes=mc.kv_bytes_per_row() * 8192,
                       max_running=8, prefill_token_budget=64, cuda_graphs=graphs, kv_dtype=kv_dtype)
    return Engine(model, mc, cfg)


@pytest.mark.parametrize("fp8_weights", ["", "beside", "only"])
def test_graph_replay_equals_eager(tiny_checkpoint, fp8_weights):
    rng = random.Random(1)
    prompts = {f"r{i}": prompt(rng, i % 2 == 1) for i in range(7)}
    eager = run(make(tiny_checkpoint, "bfloat16", graphs=False, fp8_weights=fp8_weights), prompts, 48, min_new=48)
    graphed_engine = make(tiny_checkpoint, "bfloat16", graphs=True, fp8_weights=fp8_weights)
    assert graphed_engine.runner.graphs is not None
    assert run(graphed_engine, prompts, 48, min_new=48) == eager


def test_tails_side_by_side_equal_one_after_the_other(tiny_checkpoint):
    """The text tail on its own stream beside the audio tail (the CUDA default) gives the tokens of the tails run
    one after the other, eager and in the decode graphs."""
    rng = random.Random(3)
    prompts = {f"r{i}": prompt(rng, i % 2 == 1) for i in range(5)}
    sequential = make(tiny_checkpoint, "bfloat16", graphs=False)
    sequential.runner.model.tail_stream = None
    want = run(sequential, prompts, 32, min_new=32)
    for graphs in (False, True):
        engine = make(tiny_checkpoint, "bfloat16", graphs=graphs)
        assert engine.runner.model.tail_stream is not None
        assert run(engine, prompts, 32, min_new=32) == want, graphs


def test_gpu_greedy_tokens_equal_cpu_dense_reference(tiny_checkpoint):
    rng = random.Random(2)
    prompts = {f"r{i}": prompt(rng, i % 2 == 1) for i in range(4)}
    got = run(make(tiny_checkpoint, "float32", graphs=True), prompts, 40, min_new=40)
    assert_follow_dense(dense_from_checkpoint(tiny_checkpoint), prompts, got, 40, min_new=40)


def test_fp8_kv_cache_graphs_equal_eager_and_float32_equals_the_rounded_dense_reference(tiny_checkpoint):
    """An fp8 KV cache on the GPU: CUDA-graph replay == eager (bf16), and float32 greedy tokens == the CPU dense
    reference whose attention reads K/V rounded to e4m3."""
    rng = random.Random(4)
    prompts = {f"r{i}": prompt(rng, i % 2 == 1) for i in range(6)}
    eager = run(make(tiny_checkpoint, "bfloat16", graphs=False, kv_dtype="fp8"), prompts, 40, min_new=40)
    graphed = make(tiny_checkpoint, "bfloat16", graphs=True, kv_dtype="fp8")
    assert graphed.runner.graphs is not None and graphed.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert run(graphed, prompts, 40, min_new=40) == eager
    got = run(make(tiny_checkpoint, "float32", graphs=True, kv_dtype="fp8"), prompts, 40, min_new=40)
    assert_follow_dense(dense_from_checkpoint(tiny_checkpoint, kv_fp8=True), prompts, got, 40, min_new=40,
                        margin=FP8_KV_MARGIN)


def test_overlapped_graph_decode_emits_the_same_rows(tiny_checkpoint):
    """The next audio step launched before this one's tokens are read (graphs on) == one step at a time."""
    reqs = requests(3)
    ref = run_overlap(overlap_engine(tiny_checkpoint, overlap=False, device="cuda", cuda_graphs=False), reqs)
    eng = overlap_engine(tiny_checkpoint, overlap=True, device="cuda")
    assert eng.runner.graphs is not None
    assert run_overlap(eng, reqs) == ref
    assert eng.stats().overlapped_steps > 0


def test_an_answer_ending_beside_a_ramping_one_in_graphs(tiny_checkpoint):
    """The step launched ahead past an answer that ends in flight takes the other rows' codes by a gather on the
    device (ModelRunner.gather), here into the decode graphs: the rows equal one step at a time, no launch gap."""
    ending_beside_ramping(tiny_checkpoint, "cuda")


def test_one_row_prefill_chunks_beside_decodes_in_a_graph(tiny_checkpoint):
    """A request whose input arrives one row per step (a user still speaking) runs 1-row prefill chunks that
    need no sample, in the same decode-shaped step as others' decode rows: the graph path must sample only
    the rows that need it, and emit what eager does."""
    outs = []
    for graphs in (False, True):
        rng = random.Random(4)
        eng = make(tiny_checkpoint, "float32", graphs=graphs)
        eng.add_request("talker", prompt(rng, True), SamplingParams.greedy_params(30, 30))
        eng.add_request("listener", prompt(rng, False)[:5], SamplingParams.greedy_params(30), input_done=False)
        got = []
        for i in range(60):
            if i < 20 and eng.live_request("listener") is not None:
                eng.append_input("listener", [(MODALITY_PAD, 100 + i)], input_done=i == 19)
            got += [(o.request_id, o.text_token, o.audio_token) for o in eng.step()]
            eng.check_integrity()
        outs.append(got)
    assert outs[0] == outs[1] and len(outs[0]) > 30
