"""Which Hugging Face modules an exported package's layers serve (`pipeline export`).

A `kernels` layer replaces one module class's forward and takes that forward's arguments
(`pipeline/hub_package/layers.py`). A family exports where its patch can be one module's
forward in the model as transformers writes it: an RMSNorm; the rotary, through transformers'
per-attention rotary function (`rotary_pos_emb`, a kernel layer of transformers' own) where
transformers gives the attentions one, else as the attention's own forward over the package's
rotary (`RotaryAttention`: transformers 5.17 takes `kernels` 0.16 only, and gives no slot
beside a newer one); a gated MLP; the residual add and the norm after the attention, as a
pre-norm decoder layer's forward (`PreNormDecoderLayer`). A family with no such layer, or a
model whose classes its layer does not serve, is listed with why (NO_LAYER).

For each layer, the classes of the model it was exported for, the name `kernelize` maps
(the class's own `kernel_layer_name`, or the class name where transformers gives it none:
then `replace_kernel_forward_from_hub(Class, name)` first, as `kernels` documents for
external layers), and the facts the layer cannot see in one module: the norm's form, whether
the model's rotary tables have equal halves, the MLP's activation. Found on the model built
on the meta device from the run's config, by the family's own recognisers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from pipeline.export_record import ExportRecord


@dataclass(frozen=True)
class HubLayer:
    layer: str  # the class in the package's layers.py
    # model -> [(class, facts, what it replaces, for people)]
    find: Callable[[nn.Module], list[tuple[type, dict, str]]]
    why_not: str  # what to say where the model has no module the layer serves


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _norms(model: nn.Module) -> list[tuple[type, dict, str]]:
    from codegen.rmsnorm.patch import recognise

    found = []
    for module in model.modules():
        form = recognise(module)
        if form is not None:
            found.append((type(module), {"offset": form["offset"],
                                         "cast_first": form["cast_first"]}, _named(type(module))))
    return found


def _rotary_slots(model: nn.Module) -> list[tuple[type, dict, str]]:
    from codegen.rope.patch import (
        GLOBAL_NAME,
        find_rotary_attentions,
        rotary_slot,
        tables_have_equal_halves,
    )

    halves = tables_have_equal_halves(model)
    found = []
    for _, module, module_globals, form in find_rotary_attentions(model):
        slot = rotary_slot(module, module_globals[GLOBAL_NAME])
        if form == "full" and slot is not None:
            found.append((type(slot), {"equal_halves": halves},
                          f"{type(slot).__module__}.{GLOBAL_NAME}"))
    return found


def _rotary_attentions(model: nn.Module) -> list[tuple[type, dict, str]]:
    """Attentions whose class forward calls Llama's rotary by its global name, where
    transformers gives them no slot: `RotaryAttention` serves them with a copy of that
    forward."""
    from codegen.rope.patch import (
        GLOBAL_NAME,
        find_rotary_attentions,
        rotary_slot,
        tables_have_equal_halves,
    )

    halves = tables_have_equal_halves(model)
    found = []
    for _, module, module_globals, form in find_rotary_attentions(model):
        if form != "full" or rotary_slot(module, module_globals[GLOBAL_NAME]) is not None:
            continue
        if "forward" in module.__dict__ or not _takes(type(module), ROTARY_ATTENTION_ARGS):
            continue
        found.append((type(module), {"equal_halves": halves, "via": "attention"},
                      _named(type(module))))
    return found


def _takes(cls: type, names: tuple[str, ...]) -> bool:
    """`cls.forward` takes `names` (after self; the cache under either of CACHE_NAMES), in
    that order, then **kwargs: what the package's layer for it declares."""
    import inspect

    params = list(inspect.signature(cls.forward).parameters.values())
    given = ["past_key_values" if p.name in CACHE_NAMES else p.name for p in params[1:-1]]
    return (given == list(names) and bool(params)
            and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params[:-1])
            and params[-1].kind is inspect.Parameter.VAR_KEYWORD)


# the parameters of the package's layers as transformers 5.17 names them; 5.2x renames
# past_key_values to `cache` (the layers pass the caller's name on)
ROTARY_ATTENTION_ARGS = ("hidden_states", "position_embeddings", "attention_mask",
                         "past_key_values")
DECODER_LAYER_ARGS = ("hidden_states", "attention_mask", "position_ids", "past_key_values",
                      "use_cache", "position_embeddings")
CACHE_NAMES = ("past_key_values", "cache")


