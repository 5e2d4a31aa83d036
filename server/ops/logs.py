"""Structured logs: one line per record as key=value (default) or JSON, with the session id on every line.

Session code logs through `logging.LoggerAdapter(log, {"session_id": sid})`; other lines get
`session_id=-`.
"""

from __future__ import annotations

import json
import logging
import time


def _kv_value(v: object) -> str:
    s = str(v)
    return json.dumps(s) if (not s or any(c in s for c in ' "=\n')) else s


class _Formatter(logging.Formatter):
    def __init__(self, fmt: str, worker: int | None = None) -> None:
        super().__init__()
        self.fmt = fmt
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        fields = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            **({"worker": self.worker} if self.worker is not None else {}),
            "session_id": getattr(record, "session_id", "-"),
            "msg": record.getMessage(),
        }
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        if self.fmt == "json":
            return json.dumps(fields)
        return " ".join(f"{k}={_kv_value(v)}" for k, v in fields.items())


def setup_logging(level: str = "info", fmt: str = "kv", worker: int | None = None) -> None:
    """`worker`: under --workers, the worker's index, on every line (the supervisor's lines have none)."""
    handler = logging.StreamHandler()
    handler.setFormatter(_Formatter(fmt, worker))
    for name in ("server", "uvicorn", "uvicorn.error", "uvicorn.access"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level.upper())
        lg.propagate = False
