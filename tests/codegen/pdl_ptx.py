"""Compile the decode-path kernels for sm_90 on the CPU and report, per kernel, where the
griddepcontrol instructions sit in its PTX (tests/codegen/test_pdl.py runs this in a process
of its own: the test process runs Triton's interpreter, whose kernels cannot be compiled).

    python tests/codegen/pdl_ptx.py   # prints one JSON object: {kernel: facts}
"""

from __future__ import annotations

import inspect
import json
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from codegen.add_rmsnorm.kernel import _add_rms_norm_forward_kernel
from codegen.decode_attention.kernel import _decode_combine_kernel, _decode_split_kernel
from codegen.gemv.kernel import _gemv_kernel, _split_sum_kernel
from codegen.kv_cache.kernel import _kv_static_kernel
from codegen.matmul_epilogue.gemv import _gated_gemv_kernel
from codegen.norm_gate_up.kernel import _norm_gate_up_kernel
from codegen.norm_qkv.kernel import _norm_qkv_kernel
from codegen.qkv_proj.kernel import _qkv_kernel
from codegen.rmsnorm.kernel import _rms_norm_forward_kernel
from codegen.rope.kernel import _rope_forward_kernel, _rope_split_kernel

NORM = dict(HIDDEN=2048, BLOCK=2048, ROWS=1, OFFSET=0.0, CAST_FIRST=True)
ROPE = dict(HEADS=32, KV_HEADS=8, HEAD_DIM=64, HALF=32, BLOCK_S=1, BLOCK_HALF=32,
            BLOCK_PASS=0, HALF_TABLE=False)
DECODE_SPLIT = dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_G=16, BLOCK_N=64, SPLITS=4, LEN_ON_DEVICE=True,
                    HAS_MASK=True, QK_PRECISION="tf32", PV_PRECISION="tf32x3")
DECODE_POINTERS = {"len_ptr": "i64", "mask_ptr": "i8", "part_ptr": "fp32", "ml_ptr": "fp32",
                   "count_ptr": "i32"}
GEMV_POINTERS = {"ws_ptr": "fp32", "count_ptr": "i32"}
# kernel -> (its constexprs at Llama-3.2-1B's decode shapes, pointer dtypes other than bf16)
KERNELS = {
    "gemv": (_gemv_kernel, dict(K=2048, N=2048, K_CHUNK=2048, EVEN_K=True, EVEN_N=True,
                                HAS_BIAS=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512, SPLIT_K=1,
                                ACCUMULATE=True), GEMV_POINTERS),
    # the down projection's FUSED guess: the split sum in the last program of each column block
    "gemv_fused": (_gemv_kernel, dict(K=8192, N=2048, K_CHUNK=2048, EVEN_K=True, EVEN_N=True,
                                      HAS_BIAS=False, BLOCK_M=1, BLOCK_N=16, BLOCK_K=512,
                                      SPLIT_K=4, ACCUMULATE=True, FUSED=True), GEMV_POINTERS),
    # several rows through tensor-core dots (DOT: the rows padded to 16), FUSED split
    "gemv_dot": (_gemv_kernel, dict(K=2048, N=2048, K_CHUNK=1024, EVEN_K=True, EVEN_N=True,
                                    HAS_BIAS=False, BLOCK_M=16, BLOCK_N=16, BLOCK_K=512,
                                    SPLIT_K=2, ACCUMULATE=True, FUSED=True, DOT=True),
                 GEMV_POINTERS),
    "split_sum": (_split_sum_kernel, dict(N=2048, HAS_BIAS=False, BLOCK=512, SPLIT_K=4,
                                          ACCUMULATE=True), {"ws_ptr": "fp32"}),
    "gated_gemv": (_gated_gemv_kernel, dict(HIDDEN=2048, COLS=8192, EVEN_K=True,
                                            GELU_TANH=False, BLOCK_M=1, BLOCK_N=8,
                                            BLOCK_K=512), {}),
    "gated_gemv_dot": (_gated_gemv_kernel, dict(HIDDEN=2048, COLS=8192, EVEN_K=True,
                                                GELU_TANH=False, BLOCK_M=16, BLOCK_N=32,
                                                BLOCK_K=256, DOT=True), {}),
    "qkv": (_qkv_kernel, dict(K=2048, NQ=2048, NK=512, NV=512, Q_BLOCKS=256, K_BLOCKS=64,
                              EVEN_K=True, HAS_BIAS=False, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512),
            {}),
    # DOT: the rows padded to 16 through tensor-core dots
    "qkv_dot": (_qkv_kernel, dict(K=2048, NQ=2048, NK=512, NV=512, Q_BLOCKS=64, K_BLOCKS=16,
                                  EVEN_K=True, HAS_BIAS=False, BLOCK_M=16, BLOCK_N=32,
                                  BLOCK_K=256, DOT=True), {}),
    "norm_qkv": (_norm_qkv_kernel, dict(K=2048, NQ=2048, NK=512, NV=512, Q_BLOCKS=256,
                                        K_BLOCKS=64, EVEN_K=True, HAS_BIAS=False, OFFSET=0.0,
                                        CAST_FIRST=True, BLOCK_M=1, BLOCK_N=8, BLOCK_K=512),
                 {}),
    "norm_qkv_dot": (_norm_qkv_kernel, dict(K=2048, NQ=2048, NK=512, NV=512, Q_BLOCKS=64,
                                            K_BLOCKS=16, EVEN_K=True, HAS_BIAS=False,
                                            OFFSET=0.0, CAST_FIRST=True, BLOCK_M=16,
                                            BLOCK_N=32, BLOCK_K=256, DOT=True), {}),
    "norm_gate_up": (_norm_gate_up_kernel, dict(HIDDEN=2048, COLS=8192, EVEN_K=True,
                                                HAS_RESIDUAL=True, OFFSET=0.0, CAST_FIRST=True,
                                                GELU_TANH=False, BLOCK_M=1, BLOCK_N=8,
                                                BLOCK_K=512), {}),
    "norm_gate_up_dot": (_norm_gate_up_kernel, dict(HIDDEN=2048, COLS=8192, EVEN_K=True,
                                                    HAS_RESIDUAL=True, OFFSET=0.0,
                                                    CAST_FIRST=True, GELU_TANH=False,
                                                    BLOCK_M=16, BLOCK_N=32, BLOCK_K=128,
                                                    DOT=True), {}),
    "decode_split": (_decode_split_kernel, dict(DECODE_SPLIT, FUSED=False), DECODE_POINTERS),
    "decode_fused": (_decode_split_kernel, dict(DECODE_SPLIT, FUSED=True, MERGE_G=4),
                     DECODE_POINTERS),
    "decode_combine": (_decode_combine_kernel, dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_G=16,
                                                    SPLITS=4, MERGE_G=4),
                       {"part_ptr": "fp32", "ml_ptr": "fp32"}),
    "kv_static": (_kv_static_kernel, dict(KV_HEADS=8, HEAD_DIM=64, BLOCK_R=8, BLOCK_D=64,
                                          WRITE_ALL=False, ADVANCE=True),
                  {"pos_ptr": "i64", "ticket_ptr": "i32"}),
    "rmsnorm": (_rms_norm_forward_kernel, NORM, {}),
    "add_rmsnorm": (_add_rms_norm_forward_kernel, NORM, {}),
    "rope": (_rope_forward_kernel, dict(ROPE, BLOCK_H=8), {}),
    "rope_split": (_rope_split_kernel, dict(ROPE, BLOCK_Q=32, BLOCK_K=8, NATIVE=False), {}),
}
FLOATS = ("eps", "qk_scale")


