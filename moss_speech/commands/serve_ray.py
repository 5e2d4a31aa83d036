"""`moss-speech serve --ray ADDRESS`: the server as a Ray Serve application on a running Ray cluster.

Ray Serve's ingress (HAProxy, server/cluster/deploy.py) listens on --host/--port of every node that runs one;
engines are GPU replicas, the realtime front end CPU replicas (server/cluster/). The cluster is started first:
`ray start --head` on one host and `ray start --address=HEAD:6379` on the others (docs/operations.md, "Scaling
out").
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from server.settings import Settings

FLAGS = ("ray", "ray_engines", "ray_max_engines", "ray_frontends", "ray_engine_gpus")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Ray Serve (several hosts)")
    g.add_argument("--ray", metavar="ADDRESS",
                   help="run on the Ray cluster at ADDRESS (HEAD:6379, ray://HEAD:10001 or auto) as a Ray Serve "
                        "application: engines as GPU replicas, the front end as CPU replicas behind Ray Serve's "
                        "HAProxy ingress")
    g.add_argument("--ray-engines", type=int, help="engine replicas at start and the fewest kept (default 1)")
    g.add_argument("--ray-max-engines", type=int,
                   help="autoscale engine replicas on sessions per engine up to this many (default: no autoscaling)")
    g.add_argument("--ray-frontends", type=int, help="front end replicas (default 1; ~100 sessions each)")
    g.add_argument("--ray-engine-gpus", type=float, help="GPUs per engine replica (default 1; 0: engines on the CPU)")


def unreachable(address: str, timeout_s: float = 3.0) -> str | None:
    """Why the cluster at `address` cannot be reached (a TCP connect to its port), or None. `auto` is left to Ray."""
    if address == "auto":
        return None
    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.hostname is None or port is None:
        return "the address is not HOST:PORT, ray://HOST:PORT or auto"
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run(settings: Settings, ray_args: dict[str, Any]) -> int:
    address = ray_args["ray"]
    if settings.gpus is not None or settings.workers > 1:
        print("moss-speech serve: --ray places sessions on Ray's engine replicas: leave out --gpus and --workers",
              file=sys.stderr)
        return 2
    if loopback(settings.host):
        # (the server's own default: right for one machine, not for a cluster's ingress)
        print(f"moss-speech serve: --host {settings.host}: the ingress and the front ends listen on loopback only: "
              "neither clients on other machines nor HAProxy on the cluster's other nodes reach them (--host 0.0.0.0 "
              "for a cluster of several hosts)", file=sys.stderr)
    try:
        import ray  # optional: the `ray` extra
        from ray import serve

        from server.cluster.deploy import APP_NAME, application, ingress_env, start
        from server.cluster.options import RayOptions, RayOptionsError
    except ImportError as e:
        print(f"moss-speech serve: --ray needs Ray Serve: pip install 'moss-speech-server[ray]' ({e})",
              file=sys.stderr)
        return 2
    try:
        opts = RayOptions(
            **{k: v for k, v in (("engines", ray_args["ray_engines"]), ("max_engines", ray_args["ray_max_engines"]),
                                 ("frontends", ray_args["ray_frontends"]),
                                 ("engine_gpus", ray_args["ray_engine_gpus"])) if v is not None},
            settings=settings.model_dump(mode="json", exclude_defaults=True))
    except RayOptionsError as e:
        print(f"moss-speech serve: {e}", file=sys.stderr)
        return 2
    if (why := unreachable(address)) is not None:
        print(f"moss-speech serve: cannot reach the Ray cluster at {address}: {why}", file=sys.stderr)
        return 2
    try:
        ray.init(address=address, log_to_driver=False, runtime_env={"env_vars": ingress_env()})
    except (ConnectionError, RuntimeError, TimeoutError) as e:
        # Ray turns token authentication on for a cluster whose head found a token (~/.ray/auth_token); a client
        # that names the address uses it only when told to.
        hint = "" if os.environ.get("RAY_AUTH_MODE") else (
            "; if the cluster uses token authentication, set RAY_AUTH_MODE=token (and RAY_AUTH_TOKEN, or the head's "
            "~/.ray/auth_token on this host)")
        print(f"moss-speech serve: cannot join the Ray cluster at {address}: {e}{hint}", file=sys.stderr)
        return 2
    start(settings.host, settings.port)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        serve.run(application(opts), name=APP_NAME, route_prefix="/", blocking=True)
    except KeyboardInterrupt:
        pass
    finally:  # the application lives as long as this command: its front ends drain, its engines stop
        serve.delete(APP_NAME)
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
