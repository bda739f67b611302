"""Contenders for benchmarks/kernel_table.py's per-kernel table: this family's case at a model's
prefill shape, the unmodified Hugging Face code taking the family's inputs, and Liger-Kernel's
kernel for the op (0.8.5, called as its HF patches call it).

`setup`: the model's config, its HF modeling module and class prefix ("Llama", "Qwen2").
"""

from __future__ import annotations

import torch

from codegen.gated_act.reference import make_case

IN_TABLE = True


def case(setup: dict, batch: int, seq: int, dtype: str) -> dict:
    rows = batch * seq
    return make_case(rows, setup["config"].intermediate_size, dtype, "silu", "separate")


def act_fn(setup: dict):
    """The MLP's own act_fn (its Linear weights are not needed: built on meta)."""
    with torch.device("meta"):
        return getattr(setup["module"], setup["prefix"] + "MLP")(setup["config"]).act_fn


def hf(setup: dict, inputs: tuple, device: str):
    act = act_fn(setup)
    return lambda gate, up: act(gate) * up  # as MLP.forward: act_fn(gate_proj) * up_proj


def liger(case: dict):
    import liger_kernel.ops as lk

    return lambda gate, up: lk.LigerSiLUMulFunction.apply(gate, up)  # LigerSwiGLUMLP's call
