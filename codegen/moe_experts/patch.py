"""Patching the fused experts into a model: per MoE block instance, reversible.

A block qualifies when its class's `forward`, its router's and its experts' (the function under
transformers' `experts_implementation` dispatch) are, statement for statement, the installed
transformers' code of one of the known blocks (`reference.MODELS`: compared as syntax trees,
docstrings aside), its experts use SiLU (gpt-oss: its own clamped SwiGLU), and its router is
the block's `gate` (gpt-oss: `router`). A lookalike with an extra term keeps its own code.

The replacement forward, set on the instance, hands the kernel the (T, hidden) view the block
gives its router and the parameters as the modules hold them at call time, and dispatches by
the token count (`core.family.kernel_by_signature`): a count no kernel was accepted for, a
training call, a hooked router or experts module (output capture of router logits, an
offloading hook), a call that needs autograd, or a model whose experts implementation was
switched since, runs the block's own code. Qwen2-MoE's shared expert and its sigmoid gate run
as the block runs them (their modules called, so other families' patches apply), added to the
fused routed part. gpt-oss's block also returns its router scores, which its decoder layer
drops: the patched block returns None in their place.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from codegen.dtypes import dtype_name
from codegen.moe_experts.reference import BIASED, MODELS, make_case, params
from core.family import Case, kernel_by_signature
from models.patching import code_shape, intercepted, needs_graph, wrap_instance_forwards

# model_type -> the block class whose forward the adapter reproduces (router and experts in
# reference.MODELS)
BLOCKS = {"mixtral": "MixtralSparseMoeBlock", "qwen2_moe": "Qwen2MoeSparseMoeBlock",
          "qwen3_moe": "Qwen3MoeSparseMoeBlock", "olmoe": "OlmoeSparseMoeBlock",
          "gpt_oss": "GptOssMLP"}


@dataclass(frozen=True)
class MoeBlock:
    path: str
    module: nn.Module
    model_type: str  # whose code it runs (reference.MODELS)
    router: nn.Module
    experts: nn.Module

    def case(self, rows: int, dtype: str) -> Case:
        ex, r = self.experts, self.router
        biased = self.model_type in BIASED
        return make_case(
            rows, ex.hidden_size if biased else ex.hidden_dim,
            ex.intermediate_size if biased else ex.intermediate_dim, ex.num_experts, r.top_k,
            dtype, self.model_type, norm_topk=bool(getattr(r, "norm_topk_prob", True)),
            impl=experts_impl(ex), limit=getattr(ex, "limit", None),
            alpha=getattr(ex, "alpha", None))

    def weights(self) -> tuple[torch.Tensor, ...]:
        """The kernel's weight inputs as the modules hold them now."""
        r, ex = self.router, self.experts
        if self.model_type in BIASED:
            return (r.weight, ex.gate_up_proj, ex.down_proj, r.bias, ex.gate_up_proj_bias,
                    ex.down_proj_bias)
        return r.weight, ex.gate_up_proj, ex.down_proj


def experts_impl(experts: nn.Module) -> str:
    """The experts implementation the module dispatches to (transformers' default where the
    config says none)."""
    config = getattr(experts, "config", None)
    return getattr(config, "_experts_implementation", None) or "grouped_mm"


def original_forward(cls: type) -> Callable:
    """The experts class's own forward beneath transformers' `use_experts_implementation`
    dispatch (functools.wraps keeps it as `__wrapped__`)."""
    return inspect.unwrap(cls.forward)


@cache
def _known(model_type: str) -> tuple[str, str, str] | None:
    """(block forward, router forward, experts forward) code shapes of the installed
    transformers, or None where this version has no such model."""
    name, router_cls, experts_cls = MODELS[model_type]
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        classes = [getattr(module, c) for c in (BLOCKS[model_type], router_cls, experts_cls)]
    except (ImportError, AttributeError):
        return None
    return (code_shape(classes[0].forward), code_shape(classes[1].forward),
            code_shape(original_forward(classes[2])))


