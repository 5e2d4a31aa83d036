"""Server events checked against the openai SDK's own pydantic models of the GA Realtime events, strictly: the event
validates with no type coercion, and no object carries a field the SDK does not know except our `moss` extension."""

from __future__ import annotations

from typing import Any

import pydantic
from openai.types.realtime import RealtimeServerEvent

_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(RealtimeServerEvent)

# Every event type this server sends (server/session/*, server/transports/webrtc/call.py).
SERVER_EVENT_TYPES = frozenset({
    "error", "session.created", "session.updated",
    "input_audio_buffer.committed", "input_audio_buffer.cleared", "input_audio_buffer.speech_started",
    "input_audio_buffer.speech_stopped", "input_audio_buffer.timeout_triggered",
    "conversation.item.added", "conversation.item.done", "conversation.item.truncated", "conversation.item.retrieved",
    "conversation.item.deleted", "conversation.item.input_audio_transcription.delta",
    "conversation.item.input_audio_transcription.completed", "conversation.item.input_audio_transcription.failed",
    "response.created", "response.done", "response.output_item.added", "response.output_item.done",
    "response.content_part.added", "response.content_part.done", "response.output_audio.delta",
    "response.output_audio.done", "response.output_audio_transcript.delta", "response.output_audio_transcript.done",
    "response.output_text.delta", "response.output_text.done",
    "output_audio_buffer.started", "output_audio_buffer.stopped", "output_audio_buffer.cleared",
})


def _extras(obj: Any, path: str) -> list[str]:
    out: list[str] = []
    if isinstance(obj, pydantic.BaseModel):
        out += [f"{path}.{k}" for k in (obj.__pydantic_extra__ or {}) if k != "moss"]
        for name in type(obj).model_fields:
            out += _extras(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, list | tuple):
        for i, x in enumerate(obj):
            out += _extras(x, f"{path}[{i}]")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out += _extras(v, f"{path}.{k}")
    return out


def check(event: dict[str, Any]) -> Any:
    """The event as the SDK's model; AssertionError naming what does not fit."""
    assert event.get("type") in SERVER_EVENT_TYPES, f"an event type no test covers: {event.get('type')}"
    try:
        model = _ADAPTER.validate_python(event, strict=True)
    except pydantic.ValidationError as e:
        raise AssertionError(f"{event['type']} does not validate under the SDK's model: {e}\n{event}") from None
    assert type(model).__name__ != "dict", event
    extra = _extras(model, event["type"])
    assert not extra, f"fields outside the SDK's model (extensions go under `moss`): {extra}"
    return model
