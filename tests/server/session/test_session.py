"""The transport-agnostic Session in-process: Silero VAD turns, barge-in, track audio, slow consumers.

An in-memory engine link records what the session sends; engine replies are injected with
`on_engine_message`, so the order of engine inputs can be asserted exactly.
"""

from __future__ import annotations

import asyncio
import base64
from types import SimpleNamespace

import numpy as np
import pytest

from engines.protocol import messages as m
from server.session import engine_link, pacing
from server.session.pacing import AudioOut
from server.session.session import Session
from tests.server.session.session_support import (
    CHUNK,
    Link,
    drain,
    feed,
    new_session,
    settled,
    silence,
    types,
)


async def test_server_vad_turn_streams_only_speech_and_commits(speech24k):
    s, link = await new_session()
    lead = silence(1.0)
    await feed(s, np.concatenate([lead, speech24k, silence(1.0)]))
    evs = drain(s)
    t = types(evs)
    assert t[:2] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"], t
    assert t[2:4] == ["input_audio_buffer.committed", "conversation.item.added"]
    assert "response.created" in t
    started, stopped = evs[0], evs[1]
    assert started["item_id"] == stopped["item_id"] == evs[2]["item_id"]
    # Positions are in input audio time and mark the audio sent for the turn: from the prefix padding
    # (300 ms) before the detected speech, after the 1 s lead, to the end of the trailing silence (500 ms);
    # exactly the audio streamed to the engine.
    speech_ms = len(speech24k) * 1000 // 24000
    assert 1000 - 300 - 64 <= started["audio_start_ms"] <= 1000 + 300
    assert started["audio_start_ms"] + 500 < stopped["audio_end_ms"] <= 1000 + speech_ms + 500 + 64
    sent_ms = sum(len(x.pcm16k) // 2 for x in link.of(m.AppendUserAudio)) * 1000 // 16000
    assert abs((stopped["audio_end_ms"] - started["audio_start_ms"]) - sent_ms) <= 32
    # Engine inputs: audio only from the speech (with ~300 ms prefix), then commit, then the response.
    kinds = [type(x).__name__ for x in link.sent]
    assert kinds[0] == "OpenSession" and kinds[-2:] == ["CommitUserAudio", "CreateResponse"]
    assert set(kinds[1:-2]) == {"AppendUserAudio"}
    sent16k = sum(len(x.pcm16k) // 2 for x in link.of(m.AppendUserAudio))
    fed16k = (2.0 * 24000 + len(speech24k)) * 16000 // 24000
    assert sent16k < fed16k - 0.5 * 16000  # the leading silence was not streamed
    assert link.of(m.CommitUserAudio)[0].item_id == evs[2]["item_id"]


async def test_user_audio_reaches_the_engine_in_pieces_of_96_ms_and_the_same_bytes(speech24k, monkeypatch):
    """A speaking user's audio goes to the engine in messages of at least APPEND_MIN_SAMPLES (one per VAD window
    before), the rest ahead of the commit: the same bytes in the same order as one message per window."""
    async def run() -> list:
        s, link = await new_session()
        await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
        return link.sent

    coalesced = await run()
    monkeypatch.setattr(engine_link, "APPEND_MIN_SAMPLES", 1)
    per_window = await run()
    sizes = [len(x.pcm16k) // 2 for x in coalesced if isinstance(x, m.AppendUserAudio)]
    kinds = [type(x).__name__ for x in coalesced]
    assert kinds[-2:] == ["CommitUserAudio", "CreateResponse"] and set(kinds[1:-2]) == {"AppendUserAudio"}
    assert all(n >= engine_link.APPEND_MIN_SAMPLES for n in sizes[:-1]) and sizes[-1] > 0, sizes
    n_windows = sum(isinstance(x, m.AppendUserAudio) for x in per_window)
    assert len(sizes) <= n_windows // 3 + 2, (len(sizes), n_windows)

    def audio(sent: list) -> bytes:
        return b"".join(x.pcm16k for x in sent if isinstance(x, m.AppendUserAudio))
    assert audio(coalesced) == audio(per_window)


async def test_clear_drops_unsent_audio_and_other_inputs_follow_the_audio(speech24k):
    """Without VAD: audio below the message size waits in the server; clear drops it (none reaches the engine);
    a commit or an item sends it first, so the engine sees the inputs in the client's order."""
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    pcm16 = (speech24k[:960] * 32767).astype("<i2").tobytes()  # 40 ms: below the message size
    append = {"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()}
    await s.handle_client_event(append)
    assert not link.of(m.AppendUserAudio)
    await s.handle_client_event({"type": "input_audio_buffer.clear"})
    assert not link.of(m.AppendUserAudio)
    await s.handle_client_event(append)
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    await s.handle_client_event({"type": "input_audio_buffer.commit"})
    kinds = [type(x).__name__ for x in link.sent]
    # (the commit sends the resampler's last few samples too: the filter's tail belongs to the turn)
    assert kinds == ["OpenSession", "AppendUserAudio", "AddUserText", "AppendUserAudio", "CommitUserAudio"], kinds
    first, tail = (len(x.pcm16k) // 2 for x in link.of(m.AppendUserAudio))
    assert first > 0 and first + tail == 640, (first, tail)


async def test_response_create_while_the_user_speaks_is_refused(speech24k):
    """server_vad mid-speech: the engine holds the open turn's audio, so a response.create is the client's
    mistake (the engine would fail it); the turn is still answered when the speech stops."""
    s, link = await new_session()
    await feed(s, np.concatenate([silence(0.5), speech24k[:len(speech24k) // 2]]))
    assert types(drain(s)) == ["input_audio_buffer.speech_started"]
    await s.handle_client_event({"type": "response.create", "event_id": "r1"})
    err = drain(s)[-1]
    assert err["type"] == "error" and err["error"]["code"] == "input_audio_buffer_not_empty", err
    assert not link.of(m.CreateResponse)
    await feed(s, np.concatenate([speech24k[len(speech24k) // 2:], silence(1.0)]))
    t = types(drain(s))
    assert "input_audio_buffer.speech_stopped" in t and "response.created" in t, t
    assert len(link.of(m.CreateResponse)) == 1


async def test_push_to_talk_answer_clears_uncommitted_track_audio_but_refuses_appended(speech24k):
    """Push to talk over a track: the live mic keeps feeding, so frames in flight land between a client's clear
    and its response.create (the browser test met this). The answer clears that track audio first and goes ahead;
    audio the client appended itself is still refused."""
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    await feed(s, speech24k[:4800])  # 200 ms of live mic after the client's clear (some sent to the engine)
    drain(s)
    await s.handle_client_event({"type": "response.create", "event_id": "r1"})
    t = types(drain(s))
    assert t[:2] == ["input_audio_buffer.cleared", "response.created"], t
    kinds = [type(x).__name__ for x in link.sent]
    assert kinds[-2:] == ["ClearUserAudio", "CreateResponse"], kinds
    s.on_engine_message(m.ResponseDone(s.id, link.of(m.CreateResponse)[0].response_id, "completed"))
    await settled(s)
    drain(s)

    # One append event among the track's frames makes the buffer the client's: refused, nothing cleared.
    await feed(s, speech24k[:2400])
    pcm16 = (speech24k[:480] * 32767).astype("<i2").tobytes()
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()})
    cleared = len(link.of(m.ClearUserAudio))
    await s.handle_client_event({"type": "response.create", "event_id": "r2"})
    err = drain(s)[-1]
    assert err["type"] == "error" and err["error"]["code"] == "input_audio_buffer_not_empty", err
    assert len(link.of(m.ClearUserAudio)) == cleared and len(link.of(m.CreateResponse)) == 1
    # After a commit the mic's next frames are the track's alone again.
    await s.handle_client_event({"type": "input_audio_buffer.commit"})
    await feed(s, speech24k[:960])
    drain(s)
    await s.handle_client_event({"type": "response.create", "event_id": "r3"})
    assert types(drain(s))[:2] == ["input_audio_buffer.cleared", "response.created"]
    s.on_engine_message(m.ResponseDone(s.id, link.of(m.CreateResponse)[-1].response_id, "completed"))
    await settled(s)
    drain(s)

    # An audio item follows the same rule: track audio cleared, appended audio refused.
    item = {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": base64.b64encode(pcm16).decode()}]}}
    await feed(s, speech24k[:4800])
    cleared = len(link.of(m.ClearUserAudio))
    bad = {"type": "conversation.item.create", "item": {"type": "message", "role": "user", "content": [
        {"type": "input_audio", "audio": ""}]}}
    await s.handle_client_event(bad)  # refused before anything is cleared
    assert drain(s)[-1]["error"]["code"] == "invalid_audio" and len(link.of(m.ClearUserAudio)) == cleared
    await s.handle_client_event(item)
    assert types(drain(s)) == ["input_audio_buffer.cleared", "conversation.item.added", "conversation.item.done"]
    assert [type(x).__name__ for x in link.sent[-3:]] == ["ClearUserAudio", "AppendUserAudio", "CommitUserAudio"]
    await s.handle_client_event({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()})
    sent = len(link.sent)
    await s.handle_client_event(item)
    err = drain(s)[-1]
    assert err["type"] == "error" and err["error"]["code"] == "input_audio_buffer_not_empty", err
    assert "before adding an audio item" in err["error"]["message"] and len(link.sent) == sent


async def test_a_failing_background_task_ends_the_session_with_an_error(caplog):
    """Input held behind an answer is sent by a task of its own once the answer ends; if that task fails, the
    failure is logged and the session ends with a server_error (not an unretrieved task exception and a session
    waiting for input that never reaches the engine)."""
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"type": "realtime", "audio": {
        "input": {"turn_detection": None}}}})
    await s.handle_client_event({"type": "response.create"})
    rid = link.of(m.CreateResponse)[0].response_id
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]}})
    assert not link.of(m.AddUserText)  # held behind the answer
    drain(s)

    async def refuse(msg) -> None:
        raise ConnectionError(f"cannot send {type(msg).__name__}")

    link.send = refuse
    s.on_engine_message(m.ResponseDone("sess_test", rid, "completed"))
    await asyncio.wait_for(s.wait_closed(), 5)
    errors = [e for e in drain(s) if isinstance(e, dict) and e["type"] == "error"]
    assert errors and errors[-1]["error"]["code"] == "server_error", errors
    assert s.close_code == 1011
    assert "flush-held failed" in caplog.text and "ConnectionError" in caplog.text


async def test_barge_in_cancels_truncates_flushes_and_holds_new_speech(speech24k):
    s, link = await new_session()
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    drain(s)
    rid = link.of(m.CreateResponse)[0].response_id
    s.on_engine_message(m.ResponseStarted("sess_test", rid, prompt_rows=40))
    for i in range(5):
        s.on_engine_message(m.AudioChunk("sess_test", rid, CHUNK, i))
    # The transport took the events up to and including the first audio delta.
    while True:
        item = await s.outbound.get()
        if isinstance(item, dict) and item["type"] == "response.output_audio.delta":
            break
    n_before = len(link.sent)
    await feed(s, np.concatenate([silence(0.2), speech24k[: 24000]]))  # the user talks over the answer
    new = link.sent[n_before:]
    assert isinstance(new[0], m.CancelResponse) and new[0].response_id == rid
    assert isinstance(new[1], m.TruncateResponse) and new[1].response_id == rid
    assert 0 <= new[1].audio_samples_played <= 9600  # at most what was sent
    assert not any(isinstance(x, m.AppendUserAudio) for x in new)  # held until the answer has ended
    evs = drain(s)
    assert "response.output_audio.delta" not in types(evs)  # queued answer audio was dropped
    assert "input_audio_buffer.speech_started" in types(evs)
    # The client says where its listener was (a WebSocket client knows, the server only estimated): the engine's cut
    # follows it, though the answer is still ending.
    heard_ms = 200 if new[1].audio_samples_played != 4800 else 100
    await s.handle_client_event({"type": "conversation.item.truncate", "content_index": 0, "audio_end_ms": heard_ms,
                                 "item_id": link.of(m.CreateResponse)[0].item_id})
    assert link.sent[-1] == m.TruncateResponse("sess_test", rid, heard_ms * 24)
    assert [(e["type"], e.get("audio_end_ms")) for e in drain(s)] == [("conversation.item.truncated", heard_ms)]
    s.on_engine_message(m.ResponseDone("sess_test", rid, "cancelled", reason="client_cancelled", output_rows=25))
    await settled(s)  # held inputs go out on the loop
    assert any(isinstance(x, m.AppendUserAudio) for x in link.sent[n_before + 3:])
    done = [e for e in drain(s) if e["type"] == "response.done"][0]["response"]
    assert done["status"] == "cancelled" and done["status_details"]["reason"] == "turn_detected"


async def test_track_mode_audio_and_played_position(speech24k):
    s, link = await new_session(audio_out="track")
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    await s.handle_client_event({"type": "response.create"})
    rid = link.of(m.CreateResponse)[0].response_id
    s.on_engine_message(m.ResponseStarted("sess_test", rid, prompt_rows=10))
    s.on_engine_message(m.AudioChunk("sess_test", rid, CHUNK, 0))
    s.on_engine_message(m.AudioChunk("sess_test", rid, CHUNK, 1))
    items = []
    while len(s.outbound):
        items.append(await s.outbound.get())
    audio = [x for x in items if isinstance(x, AudioOut)]
    assert [a.index for a in audio] == [0, 1] and audio[0].pcm24k == CHUNK
    assert "response.output_audio.delta" not in types(items)
    s.audio_played(rid, 12000)
    item_id = audio[0].item_id
    await s.handle_client_event({"type": "conversation.item.truncate", "item_id": item_id, "content_index": 0,
                                 "audio_end_ms": 300})
    tr = link.of(m.TruncateResponse)[0]
    assert tr.audio_samples_played == 300 * 24
    assert types(drain(s))[-1] == "conversation.item.truncated"


async def test_slow_consumer_is_closed_with_error():
    s, link = await new_session(output_queue_size=8)
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    await s.handle_client_event({"type": "response.create"})
    rid = link.of(m.CreateResponse)[0].response_id
    for i in range(20):
        s.on_engine_message(m.AudioChunk("sess_test", rid, CHUNK, i))
    await settled(s)
    assert s.closed and s.close_code == 1008
    items = [await s.outbound.get(), await s.outbound.get()]
    assert items[0]["type"] == "error" and items[0]["error"]["code"] == "slow_consumer" and items[1] is None
    assert isinstance(link.sent[-1], m.CloseSession) and isinstance(link.sent[-2], m.CancelResponse)


async def test_feed_audio_at_48k_reaches_engine_at_16k():
    s, link = await new_session()
    await s.handle_client_event({"type": "session.update", "session": {"audio": {"input": {"turn_detection": None}}}})
    await feed(s, silence(1.0, 48000) + 0.1, rate=48000)
    await s.handle_client_event({"type": "input_audio_buffer.commit"})
    total = sum(len(x.pcm16k) // 2 for x in link.of(m.AppendUserAudio))
    assert total == 16000
    assert isinstance(link.sent[-1], m.CommitUserAudio)


async def test_turn_ending_before_interrupted_answer_ends_gets_answered_after_it(speech24k):
    s, link = await new_session()
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    rid = link.of(m.CreateResponse)[0].response_id
    s.on_engine_message(m.ResponseStarted("sess_test", rid, prompt_rows=40))
    s.on_engine_message(m.AudioChunk("sess_test", rid, CHUNK, 0))
    drain(s)
    n_before = len(link.sent)
    # A whole new user turn (speech, then silence) before the engine reports the cancelled answer done.
    await feed(s, np.concatenate([speech24k, silence(1.0)]))
    new = link.sent[n_before:]
    assert [type(x).__name__ for x in new] == ["CancelResponse", "TruncateResponse"]
    assert "input_audio_buffer.speech_stopped" in types(drain(s))
    s.on_engine_message(m.ResponseDone("sess_test", rid, "cancelled", reason="client_cancelled"))
    await settled(s)
    after = [type(x).__name__ for x in link.sent[n_before + 2:]]
    # Held in order: the new turn's audio, its commit, then the answer to it.
    assert after[-2:] == ["CommitUserAudio", "CreateResponse"] and set(after[:-2]) == {"AppendUserAudio"}
    evs = drain(s)
    t = types(evs)
    assert t.count("response.created") == 1 and t.index("response.done") < t.index("response.created")
    assert link.of(m.CreateResponse)[-1].response_id != rid


async def test_sampling_voice_prompt_and_instructions_reach_the_engine(tmp_path, speech24k):
    import base64

    from engines.audio.wav import write_wav

    s, link = await new_session()
    write_wav(tmp_path / "v.wav", speech24k[:24000], 24000)
    wav = (tmp_path / "v.wav").read_bytes()
    await s.handle_client_event({"type": "session.update", "session": {
        "instructions": "Be brief.", "audio": {"input": {"turn_detection": None}},
        "moss": {"sampling": {"temperature": 0.9, "top_k": 5, "seed": 7},
                 "voice_prompt": {"wav": base64.b64encode(wav).decode()}}}})
    upd = link.of(m.UpdateSession)[0]
    assert upd.instructions == "Be brief." and upd.voice_wav == wav
    session = drain(s)[-1]["session"]
    assert session["moss"]["sampling"]["temperature"] == 0.9 and session["moss"]["voice_prompt"] is True
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    await s.handle_client_event({"type": "response.create", "response": {
        "max_output_tokens": 33, "output_modalities": ["text"], "moss": {"sampling": {"greedy": True}}}})
    cr = link.of(m.CreateResponse)[0]
    assert cr.modality == "text"
    assert (cr.sampling.temperature, cr.sampling.top_k, cr.sampling.seed) == (0.9, 5, 7)
    assert cr.sampling.greedy and cr.sampling.max_new_tokens == 33
    # A voice prompt that is not a WAV file is refused by name; the session keeps its settings.
    await s.handle_client_event({"type": "session.update", "event_id": "v", "session": {
        "moss": {"voice_prompt": {"wav": base64.b64encode(b"not a wav").decode()}}}})
    err, updated = drain(s)[-2:]
    assert err["error"]["code"] == "invalid_audio" and err["error"]["param"] == "session.moss.voice_prompt.wav"
    assert updated["type"] == "session.updated" and updated["session"]["moss"]["voice_prompt"] is True
    assert s.config.voice_prompt_wav == wav
    s.on_engine_message(m.ResponseDone(s.id, cr.response_id, "completed"))
    await settled(s)
    # New instructions alone: the engine is not given the prompt again (it would make it again).
    await s.handle_client_event({"type": "session.update", "session": {"instructions": "Be long."}})
    assert link.of(m.UpdateSession)[-1] == m.UpdateSession(s.id, instructions="Be long.")
    # null: back to the server's default voice.
    await s.handle_client_event({"type": "session.update", "session": {"moss": {"voice_prompt": None}}})
    assert link.of(m.UpdateSession)[-1] == m.UpdateSession(s.id, instructions="Be long.", default_voice=True)
    assert drain(s)[-1]["session"]["moss"]["voice_prompt"] is False and s.config.voice_prompt_wav is None
    n = len(link.of(m.UpdateSession))
    await s.handle_client_event({"type": "session.update", "session": {"moss": {"voice_prompt": None}}})
    assert len(link.of(m.UpdateSession)) == n  # nothing changed


async def test_answer_audio_later_than_real_time_is_counted_as_an_underrun(monkeypatch):
    """The server's own underrun count: a chunk that leaves after a listener playing from the answer's first
    audio at real time has run dry (here 0.8 s of audio, then the next chunk 1.0 s after the first, on the
    session's clock)."""
    now = [1000.0]
    monkeypatch.setattr(pacing, "time", SimpleNamespace(monotonic=lambda: now[0]))

    class Observer:
        def __init__(self) -> None:
            self.underruns: list[float] = []

        def error(self, code: str) -> None: ...

        def ttfa(self, seconds: float) -> None: ...

        def rtf(self, value: float) -> None: ...

        def underrun(self, seconds: float) -> None:
            self.underruns.append(seconds)

    link, obs = Link(), Observer()
    s = Session("sess_test", link, observer=obs)
    await s.start()
    await s.handle_client_event({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}})
    await s.handle_client_event({"type": "response.create"})
    rid = link.of(m.CreateResponse)[0].response_id
    s.on_engine_message(m.ResponseStarted("sess_test", rid, prompt_rows=10))
    drain(s)

    async def audio(index: int) -> None:
        s.on_engine_message(m.AudioChunk("sess_test", rid, CHUNK, index))
        item = await s.outbound.get()  # the transport takes it: it leaves the server now
        assert item["type"] == "response.output_audio.delta"

    await audio(0)
    await audio(1)  # on time: 0.8 s buffered
    assert obs.underruns == []
    now[0] += 1.0
    await audio(2)  # the listener ran dry 0.2 s ago
    assert obs.underruns == [pytest.approx(0.2)]
    await audio(3)  # on time again, counted from where playback resumed
    assert len(obs.underruns) == 1
    await s.close()


async def test_response_create_as_an_interrupted_answer_ends_takes_the_place_of_the_automatic_one(speech24k):
    """A turn that ended during a cancelled answer is answered once that answer ends, by a task; a response.create
    handled before that task runs already answers the turn: one answer, not a second one created over the first
    (whose output and end the session would then ignore, holding every later input behind it)."""
    s, link = await new_session()
    await feed(s, np.concatenate([silence(0.5), speech24k, silence(1.0)]))
    rid = link.of(m.CreateResponse)[0].response_id
    s.on_engine_message(m.ResponseStarted("sess_test", rid, prompt_rows=40))
    await feed(s, np.concatenate([speech24k, silence(1.0)]))  # barge-in, and the new turn ends
    drain(s)
    s.on_engine_message(m.ResponseDone("sess_test", rid, "cancelled", reason="client_cancelled"))
    await s.handle_client_event({"type": "response.create"})  # before the automatic answer's task has run
    await settled(s)
    creates = [x for x in link.of(m.CreateResponse) if x.response_id != rid]
    evs = drain(s)
    t = types(evs)
    assert len(creates) == 1 and t.count("response.created") == 1 and "error" not in t, t
    created = evs[t.index("response.created")]["response"]["id"]
    assert creates[0].response_id == created
    s.on_engine_message(m.ResponseStarted("sess_test", created, prompt_rows=4))
    s.on_engine_message(m.TextDelta("sess_test", created, "hi"))
    s.on_engine_message(m.ResponseDone("sess_test", created, "completed", output_rows=1))
    done = [e for e in drain(s) if e["type"] == "response.done"]
    assert [d["response"]["id"] for d in done] == [created] and done[0]["response"]["status"] == "completed"
    assert not s.response_active
