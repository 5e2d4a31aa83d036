"""KV exhaustion on the GPU (full-size random weights, a 3 GiB pool): idle sessions' long histories and 32 spoken
answers of 20 s fill the pool; while the answers play, every new turn that cannot get its blocks is refused with
server_busy, nothing waits forever, the playing answers keep real time through the flood (a listener's playback, from
the first chunk on, never stalls), every answer plays to its end, and every block comes back. Prints one JSON line
with the figures (`-s`), the answers' start (begun 50 ms apart, before the flood) among them.

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
# 20 s of speech each: 640 s of answer audio in progress, more than the speech decoder's own cache holds here (21 GiB
# of fp8 pages: 393 s, and every answer's last 28 chunks; the served 40 GiB of bf16 pages leave an 80 GB card no room
# for the pool), so the answers also forget their oldest chunks as they go (engines/speech_out/flow/full_context.py)
# and must still play to their end.
ANSWER_ROWS = 250
# The answers begin one every 50 ms (20 a second, as sessions arrive), and the flood once each has played its start:
# how answers begun together keep time is a burst of its own (docs/performance.md, KV exhaustion), not the pool's.
LIVE_STAGGER_S = 0.05
HISTORY_CHARS = 6000  # one idle session's history (the stand-in tokenizer: about a row a character)
RATE = 24_000  # answer audio samples per second


def _send(svc, msg) -> list:
    return [x for _, x in svc.handle(b"c", msg)]


def test_histories_filling_the_pool_refuse_new_work_while_answers_keep_real_time() -> None:
    # Warmed up as served: a first-use compile in the middle of the answers would be the test's own stall.
    svc = build_service(ProcessConfig.parse(["--device", "cuda", "--model", "full-random", "--codec", "full-random",
                                             "--kv-cache-gib", "3", "--max-model-len", "8192",
                                             "--decoder-cache-dtype", "fp8", "--decoder-cache-gib", "21"]))
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
    start: dict[str, float] = {}  # response id -> when it was asked for
    ttfa: dict[str, float] = {}  # response id -> the time to its first chunk
    plays_to: dict[str, float] = {}  # response id -> when the listener's playback of what came so far ends
    chunks: dict[str, int] = {}  # response id -> chunks come
    # The longest silence a listener heard (a chunk after the audio before it had played out: playback starts at the
    # first chunk and resumes where it stalled), before the flood (the answers' start) and during it, and where.
    stalls = {"start": (0.0, {}), "flood": (0.0, {})}
    asked, steps, begun = 0, 0, 0
    msgs: list = []
    slowest = (0.0, 0)  # the longest step (s) and which
    t_begin = last = time.monotonic()
    while svc.has_work() or begun < LIVE:
        while begun < LIVE and time.monotonic() >= t_begin + begun * LIVE_STAGGER_S:
            _send(svc, m.AddUserText(f"live{begun}", "i", "hello"))
            out = _send(svc, m.CreateResponse(f"live{begun}", f"a{begun}", "audio", spoken))
            assert [type(x) for x in out] == [m.ResponseStarted], out
            start[f"a{begun}"] = time.monotonic()
            begun += 1
        # Once every answer plays (past its start: 3 chunks come), a new turn every 5 steps, each with a long history
        # of its own: none may find room.
        flood = begun == LIVE and len(chunks) == LIVE and min(chunks.values()) >= 3
        if flood and steps % 5 == 0:
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
                rid, phase = x.response_id, "flood" if asked else "start"
                stall = now - plays_to.get(rid, now)
                if stall > stalls[phase][0]:
                    stalls[phase] = (stall, {"chunk": x.index, "step": steps, "new_turns_by_then": asked,
                                             "step_ms": round(dt * 1000, 1)})
                plays_to[rid] = max(plays_to.get(rid, now), now) + len(x.pcm24k) // 2 / RATE
                chunks[rid] = chunks.get(rid, 0) + 1
                ttfa.setdefault(rid, now - start[rid])
        msgs += out
        assert steps < 100_000, "the engine never went idle"
    errors = [x for x in msgs if isinstance(x, m.Error)]
    refused = sum(1 for e in errors if e.code == "server_busy")
    assert errors and {e.code for e in errors} == {"server_busy"}
    done = {x.response_id: x for x in msgs if isinstance(x, m.ResponseDone)}
    assert all(done[a].status == "incomplete" for a in start), [done[a].status for a in start]
    for sid in list(svc.sessions):
        _send(svc, m.CloseSession(sid))
    service_loop.until_idle(svc)
    eng.check_integrity()
    free = eng.stats().free_blocks
    forgotten = svc.stats().get("decoder_pages_forgotten")
    print(json.dumps({"kv_blocks": total, "decoder_pages_forgotten": forgotten, "idle_histories": h,
                      "live_answers": LIVE, "new_turns": asked, "refused_server_busy": refused, "steps": steps,
                      "first_chunk_max_ms": round(max(ttfa.values()) * 1000, 1), "free_blocks_after": free,
                      **{f"{k}_stall_max_ms": round(v[0] * 1000, 1) for k, v in stalls.items()},
                      **{f"{k}_stall_at": v[1] for k, v in stalls.items()},
                      "slowest_step_ms": round(slowest[0] * 1000, 1), "slowest_step": slowest[1]}))
    assert free == total
    assert all(done[a].audio_samples == ANSWER_ROWS * RATE // 12.5 for a in start)  # every answer to its end
    assert asked > 0 and stalls["flood"][0] <= 0.0, (
        f"a playing answer's chunk came {stalls['flood'][0] * 1000:.0f} ms after its audio ran out")
