"""The estimator's paged attention read as SASS on the CPU (engines/profiling/attention_sass.py): the kernel compiles
for Hopper without a GPU, and the loops the tool finds are the kernel's over blocks of keys."""

from __future__ import annotations

from engines.kernels.speech_out.flow import paged_attention as pa
from engines.profiling import attention_sass


def _products(block_t: int) -> int:
    """Tensor-core steps of q @ k^T and p @ v over one block of keys: BLOCK_Q x block_t x D multiply-adds each, in
    16x8x16 steps, shared by the program's warps."""
    return 2 * pa.BLOCK_Q * block_t * attention_sass.HEAD_DIM // (16 * 8 * 16) // pa.NUM_WARPS


def test_the_loops_found_are_the_kernels_three_over_their_blocks_of_keys():
    r = attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES, "auto", 90)
    # earlier pages' whole blocks, their partial block, the new chunks' frames
    assert [loop["ops"]["HMMA"] for loop in r["loops"]] == [_products(pa.BLOCK_T), _products(pa.BLOCK_T),
                                                            _products(pa.BLOCK_NEW)]
    assert r["registers"] > 0 and r["shared_bytes"] > 0
    assert 1 <= r["programs_per_sm"] <= attention_sass.WARPS_PER_SM // pa.NUM_WARPS


def test_only_the_masked_loops_select_their_scores():
    whole, partial, new = (loop["ops"] for loop in attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES,
                                                                         "auto", 90)["loops"])
    assert "FSEL" not in whole and partial["FSEL"] > 0 and new["FSEL"] > 0


def test_fp8_pages_add_their_conversion_to_the_loop():
    bf16, fp8 = (attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES, kind, 90)["loops"][0]["ops"]
                 for kind in ("auto", "fp8"))
    # e4m3 pairs converted to fp16 as keys and values are read, beside the probabilities' conversion both have
    assert fp8["F2FP"] > bf16["F2FP"] > 0
    assert fp8["HMMA"] == bf16["HMMA"]


def test_fp8_pages_reach_the_products_through_ldmatrix_as_bf16_pages_do():
    bf16, fp8 = (attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, pa.NUM_STAGES, kind, 90)
                 for kind in ("auto", "fp8"))
    # converted as read, keys and values go to the products' layout in fp16 as bf16 pages go, not assembled a byte
    # at a time from an fp8 tile in shared memory (which took 132 shared loads and 235 IMAD a block of keys)
    assert fp8["loops"][0]["ops"]["LDSM"] == bf16["loops"][0]["ops"]["LDSM"]
    assert fp8["loops"][0]["ops"].get("LDS", 0) <= bf16["loops"][0]["ops"].get("LDS", 0)
    assert fp8["key_buffers"] >= 1  # still pipelined: the words' tile in shared memory


def test_key_buffers_are_read_from_the_shared_memory_a_block_of_keys_takes():
    ir = ("%k = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared, #smem, mutable>\n"
          "%p = ttg.local_alloc : () -> !ttg.memdesc<2x128xi64, #shared1, #smem, mutable>\n"
          "%n = ttg.local_alloc : () -> !ttg.memdesc<3x32x64xbf16, #shared, #smem, mutable>\n")
    assert attention_sass.key_buffers(ir, 128) == 2  # the whole blocks' tile, not the page indices or new frames'
    assert attention_sass.key_buffers(ir, 256) == 0
    words = "%w = ttg.local_alloc : () -> !ttg.memdesc<3x128x16xi32, #shared2, #smem, mutable>\n"
    assert attention_sass.key_buffers(words, 128) == 3  # fp8 pages' tile, read as words of 4 values


def test_more_stages_keep_more_blocks_of_keys_in_flight():
    # the pipeliner's buffers follow the stages; the served launch's count is what the tool reports for it
    few, more = (attention_sass.report(pa.BLOCK_T, pa.NUM_WARPS, s, "auto", 90)["key_buffers"] for s in (3, 7))
    assert more > few
