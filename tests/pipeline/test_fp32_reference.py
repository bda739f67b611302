"""The whole-model check's reference for models whose fp32 copy does not fit: layer by layer
over the model's own weights. It gives the copy's logits to fp32 rounding and the same verdicts
on honest and wrong kernels (tiny-llama and tiny-olmoe in fp16 on the CPU), copies no weight,
leaves the model's parameters as they were, and is chosen when the copy would not fit."""

from __future__ import annotations

import pytest
import torch
from test_whole_model_check import HONEST, SKIPS_WEIGHT

from codegen.moe_experts import FAMILY as MOE
from codegen.rmsnorm import FAMILY as RMSNORM
from codegen.search import case_key
from core.workload import Workload
from pipeline import fp32_reference as fr
from pipeline import integrate as ig
from profiling.loader import build, resolve

WORKLOAD = Workload(2, 8, "float16")

# OLMoE leaves its top-k weights as the softmax gives them; this one renormalises them
RENORMALISES = '''
from codegen.moe_experts.reference import moe_block


def forward(x, *weights, out, **params):
    out.copy_(moe_block(x, *weights, **{**params, "norm_topk": not params["norm_topk"]}))
'''


def _model(model_id):
    return build(resolve(model_id), torch.float16, "cpu")


def _accepted(family, model, source: str, tmp_path) -> dict:
    path = tmp_path / f"k{abs(hash(source))}.py"
    path.write_text(source)
    return {case_key(c): {"family": family.name, "case": c, "source": str(path)}
            for c in family.cases_from_model(model, WORKLOAD)}


def _rendered_moe(model) -> str:
    case = MOE.cases_from_model(model, WORKLOAD)[0]
    return MOE.render(MOE.search_space(case)[-1], case)


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-olmoe"])
def test_layerwise_gives_the_copys_logits_without_copying(model_id):
    model = _model(model_id)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    copy_ref, layer_ref = fr.fp32_reference(model, False), fr.fp32_reference(model, True)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = copy_ref(ids).logits, layer_ref(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    with torch.no_grad():
        assert ig.logits_error(model(ids).logits, got) > 100 * ig.logits_error(got, want)
    # the reference holds the model's own parameters, and they came back as they were
    for (name, p), q in zip(model.named_parameters(), layer_ref.parameters()):
        assert p is q and p is before[name][0] and p.dtype == torch.float16
        assert torch.equal(p, before[name][1])
    assert fr.describe(layer_ref).startswith("fp32 layer by layer")
    assert fr.describe(copy_ref) == "fp32 copy"


@pytest.mark.parametrize("model_id, family, kind", [
    ("tiny-llama", RMSNORM, "honest"), ("tiny-llama", RMSNORM, "wrong"),
    ("tiny-olmoe", MOE, "honest"), ("tiny-olmoe", MOE, "wrong")])
def test_both_references_give_the_same_verdicts(model_id, family, kind, tmp_path):
    model = _model(model_id)
    if family is RMSNORM:
        source = HONEST if kind == "honest" else SKIPS_WEIGHT
    else:
        source = _rendered_moe(model) if kind == "honest" else RENORMALISES
    accepted = _accepted(family, model, source, tmp_path)
    cases = {family.name: sorted(accepted)}
    assert ig.reach(model, WORKLOAD, accepted, [family.name], cases)[family.name] > 0
    verdicts = {}
    for layer_by_layer in (False, True):
        ref = fr.fp32_reference(model, layer_by_layer)
        result = ig.whole_model_check(model, ref, accepted, [family.name], WORKLOAD,
                                      seeds=(0, 1))
        verdicts[layer_by_layer] = result
    copy_, layer = verdicts[False], verdicts[True]
    assert copy_["passed"] == layer["passed"] == (kind == "honest"), (copy_, layer)
    assert layer["reference"].startswith("fp32 layer by layer")
    # close, not equal: the check gives constant parameters (norm weights) random values in
    # the model and the reference alike, which the copy holds in fp32 and the model (so the
    # layerwise reference) rounded to fp16
    for a, b in zip(copy_["trials"], layer["trials"]):
        assert b["error_patched"] == pytest.approx(a["error_patched"], rel=0.15)
        assert b["error_unpatched"] == pytest.approx(a["error_unpatched"], rel=0.15)


def test_the_copy_is_used_only_where_it_fits(monkeypatch):
    model = _model("tiny-llama")
    assert fr.describe(fr.fp32_reference(model)) == "fp32 copy"
    monkeypatch.setattr(fr, "free_bytes", lambda device: 1000)
    ref = fr.fp32_reference(model)
    assert fr.describe(ref).startswith("fp32 layer by layer")
    assert next(ref.parameters()) is next(model.parameters())


@pytest.mark.parametrize("layer_by_layer", [False, True])
def test_an_moe_reference_runs_eager_experts_and_the_model_keeps_its_own(layer_by_layer):
    model = _model("tiny-olmoe")
    own = model.config._experts_implementation
    ref = fr.fp32_reference(model, layer_by_layer)
    assert ref.model.layers[0].mlp.experts.config._experts_implementation == "eager"
    assert model.model.layers[0].mlp.experts.config._experts_implementation == own != "eager"
