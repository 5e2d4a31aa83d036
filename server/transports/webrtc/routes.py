"""HTTP side of WebRTC calls, `/v1/info`, and the web page.

  POST   /v1/realtime/calls                 body: SDP offer (application/sdp) -> 201, SDP answer,
                                            `Location: /v1/realtime/calls/{call_id}`
  GET    /v1/realtime/calls/{call_id}       the call's state (JSON)
  POST   /v1/realtime/calls/{call_id}/hangup  (also DELETE /v1/realtime/calls/{call_id}) -> 204
  POST   /v1/realtime/calls/{call_id}/voice   body: a WAV file -> sets the session's voice prompt
  GET    /v1/info                           {model, weights, random_weights, ice_servers, ...} for the page; with
                                            API keys set, `ice_servers` is empty unless the request carries a
                                            key or a client secret (TURN credentials are not for anyone)
  GET    /                                  the page (client_web/index.html); /web/* its files

Errors are JSON `{"error": {"type", "code", "message"}}`: 400 bad offer (the reason), 401 bad key,
403 origin not allowed, 404 unknown call, 413 offer too large, 415 not application/sdp, 503 call or session
limit reached / engine not ready (with Retry-After). The control WebSocket `/v1/realtime?call_id=ID`
(server/transports/ws.py) finds the call in `app.state.calls` and binds to it with `Call.bind`.
Under `--workers` (and `--ray`) a call lives in the worker (front end replica) that answered its offer; the others
relay its requests there (server/transports/relay.py), and `max_calls` is per process (a call's media costs its
process's CPU).
"""

from __future__ import annotations

import base64
import logging
from typing import Any

from aiortc import RTCPeerConnection, RTCSessionDescription
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from engines.protocol import errors
from server import auth, client_secrets
from server.session.client_events import parse_session_update
from server.session.client_json import ProtocolError
from server.session.manager import SessionManager, SessionRefused
from server.transports.webrtc.call import Call, CallRegistry, new_call_id
from server.transports.webrtc.config import WebRTCConfig
from server.transports.webrtc.sdp import MAX_SDP_BYTES, OfferError, check_offer

log = logging.getLogger("server.transports.webrtc")

RANDOM_MODEL = "tiny-random"


