"""`moss-speech serve --workers N`: N server processes behind one port, one engine process.

One asyncio loop is one core, full at ~100 real-time WebSocket sessions on a small CPU (docs/operations.md,
"Workers"); more sessions per GPU need more server processes. The supervisor (supervisor.py)
binds the port, runs the engine and starts the workers (worker.py); the kernel hands each new
connection to one of them. What must be shared is: the session limit (server/workers/slots.py), the metrics
(PROMETHEUS_MULTIPROC_DIR), and a WebRTC call's requests and control socket, which must reach the
worker that holds the call's peer connection (server/transports/relay.py, by the worker index in the call id).
"""
