"""Validation of client-provided session and response settings (OpenAI Realtime GA shape + our extension).

Every unknown field is refused with its dotted name. Fields of the GA shape that this server does not
implement (tools, noise reduction...) are accepted only with their "off" values, so a
client that sends defaults works and a client that relies on a feature learns it is missing.
A session.update applies every field it can and reports each refused one (its own `error`, naming it); a
response.create is all or nothing (an answer with settings other than those asked for would mislead).

Extension `session.moss` (and `response.moss`):
  {"sampling": {temperature, top_p, top_k, repetition_penalty, min_output_tokens, seed, greedy},
   "voice_prompt": {"wav": "<base64 WAV file>"} | null}
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from engines.audio.voice_prompt import check_voice_prompt
from engines.audio.wav import AudioFormatError
from engines.protocol import errors
from engines.protocol.messages import Sampling, number_in
from server.audio.formats import PCM, AudioFormat, FormatError, parse_format
from server.audio.stretch import MAX_SPEED, MIN_SPEED
from server.session.client_json import ProtocolError

TurnType = Literal["server_vad", "semantic_vad"]
Eagerness = Literal["low", "medium", "high", "auto"]


@dataclass(frozen=True)
class TurnDetection:
    type: TurnType = "server_vad"
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500  # server_vad's silence; semantic_vad waits by eagerness (turn_detection.py)
    create_response: bool = True
    interrupt_response: bool = True
    eagerness: Eagerness = "auto"  # semantic_vad
    idle_timeout_ms: int | None = None  # server_vad only

    def __post_init__(self) -> None:
        if self.type not in get_args(TurnType):
            raise ValueError(f"turn detection type must be one of {get_args(TurnType)}, got {self.type!r}")
        if self.eagerness not in get_args(Eagerness):
            raise ValueError(f"eagerness must be one of {get_args(Eagerness)}, got {self.eagerness!r}")


MAX_OUTPUT_TOKENS_DEFAULT = Sampling().max_new_tokens
MAX_VOICE_PROMPT_BYTES = 4 << 20
MAX_TRACING_METADATA = 2048  # characters of JSON


@dataclass(frozen=True)
class SessionConfig:
    model: str = "moss-speech"
    instructions: str | None = None
    output_modalities: tuple[str, ...] = ("audio",)
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    voice: str | None = None
    max_output_tokens: int | str = "inf"
    sampling: Sampling = field(default_factory=Sampling)
    voice_prompt_wav: bytes | None = None
    max_answer_rows: int = MAX_OUTPUT_TOKENS_DEFAULT  # the server's: an answer's length under "inf"
    # GA `audio.input.transcription` (the model named is echoed; MOSS-Speech itself transcribes) and `truncation`
    transcription: dict[str, Any] | None = None
    truncation: str | dict[str, Any] = "auto"
    input_format: AudioFormat = PCM  # of input_audio_buffer.append and input_audio items
    output_format: AudioFormat = PCM  # of response.output_audio.delta (a WebRTC track is Opus either way)
    speed: float = 1.0  # answers played this many times as fast, at the same pitch (server/audio/stretch.py)
    tracing: str | dict[str, Any] | None = None  # GA `tracing`, named in the session's log

    def sampling_dict(self) -> dict[str, Any]:
        s = self.sampling
        return {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                "repetition_penalty": s.repetition_penalty, "min_output_tokens": s.min_new_tokens,
                "seed": s.seed, "greedy": s.greedy}


class Refused:
    """The fields of one update that could not be applied: `with refused:` runs a field's parse, and a ProtocolError
    in it is kept (the field is left as it was) instead of ending the update."""

    def __init__(self) -> None:
        self.errors: list[ProtocolError] = []

    def __enter__(self) -> Refused:
        return self

    def __exit__(self, etype: Any, exc: Any, tb: Any) -> bool:
        if isinstance(exc, ProtocolError):
            self.errors.append(exc)
            return True
        return False


def _obj(v: Any, param: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ProtocolError(errors.INVALID_VALUE, f"{param} must be an object", param)
    return v


def _keys(d: dict[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(d) - allowed)
    if unknown:
        names = ", ".join(f"{param}.{k}" for k in unknown)
        raise ProtocolError(errors.UNKNOWN_PARAMETER, f"unknown or unsupported field(s): {names}",
                            f"{param}.{unknown[0]}")


def _off(d: dict[str, Any], name: str, param: str, off_values: tuple[Any, ...]) -> None:
    if name in d and d[name] not in off_values:
        raise ProtocolError(errors.UNSUPPORTED_PARAMETER, f"{param}.{name} is not supported by this server "
                            f"(only {' or '.join(repr(v) for v in off_values)})", f"{param}.{name}")


def _num(v: Any, param: str, lo: float, hi: float, *, integer: bool = False) -> Any:
    if not number_in(v, lo, hi, integer=integer):
        kind = "an integer" if integer else "a number"
        raise ProtocolError(errors.INVALID_VALUE, f"{param} must be {kind} in [{lo:g}, {hi:g}], got {v!r}", param)
    return v


def _bool(v: Any, param: str) -> bool:
    if not isinstance(v, bool):
        raise ProtocolError(errors.INVALID_VALUE, f"{param} must be true or false, got {v!r}", param)
    return v


def _format(v: Any, param: str) -> AudioFormat:
    f = _obj(v, param)
    _keys(f, {"type", "rate"}, param)
    try:
        return parse_format(f)
    except FormatError as e:
        raise ProtocolError(errors.UNSUPPORTED_AUDIO_FORMAT, f"{param}.{e}", f"{param}.{e.param}") from None


def _eagerness(v: Any, param: str) -> str:
    if v not in get_args(Eagerness):
        raise ProtocolError(errors.INVALID_VALUE, f"{param} must be one of {', '.join(get_args(Eagerness))}, "
                            f"got {v!r}", param)
    return v


def _idle_timeout(v: Any, param: str) -> int | None:
    return None if v is None else _num(v, param, 5000, 30000, integer=True)


_TD_FIELDS: dict[str, Callable[[Any, str], Any]] = {
    "threshold": lambda v, p: float(_num(v, p, 0.0, 1.0)),
    "prefix_padding_ms": lambda v, p: _num(v, p, 0, 5000, integer=True),
    "silence_duration_ms": lambda v, p: _num(v, p, 32, 10000, integer=True),
    "create_response": _bool,
    "interrupt_response": _bool,
    "eagerness": _eagerness,
    "idle_timeout_ms": _idle_timeout,
}
_TD_KEYS = {"server_vad": {"type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                           "interrupt_response", "idle_timeout_ms"},
            "semantic_vad": {"type", "eagerness", "create_response", "interrupt_response"}}


def _turn_detection(v: Any, cur: TurnDetection | None, param: str, refused: Refused) -> TurnDetection | None:
    """Each field that parses applies; a field that does not is refused on its own (the others still apply)."""
    if v is None:
        return None
    td = _obj(v, param)
    kind = td.get("type")
    if not isinstance(kind, str) or kind not in _TD_KEYS:
        raise ProtocolError(errors.UNSUPPORTED_TURN_DETECTION, f"{param}.type {kind!r} is not supported (only "
                            "'server_vad', 'semantic_vad' or turn_detection null)", f"{param}.type")
    with refused:
        _keys(td, _TD_KEYS[kind], param)
    base = cur if cur is not None and cur.type == kind else TurnDetection(type=kind)
    out: dict[str, Any] = {}
    for name in _TD_KEYS[kind] - {"type"}:
        if name in td:
            with refused:
                out[name] = _TD_FIELDS[name](td[name], f"{param}.{name}")
    return dataclasses.replace(base, **out)


def _modalities(v: Any, param: str) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or any(x not in ("audio", "text") for x in v):
        raise ProtocolError(errors.INVALID_VALUE, f"{param} must be ['audio'] or ['text']", param)
    # MOSS-Speech answers in one modality; audio answers carry their text as the transcript.
    return ("audio",) if "audio" in v else ("text",)


def _max_tokens(v: Any, param: str) -> int | str:
    if v == "inf":
        return "inf"
    return _num(v, param, 1, 1 << 20, integer=True)


def _sampling(v: Any, cur: Sampling, param: str) -> Sampling:
    s = _obj(v, param)
    _keys(s, {"temperature", "top_p", "top_k", "repetition_penalty", "min_output_tokens", "seed", "greedy"}, param)
    out: dict[str, Any] = {}
    if "temperature" in s:
        out["temperature"] = float(_num(s["temperature"], f"{param}.temperature", 0.0, 10.0))
    if "top_p" in s:
        out["top_p"] = float(_num(s["top_p"], f"{param}.top_p", 1e-6, 1.0))
    if "top_k" in s:
        out["top_k"] = _num(s["top_k"], f"{param}.top_k", 0, 1 << 20, integer=True)
    if "repetition_penalty" in s:
        out["repetition_penalty"] = float(_num(s["repetition_penalty"], f"{param}.repetition_penalty", 1e-3, 10.0))
    if "min_output_tokens" in s:
        out["min_new_tokens"] = _num(s["min_output_tokens"], f"{param}.min_output_tokens", 0, 1 << 20, integer=True)
    if "seed" in s:
        out["seed"] = None if s["seed"] is None else _num(s["seed"], f"{param}.seed", 0, 2**63 - 1, integer=True)
    if "greedy" in s:
        out["greedy"] = _bool(s["greedy"], f"{param}.greedy")
    return dataclasses.replace(cur, **out)


def _voice_prompt(v: Any, param: str) -> bytes | None:
    if v is None:
        return None
    vp = _obj(v, param)
    _keys(vp, {"wav"}, param)
    try:
        raw = base64.b64decode(vp.get("wav") or "", validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise ProtocolError(errors.INVALID_AUDIO, f"{param}.wav is not valid base64", f"{param}.wav") from None
    if not raw.startswith(b"RIFF") or raw[8:12] != b"WAVE":
        raise ProtocolError(errors.INVALID_AUDIO, f"{param}.wav must be a WAV file", f"{param}.wav")
    if len(raw) > MAX_VOICE_PROMPT_BYTES:
        raise ProtocolError(errors.INVALID_AUDIO, f"{param}.wav is larger than {MAX_VOICE_PROMPT_BYTES} bytes",
                            f"{param}.wav")
    try:
        check_voice_prompt(raw)
    except AudioFormatError as e:
        raise ProtocolError(errors.INVALID_AUDIO, f"{param}.wav: {e}", f"{param}.wav") from None
    return raw


def _moss(v: Any, cfg: dict[str, Any], cur: SessionConfig, param: str, refused: Refused) -> None:
    mo = _obj(v, param)
    with refused:
        _keys(mo, {"sampling", "voice_prompt"}, param)
    if "sampling" in mo:
        with refused:
            cfg["sampling"] = _sampling(mo["sampling"], cur.sampling, f"{param}.sampling")
    if "voice_prompt" in mo:
        with refused:
            cfg["voice_prompt_wav"] = _voice_prompt(mo["voice_prompt"], f"{param}.voice_prompt")


def _audio_input(i: dict[str, Any], cfg: dict[str, Any], cur: SessionConfig, refused: Refused) -> None:
    param = "session.audio.input"
    with refused:
        _keys(i, {"format", "transcription", "noise_reduction", "turn_detection"}, param)
    if "format" in i:
        with refused:
            cfg["input_format"] = _format(i["format"], f"{param}.format")
    if "transcription" in i:
        with refused:
            cfg["transcription"] = _transcription(i["transcription"], f"{param}.transcription")
    with refused:
        _off(i, "noise_reduction", param, (None,))
    if "turn_detection" in i:
        with refused:
            cfg["turn_detection"] = _turn_detection(i["turn_detection"], cur.turn_detection,
                                                    f"{param}.turn_detection", refused)


def _audio_output(o: dict[str, Any], cfg: dict[str, Any], refused: Refused) -> None:
    param = "session.audio.output"
    with refused:
        _keys(o, {"format", "voice", "speed"}, param)
    if "format" in o:
        with refused:
            cfg["output_format"] = _format(o["format"], f"{param}.format")
    if "speed" in o:
        with refused:
            speed = o["speed"]
            cfg["speed"] = 1.0 if speed is None else float(_num(speed, f"{param}.speed", MIN_SPEED, MAX_SPEED))
    if "voice" in o:
        # No named voices: the name is echoed; a voice prompt (session.moss.voice_prompt) sets the voice.
        if o["voice"] is not None and not isinstance(o["voice"], str):
            refused.errors.append(ProtocolError(errors.UNSUPPORTED_PARAMETER, f"{param}.voice must be a name; use "
                                                "session.moss.voice_prompt for a custom voice", f"{param}.voice"))
        else:
            cfg["voice"] = o["voice"]


def parse_session_update(v: Any, cur: SessionConfig) -> tuple[SessionConfig, list[ProtocolError]]:
    """The session after an update, and the fields refused: every field that parses applies, each one that does
    not is reported (and left as it was). Raises ProtocolError only when nothing can apply (`session` is not an
    object, or not a realtime session). `session.model` may name any model: this server serves its own."""
    s = _obj(v, "session")
    if s.get("type", "realtime") != "realtime":
        raise ProtocolError(errors.UNSUPPORTED_SESSION_TYPE, "session.type must be 'realtime'", "session.type")
    refused = Refused()
    with refused:
        _keys(s, {"type", "object", "id", "model", "instructions", "output_modalities", "audio", "max_output_tokens",
                  "tools", "tool_choice", "tracing", "truncation", "prompt", "include", "expires_at", "moss"},
              "session")
    for name, off in (("tools", ([], None)), ("tool_choice", ("auto", "none", None)), ("prompt", (None,)),
                      ("include", (None, []))):
        with refused:
            _off(s, name, "session", off)
    cfg: dict[str, Any] = {}
    if "instructions" in s:
        if s["instructions"] is not None and not isinstance(s["instructions"], str):
            refused.errors.append(ProtocolError(errors.INVALID_VALUE, "session.instructions must be a string",
                                                "session.instructions"))
        else:
            cfg["instructions"] = s["instructions"] or None
    if "output_modalities" in s:
        with refused:
            cfg["output_modalities"] = _modalities(s["output_modalities"], "session.output_modalities")
    if "max_output_tokens" in s:
        with refused:
            cfg["max_output_tokens"] = _max_tokens(s["max_output_tokens"], "session.max_output_tokens")
    if "audio" in s:
        with refused:
            a = _obj(s["audio"], "session.audio")
            with refused:
                _keys(a, {"input", "output"}, "session.audio")
            if "input" in a:
                with refused:
                    _audio_input(_obj(a["input"], "session.audio.input"), cfg, cur, refused)
            if "output" in a:
                with refused:
                    _audio_output(_obj(a["output"], "session.audio.output"), cfg, refused)
    if "moss" in s:
        with refused:
            _moss(s["moss"], cfg, cur, "session.moss", refused)
    if "tracing" in s:
        with refused:
            cfg["tracing"] = _tracing(s["tracing"], cur.tracing)
    if s.get("truncation") is not None:
        with refused:
            cfg["truncation"] = _truncation(s["truncation"], "session.truncation")
    return dataclasses.replace(cur, **cfg), refused.errors


def _truncation(v: Any, param: str) -> str | dict[str, Any]:
    """GA `truncation`: "auto", "disabled" or {"type": "retention_ratio", "retention_ratio": x in (0, 1]}."""
    if v in ("auto", "disabled"):
        return v
    t = _obj(v, param)
    _keys(t, {"type", "retention_ratio", "token_limits"}, param)
    if t.get("type") != "retention_ratio":
        raise ProtocolError(errors.INVALID_VALUE, f"{param} must be 'auto', 'disabled' or a retention_ratio object",
                            f"{param}.type")
    _off(t, "token_limits", param, (None,))
    ratio = t.get("retention_ratio")
    if not number_in(ratio, 0.0, 1.0) or ratio == 0:
        raise ProtocolError(errors.INVALID_VALUE, f"{param}.retention_ratio must be a number in (0, 1]",
                            f"{param}.retention_ratio")
    return {"type": "retention_ratio", "retention_ratio": float(ratio)}


def _tracing(v: Any, cur: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """GA `tracing`: null, "auto" or {workflow_name, group_id, metadata}; as OpenAI's, fixed once set. There is no
    trace dashboard here: the session's log names them (client_handlers)."""
    param = "session.tracing"
    if v is not None and v != "auto":
        t = _obj(v, param)
        _keys(t, {"workflow_name", "group_id", "metadata"}, param)
        for k in ("workflow_name", "group_id"):
            if t.get(k) is not None and not (isinstance(t[k], str) and len(t[k]) <= 256):
                raise ProtocolError(errors.INVALID_VALUE, f"{param}.{k} must be a string of at most 256 characters",
                                    f"{param}.{k}")
        if t.get("metadata") is not None and not (isinstance(t["metadata"], dict)
                                                  and len(json.dumps(t["metadata"])) <= MAX_TRACING_METADATA):
            raise ProtocolError(errors.INVALID_VALUE, f"{param}.metadata must be an object of at most "
                                f"{MAX_TRACING_METADATA} characters of JSON", f"{param}.metadata")
    if cur is not None and v != cur:
        raise ProtocolError(errors.INVALID_VALUE, "session.tracing cannot be changed once set", param)
    return v


