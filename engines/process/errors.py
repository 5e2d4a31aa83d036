"""What the engine service tells a client when a message cannot be served: an `Error` with a code (engines/api.py)."""

from __future__ import annotations

from engines.api import EngineError
from engines.protocol import errors


class ServiceError(Exception):
    def __init__(self, code: str, message: str, response_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.response_id = response_id


def speech_error(e: Exception) -> ServiceError:
    """What a client is told of a speech encoder failure: the engine's own code where it has one (server_busy when
    every KV slot is taken and the pool cannot grow), else engine_error."""
    return ServiceError(e.code if isinstance(e, EngineError) else errors.ENGINE_ERROR,
                        f"speech encoder failed: {type(e).__name__}: {e}")
