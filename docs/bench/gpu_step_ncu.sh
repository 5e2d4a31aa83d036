#!/usr/bin/env bash
# One decode step's kernels, each timed by Nsight Compute (graph nodes, clocks and caches left alone), summed by
# kernel name and launch grid. Run from the repo root on the GPU box:
#   STEP_ARGS="--batch 8 --context 300 --fp8-weights --fp8-only" bash docs/bench/gpu_step_ncu.sh
# Kernels run one at a time under ncu (no overlap between neighbours), so the sum is above the graph's replay time.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
CSV=$OUT/step-ncu.csv
# shellcheck disable=SC2086  # STEP_ARGS is a list of options
timeout ${NCU_TIMEOUT:-300} "$NCU" --profile-from-start off --graph-profiling node --clock-control none \
  --cache-control none --metrics gpu__time_duration.sum --csv \
  python3 -m engines.profiling.profile_step --ncu ${STEP_ARGS:---batch 8 --context 300} > "$CSV" 2> "$OUT/step-ncu.err"
# (profile_step's own timing line: taken under ncu, whose launch interception makes it many times the real time)
grep -h "graph replay" "$OUT/step-ncu.err" "$CSV" | head -1 | sed 's/$/  [timed under ncu: not the step'"'"'s time]/'
python3 - "$CSV" <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
if not rows:
    sys.exit("no kernels in the ncu output (see step-ncu.err)")
hdr, rows = rows[0], rows[1:]
col = {name: hdr.index(name) for name in ("Kernel Name", "Grid Size", "Metric Name", "Metric Unit", "Metric Value")}
to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
by = collections.defaultdict(list)
for r in rows:
    if r[col["Metric Name"]] == "gpu__time_duration.sum":
        us = float(r[col["Metric Value"]].replace(",", "")) * to_us[r[col["Metric Unit"]]]
        by[(r[col["Kernel Name"]][:60], r[col["Grid Size"]])].append(us)
total = sum(sum(v) for v in by.values())
print(f"{sum(len(v) for v in by.values())} kernels, {total / 1e3:.3f} ms summed")
for (name, grid), v in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:24]:
    print(f"{sum(v):9.1f} us {len(v):4d} x {sum(v) / len(v):7.2f} us  grid {grid:14s} {name}")
PY
