"""Fused MoE experts family: the reference is the model's own router and experts modules (bit
for bit), rendered kernels (decode and grouped paths) equal it under the interpreter in fp32 on
each tiny MoE of the zoo, edge routings included (an expert with no token, one with one token,
one with all; exact router ties); the pattern makes one row of the router, the experts and the
combine; patching is per block instance, the whole-model check passes and undo is exact."""

from __future__ import annotations

import collections

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    instance_forwards,
    profiled_ops,
    run_candidate,
    verify_on_cpu_or_gpu,
)

from codegen.moe_experts import FAMILY
from codegen.moe_experts.patch import find_moe_blocks
from codegen.moe_experts.reference import IMPLS, make_case, make_inputs
from codegen.softmax import FAMILY as SOFTMAX
from core.workload import Workload
from profiling.loader import build, resolve
from profiling.patterns import BASE_PATTERNS, match

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
MODELS = ["tiny-mixtral", "tiny-qwen3-moe", "tiny-olmoe"]


# MoE blocks the zoo has no tiny name for: Qwen2-MoE (a shared expert beside the routed ones)
# and gpt-oss (biased router and experts, transposed interleaved gate/up, clamped SwiGLU)
_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)
CONFIGS = {
    "qwen2_moe": dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=88,
                      shared_expert_intermediate_size=96),
    "gpt_oss": dict(_TINY, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=32, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def _model(model_id, dtype=torch.float32):
    if model_id in CONFIGS:
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model(model_id, **CONFIGS[model_id])
        return AutoModelForCausalLM.from_config(config).to(dtype=dtype, device=DEVICE).eval()
    return build(resolve(model_id), dtype, DEVICE)


def _path_configs(case) -> list[dict]:
    """The last config of each path (decode, grouped): the widest blocks, the fewest programs
    for the interpreter."""
    space = FAMILY.search_space(case)
    return [[c for c in space if c["PATH"] == p][-1] for p in ("gemv", "grouped")
            if any(c["PATH"] == p for c in space)]


@pytest.mark.parametrize("model_id", MODELS)
def test_reference_is_bitwise_the_models_block(model_id):
    """moe_block on the block's own weights gives what the model's block returns, under every
    experts implementation transformers offers here."""
    model = _model(model_id)
    block = find_moe_blocks(model)[0]
    x = torch.randn(1, 9, block.experts.hidden_dim, generator=torch.Generator().manual_seed(1))
    case = block.case(9, "float32")
    for impl in IMPLS:
        model.config._experts_implementation = impl
        block.experts.config._experts_implementation = impl
        with torch.no_grad():
            want = block.module(x)
            got = FAMILY.reference(x.reshape(9, -1), *block.weights(),
                                   **{**FAMILY.params(case), "impl": impl})
        assert torch.equal(got.reshape(want.shape), want), impl


@pytest.mark.parametrize("model_id", MODELS + ["gpt_oss"])
def test_rendered_kernels_match_the_block_with_edge_routings(model_id, tmp_path):
    """Both paths, on the model's case and every edge case the verifier runs: one token, a
    prime count, one past a row block, and the skewed (an expert with no token, one with one
    token, one with all) and tied routings."""
    case = FAMILY.cases_from_model(_model(model_id), Workload(1, 8))[0]
    edges = FAMILY.edge_cases(case)
    assert {c.get("routing") for c in edges} >= {"skewed", "tied"}
    for config in _path_configs(case):
        for c in [case] + edges:
            out, ref = run_candidate(FAMILY, config, c, tmp_path, rendered_for=case)
            where = f"{config['PATH']} {c}"
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, where=where: f"{where}: {m}")


def test_skewed_routing_leaves_an_expert_empty_and_one_full():
    case = make_case(8, 64, 32, 4, 2, "float32", "olmoe", routing="skewed")
    x, w, *_ = make_inputs(case, generator=torch.Generator().manual_seed(0))
    chosen = torch.topk(torch.softmax(x @ w.T, -1), 2).indices
    per_expert = torch.bincount(chosen.reshape(-1), minlength=4).tolist()
    assert per_expert[0] == 0 and per_expert[1] == 8 and per_expert[2] == 1
    tied = make_case(8, 64, 32, 4, 2, "float32", "olmoe", routing="tied")
    x, w, *_ = make_inputs(tied, generator=torch.Generator().manual_seed(0))
    logits = x @ w.T
    assert torch.equal(logits[:, 0], logits[:, 1])  # tied bit for bit, above the rest
    assert bool((logits[:, 0] > logits[:, 2:].max(-1).values).all())


