#!/usr/bin/env bash
# Ray Serve's wheels for the GPU box (Python 3.12, x86-64, nothing fetched there), for gpu_ray_vs_direct.sh: the
# pinned ray[serve] and what it needs that the box's image lacks and .whl/ (gpu_wheels.sh) does not carry, in two
# parts under the device tool's 64 MiB carry (which counts the ~13 MiB checkout too): .whl-ray/a (the first 44 MiB
# of the ray wheel) and .whl-ray/b (the rest of it and the other wheels, ~47 MiB). Each is carried in a call of its
# own (RVD_MODE=stage in gpu_ray_vs_direct.sh keeps it in /tmp on the machine while it is warm).
set -euo pipefail
OUT_DIR=${1:-.whl-ray}
PIN=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["optional-dependencies"]["ray"][0])')
# On the box already (/work/.library/device/KINDS.md) or in .whl/: not carried again.
HAVE="aiohappyeyeballs aiohttp aiosignal annotated_doc annotated_types anyio attrs certifi charset_normalizer click
cloudpickle fastapi filelock frozenlist fsspec grpcio h11 httpcore httpx idna jinja2 markupsafe msgpack multidict
packaging pluggy prometheus_client propcache protobuf psutil pydantic pydantic_core pydantic_settings pyyaml requests
starlette typing_extensions typing_inspection urllib3 uvicorn uvloop websockets wrapt yarl zipp numpy six
cffi cryptography pycparser httptools python_dotenv platformdirs"
# The box's grpcio (`python3 -m pip show grpcio` there: 1.84.0 on 2026-12-02): grpcio-reflection's generated code
# refuses to import beside an older grpcio than its own version.
BOX_GRPCIO=${BOX_GRPCIO:-1.84.0}
rm -rf "$OUT_DIR" && mkdir -p "$OUT_DIR/all" "$OUT_DIR/a" "$OUT_DIR/b"
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$OUT_DIR/all" "$PIN" "grpcio-reflection==$BOX_GRPCIO"
for whl in "$OUT_DIR"/all/*.whl; do
  name=$(basename "$whl" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
  case " $(echo $HAVE) " in *" $name "*) continue ;; esac
  # carried in .whl/ already (a second copy of a wheel stops pip's whole install there)
  ls .whl/"$name"-*.whl > /dev/null 2>&1 && continue
  if [ "$name" = ray ]; then
    split -b 44m -a 2 "$whl" "$OUT_DIR/b/$(basename "$whl").part-" && mv "$OUT_DIR/b/$(basename "$whl").part-aa" "$OUT_DIR/a/"
  else
    cp "$whl" "$OUT_DIR/b/"
  fi
done
rm -rf "$OUT_DIR/all"
du -sh "$OUT_DIR/a" "$OUT_DIR/b"
