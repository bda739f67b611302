"""add_layernorm: GPT-2's attention residual add + ln_2 fused (layernorm's fused kernel) into
each GPT2Block by a per-instance forward: same logits within tolerance, undo restores them
bit for bit, cross-attention inputs and declined signatures run the original code, and the
profile's block scope is this family's pattern."""

from __future__ import annotations

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    _family_patterns,
    assert_close,
    instance_forwards,
    profiled_ops,
)

from codegen.add_layernorm import FAMILY
from codegen.add_layernorm.patch import recognise
from codegen.layernorm import LAYERNORM_PATTERN
from core.workload import Workload
from profiling.loader import build, resolve


def _model():
    model = build(resolve("tiny-gpt2"), torch.float32, DEVICE)
    for block in model.transformer.h:  # norm parameters a config leaves at 1 and 0
        torch.nn.init.normal_(block.ln_2.weight, 1.0, 0.2)
        torch.nn.init.normal_(block.ln_2.bias, 0.0, 0.2)
    return model


def test_patch_gives_the_same_logits_and_undo_restores(tmp_path):
    model = _model()
    ids = torch.randint(0, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    layers = model.config.n_layer
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == layers
        patched = model(ids).logits
        undo()
        after = model(ids).logits
    assert chooser.calls == layers
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    assert all(c["residual"] for c in chooser.distinct_cases())
    assert_close(patched, before, (1e-4, 1e-4))
    assert torch.equal(after, before) and instance_forwards(model) == []


def test_declined_signatures_and_cross_attention_run_the_original(tmp_path):
    model = _model()
    block = model.transformer.h[0]
    assert recognise(block) is not None
    x = torch.randn(1, 8, model.config.n_embd, device=DEVICE)
    with torch.no_grad():
        want = block(x)
        declining = CountingChooser(FAMILY, tmp_path, give=False)
        undo = FAMILY.patch(model, declining)
        got = block(x)
        undo()
    assert torch.equal(got, want) and declining.calls == 0 and declining.cases


def test_the_block_scope_is_this_familys_pattern(tmp_path):
    from profiling.patterns import BASE_PATTERNS, match

    model = build(resolve("tiny-gpt2"), torch.float32, "cpu")
    ops = profiled_ops(model, tmp_path)
    # every family's patterns, as the rank stage has them: the attention's and MLP's own
    # claim their ops, leaving the block scope its two adds
    patterns = list(BASE_PATTERNS) + _family_patterns() + [LAYERNORM_PATTERN, *FAMILY.patterns]
    found, _ = match(ops, patterns)
    mine = [o for o in found if o.family == "add_layernorm"]
    assert len(mine) == model.config.n_layer
    assert all([ops[i]["name"] for i in o.ops] == ["aten::add"] * 2 for o in mine)
    assert not any(o.pattern == "residual_add" for o in found)  # ours claims the block first


@pytest.mark.gpu
def test_patch_reaches_the_kernel_on_the_gpu_stack_in_bf16(tmp_path):
    """GPT2Block's forward as the GPU stack's transformers writes it is recognised (its
    syntax tree is read, so a version that changed it would decline here)."""
    model = build(resolve("tiny-gpt2"), torch.bfloat16, "cuda")
    ids = torch.randint(0, 500, (2, 64), device="cuda")
    with torch.no_grad():
        before = model(ids).logits.float()
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        patched = model(ids).logits.float()
        undo()
    assert chooser.calls == model.config.n_layer
    torch.testing.assert_close(patched, before, atol=5e-2, rtol=5e-2)


def test_fast_binding_of_gpt2s_positional_call_equals_signature_bind():
    """GPT2Model calls its blocks with four positional arguments and the rest by keyword; the
    adapter binds that without Signature.bind (23 us a call on the CPU) and must give exactly
    what bind + apply_defaults gives, and refuse what bind refuses (an argument given twice,
    an unknown one without **kwargs)."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from codegen.add_layernorm.patch import block_template
    from codegen.add_rmsnorm.patch import _arguments

    template = block_template(GPT2Block)
    assert template is not None and len(template["positional"]) >= 4
    hs, mask = torch.zeros(1, 2, 4), torch.ones(1, 1)
    calls = [((hs,), {}), ((hs, None, mask, None), {"use_cache": True, "position_ids": 5}),
             ((hs, 7), {"encoder_attention_mask": mask}), ((hs, None, mask), {"foo": 1})]
    for args, kwargs in calls:
        bound = template["signature"].bind(None, *args, **kwargs)
        bound.apply_defaults()
        want = {k: v for k, v in bound.arguments.items() if k != "self"}
        got = _arguments(template, None, args, kwargs)
        assert got.keys() == want.keys()
        assert all(got[k] is v or got[k] == v for k, v in want.items())
    twice = template["positional"][1]
    assert _arguments(template, None, (hs, None), {twice: None}) is None
    too_many = (hs,) * (len(template["positional"]) + 1)
    assert _arguments(template, None, too_many, {}) is None
