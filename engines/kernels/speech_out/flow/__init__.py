"""Triton fusions for the codec's CFM estimator (GPU only; engines/speech_out/flow/estimator.py dispatches), by
kernel family: `norms` (LayerNorm tails), `conv` (causal convolutions), `gemm` (GEMMs with a LayerNorm prologue or a
residual epilogue), `attention` (the short window's attention), on the launch settings of `common`.

The estimator runs ~1300 tiny kernels per call at streaming batch sizes, so launch latency dominates. These fuse
the elementwise tails around its LayerNorms. Rounding order follows the torch path (float32 math, rounded to the
activation dtype wherever the torch path stores a tensor), so GPU and CPU agree to bf16 rounding.

Strides are specialized (Triton compiles a variant per stride divisible by 16 or not): the estimator's are, so
the row loads of the convs and the window attention are vectorized. Unspecialized batch and time strides (before
2026-11-24) cost the solve graph ~9% at every batch on an H200 (batch 1 10.84 -> 9.94 ms, 32 sessions 31.6 -> 28.6),
bit-identical output. Row counts (M, T) stay unspecialized.

At streaming sizes (<= PDL_MAX_ROWS rows) the kernels launch with programmatic dependent launch
(engines/kernels/pdl.py): each reads its weights, which nothing in a solve writes, before waiting for the kernel
before it, so the weights' HBM latency and the launch overlap that kernel's tail.
The estimator keeps its [B, C, T] activations in time-major memory ([B, T, C] dense, strides (T*C, 1, C)), the layout
the transformer blocks and these kernels read without copies. Inputs may be strided (a transposed view): no
.contiguous() copies.

This package's modules import Triton; the package itself does not, so CPU-only code can name it.
"""
