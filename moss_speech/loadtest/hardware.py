"""What the server says about its hardware (GET /health, /v1/info); "unknown" when it says nothing. And its
speculative answers' counters (GET /metrics), which no client event shows."""

from __future__ import annotations

from typing import Any

import httpx

from moss_speech.loadtest.config import LoadConfig

GPU_KEYS = ("gpu_name", "gpu", "device_name", "cuda_device", "device")


def _find_gpu(obj: Any) -> str | None:
    """First GPU-ish string in a JSON document (servers nest it differently: engine.gpu, devices[0].name...)."""
    if isinstance(obj, dict):
        for k in GPU_KEYS:
            v = obj.get(k)
            if isinstance(v, str) and v and v.lower() not in ("cuda", "cpu"):
                return v
            if isinstance(v, dict) and isinstance(v.get("name"), str):
                return v["name"]
        for v in obj.values():
            found = _find_gpu(v)
            if found:
                return found
    elif isinstance(obj, list):
        for v in obj:
            found = _find_gpu(v)
            if found:
                return found
    return None


def probe(cfg: LoadConfig, timeout_s: float = 10.0) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": "unknown", "source": None}
    with httpx.Client(timeout=timeout_s, headers=cfg.auth_headers) as client:
        for path in ("/health", "/v1/info"):
            try:
                r = client.get(cfg.http_url(path))
            except httpx.HTTPError as e:
                out[path] = f"unreachable: {type(e).__name__}: {e}"
                continue
            try:
                doc = r.json()
            except ValueError:
                doc = r.text[:500]
            out[path] = {"status": r.status_code, "body": doc}
            gpu = _find_gpu(doc)
            if gpu and out["source"] is None:
                out["gpu"], out["source"] = gpu, path
    return out


# /metrics counters the report takes the difference of, over a run (server/ops/metrics.py)
SERVER_COUNTERS = {'moss_speculative_answers_total{outcome="withdrawn"}': "withdrawn",
                   'moss_speculative_answers_total{outcome="confirmed"}': "confirmed",
                   "moss_withdrawn_rows_total": "withdrawn_rows"}


def server_counters(cfg: LoadConfig, timeout_s: float = 10.0) -> dict[str, float] | None:
    """The server's speculation counters now; None if it does not serve /metrics (or they cannot be read)."""
    try:
        with httpx.Client(timeout=timeout_s, headers=cfg.auth_headers) as client:
            r = client.get(cfg.http_url("/metrics"))
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    out = dict.fromkeys(SERVER_COUNTERS.values(), 0.0)
    for line in r.text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in SERVER_COUNTERS:
            try:
                out[SERVER_COUNTERS[name]] = float(value)
            except ValueError:
                return None
    return out
