"""Patching RMSNorm kernels into a model, one module instance at a time.

A module is taken for an RMSNorm by its class name *and* by what its class's forward computes:
it is run once on a small bf16 probe (on the CPU, with a probe weight swapped in, so neither
the model's device nor its weights matter) and must equal one of the reference forms bitwise.
bf16 is where the Llama and Gemma cast orders differ, so the probe tells them apart.

The wrapper dispatches every call by its case: `chooser(case)` returns a candidate forward
(accepted for that shape) or None, which keeps the module's original code for that call.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from contextlib import contextmanager

import torch

from codegen.dtypes import dtype_name
from codegen.rmsnorm.reference import params, rms_norm
from core.family import Case, kernel_by_signature
from models.patching import fused_below, set_instance_forwards

NAME_RE = re.compile(r".*RMSNorm$")
_PROBE_ROWS = 4


@contextmanager
def swapped_params(module: torch.nn.Module, values: dict[str, torch.Tensor]):
    """Temporarily give `module` other parameter tensors (its own stay untouched)."""
    saved = {name: module._parameters[name] for name in values}
    try:
        module._parameters.update(values)
        yield module
    finally:
        module._parameters.update(saved)


def module_eps(module: torch.nn.Module) -> float | None:
    for attr in ("variance_epsilon", "eps"):
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def recognise(module: torch.nn.Module) -> dict | None:
    """{"eps", "offset", "cast_first"} when `module` is an RMSNorm of a known form, else None."""
    if not NAME_RE.match(type(module).__name__):
        return None
    weight = module._parameters.get("weight")
    eps = module_eps(module)
    if weight is None or weight.dim() != 1 or eps is None:
        return None
    hidden = weight.shape[0]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_PROBE_ROWS, hidden, generator=gen).to(torch.bfloat16)
    probe_w = (torch.randn(hidden, generator=gen) * 0.5).to(torch.bfloat16)
    try:
        with torch.no_grad(), swapped_params(module, {"weight": probe_w}):
            got = type(module).forward(module, x)
    except Exception:  # noqa: BLE001 - a forward that cannot run on the probe is not ours
        return None
    for form in ({"offset": 0.0, "cast_first": True}, {"offset": 1.0, "cast_first": False},
                 {"offset": 1.0, "cast_first": True}, {"offset": 0.0, "cast_first": False}):
        want = rms_norm(x, probe_w, eps=eps, **form)
        if isinstance(got, torch.Tensor) and got.dtype == want.dtype and torch.equal(got, want):
            return {"eps": eps, **form}
    return None


def kernel_resolver(chooser: Callable, form: dict, params_of: Callable = params) -> Callable:
    """(shape, dtype, hidden) -> (kernel or None, its params), once per signature; the fused
    add + RMSNorm family passes its own params."""

    def case_of(shape: torch.Size, dtype: torch.dtype, hidden: int) -> Case:
        return {"rows": shape.numel() // hidden, "hidden": hidden, "dtype": dtype_name(dtype),
                **form}

    return kernel_by_signature(chooser, case_of, params_of)


def kernel_can_take(x: torch.Tensor, weight: torch.Tensor, form: dict) -> bool:
    """Calls the kernels do not cover go to the original code: autograd (no backward here),
    other widths, empty inputs, and a Llama-form weight whose dtype would promote the output."""
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if x.dim() == 0 or x.shape[-1] != weight.shape[0] or x.numel() == 0:
        return False
    if x.device != weight.device or not x.dtype.is_floating_point:
        return False
    return not form["cast_first"] or weight.dtype == x.dtype


def declined(resolve: Callable, x) -> bool:
    """Whether `resolve` had no kernel for x's signature already: the call then runs the
    original code whatever the other checks say (a call that reaches `resolve` has
    x.shape[-1] == hidden, `kernel_can_take`), so they are skipped. Where only decode
    workloads were optimized, every norm of a prefill takes this path."""
    return isinstance(x, torch.Tensor) and bool(x.shape) and resolve.declines(
        x.shape, x.dtype, x.shape[-1])


def _wrap(module: torch.nn.Module, form: dict, chooser: Callable) -> Callable:
    original = module.forward
    resolve = kernel_resolver(chooser, form)

    def forward(hidden_states, *args, **kwargs):
        if args or kwargs:
            return original(hidden_states, *args, **kwargs)
        fused = fused_below(original)  # a norm fused into its consumer's launch (norm_qkv)
        if fused is None and declined(resolve, hidden_states):
            return original(hidden_states)
        weight = module.weight
        if not kernel_can_take(hidden_states, weight, form):
            return original(hidden_states)
        if fused is not None and (out := fused(hidden_states)) is not None:
            return out
        hidden = weight.shape[0]
        fn, kw = resolve(hidden_states.shape, hidden_states.dtype, hidden)
        if fn is None:
            return original(hidden_states)
        x = hidden_states.contiguous().view(-1, hidden)
        out = torch.empty_like(x)
        fn(x, weight, out=out, **kw)
        return out.view(*hidden_states.shape)  # unpacked: a torch.Size argument parses slower

    forward.__wrapped__ = original
    return forward


def patch(model: torch.nn.Module, chooser: Callable[[Case], Callable | None]) -> Callable[[], None]:
    """Replace the forward of every recognised RMSNorm instance in `model`; returns undo."""
    replacements = []
    for _, module in model.named_modules():
        form = recognise(module)
        if form is not None:
            replacements.append((module, _wrap(module, form, chooser)))
    return set_instance_forwards(replacements)


def rows_per_token(name: str, hidden: int, config) -> int | None:
    """How many rows one token gives this norm: 1 across the model width, one per head for the
    per-head q/k norms (Qwen3, Gemma3: as wide as a head), 1 for q/k norms across the whole
    projection (OLMo-2: as wide as heads x head_dim); None when the use cannot be read from
    the config."""
    text_config = getattr(config, "get_text_config", lambda: config)()
    if hidden == getattr(text_config, "hidden_size", None):
        return 1
    leaf = name.rsplit(".", 1)[-1]
    heads = getattr(text_config, {"q_norm": "num_attention_heads",
                                  "k_norm": "num_key_value_heads"}.get(leaf, ""), None)
    if not heads:
        return None
    head_dim = getattr(text_config, "head_dim", None) or (
        text_config.hidden_size // text_config.num_attention_heads)
    if hidden == head_dim:
        return heads
    return 1 if hidden == heads * head_dim else None


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
        case = {"rows": workload.tokens * per_token, "hidden": hidden, "dtype": workload.dtype,
                **form}
        if case not in cases:
            cases.append(case)
    return cases
