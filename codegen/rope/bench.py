"""Contenders for benchmarks/kernel_table.py's per-kernel table: this family's case at a model's
prefill shape, the unmodified Hugging Face code taking the family's inputs, and Liger-Kernel's
kernel for the op (0.8.5, called as its HF patches call it).

`setup`: the model's config, its HF modeling module and class prefix ("Llama", "Qwen2").
"""

from __future__ import annotations

import torch

from codegen.rope.patch import builds_equal_halves
from codegen.rope.reference import make_case

IN_TABLE = True


def case(setup: dict, batch: int, seq: int, dtype: str) -> dict:
    cfg = setup["config"]
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    # the model's rotary embedding decides the case, as in the pipeline's recorded case
    halves = builds_equal_halves(getattr(setup["module"], setup["prefix"] + "RotaryEmbedding"))
    return make_case(batch, seq, heads, kv, head_dim, head_dim, dtype, equal_halves=halves)


def model_inputs(setup: dict, case: dict, inputs: tuple, device: str) -> tuple:
    """cos/sin from the model's own rotary embedding at positions 0..seq-1."""
    rotary = getattr(setup["module"], setup["prefix"] + "RotaryEmbedding")(setup["config"])
    positions = torch.arange(case["seq"], device=device)[None]
    return (*inputs[:2], *rotary.to(device)(inputs[0], positions))


def hf(setup: dict, inputs: tuple, device: str):
    return setup["module"].apply_rotary_pos_emb


def liger(case: dict):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return liger_rotary_pos_emb  # rotates q and k in place; checked on copies


def impl(device) -> str:
    """Which implementation Liger's dispatch chose for rope on `device`."""
    from liger_kernel.backends import resolve_impl

    return resolve_impl("rope", device=device).impl_name
