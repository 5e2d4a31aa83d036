#!/usr/bin/env bash
# GPU capacity run: server with full-size random weights + capacity sweep against it (run from repo root).
# The engine runs with --max-running 128 --max-model-len 4096, set as MOSS_MAX_RUNNING / MOSS_MAX_MODEL_LEN (give
# those variables to change them; on an 80 GB card with the full-context decoder 128 leaves no room: the speech
# encoder's slots alone take 30 GiB, so give MOSS_MAX_RUNNING=64, the engine's default).
# The vocoder is HiFT (CUDA graphs) unless CAP_VOCODER=bigvgan (the bigvgan package's generator, eager).
# CAP_WORKERS: server processes (default 4: one process's loop fell behind real time from ~140 sessions on an H200
# host, VAD commits 1.6 s late at 172; docs/operations.md, Workers).
# CAP_KV_GIB: the language model's KV pool in GiB (MOSS_KV_CACHE_GIB; default auto: what the GPU has free after the
# codec and the weights, less a headroom).
# CAP_ENCODE_MS: the speech encoder's interval for held audio (MOSS_ENCODE_EVERY_MS; default 80).
# CAP_ENGINE_ARGS: more engine options, as `moss-speech serve` flags (e.g. "--fp8-weights --encoder-tf32"); a flag
# wins over its MOSS_* variable.
# MOSS_TUNING_FILE=PATH (passed on to the engine): serve the GEMM tilings kept in PATH, so both servers of an A/B pair
# run the same tilings; the engine tunes and adds the shapes the file lacks. Without it the shipped picks
# (engines/kernels/tunings.json: the fastest of four starts on an H100 by `gpu_tuning_pick.sh`) serve where they have
# the GPU model; MOSS_TUNING_FILE=none tunes every shape at start.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1  # server wheels carried to the GPU box in .whl/ (git-ignored; made by docs/bench/gpu_wheels.sh)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/moss-triton-cache}  # kernels compiled after start-up are listed below
export MOSS_MAX_SESSIONS=${MOSS_MAX_SESSIONS:-288} MOSS_LOG_LEVEL=${MOSS_LOG_LEVEL:-warning}  # info: per-response server TTFA for engines.profiling.stage_marks
export MOSS_MAX_RUNNING=${MOSS_MAX_RUNNING:-128} MOSS_MAX_MODEL_LEN=${MOSS_MAX_MODEL_LEN:-4096} \
  MOSS_KV_CACHE_GIB=${CAP_KV_GIB:-auto} MOSS_ENCODE_EVERY_MS=${CAP_ENCODE_MS:-80}
# shellcheck disable=SC2086  # CAP_ENGINE_ARGS is a list of serve flags
python3 -m moss_speech.cli serve --model full-random --codec full-random --device cuda --vocoder "${CAP_VOCODER:-hift}" \
  --host 127.0.0.1 --port 8000 --workers "${CAP_WORKERS:-4}" ${CAP_ENGINE_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 300); do  # (start-up: 70-250 s on an H200; the engine log's `start-up:` lines say where it goes)
  curl -sf http://127.0.0.1:8000/health > /dev/null && break; grep -q "engine did not start" $OUT/server.log && break
  sleep 1; done
curl -s http://127.0.0.1:8000/health; echo
touch /tmp/moss-ready
PLOTS=$(python3 -c "import matplotlib" 2>/dev/null && echo "--plots $OUT")  # (plots only where matplotlib is there)
timeout ${CAP_TIMEOUT:-420} python3 -m moss_speech.cli bench capacity --url http://127.0.0.1:8000 --start ${CAP_START:-16} --step ${CAP_STEP:-16} --max ${CAP_MAX:-128} \
  --turns 2 --ramp 16 --max-output-tokens 50 --level-duration ${CAP_LEVEL_S:-60} --json $OUT/capacity.json $PLOTS ${CAP_ARGS:-} 2>&1 | tail -40
BENCH_RC=${PIPESTATUS[0]}
# A sweep cut off by CAP_TIMEOUT may have stalled: every engine thread's stack (faulthandler on SIGUSR1) to the log.
[ "$BENCH_RC" = 124 ] && { echo "capacity sweep cut off by CAP_TIMEOUT: engine stacks in server.log"; pkill -USR1 -P "$SERVER" -f 'engines[.]process[.]main'; }
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv >> $OUT/server.log 2>&1; sleep 1
kill $SERVER; sleep 3; tail -5 $OUT/server.log
echo "Triton kernels compiled while serving (each one stalls its caller):"
find $TRITON_CACHE_DIR -newer /tmp/moss-ready -name '*.cubin' -printf '%TT %f\n' | sort | head -20
echo "stalls: $(grep -c 'stall in' $OUT/server.log), gc pauses logged: $(grep -c 'gc generation' $OUT/server.log)"
# The server process's own CPU per real-time session on this host's cores (no GPU, no network; ~20 s).
[ "${CAP_SESSIONS_BENCH:-1}" = 1 ] && timeout 120 python3 -m moss_speech.cli bench sessions --sessions 64,128,256 \
  --seconds 5 --json $OUT/sessions-cpu.json 2>&1 | tail -5
# The server processes with the fake engine at 256 sessions, one worker against four (~1.5 min).
[ "${CAP_WORKERS_BENCH:-1}" = 1 ] && LOAD_WORKERS="1 4" LOAD_SESSIONS=256 timeout 240 bash docs/bench/server_load.sh
