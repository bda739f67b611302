"""Decode projections (a few rows times a weight) as a Triton GEMV against cuBLAS, inside CUDA
graphs (GPU).

    python benchmarks/probes/gemv.py [OUT.json]

For Llama-3.2-1B's and Qwen2.5-0.5B's projection shapes at 1 (and 8) rows: cuBLAS (F.linear) and
a Triton GEMV over a grid of tiles and K splits, each timed as 40 back-to-back calls captured in
one graph (what a graphed decode step pays per projection: its kernel and its node), max error
against F.linear. The answer says whether a GEMV family can beat cuBLAS where the decode census
found it at 0.4-1.5 TB/s (k/v and q/o projections) and which tiles win.
"""

from __future__ import annotations

import functools
import itertools
import json
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, o_ptr, ws_ptr, M, N, K, k_chunk,
                 x_sm, x_sk, w_sn, w_sk, o_sm, o_sn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok = offs_n < N
    m_ok = offs_m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    lo = split * k_chunk
    hi = tl.minimum(lo + k_chunk, K)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hi
        w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * w_sn + offs_k[None, :] * w_sk,
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * x_sm + offs_k[None, :] * x_sk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(o_ptr + offs_m[:, None] * o_sm + offs_n[None, :] * o_sn,
                 acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(ws_ptr + (split * BLOCK_M + offs_m[:, None]) * N + offs_n[None, :], acc,
                 mask=n_ok[None, :])


@triton.jit
def _split_sum_kernel(ws_ptr, b_ptr, o_ptr, M, N, o_sm, o_sn, BLOCK_M: tl.constexpr,
                      BLOCK: tl.constexpr, SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < N
    for m in range(0, M):
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(SPLIT_K):
            acc += tl.load(ws_ptr + (s * BLOCK_M + m) * N + offs_n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(o_ptr + m * o_sm + offs_n * o_sn, acc.to(o_ptr.dtype.element_ty), mask=n_ok)


def gemv(x, w, b, *, out, ws, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages):
    M, K = x.shape
    N = w.shape[0]
    bm = max(1, triton.next_power_of_2(M))
    k_chunk = triton.cdiv(triton.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    _gemv_kernel[(triton.cdiv(N, BLOCK_N), SPLIT_K)](
        x, w, b if b is not None else x, out, ws, M, N, K, k_chunk, x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), out.stride(0), out.stride(1), BLOCK_M=bm, BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K, SPLIT_K=SPLIT_K, HAS_BIAS=b is not None, num_warps=num_warps,
        num_stages=num_stages)
    if SPLIT_K > 1:
        _split_sum_kernel[(triton.cdiv(N, 1024),)](
            ws, b if b is not None else x, out, M, N, out.stride(0), out.stride(1), BLOCK_M=bm,
            BLOCK=1024, SPLIT_K=SPLIT_K, HAS_BIAS=b is not None, num_warps=4)


CALLS = 40


def _rotating(fn, x, weights, b):
    """fn(x, w, b) over the weight copies in turn, one per call."""
    state = {"i": 0}

    def call():
        w = weights[state["i"] % len(weights)]
        state["i"] += 1
        return fn(x, w, b)
    return call


def graphed_us(fn, calls=CALLS, reps=20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    times.sort()
    del g
    return times[len(times) // 2]


SHAPES = {  # name: (K, N, bias)
    "llama q/o": (2048, 2048, False), "llama k/v": (2048, 512, False),
    "llama gate/up": (2048, 8192, False), "llama down": (8192, 2048, False),
    "llama lm_head": (2048, 128256, False),
    "qwen q": (896, 896, True), "qwen k/v": (896, 128, True), "qwen gate/up": (896, 4864, False),
    "qwen down": (4864, 896, False), "qwen lm_head": (896, 151936, False),
}
CONFIGS = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=4, num_stages=3)
           for bn, bk, sk in itertools.product((4, 8, 16, 32), (256, 512), (1, 2, 4))]


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    rows_list = [int(r) for r in (sys.argv[2].split(",") if len(sys.argv) > 2 else ("1",))]
    result = []
    for (name, (k, n, bias)), rows in itertools.product(SHAPES.items(), rows_list):
        if rows > 1 and "lm_head" in name:
            continue
        x = torch.randn(rows, k, device=dev, dtype=dt)
        # as many weight copies as take 3x the L2 (50 MB): each call reads a cold weight, as a
        # decode step does (it reads every weight once), not one the last call left in L2
        copies = max(1, min(CALLS, -(-150 * 2**20 // (n * k * 2))))
        ws_ = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
        b = torch.randn(n, device=dev, dtype=dt) if bias else None
        w = ws_[0]
        want = torch.nn.functional.linear(x, w, b)
        cublas = graphed_us(_rotating(torch.nn.functional.linear, x, ws_, b))
        out = torch.empty(rows, n, device=dev, dtype=dt)
        ws = torch.empty(8 * max(1, triton.next_power_of_2(rows)) * n, device=dev,
                         dtype=torch.float32)
        best = None
        for cfg in CONFIGS:
            if cfg["SPLIT_K"] * cfg["BLOCK_K"] > k:
                continue
            try:
                gemv(x, w, b, out=out, ws=ws, **cfg)
                torch.cuda.synchronize()
                err = (out.float() - want.float()).abs().max().item()
                us = graphed_us(_rotating(functools.partial(gemv, out=out, ws=ws, **cfg),
                                          x, ws_, b))
            except Exception as e:  # a tile the compiler rejects: skip it, say which
                print(f"  {name} {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            if best is None or us < best[0]:
                best = (us, cfg, err)
        nbytes = n * k * 2
        row = {"shape": name, "rows": rows, "k": k, "n": n, "cublas_us": round(cublas, 2),
               "cublas_TBps": round(nbytes / cublas / 1e6, 2), "triton_us": round(best[0], 2),
               "triton_TBps": round(nbytes / best[0] / 1e6, 2), "config": best[1],
               "max_err": best[2], "ratio": round(cublas / best[0], 3)}
        result.append(row)
        print(json.dumps(row), flush=True)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
