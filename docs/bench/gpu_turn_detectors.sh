#!/usr/bin/env bash
# Speech end -> first audio with each turn detector, against one server in one device call (run from repo root):
# full-size random weights, `--fp8-weights --encoder-tf32`, HiFT, --workers 4, one `bench capacity` level a run.
# The runs at 128 sessions are for the windowed decoder: SERVE_ARGS="--decoder-context window" (gpu_serve.sh; the
# full-context one, the default, serves at most 32 sessions in real time).
# RUNS: which of the runs below, in this order (default "nat128 nat1 vad128"); each is skipped when fewer than 40 s
# of TD_BUDGET_S (570, from the script's start: the engine's start takes 190-260 s of it on a fresh machine, so more
# than two runs take two calls) are left, and cut at what is left. Each writes $OUT/NAME.json, and NAME-cpu.json: the
# host's cores busy over it, by role (docs/bench/proc_cpu.py), as the engine shares them with the server processes,
# and NAME-end-of-turn.txt (/metrics): the silence heard at each turn's end, the end-of-turn model's questions by
# outcome and the answered ones' waits.
#   high128 / auto128  semantic_vad, eagerness high (answers released at once) / auto (held until 300 ms of
#                      silence confirm the turn): 128 sessions, 4 turns, answers up to 250 rows (20 s), the paused
#                      turn of tests/data
#   high1 / auto1      the same at one session: 6 turns, answers up to 50 rows (the first audio does not depend on
#                      the answer's length)
#   vad128             server_vad 300 ms, the one-sentence sample (300 ms would split the paused turn at its pauses)
#   nat128 / nathigh128 / nat1 / nathigh1  semantic_vad auto / high at 128 sessions and at one, on natural
#                      speech: TD_NATURAL (default .carry/natural_turn_en_16k.wav, made as docs/performance.md says;
#                      carried with `carry: [".whl", ".carry"]`)
#   plainN / txN       server_vad 300 ms, N sessions (e.g. plain32 tx32), 3 turns, answers up to 50 rows, the
#                      one-sentence sample, without / with input transcription of every turn (--transcription): what
#                      transcribing costs the answer
set -u
T0=$(date +%s)
DEADLINE=$((T0 + ${TD_BUDGET_S:-570}))
# shellcheck source=docs/bench/gpu_serve.sh
source docs/bench/gpu_serve.sh
# TD_ENGINE_NICE (e.g. -5): every thread of the engine process at that niceness once it serves (Linux niceness is a
# thread's; threads started later inherit it), the server processes left at 0: whether the engine's loop and codec
# threads lose the host's cores to the server processes' end-of-turn model under load (compare NAME-cpu.json).
if [ -n "${TD_ENGINE_NICE:-}" ]; then
  ENGINE_PID=$(pgrep -f engines.process.main | head -1)
  [ -n "$ENGINE_PID" ] || { echo "TD_ENGINE_NICE: no engine process"; exit 1; }
  for task in /proc/"$ENGINE_PID"/task/*; do renice -n "$TD_ENGINE_NICE" -p "${task##*/}" > /dev/null; done
  echo "engine threads at niceness $TD_ENGINE_NICE: $(ls /proc/"$ENGINE_PID"/task | wc -l)"
