"""Patching residual add + RMSNorm into pre-norm decoder layers, one instance at a time.

The add and the norm sit in the decoder layer's own forward, so the adapter replaces that
forward on the instance, and only where the class's code is, statement for statement, the
pre-norm layout that Llama, Qwen2, Mistral, Gemma and Phi3 share (read from its syntax tree):

    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(hidden_states=hidden_states, <p>=<p>, ..., **kwargs)
    hidden_states = residual + hidden_states       # or residual + self.<dropout>(...)
    residual = hidden_states
    hidden_states = self.post_attention_layernorm(hidden_states)
    hidden_states = self.mlp(hidden_states)
    hidden_states = residual + hidden_states       # or residual + self.<dropout>(...)
    return hidden_states

The replacement runs the same submodules in the same order (so their own patches still apply)
and swaps the add + post-attention norm for one kernel; where the MLP returns its down_proj's
output as it is, the last add goes into down_proj's GEMM (residual_gemm.py). Layers of any
other shape are left alone. Wrappers between the class attribute and the code must be transformers'
`deprecate_kwarg` (whose renames the adapter repeats) or its gradient-checkpointing wrapper;
any other decorator means no patch.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from functools import cache

import torch

from codegen.add_rmsnorm.reference import params
from codegen.add_rmsnorm.residual_gemm import Slot, down_proj_wrap, mlp_into, plain_down_proj
from codegen.rmsnorm.patch import declined, kernel_can_take, kernel_resolver
from codegen.rmsnorm.patch import recognise as recognise_rmsnorm
from core.family import Case
from models.patching import set_instance_forwards, wrap_instance_forward

NAME_RE = re.compile(r".*DecoderLayer$")
HS = "hidden_states"
_ADD_RE = re.compile(rf"{HS} = residual \+ (?:{HS}|self\.(\w+)\({HS}\))$")
_FIXED = {0: f"residual = {HS}", 1: f"{HS} = self.input_layernorm({HS})",
          4: f"residual = {HS}", 5: f"{HS} = self.post_attention_layernorm({HS})",
          6: f"{HS} = self.mlp({HS})", 8: f"return {HS}"}


def _kwarg_renames(fn) -> dict[str, str] | None:
    """Old -> new keyword names applied by the wrappers above the code, or None when a wrapper
    of unknown behaviour sits there. Known: `deprecate_kwarg`, and the gradient-checkpointing
    wrapper GradientCheckpointingLayer puts on every subclass (a pass-through unless it
    checkpoints, and the adapter falls back to the original forward whenever it might)."""
    renames = {}
    while hasattr(fn, "__wrapped__"):
        cells = dict(zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True))
        if "old_name" in cells and "new_name" in cells:
            new = cells["new_name"].cell_contents
            if new is not None:
                renames[cells["old_name"].cell_contents] = new
        elif "forward_with_checkpointing" not in cells:
            return None
        fn = fn.__wrapped__
    return renames


def _attn_keywords(stmt: ast.stmt, param_names: set[str], varkw: str | None):
    """[(keyword, source name)] of the self_attn call, or None unless every argument is passed
    by keyword straight from a forward parameter (or the normed hidden_states)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
        return None
    target, call = stmt.targets[0], stmt.value
    if not (isinstance(target, ast.Tuple) and target.elts
            and all(isinstance(e, ast.Name) for e in target.elts) and target.elts[0].id == HS):
        return None
    if not (isinstance(call, ast.Call) and ast.unparse(call.func) == "self.self_attn"
            and not call.args):
        return None
    keywords = []
    for kw in call.keywords:
        if not isinstance(kw.value, ast.Name):
            return None
        name = kw.value.id
        if kw.arg is None and name != varkw or kw.arg is not None and name not in param_names:
            return None
        keywords.append((kw.arg, name))
    return keywords


