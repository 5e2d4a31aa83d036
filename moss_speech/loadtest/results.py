"""Per-turn records and the collector every simulated user reports into."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from moss_speech.loadtest.stats import PlaybackBuffer, percentile

TurnStatus = Literal["ok", "error", "timeout", "cut"]

# Client-side error codes (server codes come from `error.code` of the server's `error` events).
CONNECT_FAILED = "connect_failed"
CONNECTION_CLOSED = "connection_closed"
TURN_TIMEOUT = "turn_timeout"
TRANSCRIPTION_FAILED = "transcription_failed"
NO_TRANSCRIPT = "no_transcript"
NO_AUDIO = "no_audio"
BAD_EVENT = "bad_server_event"
CLIENT_BUG = "loadtest_client_error"


@dataclass
class TurnRecord:
    session: int
    turn: int
    status: TurnStatus = "cut"
    error_code: str | None = None
    start_s: float = 0.0  # since the run started
    speech_s: float = 0.0
    ttfa_ms: float | None = None  # speech end (VAD modes) or commit sent (commit) -> first audio delta received
    heard_ms: float | None = None  # speech end -> the listener starts playing the answer (after its prebuffer)
    false_starts: int = 0  # answers the client saw begin while the user was still speaking
    talked_over: bool = False  # answer audio arrived while the user was still speaking
    ttfa_commit_ms: float | None = None  # committed (commit sent, or input_audio_buffer.committed received) -> first
    server_ttfa_ms: float | None = None  # the server's own `response.ttfa_ms`
    vad_delay_ms: float | None = None  # speech end -> input_audio_buffer.committed received (VAD modes)
    transcript_ms: float | None = None  # committed -> the turn's input transcription completed (--transcription)
    response_status: str | None = None
    audio_s: float = 0.0
    deltas: int = 0
    gap_p95_ms: float | None = None
    gap_max_ms: float | None = None
    underruns: int = 0
    stall_ms: float = 0.0
    min_lead_ms: float | None = None
    rtf: float | None = None  # receive span / audio duration after the first chunk
    gaps_ms: list[float] = field(default_factory=list, repr=False)

    def absorb_playback(self, buf: PlaybackBuffer) -> None:
        self.audio_s = buf.audio_s
        self.underruns = buf.underruns
        self.stall_ms = buf.stall_s * 1000
        self.min_lead_ms = None if buf.min_lead_s is None else buf.min_lead_s * 1000
        self.gap_p95_ms = percentile(self.gaps_ms, 95)
        self.gap_max_ms = max(self.gaps_ms) if self.gaps_ms else None

    def to_dict(self, with_gaps: bool = True) -> dict[str, Any]:
        d = asdict(self)
        if not with_gaps:
            d.pop("gaps_ms")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TurnRecord:
        return cls(**d)


@dataclass
class Collector:
    """Shared by all users of one process; the parent of worker processes rebuilds one from their messages."""

    records: list[TurnRecord] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    error_samples: dict[str, str] = field(default_factory=dict)  # first message per code
    sessions_started: int = 0
    sessions_connected: int = 0
    sessions_ended: int = 0
    extra_responses: int = 0  # responses we did not ask for (e.g. VAD split one utterance)
    client_lag_ms: list[float] = field(default_factory=list)  # how late the microphone loop woke up

    def error(self, code: str, message: str = "") -> None:
        self.errors[code] += 1
        self.error_samples.setdefault(code, message[:300])

    def turn(self, rec: TurnRecord) -> None:
        self.records.append(rec)

    def merge(self, other: Collector) -> None:
        self.records += other.records
        self.errors.update(other.errors)
        for k, v in other.error_samples.items():
            self.error_samples.setdefault(k, v)
        self.sessions_started += other.sessions_started
        self.sessions_connected += other.sessions_connected
        self.sessions_ended += other.sessions_ended
        self.extra_responses += other.extra_responses
        self.client_lag_ms += other.client_lag_ms

    def to_dict(self) -> dict[str, Any]:
        return {
            "records": [r.to_dict() for r in self.records],
            "errors": dict(self.errors),
            "error_samples": dict(self.error_samples),
            "sessions_started": self.sessions_started,
            "sessions_connected": self.sessions_connected,
            "sessions_ended": self.sessions_ended,
            "extra_responses": self.extra_responses,
            "client_lag_ms": list(self.client_lag_ms),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Collector:
        return cls(records=[TurnRecord.from_dict(r) for r in d["records"]], errors=Counter(d["errors"]),
                   error_samples=dict(d["error_samples"]), sessions_started=d["sessions_started"],
                   sessions_connected=d["sessions_connected"], sessions_ended=d["sessions_ended"],
                   extra_responses=d["extra_responses"], client_lag_ms=list(d["client_lag_ms"]))
