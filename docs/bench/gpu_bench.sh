#!/usr/bin/env bash
# One GPU lease: GPU tests, engine bench (floors + HF-style baseline in the same run), batch-1 step profile,
# codec bench and codec profile. Results under $OUT (run from the repo root on the GPU box).
# Parts can be skipped: SKIP="tests profile codec" etc.
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/moss-triton-cache}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
skip() { [[ " ${SKIP:-} " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
t0=$(date +%s)
stamp() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
if ! skip tests; then
  stamp tests
  # One pytest per file under one overall limit, so a file cut off by the limit still leaves every earlier file's
  # failures and summary (pytest prints them only at its end), and the files never reached are named.
  end=$(( $(date +%s) + ${TESTS_S:-480} ))
  : > "$OUT/gpu-tests.txt"
  for f in tests/gpu/test_*.py; do
    left=$(( end - $(date +%s) ))
    if [ $left -le 0 ]; then echo "not run (TESTS_S): $f" | tee -a "$OUT/gpu-tests.txt"; continue; fi
    echo "== $f" >> "$OUT/gpu-tests.txt"
    timeout $left python3 -m pytest -q -p no:cacheprovider --tb=short "$f" ${TESTS_ARGS:-} >> "$OUT/gpu-tests.txt" 2>&1
    echo "$f: $(tail -1 "$OUT/gpu-tests.txt")"
  done
  grep -E "^(FAILED|ERROR) " "$OUT/gpu-tests.txt"
fi
if ! skip engine; then
  stamp engine
  timeout ${ENGINE_S:-240} python3 -m moss_speech.cli bench engine --model full-random --batches ${BATCHES:-1,8,32,64} \
    --json "$OUT/engine.json" ${ENGINE_ARGS:-} 2>&1 | tail -12
fi
if ! skip profile; then
  stamp profile
  timeout ${PROFILE_S:-150} python3 -m engines.profiling.profile_step --batch 1 > "$OUT/profile-step.txt" 2>&1
  grep -E "graph replay|Self CUDA time total" "$OUT/profile-step.txt"
fi
if ! skip codec; then
  stamp codec
  timeout ${CODEC_S:-200} python3 -m moss_speech.cli bench codec --codec full-random --vocoder hift \
    --batches ${CODEC_BATCHES:-1,16,64} --json "$OUT/codec.json" 2>&1 | tail -10
  timeout ${PCODEC_S:-150} python3 -m engines.profiling.profile_codec --batches 1,16 > "$OUT/profile-codec.txt" 2>&1
  tail -25 "$OUT/profile-codec.txt"
fi
stamp done
