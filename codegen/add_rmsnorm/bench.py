"""Contenders for benchmarks/kernel_table.py's per-kernel table: this family's case at a model's
prefill shape, the unmodified Hugging Face code taking the family's inputs, and Liger-Kernel's
kernel for the op (0.8.5, called as its HF patches call it).

`setup`: the model's config, its HF modeling module and class prefix ("Llama", "Qwen2").
"""

from __future__ import annotations

from codegen.rmsnorm.bench import case as norm_case
from codegen.rmsnorm.bench import hf_norm

IN_TABLE = True


def case(setup: dict, batch: int, seq: int, dtype: str) -> dict:
    return norm_case(setup, batch, seq, dtype)


def hf(setup: dict, inputs: tuple, device: str):
    norm = hf_norm(setup, inputs[-1])

    def add_norm(x, residual, weight):
        hidden = residual + x  # as the decoder layer: residual + attention output, then the norm
        return hidden, norm(hidden)

    return add_norm


def liger(case: dict):
    import liger_kernel.ops as lk

    # LigerFusedAddRMSNorm.forward returns (normed, sum), the family (sum, normed)
    eps = case["eps"]
    return lambda x, r, w: lk.LigerFusedAddRMSNormFunction.apply(x, r, w, eps, 0.0, "llama",
                                                                 False)[::-1]
