"""Patching residual add + LayerNorm into GPT-2 blocks, one instance at a time.

The add sits in GPT2Block's own forward, so the adapter replaces that forward on the
instance, and only where the class's code is, statement for statement (read from its syntax
tree), the layout it replays:

    residual = hidden_states
    hidden_states = self.ln_1(hidden_states)
    attn_output, _ = self.attn(hidden_states, <kw>=<param>, ..., **kwargs)
    hidden_states = attn_output + residual
    if encoder_hidden_states is not None: ...     # cross-attention: the original runs
    residual = hidden_states
    hidden_states = self.ln_2(hidden_states)
    feed_forward_hidden_states = self.mlp(hidden_states)
    hidden_states = residual + feed_forward_hidden_states
    return hidden_states

The replacement calls ln_1, attn and mlp as modules (their own patches still apply) and swaps
the add + ln_2 for one kernel. It runs the original forward whenever the arguments do not
bind, cross-attention inputs are given, an autograd graph is needed, ln_2 is not a plain
LayerNorm of x's dtype and device, or the chooser declines the signature. Wrappers above the
code must be transformers' `deprecate_kwarg` or its gradient-checkpointing wrapper
(add_rmsnorm's `_kwarg_renames`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from functools import cache

import torch

from codegen.add_rmsnorm.patch import _arguments, _kwarg_renames, bind_fields
from codegen.dtypes import dtype_name
from codegen.layernorm.patch import recognise as recognise_layernorm
from codegen.layernorm.reference import params
from core.family import Case, kernel_by_signature
from models.patching import set_instance_forwards

HS = "hidden_states"
_FIXED = {0: f"residual = {HS}", 1: f"{HS} = self.ln_1({HS})",
          3: f"{HS} = attn_output + residual", 5: f"residual = {HS}",
          6: f"{HS} = self.ln_2({HS})", 7: f"feed_forward_hidden_states = self.mlp({HS})",
          8: f"{HS} = residual + feed_forward_hidden_states", 9: f"return {HS}"}
CROSS = "encoder_hidden_states"


def _attn_keywords(stmt: ast.stmt, params_: set[str], varkw: str | None):
    """[(keyword, parameter)] of `attn_output, _ = self.attn(hidden_states, k=p, ...)`, with
    (None, varkw) for `**kwargs`; None for any other statement."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
            and ast.unparse(stmt.targets[0]) == "(attn_output, _)"):
        return None
    call = stmt.value
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "self.attn"
            and [ast.unparse(a) for a in call.args] == [HS]):
        return None
    keywords = []
    for kw in call.keywords:
        if not (isinstance(kw.value, ast.Name) and (kw.value.id in params_ if kw.arg
                                                    else kw.value.id == varkw)):
            return None
        keywords.append((kw.arg, kw.value.id))
    return keywords


@cache
def block_template(cls: type) -> dict | None:
    """What the adapter needs to replay `cls.forward`, or None if it is not the layout."""
    fn = cls.__dict__.get("forward")
    renames = _kwarg_renames(fn) if fn is not None else None
    if renames is None:
        return None
    code = inspect.unwrap(fn)
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(code))).body[0].body
    except (OSError, TypeError, SyntaxError):
        return None
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    sig = inspect.signature(code)
    names = list(sig.parameters)
    varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if len(body) != 10 or names[:2] != ["self", HS] or CROSS not in names:
        return None
    if any(ast.unparse(body[i]) != text for i, text in _FIXED.items()):
        return None
    cross = body[4]
    if not (isinstance(cross, ast.If) and ast.unparse(cross.test) == f"{CROSS} is not None"):
        return None
    keywords = _attn_keywords(body[2], set(names[1:]) - {varkw}, varkw)
    if keywords is None:
        return None
    return {"signature": sig, "renames": renames, "attn_keywords": keywords, "varkw": varkw,
            **bind_fields(sig)}


def recognise(block: torch.nn.Module) -> dict | None:
    """{"template", "eps"} for a block this family can patch, else None."""
    if "forward" in block.__dict__:
        return None
    if not all(isinstance(getattr(block, c, None), torch.nn.Module)
               for c in ("ln_1", "attn", "ln_2", "mlp")):
        return None
    template = block_template(type(block))
    form = recognise_layernorm(block.ln_2) if template is not None else None
    return None if form is None else {"template": template, "eps": form["eps"]}


def _can_take(residual: torch.Tensor, ln: torch.nn.Module) -> bool:
    w, b = ln.weight, ln.bias
    if torch.is_grad_enabled() and (residual.requires_grad or w.requires_grad
                                    or b.requires_grad):
        return False
    return (residual.dim() >= 2 and residual.numel() > 0 and residual.shape[-1] == w.shape[0]
            and residual.dtype == w.dtype == b.dtype and residual.device == w.device)


def _wrap(block: torch.nn.Module, template: dict, eps: float, chooser: Callable) -> Callable:
    original = block.forward
    hidden = block.ln_2.weight.shape[0]

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case:
        return {"rows": shape.numel() // hidden, "hidden": hidden, "dtype": dtype_name(dtype),
                "eps": eps, "residual": True}

    resolve = kernel_by_signature(chooser, case_of, params)

    def forward(*args, **kwargs):
        # bound without Signature.bind, which cost 23 us a call on the CPU (add_rmsnorm's)
        arguments = _arguments(template, block, args, kwargs)
        if arguments is None:
            return original(*args, **kwargs)
        residual = arguments[HS]
        if (arguments.get(CROSS) is not None or not isinstance(residual, torch.Tensor)
                or (block.training and getattr(block, "gradient_checkpointing", False))
                or not _can_take(residual, block.ln_2)):
            return original(*args, **kwargs)
        fn, kw = resolve(residual.shape, residual.dtype)
        if fn is None:
            return original(*args, **kwargs)
        normed_1 = block.ln_1(residual)
        attn_kwargs = {}
        for keyword, name in template["attn_keywords"]:
            if keyword is None:
                attn_kwargs.update(arguments[name])
            else:
                attn_kwargs[keyword] = arguments[name]
        attn_output = block.attn(normed_1, **attn_kwargs)[0]
        if attn_output.shape == residual.shape and attn_output.dtype == residual.dtype:
            r2 = residual.contiguous().view(-1, hidden)
            total, normed = torch.empty_like(r2), torch.empty_like(r2)
            fn(attn_output.contiguous().view(-1, hidden), r2, block.ln_2.weight,
               block.ln_2.bias, out=(total, normed), **kw)
            total, normed = total.view(*residual.shape), normed.view(*residual.shape)
        else:  # an attention that changed shape or dtype: the unfused code, op for op
            total = attn_output + residual
            normed = block.ln_2(total)
        return total + block.mlp(normed)

    forward.__wrapped__ = original
    return forward


def patch(model: torch.nn.Module, chooser: Callable[[Case], Callable | None]) -> Callable[[], None]:
    """Replace the forward of every recognised GPT-2 block instance; returns undo."""
    replacements = []
    for _, block in model.named_modules():
        found = recognise(block)
        if found is not None:
            replacements.append((block, _wrap(block, found["template"], found["eps"], chooser)))
    return set_instance_forwards(replacements)


def cases_from_model(model: torch.nn.Module, workload) -> list[Case]:
    cases: list[Case] = []
    for _, block in model.named_modules():
        found = recognise(block)
        if found is None:
            continue
        case = {"rows": workload.tokens, "hidden": block.ln_2.weight.shape[0],
                "dtype": workload.dtype, "eps": found["eps"], "residual": True}
        if case not in cases:
            cases.append(case)
    return cases
