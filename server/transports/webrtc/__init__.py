"""WebRTC transport: aiortc peers that carry a realtime session's audio as Opus tracks.

`routes.install(app, ...)` adds `POST /v1/realtime/calls`, the call hang-up/lookup routes, `/v1/info`
and the static page at `/`. The peer code knows nothing of the model: it moves PCM between the
browser's tracks and a session, and forwards the session's JSON events on the `oai-events` data channel.
"""
