"""The Ray Serve application: `build(args)` for `serve run` and the KubeRay RayService, `deploy` for
`moss-speech serve --ray ADDRESS`.

Three deployments: EngineDirectory (one small replica: where the engines and the front ends' relay ports are),
Engine (one GPU each, autoscaled on sessions per engine when max_engines > engines) and Frontend (the ingress: CPU
replicas behind Ray Serve's HTTP ingress, which carries the WebSockets and the WebRTC signalling).

The ingress is Ray Serve's HAProxy mode (`RAY_SERVE_ENABLE_HA_PROXY=1`): HAProxy on each node passes connections
to the front end replicas, each serving HTTP itself on a port of its node (30000-31000). Ray's default Python proxy
relays every WebSocket message through Ray calls, a second hop per audio frame: at 128 sessions on one H200 host it
took 1.5 cores in one process and made the front ends' CPU 2.6 times the direct server's, and p95 commit -> first
audio +83 ms over the direct path (docs/bench/gpu_ray_vs_direct.sh). The controller and the replicas must agree on
it: `moss-speech serve --ray` gives it to both (`ingress_env` in its job's environment, `start`); a cluster served
with `serve run` or KubeRay sets it in every host's environment. An operator's own RAY_SERVE_ENABLE_HA_PROXY is
kept. A front end replica runs the sessions on the loop its HTTP server runs on (`FRONTEND_ENV`).
"""

from __future__ import annotations

import os
from typing import Any

from ray import serve
from ray.serve import Application

from server.cluster.directory import EngineDirectory
from server.cluster.engine_replica import EngineReplica
from server.cluster.frontend import IngressFrontend
from server.cluster.options import RayOptions

APP_NAME = "moss-speech"
AUTOSCALE_POLICY = "server.cluster.autoscale:sessions_per_engine"
# A front end replica's graceful stop: its sessions' answers in progress finish (the server's drain).
FRONTEND_SHUTDOWN_S = 30.0
# A front end replica's sessions run on the event loop of its HTTP server (the ingress's end), not on Ray's default
# second loop in a thread of its own, which hands every WebSocket message between the two threads: the ingress's
# share of a turn (the client's commit -> first audio less the server's own) p95 +4.4 and +8.0 ms with the second
# loop, -0.5 and +0.5 ms without (tiny model, 2-core box, 16 sessions, two pairs, 2026-12-02).
# Ray starts its worker processes at niceness 15 (its `worker_niceness`), and the engine process inherits it from the
# engine replica: then any busy process at the default niceness (a client on the same host, Ray's own services) takes
# the core from the engine's loop, the front ends' sessions and HAProxy whenever they contend. Every process on the
# serving path runs at the default niceness instead.
SERVING_ENV = {"RAY_worker_niceness": "0"}
FRONTEND_ENV = {**SERVING_ENV, "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def ingress_env() -> dict[str, str]:
    """The environment the Serve controller, its proxies and the front end replicas need for the ingress (the
    replicas take it from their job's runtime_env: the driver's ray.init), HAProxy at the default niceness."""
    return {"RAY_SERVE_ENABLE_HA_PROXY": os.environ.get("RAY_SERVE_ENABLE_HA_PROXY", "1"), **SERVING_ENV}


def start(host: str, port: int) -> None:
    """Start Serve on the connected cluster (its controller and ingress), unless it runs there already."""
    serve.start(http_options={"host": host, "port": port},
                controller_options={"runtime_env": {"env_vars": ingress_env()}})


def application(opts: RayOptions) -> Application:
    directory = serve.deployment(EngineDirectory, name="EngineDirectory", num_replicas=1,
                                 ray_actor_options={"num_cpus": 0}).bind()
    scaling: dict[str, Any] = {"num_replicas": opts.engines}
    if opts.autoscaling:
        scaling = {"num_replicas": "auto", "autoscaling_config": {
            "min_replicas": opts.engines, "max_replicas": opts.max_engines, "initial_replicas": opts.engines,
            "policy": {"policy_function": AUTOSCALE_POLICY},
            # an engine takes a minute or two to load: add them soon, remove them late
            "upscale_delay_s": 10.0, "downscale_delay_s": 600.0}}
    engine = serve.deployment(
        EngineReplica, name="Engine", **scaling,
        ray_actor_options={"num_gpus": opts.engine_gpus, "num_cpus": opts.engine_cpus,
                           "runtime_env": {"env_vars": SERVING_ENV}},
        health_check_period_s=opts.health_check_period_s, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=opts.engine_drain_s + 30.0,
    ).bind(directory, opts.settings, opts.engine_drain_s)
    frontend = serve.deployment(
        IngressFrontend, name="Frontend", num_replicas=opts.frontends,
        max_ongoing_requests=opts.sessions_per_frontend,
        ray_actor_options={"num_cpus": opts.frontend_cpus, "runtime_env": {"env_vars": FRONTEND_ENV}},
        graceful_shutdown_timeout_s=FRONTEND_SHUTDOWN_S,
    ).bind(directory, engine, opts.settings, opts.frontends)
    return frontend


def build(args: dict[str, Any]) -> Application:
    """`import_path: server.cluster.deploy:build` in a Serve config; its `args` are RayOptions."""
    return application(RayOptions.from_args(dict(args)))
