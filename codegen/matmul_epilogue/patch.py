"""Patching the gated GEMM into a model: per MLP instance, reversible, stacked over what runs.

The MLPs are codegen.gated_act's (`find_gated_mlps`: class name, projections, activation, and
a forward that is HF's own, statement for statement), restricted to those whose gate and up
projections are plain `nn.Linear` without bias (Phi-3: gate_up_proj), the only projections
the kernel computes.

The replacement WRAPS the instance's forward (`models.patching.wrap_instance_forwards`) rather
than replacing it: where the kernel does not apply it calls `below`, whatever ran before, which
may be gated_act's own patch of the same MLP (the pipeline integrates one of the two families,
but a model patched with both must still run, and undo in any order). The kernel applies when
no autograd graph is needed, the absorbed projections are the modules seen at patch time and
nobody hooks them (a user's hook, or accelerate's that brings offloaded weights in, must see
its module called; a LoRA layer swapped in must add its term), both weights have x's dtype
and device, and the chooser gives a kernel for the input signature (shape, dtype; asked once
per signature, `core.family.kernel_by_signature`). The weights are read from the
projections at call time, never captured at patch time: a parameter given new storage after
patching (`.to()`, reassignment, gated_act's fused [gate; up] buffer, whose halves are views)
is what the kernel reads. down_proj stays HF's Linear, called as a module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.compiler import is_compiling

from codegen.dtypes import dtype_name
from codegen.gated_act.patch import GatedMLP, find_gated_mlps
from codegen.matmul_epilogue.reference import make_case, packed_weight, params
from core.family import Case, kernel_by_signature
from models.patching import (
    fused_below,
    intercepted,
    needs_graph,
    only_same_result_forwards,
    wrap_instance_forwards,
)


def _plain(linear) -> bool:
    return type(linear) is nn.Linear and linear.bias is None


def projections(mlp: GatedMLP) -> tuple[nn.Linear, ...] | None:
    """The Linears the kernel absorbs, (gate_proj, up_proj) or (gate_up_proj,); None when the
    MLP does not qualify."""
    m = mlp.module
    if mlp.layout == "packed":
        projs = (m.gate_up_proj,)
    else:
        projs = (m.gate_proj, m.up_proj)
        if m.gate_proj.in_features != m.up_proj.in_features:
            return None
    return projs if all(_plain(p) for p in projs) else None


def gemm_mlps(model: nn.Module) -> list[tuple[GatedMLP, tuple[nn.Linear, ...]]]:
    return [(mlp, projs) for mlp in find_gated_mlps(model)
            if (projs := projections(mlp)) is not None]


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """Every qualifying MLP sees tokens x hidden in, tokens x intermediate out; prefill has
    batch x seq tokens, a decode step one per sequence (`workload.tokens`)."""
    cases = []
    for mlp, projs in gemm_mlps(model):
        case = make_case(workload.tokens, projs[0].in_features, mlp.cols, workload.dtype,
                         mlp.act, lead=(workload.batch, workload.tokens // workload.batch),
                         weights=_weights_layout(mlp))
        if case not in cases:
            cases.append(case)
    return cases


def _weights_layout(mlp: GatedMLP) -> str | None:
    """"packed" where the MLP holds both weights in one buffer (Phi-3, see `_weights`)."""
    return "packed" if mlp.layout == "packed" else None


def packed(w_gate: torch.Tensor, w_up: torch.Tensor) -> str | None:
    """"packed" where w_up's rows follow w_gate's in one buffer, as the call hands them: Phi-3's
    gate_up_proj, and separate projections while gated_act's patch fuses them (GateUp).

    One buffer means one storage, as the verifier builds the packed case and as
    `codegen.layouts` compares them: two weights allocated apart can still sit back to back
    (CUDA's caching allocator placed up_proj's right after gate_proj's in 4 of Llama-3.2-1B's
    16 MLPs and 8 of Qwen2.5-0.5B's 24 on the H200), and read as "packed" by address alone they
    asked for a case nobody verified and ran HF's MLP there. The reference's `packed_weight`
    is the one test of it, so the case the call asks for is the layout the reference runs."""
    return "packed" if packed_weight(w_gate, w_up) is not None else None


def _weights(mlp: GatedMLP) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """(w_gate, w_up) as the projections hold them now: Phi-3's are the two row halves of
    gate_up_proj's weight (views, no copy)."""
    m, cols = mlp.module, mlp.cols
    if mlp.layout == "packed":
        def packed() -> tuple[torch.Tensor, torch.Tensor]:
            w = m.gate_up_proj.weight
            return w[:cols], w[cols:]
        return packed
    return lambda: (m.gate_proj.weight, m.up_proj.weight)


def _current(mlp: GatedMLP) -> tuple[nn.Module, ...]:
    m = mlp.module
    return (m.gate_up_proj,) if mlp.layout == "packed" else (m.gate_proj, m.up_proj)


def _as_patched(mlp: GatedMLP, projs: tuple[nn.Module, ...]) -> bool:
    """The projections are still the plain Linears seen at patch time, and nothing intercepts
    their calls: no hook of torch's, none of accelerate's (it replaces the instance's forward
    and sets `_hf_hook`, to bring offloaded weights in), no module swapped in since (PEFT's
    LoRA layer, whose `.weight` is the base weight only). An instance forward that computes
    the same product of the same weight (`models.patching.SAME_RESULT`: the gemv family's, at
    a decode step) is skipped, not a reason to decline: the two families compose. Runs on every
    MLP call: plain lookups, no `hasattr` (which raises and catches inside
    nn.Module.__getattr__)."""
    return all(c is p and not intercepted(p) and only_same_result_forwards(p)
               for c, p in zip(_current(mlp), projs))


def _wrapper(mlp: GatedMLP, projs: tuple[nn.Linear, ...],
             forward_by_case: Callable) -> Callable[[Callable], Callable]:
    m, cols, hidden = mlp.module, mlp.cols, projs[0].in_features
    weights = _weights(mlp)

    def case_of(shape: torch.Size, dtype: torch.dtype, weights: str | None) -> Case:
        return make_case(shape.numel() // shape[-1], hidden, cols, dtype_name(dtype), mlp.act,
                         lead=shape[:-1], weights=weights)

    resolve = kernel_by_signature(forward_by_case, case_of, params)

    def declined(x) -> bool:
        """Whether the signature had no kernel already, read off the projections seen at
        patch time (where they are no longer the MLP's, the call goes below anyway): the
        other checks are then skipped, a prefill's cost where only decode was optimized."""
        if mlp.layout == "packed" or not isinstance(x, torch.Tensor) or is_compiling():
            return False  # (a trace reads no storage offsets: it takes the full path)
        # the registered parameters, without nn.Module's attribute fallback (host time)
        w_gate, w_up = projs[0]._parameters.get("weight"), projs[1]._parameters.get("weight")
        if w_gate is None or w_up is None:
            return False
        # weights allocated apart are not packed (`packed_weight`'s cheapest test, first)
        apart = w_up.storage_offset() != w_gate.storage_offset() + w_gate.numel()
        return resolve.declines(x.shape, x.dtype, None if apart else packed(w_gate, w_up))

    def wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:  # HF calls mlp(hidden_states)
                (x,) = args
                fused = fused_below(below)  # the gate/up launch a norm below ran (norm_gate_up)
                if fused is not None and (out := fused(x)) is not None:
                    return out
                if declined(x):
                    return below(*args, **kwargs)
                w_gate, w_up = weights() if _as_patched(mlp, projs) else (None, None)
                if (w_gate is not None and w_gate.dtype == w_up.dtype == x.dtype
                        and w_gate.device == w_up.device == x.device
                        and not needs_graph(x, w_gate, w_up)):
                    kernel, kw = resolve(x.shape, x.dtype, packed(w_gate, w_up))
                    if kernel is not None:
                        out = torch.empty((*x.shape[:-1], cols), dtype=x.dtype, device=x.device)
                        kernel(x, w_gate, w_up, out=out, **kw)
                        return m.down_proj(out)
            return below(*args, **kwargs)

        forward.returns_down_proj = "or_below"  # add_rmsnorm folds the residual add into it
        return forward

    return wrap


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    """Wrap every qualifying MLP's forward; the undo restores what each ran before (and leaves
    a forward stacked on top of this one working, whichever is undone first)."""
    return wrap_instance_forwards([(mlp.module, _wrapper(mlp, projs, forward_by_case))
                                   for mlp, projs in gemm_mlps(model)])
