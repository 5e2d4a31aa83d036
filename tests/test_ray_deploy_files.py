"""The Ray Serve config (docker/ray-serve.yaml) and the KubeRay RayService manifest (docker/kuberay-rayservice.yaml)
agree with Ray Serve's config schema, KubeRay's CRD (tests/data/kuberay/, its facts) and the project: the
application they import, its options, the pinned Ray version, GPUs for the engines. (Kubernetes cannot run here.)"""

from __future__ import annotations

import copy
import importlib
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from server.cluster.options import RayOptions

REPO = Path(__file__).resolve().parents[1]
MANIFEST = REPO / "docker" / "kuberay-rayservice.yaml"
SERVE_CONFIG = REPO / "docker" / "ray-serve.yaml"
SCHEMA = json.loads((REPO / "tests" / "data" / "kuberay" / "rayservice.schema.json").read_text())


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def pinned_ray() -> str:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (pin,) = [d for d in extras["ray"] if d.startswith("ray[")]
    assert pin in extras["dev"], "make test installs the same Ray"
    return re.fullmatch(r"ray\[serve\]==([\d.]+)", pin).group(1)


def test_manifest_is_a_valid_rayservice():
    jsonschema.Draft202012Validator(SCHEMA).validate(manifest())


def test_every_host_of_the_cluster_turns_on_the_haproxy_ingress():
    """The Serve controller and the front end replicas must agree on the ingress: the variable is set on every
    host, to 1, as `moss-speech serve --ray` sets it for its own application; so is Ray's worker niceness, to 0
    (HAProxy is started by Ray's proxy actors, outside the application's deployments)."""
    spec = manifest()["spec"]["rayClusterConfig"]
    pods = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    containers = [c for pod in pods for c in pod["spec"]["containers"]]
    assert len(containers) == 2
    for c in containers:
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        assert env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1", c["name"]
        assert env.get("RAY_worker_niceness") == "0", c["name"]
    assert "export RAY_SERVE_ENABLE_HA_PROXY=1" in SERVE_CONFIG.read_text()
    assert "export RAY_worker_niceness=0" in SERVE_CONFIG.read_text()


@pytest.mark.parametrize("path, value", [
    (("spec", "rayClusterConfig", "workerGroupSpecs", 0, "maxReplicas"), "8"),  # int32, not a string
    (("spec", "rayClusterConfig", "headGroupSpec", "rayStartParams", "num-gpus"), 0),  # strings only
    (("spec", "rayClusterConfig", "workerGroupSpec"), []),  # no such field
])
def test_schema_refuses_what_kuberay_refuses(path, value):
    bad = copy.deepcopy(manifest())
    node = bad
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCHEMA).validate(bad)


@pytest.mark.parametrize("config", ["manifest", "serve_config"])
def test_serve_configs_build_this_projects_application(config):
    raw = yaml.safe_load(manifest()["spec"]["serveConfigV2"]) if config == "manifest" else \
        yaml.safe_load(SERVE_CONFIG.read_text())
    serve_config = ServeDeploySchema.model_validate(raw)
    (app,) = serve_config.applications
    module, _, attr = app.import_path.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    opts = RayOptions.from_args(app.args)
    assert opts.engine_gpus == 1 and opts.autoscaling and opts.settings["device"] == "cuda"
    assert serve_config.http_options.port == 8000


def test_manifest_matches_the_ray_pin_and_gives_each_engine_a_gpu():
    spec = manifest()["spec"]
    assert spec["rayClusterConfig"]["rayVersion"] == pinned_ray()
    opts = RayOptions.from_args(yaml.safe_load(spec["serveConfigV2"])["applications"][0]["args"])
    (gpu,) = spec["rayClusterConfig"]["workerGroupSpecs"]
    assert gpu["maxReplicas"] * opts.engine_gpus >= opts.max_engines
    (worker,) = gpu["template"]["spec"]["containers"]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpu["rayStartParams"]["num-gpus"] == "1"
    assert spec["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"  # no engine on the head
