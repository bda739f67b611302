"""A decoder layer's last residual add folded into down_proj's GEMM as its C operand.

After add_rmsnorm's kernel the layer still ran `total + mlp(normed)`: a pass that reads two
(tokens, hidden) tensors and writes a third. cuBLAS's addmm with beta = 1 adds C while it
writes the product, in place when C is the output (`total.addmm_(h, W_down^T)`), and at the
b8 s1024 prefill shapes the GEMM with `total` as C takes what the plain GEMM takes, so the add
comes free (benchmarks/probes/README.md, `residual_addmm.py`). Not bit for bit the unfused
code: cuBLAS adds C to the fp32 accumulator and rounds once, where HF rounds the product and
then the sum; the whole-model check holds both to the fp32 reference.

The add happens inside the MLP's call, so it is done only where the MLP returns down_proj's
output as it is: the class's forward ends in `return self.down_proj(...)` (read from its
syntax tree), or an adapter's instance forward that declares so (`RETURNS_DOWN_PROJ` on the
function: gated_act's and matmul_epilogue's). `total` is the layer's own buffer (add_rmsnorm's
kernel wrote it and normed, which the MLP reads, is another), so writing it in place loses
nothing anyone else holds.

Protocol, per layer: the layer arms `Slot.total` before calling the MLP; down_proj's instance
forward (installed here) takes it, computes in place and leaves its result in `Slot.result`;
the layer returns that tensor, which the MLP must have returned as it is (anything else is an
error: the sum is already written). Where down_proj did not take it, the layer adds as before.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from functools import cache

import torch
from torch import nn
from torch.nn.modules import module as nn_module

from models.patching import (
    FUSED,
    accumulator,
    intercepted,
    only_same_result_forwards,
    reaches,
)

# On an adapter's MLP forward: "always" (it returns down_proj's output on every path) or
# "or_below" (that, or what the forward below it returns)
RETURNS_DOWN_PROJ = "returns_down_proj"


class Slot:
    """One layer's hand-over between its forward and its down_proj's."""

    __slots__ = ("total", "result")

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None
        self.result: torch.Tensor | None = None


@cache
def class_returns_down_proj(cls: type) -> bool:
    """Whether `cls.forward` ends in `return self.down_proj(...)` (or assigns that call to a
    name and returns the name), calling down_proj nowhere else."""
    owner = next(c for c in cls.__mro__ if "forward" in c.__dict__)
    if owner is not cls:
        return owner is not nn.Module and class_returns_down_proj(owner)
    fn = cls.__dict__["forward"]
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    except (OSError, TypeError, SyntaxError):
        return False
    body = tree.body[0].body
    calls = [n for n in ast.walk(tree.body[0]) if isinstance(n, ast.Call)
             and ast.unparse(n.func) == "self.down_proj"]
    if len(calls) != 1 or not body or not isinstance(body[-1], ast.Return):
        return False
    returned = body[-1].value
    if returned is calls[0]:
        return True
    return (len(body) >= 2 and isinstance(returned, ast.Name)
            and isinstance(body[-2], ast.Assign) and body[-2].value is calls[0]
            and [ast.unparse(t) for t in body[-2].targets] == [returned.id])


@torch.compiler.assume_constant_result
def _class_returns_down_proj(cls: type) -> bool:
    """`class_returns_down_proj`, asked once by torch.compile, at trace time: dynamo cannot
    read source text, and a class's source does not change while its model runs."""
    return class_returns_down_proj(cls)


def mlp_returns_down_proj(mlp: nn.Module) -> bool:
    """Whether calling `mlp(x)` now returns its down_proj's output unchanged: each live
    instance forward on it declares so, down to the class's forward (or one that never calls
    below). No hooks on the MLP, none global."""
    if (mlp._forward_hooks or mlp._forward_pre_hooks or nn_module._global_forward_hooks
            or nn_module._global_forward_pre_hooks):
        return False
    forward = mlp.__dict__.get("forward")
    while forward is not None:
        layer = getattr(forward, "_instance_forward", None)
        if layer is None:
            return False  # an instance forward not installed through models.patching
        if layer.live:
            declared = getattr(layer.run, RETURNS_DOWN_PROJ, None)
            if declared == "always":
                return True
            if declared != "or_below":
                return False
        if not layer.had:
            break
        forward = layer.below
    return _class_returns_down_proj(type(mlp))


def plain_down_proj(mlp: nn.Module) -> nn.Linear | None:
    """The MLP's down_proj when it is a bias-free nn.Linear nothing intercepts, else None.
    Instance forwards that compute the same product (`models.patching.SAME_RESULT`: the gemv
    family's, at a decode step) are allowed, above or below the one installed here: they pass
    its calls to it (`FUSED`), and it runs the add in their kernel where they offer one
    (`ACCUMULATES`: the GEMV's epilogue), in cuBLAS's addmm otherwise."""
    down = getattr(mlp, "down_proj", None)
    if (type(down) is not nn.Linear or down.bias is not None or intercepted(down)
            or not only_same_result_forwards(down)):
        return None
    return down


def down_proj_wrap(down: nn.Linear, slot: Slot):
    """The `wrap` (models.patching) of down_proj's forward: with a `total` armed that fits
    (rows, dtype, device), `total += x @ W^T` in one launch (a kernel of down_proj's that
    accumulates, else cuBLAS's addmm); otherwise what ran below."""

    def take(x) -> torch.Tensor | None:
        total = slot.total
        if total is None:
            return None
        slot.total = None  # one use: a second call of down_proj gets the plain GEMM
        weight = down.weight
        if (isinstance(x, torch.Tensor) and x.dim() >= 2
                and x.numel() // x.shape[-1] == total.shape[0]
                and x.dtype == weight.dtype == total.dtype
                and x.device == weight.device == total.device
                and x.shape[-1] == weight.shape[1] and total.shape[1] == weight.shape[0]
                and not torch.is_grad_enabled()):
            accumulate = accumulator(down)
            if accumulate is None or not accumulate(x, total):
                total.addmm_(x.reshape(-1, x.shape[-1]), weight.t())
            slot.result = total.view(*x.shape[:-1], weight.shape[0])
            return slot.result
        return None

    def wrap(below):
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:
                out = take(args[0])
                if out is not None:
                    return out
            return below(*args, **kwargs)

        setattr(forward, FUSED, take)  # a gemv forward stacked above asks it first
        return forward

    return wrap


def mlp_into(total_2d: torch.Tensor, mlp: nn.Module, down: nn.Linear, installed, slot: Slot,
             normed: torch.Tensor) -> torch.Tensor | None:
    """`total + mlp(normed)` with the add in down_proj's GEMM, written into `total_2d`; None,
    before any call, when the MLP is not known to return down_proj's output (the caller then
    runs it and adds). `installed`: the forward this module put on down_proj, which its calls
    must still reach (first, or through forwards of the same product that pass them down)."""
    if not reaches(down, installed) or not mlp_returns_down_proj(mlp):
        return None
    slot.total, slot.result = total_2d, None
    try:
        out = mlp(normed)
    finally:
        slot.total = None
    result, slot.result = slot.result, None
    if result is None:  # down_proj went another way (another kernel, other rows): add
        return total_2d.view(*out.shape) + out
    if out is not result:
        raise RuntimeError(f"{type(mlp).__name__} changed down_proj's output after the residual "
                           "add was folded into it; add_rmsnorm's check of its forward is wrong")
    return out
