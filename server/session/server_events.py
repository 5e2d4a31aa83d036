"""Builders for server events in the OpenAI Realtime GA shape (every event has `event_id` and `type`)."""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

from engines.protocol import errors

if TYPE_CHECKING:
    from engines.protocol.messages import ResponseDone
    from server.session.client_events import SessionConfig, TurnDetection


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(10)}"


def event(etype: str, **fields: Any) -> dict[str, Any]:
    return {"event_id": new_id("event"), "type": etype, **fields}


def error_event(code: str, message: str, *, param: str | None = None, event_id: Any = None) -> dict[str, Any]:
    """`error.type` is the code's (engines.protocol.errors); `error.event_id` is the client's event that caused it
    (None when not caused by one)."""
    return event("error", error={"type": errors.error_type(code), "code": code, "message": message, "param": param,
                                 "event_id": event_id if isinstance(event_id, str) else None})


def item(item_id: str, role: str, content: list[dict[str, Any]], status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "status": status, "role": role,
            "content": content}


def _turn_detection(td: TurnDetection | None) -> dict[str, Any] | None:
    if td is None:
        return None
    if td.type == "semantic_vad":
        return {"type": "semantic_vad", "eagerness": td.eagerness, "create_response": td.create_response,
                "interrupt_response": td.interrupt_response}
    return {"type": "server_vad", "threshold": td.threshold, "prefix_padding_ms": td.prefix_padding_ms,
            "silence_duration_ms": td.silence_duration_ms, "create_response": td.create_response,
            "interrupt_response": td.interrupt_response, "idle_timeout_ms": td.idle_timeout_ms}


def session_obj(session_id: str, c: SessionConfig) -> dict[str, Any]:
    moss: dict[str, Any] = {"session_id": session_id, "sampling": c.sampling_dict(),
                            "voice_prompt": c.voice_prompt_wav is not None}
    return {
        "type": "realtime",
        "model": c.model,
        "output_modalities": list(c.output_modalities),
        "instructions": c.instructions,
        "tools": [],
        "tool_choice": "auto",
        "max_output_tokens": c.max_output_tokens,
        "tracing": c.tracing,
        "truncation": c.truncation,
        "prompt": None,
        "include": None,
        "audio": {
            "input": {
                "format": c.input_format.to_event(),
                "transcription": c.transcription,
                "noise_reduction": None,
                "turn_detection": _turn_detection(c.turn_detection),
            },
            "output": {"format": c.output_format.to_event(), "voice": c.voice, "speed": c.speed},
        },
        # Our extension (docs/api.md, "Extension fields: `moss`").
        "moss": moss,
    }


def session_event(etype: str, session_id: str, c: SessionConfig) -> dict[str, Any]:
    return event(etype, session=session_obj(session_id, c))


def usage(done: ResponseDone, modality: str) -> dict[str, Any]:
    """Token counts are model rows (one row = one text token + one audio code at 12.5 Hz)."""
    prompt = done.prompt_rows + done.cached_rows
    return {
        "total_tokens": prompt + done.output_rows,
        "input_tokens": prompt,
        "output_tokens": done.output_rows,
        "input_token_details": {"cached_tokens": done.cached_rows, "text_tokens": None, "audio_tokens": None,
                                "cached_tokens_details": None},
        "output_token_details": {"text_tokens": done.output_rows if modality == "text" else 0,
                                 "audio_tokens": done.output_rows if modality == "audio" else 0},
    }


def response_obj(r: Any, session_id: str, status: str, *, output: list[dict[str, Any]] | None = None,
                 done: ResponseDone | None = None, status_details: dict[str, Any] | None = None) -> dict[str, Any]:
    # Extension: server-side time from the committed turn to the first audio leaving the server; rows actually
    # prefilled for this response (history rows are cached, not recomputed); answer audio samples; and whether the
    # server's answer length (max_answer_rows) ended an answer the client set no limit for.
    moss: dict[str, Any] = {"ttfa_ms": None if r.ttfa_ms is None else round(r.ttfa_ms, 2)}
    if done is not None:
        moss.update(prefilled_rows=done.prompt_rows, audio_samples=done.audio_samples)
    if r.stopped_by_server_limit:
        moss["stopped_by"] = "max_answer_rows"
    return {
        "id": r.id,
        "object": "realtime.response",
        "status": status,
        "status_details": status_details,
        "output": output or [],
        "conversation_id": None if r.out_of_band else f"conv_{session_id}",
        "output_modalities": [r.modality],
        "max_output_tokens": r.max_output_tokens,
        "audio": {"output": {"format": r.encoder.fmt.to_event(), "voice": None}} if r.modality == "audio" else None,
        "usage": None if done is None else usage(done, r.modality),
        "metadata": r.metadata,
        "moss": moss,
    }
