#!/usr/bin/env bash
# Servers of an A/B pair at one capacity level, one after the other in one device call (run from the repo root on
# the GPU box). Each run is docs/bench/gpu_capacity.sh with CAP_START = CAP_MAX = PAIR_LEVEL; a run takes ~3-4.5 min
# (engine start 70-165 s, then the level), so two fit one call; run the reverse order in the next call for ABBA.
#   PAIR_ORDER="A B"          the runs, by label (a label may repeat: "A B A")
#   PAIR_A / PAIR_B ...       environment of that label's server, e.g. "MOSS_TUNING_FILE=/tmp/tuning.json"
#   PAIR_A_ARGS ...           engine options of that label's server (serve flags), after CAP_ENGINE_ARGS (e.g. "--encoder-tf32")
#   PAIR_A_TREE ...           run that label from another tree (a directory holding an older checkout's engines/,
#                             server/, moss_speech/, client_web/ and docs/bench/, e.g. `git archive` into .probe/old);
#                             its .whl and the load test's speech sample are taken from this tree
#   PAIR_LEVEL (136), CAP_ENGINE_ARGS, CAP_LEVEL_S (45): as in gpu_capacity.sh
#   PAIR_DRY=1                print each run's command instead of running it
#   MOSS_LOG_LEVEL=info       the engine logs each answer's stage marks: printed per run (engines.profiling.stage_marks)
# A fresh machine's first run compiles the Triton kernels (H200, 2026-11-28: ~256 s for that run against ~160 s for
# the next), so plan three runs per call at most.
# Example, the shipped tilings against tilings tuned at start:
#   PAIR_ORDER="A B" PAIR_A="" PAIR_B="MOSS_TUNING_FILE=none" \
#     CAP_ENGINE_ARGS="--fp8-weights --fp8-only" bash docs/bench/gpu_capacity_pair.sh
# Writes $OUT/capacity-<label>-<n>.json and the server's log $OUT/server-<label>-<n>.log.gz per run and prints each
# run's level line.
# With MOSS_LOG_LEVEL=info, `python3 -m engines.profiling.pair_compare DIR...` pools each label's runs (from one call
# or several: keep the files' names) and prints B's p95 shift from A with a bootstrap interval.
# `python3 -m engines.profiling.load_parts server-A-1.log.gz server-B-2.log.gz` sums each run's encoder calls and
# codec rounds.
set -u
ROOT=$PWD
OUT=${OUT:-/tmp}
LEVEL=${PAIR_LEVEL:-136}
n=0
for label in ${PAIR_ORDER:-A B}; do
  n=$((n + 1))
  envvar="PAIR_$label"; treevar="PAIR_${label}_TREE"; argsvar="PAIR_${label}_ARGS"
  vars=${!envvar-}; tree=${!treevar:-$ROOT}
  read -r -a words <<< "${CAP_ENGINE_ARGS:-} ${!argsvar-}"; engine_args="${words[*]}"
  if [ "$tree" != "$ROOT" ]; then
    [ -d "$tree/engines" ] || { echo "run $n ($label): $tree holds no engines/"; exit 2; }
    if [ -z "${PAIR_DRY:-}" ]; then
      ln -sfn "$ROOT/.whl" "$tree/.whl"
      mkdir -p "$tree/tests/data"
      [ -f "$tree/tests/data/speech_en_16k.wav" ] || cp "$ROOT/tests/data/speech_en_16k.wav" "$tree/tests/data/"
    fi
  fi
  # shellcheck disable=SC2086  # vars is a list of NAME=VALUE words
  cmd=(env $vars CAP_ENGINE_ARGS="$engine_args" CAP_START="$LEVEL" CAP_MAX="$LEVEL" CAP_LEVEL_S="${CAP_LEVEL_S:-45}" CAP_TIMEOUT="${CAP_TIMEOUT:-300}"
       CAP_SESSIONS_BENCH=0 CAP_WORKERS_BENCH=0 CAP_ARGS="--keep-going" bash docs/bench/gpu_capacity.sh)
  echo "run $n ($label, ${vars:-no extra environment}, engine options: ${engine_args:-none}, tree ${tree#"$ROOT"/}):"
  if [ -n "${PAIR_DRY:-}" ]; then
    echo "  (cd $tree && $(printf '%q ' "${cmd[@]}"))"
    continue
  fi
  (cd "$tree" && OUT=$OUT "${cmd[@]}" 2>&1 | grep -E "^ +[0-9]+ |^capacity: [0-9<]|stalls")
  if [ -f "$OUT/capacity.json" ]; then
    mv "$OUT/capacity.json" "$OUT/capacity-$label-$n.json"
  else
    echo "  no report (see $OUT/server-$label-$n.log.gz)"
  fi
  rm -f "$OUT"/*.png
  if [ -f "$OUT/server.log" ]; then
    [ "${MOSS_LOG_LEVEL:-}" = info ] && python3 -m engines.profiling.stage_marks "$OUT/server.log" "$LEVEL" | tail -3
    gzip -c "$OUT/server.log" > "$OUT/server-$label-$n.log.gz" && rm "$OUT/server.log"
  fi
done
