"""KV exhaustion on the GPU (full-size random weights, a 3 GiB pool): idle sessions' long histories fill the pool
while spoken answers play; every new turn that cannot get its blocks is refused with server_busy, nothing waits
forever, the playing answers keep real time (each chunk arrives before the audio posted before it has played out,
playback starting at the first chunk), and every block comes back. Prints one JSON line with the figures (`-s`).

Real time, not a rate: the codec decodes a playing answer only ~1.6 s ahead of its playback, so an answer's rows
per second stay near 12.5 however fast the engine runs; a late chunk is what a listener hears."""

from __future__ import annotations

import json
import time

import pytest
import torch

from engines.process.config import ProcessConfig
from engines.process.loading import build_service
from engines.protocol import messages as m
from tests.engines.process import service_loop

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: tests/gpu runs on the GPU box")

LIVE = 32  # spoken answers playing through the flood
# 10 s of speech each: the 32 fit the speech decoder's own cache as served (40 GiB: 374 s of answer audio in progress;
# 32 answers of 20 s outgrow it and are stopped with server_busy, its documented bound). This test fills the language
# model's KV pool, not that cache.
ANSWER_ROWS = 125
HISTORY_CHARS = 6000  # one idle session's history (the stand-in tokenizer: about a row a character)
RATE = 24_000  # answer audio samples per second


def _send(svc, msg) -> list:
    return [x for _, x in svc.handle(b"c", msg)]


def test_histories_filling_the_pool_refuse_new_work_while_answers_keep_real_time() -> None:
    # Warmed up as served: a first-use compile in the middle of the answers would be the test's own stall.
    svc = build_service(ProcessConfig.parse(["--device", "cuda", "--model", "full-random", "--codec", "full-random",
                                             "--kv-cache-gib", "3", "--max-model-len", "8192"]))
    eng = svc.engine
    total = eng.stats().total_blocks
    text = m.Sampling(greedy=True, max_new_tokens=4, min_new_tokens=4)
    for i in range(LIVE):
        _send(svc, m.OpenSession(f"live{i}", instructions="x"))
    # Idle histories while one more leaves the live answers their reservations: then no new turn's history fits.
    live_need = LIVE * -(-(ANSWER_ROWS + 40) // eng.config.block_size)
    h, per_history = 0, 0
    while eng.stats().free_blocks - per_history > live_need + 8:
        free = eng.stats().free_blocks
        sid = f"hist{h}"
        _send(svc, m.OpenSession(sid, instructions="x"))
        _send(svc, m.AddUserText(sid, "i", "a" * HISTORY_CHARS))
        _send(svc, m.CreateResponse(sid, "r", "text", text))
        service_loop.until_idle(svc)
        per_history = max(per_history, free - eng.stats().free_blocks)
        h += 1
    spoken = m.Sampling(max_new_tokens=ANSWER_ROWS, min_new_tokens=ANSWER_ROWS)
    start: dict[str, float] = {}
    first: dict[str, float] = {}  # response id -> when its first chunk came (its playback's start)
    posted: dict[str, int] = {}  # response id -> samples posted so far
    late_s = 0.0  # the most any chunk came after the audio before it had played out
    worst: dict = {}  # where that chunk was: its answer's chunk index, the step, the new turns asked by then
    for i in range(LIVE):
        _send(svc, m.AddUserText(f"live{i}", "i", "hello"))
        out = _send(svc, m.CreateResponse(f"live{i}", f"a{i}", "audio", spoken))
        assert [type(x) for x in out] == [m.ResponseStarted], out
        start[f"a{i}"] = time.monotonic()
    asked, steps = 0, 0
    msgs: list = []
    slowest = (0.0, 0)  # the longest step (s) and which
    last = time.monotonic()
    while svc.has_work():
        if steps % 5 == 0:  # a new turn every 5 steps, each with a long history of its own
            sid = f"new{asked}"
            asked += 1
            _send(svc, m.OpenSession(sid, instructions="x"))
            _send(svc, m.AddUserText(sid, "i", "a" * HISTORY_CHARS))
            msgs += _send(svc, m.CreateResponse(sid, "r", "audio", spoken))
        out = [x for _, x in service_loop.step(svc)]
        steps += 1
        now = time.monotonic()
        dt, last = now - last, now
        slowest = max(slowest, (dt, steps))
        for x in out:
            if isinstance(x, m.AudioChunk) and x.response_id in start:
                t0 = first.setdefault(x.response_id, now)
                late = (now - t0) - posted.get(x.response_id, 0) / RATE
                if late > late_s:
                    late_s, worst = late, {"chunk": x.index, "step": steps, "new_turns_by_then": asked,
                                           "step_ms": round(dt * 1000, 1)}
                posted[x.response_id] = posted.get(x.response_id, 0) + len(x.pcm24k) // 2
        msgs += out
        assert steps < 100_000, "the engine never went idle"
    errors = [x for x in msgs if isinstance(x, m.Error)]
    refused = sum(1 for e in errors if e.code == "server_busy")
    assert errors and {e.code for e in errors} == {"server_busy"}
    done = {x.response_id: x for x in msgs if isinstance(x, m.ResponseDone)}
    assert all(done[a].status == "incomplete" for a in start), [done[a].status for a in start]
    ttfa = sorted(first[a] - start[a] for a in start)
    for sid in list(svc.sessions):
        _send(svc, m.CloseSession(sid))
    service_loop.until_idle(svc)
    eng.check_integrity()
    free = eng.stats().free_blocks
    print(json.dumps({"kv_blocks": total, "idle_histories": h, "live_answers": LIVE, "new_turns": asked,
                      "refused_server_busy": refused, "steps": steps, "max_late_ms": round(late_s * 1000, 1),
                      "first_chunk_max_ms": round(ttfa[-1] * 1000, 1), "free_blocks_after": free,
                      "latest_chunk": worst, "slowest_step_ms": round(slowest[0] * 1000, 1),
                      "slowest_step": slowest[1]}))
    assert free == total
    assert late_s <= 0.0, f"a playing answer's chunk came {late_s * 1000:.0f} ms after its audio ran out"
