#!/usr/bin/env bash
# The MMA-chain variants prepared in session 42 (docs/PERF_NOTES.md), in one GPU call from the repo root:
#   bash docs/bench/gpu_mma_chains.sh          (raw files under $OUT)
# 1. their GPU tests (every codec linear / ln_linear / conv / estimator test with each StreamTiles variant, and the
#    skinny kernel's accumulator chains over fp8 and bf16 weights); 2. the codec's solve graph per variant at the
#    first-chunk lane's batches and a playing round's; 3. the skinny kernel's chains on the decode step's four GEMMs.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp}
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 300 python3 -m pytest -q tests/gpu/test_codec_kernels.py -k "linear or conv or estimator_cuda" 2>&1 | tail -2
timeout 200 python3 -m pytest -q tests/gpu/test_kernels.py -k "chains" 2>&1 | tail -2
timeout 300 python3 -m engines.bench.profile_codec --tiles --tile-filter dots,tap --batches 1,2,16 2>&1 \
  | tee "$OUT/codec-mma-chains.txt" | grep -E "solve batch|served"
timeout 200 python3 -m engines.bench.skinny_chains --rows 1,8,16 --json "$OUT/skinny-chains-fp8.json" 2>&1 | tail -30
timeout 200 python3 -m engines.bench.skinny_chains --rows 8 --weights bf16 --json "$OUT/skinny-chains-bf16.json" \
  2>&1 | tail -15
