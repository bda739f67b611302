"""Probe: why is Liger-Kernel's rotary kernel ahead of ours on Qwen2.5-0.5B b8 (12.8 against
13.6 us in run 6) when both rotate q and k in place, one position per program?

Three differences remain between the two kernels, and this times each on its own, in one
process, at the models' prefill shapes (bf16, in place, L2 flushed per repetition):

- table: Liger reads only the first half of each cos/sin row (HF builds the table as
  cat(freqs, freqs), so the halves are equal); ours reads both halves;
- addressing: Liger addresses a position's heads with compile-time strides (a contiguous
  (heads, head_dim) row); ours takes every stride at run time;
- index width: ours computes row offsets in int64, which costs a 64-bit division per program.

`_rope_rows` below is written for this probe with each difference as a flag; `ours` is the
pipeline's own rendered kernel (split layout), `liger` Liger's autograd function. Each variant is
checked against the HF reference before it is timed.

Usage: python3 benchmarks/probes/rope_probe.py OUT.json (on a machine without a GPU, under
TRITON_INTERPRET=1, it checks every variant on a small shape and times nothing).
"""

from __future__ import annotations

import itertools
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl

MODELS = {"llama-3.2-1b": (32, 8, 64), "qwen2.5-0.5b": (14, 2, 64)}  # heads, kv heads, dim
BATCH, SEQ = 8, 1024


