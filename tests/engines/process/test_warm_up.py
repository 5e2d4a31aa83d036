"""The start-up turns (warm_up.py): they leave nothing behind, and a failed one is raised."""

from __future__ import annotations

import pytest

from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.process.warm_up import warm_up
from engines.protocol import messages as m
from engines.speech_in import SpeechEncoder
from engines.speech_out.decoder import CodecDecoder
from tests.engines.process.tiny_engine import N_OUT, engine, question_pcm


@pytest.fixture(scope="module")
def codec() -> tuple[SpeechEncoder, CodecDecoder]:
    return SpeechEncoder.load("tiny-random"), CodecDecoder.load("tiny-random")


def _spoken_turn(svc: Service) -> list:
    greedy = m.Sampling(greedy=True, max_new_tokens=N_OUT, min_new_tokens=N_OUT)
    out = svc.handle(b"c", m.OpenSession("s", sampling=greedy))
    out += svc.handle_many([(b"c", m.AppendUserAudio("s", question_pcm(0.8)))])
    out += svc.handle(b"c", m.CommitUserAudio("s", "item"))
    out += svc.handle(b"c", m.CreateResponse("s", "r", "audio", greedy))
    while svc.has_work():
        out += svc.step()
    return [(type(x).__name__, getattr(x, "pcm24k", None), getattr(x, "text", None)) for _, x in out]


@pytest.mark.parametrize("encoder_thread", [False, True])
def test_warm_up_leaves_nothing_behind(codec, encoder_thread) -> None:
    enc, dec = codec
    svc = Service(engine(), StandInTokenizer(), enc, dec, encode_every_s=0.08, encoder_thread=encoder_thread)
    asked = []
    create = svc._on_CreateResponse
    svc._on_CreateResponse = lambda client, msg: asked.append(msg.modality) or create(client, msg)
    warm_up(svc, batches=(1, 3), rows=10)
    del svc._on_CreateResponse
    assert asked == ["audio"] * 3 + ["text"]  # the text channel's sampling is warmed up too
    st = svc.engine.stats()
    assert svc.sessions == {} and svc._requests == {} and svc._speech._turns == {} and svc._codec_owner == {}
    assert st.running == st.waiting == 0 and st.free_blocks == st.total_blocks and st.steps > 0
    assert enc.runner.kv.in_use == 0  # every encoder stream closed, its slot back
    svc.engine.check_integrity()
    assert not svc.has_work()
    # A user's turn afterwards is exactly what it is on a service that never warmed up.
    fresh = Service(engine(), StandInTokenizer(), enc, dec, encode_every_s=0.08,
                    encoder_thread=encoder_thread)
    assert _spoken_turn(svc) == _spoken_turn(fresh)


def test_warm_up_failure_is_raised(codec) -> None:
    enc, dec = codec
    svc = Service(engine(), StandInTokenizer(), enc, dec)
    with pytest.raises(RuntimeError, match="warm-up with 1 sessions failed"):
        warm_up(svc, batches=(1,), rows=10_000_000)  # more rows than the model length: refused
