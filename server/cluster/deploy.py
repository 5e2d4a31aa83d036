"""The Ray Serve application: `build(args)` for `serve run` and the KubeRay RayService, `deploy` for
`moss-speech serve --ray ADDRESS`.

Three deployments: EngineDirectory (one small replica: where the engines and the front ends' relay ports are),
Engine (one GPU each, autoscaled on sessions per engine when max_engines > engines) and Frontend (the ingress: CPU
replicas behind Ray Serve's HTTP proxy, which carries the WebSockets and the WebRTC signalling).
"""

from __future__ import annotations

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
        ray_actor_options={"num_gpus": opts.engine_gpus, "num_cpus": opts.engine_cpus},
        health_check_period_s=opts.health_check_period_s, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=opts.engine_drain_s + 30.0,
    ).bind(directory, opts.settings, opts.engine_drain_s)
    frontend = serve.deployment(
        IngressFrontend, name="Frontend", num_replicas=opts.frontends,
        max_ongoing_requests=opts.sessions_per_frontend, ray_actor_options={"num_cpus": opts.frontend_cpus},
        graceful_shutdown_timeout_s=FRONTEND_SHUTDOWN_S,
    ).bind(directory, engine, opts.settings, opts.frontends)
    return frontend


def build(args: dict[str, Any]) -> Application:
    """`import_path: server.cluster.deploy:build` in a Serve config; its `args` are RayOptions."""
    return application(RayOptions.from_args(dict(args)))
