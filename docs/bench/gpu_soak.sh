#!/usr/bin/env bash
# A soak on the GPU in one device call (run from repo root): the server as docs/bench/gpu_capacity.sh starts it
# (full-size random weights, `--fp8-weights --encoder-tf32`, HiFT, --workers 4), then `moss-speech bench soak`
# against it: SOAK_SESSIONS users (default 32: the full-context decoder's session limit, server/limits.py) churning
# for SOAK_S seconds (default 300: the engine's start takes 190-260 s of the call's 600), their first connections
# spread over SOAK_STAGGER seconds (default 10); GPU memory in use sampled beside it every 10 s ($OUT/gpu_memory.csv).
# Writes $OUT/soak.json. The windowed decoder: SERVE_ARGS="--decoder-context window" SOAK_SESSIONS=200
# SOAK_STAGGER=30 (spread out: 200 users speaking at once are past the speech encoder's 128 slots, docs/operations.md,
# Limits).
set -u
T0=$(date +%s)
# shellcheck source=docs/bench/gpu_serve.sh
source docs/bench/gpu_serve.sh
( while sleep 10; do echo "$(($(date +%s) - T0)),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"
  done ) > "$OUT/gpu_memory.csv" &
SAMPLER=$!
python3 -m moss_speech.cli bench soak --url http://127.0.0.1:8000 --server-pid $SERVER \
  --sessions "${SOAK_SESSIONS:-32}" --stagger "${SOAK_STAGGER:-10}" --duration "${SOAK_S:-300}" --window 60 --json "$OUT/soak.json" 2>&1 \
  | grep -v "^soak t=" | tail -40
echo "soak exit ${PIPESTATUS[0]} (1: KV blocks in use once every session had closed)"
kill $SAMPLER $SERVER; sleep 3
echo "GPU memory (s since start, MiB): first $(head -1 "$OUT/gpu_memory.csv"), last $(tail -1 "$OUT/gpu_memory.csv")"
echo "stalls: $(grep -c 'stall in' "$OUT/server.log")"; grep -i "error\|traceback" "$OUT/server.log" | head -10
