"""The full-context estimator's paged attention kernel as the GPU would run it, read on any CPU: compiled by Triton
for a Hopper target (no GPU needed: Triton ships ptxas, cuobjdump and nvdisasm), it reports per launch configuration
the registers and shared memory a program takes, so how many programs an SM holds at once, how many blocks of keys
its loads keep in flight (the shared-memory buffers Triton's pipeliner gives a block of keys: with one, a block's
loads are issued after the previous block's products and waited for at once, so the memory latency is not hidden),
and each loop's machine instructions (SASS) by opcode, a loop iteration being one block of keys.

    python3 -m engines.profiling.attention_sass [--configs 128,4,3 64,4,3] [--cache-dtype auto,fp8] [--arch 90]

A config is BLOCK_T,NUM_WARPS,NUM_STAGES of engines/kernels/speech_out/flow/paged_attention.py. The figures are
Triton's for the version installed here; a GPU machine's Triton may schedule differently.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engines.config import kv_torch_dtype
from engines.kernels.cache_value import fp16_dots
from engines.kernels.speech_out.flow import paged_attention as pa

FRAMES, HEADS, HEAD_DIM = 20, 8, 64
POINTERS = {"Q": "q", "PAGES": "pages", "TABLE": "*i64", "NKEYS": "*i64", "NNEW": "*i64", "OUT": "q", "PO": "*fp32",
            "PML": "*fp32"}
REGISTERS_PER_SM, SHARED_PER_SM, SHARED_RESERVED, WARPS_PER_SM = 65536, 233472, 1024, 64  # Hopper
_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)")
_LABEL = re.compile(r"^(\.L_x_\d+):")
# A pipelined load's shared-memory buffers in Triton's GPU IR: `ttg.local_alloc : () -> !ttg.memdesc<NxROWSxCOLSx...`
_BUFFERS = re.compile(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x(\d+)x(\d+)x")
_BACK = re.compile(r"BRA\s+`?\((\.L_x_\d+)\)")


def compile_kernel(block_t: int, warps: int, stages: int, cache_dtype: str, arch: int):
    """The compiled _paged_kernel of one config (no key splits: the batch-64 launch), as Triton builds it."""
    fn = pa._paged_kernel
    pages = "*fp8e4nv" if cache_dtype == "fp8" else "*bf16"
    # the served estimator's bf16 queries over its pages: the dots' dtype as the launch chooses it
    f16 = fp16_dots(torch.empty(0, dtype=torch.bfloat16), torch.empty(0, dtype=kv_torch_dtype(cache_dtype, "bfloat16")))
    const = {"FR": FRAMES, "H": HEADS, "D": HEAD_DIM, "BLOCK_T": block_t, "SPLIT": False, "F16": f16}
    sig, constexprs, aligned = {}, {}, []
    for i, name in enumerate(fn.arg_names):
        if name in POINTERS:
            sig[name] = {"q": "*bf16", "pages": pages}.get(POINTERS[name], POINTERS[name])
            aligned.append(i)
        elif name in const or name.isupper() and hasattr(pa, name):  # other block sizes: the module's, as launched
            sig[name], constexprs[(i,)] = "constexpr", const.get(name, getattr(pa, name, None))
        elif "scale" in name:
            sig[name] = "fp32"
        else:
            sig[name] = "i32"
            if name.startswith("s_"):  # strides: multiples of 16 elements, as Triton specializes them at launch
                aligned.append(i)
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn, sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": stages})


def _tool(name: str) -> str:
    import triton.backends.nvidia as nv

    return os.path.join(os.path.dirname(nv.__file__), "bin", name)


def loops(sass: str) -> list[collections.Counter]:
    """Each loop's opcodes (a backward branch's body), in program order."""
    lines = sass.splitlines()
    at = {}
    found = []
    for n, line in enumerate(lines):
        m = _LABEL.match(line.strip())
        if m:
            at[m.group(1)] = n
        b = _BACK.search(line)
        if b and b.group(1) in at and "@" in line.split("BRA")[0]:  # a conditional branch back: a loop's end
            body = lines[at[b.group(1)]:n + 1]
            found.append(collections.Counter(m.group(1).split(".")[0] for m in map(_OP.search, body) if m))
    return found


def key_buffers(ttgir: str, block_t: int) -> int:
    """The shared-memory buffers of a block of block_t keys (the whole-block loop's, [block_t, HEAD_DIM] values or,
    fp8 pages read as words of 4, [block_t, HEAD_DIM // 4]) in the kernel's GPU IR: how many blocks' loads the
    pipeliner keeps in flight (0: loaded to registers, not pipelined)."""
    tiles = {(block_t, HEAD_DIM), (block_t, HEAD_DIM // 4)}
    return max((int(n) for n, rows, cols in _BUFFERS.findall(ttgir) if (int(rows), int(cols)) in tiles), default=0)


def report(block_t: int, warps: int, stages: int, cache_dtype: str, arch: int) -> dict:
    k = compile_kernel(block_t, warps, stages, cache_dtype, arch)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", path], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = k.metadata.shared
    by_regs = REGISTERS_PER_SM // (-(-regs // 8) * 8 * 32 * warps)
    by_shared = SHARED_PER_SM // (shared + SHARED_RESERVED)
    return {"config": f"{block_t},{warps},{stages}", "cache_dtype": cache_dtype, "registers": regs,
            "shared_bytes": shared, "key_buffers": key_buffers(k.asm["ttgir"], block_t),
            "programs_per_sm": min(by_regs, by_shared, WARPS_PER_SM // warps),
            "loops": [{"instructions": sum(c.values()), "ops": dict(c.most_common())} for c in loops(sass)]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=[f"{pa.BLOCK_T},{pa.NUM_WARPS},{pa.NUM_STAGES}"])
    p.add_argument("--cache-dtype", default="auto", help="comma separated: auto (bf16 pages), fp8")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    args = p.parse_args(argv)
    for cfg in args.configs:
        bt, w, s = (int(x) for x in cfg.split(","))
        for kind in args.cache_dtype.split(","):
            r = report(bt, w, s, kind, args.arch)
            print(f"config {r['config']} {kind:4}: {r['registers']} registers, {r['shared_bytes']} B shared, "
                  f"{r['programs_per_sm']} programs per SM, {r['key_buffers']} buffer(s) a block of keys")
            for i, loop in enumerate(r["loops"]):
                top = " ".join(f"{op} {n}" for op, n in list(loop["ops"].items())[:12])
                print(f"  loop {i}: {loop['instructions']} instructions an iteration: {top}")


if __name__ == "__main__":
    main()
