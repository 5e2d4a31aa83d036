# Sourced by docs/bench/gpu_turn_detectors.sh and gpu_soak.sh (from the repo root, on the GPU box): installs the
# server wheels carried in .whl/ (docs/bench/gpu_wheels.sh), starts `moss-speech serve` as the capacity runs do
# (full-size random weights, `--fp8-weights --encoder-tf32`, HiFT, --max-running 128, --workers 4, port 8000; its
# log $OUT/server.log; SERVER its pid) and waits for /health (the engine's start takes 190-260 s there). SERVE_ARGS:
# more `serve` options, after these (e.g. SERVE_ARGS="--ramp-step-rows 0").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/moss-triton-cache}
export MOSS_MAX_SESSIONS=288 MOSS_LOG_LEVEL=${MOSS_LOG_LEVEL:-warning} MOSS_MAX_RUNNING=128 MOSS_MAX_MODEL_LEN=4096 \
  MOSS_KV_CACHE_GIB=auto MOSS_ENCODE_EVERY_MS=80
# (SERVE_ARGS split into words)
# shellcheck disable=SC2086
python3 -m moss_speech.cli serve --model full-random --codec full-random --device cuda --vocoder hift \
  --host 127.0.0.1 --port 8000 --workers 4 --fp8-weights --encoder-tf32 ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
_t0=$(date +%s)
for _ in $(seq 1 300); do
  curl -sf http://127.0.0.1:8000/health > /dev/null && break; grep -q "engine did not start" "$OUT/server.log" && break
  sleep 1; done
echo "server ready after $(($(date +%s) - _t0)) s: $(curl -s http://127.0.0.1:8000/health | head -c 200)"