def test_the_example_is_verified_with_the_grouped_paths_widest_config():
    """The family's example (verified by tests/codegen/test_family_contract.py with the search
    space's last config) has pairs enough for both paths, the grouped path's widest last."""
    case = make_case(8, 32, 16, 4, 2, "float32", "olmoe")
    assert case in FAMILY.examples
    assert FAMILY.search_space(case)[-1] == _path_configs(case)[-1]
    assert {c["PATH"] for c in FAMILY.search_space(case)} == {"gemv", "grouped"}


@pytest.mark.parametrize("model_id", MODELS + list(CONFIGS))
def test_one_row_holds_router_experts_and_combine(model_id, tmp_path):
    """Each MoE block is one moe_experts occurrence, which took in the router's softmax (the
    softmax pattern claims F.softmax calls first); no softmax row is left inside a block."""
    ops = profiled_ops(_model(model_id), tmp_path)
    found, _ = match(ops, list(BASE_PATTERNS) + list(SOFTMAX.patterns) + list(FAMILY.patterns))
    moe = [o for o in found if o.family == "moe_experts"]
    assert len(moe) == 2
    for o in moe:
        names = collections.Counter(ops[i]["name"] for i in o.ops)
        assert names["aten::softmax"] + names["aten::_softmax"] >= 1, names
        assert names["aten::topk"] == 1, names
        assert FAMILY.patterns[0].cost([ops[i] for i in o.ops])[0] > 0
    inside = {i for o in moe for i in o.ops}
    assert not [o for o in found if o.family == "softmax" and set(o.ops) & inside]


@pytest.mark.parametrize("model_id", MODELS + list(CONFIGS))
def test_patch_runs_the_kernel_and_undo_restores(model_id, tmp_path):
    model = _model(model_id)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == 2
        patched = model(ids).logits
        undo()
        after = model(ids).logits
    assert chooser.calls == 2
    assert chooser.distinct_cases() == FAMILY.cases_from_model(model, Workload(2, 8))
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []


@pytest.mark.parametrize("model_id", MODELS)
def test_whole_model_check_passes(model_id, tmp_path):
    from codegen.search import case_key
    from pipeline import integrate as ig

    model = _model(model_id)
    workload = Workload(1, 8)
    accepted = {}
    for case in FAMILY.cases_from_model(model, workload):
        path = tmp_path / f"k{len(accepted)}.py"
        path.write_text(FAMILY.render(FAMILY.search_space(case)[-1], case))
        accepted[case_key(case)] = {"family": "moe_experts", "case": case, "source": str(path)}
    result = ig.whole_model_check(model, ig.fp32_reference(model), accepted, ["moe_experts"],
                                  workload, seeds=(0, 1))
    assert result["passed"], result["trials"]


def test_a_lookalike_block_keeps_its_own_code():
    """A block whose forward differs from the installed transformers' is not patched."""
    model = _model("tiny-olmoe")
    block = find_moe_blocks(model)[0].module
    cls = type(block)
    own = cls.forward

    def forward(self, hidden_states):  # an extra term
        return own(self, hidden_states) * 2

    odd = type(cls.__name__, (cls,), {"forward": forward})
    block.__class__ = odd
    assert [b.path for b in find_moe_blocks(model)] == ["model.layers.1.mlp"]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [8, 512])
def test_bf16_kernels_pass_the_verifier_on_a_gpu(rows, tmp_path):
    """bf16 (which the interpreter gets wrong) on each path: the decode path at 8 tokens, the
    grouped path at 512 (a few row blocks per expert)."""
    case = make_case(rows, 256, 128, 8, 2, "bfloat16", "olmoe")
    for i, config in enumerate(_path_configs(case)):
        folder = tmp_path / str(i)
        folder.mkdir()
        verify_on_cpu_or_gpu(FAMILY, case, folder, config=config)