def _transcription(v: Any, param: str) -> dict[str, Any] | None:
    """GA `audio.input.transcription`: null, or {"model", "language", "prompt"}: any model name (MOSS-Speech itself
    transcribes), echoed back."""
    if v is None:
        return None
    t = _obj(v, param)
    _keys(t, {"model", "language", "prompt"}, param)
    for k in ("model", "language", "prompt"):
        if t.get(k) is not None and not isinstance(t[k], str):
            raise ProtocolError(errors.INVALID_VALUE, f"{param}.{k} must be a string", f"{param}.{k}")
    return {"model": t.get("model"), "language": t.get("language"), "prompt": t.get("prompt")}


def parse_response_create(v: Any, cur: SessionConfig) -> dict[str, Any]:
    """Options of one response: {modality, sampling (engine Sampling), max_output_tokens, metadata, format,
    instructions (this answer's own: None when they are the session's), out_of_band (`conversation: "none"`)}."""
    r = {} if v is None else _obj(v, "response")
    _keys(r, {"output_modalities", "max_output_tokens", "metadata", "conversation", "instructions", "audio",
              "tools", "tool_choice", "input", "prompt", "moss"}, "response")
    if r.get("conversation") not in ("auto", "none", None):
        raise ProtocolError(errors.INVALID_VALUE, "response.conversation must be 'auto' or 'none'",
                            "response.conversation")
    _off(r, "tools", "response", ([], None))
    _off(r, "tool_choice", "response", ("auto", "none", None))
    _off(r, "prompt", "response", (None,))
    _off(r, "input", "response", (None,))
    instructions = r.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ProtocolError(errors.INVALID_VALUE, "response.instructions must be a string", "response.instructions")
    out_format = cur.output_format
    if "audio" in r:
        a = _obj(r["audio"], "response.audio")
        _keys(a, {"output"}, "response.audio")
        o = _obj(a.get("output", {}), "response.audio.output")
        _keys(o, {"format", "voice"}, "response.audio.output")
        if "format" in o:
            out_format = _format(o["format"], "response.audio.output.format")
    metadata = r.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise ProtocolError(errors.INVALID_VALUE, "response.metadata must be an object", "response.metadata")
    modality = (_modalities(r["output_modalities"], "response.output_modalities") if "output_modalities" in r
                else cur.output_modalities)[0]
    max_tokens = _max_tokens(r["max_output_tokens"], "response.max_output_tokens") if "max_output_tokens" in r \
        else cur.max_output_tokens
    sampling = cur.sampling
    if "moss" in r:
        mo = _obj(r["moss"], "response.moss")
        _keys(mo, {"sampling"}, "response.moss")
        if "sampling" in mo:
            sampling = _sampling(mo["sampling"], sampling, "response.moss.sampling")
    sampling = dataclasses.replace(
        sampling, max_new_tokens=cur.max_answer_rows if max_tokens == "inf" else int(max_tokens))
    if sampling.min_new_tokens > sampling.max_new_tokens:
        raise ProtocolError(errors.INVALID_VALUE, "moss.sampling.min_output_tokens exceeds max_output_tokens",
                            "max_output_tokens")
    return {"modality": modality, "sampling": sampling, "max_output_tokens": max_tokens, "metadata": metadata,
            "format": out_format, "instructions": None if instructions in ("", cur.instructions) else instructions,
            "out_of_band": r.get("conversation") == "none"}