@cache
def _shape(cls: type, experts: bool = False) -> str | None:
    try:
        return code_shape(original_forward(cls) if experts else cls.forward)
    except (OSError, TypeError):  # no source (compiled or built-in forward)
        return None


def _silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def block_of(path: str, module: nn.Module) -> MoeBlock | None:
    """The MoeBlock if `module` is one the kernel reproduces, else None."""
    cls = type(module)
    if not any(cls.__name__ == b for b in BLOCKS.values()) and not _routing_children(module):
        return None
    shape = _shape(cls)
    for model_type in BLOCKS:
        known = _known(model_type)
        if known is None or shape != known[0]:
            continue
        router = getattr(module, "router" if model_type in BIASED else "gate", None)
        experts = getattr(module, "experts", None)
        if router is None or experts is None or _shape(type(router)) != known[1] \
                or _shape(type(experts), experts=True) != known[2]:
            return None
        if model_type not in BIASED and not _silu(getattr(experts, "act_fn", None)):
            return None
        return MoeBlock(path, module, model_type, router, experts)
    return None


def _routing_children(module: nn.Module) -> bool:
    return hasattr(module, "experts") and (hasattr(module, "gate") or hasattr(module, "router"))


def find_moe_blocks(model: nn.Module) -> list[MoeBlock]:
    return [b for path, m in model.named_modules() if (b := block_of(path, m)) is not None]


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """Every block sees the pass's tokens: batch x seq at prefill, one per sequence at a decode
    step (`workload.tokens`)."""
    cases = []
    for block in find_moe_blocks(model):
        case = block.case(workload.tokens, workload.dtype)
        if case not in cases:
            cases.append(case)
    return cases


def _as_patched(block: MoeBlock) -> bool:
    """The router and experts are still the modules seen at patch time, and nothing runs
    around their calls (output capture of router logits hooks the router; accelerate's
    offloading hooks every module)."""
    m = block.module
    name = "router" if block.model_type in BIASED else "gate"
    return (getattr(m, name, None) is block.router and getattr(m, "experts", None) is block.experts
            and not intercepted(block.router) and not intercepted(block.experts)
            and not m.training)


def _wrapper(block: MoeBlock, forward_by_case: Callable) -> Callable[[Callable], Callable]:
    m = block.module
    impl = experts_impl(block.experts)

    def case_of(rows: int, dtype: torch.dtype) -> Case:
        return block.case(rows, dtype_name(dtype))

    resolve = kernel_by_signature(forward_by_case, case_of, params)
    shared = block.model_type == "qwen2_moe"
    scores = block.model_type == "gpt_oss"

    def wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs and _as_patched(block) \
                    and experts_impl(block.experts) == impl:
                (hidden_states,) = args
                weights = block.weights()
                if (hidden_states.dim() == 3 and all(
                        w.dtype == hidden_states.dtype and w.device == hidden_states.device
                        for w in weights) and not needs_graph(hidden_states, *weights)):
                    b, s, h = hidden_states.shape
                    x = hidden_states.reshape(-1, h)
                    kernel, kw = resolve(x.shape[0], x.dtype)
                    if kernel is not None:
                        out = torch.empty_like(x)
                        kernel(x, *weights, out=out, **kw)
                        if shared:  # Qwen2MoeSparseMoeBlock's shared expert, as it runs it
                            common = m.shared_expert(x)
                            common = F.sigmoid(m.shared_expert_gate(x)) * common
                            out = out + common
                        out = out.reshape(b, s, h)
                        return (out, None) if scores else out
            return below(*args, **kwargs)

        return forward

    return wrap


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    """Wrap every qualifying block's forward; the undo restores what each ran before."""
    return wrap_instance_forwards([(b.module, _wrapper(b, forward_by_case))
                                   for b in find_moe_blocks(model)])
