"""transformers' experts implementations: which the installed version offers, and switching a
model (or a twin of it) to one.

transformers 5 dispatches every MoE experts module through `config._experts_implementation`
(`integrations.moe.use_experts_implementation`): "eager" (a Python loop over the experts that
got tokens), and the functions of `ExpertsInterface` ("batched_mm", "grouped_mm", and on later
releases "deepgemm" and "sonicmoe", which need their own libraries and a Hopper GPU). The
baseline an MoE kernel must beat is the fastest of these that runs, not eager.
"""

from __future__ import annotations

import torch


def experts_options() -> list[str]:
    """"eager", then every experts function the installed transformers registers."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # a transformers without the interface: its experts are eager only
        return ["eager"]
    return ["eager"] + [k for k in ALL_EXPERTS_FUNCTIONS if k != "eager"]


def is_moe(model: torch.nn.Module) -> bool:
    """Some module of the model dispatches through an experts implementation."""
    return any(hasattr(getattr(m, "config", None), "_experts_implementation")
               and hasattr(m, "gate_up_proj") for m in model.modules())


def set_experts(model: torch.nn.Module, impl: str) -> None:
    """Run the model's experts under `impl` (its own `set_experts_implementation`, which checks
    that the option can run here and raises where it cannot)."""
    setter = getattr(model, "set_experts_implementation", None)
    if setter is not None:
        setter(impl)
        return
    for m in model.modules():  # releases without the setter read the config at call time
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = impl
