"""Structured logs: one line per record as key=value (default) or JSON, with the session id on every line.

Session code logs through `logging.LoggerAdapter(log, {"session_id": sid})`; other lines get
`session_id=-`.

Every line is redacted before it is written (uvicorn's access lines included: they carry the query string): the
value of an `api_key` or `client_secret` query parameter, an `Authorization` header's credentials, the key in an
`openai-insecure-api-key.KEY` subprotocol, client secrets (`ek_...`), and the configured API keys and TURN secret
wherever they appear, each become `[redacted]`.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable

from server.auth import CLIENT_SECRET_PREFIX, KEY_SUBPROTOCOL_PREFIX

REDACTED = "[redacted]"
# Shorter configured secrets are not replaced as literals (they would blank ordinary words); the patterns still
# catch them where a client sends them.
MIN_LITERAL_SECRET = 6
_PATTERNS = [
    re.compile(r"(?i)([?&](?:api_key|client_secret|key|token)=)[^&\s\"'#]+"),
    re.compile(r"(?i)((?:authorization|proxy-authorization)[\"']?\s*[:=,]\s*[\"']?\s*(?:bearer|basic)?\s*)[^\s\"',]+"),
    re.compile(r"(?i)(\bbearer\s+)[^\s\"',]+"),
    re.compile("(" + re.escape(KEY_SUBPROTOCOL_PREFIX) + r")[^\s\"',]+"),
    re.compile(r"()\b" + re.escape(CLIENT_SECRET_PREFIX) + r"[A-Za-z0-9_\-]+"),
]


class Redactor:
    def __init__(self, secrets: Iterable[str] = ()) -> None:
        literals = sorted({s for s in secrets if len(s) >= MIN_LITERAL_SECRET}, key=len, reverse=True)
        self._literal = re.compile("|".join(map(re.escape, literals))) if literals else None

    def __call__(self, text: str) -> str:
        for p in _PATTERNS:
            text = p.sub(lambda m: m.group(1) + REDACTED, text)
        if self._literal is not None:
            text = self._literal.sub(REDACTED, text)
        return text


def _kv_value(v: object) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


class _Formatter(logging.Formatter):
    def __init__(self, fmt: str, worker: int | None = None, redact: Redactor | None = None) -> None:
        super().__init__()
        self.fmt = fmt
        self.worker = worker
        self.redact = redact or Redactor()

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            **({"worker": self.worker} if self.worker is not None else {}),
            "session_id": getattr(record, "session_id", "-"),
            "msg": self.redact(record.getMessage()),
        }
        if record.exc_info:
            fields["exc"] = self.redact(self.formatException(record.exc_info))
        if self.fmt == "json":
            return json.dumps(fields)
        return " ".join(f"{k}={_kv_value(v)}" for k, v in fields.items())


def setup_logging(level: str = "info", fmt: str = "kv", worker: int | None = None,
                  secrets: Iterable[str] = ()) -> None:
    """`worker`: under --workers, the worker's index, on every line (the supervisor's lines have none). `secrets`:
    literals to redact wherever they appear (the API keys, the TURN secret)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Formatter(fmt, worker, Redactor(secrets)))
    for name in ("server", "uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
