"""Messages between the server processes and the engine process (ZeroMQ + msgpack).

The server knows nothing of tensors: it sends session-level commands with PCM bytes and text,
and receives text deltas, PCM chunks and completions. Every message is a frozen dataclass; on
the wire it is a msgpack map with a `type` field naming the class.

PCM on the wire: little-endian int16 mono. User audio is 16 kHz (the server resamples);
answer audio is 24 kHz (the codec's rate).

What the engine does with each message (one ResponseDone per CreateResponse, truncation rule,
readiness) is written down in engines/process/service.py and main.py; error codes are those of
errors.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import msgpack

Modality = Literal["audio", "text"]


def number_in(v: Any, lo: float, hi: float, *, integer: bool = False) -> bool:
    """A message field holds a number (an int where `integer`; never a bool, never NaN) within [lo, hi]: the one
    check both sides apply to numeric fields (the server's protocol to the client's, the engine to the server's)."""
    ok_type = isinstance(v, int) if integer else isinstance(v, int | float)
    return not isinstance(v, bool) and ok_type and lo <= v <= hi


@dataclass(frozen=True)
class Sampling:
    """Per-session sampling settings; fields mirror engines.api.SamplingParams (one value for both channels)."""

    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = 20
    repetition_penalty: float = 1.1
    max_new_tokens: int = 500
    min_new_tokens: int = 0
    seed: int | None = None
    greedy: bool = False


# ---- server -> engine ----------------------------------------------------------------------


@dataclass(frozen=True)
class OpenSession:
    session_id: str
    instructions: str | None = None  # system prompt; None = the contract's default for the modality
    voice_wav: bytes | None = None  # optional speaker prompt as a WAV file's bytes
    # Added by the engine service: the session's sampling, used to open the engine request for user
    # speech before CreateResponse arrives (incremental prefill). A CreateResponse with other
    # settings still works, but its user turn is prefilled again. None = defaults / last used.
    sampling: Sampling | None = None


@dataclass(frozen=True)
class UpdateSession:
    """What changed (None: unchanged)."""

    session_id: str
    instructions: str | None = None
    voice_wav: bytes | None = None
    sampling: Sampling | None = None  # see OpenSession.sampling
    default_voice: bool = False  # without voice_wav: back to the engine's default voice (a prompt in the making
    # no longer counts)
    # Without instructions: back to none, the default system prompt of this modality going in as the system turn.
    default_instructions: Modality | None = None
    # The system turn of new instructions is never dropped to fit the context; False for one answer's own
    # instructions and the turn that ends them (the session's again), which may leave like any item.
    pinned: bool = True


@dataclass(frozen=True)
class AppendUserAudio:
    """User speech as it arrives; encoded and prefilled while the user is still talking."""

    session_id: str
    pcm16k: bytes


@dataclass(frozen=True)
class ClearUserAudio:
    session_id: str


@dataclass(frozen=True)
class CommitUserAudio:
    """End of the user's spoken turn (VAD or client commit): closes the user turn in the history.

    `tentative`: the turn probably ended (an answer may start at once) but the user may go on: it closes with the
    codes of the audio sent so far, and the encoder keeps its stream (and the audio it holds for the next code), so
    that a WithdrawResponse continues the turn exactly where it was. ConfirmUserAudio ends it for good."""

    session_id: str
    item_id: str
    tentative: bool = False
    transcribe: bool = False  # the turn is also transcribed (TranscriptionDelta / TranscriptionDone for item_id)


@dataclass(frozen=True)
class ConfirmUserAudio:
    """The tentative commit stands: the encoder forgets the turn (the audio it held is not encoded)."""

    session_id: str


@dataclass(frozen=True)
class WithdrawResponse:
    """The user went on speaking after a tentative commit: the answer to it stops (ResponseDone `cancelled`, reason
    `withdrawn`, if it had not ended), its rows and the turn's closing rows leave the history and the KV cache, and
    the user's turn is open again (its audio is not prefilled again)."""

    session_id: str
    response_id: str


@dataclass(frozen=True)
class AddUserText:
    session_id: str
    item_id: str
    text: str
    role: Literal["user", "system", "assistant"] = "user"


@dataclass(frozen=True)
class CreateResponse:
    session_id: str
    response_id: str
    modality: Modality = "audio"
    sampling: Sampling = field(default_factory=Sampling)
    item_id: str | None = None  # the answer's conversation item (DeleteItem); None: the response id
    # Outside the conversation (GA `conversation: "none"`): it answers the history as it stands, then its rows leave
    # it; it is no item and cannot be truncated.
    out_of_band: bool = False
    # An out-of-band answer's own instructions: a system turn right before it that leaves the history with it (those
    # of an answer in the conversation go in with UpdateSession). None: the session's.
    instructions: str | None = None


@dataclass(frozen=True)
class DeleteItem:
    """Drop an item from the conversation (the history after it is prefilled again); answered by ItemsDropped."""

    session_id: str
    item_id: str


# The retention share of GA truncation "auto" (and of a session that never set one): a cut is rare.
AUTO_RETENTION = 0.75


@dataclass(frozen=True)
class SetTruncation:
    """What to do when the next turn would not fit the context: drop the oldest items until the conversation takes
    at most `retention_ratio` of it (never the system prompt), or refuse the turn (None)."""

    session_id: str
    retention_ratio: float | None


@dataclass(frozen=True)
class CancelResponse:
    session_id: str
    response_id: str


@dataclass(frozen=True)
class TruncateResponse:
    """Barge-in: keep only the answer audio the user actually heard (in 24 kHz samples)."""

    session_id: str
    response_id: str
    audio_samples_played: int


@dataclass(frozen=True)
class CloseSession:
    session_id: str


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Sync:
    """Answered by Synced once the engine has handled the session's earlier messages (and sent what they caused):
    how a session bounds the messages it has in flight, and so the replies that may still come for them."""

    session_id: str
    seq: int


# ---- engine -> server ----------------------------------------------------------------------


@dataclass(frozen=True)
class SessionReady:
    session_id: str


@dataclass(frozen=True)
class UserAudioProgress:
    """How much of the user's audio is encoded and prefilled (for metrics and tests)."""

    session_id: str
    codes: int
    prefilled_rows: int


@dataclass(frozen=True)
class ResponseStarted:
    session_id: str
    response_id: str
    prompt_rows: int  # rows prefilled for this response (new rows only; history is cached)


@dataclass(frozen=True)
class TextDelta:
    session_id: str
    response_id: str
    text: str


@dataclass(frozen=True)
class AudioChunk:
    session_id: str
    response_id: str
    pcm24k: bytes
    index: int  # 0, 1, 2... per response


@dataclass(frozen=True)
class ResponseDone:
    session_id: str
    response_id: str
    status: Literal["completed", "cancelled", "incomplete", "failed"]
    reason: str | None = None  # e.g. "max_output_tokens", "client_cancelled"
    output_rows: int = 0
    prompt_rows: int = 0
    cached_rows: int = 0
    audio_samples: int = 0
    text: str = ""
    engine_ttfa_ms: float | None = None  # from CreateResponse received to first AudioChunk sent


@dataclass(frozen=True)
class TranscriptionDelta:
    session_id: str
    item_id: str
    text: str


@dataclass(frozen=True)
class TranscriptionDone:
    session_id: str
    item_id: str
    status: Literal["completed", "failed"]
    text: str = ""
    code: str | None = None  # with failed: errors.py's code, and why
    reason: str | None = None
    prompt_rows: int = 0
    output_rows: int = 0


@dataclass(frozen=True)
class ItemsDropped:
    """Items gone from the conversation: the one a DeleteItem named, or the oldest, dropped to fit the context."""

    session_id: str
    item_ids: list[str]
    deleted: bool  # by DeleteItem (else by truncation)


@dataclass(frozen=True)
class Error:
    session_id: str | None
    code: str  # errors.py: invalid_request, server_busy, request_too_large, engine_error
    message: str
    response_id: str | None = None


@dataclass(frozen=True)
class Synced:
    session_id: str
    seq: int


@dataclass(frozen=True)
class Pong:
    nonce: int
    stats: dict[str, Any] = field(default_factory=dict)  # running, waiting, kv_free, kv_total, ...


MESSAGE_TYPES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        OpenSession, UpdateSession, AppendUserAudio, ClearUserAudio, CommitUserAudio, ConfirmUserAudio, AddUserText,
        CreateResponse, CancelResponse, WithdrawResponse, TruncateResponse, DeleteItem, SetTruncation, CloseSession,
        Ping, Sync, SessionReady, UserAudioProgress, ResponseStarted, TextDelta, AudioChunk, ResponseDone,
        TranscriptionDelta, TranscriptionDone, ItemsDropped, Synced, Error, Pong,
    )
}


class MessageError(ValueError):
    pass


def encode(msg: Any) -> bytes:
    d = dataclasses.asdict(msg)
    d["type"] = type(msg).__name__
    return msgpack.packb(d, use_bin_type=True)


def decode(data: bytes) -> Any:
    try:
        d = msgpack.unpackb(data, raw=False)
        cls = MESSAGE_TYPES[d.pop("type")]
    except Exception as e:  # noqa: BLE001 - any malformed frame is one error kind
        raise MessageError(f"malformed engine message: {e}") from None
    if cls in (CreateResponse, OpenSession, UpdateSession) and isinstance(d.get("sampling"), dict):
        d["sampling"] = Sampling(**d["sampling"])
    try:
        return cls(**d)
    except TypeError as e:
        raise MessageError(f"bad fields for {cls.__name__}: {e}") from None