def _error(code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """A refusal: the code's HTTP status and type from engines.protocol.errors."""
    return JSONResponse({"error": {"type": errors.error_type(code), "code": code, "message": message}},
                        status_code=errors.http_status(code), headers=headers)


class WebRTCService:
    """Owns the call registry; the route functions below are thin wrappers around it."""

    def __init__(self, settings: Any, sessions: SessionManager, config: WebRTCConfig, relay: Any = None) -> None:
        self.settings = settings
        self.relay = relay  # server.transports.relay.CallRelay: calls held by sibling processes
        self.sessions = sessions
        self.config = config
        self.calls = CallRegistry(config.max_calls)

    def info(self, request: Request) -> dict[str, Any]:
        weights = getattr(self.settings, "model", RANDOM_MODEL)
        authorized = self.authorized(request)
        return {
            "model": getattr(self.settings, "model_name", "moss-speech"),
            "weights": weights,
            "random_weights": bool(getattr(self.settings, "random_weights", weights == RANDOM_MODEL)),
            "ice_servers": [s.to_json() for s in self.config.ice_servers_now()] if authorized else [],
            "max_calls": self.config.max_calls,
            "api_key_required": bool(getattr(self.settings, "api_keys", [])),
            "turn_detection": self.turn_detection(),
        }

    def turn_detection(self) -> list[str]:
        """The turn detection types this server serves (the page picks its default from them)."""
        vad = bool(getattr(self.settings, "vad", True))
        semantic = vad and bool(getattr(self.settings, "end_of_turn_model", True))
        return ["server_vad"] * vad + ["semantic_vad"] * semantic

    def authorized(self, request: Request) -> bool:
        return auth.request_authorized(getattr(self.settings, "api_keys", []), request.app.state, request.headers,
                                       request.query_params)

    def access_error(self, request: Request) -> JSONResponse | None:
        origin = request.headers.get("origin")
        if not auth.origin_ok(getattr(self.settings, "allowed_origins", []), origin):
            return _error(errors.ORIGIN_NOT_ALLOWED, f"Origin {origin!r} is not allowed")
        if not self.authorized(request):
            return _error(errors.INVALID_API_KEY, "missing or wrong API key (Authorization: Bearer KEY)")
        return None

    async def create_call(self, request: Request) -> Response:
        denied = self.access_error(request)
        if denied is not None:
            return denied
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/sdp":
            return _error(errors.UNSUPPORTED_MEDIA_TYPE,
                          f"send the SDP offer with Content-Type: application/sdp (got {ctype or 'none'!r})")
        body = await request.body()
        if len(body) > MAX_SDP_BYTES:
            return _error(errors.OFFER_TOO_LARGE, f"the SDP offer is {len(body)} bytes; the limit is {MAX_SDP_BYTES}")
        try:
            offer = check_offer(body)
        except OfferError as e:
            return _error(errors.INVALID_OFFER, str(e))
        if not self.calls.try_reserve():
            return _error(errors.SERVER_BUSY, f"the server is at its limit of {self.calls.max_calls} WebRTC calls; "
                          "retry later", headers={"Retry-After": "5"})
        carried = client_secrets.session_settings(getattr(self.settings, "api_keys", []),
                                                  auth.presented_key(request.headers, request.query_params))
        try:
            return await self._negotiate(offer, carried)
        finally:
            self.calls.release()

    async def _negotiate(self, offer: str, carried: dict[str, Any] | None = None) -> Response:
        """`carried`: the session settings of the client secret the call was made with (its first session.update)."""
        pc = RTCPeerConnection(self.config.rtc_configuration())
        try:
            session = self.sessions.create(audio_out="track")
        except SessionRefused as e:
            await pc.close()
            return _error(e.code, e.message, headers={"Retry-After": "5"})
        call_id = new_call_id(self.relay.call_id_prefix) if self.relay is not None else new_call_id()
        call = Call(call_id, pc, session, prebuffer_ms=self.config.prebuffer_ms,
                    ice_timeout_s=self.config.ice_timeout_s, on_closed=self._closed)
        try:
            await pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
            pc.addTrack(call.track)
            await pc.setLocalDescription(await pc.createAnswer())
        except Exception as e:  # aiortc reports unusable offers with assorted exception types
            log.info("call %s: offer refused: %s", call_id, e)
            await call.close(f"offer refused: {e}")
            return _error(errors.INVALID_OFFER, f"the offer cannot be answered: {type(e).__name__}: {e}")
        try:
            await session.start()
        except Exception as e:  # the engine went away between create() and start()
            log.warning("call %s: session start failed: %s", call_id, e)
            await call.close(f"session start failed: {e}")
            return _error(errors.ENGINE_UNAVAILABLE, f"could not open a session: {e}", headers={"Retry-After": "5"})
        if carried is not None:
            await session.handle_client_event({"type": "session.update", "session": carried})
        self.calls.add(call)
        call.start()
        log.info("call %s: answered (session %s)", call_id, session.id)
        return Response(pc.localDescription.sdp, status_code=201, media_type="application/sdp",
                        headers={"Location": f"/v1/realtime/calls/{call_id}"})

    def _closed(self, call: Call) -> None:
        self.calls.remove(call)

    async def _call_or_reply(self, request: Request, call_id: str) -> Call | Response:
        """The call; or the reply: a refusal (auth/origin, then unknown id -> 404), or the answer of the
        sibling process that holds the call."""
        denied = self.access_error(request)
        if denied is not None:
            return denied
        call = self.calls.get(call_id)
        if call is not None:
            return call
        owner = await self.relay.owner(call_id) if self.relay is not None else None
        if owner is not None:
            reply = await self.relay.http(request, owner)
            if reply is not None:
                return reply
        return _error(errors.CALL_NOT_FOUND, f"no active call with id {call_id!r}")

    async def call_state(self, request: Request, call_id: str) -> Response:
        call = await self._call_or_reply(request, call_id)
        if not isinstance(call, Call):
            return call
        t = call.track.stats
        return JSONResponse({
            "id": call.call_id, "session_id": call.session.id, "connection_state": call.pc.connectionState,
            "ice_connection_state": call.pc.iceConnectionState,
            "outbound": {"frames_sent": t.frames_sent, "audio_frames_sent": t.audio_frames_sent,
                         "underruns": t.underruns, "clock_resets": t.clock_resets},
        })

    async def hangup(self, request: Request, call_id: str) -> Response:
        call = await self._call_or_reply(request, call_id)
        if not isinstance(call, Call):
            return call
        await call.close("hung up by the client")
        return Response(status_code=204)

    async def set_voice(self, request: Request, call_id: str) -> Response:
        call = await self._call_or_reply(request, call_id)
        if not isinstance(call, Call):
            return call
        wav = await request.body()
        # Through HTTP rather than the data channel: a WAV is larger than an SCTP message may be (256 KiB).
        event = {"type": "session.update",
                 "session": {"moss": {"voice_prompt": {"wav": base64.b64encode(wav).decode("ascii")}}}}
        try:
            _, refused = parse_session_update(event["session"], call.session.config)
            if refused:
                raise refused[0]
        except ProtocolError as e:
            return _error(e.code, e.message)
        await call.session.handle_client_event(event)
        return Response(status_code=204)


def install(app: FastAPI, settings: Any, sessions: SessionManager) -> WebRTCService:
    """Add the WebRTC routes, `/v1/info` and the page to `app`; returns the service (also app.state.webrtc)."""
    svc = WebRTCService(settings, sessions, WebRTCConfig.from_settings(settings), getattr(app.state, "relay", None))
    for server in svc.config.ice_servers:
        if server.turn and server.static_credential:
            log.warning("TURN server %s has a static password, handed to every client allowed to read /v1/info; "
                        "MOSS_TURN_SECRET gives each client time-limited credentials instead", server.urls[0])
    app.state.webrtc = svc
    app.state.calls = svc.calls  # the control WebSocket's lookup of `?call_id=`
    app.add_api_route("/v1/realtime/calls", svc.create_call, methods=["POST"], status_code=201)
    app.add_api_route("/v1/realtime/calls/{call_id}", svc.call_state, methods=["GET"])
    app.add_api_route("/v1/realtime/calls/{call_id}", svc.hangup, methods=["DELETE"], status_code=204)
    app.add_api_route("/v1/realtime/calls/{call_id}/hangup", svc.hangup, methods=["POST"], status_code=204)
    app.add_api_route("/v1/realtime/calls/{call_id}/voice", svc.set_voice, methods=["POST"], status_code=204)
    if not any(getattr(r, "path", None) == "/v1/info" for r in app.router.routes):
        app.add_api_route("/v1/info", svc.info, methods=["GET"])
    web_root = svc.config.web_root
    index = web_root / "index.html"

    async def page() -> Response:
        if not index.is_file():
            return _error(errors.PAGE_NOT_FOUND, f"the web page is not installed ({index} is missing)")
        return FileResponse(index, media_type="text/html")

    app.add_api_route("/", page, methods=["GET"], include_in_schema=False)
    if web_root.is_dir():
        app.mount("/web", StaticFiles(directory=web_root), name="web")
    return svc
