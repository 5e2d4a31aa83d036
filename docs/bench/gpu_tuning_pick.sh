#!/usr/bin/env bash
# Keep the GEMM tilings of the fastest of several engine starts (MOSS_TUNING_FILE, engines/kernels/tuning.py).
# Each start tunes anew and may pick differently (H100, fp8: decode steps 3.86-4.12 ms at batch 1 over four starts of
# one code, 2026-11-27). Run from the repo root on the GPU box:
#   PICK_STARTS=4 PICK_ARGS="--fp8-weights --fp8-only" bash docs/bench/gpu_tuning_pick.sh
# Writes $OUT/tuning.json (the fastest start's file) and prints every start's decode steps; export
# MOSS_TUNING_FILE=$OUT/tuning.json before docs/bench/gpu_capacity.sh to serve with those tilings.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
BEST="" BEST_MS=""
for i in $(seq 1 "${PICK_STARTS:-4}"); do
  rm -f "$OUT/tuning-$i.json"
  # shellcheck disable=SC2086  # PICK_ARGS is a list of options
  MOSS_TUNING_FILE="$OUT/tuning-$i.json" timeout "${PICK_TIMEOUT:-150}" python3 -m moss_speech.cli bench engine \
    --model "${PICK_MODEL:-full-random}" --batches "${PICK_BATCHES:-1,8,16}" --context 300 --no-baseline ${PICK_ARGS:-} \
    --json "$OUT/tuning-$i-engine.json" > "$OUT/tuning-$i.log" 2>&1 || { echo "start $i failed:"; tail -3 "$OUT/tuning-$i.log"; continue; }
  [ -f "$OUT/tuning-$i.json" ] || { echo "start $i wrote no tuning file (no GEMM tuned: not a GPU?)"; continue; }
  # the sum of the decode steps over the batches measured: what the start's tilings cost a step
  MS=$(python3 -c "import json, sys; d = json.load(open(sys.argv[1]))['decode_step_ms']
print(' '.join(f'batch {b}: {v:.3f} ms,' for b, v in d.items()), round(sum(d.values()), 3))" "$OUT/tuning-$i-engine.json")
  echo "start $i: decode steps $MS ms summed"
  MS=${MS##* }
  if [ -z "$BEST_MS" ] || python3 -c "import sys; sys.exit(not float(sys.argv[1]) < float(sys.argv[2]))" "$MS" "$BEST_MS"; then
    BEST=$i BEST_MS=$MS
  fi
done
[ -n "$BEST" ] || { echo "no start finished"; exit 1; }
cp "$OUT/tuning-$BEST.json" "$OUT/tuning.json"
echo "kept start $BEST (sum $BEST_MS ms): $OUT/tuning.json"
