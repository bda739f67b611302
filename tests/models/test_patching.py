"""Instance-level forwards stacked on one module: each wraps the one below it, and undos come
in any order (rope, attention and kv_cache all wrap the same attention modules)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from models.patching import set_instance_forward, wrap_instance_forward


def _adds(amount):
    return lambda below: (lambda x: below(x) + amount)


@pytest.mark.parametrize("undo_order", list(itertools.permutations(range(3))))
def test_undo_in_any_order_keeps_the_others_and_restores_the_module(undo_order):
    module = nn.Identity()
    x = torch.zeros(1)
    amounts = (1.0, 10.0, 100.0)
    undos = [wrap_instance_forward(module, _adds(a)) for a in amounts]
    assert module(x).item() == sum(amounts)
    live = set(range(3))
    for i in undo_order:
        undos[i]()
        live.discard(i)
        assert module(x).item() == sum(amounts[j] for j in live)
    assert "forward" not in vars(module)


def test_an_earlier_instance_forward_comes_back():
    module = nn.Identity()
    earlier = lambda x: x + 2  # noqa: E731 - someone else's instance forward
    module.forward = earlier
    undo_plain = set_instance_forward(module, lambda x: x * 0)
    undo_wrap = wrap_instance_forward(module, _adds(5.0))
    assert module(torch.ones(1)).item() == 5.0
    undo_plain()
    assert module(torch.ones(1)).item() == 8.0  # the wrapper now runs `earlier` beneath it
    undo_wrap()
    assert module.forward is earlier



def test_the_function_behind_a_hub_kernels_wrapper_is_compared_and_recognised():
    """transformers 5.25 with `kernels` installed wraps `apply_rotary_pos_emb` in an nn.Module
    instance (`@use_kernel_forward_from_hub`); the rope adapter still recognises Llama's code
    through it, and a plain function passes through unchanged."""
    from torch import nn
    from transformers.models.llama import modeling_llama

    from codegen.rope.patch import rotary_form
    from models.patching import code_shape, plain_function

    original = plain_function(modeling_llama.apply_rotary_pos_emb)

    def wrapped(func):  # the shape of kernels' _create_func_module: forward calls `func`
        class Func(nn.Module):
            def forward(self, *args, **kwargs):
                return func(*args, **kwargs)
        return Func()

    hub = wrapped(original)
    assert plain_function(hub) is original and plain_function(original) is original
    assert code_shape(hub) == code_shape(original)
    g = {"apply_rotary_pos_emb": hub, "rotate_half": modeling_llama.rotate_half}
    assert rotary_form(g) == "full"
    # a module whose forward has no `func` of its own is not unwrapped
    assert plain_function(nn.Identity()) is not original
