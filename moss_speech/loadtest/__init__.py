"""Load test and capacity benchmark: simulated users speaking and listening at real time.

`moss-speech loadtest` (run.py) drives N users against a running server; `moss-speech bench capacity`
(capacity.py) raises N until p95 TTFA or underruns break. Nothing here imports torch or the engine:
the tool runs from any machine that can reach the server.
"""
