"""What /metrics says of turn ends: the silence heard when each turn ended, and of the end-of-turn model, every
question's outcome and how long answered ones took."""

from __future__ import annotations

import re

import numpy as np

from server.ops.metrics import Metrics
from server.vad_streams import VadStreams
from tests.fakes.harness import tiny_settings


def questions(metrics: Metrics) -> dict[str, float]:
    text = metrics.render().decode()
    return {k: float(v) for k, v in re.findall(r'^moss_end_of_turn_questions_total\{outcome="(\w+)"\} (\S+)$', text,
                                               re.M)}


def count(metrics: Metrics, histogram: str) -> float:
    (n,) = re.findall(rf"^{histogram}_count (\S+)$", metrics.render().decode(), re.M)
    return float(n)


def test_turn_ends_are_counted_by_the_silence_heard():
    metrics = Metrics()
    metrics.turn_end(0.32)
    metrics.turn_end(1.1)
    text = metrics.render().decode()
    assert count(metrics, "moss_turn_end_silence_seconds") == 2.0
    assert re.search(r'^moss_turn_end_silence_seconds_bucket\{le="0\.35"\} 1\.0$', text, re.M)


def test_answered_questions_time_their_wait_and_every_run_question_its_call():
    metrics = Metrics()
    metrics.end_of_turn_question("answered", 0.05, 0.04)
    metrics.end_of_turn_question("withdrawn", None, None)
    metrics.end_of_turn_question("stale", 0.3, 0.2)
    assert questions(metrics) == {"answered": 1.0, "withdrawn": 1.0, "stale": 1.0}
    assert count(metrics, "moss_end_of_turn_wait_seconds") == 1.0
    assert count(metrics, "moss_end_of_turn_call_seconds") == 2.0


async def test_the_apps_end_of_turn_model_reports_into_its_metrics():
    metrics = Metrics()
    streams = VadStreams(tiny_settings(), metrics)
    end_of_turn = streams.batcher().end_of_turn  # the shipped Smart Turn, as the app builds it
    p = await end_of_turn.complete(np.zeros(16000, np.float32))
    assert 0.0 <= p <= 1.0
    assert questions(metrics) == {"answered": 1.0}
    assert count(metrics, "moss_end_of_turn_wait_seconds") == 1.0
    assert count(metrics, "moss_end_of_turn_call_seconds") == 1.0


def test_the_speech_decoders_cache_is_reported_free_and_used():
    metrics = Metrics()
    metrics.engine_stats({"kv_free": 10, "kv_total": 20, "decoder_pages_free": 700, "decoder_pages_total": 936,
                          "decoder_pages_forgotten": 12})
    text = metrics.render().decode()
    assert re.search(r"^moss_decoder_pages_free 700\.0$", text, re.M)
    assert re.search(r"^moss_decoder_pages_used 236\.0$", text, re.M)
    assert re.search(r"^moss_decoder_pages_forgotten 12\.0$", text, re.M)
