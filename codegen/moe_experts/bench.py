"""Contenders for the per-kernel tables (benchmarks/kernel_table.py on request,
benchmarks/moe_table.py for every experts implementation): this family's case at a model's
shape and the unmodified Hugging Face block (its router, then its experts under an
`experts_implementation`) taking the family's inputs. Liger-Kernel has no MoE kernel.

`setup`: the model's config, its HF modeling module and class prefix.
"""

from __future__ import annotations

from codegen.moe_experts.reference import BIASED, IMPLS, make_case, moe_block, params

IN_TABLE = False  # compute-bound at prefill: on request only (its copy column is no ceiling)


def case(setup: dict, batch: int, seq: int, dtype: str, impl: str = "grouped_mm",
         mode: str = "prefill") -> dict:
    """The block's case for `batch` x `seq` tokens (one per sequence at a decode step)."""
    cfg = setup["config"]
    model_type = cfg.model_type
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    limit = getattr(cfg, "swiglu_limit", None) if model_type in BIASED else None
    alpha = getattr(cfg, "swiglu_alpha", None) if model_type in BIASED else None
    rows = batch * (seq if mode == "prefill" else 1)
    return make_case(rows, cfg.hidden_size, inter, experts, cfg.num_experts_per_tok, dtype,
                     model_type, norm_topk=bool(getattr(cfg, "norm_topk_prob", True)),
                     impl=impl, limit=limit, alpha=alpha)


def hf_option(case_: dict, impl: str):
    """HF's block on the family's inputs under experts implementation `impl`."""
    if impl not in IMPLS:
        raise LookupError(f"n/a: {impl!r} is no experts_implementation of transformers")
    kw = {**params(case_), "impl": impl}
    return lambda *inputs: moe_block(*inputs, **kw)


def hf(setup: dict, inputs: tuple, device: str):
    """The block as the model runs it by default (transformers' grouped_mm)."""
    return hf_option(setup["cases"]["moe_experts"], "grouped_mm")


def liger(case_: dict):
    raise LookupError("n/a: Liger-Kernel has no mixture-of-experts kernel")
