"""Compile decode attention's merging kernels for sm_90 on the CPU and report each one's
registers and the local memory it spills to (cuobjdump -res-usage on the cubin), with the heads
`merge_heads` merges at once (tests/codegen/test_decode_attention.py runs this in a process of
its own: the test process runs Triton's interpreter, whose kernels cannot be compiled).

    python tests/codegen/decode_merge_regs.py   # prints one JSON object: {name: usage}

The cases are the heaviest of the family's space: the FUSED split kernel with the most
registers before its merge (8 x 64 at 4 warps) and at 32 splits on 2 warps (Qwen2.5-0.5B's group
of 7), the combine kernel at 32 splits with a group of 7, in chunks and (over the bound) whole.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from codegen.decode_attention.kernel import (
    COMBINE_WARPS,
    _decode_combine_kernel,
    _decode_split_kernel,
    merge_heads,
)

sys.path.insert(0, str(Path(__file__).parent))
from pdl_ptx import DECODE_POINTERS, DECODE_SPLIT, signature  # noqa: E402

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
# name -> (kernel, SPLITS, BLOCK_N, warps, group, head_dim)
CASES = {
    "fused_8x64_w4_g4_d64": (_decode_split_kernel, 8, 64, 4, 4, 64),
    "fused_32x32_w2_g7_d64": (_decode_split_kernel, 32, 32, 2, 7, 64),
    "combine_32_g7_d64": (_decode_combine_kernel, 32, None, COMBINE_WARPS, 7, 64),
}


def usage(kernel, splits: int, block_n: int | None, warps: int, group: int, d: int,
          heads: int | None = None) -> dict:
    """Registers and spilled bytes a thread uses; `heads`: the chunk (merge_heads' by
    default)."""
    heads = heads or merge_heads(group, splits, d, warps)
    consts = dict(HEAD_DIM=d, BLOCK_D=d, BLOCK_G=16, SPLITS=splits, MERGE_G=heads, PDL=False)
    if kernel is _decode_split_kernel:
        consts = {**DECODE_SPLIT, **consts, "BLOCK_N": block_n, "FUSED": True}
        pointers = DECODE_POINTERS
    else:
        pointers = {"part_ptr": "fp32", "ml_ptr": "fp32"}
    src = ASTSource(kernel, signature(kernel, consts, pointers), consts)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": warps, "enable_fp_fusion": False})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        text = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    fields = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", text))
    return {"heads": heads, **{k.lower(): int(v) for k, v in fields.items()}}


def main() -> None:
    out = {name: usage(*case) for name, case in CASES.items()}
    # the combine at twice the bound (a group of 8 at once): spills, so the bound is not loose
    out["combine_32_g7_d64_whole"] = usage(*CASES["combine_32_g7_d64"], heads=8)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
