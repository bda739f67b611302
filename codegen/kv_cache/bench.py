"""Contenders for benchmarks/kernel_table.py's per-kernel table: this family's case at a model's
prefill shape, the unmodified Hugging Face code taking the family's inputs, and Liger-Kernel's
kernel for the op (0.8.5, called as its HF patches call it).

`setup`: the model's config, its HF modeling module and class prefix ("Llama", "Qwen2").
"""

from __future__ import annotations

from codegen.kv_cache.reference import make_case

IN_TABLE = True


def case(setup: dict, batch: int, seq: int, dtype: str) -> dict:
    """The prefill's append of k and v to an empty cache layer."""
    cfg = setup["config"]
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return make_case(batch, cfg.num_key_value_heads, head_dim, 0, seq, dtype)


def hf(setup: dict, inputs: tuple, device: str):
    from transformers.cache_utils import DynamicLayer

    return lambda keys, values, k, v: DynamicLayer().update(k, v)  # a fresh layer per call


def liger(case: dict):
    raise LookupError("n/a: Liger-Kernel has no KV-cache kernel")
