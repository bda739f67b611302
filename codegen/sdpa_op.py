"""Transformers' SDPA attention as one opaque custom op, for a patched model under torch.compile.

Why: Inductor lowers `F.scaled_dot_product_attention` itself, and on Llama-3.2-1B's prefill
(b8 s1024, bf16, H100) the layout it picked for q, k and v made the same cuDNN SDPA kernel
take 4.7 ms a pass against 1.7 ms eager, behind copies into that layout: both compiled
contenders lost about 3 ms to attention, and compiling cost our eager kernels 17 %
(benchmarks/results/export-llama-3.2-1b-prefill-b8-s1024-1207b-h100/h2h.json, its
`top_kernels`, and README "Decode step, mixture of experts, compiled and exported (H100)").
So `apply_kernels(..., compiled=True)` hands Inductor the attention as one op,
`torch.ops.kernel_pipeline.sdpa_attention`, that runs transformers' own
`sdpa_attention_forward` on the tensors eager would give it: same SDPA arguments (mask,
dropout, is_causal, scale, enable_gqa or repeat_kv as that transformers version decides),
so the same SDPA backend as eager. The op is tagged with exact strides, so Inductor passes
q, k and v laid out as eager does instead of copying them into a layout of its own.

How the model reaches it: transformers picks the attention function by the config's
`_attn_implementation` through `AttentionInterface` (and the mask builder through
`AttentionMaskInterface`). `route` registers a function under a project name in both (the
mask function is the one "sdpa" has, so the masks are SDPA's), once per process, and points
the configs of the model's SDPA attentions at it; undo puts the old name back. Only the
patched model's configs change: another model of the process keeps "sdpa" (the per-call
global swap the attention families use, codegen/attention/patch.py, is what a trace cannot
follow, hence a name here). The registered function calls transformers' function unchanged
outside a trace (no op dispatch in eager calls) and where the op cannot stand in for it:
autograd history needed (the op has no backward), softcap or output_attentions (transformers
raises or warns), a mask that is not a tensor. A model whose attention is not SDPA is left
alone (`route` says why).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from codegen.attention.patch import GLOBAL_NAME, _forward_globals, _sdpa_forward
from codegen.ops import LAYOUT_TAG, NAMESPACE
from models.patching import needs_graph

NAME = "kernel_pipeline_sdpa"  # the attention implementation's name (no "flash" in it:
# transformers treats any name holding "flash" as flash attention)
OP = f"{NAMESPACE}::sdpa_attention"

_op = None


class _Module:
    """What sdpa_attention_forward reads of the attention module: its kv-head groups (and
    is_causal, passed resolved)."""

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
               is_causal: bool, position_bias: torch.Tensor | None, groups: int
               ) -> torch.Tensor:
    """transformers' sdpa_attention_forward, (batch, q_len, heads, head_dim) contiguous: the op
    and its fake implementation alike (on fake tensors it gives the shape and strides the real
    call returns)."""
    out, _ = _sdpa_forward()(_Module(groups), query, key, value, attention_mask,
                             dropout=dropout, scaling=scaling, is_causal=is_causal,
                             position_bias=position_bias)
    return out


def sdpa_op():
    """`torch.ops.kernel_pipeline.sdpa_attention`, defined on first use."""
    global _op
    if _op is None:
        op = torch.library.custom_op(
            OP, _attention, mutates_args=(), tags=(LAYOUT_TAG,),
            schema="(Tensor query, Tensor key, Tensor value, Tensor? attention_mask, "
                   "float dropout, float? scaling, bool is_causal, Tensor? position_bias, "
                   "int groups) -> Tensor")
        op.register_fake(_attention)
        _op = op
    return _op


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, position_bias=None, **kwargs):
    """The function registered as NAME: sdpa_attention_forward's signature and result, through
    the op while torch.compile traces it."""
    tensors = [t for t in (query, key, value, attention_mask, position_bias) if t is not None]
    if (not torch.compiler.is_compiling() or kwargs.get("softcap") is not None
            or kwargs.get("output_attentions")
            or not all(isinstance(t, torch.Tensor) for t in tensors)  # a BlockMask, say
            or needs_graph(*tensors)):
        return _sdpa_forward()(module, query, key, value, attention_mask, dropout=dropout,
                               scaling=scaling, is_causal=is_causal,
                               position_bias=position_bias, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = sdpa_op()(query, key, value, attention_mask, float(dropout), scaling, bool(causal),
                    position_bias, getattr(module, "num_key_value_groups", 1))
    return out, None


def _register() -> None:
    """The op, and NAME in transformers' attention and mask interfaces (process-wide,
    idempotent; the mask function is SDPA's): defined before any trace, which cannot."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    sdpa_op()
    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def route(model) -> tuple[Callable[[], None] | None, str]:
    """Point the configs of `model`'s SDPA attentions at NAME: (undo, what was done), or
    (None, why not) where no attention of the model runs transformers' SDPA."""
    _register()
    sdpa = _sdpa_forward()
    configs, others = {}, set()
    for module in model.modules():
        module_globals = _forward_globals(module)  # picks its function by the config's name
        config = getattr(module, "config", None)
        if module_globals is None or config is None:
            continue
        impl = getattr(config, "_attn_implementation", None)
        interfaces = module_globals[GLOBAL_NAME]
        if (impl == "sdpa" and hasattr(config, "_attn_implementation_internal")
                and interfaces.get("sdpa") is sdpa and NAME in interfaces):
            configs[id(config)] = config
        elif impl != NAME:
            others.add(str(impl))
    if not configs:
        why = (f"configured {', '.join(sorted(others))}" if others else
               f"no module picks its attention through {GLOBAL_NAME}")
        return None, f"attention left to torch.compile: it does not run transformers' SDPA ({why})"

    for config in configs.values():
        config._attn_implementation_internal = NAME

    def undo() -> None:
        for config in configs.values():
            # a model set to another implementation since keeps it
            if config._attn_implementation_internal == NAME:
                config._attn_implementation_internal = "sdpa"

    return undo, (f"attention: transformers' SDPA as one opaque op ({OP}), laid out as "
                  "eager, not Inductor's SDPA lowering")
