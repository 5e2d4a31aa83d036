#!/usr/bin/env bash
# The server processes alone under load: `moss-speech serve --workers W` with the scripted fake engine (no model,
# no GPU) and `moss-speech loadtest` (server_vad turns at real time) on this host. Prints, per (workers, sessions),
# the server processes' CPU seconds and the load test's summary; reports go to $OUT/server-load-w{W}-{N}.json.
# Run from the repository root:  OUT=DIR LOAD_WORKERS="1 4" LOAD_SESSIONS="128 256" bash docs/bench/server_load.sh
# LOAD_TRANSPORT=webrtc drives WebRTC calls instead (MOSS_MAX_CALLS is raised to the session count).
set -u
OUT=${OUT:-/tmp}; PORT=${LOAD_PORT:-8123}; PY=${PYTHON:-python3}
export MOSS_ENGINE_COMMAND="[\"$PY\",\"-m\",\"tests.fakes.fake_engine\",\"--model\",\"x\",\"--codec\",\"x\",\"--device\",\"cpu\"]"
export FAKE_ENGINE_CHUNKS=6 FAKE_ENGINE_STEP_S=0.3  # answers of 6 x 400 ms chunks at real time
echo "host: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
for W in ${LOAD_WORKERS:-1 2}; do
  for N in ${LOAD_SESSIONS:-128 192}; do
    MOSS_MAX_CALLS=$N $PY -m moss_speech.cli serve --port $PORT --max-sessions 1000 --workers $W --log-level warning > $OUT/server-load-w$W-$N.log 2>&1 &
    SERVER=$!
    for i in $(seq 200); do curl -s localhost:$PORT/health | grep -q '"status":"ok"' && break; sleep 0.3; done
    sleep 3  # every worker up
    # The processes that serve sessions: the server itself, or the supervisor's workers (not the engine).
    pids() { if [ $W = 1 ]; then echo $SERVER; else for p in $(pgrep -P $SERVER); do grep -q spawn_main /proc/$p/cmdline && echo $p; done; fi; }
    ticks() { t=0; for p in $(pids); do read u s < <(awk '{print $14, $15}' /proc/$p/stat); t=$((t + u + s)); done; echo $t; }
    c0=$(ticks); t0=$(date +%s.%N)
    $PY -m moss_speech.cli loadtest --url http://127.0.0.1:$PORT --sessions $N --turns 2 --ramp 32 --quiet \
      --transport ${LOAD_TRANSPORT:-ws} \
      --json $OUT/server-load-w$W-$N.json > $OUT/server-load-w$W-$N.txt 2>&1
    t1=$(date +%s.%N); c1=$(ticks)
    $PY -c "print('workers $W sessions $N: wall %.1f s, server CPU %.1f s' % ($t1 - $t0, ($c1 - $c0) / $(getconf CLK_TCK)))"
    grep -E "turns:|ttfa_ms |vad_delay|gap_ms|underruns|errors|fell behind" $OUT/server-load-w$W-$N.txt
    kill $SERVER; wait $SERVER 2>/dev/null
  done
done
