"""A session's conversation items beyond answers: `conversation.item.delete` (the engine cuts its history there and
prefills what follows again), items the engine dropped to fit its context (GA `truncation`), and the transcriptions
of user audio turns that MOSS-Speech writes itself (`audio.input.transcription`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engines.protocol import errors
from engines.protocol import messages as m
from engines.protocol.messages import AUTO_RETENTION
from server.session import server_events as ev
from server.session.client_events import SessionConfig
from server.session.client_json import ProtocolError

if TYPE_CHECKING:
    from server.session.session import Session


async def on_item_delete(s: Session, event: dict[str, Any]) -> None:
    unknown = sorted(set(event) - {"type", "event_id", "item_id"})
    if unknown:
        raise ProtocolError(errors.UNKNOWN_PARAMETER, f"unknown or unsupported field(s): {', '.join(unknown)}",
                            unknown[0])
    item_id = event.get("item_id")
    if not isinstance(item_id, str) or item_id not in s.items:
        raise ProtocolError(errors.ITEM_DELETE_INVALID_ITEM_ID, f"no item {item_id!r} in the conversation",
                            "item_id")
    if s.responses.active is not None:
        raise ProtocolError(errors.CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE, "an item cannot be deleted while an "
                            f"answer is in progress (response {s.responses.active.id}); cancel it first")
    if s.turns.spec is not None:
        raise ProtocolError(errors.INPUT_AUDIO_BUFFER_NOT_EMPTY, "an item cannot be deleted while the user's turn "
                            "may still go on (its end is not yet confirmed)")
    if s.input_buffer.uncommitted_samples():
        raise ProtocolError(errors.INPUT_AUDIO_BUFFER_NOT_EMPTY, "an item cannot be deleted while the input audio "
                            "buffer holds uncommitted audio; commit or clear it first")
    last = s.responses.last
    if last is not None and last.item_id in s.items and s.items.index(item_id) <= s.items.index(last.item_id):
        # The engine prefills the answer's rows again after the cut: from now on (not once it says so) a cut of it
        # would reach rows that moved.
        last.moved = True
    await s.engine_inputs.send(m.DeleteItem(session_id=s.id, item_id=item_id))


def retention_ratio(truncation: str | dict[str, Any]) -> float | None:
    """The share of the context a cut conversation keeps (None: never cut; "auto": the oldest items go when the next
    turn would not fit, until the conversation takes AUTO_RETENTION of the context)."""
    if truncation == "disabled":
        return None
    return AUTO_RETENTION if truncation == "auto" else truncation["retention_ratio"]


async def settings_changed(s: Session, old: SessionConfig) -> None:
    """After a session.update: the engine learns a new truncation setting."""
    if s.config.truncation != old.truncation:
        await s.engine_inputs.send(m.SetTruncation(session_id=s.id,
                                                   retention_ratio=retention_ratio(s.config.truncation)))


def on_engine_message(s: Session, msg: Any) -> bool:
    """Events for the engine's item and transcription messages; False: the message is not one of those."""
    if isinstance(msg, m.TranscriptionDelta):
        if msg.text:
            s.emit(ev.event("conversation.item.input_audio_transcription.delta", item_id=msg.item_id,
                            content_index=0, delta=msg.text))
    elif isinstance(msg, m.TranscriptionDone):
        if msg.status == "completed":
            usage = {"type": "tokens", "input_tokens": msg.prompt_rows, "output_tokens": msg.output_rows,
                     "total_tokens": msg.prompt_rows + msg.output_rows}
            s.emit(ev.event("conversation.item.input_audio_transcription.completed", item_id=msg.item_id,
                            content_index=0, transcript=msg.text, usage=usage))
        else:
            code = msg.code or errors.ENGINE_ERROR
            s.emit(ev.event("conversation.item.input_audio_transcription.failed", item_id=msg.item_id,
                            content_index=0, error={"type": errors.error_type(code), "code": code,
                                                    "message": msg.reason or "transcription failed", "param": None}))
    elif isinstance(msg, m.ItemsDropped):
        last = s.responses.last
        if last is not None and last.item_id in s.items:
            at = s.items.index(last.item_id)
            last.moved = last.moved or any(i in s.items[:at + 1] for i in msg.item_ids)
        for item_id in msg.item_ids:
            if item_id in s.items:
                s.items.remove(item_id)
                s.emit(ev.event("conversation.item.deleted", item_id=item_id))
        if not msg.deleted and msg.item_ids:
            s.log.info("conversation cut to fit the context: %d items dropped", len(msg.item_ids))
    else:
        return False
    return True
