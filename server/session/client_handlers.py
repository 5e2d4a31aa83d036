"""What each client event does to a Session (the OpenAI Realtime GA events; settings are parsed in client_events.py).

Each handler raises ProtocolError for a client mistake; the session answers it with an `error` event and goes on.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.protocol import errors
from engines.protocol import messages as m
from server.audio.formats import AudioFormat
from server.audio.pcm import float32_to_pcm16
from server.audio.resample import AudioError, resample
from server.session import items
from server.session import server_events as ev
from server.session.client_events import parse_response_create, parse_session_update
from server.session.client_json import ProtocolError
from server.session.input_buffer import CLIENT_RATE, ENGINE_IN_RATE
from server.session.pacing import ANSWER_RATE

if TYPE_CHECKING:
    from server.session.responses import Response
    from server.session.session import Session


async def _on_session_update(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "session"})
    new, refused = parse_session_update(event.get("session"), s.config)
    asked = event["session"].get("model")
    if isinstance(asked, str) and asked != s.config.model and not s.model_asked_logged:
        s.model_asked_logged = True
        s.log.info("the client asked for model %r; this server serves %r", asked[:64], s.config.model)
    if new.tracing is not None and s.config.tracing is None:  # (no trace dashboard: the log is where to find it)
        s.log.info("tracing %s", json.dumps(new.tracing))
    if new.instructions is not None and len(new.instructions) > s.limits.max_text_chars:
        refused.append(_text_too_long("session.instructions", new.instructions, s.limits.max_text_chars))
        new = dataclasses.replace(new, instructions=s.config.instructions)
    try:
        await s.turns.check(new.turn_detection)
    except ProtocolError as e:  # turn detection this server cannot serve: refused, the rest applies
        refused.append(e)
        new = dataclasses.replace(new, turn_detection=s.config.turn_detection)
    old = s.config
    s.config = new
    if new.turn_detection != old.turn_detection:
        if old.turn_detection is not None and not s.turns.in_speech:
            # Between server_vad turns the input is only the prefix ring (reset here), none of it sent to the engine:
            # nothing is left for a commit to hold, so a response.create next is not refused for it.
            s.input_buffer.samples_client = 0
            s.input_buffer.appended = False
        await s.turns.reset()
        s.idle.disarm()
    voice_changed = new.voice_prompt_wav != old.voice_prompt_wav
    if new.instructions != old.instructions or voice_changed:
        # Only what changed: a voice prompt sent again would be made again, and the next answer wait for it.
        await s.engine_inputs.send(m.UpdateSession(
            session_id=s.id, instructions=new.instructions,
            default_instructions=new.output_modalities[0] if new.instructions is None else None,
            voice_wav=new.voice_prompt_wav if voice_changed else None,
            default_voice=voice_changed and new.voice_prompt_wav is None))
    await items.settings_changed(s, old)
    for e in refused:  # each refused field in its own error, then the session as it now is
        s.error(e.code, e.message, param=e.param, event_id=event.get("event_id"), now=True)
    s.emit(ev.session_event("session.updated", s.id, s.config), keep=True)


async def _on_append(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "audio"})
    fmt = s.config.input_format
    pcm = _decode_audio(event.get("audio"), fmt, "audio")
    await s.input_buffer.add(pcm, fmt.rate, client_samples=round(len(pcm) * CLIENT_RATE / fmt.rate))
    s.input_buffer.appended = True


async def _on_commit(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id"})
    if not s.input_buffer.uncommitted_samples() and not (s.config.turn_detection and s.turns.prefix_samples):
        raise ProtocolError(errors.INPUT_AUDIO_BUFFER_COMMIT_EMPTY, "the input audio buffer is empty")
    await s.input_buffer.flush_resamplers()
    if s.config.turn_detection is not None and not s.turns.in_speech:
        await s.turns.flush_prefix()
    await s.input_buffer.commit(auto_response=False)


async def _on_clear(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id"})
    await s.input_buffer.clear()


async def _on_item_create(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "previous_item_id", "item"})
    prev = event.get("previous_item_id")
    # ("root" is the conversation's start: the end too while it is empty)
    if prev is not None and prev != (s.items[-1] if s.items else "root"):
        raise ProtocolError(errors.UNSUPPORTED_PREVIOUS_ITEM_ID,
                            "items can only be appended at the end of the conversation", "previous_item_id")
    item = event.get("item")
    if not isinstance(item, dict):
        raise ProtocolError(errors.INVALID_ITEM, "item must be an object", "item")
    _check_keys(item, {"id", "type", "object", "role", "content", "status"}, "item.")
    if item.get("type", "message") != "message":
        raise ProtocolError(errors.UNSUPPORTED_ITEM_TYPE, f"item.type {item.get('type')!r} is not supported "
                            "(only 'message')", "item.type")
    role = item.get("role")
    if role not in ("user", "system", "assistant"):
        raise ProtocolError(errors.INVALID_ITEM, f"item.role must be user, system or assistant, got {role!r}",
                            "item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content or not all(isinstance(p, dict) for p in content):
        raise ProtocolError(errors.INVALID_ITEM, "item.content must be a non-empty list of content parts",
                            "item.content")
    item_id = item.get("id") or ev.new_id("item")
    if not isinstance(item_id, str) or len(item_id) > 64 or item_id in s.items:
        raise ProtocolError(errors.INVALID_ITEM, "item.id must be a new string of at most 64 characters",
                            "item.id")
    text_type = {"user": "input_text", "system": "input_text", "assistant": "output_text"}[role]
    if any(p.get("type") in (text_type, "text") for p in content):
        # Text parts (LiveKit sends a message's strings as parts of one item) are one text, a line each.
        text = "\n".join(_text_part(p, i, text_type, role) for i, p in enumerate(content))
        if len(text) > s.limits.max_text_chars:
            raise _text_too_long("item.content[0].text" if len(content) == 1 else "item.content", text,
                                 s.limits.max_text_chars)
        msg = m.AddUserText(session_id=s.id, item_id=item_id, text=text, role=role)
        out_parts = [{"type": text_type, "text": p["text"]} for p in content]
    elif content[0].get("type") == "input_audio" and role == "user":
        if len(content) > 1:
            raise ProtocolError(errors.UNSUPPORTED_CONTENT_TYPE, "an input_audio part must be its item's only "
                                "content part", "item.content")
        part = content[0]
        _check_keys(part, {"type", "audio", "transcript"}, "item.content[0].")
        try:
            fmt = s.config.input_format
            pcm = resample(_decode_audio(part.get("audio"), fmt, "item.content[0].audio"), fmt.rate, ENGINE_IN_RATE)
        except AudioError as e:
            raise ProtocolError(errors.INVALID_AUDIO, str(e), "item.content[0].audio") from None
        await s.input_buffer.settle("adding an audio item")  # after the checks: a bad item clears nothing
        await s.engine_inputs.send(m.AppendUserAudio(session_id=s.id, pcm16k=float32_to_pcm16(pcm)))
        msg = m.CommitUserAudio(session_id=s.id, item_id=item_id, transcribe=s.config.transcription is not None)
        out_parts = [{"type": "input_audio", "transcript": part.get("transcript")}]
    else:
        raise ProtocolError(errors.UNSUPPORTED_CONTENT_TYPE, f"content type {content[0].get('type')!r} is not "
                            f"supported for role {role!r}", "item.content[0].type")
    await s.engine_inputs.send(msg)
    s.add_item(item_id, role, out_parts)


def _text_part(part: dict[str, Any], i: int, text_type: str, role: str) -> str:
    """The text of part i of a message item whose parts are text."""
    param = f"item.content[{i}]"
    if part.get("type") not in (text_type, "text"):
        raise ProtocolError(errors.UNSUPPORTED_CONTENT_TYPE, f"content type {part.get('type')!r} cannot go with "
                            f"text in a {role} item", f"{param}.type")
    _check_keys(part, {"type", "text"}, f"{param}.")
    text = part.get("text")
    if not isinstance(text, str) or not text:
        raise ProtocolError(errors.INVALID_ITEM, "text content needs a non-empty string 'text'", f"{param}.text")
    return text


async def _on_item_truncate(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "item_id", "content_index", "audio_end_ms"})
    item_id = event.get("item_id")
    audio_end_ms = event.get("audio_end_ms")
    if not isinstance(audio_end_ms, int) or audio_end_ms < 0:
        raise ProtocolError(errors.INVALID_VALUE, "audio_end_ms must be an integer >= 0", "audio_end_ms")
    samples = audio_end_ms * ANSWER_RATE // 1000
    active = _seen_active(s)
    r = active if active and active.item_id == item_id else _seen_last(s)
    if r is None or r.item_id != item_id:
        # An earlier assistant item truncated at (or past) its end cuts nothing: clients that track playback loosely
        # send that after a later answer began.
        heard = s.item_audio_samples.get(item_id) if isinstance(item_id, str) else None
        if heard is None or heard - samples >= ANSWER_RATE // 1000:  # short of its end by a millisecond or more
            raise ProtocolError(errors.ITEM_TRUNCATE_INVALID_ITEM_ID, "only the latest assistant audio item can be "
                                "cut short (an earlier one only at its end)", "item_id")
        s.emit(ev.event("conversation.item.truncated", item_id=item_id,
                        content_index=event.get("content_index", 0), audio_end_ms=heard * 1000 // ANSWER_RATE),
               keep=True)
        return
    if r.out_of_band:
        raise ProtocolError(errors.ITEM_TRUNCATE_INVALID_ITEM_ID, "an out-of-band response is in no conversation",
                            "item_id")
    if samples > r.audio_samples_queued:
        raise ProtocolError(errors.INVALID_VALUE, f"audio_end_ms {audio_end_ms} is beyond the item's audio "
                            f"({r.audio_samples_queued * 1000 // ANSWER_RATE} ms)", "audio_end_ms")
    if r is active and r.cancel_sent:  # (a barge-in's cancel, cut where the server guessed the listener was)
        await s.responses.stop_heard(r, samples)
    elif r is active:
        await s.responses.cancel("client_cancelled", samples)
    elif r.kept_samples - samples >= ANSWER_RATE // 1000:  # cuts something the engine's history holds
        if r.moved:
            raise ProtocolError(errors.ITEM_TRUNCATE_INVALID_ITEM_ID, "an item at or before this one left the "
                                "conversation since: it can no longer be cut short (only at its end)", "item_id")
        if s.turns.spec is not None:  # (its answer, held, was made after all of this one)
            raise ProtocolError(errors.ITEM_TRUNCATE_INVALID_ITEM_ID, "the user's next turn is being answered: this "
                                "item can no longer be cut short (only at its end)", "item_id")
        if s.responses.active is not None:
            raise ProtocolError(errors.ITEM_TRUNCATE_INVALID_ITEM_ID, "a later answer has begun: this item can no "
                                "longer be cut short (only at its end)", "item_id")
        await s.engine_inputs.send(m.TruncateResponse(session_id=s.id, response_id=r.id,
                                                      audio_samples_played=r.model_samples(samples)))
        r.kept_samples = samples
    s.emit(ev.event("conversation.item.truncated", item_id=item_id,
                    content_index=event.get("content_index", 0), audio_end_ms=audio_end_ms), keep=True)


def _seen_active(s: Session) -> Response | None:
    """The response in progress as the client sees it: none while the answer under way is held, unseen, on a
    tentative end of turn (turn_detection.py)."""
    r = s.responses.active
    return None if r is None or r.id == s.turns.held_response() else r


def _seen_last(s: Session) -> Response | None:
    """The latest response that ended as the client sees it: while an answer is held on a tentative end of turn
    (turn_detection.py), the one before it, even if the held one has ended already."""
    spec = s.turns.spec
    return s.responses.last if spec is None else spec.last


async def _on_response_create(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "response"})
    opts = parse_response_create(event.get("response"), s.config)
    if opts["instructions"] is not None and len(opts["instructions"]) > s.limits.max_text_chars:
        raise _text_too_long("response.instructions", opts["instructions"], s.limits.max_text_chars)
    active = _seen_active(s)
    if active is not None:
        raise ProtocolError(errors.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE,
                            f"response {active.id} is still in progress")
    await s.input_buffer.settle("response.create")  # (while an answer is held, to the client the user still speaks)
    await s.responses.create(opts)


async def _on_response_cancel(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "response_id"})
    rid = event.get("response_id")
    r = _seen_active(s)
    if r is None or (rid is not None and rid != r.id):
        raise ProtocolError(errors.RESPONSE_CANCEL_NOT_ACTIVE, "there is no active response to cancel"
                            + (f" with id {rid!r}" if rid else ""))
    await s.responses.cancel("client_cancelled", None)


async def _on_item_retrieve(s: Session, event: dict[str, Any]) -> None:
    _check_keys(event, {"type", "event_id", "item_id"})
    item_id = event.get("item_id")
    if not isinstance(item_id, str):
        raise ProtocolError(errors.ITEM_RETRIEVE_INVALID_ITEM_ID, "item_id (a string) is required", "item_id")
    item = s.item_objs.get(item_id)
    if item is None:
        raise ProtocolError(errors.ITEM_RETRIEVE_INVALID_ITEM_ID, f"no item {item_id!r} in this conversation",
                            "item_id")
    s.emit(ev.event("conversation.item.retrieved", item=item), keep=True)


async def _on_output_audio_clear(s: Session, event: dict[str, Any]) -> None:
    """Stop the answer's audio where the listener is: an answer still running is cancelled, queued audio dropped, the
    history cut to what was heard (WebRTC: what the track played; WebSocket: real time since the first audio)."""
    _check_keys(event, {"type", "event_id"})
    active = _seen_active(s)  # (while one is held, what the client clears is the answer it heard)
    r = active or _seen_last(s)
    if r is None:
        return
    played = r.playback.played()
    if r is active:
        await s.responses.cancel("client_cancelled", played)
    elif played < r.kept_samples and s.turns.spec is None:  # (a held answer was made after all of this one)
        await s.responses.stop_heard(r, played)
    s.emit(ev.event("output_audio_buffer.cleared", response_id=r.id), keep=True)


HANDLERS: dict[str, Callable[[Session, dict[str, Any]], Awaitable[None]]] = {
    "session.update": _on_session_update,
    "input_audio_buffer.append": _on_append,
    "input_audio_buffer.commit": _on_commit,
    "input_audio_buffer.clear": _on_clear,
    "conversation.item.create": _on_item_create,
    "conversation.item.truncate": _on_item_truncate,
    "conversation.item.retrieve": _on_item_retrieve,
    "output_audio_buffer.clear": _on_output_audio_clear,
    "response.create": _on_response_create,
    "response.cancel": _on_response_cancel,
    "conversation.item.delete": items.on_item_delete,
}


def _text_too_long(param: str, text: str, bound: int) -> ProtocolError:
    """Refused when it arrives, rather than forwarded for the engine to refuse (its bound is the same)."""
    return ProtocolError(errors.INPUT_TOO_LARGE, f"{param} of {len(text)} characters is over this server's bound of "
                         f"{bound} (MOSS_MAX_TEXT_CHARS)", param)


def _check_keys(d: dict[str, Any], allowed: set[str], prefix: str = "") -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise ProtocolError(errors.UNKNOWN_PARAMETER, "unknown or unsupported field(s): "
                            + ", ".join(prefix + k for k in unknown), prefix + unknown[0])


def _decode_audio(data: Any, fmt: AudioFormat, param: str) -> np.ndarray:
    """base64 audio in the session's input format -> float32 [n] in [-1, 1) at its rate."""
    if not isinstance(data, str):
        raise ProtocolError(errors.INVALID_AUDIO, f"audio must be a base64 string of {fmt.type} samples", param)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError(errors.INVALID_AUDIO, "audio is not valid base64", param) from None
    try:
        return fmt.decode(raw)
    except AudioError as e:
        raise ProtocolError(errors.INVALID_AUDIO, str(e), param) from None
