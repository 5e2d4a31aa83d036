"""`/health` and `/metrics`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 when the engine answers pings and the server accepts sessions; 503 otherwise (with why)."""
    st = request.app.state
    engine = st.engines
    body = {
        "status": "ok",
        "engine_alive": bool(engine.ready),  # any engine takes sessions
        "model_loaded": bool(engine.ready),
        "model": st.settings.model,
        "codec": st.settings.codec,
        "random_weights": st.settings.random_weights,
        "sessions": st.sessions.in_use(),  # the whole server's, all workers'
        "max_sessions": st.sessions.slots.limit,
        "worker": st.worker.index if getattr(st, "worker", None) is not None else None,
        "draining": st.sessions.draining,
        "engine_restarts": engine.restarts,
        "engine": engine.stats(),  # summed over the engines
        "engines": engine.each(),
    }
    if not engine.ready or st.sessions.draining:
        body["status"] = "draining" if st.sessions.draining else "engine_unavailable"
        return JSONResponse(body, status_code=503)
    return JSONResponse(body)


def refresh_gauges(st: Any) -> None:
    """This process's gauges from its sessions (under --workers each worker's share; the scrape adds them)."""
    st.metrics.queue_depth.set(sum(len(s.outbound) for s in st.sessions.sessions.values()))
    st.metrics.engine_up.set(1 if st.engines.ready else 0)
    st.metrics.engines(st.engines.each())
    st.metrics.active_sessions.set(len(st.sessions))  # WebSocket and WebRTC sessions alike


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = request.app.state
    refresh_gauges(st)
    return Response(st.metrics.render(), media_type=CONTENT_TYPE_LATEST)
