"""Every error code a client can be sent, in one table: its `error.type`, the WebSocket close code that follows it
where it ends the session, the HTTP status where it answers an HTTP request, and what it means.

The server's `error` events and HTTP refusals and the engine's `Error` messages (messages.py; the server passes them
on to the client as `error` events) spell their codes with the constants below, and docs/api.md lists them all for
clients. Codes are stable: clients match on them.

A session refused at its start (`server_busy`, `engine_unavailable`, `server_shutting_down`) is answered with HTTP
503 (WebRTC offer) or, on a WebSocket already upgraded, the `error` event and close CLOSE_TRY_AGAIN_LATER.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# `error.type`: the client's mistake (the session goes on), the server's or the engine's side, a bad API key
ErrorType = Literal["invalid_request_error", "server_error", "authentication_error"]
_CLIENT: ErrorType = "invalid_request_error"
_SERVER: ErrorType = "server_error"
_AUTH: ErrorType = "authentication_error"

# WebSocket close codes (RFC 6455, section 7.4.1)
CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY_VIOLATION = 1008
CLOSE_MESSAGE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013

# ---- client events the server refuses (the session goes on) ----------------------------------------------------
INVALID_JSON = "invalid_json"
INVALID_EVENT = "invalid_event"
UNKNOWN_EVENT = "unknown_event"
UNKNOWN_PARAMETER = "unknown_parameter"
UNSUPPORTED_PARAMETER = "unsupported_parameter"
INVALID_VALUE = "invalid_value"
UNSUPPORTED_SESSION_TYPE = "unsupported_session_type"
UNSUPPORTED_AUDIO_FORMAT = "unsupported_audio_format"
UNSUPPORTED_TURN_DETECTION = "unsupported_turn_detection"
SERVER_VAD_UNAVAILABLE = "server_vad_unavailable"
SEMANTIC_VAD_UNAVAILABLE = "semantic_vad_unavailable"
INVALID_AUDIO = "invalid_audio"
INVALID_ITEM = "invalid_item"
UNSUPPORTED_ITEM_TYPE = "unsupported_item_type"
UNSUPPORTED_CONTENT_TYPE = "unsupported_content_type"
UNSUPPORTED_PREVIOUS_ITEM_ID = "unsupported_previous_item_id"
ITEM_TRUNCATE_INVALID_ITEM_ID = "item_truncate_invalid_item_id"
ITEM_RETRIEVE_INVALID_ITEM_ID = "item_retrieve_invalid_item_id"
ITEM_DELETE_INVALID_ITEM_ID = "item_delete_invalid_item_id"
ITEM_DELETE_MID_TURN = "item_delete_mid_turn"
INPUT_AUDIO_BUFFER_COMMIT_EMPTY = "input_audio_buffer_commit_empty"
INPUT_AUDIO_BUFFER_TOO_LARGE = "input_audio_buffer_too_large"
INPUT_AUDIO_BUFFER_NOT_EMPTY = "input_audio_buffer_not_empty"
CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE = "conversation_already_has_active_response"
RESPONSE_CANCEL_NOT_ACTIVE = "response_cancel_not_active"

# ---- the server's side -----------------------------------------------------------------------------------------
SERVER_ERROR = "server_error"
SLOW_CONSUMER = "slow_consumer"
TOO_MANY_EVENTS = "too_many_events"
SERVER_BUSY = "server_busy"
ENGINE_UNAVAILABLE = "engine_unavailable"
SERVER_SHUTTING_DOWN = "server_shutting_down"
SESSION_IDLE_TIMEOUT = "session_idle_timeout"

# ---- the engine's side (Error messages, passed on to the client; the session goes on) --------------------------
INVALID_REQUEST = "invalid_request"
ENGINE_ERROR = "engine_error"
REQUEST_TOO_LARGE = "request_too_large"
INPUT_TOO_LARGE = "input_too_large"

# ---- HTTP refusals (WebRTC calls and the page) -----------------------------------------------------------------
INVALID_OFFER = "invalid_offer"
INVALID_API_KEY = "invalid_api_key"
ORIGIN_NOT_ALLOWED = "origin_not_allowed"
CALL_NOT_FOUND = "call_not_found"
PAGE_NOT_FOUND = "page_not_found"
OFFER_TOO_LARGE = "offer_too_large"
UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"


@dataclass(frozen=True)
class ErrorCode:
    type: ErrorType
    meaning: str
    close: int | None = None  # the WebSocket close code after it: it ends the session
    http: int | None = None  # the HTTP status of a request refused with it


ERRORS: dict[str, ErrorCode] = {
    INVALID_JSON: ErrorCode(_CLIENT, "the message is not JSON (or escapes a lone UTF-16 surrogate, or nests arrays "
                                        "and objects more than 64 deep)"),
    INVALID_EVENT: ErrorCode(_CLIENT, "the message is not a JSON object (or is a binary frame)"),
    UNKNOWN_EVENT: ErrorCode(_CLIENT, "an unknown or unsupported client event `type`"),
    UNKNOWN_PARAMETER: ErrorCode(_CLIENT, "a field that does not exist"),
    UNSUPPORTED_PARAMETER: ErrorCode(_CLIENT, "a field this server takes only with its off value"),
    INVALID_VALUE: ErrorCode(_CLIENT, "a field with a bad value"),
    UNSUPPORTED_SESSION_TYPE: ErrorCode(_CLIENT, "`session.type` other than `realtime`"),
    UNSUPPORTED_AUDIO_FORMAT: ErrorCode(_CLIENT, "an audio format other than 24 kHz PCM or 8 kHz G.711"),
    UNSUPPORTED_TURN_DETECTION: ErrorCode(_CLIENT, "turn detection other than `server_vad`, `semantic_vad` or null"),
    SERVER_VAD_UNAVAILABLE: ErrorCode(_CLIENT, "`server_vad` or `semantic_vad` on a server started without VAD"),
    SEMANTIC_VAD_UNAVAILABLE: ErrorCode(_CLIENT, "`semantic_vad` on a server without its end-of-turn model"),
    INVALID_AUDIO: ErrorCode(_CLIENT, "audio that is not base64 PCM16, or a voice prompt that is not a WAV file, whose "
                             "sample rate is outside 8-192 kHz or that is longer than 30 s", http=400),
    INVALID_ITEM: ErrorCode(_CLIENT, "a `conversation.item.create` item the server cannot take"),
    UNSUPPORTED_ITEM_TYPE: ErrorCode(_CLIENT, "an item type other than `message`"),
    UNSUPPORTED_CONTENT_TYPE: ErrorCode(_CLIENT, "a content part the item's role cannot have"),
    UNSUPPORTED_PREVIOUS_ITEM_ID: ErrorCode(_CLIENT, "an item placed anywhere but at the end"),
    ITEM_TRUNCATE_INVALID_ITEM_ID: ErrorCode(_CLIENT, "cutting short an item that is not the latest assistant audio"),
    ITEM_RETRIEVE_INVALID_ITEM_ID: ErrorCode(_CLIENT, "retrieving an item that is not in the conversation"),
    ITEM_DELETE_INVALID_ITEM_ID: ErrorCode(_CLIENT, "deleting an item the conversation does not have"),
    ITEM_DELETE_MID_TURN: ErrorCode(_CLIENT, "deleting an item while the engine holds a turn in progress: a committed "
                                    "user turn not yet answered, or its commit or answer still finishing"),
    INPUT_AUDIO_BUFFER_COMMIT_EMPTY: ErrorCode(_CLIENT, "a commit with no audio"),
    INPUT_AUDIO_BUFFER_TOO_LARGE: ErrorCode(_CLIENT, "uncommitted audio over the input buffer limit"),
    INPUT_AUDIO_BUFFER_NOT_EMPTY: ErrorCode(_CLIENT, "an answer or audio item while the input buffer holds "
                                            "uncommitted audio"),
    CONVERSATION_ALREADY_HAS_ACTIVE_RESPONSE: ErrorCode(_CLIENT, "`response.create` while an answer runs"),
    RESPONSE_CANCEL_NOT_ACTIVE: ErrorCode(_CLIENT, "`response.cancel` with no such answer running"),
    SERVER_ERROR: ErrorCode(_SERVER, "an internal error: on one event the session goes on, else it ends",
                            close=CLOSE_INTERNAL_ERROR),
    SLOW_CONSUMER: ErrorCode(_SERVER, "the client does not read its events", close=CLOSE_POLICY_VIOLATION),
    TOO_MANY_EVENTS: ErrorCode(_CLIENT, "a call's client sent events on its data channel faster than they could be "
                               "handled (more than 512 waiting): the call ends"),
    SERVER_BUSY: ErrorCode(_SERVER, "the session or call limit is reached, or the engine has no room for the "
                           "answer now", http=503),
    ENGINE_UNAVAILABLE: ErrorCode(_SERVER, "the engine is (re)starting, or its process stopped",
                                  close=CLOSE_INTERNAL_ERROR, http=503),
    SERVER_SHUTTING_DOWN: ErrorCode(_SERVER, "the server is shutting down", close=CLOSE_GOING_AWAY, http=503),
    SESSION_IDLE_TIMEOUT: ErrorCode(_SERVER, "the client sent nothing for the idle timeout while no answer ran",
                                    close=CLOSE_GOING_AWAY),
    INVALID_REQUEST: ErrorCode(_SERVER, "the engine refused a message (a bad value, or out of order)"),
    ENGINE_ERROR: ErrorCode(_SERVER, "the engine failed on a request"),
    REQUEST_TOO_LARGE: ErrorCode(_SERVER, "the conversation and answer would exceed the engine's context or KV "
                                 "pool"),
    INPUT_TOO_LARGE: ErrorCode(_CLIENT, "a text, instructions, items waiting for the next answer or "
                               "`max_output_tokens` over the engine's bounds (the message changes nothing)"),
    INVALID_OFFER: ErrorCode(_CLIENT, "an SDP offer the server cannot answer", http=400),
    INVALID_API_KEY: ErrorCode(_AUTH, "a missing or wrong API key", http=401),
    ORIGIN_NOT_ALLOWED: ErrorCode(_CLIENT, "an `Origin` not allowed", http=403),
    CALL_NOT_FOUND: ErrorCode(_CLIENT, "no such call", http=404),
    PAGE_NOT_FOUND: ErrorCode(_CLIENT, "the web page is not installed", http=404),
    OFFER_TOO_LARGE: ErrorCode(_CLIENT, "an SDP offer over the size limit", http=413),
    UNSUPPORTED_MEDIA_TYPE: ErrorCode(_CLIENT, "an offer that is not `application/sdp`", http=415),
}


def error_type(code: str) -> ErrorType:
    """`error.type` of a code; a code the table lacks is the server's own fault."""
    e = ERRORS.get(code)
    return e.type if e is not None else _SERVER


def close_code(code: str) -> int:
    """The WebSocket close code of an error that ends the session."""
    close = ERRORS[code].close
    if close is None:
        raise ValueError(f"error code {code!r} does not end a session")
    return close


def http_status(code: str) -> int:
    """The HTTP status of a request refused with `code` (400 for a client mistake the table gives no status)."""
    e = ERRORS[code]
    if e.http is not None:
        return e.http
    if e.type != _CLIENT:
        raise ValueError(f"error code {code!r} has no HTTP status")
    return 400
