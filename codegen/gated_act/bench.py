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
    layout = "packed" if packed(setup) else "separate"
    return make_case(rows, setup["config"].intermediate_size, dtype, act_kind(setup), layout)


def mlp_of(setup: dict):
    """The model's MLP module, built on meta (its weights' values are not needed)."""
    with torch.device("meta"):
        return getattr(setup["module"], setup["prefix"] + "MLP")(setup["config"])


def packed(setup: dict) -> bool:
    """Phi-3's form: one gate_up_proj weight, the gate's rows then the up's."""
    return hasattr(mlp_of(setup), "gate_up_proj")


def act_fn(setup: dict):
    """The MLP's own activation module: `act_fn` (Llama, Qwen2, Gemma) or `activation_fn`
    (Phi-3)."""
    mlp = mlp_of(setup)
    return getattr(mlp, "act_fn", None) or mlp.activation_fn


def act_kind(setup: dict) -> str:
    """"silu" or "gelu_tanh" (Gemma's GeGLU), as the family's patch reads the module."""
    from codegen.gated_act.patch import activation_kind

    act = act_fn(setup)
    kind = activation_kind(act)
    if kind is None:
        raise LookupError(f"n/a: {type(act).__name__} is no gated activation we fuse")
    return kind


def hf(setup: dict, inputs: tuple, device: str):
    act = act_fn(setup)
    if len(inputs) == 1:  # Phi3MLP.forward: the product on the halves of gate_up_proj's output
        def product(gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return up * act(gate)
        return product
    return lambda gate, up: act(gate) * up  # as MLP.forward: act_fn(gate_proj) * up_proj


def liger_mul(case: dict):
    """Liger's gated product for the case's activation: LigerSwiGLUMLP's and LigerGEGLUMLP's."""
    import liger_kernel.ops as lk

    return (lk.LigerSiLUMulFunction if case["act"] == "silu" else lk.LigerGELUMulFunction).apply


def liger(case: dict):
    if case["layout"] == "packed":  # LigerPhi3SwiGLUMLP fuses gate_up_proj too: not this op
        raise LookupError("n/a: Liger has no kernel for the product of packed halves alone")
    return liger_mul(case)
