"""Per-session inputs as a hostile client sends them: instructions and text items too long, a history restored with
thousands of items, an answer asked for near the model's length. Each is refused with `input_too_large` before its
work is done, changes nothing, and the session goes on."""

from __future__ import annotations

from engines.config import EngineConfig
from engines.lm.engine import Engine
from engines.process.limits import InputLimits
from engines.process.service import Service
from engines.process.tokenizer import StandInTokenizer
from engines.protocol import messages as m
from tests.engines.process.fake_service import FakeDecoder, FakeEncoder, greedy, of, run, send

LIMITS = InputLimits(max_text_chars=200, max_output_tokens=40)
MAX_MODEL_LEN = 512


class CountingTokenizer(StandInTokenizer):
    def __init__(self) -> None:
        super().__init__()
        self.chars = 0

    def encode(self, text: str) -> list[int]:
        self.chars += len(text)
        return super().encode(text)


def service() -> Service:
    ec = EngineConfig(kv_cache_bytes=8 * 1024 * 1024, max_model_len=MAX_MODEL_LEN)
    return Service(Engine.from_name("tiny-random", ec, seed=0), CountingTokenizer(), FakeEncoder(), FakeDecoder(),
                   limits=LIMITS)


def codes(out: list) -> list[str]:
    return [x.code for x in of(out, m.Error)]


def answered(svc: Service, sid: str, rid: str) -> None:
    send(svc, m.CreateResponse(sid, rid, "text", greedy(4)))
    assert [d.status for d in of(run(svc), m.ResponseDone)] == ["incomplete"]


def test_long_instructions_and_texts_are_refused_before_they_are_tokenized() -> None:
    svc = service()
    long = "x" * (LIMITS.max_text_chars + 1)
    chars = svc.tokenizer.chars
    assert codes(send(svc, m.OpenSession("a", instructions=long))) == ["input_too_large"] and "a" not in svc.sessions
    send(svc, m.OpenSession("s", instructions="Be brief."))
    out = send(svc, m.UpdateSession("s", instructions=long, sampling=greedy(5)))
    assert codes(out) == ["input_too_large"] and "--max-text-chars" in of(out, m.Error)[0].message
    assert svc.sessions["s"].instructions == "Be brief." and svc.sessions["s"].sampling is None
    for role in ("user", "system", "assistant"):
        assert codes(send(svc, m.AddUserText("s", "i", long, role))) == ["input_too_large"]
    assert svc.sessions["s"].pending_rows == [] and svc.tokenizer.chars == chars
    send(svc, m.AddUserText("s", "i", "x" * LIMITS.max_text_chars))
    answered(svc, "s", "r")


def test_a_history_flood_is_bounded_by_the_models_context() -> None:
    """Thousands of conversation.item.create before any answer: the items waiting for it may hold at most the model's
    context; past it each is refused, the session keeps what it has and answers once those are sent."""
    svc = service()
    send(svc, m.OpenSession("s"))
    out = []
    for i in range(2000):
        out += send(svc, m.AddUserText("s", f"i{i}", f"item {i}", "user" if i % 2 else "assistant"))
    s = svc.sessions["s"]
    refused = codes(out)
    assert refused and set(refused) == {"input_too_large"} and len(refused) < 2000
    assert MAX_MODEL_LEN - 20 < len(s.pending_rows) <= MAX_MODEL_LEN
    # With the system prompt, the answer's prefix and its output budget they exceed the context. With truncation off
    # that answer fails with a typed error, no KV is taken, and the session goes on.
    send(svc, m.SetTruncation("s", None))
    msgs = send(svc, m.CreateResponse("s", "r1", "text", greedy(4))) + run(svc)
    assert codes(msgs) == ["request_too_large"] and [d.status for d in of(msgs, m.ResponseDone)] == ["failed"]
    st = svc.engine.stats()
    assert st.running == st.waiting == 0 and st.free_blocks == st.total_blocks
    assert codes(send(svc, m.AddUserText("s", "x", "one more"))) == ["input_too_large"]
    # With the default truncation the oldest items are dropped (reported) and the answer goes ahead.
    send(svc, m.SetTruncation("s", m.AUTO_RETENTION))
    msgs = send(svc, m.CreateResponse("s", "r2", "text", greedy(4))) + run(svc)
    dropped = of(msgs, m.ItemsDropped)
    assert codes(msgs) == [] and [d.status for d in of(msgs, m.ResponseDone)] == ["incomplete"]
    assert len(dropped) == 1 and not dropped[0].deleted and dropped[0].item_ids[:2] == ["i0", "i1"]
    assert len(s.pending_rows) == 0 and svc.engine.conversation_rows("s") <= MAX_MODEL_LEN


def test_max_output_tokens_over_the_bound_is_refused_without_reserving_kv() -> None:
    svc = service()
    send(svc, m.OpenSession("s"))
    send(svc, m.AddUserText("s", "i", "hello"))
    out = send(svc, m.CreateResponse("s", "r", "audio", greedy(LIMITS.max_output_tokens + 1)))
    assert [(type(x).__name__, getattr(x, "code", None) or x.status, x.response_id) for x in out] == [
        ("Error", "input_too_large", "r"), ("ResponseDone", "failed", "r")]
    assert "--max-output-tokens" in out[0].message
    st = svc.engine.stats()
    assert st.running == st.waiting == 0 and st.free_blocks == st.total_blocks
    out = send(svc, m.OpenSession("t", sampling=greedy(LIMITS.max_output_tokens + 1)))
    assert codes(out) == ["input_too_large"] and "t" not in svc.sessions
    answered(svc, "s", "r2")
