"""Ray Serve's autoscaling policy for the engine replicas: on sessions per engine.

Each engine replica reports the sessions open on its engine and the sessions it holds (server/limits.py, from its
stats); the deployment wants enough engines that they run at FILL of what they hold, within Ray's bounds
(min/max_replicas, and the GPUs the cluster has). Ray Serve's default policy counts requests through its handles,
which sessions do not make: their audio goes to the engine over ZeroMQ.
"""

from __future__ import annotations

import math
from typing import Any

# Engines are added before they are full: a new one takes ~1-2 minutes to load on a GPU, and sessions keep coming.
FILL = 0.75


def desired_engines(sessions: float, capacity: float, current: int) -> int:
    """Engines for `sessions` at FILL of `capacity` sessions each (`current` when capacity is not known yet)."""
    if capacity <= 0:
        return current
    return max(1, math.ceil(sessions / (capacity * FILL)))


def sessions_per_engine(ctx: Any) -> tuple[int, dict[str, Any]]:
    """The policy function (`policy_function: server.cluster.autoscale:sessions_per_engine`)."""
    metrics = ctx.aggregated_metrics or {}
    sessions = sum(metrics.get("sessions", {}).values())
    capacities = [c for c in metrics.get("capacity", {}).values() if c > 0]
    want = desired_engines(sessions, min(capacities) if capacities else 0, ctx.current_num_replicas)
    return min(max(want, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas), {}
