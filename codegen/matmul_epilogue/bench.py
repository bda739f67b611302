"""Contenders for benchmarks/kernel_table.py's per-kernel table: this family's case at a model's
prefill shape, the unmodified Hugging Face code taking the family's inputs, and Liger-Kernel's
kernel for the op (0.8.5, called as its HF patches call it).

`setup`: the model's config, its HF modeling module and class prefix ("Llama", "Qwen2").
"""

from __future__ import annotations

import torch

from codegen.gated_act.bench import act_fn, act_kind, liger_mul, packed
from codegen.matmul_epilogue.reference import gated_gemm, make_case

IN_TABLE = False  # compute-bound: on request only (its copy column is no ceiling)


def case(setup: dict, batch: int, seq: int, dtype: str) -> dict:
    rows = batch * seq
    cfg = setup["config"]
    return make_case(rows, cfg.hidden_size, cfg.intermediate_size, dtype, act_kind(setup),
                     weights="packed" if packed(setup) else None)


def hf(setup: dict, inputs: tuple, device: str):
    if packed(setup):  # Phi3MLP's own steps, which the reference takes for packed halves
        act = act_kind(setup)
        return lambda x, wg, wu: gated_gemm(x, wg, wu, act)
    act, linear = act_fn(setup), torch.nn.functional.linear
    # MLP.forward up to down_proj, cuBLAS for the projections
    return lambda x, wg, wu: act(linear(x, wg)) * linear(x, wu)


def liger(case: dict):
    mul, linear = liger_mul(case), torch.nn.functional.linear  # Liger's MLP up to down_proj
    return lambda x, wg, wu: mul(linear(x, wg), linear(x, wu))