@cache
def layer_template(cls: type) -> dict | None:
    """What the adapter needs to replay `cls.forward`, or None if it is not the layout."""
    fn = cls.__dict__.get("forward")
    if fn is None:
        return None
    renames = _kwarg_renames(fn)
    code = inspect.unwrap(fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    sig = inspect.signature(code)
    names = list(sig.parameters)
    varkw = next((p.name for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    if renames is None or len(body) != 9 or names[:2] != ["self", HS]:
        return None
    if any(ast.unparse(body[i]) != text for i, text in _FIXED.items()):
        return None
    adds = [_ADD_RE.match(ast.unparse(body[i])) for i in (3, 7)]
    keywords = _attn_keywords(body[2], set(names[1:]) - {varkw}, varkw)
    if keywords is None or not all(adds):
        return None
    return {"signature": sig, "renames": renames, "attn_keywords": keywords,
            "varkw": varkw, "dropouts": tuple(m.group(1) for m in adds), **bind_fields(sig)}


def bind_fields(sig: inspect.Signature) -> dict:
    """What `_arguments` binds a call with: the named parameters' defaults, the required ones,
    and those a call may give by position, in order (after self)."""
    named = [p for p in sig.parameters.values()
             if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return {"defaults": {p.name: p.default for p in named if p.default is not p.empty},
            "required": {p.name for p in named if p.default is p.empty},
            # a positional-only parameter or *args: every call goes through Signature.bind
            "positional": () if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL)
                                    for p in sig.parameters.values())
            else tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD)}


def _arguments(template: dict, layer, args: tuple, kwargs: dict) -> dict | None:
    """The forward's arguments by name, as Signature.bind + apply_defaults gives them, or
    None when they do not bind. HF passes hidden_states and, in GPT-2, three more arguments
    positionally, the rest by keyword; that call is bound here directly, since Signature.bind
    costs more host time per layer than the fused kernel's launch (measured on the H200's
    host; 23 us a call on the CPU)."""
    renames = template["renames"]
    if renames and any(old in kwargs for old in renames):
        kwargs = dict(kwargs)
        for old, new in renames.items():
            if old in kwargs and new not in kwargs:
                kwargs[new] = kwargs.pop(old)
    positional = template["positional"]
    if 1 <= len(args) <= len(positional):
        arguments = dict(template["defaults"])
        arguments.update(zip(positional, args))
        given = positional[:len(args)]
        extra = {}
        for key, value in kwargs.items():
            if key in given:
                return None  # given twice: Signature.bind's TypeError, the original's too
            if key in arguments or key in template["required"]:
                arguments[key] = value
            elif template["varkw"]:
                extra[key] = value
            else:
                return None
        # not `required - arguments.keys()`: Dynamo on torch 2.11 cannot subtract dict_keys
        # from a set, and the graph break left that frame uncompiled
        if any(key not in arguments for key in template["required"]):
            return None
        if template["varkw"]:
            arguments[template["varkw"]] = extra
        return arguments
    try:
        bound = template["signature"].bind(layer, *args, **kwargs)
    except TypeError:
        return None
    bound.apply_defaults()
    return bound.arguments


def recognise(layer: torch.nn.Module) -> dict | None:
    """{"template", "form"} for a decoder layer this family can patch, else None."""
    if not NAME_RE.match(type(layer).__name__) or "forward" in layer.__dict__:
        return None
    children = ("input_layernorm", "post_attention_layernorm", "self_attn", "mlp")
    if not all(isinstance(getattr(layer, c, None), torch.nn.Module) for c in children):
        return None
    template = layer_template(type(layer))
    if template is None:
        return None
    if any(d and not isinstance(getattr(layer, d, None), torch.nn.Module)
           for d in template["dropouts"]):
        return None
    form = recognise_rmsnorm(layer.post_attention_layernorm)
    return None if form is None else {"template": template, "form": form}


def _wrap(layer: torch.nn.Module, template: dict, form: dict, chooser: Callable,
          down: tuple | None = None) -> Callable:
    """The layer's forward. `down`: (down_proj, the forward installed on it, its Slot) where
    the last residual add goes into down_proj's GEMM (residual_gemm.py)."""
    original = layer.forward
    attn_drop, mlp_drop = (getattr(layer, d) if d else None for d in template["dropouts"])
    resolve = kernel_resolver(chooser, form, params)

    def forward(*args, **kwargs):
        # hidden_states is the first parameter after self (`layer_template`); a signature
        # with no kernel needs no binding of the arguments (rmsnorm's `declined`)
        if declined(resolve, args[0] if args else kwargs.get(HS)):
            return original(*args, **kwargs)
        arguments = _arguments(template, layer, args, kwargs)
        if arguments is None:
            return original(*args, **kwargs)
        residual = arguments[HS]
        weight = layer.post_attention_layernorm.weight
        checkpointing = layer.training and getattr(layer, "gradient_checkpointing", False)
        if checkpointing or not kernel_can_take(residual, weight, form):
            return original(*args, **kwargs)
        hidden = weight.shape[0]
        fn, kw = resolve(residual.shape, residual.dtype, hidden)
        if fn is None:
            return original(*args, **kwargs)

        hidden_states = layer.input_layernorm(residual)
        attn_kwargs = {}
        for keyword, name in template["attn_keywords"]:
            if keyword is None:
                attn_kwargs.update(arguments[name])
            else:
                attn_kwargs[keyword] = hidden_states if name == HS else arguments[name]
        attn_out = layer.self_attn(**attn_kwargs)[0]
        if attn_drop is not None:
            attn_out = attn_drop(attn_out)
        if attn_out.shape == residual.shape and attn_out.dtype == residual.dtype:
            residual_2d = residual.contiguous().view(-1, hidden)
            total_2d = torch.empty_like(residual_2d)
            normed = torch.empty_like(residual_2d)
            fn(attn_out.contiguous().view(-1, hidden), residual_2d, weight,
               out=(total_2d, normed), **kw)
            # unpacked sizes: view(torch.Size) costs 2.5x view(*ints) on the host (CPU, 2.13)
            total, normed = total_2d.view(*residual.shape), normed.view(*residual.shape)
            # Phi-3's dropout is the identity in eval, and the fused add skips it only then
            if down is not None and (mlp_drop is None or not mlp_drop.training):
                out = mlp_into(total_2d, layer.mlp, *down, normed)
                if out is not None:
                    return out
        else:  # an attention that changed shape or dtype: the unfused code, op for op
            total = residual + attn_out
            normed = layer.post_attention_layernorm(total)
        mlp_out = layer.mlp(normed)
        if mlp_drop is not None:
            mlp_out = mlp_drop(mlp_out)
        return total + mlp_out

    forward.__wrapped__ = original
    return forward


def patch(model: torch.nn.Module, chooser: Callable[[Case], Callable | None]) -> Callable[[], None]:
    """Replace the forward of every recognised decoder layer instance; returns undo."""
    return patch_layers([(layer, found, chooser) for _, layer in model.named_modules()
                         if (found := recognise(layer)) is not None])


def patch_layers(layers: list[tuple[torch.nn.Module, dict, Callable]]) -> Callable[[], None]:
    """`patch` for each (layer, what `recognise` found, the chooser of its add + norm kernel):
    norm_gate_up hands each layer a chooser of its own, whose kernel also runs that layer's
    gate/up GEMV."""
    replacements, down_undos = [], []
    for layer, found, chooser in layers:
        down = plain_down_proj(layer.mlp)
        drop = found["template"]["dropouts"][1]
        if down is not None and (drop is None or type(getattr(layer, drop)) is torch.nn.Dropout):
            slot = Slot()
            down_undos.append(wrap_instance_forward(down, down_proj_wrap(down, slot)))
            down = (down, down.__dict__["forward"], slot)
        else:
            down = None
        replacements.append((layer, _wrap(layer, found["template"], found["form"], chooser,
                                          down)))
    undo_layers = set_instance_forwards(replacements)

    def undo() -> None:
        undo_layers()
        for u in reversed(down_undos):
            u()

    return undo


def cases_from_model(model: torch.nn.Module, workload) -> list[Case]:
    cases: list[Case] = []
    for _, layer in model.named_modules():
        found = recognise(layer)
        if found is None:
            continue
        hidden = layer.post_attention_layernorm.weight.shape[0]
        case = {"rows": workload.tokens, "hidden": hidden, "dtype": workload.dtype,
                **found["form"]}
        if case not in cases:
            cases.append(case)
    return cases
