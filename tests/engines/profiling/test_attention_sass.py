"""The estimator's paged attention read as SASS on the CPU (engines/profiling/attention_sass.py): the kernel compiles
for Hopper without a GPU, and the loop the tool finds is the one over blocks of keys."""

from __future__ import annotations

from engines.kernels.speech_out.flow import paged_attention as pa
from engines.profiling import attention_sass


def test_the_loop_found_does_one_block_of_keys_products_per_iteration():
    r = attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES, "auto", 90)
    # q @ k^T and p @ v of one block: BLOCK_Q x BLOCK_T x D multiply-adds each, in 16x8x16 tensor-core steps,
    # shared by the program's warps
    steps = 2 * pa.BLOCK_Q * pa.BLOCK_T * attention_sass.HEAD_DIM // (16 * 8 * 16) // pa.NUM_WARPS
    assert r["loops"][0]["ops"]["HMMA"] == steps
    assert r["registers"] > 0 and r["shared_bytes"] > 0
    assert 1 <= r["programs_per_sm"] <= attention_sass.WARPS_PER_SM // pa.NUM_WARPS


def test_fp8_pages_add_their_conversion_to_the_loop():
    bf16, fp8 = (attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES, kind, 90)["loops"][0]["ops"]
                 for kind in ("auto", "fp8"))
    # e4m3 pairs converted to fp16 as keys and values are read, beside the probabilities' conversion both have
    assert fp8["F2FP"] > bf16["F2FP"] > 0
    assert fp8["HMMA"] == bf16["HMMA"]