def signature(kernel, constexprs: dict, pointers: dict) -> dict:
    out = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            out[name] = "constexpr"
        elif name.endswith("_ptr") or len(name) == 1:  # the norms name theirs X, W, Y, R, S
            out[name] = "*" + pointers.get(name, "bf16")
        else:
            out[name] = "fp32" if name in FLOATS else "i32"
    return out


def facts(kernel, constexprs: dict, pointers: dict, pdl: bool, prefetch: bool | None = None
          ) -> dict:
    """Where the griddepcontrol instructions sit; PREFETCH (where the kernel takes it) as
    `prefetch`, by default as `pdl` (what the launcher binds)."""
    # the constexprs a launcher leaves at their defaults (FUSED, DOT) as constexprs too, not
    # runtime integers: DOT's two branches build accumulators of two shapes
    defaults = {p.name: p.default for p in inspect.signature(kernel.fn).parameters.values()
                if p.default is not inspect.Parameter.empty}
    consts = {**defaults, **constexprs, "PDL": pdl}
    if "PREFETCH" in inspect.signature(kernel.fn).parameters:
        consts["PREFETCH"] = pdl if prefetch is None else prefetch
    src = ASTSource(kernel, signature(kernel, consts, pointers), consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"].splitlines()

    def first(word: str) -> int | None:
        return next((i for i, line in enumerate(ptx) if word in line), None)

    wait, launch = first("griddepcontrol.wait"), first("griddepcontrol.launch_dependents")
    loads = [i for i, line in enumerate(ptx) if "ld.global" in line]
    stores = [i for i, line in enumerate(ptx) if "st.global" in line or "atom.global" in line]
    fetches = [i for i, line in enumerate(ptx) if "prefetch.global.L2" in line]
    return {"wait": wait, "launch": launch, "prefetches": len(fetches),
            "prefetches_before_wait": sum(i < wait for i in fetches) if wait is not None
            else None,
            "waits": sum("griddepcontrol.wait" in line for line in ptx),
            "loads_before_wait": sum(i < wait for i in loads) if wait is not None else None,
            "stores_before_wait": sum(i < wait for i in stores) if wait is not None else None}


def main() -> None:
    names = sys.argv[1:] or list(KERNELS)
    out = {name: facts(*KERNELS[name], pdl=True) for name in names}
    out["gemv_without_pdl"] = facts(*KERNELS["gemv"], pdl=False)
    out["gemv_without_prefetch"] = facts(*KERNELS["gemv"], pdl=True, prefetch=False)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
