# syntax=docker/dockerfile:1
# The MOSS-Speech realtime server on one NVIDIA GPU.
#   docker build -t moss-speech .
#   docker run --gpus all --network host -v /srv/weights/MOSS-Speech:/models/moss-speech:ro \
#              -v /srv/weights/MOSS-Speech-Codec:/models/codec:ro moss-speech
# Or docker/compose.yaml (server + TURN, optional TLS proxy and Prometheus). README "Deploy" has the details.
#
# torch: pyproject pins torch==2.13.0. Its PyPI wheel for Linux x86_64 is a CUDA 13 build that brings its CUDA
# libraries as nvidia-*-cu13 wheels, so it is installed first, at exactly the pin, and every later pip command
# runs with a constraints file holding that pin: pip can neither upgrade nor swap torch (nor add torchaudio).
# The CUDA 13 base image gives the NVIDIA container runtime what it needs; the host driver must support
# CUDA 13 (driver >= 580).
FROM nvidia/cuda:13.0.2-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/etc/moss-speech/constraints.txt \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Ubuntu 24.04's Python is 3.12 (the project needs >= 3.11). Unpinned apt packages: the base image tag pins
# the distribution release, and security updates should come in with a rebuild.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv \
 && mkdir -p /etc/moss-speech \
 && echo "torch==2.13.0" > /etc/moss-speech/constraints.txt

RUN pip install torch==2.13.0

WORKDIR /app
COPY pyproject.toml ./
COPY moss_speech ./moss_speech
COPY engines ./engines
COPY server ./server
COPY client_web ./client_web
# The speech sample `moss-speech loadtest` uses when given no --audio.
COPY tests/data/speech_en_16k.wav ./tests/data/speech_en_16k.wav

# Editable install: `moss-speech loadtest` finds its default speech sample (tests/data/) beside the packages, as
# in a checkout. With Ray Serve: the same image runs under KubeRay (docker/kuberay-rayservice.yaml). (The web page is package data: an ordinary install serves it too.)
# bigvgan without its training extras, as the Makefile does (we only use its generator class).
# hadolint ignore=DL3013
RUN pip install -e '.[ray]' \
 && pip install --no-deps bigvgan==2.4.1 \
 && python -c "import torch; v = torch.__version__; assert v.split('+')[0] == '2.13.0', v"

RUN groupadd --gid 10001 moss \
 && useradd --create-home --uid 10001 --gid 10001 --shell /usr/sbin/nologin moss \
 && mkdir -p /models/moss-speech /models/codec \
 && chown moss:moss /models/moss-speech /models/codec
USER 10001:10001

# Every setting is a MOSS_* variable (server/settings.py); these are the container's defaults.
ENV MOSS_MODEL=/models/moss-speech \
    MOSS_CODEC=/models/codec \
    MOSS_DEVICE=cuda \
    MOSS_HOST=0.0.0.0 \
    MOSS_PORT=8000 \
    MOSS_LOG_FORMAT=json

VOLUME ["/models/moss-speech", "/models/codec"]
# HTTP and the /v1/realtime WebSocket. WebRTC media uses UDP ports the OS picks (aiortc has no port range):
# run with host networking, or relay media through TURN (docker/compose.yaml does both).
EXPOSE 8000

# Loading ~17 GiB of weights and capturing CUDA graphs takes minutes: a long start period.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('MOSS_PORT', '8000'), timeout=4)"]

# SIGTERM (docker stop) drains: live answers finish (up to MOSS_DRAIN_TIMEOUT_S), new sessions are refused.
STOPSIGNAL SIGTERM
ENTRYPOINT ["moss-speech", "serve"]