@triton.jit
def _rotate(x_ptr, offs, mask, c1, c2, s1, s2, HALF: tl.constexpr, NATIVE: tl.constexpr):
    x1 = tl.load(x_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + offs + HALF, mask=mask, other=0.0)
    if not NATIVE:
        x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(x_ptr + offs, (x1 * c1 - x2 * s1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(x_ptr + offs + HALF, (x2 * c2 + x1 * s2).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_rows(q_ptr, k_ptr, cos_ptr, sin_ptr, seq_len, q_row, k_row, q_sh, k_sh,
               HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, HALF_TABLE: tl.constexpr,
               CONST_STRIDES: tl.constexpr, INT64: tl.constexpr, NATIVE: tl.constexpr):
    HALF: tl.constexpr = HEAD_DIM // 2
    row = tl.program_id(0)
    if INT64:
        row = row.to(tl.int64)
    pos = row % seq_len
    dims = tl.arange(0, HALF)[None, :]
    c1 = tl.load(cos_ptr + pos * HEAD_DIM + dims)
    s1 = tl.load(sin_ptr + pos * HEAD_DIM + dims)
    if HALF_TABLE:
        c2, s2 = c1, s1
    else:
        c2 = tl.load(cos_ptr + pos * HEAD_DIM + HALF + dims)
        s2 = tl.load(sin_ptr + pos * HEAD_DIM + HALF + dims)
    if not NATIVE:
        c1, c2, s1, s2 = c1.to(tl.float32), c2.to(tl.float32), s1.to(tl.float32), s2.to(tl.float32)
    qh = tl.arange(0, BLOCK_Q)[:, None]
    kh = tl.arange(0, BLOCK_K)[:, None]
    if CONST_STRIDES:
        q_offs, k_offs = qh * HEAD_DIM + dims, kh * HEAD_DIM + dims
    else:
        q_offs, k_offs = qh * q_sh + dims, kh * k_sh + dims
    _rotate(q_ptr + row * q_row, q_offs, qh < HEADS, c1, c2, s1, s2, HALF, NATIVE)
    _rotate(k_ptr + row * k_row, k_offs, kh < KV_HEADS, c1, c2, s1, s2, HALF, NATIVE)


def rows_kernel(q, k, cos, sin, flags, warps):
    heads, kv, d = q.shape[1], k.shape[1], q.shape[3]
    _rope_rows[(q.shape[0] * q.shape[2],)](
        q, k, cos, sin, q.shape[2], q.stride(2), k.stride(2), q.stride(1), k.stride(1),
        HEADS=heads, KV_HEADS=kv, HEAD_DIM=d, BLOCK_Q=triton.next_power_of_2(heads),
        BLOCK_K=triton.next_power_of_2(kv), num_warps=warps, **flags)


def main(out_path: str) -> None:
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRotaryEmbedding

    from codegen.registry import get_family
    from codegen.rope.reference import apply_rotary, make_case
    from core.source import load_forward
    from verify.timing import bench, copy_reference

    gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if gpu else "cpu")
    # the CPU interpreter's bf16 arithmetic is wrong (codegen/rope/kernel.py): fp16 there
    batch, seq, dtype = (BATCH, SEQ, torch.bfloat16) if gpu else (2, 5, torch.float16)
    family = get_family("rope")
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        LigerRopeFunction = None
    results = {"versions": {"torch": torch.__version__, "triton": triton.__version__,
                            "device": torch.cuda.get_device_name() if gpu else "cpu"}, "models": {}}
    tmp = Path(tempfile.mkdtemp())
    for model, (heads, kv, d) in MODELS.items():
        gen = torch.Generator(device=dev).manual_seed(0)
        q_mem = torch.randn(batch, seq, heads, d, device=dev, generator=gen, dtype=dtype)
        k_mem = torch.randn(batch, seq, kv, d, device=dev, generator=gen, dtype=dtype)
        rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=heads * d, num_attention_heads=heads,
                                                  head_dim=d)).to(dev)
        cos, sin = rotary(q_mem, torch.arange(seq, device=dev)[None])
        q0, k0 = q_mem.transpose(1, 2), k_mem.transpose(1, 2)
        want = apply_rotary(q0.float(), k0.float(), cos.float(), sin.float())
        case = make_case(batch, seq, heads, kv, d, d, str(dtype).removeprefix("torch."))
        nbytes = family.min_bytes(case)
        variants = {}
        combos = [(h, c, 1, n) for h, c, n in itertools.product((0, 1), repeat=3)] + [(1, 1, 0, 1)]
        for warps, (half, const, i64, native) in itertools.product((1, 2, 4), combos):
            flags = dict(HALF_TABLE=half, CONST_STRIDES=const, INT64=i64, NATIVE=native)
            name = f"rows w{warps} " + " ".join(k for k, v in flags.items() if v)
            variants[name] = (lambda q, k, c, s, f=flags, w=warps: rows_kernel(q, k, c, s, f, w))
        for cfg in family.search_space(case):
            if cfg.get("SPLIT") and cfg["BLOCK_S"] == 1:
                for warps in (1, 2, 4):
                    c = {**cfg, "num_warps": warps}
                    path = tmp / f"{model}-{len(variants)}.py"
                    path.write_text(family.render(c, case))
                    fwd = load_forward(path)
                    variants[f"ours {json.dumps(c)}"] = (
                        lambda q, k, c, s, f=fwd: f(q, k, c, s, out=(q, k)))
        if LigerRopeFunction is not None:
            variants["liger"] = lambda q, k, c, s: LigerRopeFunction.apply(q, k, c, s)
        rows = {"copy": copy_reference(nbytes, dev).to_dict() if gpu else {"median_ms": 0.0}}
        for name, fn in variants.items():
            q, k = q_mem.clone().transpose(1, 2), k_mem.clone().transpose(1, 2)
            try:
                fn(q, k, cos, sin)
                if gpu:
                    torch.cuda.synchronize()
                err = max((q.float() - want[0]).abs().max().item(),
                          (k.float() - want[1]).abs().max().item())
                if err > 0.1:
                    rows[name] = {"status": f"wrong: max abs error {err:.3g}"}
                    continue
                timed = bench(lambda f=fn, a=(q, k, cos, sin): f(*a), device=dev,
                              min_bytes=nbytes).to_dict() if gpu else {"median_ms": 0.0}
                rows[name] = {"status": "ok", **timed}
            except Exception as e:  # noqa: BLE001 - a failing variant is a result
                rows[name] = {"status": f"error: {type(e).__name__}: {e}"[:200]}
        results["models"][model] = rows
        ok = sorted((r["median_ms"] * 1e3, n) for n, r in rows.items() if r.get("status", "ok")
                    == "ok")
        print(f"## {model}: copy {rows['copy']['median_ms'] * 1e3:.1f} us")
        for us, n in ok[:12] + [x for x in ok if x[1] == "liger" or x[1].startswith("ours")][:6]:
            print(f"  {us:7.2f}  {n}")
    Path(out_path).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
