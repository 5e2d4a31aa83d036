"""The Ray Serve deployment's options: how many engine and front end replicas, and their resources.

Given as `args` of the application in a Serve config file (docker/ray-serve.yaml, the KubeRay manifest's
serveConfigV2) or built from `moss-speech serve --ray` flags. `settings` are the server's settings
(server/settings.py field names: model, codec, device, engine options...), the same for every replica.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


class RayOptionsError(ValueError):
    pass


@dataclass(frozen=True)
class RayOptions:
    engines: int = 1  # engine replicas at start, and the fewest autoscaling keeps
    max_engines: int | None = None  # the most autoscaling starts (None: `engines`, no autoscaling)
    frontends: int = 1  # front end replicas (each one server process: ~100 real-time sessions)
    engine_gpus: float = 1.0  # GPUs per engine replica; 0 runs engines on the CPU (tests, trials)
    engine_cpus: float = 1.0
    frontend_cpus: float = 1.0
    # A front end's WebSockets and HTTP requests at once (Ray Serve's max_ongoing_requests); a WebSocket is one for
    # the session's life.
    sessions_per_frontend: int = 200
    engine_drain_s: float = 300.0  # an engine replica being scaled down waits this long for its sessions to end
    health_check_period_s: float = 2.0
    settings: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        checks = [
            (self.engines >= 1, f"engines must be >= 1, got {self.engines}"),
            (self.max_engines is None or self.max_engines >= self.engines,
             f"max_engines ({self.max_engines}) must be >= engines ({self.engines})"),
            (self.frontends >= 1, f"frontends must be >= 1, got {self.frontends}"),
            (self.engine_gpus >= 0 and self.engine_cpus >= 0 and self.frontend_cpus >= 0,
             "engine_gpus, engine_cpus and frontend_cpus must be >= 0"),
            (self.sessions_per_frontend >= 1, f"sessions_per_frontend must be >= 1, got {self.sessions_per_frontend}"),
            (self.engine_drain_s >= 0, f"engine_drain_s must be >= 0, got {self.engine_drain_s}"),
            (self.health_check_period_s > 0, f"health_check_period_s must be > 0, got {self.health_check_period_s}"),
            (isinstance(self.settings, dict), "settings must be a mapping of server settings"),
        ]
        bad = [why for ok, why in checks if not ok]
        if bad:
            raise RayOptionsError("Ray Serve options: " + "; ".join(bad))

    @classmethod
    def from_args(cls, args: dict[str, Any]) -> RayOptions:
        """From a Serve config's `args`; an unknown key is refused by name."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise RayOptionsError(f"Ray Serve options: unknown {unknown}; known: {sorted(known)}")
        return cls(**args)

    @property
    def autoscaling(self) -> bool:
        return self.max_engines is not None and self.max_engines > self.engines
