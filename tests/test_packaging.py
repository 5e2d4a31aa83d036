"""An installed server (a wheel of the project, not a checkout) serves the web page from where it was installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engines", "server", "moss_speech", "client_web")

# Run away from the checkout, with only the unpacked wheel ahead of the environment's packages.
SERVE_THE_PAGE = """
import json, client_web, server
from starlette.testclient import TestClient
from server.app import create_app
from server.settings import Settings
from server.transports.webrtc.config import DEFAULT_WEB_ROOT

client = TestClient(create_app(Settings()))
page, script = client.get("/"), client.get("/web/app.js")
print(json.dumps({"root": str(DEFAULT_WEB_ROOT), "server": server.__file__, "page": page.status_code,
                  "html": page.text, "script": script.status_code}))
"""


@pytest.mark.timeout(300)
def test_an_installed_server_serves_the_page_from_its_package_data(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    src.mkdir()
    shutil.copy(ROOT / "pyproject.toml", src)
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, timeout=240)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    page_files = {f"client_web/{p.name}" for p in (ROOT / "client_web").iterdir() if p.is_file()}
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        assert page_files <= set(z.namelist()), sorted(page_files - set(z.namelist()))
        z.extractall(site)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOSS_")} | {"PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", SERVE_THE_PAGE], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["server"]).is_relative_to(site) and Path(got["root"]) == site / "client_web"
    assert got["page"] == 200 and got["html"] == (ROOT / "client_web" / "index.html").read_text()
    assert got["script"] == 200
