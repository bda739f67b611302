"""Which Hugging Face modules an exported package's layers serve (`pipeline export`).

A `kernels` layer replaces one module class's forward and takes that forward's arguments
(`pipeline/hub_package/layers.py`). A family exports where its patch is one module's forward
in the model as transformers writes it: an RMSNorm, transformers' per-attention rotary
function (`rotary_pos_emb`, a kernel layer of transformers' own), a gated MLP. Families whose
patch spans modules (the residual add folded into the next norm, the KV-cache update inside
the attention) or swaps a module-level global for the call have no such layer, and the export
says so.

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


def _mlps(model: nn.Module) -> list[tuple[type, dict, str]]:
    from codegen.matmul_epilogue.patch import gemm_mlps

    return [(type(mlp.module), {"act": mlp.act, "act_class": type(mlp.module.act_fn).__name__},
             _named(type(mlp.module))) for mlp, _ in gemm_mlps(model) if mlp.layout == "separate"]


HUB_LAYERS = {
    "rmsnorm": HubLayer("RMSNorm", _norms, "no RMSNorm of a known form"),
    "rope": HubLayer("ApplyRotaryPosEmb", _rotary_slots,
                     "no attention with transformers' rotary kernel slot (`kernels` installed "
                     "where transformers was imported) over Llama's rotary function"),
    "matmul_epilogue": HubLayer("GatedMLP", _mlps,
                                "no gated MLP with separate gate_proj and up_proj"),
}


def classes(model: nn.Module, family: str) -> tuple[list[dict], str | None]:
    """([{module, class, name, replaces, kernel_layer_name, facts}] of the classes the
    family's layer serves in `model`, one per class), or ([], why not)."""
    hub = HUB_LAYERS.get(family)
    if hub is None:
        return [], ("no `kernels` layer: its patch is not one module's forward (it spans "
                    "modules or swaps a global for the call); apply_kernels runs it")
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


def kernel_mapping(record: dict) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """From an export's record: ([(module, class name, kernelize name)] of the classes that
    need `replace_kernel_forward_from_hub` first, transformers naming no kernel layer for them),
    {kernelize name: layer in the package}."""
    replaced, mapping = [], {}
    for spec in record["families"].values():
        for cls in spec["classes"]:
            key = cls["kernel_layer_name"]
            if key is None:
                key = cls["name"]
                replaced.append((cls["module"], cls["name"], key))
            mapping.setdefault(key, spec["layer"])
    return replaced, mapping
