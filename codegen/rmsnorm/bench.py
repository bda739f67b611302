"""Contenders for benchmarks/kernel_table.py's per-kernel table: this family's case at a model's
prefill shape, the unmodified Hugging Face code taking the family's inputs, and Liger-Kernel's
kernel for the op (0.8.5, called as its HF patches call it).

`setup`: the model's config, its HF modeling module and class prefix ("Llama", "Qwen2").
"""

from __future__ import annotations

import torch

IN_TABLE = True  # in the table by default


def case(setup: dict, batch: int, seq: int, dtype: str) -> dict:
    rows = batch * seq
    cfg = setup["config"]
    return {"rows": rows, "hidden": cfg.hidden_size, "dtype": dtype,
            "eps": float(cfg.rms_norm_eps), "offset": 0.0, "cast_first": True}


def hf_norm(setup: dict, weight: torch.Tensor):
    """The model's own RMSNorm module carrying `weight` (the reference's random weight, so the
    outputs compare)."""
    cfg, mod, prefix = setup["config"], setup["module"], setup["prefix"]
    norm = getattr(mod, prefix + "RMSNorm")(cfg.hidden_size, eps=cfg.rms_norm_eps)
    norm = norm.to(device=weight.device, dtype=weight.dtype)
    norm.weight.data.copy_(weight)
    return norm


def hf(setup: dict, inputs: tuple, device: str):
    norm = hf_norm(setup, inputs[-1])
    return lambda x, weight: norm(x)


def liger(case: dict):
    import liger_kernel.ops as lk

    eps = case["eps"]  # LigerRMSNorm.forward with the settings of the Llama/Qwen2 patch
    return lambda x, w: lk.LigerRMSNormFunction.apply(x, w, eps, 0.0, "llama", True, None)
