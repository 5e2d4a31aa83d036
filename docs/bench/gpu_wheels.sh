#!/usr/bin/env bash
# Wheels of the server's packages for the GPU box (Python 3.12, x86-64, nothing can be fetched there) into .whl/
# (git-ignored), at the versions .venv runs (make the .venv first). The device tool carries them (`carry: [".whl"]`,
# ~50 MiB of its 64) and docs/bench/gpu_capacity.sh installs them there.
# NAMES: what `serve` (its workers import server.transports.webrtc at start, so aiortc and av too), `bench capacity`,
# `bench sessions` and the engine process import that the box's image lacks (/work/.library/device/KINDS.md lists
# what it has), with their own requirements; bigvgan and librosa's share only for CAP_VOCODER=bigvgan.
# silero-vad's wheel is carried without its ONNX and safetensors models (9 MB): server/vad.py loads the JIT one.
set -euo pipefail
OUT_DIR=${1:-.whl}
NAMES="aioice aiortc annotated-types av bigvgan cffi cryptography decorator dnspython fastapi google-crc32c httptools
ifaddr librosa opentelemetry-api platformdirs pooch pycparser pydantic pydantic-core pydantic-settings pyee pylibsrtp
pyopenssl python-dotenv pyzmq silero-vad soxr starlette threadpoolctl typing-extensions typing-inspection uvicorn websockets"
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64"
mkdir -p "$OUT_DIR"
# NAME==VERSION of each, as .venv has it (one interpreter for all; a name it lacks stops the script)
# shellcheck disable=SC2086
PINS=$(.venv/bin/python -c 'import importlib.metadata as m, sys
print(" ".join(f"{n}=={m.version(n)}" for n in sys.argv[1:]))' $NAMES) \
  || { echo "a package of NAMES is not installed in .venv: run make first" >&2; exit 1; }
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d "$OUT_DIR" $PINS
python3 - "$OUT_DIR" <<'PY'
import pathlib, sys, zipfile
for whl in pathlib.Path(sys.argv[1]).glob("silero_vad-*.whl"):
    src = zipfile.ZipFile(whl)
    drop = [n for n in src.namelist() if n.endswith((".onnx", ".safetensors"))]
    if not drop:
        continue
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename in drop:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if line.split(b",")[0].decode() not in drop)
            dst.writestr(info, data)
    tmp.replace(whl)
    print(f"{whl.name}: left out {len(drop)} model files")
PY
du -sh "$OUT_DIR"
