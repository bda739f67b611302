"""The two norm fusions (norm_qkv, norm_gate_up) with gemv in a whole-model decode
check (pipeline.integrate.whole_model_check): a prefill, then decode steps over the dynamic
cache, the static cache and a left-padded batch, every step's logits against the fp32
reference, on tiny Llama and tiny Qwen2 with one kv head per query head (k/v at a width no
family pads); the rendered candidates are the interpreter's cheapest configs. The patch's
proof (`patch_took_effect`): one launch per layer of each, and fewer of the aten ops each
replaces."""

from __future__ import annotations

import pytest
import torch

from codegen.registry import get_family
from codegen.search import case_key
from core.workload import Workload
from pipeline import integrate as ig
from profiling.loader import build, resolve

FAMILIES = ["norm_qkv", "norm_gate_up", "gemv"]


def _accepted(model, workload, folder) -> dict:
    out = {}
    for name in FAMILIES:
        family = get_family(name)
        for case in family.cases_from_model(model, workload):
            path = folder / f"{name}_{abs(hash(case_key(case)))}.py"
            path.write_text(family.render(family.search_space(case)[-1], case))
            out[case_key(case)] = {"family": name, "case": case, "source": str(path)}
    return out


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-qwen2"])
def test_the_decode_check_passes_with_both_norm_fusions(model_id, tmp_path):
    spec = resolve(model_id)
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    torch.manual_seed(0)
    model = build(spec, torch.float32, "cpu")
    workload = Workload(2, 8, mode="decode")
    accepted = _accepted(model, workload, tmp_path)
    assert {a["family"] for a in accepted.values()} == set(FAMILIES)
    result = ig.whole_model_check(model, ig.fp32_reference(model), accepted, FAMILIES,
                                  workload, seeds=(0,))
    assert result["passed"], result["failure"]
    effect = ig.patch_took_effect(model, accepted, FAMILIES, workload)
    assert effect.passed, effect
    layers = model.config.num_hidden_layers
    assert effect.kernel_calls["norm_qkv"] == effect.kernel_calls["norm_gate_up"] == layers
    # o_proj and down_proj (the residual accumulated into it) and the LM head
    assert effect.kernel_calls["gemv"] >= 2 * layers
