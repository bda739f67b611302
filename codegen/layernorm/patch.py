"""Patching the LayerNorm kernel into a model, one module instance at a time.

Recognition mirrors the RMSNorm family: the class name must end in LayerNorm, the module must
normalise over one trailing dimension with a weight and a bias, and its class forward, run on
a bf16 CPU probe with probe parameters swapped in, must equal `F.layer_norm` bitwise.
Only the plain norm is patched: the fused residual variant is a kernel and reference for the
verifier, since fusing it into a model means rewriting each block's forward.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from codegen.dtypes import dtype_name
from codegen.layernorm.reference import layer_norm, params
from codegen.rmsnorm.patch import rows_per_token, swapped_params
from core.family import Case, kernel_by_signature
from models.patching import set_instance_forwards

NAME_RE = re.compile(r".*LayerNorm$")


def recognise(module: torch.nn.Module) -> dict | None:
    """{"eps"} when `module` computes nn.LayerNorm over its last dimension, else None."""
    if not NAME_RE.match(type(module).__name__):
        return None
    weight, bias = module._parameters.get("weight"), module._parameters.get("bias")
    eps = getattr(module, "eps", None)
    if weight is None or bias is None or weight.dim() != 1 or bias.shape != weight.shape:
        return None
    if not isinstance(eps, (int, float)) or isinstance(eps, bool):
        return None
    if tuple(getattr(module, "normalized_shape", weight.shape)) != tuple(weight.shape):
        return None
    hidden = weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, hidden, generator=gen).to(torch.bfloat16)
    probe = {"weight": (1 + 0.5 * torch.randn(hidden, generator=gen)).to(torch.bfloat16),
             "bias": (0.5 * torch.randn(hidden, generator=gen)).to(torch.bfloat16)}
    try:
        with torch.no_grad(), swapped_params(module, probe):
            got = type(module).forward(module, x)
    except Exception:  # noqa: BLE001 - a forward that cannot run on the probe is not ours
        return None
    want = layer_norm(x, probe["weight"], probe["bias"], eps=float(eps))
    if isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want):
        return {"eps": float(eps)}
    return None


def _kernel_can_take(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> bool:
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or bias.requires_grad):
        return False
    if x.dim() == 0 or x.numel() == 0 or x.shape[-1] != weight.shape[0]:
        return False
    # F.layer_norm would promote mixed dtypes; the kernel writes the input's dtype only.
    return x.dtype == weight.dtype == bias.dtype and x.device == weight.device


def _wrap(module: torch.nn.Module, eps: float, chooser: Callable) -> Callable:
    """The kernel is resolved once per input signature (`kernel_by_signature`), as rmsnorm's
    adapter does: GPT-2 at b8 s1024 is host-bound once patched (5.1 ms of host in a 6.0 ms
    pass on the H200), so the pass waits on every microsecond of an adapter's Python, and
    building a case dict and looking it up on each of its 25 calls a pass cost 9 us a call
    more than this on the CPU (benchmarks/adapter_overhead.py)."""
    original = module.forward

    def case_of(shape: torch.Size, dtype: torch.dtype, hidden: int) -> Case:
        return {"rows": shape.numel() // hidden, "hidden": hidden, "dtype": dtype_name(dtype),
                "eps": eps}

    resolve = kernel_by_signature(chooser, case_of, params)

    def forward(hidden_states, *args, **kwargs):
        weight, bias = module.weight, module.bias
        if args or kwargs or not _kernel_can_take(hidden_states, weight, bias):
            return original(hidden_states, *args, **kwargs)
        hidden = weight.shape[0]
        fn, kw = resolve(hidden_states.shape, hidden_states.dtype, hidden)
        if fn is None:
            return original(hidden_states)
        x = hidden_states.contiguous().view(-1, hidden)
        out = torch.empty_like(x)
        fn(x, weight, bias, out=out, **kw)
        return out.view(*hidden_states.shape)  # unpacked: a torch.Size argument parses slower

    forward.__wrapped__ = original
    return forward


def patch(model: torch.nn.Module, chooser: Callable[[Case], Callable | None]) -> Callable[[], None]:
    """Replace the forward of every recognised LayerNorm instance in `model`; returns undo."""
    replacements = []
    for _, module in model.named_modules():
        form = recognise(module)
        if form is not None:
            replacements.append((module, _wrap(module, form["eps"], chooser)))
    return set_instance_forwards(replacements)


def cases_from_model(model: torch.nn.Module, workload) -> list[Case]:
    cases: list[Case] = []
    for name, module in model.named_modules():
        form = recognise(module)
        if form is None:
            continue
        hidden = module.weight.shape[0]
        per_token = rows_per_token(name, hidden, getattr(model, "config", None))
        if per_token is None:
            continue
        case = {"rows": workload.tokens * per_token, "hidden": hidden,
                "dtype": workload.dtype, **form}
        if case not in cases:
            cases.append(case)
    return cases