def _decoder_layers(model: nn.Module) -> list[tuple[type, dict, str]]:
    """Pre-norm decoder layers the `add_rmsnorm` family patches whose forward is Llama's
    exactly: no dropout, and the attention called with each of the layer's arguments under
    its own name, as `PreNormDecoderLayer` calls it."""
    from codegen.add_rmsnorm.patch import recognise

    found = []
    for module in model.modules():
        known = recognise(module)
        if known is None or any(known["template"]["dropouts"]):
            continue
        template = known["template"]
        names = [n for n in template["signature"].parameters if n != "self"][:-1]
        cache = next((n for n in CACHE_NAMES if n in names), None)
        expected = [cache if n == "past_key_values" else n for n in DECODER_LAYER_ARGS]
        passed = [(k, n) for k, n in template["attn_keywords"] if k is not None]
        if (cache is None or names != expected or template["varkw"] is None
                or sorted(passed) != sorted((n, n) for n in expected)
                or (None, template["varkw"]) not in template["attn_keywords"]
                or template["renames"] not in ({}, {"past_key_values": "cache"})):
            continue
        form = known["form"]
        found.append((type(module), {"offset": form["offset"], "cast_first": form["cast_first"],
                                     "cache": cache}, _named(type(module))))
    return found


def _mlps(model: nn.Module) -> list[tuple[type, dict, str]]:
    from codegen.matmul_epilogue.patch import gemm_mlps

    return [(type(mlp.module), {"act": mlp.act, "act_class": type(mlp.module.act_fn).__name__},
             _named(type(mlp.module))) for mlp, _ in gemm_mlps(model) if mlp.layout == "separate"]


# per family, its layers in the order tried: the first that serves the model's classes
HUB_LAYERS = {
    "rmsnorm": (HubLayer("RMSNorm", _norms, "no RMSNorm of a known form"),),
    "rope": (HubLayer("ApplyRotaryPosEmb", _rotary_slots,
                      "no attention with transformers' rotary kernel slot"),
             HubLayer("RotaryAttention", _rotary_attentions,
                      "no attention calling Llama's rotary function by its global name with "
                      "Llama's attention arguments")),
    "matmul_epilogue": (HubLayer("GatedMLP", _mlps,
                                 "no gated MLP with separate gate_proj and up_proj"),),
    "add_rmsnorm": (HubLayer("PreNormDecoderLayer", _decoder_layers,
                             "no pre-norm decoder layer whose forward is Llama's (no dropout, "
                             "the attention given the layer's own arguments)"),),
}
NO_LAYER = {
    "kv_cache": "no `kernels` layer: its patch replaces the update method of the cache's layer "
                "objects for the attention's call, and a layer replaces a module's forward: "
                "one for the attention would repeat transformers' Cache.update, which differs "
                "between releases; apply_kernels runs it",
}


def classes(model: nn.Module, family: str) -> tuple[str | None, list[dict], str | None]:
    """(the layer, [{module, class, name, replaces, kernel_layer_name, facts}] of the classes
    it serves in `model`, one per class) for the first of the family's layers that serves
    any, or (None, [], why not)."""
    hubs = HUB_LAYERS.get(family)
    if hubs is None:
        return None, [], NO_LAYER.get(family, "no `kernels` layer: its patch is not one "
                                              "module's forward; apply_kernels runs it")
    whys = []
    for hub in hubs:
        found, why = _classes(model, hub)
        if not why:
            return hub.layer, found, None
        whys.append(why)
    return None, [], "; ".join(whys)


def _classes(model: nn.Module, hub: HubLayer) -> tuple[list[dict], str | None]:
    out: dict[tuple, dict] = {}
    for cls, facts, what in hub.find(model):
        key = (cls.__module__, cls.__qualname__)
        known = out.setdefault(key, {"module": cls.__module__, "class": cls.__qualname__,
                                     "name": cls.__name__, "replaces": what, "facts": facts,
                                     "kernel_layer_name": getattr(cls, "kernel_layer_name",
                                                                  None)})
        if known["facts"] != facts:
            return [], f"instances of {cls.__name__} differ in what the layer must know"
    return list(out.values()), None if out else hub.why_not


def kernel_mapping(record: ExportRecord | dict
                   ) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """From an export's record: ([(module, class name, kernelize name)] of the classes that
    need `replace_kernel_forward_from_hub` first, transformers naming no kernel layer for them),
    {kernelize name: layer in the package}."""
    replaced, mapping = [], {}
    for spec in ExportRecord.of(record).families.values():
        for cls in spec.classes:
            key = cls.kernel_layer_name
            if key is None:
                key = cls.name
                replaced.append((cls.module, cls.name, key))
            mapping.setdefault(key, spec.layer)
    return replaced, mapping
