"""The WebSocket transport: OpenAI Realtime events as JSON text frames on /v1/realtime."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

from moss_speech.loadtest.results import CONNECT_FAILED
from moss_speech.loadtest.user import SessionFailed, SimulatedUser, append_message


class WsUser(SimulatedUser):
    ws: ClientConnection | None = None
    _reader: asyncio.Task | None = None

    @staticmethod
    def prepare_frames(frames_b64: list[str], silence_b64: str) -> tuple[list[str], str]:
        return [append_message(f) for f in frames_b64], append_message(silence_b64)

    async def open(self) -> None:
        try:
            # Keepalive pings off: under load a late pong would close healthy sessions and count as server errors.
            self.ws = await connect(self.cfg.realtime_url, additional_headers=self.cfg.auth_headers,
                                    max_size=2**24, open_timeout=15, ping_interval=None, compression=None)
        except InvalidStatus as e:
            raise SessionFailed(CONNECT_FAILED, f"HTTP {e.response.status_code} on {self.cfg.realtime_url}") from e
        except InvalidHandshake as e:
            raise SessionFailed(CONNECT_FAILED, f"{type(e).__name__}: {e}") from e
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.ws is not None
        try:
            async for msg in self.ws:
                self.on_message(msg, self.loop.time())
            self.on_closed(f"server closed the connection (code {self.ws.close_code}, {self.ws.close_reason!r})")
        except ConnectionClosed as e:
            self.on_closed(f"connection lost: {e}")

    async def send_event(self, evt: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send(json.dumps(evt))

    async def send_mic_frame(self, msg: str) -> None:
        assert self.ws is not None
        await self.ws.send(msg)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self._reader is not None:
            self._reader.cancel()
