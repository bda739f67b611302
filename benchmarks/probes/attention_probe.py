"""Probe for the attention family's NaN on the GPU (issue 4): the verifier's "mixed" stress
(magnitudes 2^-32..2^32 in q, k and v) made every config return NaN from the second query
block on, where SDPA stays finite; the Triton interpreter does not reproduce it.

This runs the kernel (with the family's launch options) on the same stressed inputs under
each dot precision and pipelining depth, and reports non-finite outputs and the largest error
against fp32 SDPA. Cause found with it: FMA contraction of `score * scale - row max` (see
codegen/attention/kernel.py, LAUNCH_OPTIONS).
GPU only. Usage: python3 benchmarks/probes/attention_probe.py OUT.json
"""

from __future__ import annotations

import itertools
import json
import sys

import torch
import triton


def main(out_path: str) -> None:
    from codegen.attention import FAMILY
    from codegen.attention.kernel import LAUNCH_OPTIONS, LOG2E, _attn_fwd_kernel, block_d
    from codegen.attention.reference import make_case
    from verify.numerics import apply_stress

    case = make_case(1, 512, 32, 8, 64, "bfloat16")
    rows = []
    for kind in ("random", "mixed"):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = FAMILY.make_inputs(case, "cuda", gen)[:3]
        if kind != "random":
            apply_stress((q, k, v), (0, 1, 2), kind, 5476726326639965706)
        scale = q.shape[-1] ** -0.5
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1),
            is_causal=True, scale=scale).transpose(1, 2)
        for (bm, bn, warps, stages), (qk, pv) in itertools.product(
                [(64, 32, 4, 1), (64, 32, 4, 2), (128, 64, 8, 3)],
                [("tf32", "tf32x3"), ("tf32", "tf32"), ("tf32", "ieee")]):
            out = torch.full((1, 512, 32, 64), float("nan"), device="cuda", dtype=q.dtype)
            o = out.transpose(1, 2)
            grid = (triton.cdiv(512, bm), 32)
            try:
                _attn_fwd_kernel[grid](q, k, v, o, 512, 32, 4, scale * LOG2E, *q.stride(),
                                       *k.stride(), *v.stride(), *o.stride(), HEAD_DIM=64,
                                       BLOCK_D=block_d(64), BLOCK_M=bm, BLOCK_N=bn,
                                       QK_PRECISION=qk, PV_PRECISION=pv, num_warps=warps,
                                       num_stages=stages, **LAUNCH_OPTIONS)
                torch.cuda.synchronize()
                bad = ~torch.isfinite(out.float())
                first = bad.nonzero()[0].tolist() if bad.any() else None
                err = (out.float() - ref).abs()[~bad].max().item() if (~bad).any() else None
                row = {"kind": kind, "config": [bm, bn, warps, stages], "qk": qk, "pv": pv,
                       "nonfinite": int(bad.sum()), "first_nonfinite": first,
                       "max_abs_err_finite": err,
                       "ref_max_abs": ref.abs().max().item()}
            except Exception as e:  # noqa: BLE001 - a failing combination is a result
                row = {"kind": kind, "config": [bm, bn, warps, stages], "qk": qk, "pv": pv,
                       "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(json.dumps(row))
    with open(out_path, "w") as f:
        json.dump({"case": case, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
