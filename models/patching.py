"""Per-instance, reversible module patching: the one mechanism every family's adapter uses.

A class-level patch leaks into every model built later in the process (seen with Liger), so
adapters only ever shadow `forward` on the instance, and undo restores exactly what was there.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def set_instance_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Shadow the class's forward on this instance only; the undo puts back exactly what was
    there (nothing, or an earlier instance-level forward)."""
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = previous
        else:
            del module.forward

    return undo