fi
WARM=""  # the first run wakes the server with an unrecorded turn; the others need none
level() {  # NAME SESSIONS bench-capacity-options...
  local name=$1 n=$2 left; shift 2
  left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt 40 ] && { echo "== $name: skipped, ${left} s left"; return; }
  echo "== $name ($n sessions, $left s left)"
  python3 docs/bench/proc_cpu.py snapshot > "$OUT/$name-cpu-0.json"; local t0; t0=$(date +%s.%N)
  # shellcheck disable=SC2086
  timeout "$left" python3 -m moss_speech.cli bench capacity --url http://127.0.0.1:8000 --start "$n" --max "$n" \
    --ramp 16 --keep-going --quiet --level-duration 150 $WARM --json "$OUT/$name.json" "$@" 2>&1 | tail -12
  # the host's cores busy on average over the level, by role (engine, server processes; the load test's processes
  # start and end within the level, so they count in `other`)
  python3 docs/bench/proc_cpu.py snapshot > "$OUT/$name-cpu-1.json"
  python3 docs/bench/proc_cpu.py diff "$OUT/$name-cpu-0.json" "$OUT/$name-cpu-1.json" \
    "$(python3 -c "print($(date +%s.%N) - $t0)")" "$n" > "$OUT/$name-cpu.json" && rm "$OUT/$name"-cpu-[01].json
  python3 -c "import json, sys; d = json.load(open(sys.argv[1])); t = d.pop('threads'); print('cores busy:', ', '.join(
    f'{k} {v[\"cores\"]}' for k, v in d.items())); print('main threads / other threads:', t)" "$OUT/$name-cpu.json"
  # turn ends and the end-of-turn model's questions, all server processes together (counted from the server's
  # start: the runs before this one included)
  curl -s http://127.0.0.1:8000/metrics | grep -E "^moss_(end_of_turn|turn_end_silence)" > "$OUT/$name-end-of-turn.txt"
  grep "_questions_total" "$OUT/$name-end-of-turn.txt"
  # means: an answer's wait, the model's call (~40 ms when its threads have their cores), the silence at turn ends
  python3 -c "import re, sys; t = open(sys.argv[1]).read(); v = lambda k: float((re.findall(rf'^{k} (\S+)$', t, re.M)
    or [0])[0]); print('; '.join(f'{n} mean {1e3 * v(m + \"_sum\") / max(1, v(m + \"_count\")):.0f} ms' for n, m in (
    ('wait', 'moss_end_of_turn_wait_seconds'), ('call', 'moss_end_of_turn_call_seconds'),
    ('turn-end silence', 'moss_turn_end_silence_seconds'))))" "$OUT/$name-end-of-turn.txt"
  WARM="--no-warmup"
}
PAUSED="--audio tests/data/speech_paused_en_16k.wav"
NATURAL="--audio ${TD_NATURAL:-.carry/natural_turn_en_16k.wav}"
for run in ${RUNS:-nat128 nat1 vad128}; do
  case $run in
    high128) level high128 128 --turns 4 --max-output-tokens 250 $PAUSED --turn-detection semantic_vad --eagerness high ;;
    auto128) level auto128 128 --turns 4 --max-output-tokens 250 $PAUSED --turn-detection semantic_vad --eagerness auto ;;
    high1) level high1 1 --turns 6 --max-output-tokens 50 $PAUSED --turn-detection semantic_vad --eagerness high ;;
    auto1) level auto1 1 --turns 6 --max-output-tokens 50 $PAUSED --turn-detection semantic_vad --eagerness auto ;;
    vad128) level vad128 128 --turns 4 --max-output-tokens 250 --turn-detection server_vad ;;
    nat128) level nat128 128 --turns 4 --max-output-tokens 250 $NATURAL --turn-detection semantic_vad --eagerness auto ;;
    nathigh128) level nathigh128 128 --turns 4 --max-output-tokens 250 $NATURAL --turn-detection semantic_vad \
      --eagerness high ;;
    plain[0-9]*) level "$run" "${run#plain}" --turns 3 --max-output-tokens 50 --turn-detection server_vad ;;
    tx[0-9]*) level "$run" "${run#tx}" --turns 3 --max-output-tokens 50 --turn-detection server_vad --transcription ;;
    nat1) level nat1 1 --turns 6 --max-output-tokens 50 $NATURAL --turn-detection semantic_vad --eagerness auto ;;
    nathigh1) level nathigh1 1 --turns 6 --max-output-tokens 50 $NATURAL --turn-detection semantic_vad --eagerness high ;;
  esac
done
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
kill $SERVER; sleep 3
echo "stalls: $(grep -c 'stall in' "$OUT/server.log"); errors: $(grep -ci 'error' "$OUT/server.log")"
grep -i "error\|traceback" "$OUT/server.log" | head -10
