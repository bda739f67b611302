"""Probe: is a matmul with the gated activation fused into its epilogue worth building?

The gate and up projections of a SwiGLU MLP write two (tokens, intermediate) tensors that the
activation reads back; a dual GEMM that keeps both accumulators on chip and writes
silu(gate) * up once saves that traffic and a launch, but only pays if a Triton GEMM stays
close enough to cuBLAS. This times, at the models' prefill shapes (bf16, L2 flushed by
triton.testing.do_bench):

- eager: F.linear(x, Wg), F.linear(x, Wu), silu(gate) * up (what HF runs);
- cuBLAS + fused activation: the two linears, then the pipeline's gated_act kernel
  (codegen/gated_act, flat 2048-element blocks, its best config on the H200);
- Triton dual GEMM with the activation in the epilogue, over a few tile shapes;
- the same with TMA tensor descriptors (Hopper's bulk copies into shared memory), one program
  per tile and persistent (one program per SM looping over tiles);
- cuBLAS over the fused [gate; up] weight plus our activation on its two halves: what the
  gated_act adapter runs (`GateUp`), the real competitor.

Prefill shapes (8192 tokens) and batch-1 ones (128 tokens, and 8: a few decode steps).

GPU only. Usage: python3 benchmarks/probes/epilogue_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SHAPES = {"llama-3.2-1b": (8192, 2048, 8192), "qwen2.5-0.5b": (8192, 896, 4864),
          "llama-3.2-1b-b1": (128, 2048, 8192), "qwen2.5-0.5b-b1": (128, 896, 4864),
          "llama-3.2-1b-m8": (8, 2048, 8192)}  # M, K, N
TMA_TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (128, 64, 128, 8, 3),
             (64, 128, 64, 4, 4), (256, 64, 64, 8, 3), (128, 128, 32, 8, 5), (64, 64, 128, 4, 4)]
SMALL_TILES = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 64, 4, 4), (16, 128, 128, 4, 3),
               (64, 128, 64, 4, 4)]
TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4),
         (128, 128, 32, 8, 4)]


@triton.jit
def _dual_gemm_swiglu(x_ptr, wg_ptr, wu_ptr, o_ptr, M, N, K, sxm, sxk, swn, swk, som, son,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    # grouped order: neighbouring programs share weight tiles in L2
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * n_n)) % size_m
    pid_n = (pid % (GROUP_M * n_n)) // size_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w_mask = (kk[:, None] < K) & (rn[None, :] < N)
        bg = tl.load(wg_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=w_mask, other=0.0)
        bu = tl.load(wu_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=w_mask, other=0.0)
        acc_g = tl.dot(a, bg, acc_g)
        acc_u = tl.dot(a, bu, acc_u)
    out = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(o_ptr + rm[:, None] * som + rn[None, :] * son, out.to(o_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _dual_gemm_swiglu_tma(x_desc, wg_desc, wu_desc, o_desc, M, N, K, BM: tl.constexpr,
                          PROGRAMS, BN: tl.constexpr, BK: tl.constexpr,
                          GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    """Tiles of x, Wg, Wu arrive through TMA descriptors; PROGRAMS programs loop over the
    output tiles (PROGRAMS = number of tiles: one program per tile)."""
    n_m, n_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), n_m * n_n, PROGRAMS):
        group = tile // (GROUP_M * n_n)
        first_m = group * GROUP_M
        size_m = min(n_m - first_m, GROUP_M)
        pid_m = first_m + (tile % (GROUP_M * n_n)) % size_m
        pid_n = (tile % (GROUP_M * n_n)) // size_m
        off_m, off_n = pid_m * BM, pid_n * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for ki in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            a = x_desc.load([off_m, ki * BK])
            acc_g = tl.dot(a, wg_desc.load([off_n, ki * BK]).T, acc_g)
            acc_u = tl.dot(a, wu_desc.load([off_n, ki * BK]).T, acc_u)
        out = acc_g * tl.sigmoid(acc_g) * acc_u
        o_desc.store([off_m, off_n], out.to(o_desc.dtype))


def dual_gemm_tma(x, wg, wu, out, bm, bn, bk, warps, stages, persistent):
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = wg.shape[0]
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    programs = min(tiles, torch.cuda.get_device_properties(0).multi_processor_count) \
        if persistent else tiles
    _dual_gemm_swiglu_tma[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(wg, [bn, bk]),
        TensorDescriptor.from_tensor(wu, [bn, bk]), TensorDescriptor.from_tensor(out, [bm, bn]),
        M, N, K, BM=bm, PROGRAMS=programs, BN=bn, BK=bk, GROUP_M=8, STAGES=stages,
        num_warps=warps)


def dual_gemm(x, wg, wu, out, bm, bn, bk, warps, stages):
    M, K = x.shape
    N = wg.shape[0]
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    _dual_gemm_swiglu[grid](x, wg, wu, out, M, N, K, x.stride(0), x.stride(1), wg.stride(0),
                            wg.stride(1), out.stride(0), out.stride(1), BM=bm, BN=bn, BK=bk,
                            GROUP_M=8, num_warps=warps, num_stages=stages)


def probe(M: int, K: int, N: int) -> dict:
    from codegen.gated_act.kernel import gated_act_forward

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    wg = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    wu = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * K ** -0.5
    ref = F.silu(F.linear(x, wg)) * F.linear(x, wu)
    hidden = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def eager():
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)

    def cublas_fused():
        gate, up = F.linear(x, wg), F.linear(x, wu)
        gated_act_forward(gate, up, out=hidden, BLOCK=2048, num_warps=8, FLAT=True)

    w_gu = torch.cat([wg, wu])

    def cublas_gate_up():  # the gated_act adapter's path: one GEMM over [gate; up]
        gu = F.linear(x, w_gu)
        gated_act_forward(gu[:, :N], gu[:, N:], out=hidden, BLOCK=2048, num_warps=8, FLAT=True)

    def gemms_only():
        F.linear(x, wg)
        F.linear(x, wu)

    row = {"M": M, "K": K, "N": N,
           "eager_us": triton.testing.do_bench(eager) * 1e3,
           "cublas_two_linears_us": triton.testing.do_bench(gemms_only) * 1e3,
           "cublas_plus_gated_act_us": triton.testing.do_bench(cublas_fused) * 1e3,
           "cublas_gate_up_plus_gated_act_us": triton.testing.do_bench(cublas_gate_up) * 1e3,
           "triton_dual_gemm": [], "triton_dual_gemm_tma": []}
    for tile in TMA_TILES if M > 256 else SMALL_TILES:
        for persistent in (False, True):
            out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            entry = {"tile": tile, "persistent": persistent}
            try:
                def call(out=out, tile=tile, persistent=persistent):
                    dual_gemm_tma(x, wg, wu, out, *tile, persistent)
                call()
                entry["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
                entry["us"] = triton.testing.do_bench(call) * 1e3
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            row["triton_dual_gemm_tma"].append(entry)
    for tile in TILES if M > 256 else SMALL_TILES:
        out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        try:
            dual_gemm(x, wg, wu, out, *tile)
            err = (out.float() - ref.float()).abs().max().item()
            us = triton.testing.do_bench(lambda out=out, tile=tile: dual_gemm(
                x, wg, wu, out, *tile)) * 1e3
            row["triton_dual_gemm"].append({"tile": tile, "us": us, "max_abs_err": err})
        except Exception as e:  # noqa: BLE001 - a tile that does not fit is a result
            row["triton_dual_gemm"].append({"tile": tile, "error": str(e)[:200]})
    row["tflops_two_linears"] = 2 * 2 * M * K * N / row["cublas_two_linears_us"] / 1e6
    timed = [e for e in row["triton_dual_gemm"] + row["triton_dual_gemm_tma"] if "us" in e]
    row["best_triton_us"] = min((e["us"] for e in timed), default=None)
    return row


def main(out_path: str) -> None:
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "triton": triton.__version__, "models": {}}
    for model, shape in SHAPES.items():
        r = results["models"][model] = probe(*shape)
        print(model, {k: v for k, v in r.items() if not k.startswith("triton_dual")})
    with open(out_path, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
