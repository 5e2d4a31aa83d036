"""What one load test run does, validated at construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

Transport = Literal["ws", "webrtc"]
TurnDetection = Literal["server_vad", "semantic_vad", "commit"]
EAGERNESS = ("low", "medium", "high", "auto")


class LoadConfigError(ValueError):
    pass


@dataclass(frozen=True)
class LoadConfig:
    url: str  # server base: http(s)://host:port or ws(s)://host:port (a path, if any, is replaced)
    sessions: int = 1
    turns: int = 2
    duration_s: float = 60.0  # hard bound on the whole run; turns in flight then are counted as cut
    ramp_per_s: float = 0.0  # sessions started per second; 0 = all at once
    transport: Transport = "ws"
    turn_detection: TurnDetection = "server_vad"
    vad_silence_ms: int = 300  # silence_duration_ms asked of the server's VAD
    vad_threshold: float = 0.5
    eagerness: str = "auto"  # semantic_vad's
    transcription: bool = False  # ask for input transcription (audio.input.transcription) of every user turn
    pauses_ms: tuple[int, int] | None = None  # --pauses: silence inserted into the utterance (audio.insert_pauses)
    frame_ms: int = 20  # microphone frame (one input_audio_buffer.append)
    prebuffer_ms: float = 60.0  # the listener's jitter buffer before playback starts
    think_ms: float = 500.0  # pause after the answer finished playing, before the next turn
    turn_timeout_s: float = 30.0  # from speech end to response.done
    max_output_tokens: int | None = 125  # model rows (12.5 per second of audio); None = server default
    api_key: str | None = None
    workers: int = 1  # processes sharing the sessions (one asyncio loop each)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
            raise LoadConfigError(f"--url must look like http://host:port (or https://, ws://, wss://), "
                                  f"got {self.url!r}")
        checks = [
            (self.sessions >= 1, f"--sessions must be >= 1, got {self.sessions}"),
            (self.turns >= 1, f"--turns must be >= 1, got {self.turns}"),
            (self.duration_s > 0, f"--duration must be > 0 s, got {self.duration_s}"),
            (self.ramp_per_s >= 0, f"--ramp must be >= 0 sessions/s (0 = all at once), got {self.ramp_per_s}"),
            (self.transport in ("ws", "webrtc"), f"--transport must be ws or webrtc, got {self.transport!r}"),
            (self.turn_detection in ("server_vad", "semantic_vad", "commit"),
             f"--turn-detection must be server_vad, semantic_vad or commit, got {self.turn_detection!r}"),
            (self.eagerness in EAGERNESS, f"--eagerness must be one of {', '.join(EAGERNESS)}, got {self.eagerness!r}"),
            (self.pauses_ms is None or 0 < self.pauses_ms[0] <= self.pauses_ms[1] <= 5000,
             f"--pauses must be MIN-MAX ms with 0 < MIN <= MAX <= 5000, got {self.pauses_ms}"),
            (self.vad_silence_ms > 0, f"--vad-silence-ms must be > 0, got {self.vad_silence_ms}"),
            (0 < self.vad_threshold < 1, f"--vad-threshold must be in (0, 1), got {self.vad_threshold}"),
            (10 <= self.frame_ms <= 200 and self.frame_ms % 10 == 0,
             f"--frame-ms must be a multiple of 10 in [10, 200], got {self.frame_ms}"),
            (self.prebuffer_ms >= 0, f"--prebuffer-ms must be >= 0, got {self.prebuffer_ms}"),
            (self.think_ms >= 0, f"--think-ms must be >= 0, got {self.think_ms}"),
            (self.turn_timeout_s > 0, f"--turn-timeout must be > 0 s, got {self.turn_timeout_s}"),
            (self.max_output_tokens is None or self.max_output_tokens >= 1,
             f"--max-output-tokens must be >= 1, got {self.max_output_tokens}"),
            (self.workers >= 1, f"--workers must be >= 1, got {self.workers}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise LoadConfigError(msg)

    @property
    def vad(self) -> bool:
        """The server ends the turns (server_vad or semantic_vad): the users stream silence after speaking."""
        return self.turn_detection != "commit"

    def _base(self, ws: bool) -> tuple[str, str]:
        p = urlsplit(self.url)
        secure = p.scheme in ("https", "wss")
        scheme = ("wss" if secure else "ws") if ws else ("https" if secure else "http")
        return scheme, p.netloc

    def http_url(self, path: str) -> str:
        scheme, netloc = self._base(ws=False)
        return urlunsplit((scheme, netloc, path, "", ""))

    @property
    def realtime_url(self) -> str:
        scheme, netloc = self._base(ws=True)
        return urlunsplit((scheme, netloc, "/v1/realtime", "", ""))

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def public_dict(self) -> dict[str, Any]:
        """For the report: everything but the API key."""
        d = asdict(self)
        d["api_key"] = "***" if self.api_key else None
        return d
