"""Families patched together hand each other what the unpatched model would not: a family's
cases are predicted from the unpatched model (`cases_from_model`), but in the shipped set its
inputs may come out of another family's kernel. Phi-3-mini b8 s1024 on the H200: the rope
kernel runs in place on qkv_proj's output, so the keys reached the KV cache as a column block,
a layout no kv_cache case described; kv_cache shipped with 0 calls and its projected 8.5 ms
never came (the integrate stage now drops such a family, `integrate.reach`). Here every family
that can ship together on a tiny model is patched at once (one rendered kernel per case) and
each must be called, on cases its own prediction holds."""

from __future__ import annotations

import pytest
import torch
from family_checks import CountingChooser

from codegen.registry import families
from codegen.search import case_key
from core.workload import Workload
from profiling.capture import make_runner
from profiling.loader import build, resolve

# Never shipped together with the others: attention loses to SDPA on every measured shape
# (and after Phi-3's in-place rope is handed q/k layouts it has no case for); matmul declines
# the Llama-family GEMMs at the roofline, and where it patches k_proj/v_proj their outputs take
# a layout kv_cache has no case for (a gap, not a shipped set); the GEMM/GEMV families are the
# matmul's rivals or decode-only.
APART = ("attention", "matmul", "matmul_gelu", "gemv", "decode_attention", "softmax",
         "cross_entropy")
MODELS = ("tiny-llama", "tiny-qwen2", "tiny-gemma", "tiny-phi3", "tiny-gpt2")


def set_of(model, workload) -> dict:
    chosen = {}
    for name, fam in families().items():
        if name in APART or set(fam.rank.rivals) & set(chosen):
            continue
        predicted = {case_key(c) for c in fam.cases_from_model(model, workload)}
        if predicted:
            chosen[name] = (fam, predicted)
    return chosen


@pytest.mark.parametrize("model_id", MODELS)
def test_every_family_of_a_set_is_called_on_cases_it_predicted(model_id, tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu").eval()
    workload = Workload(2, 8, dtype="float32")
    chosen = set_of(model, workload)
    assert "kv_cache" in chosen and len(chosen) >= 4
    choosers = {}
    undo = []
    try:
        for name, (fam, _) in chosen.items():
            (tmp_path / name).mkdir()
            choosers[name] = CountingChooser(fam, tmp_path / name)
            undo.append(fam.patch(model, choosers[name]))
        runner = make_runner(model, workload)
        with torch.no_grad():
            runner.call()
    finally:
        for u in reversed(undo):
            u()
    for name, (_, predicted) in chosen.items():
        asked = {case_key(c) for c in choosers[name].cases}
        assert choosers[name].calls > 0, f"{name} never called with {sorted(chosen)} patched"
        assert asked <= predicted, f"{name} asked {sorted(asked - predicted)}"


DECODE_SET = ("gemv", "qkv_proj", "matmul_epilogue", "add_rmsnorm", "rmsnorm")


@pytest.mark.parametrize("order", [DECODE_SET, DECODE_SET[::-1]])
def test_the_decode_fusions_compose_with_gemv_in_any_patch_order(order, tmp_path):
    """A decode step with the fused decode families and gemv patched together, in either
    order: q/k/v from one launch per layer, gate/up with the gated epilogue in one, the
    residual add in down_proj's GEMV (accumulate), gemv on o_proj, down_proj and the LM head;
    logits as unpatched, every family called, undo restores every module."""
    from transformers import DynamicCache

    from codegen.registry import get_family
    from models.graphs import cache_argument

    # one kv head per query head: k/v at a width no family pads (as test_qkv_proj's tiny)
    model = build_with_full_kv("tiny-qwen2")
    ids = torch.randint(3, 500, (3, 6), generator=torch.Generator().manual_seed(2))

    def step():
        cache = DynamicCache()
        arg = {cache_argument(model): cache}
        with torch.no_grad():
            model(ids[:, :-1], use_cache=True, **arg)
            return model(ids[:, -1:], use_cache=True, **arg).logits

    want = step()
    choosers, undos = {}, []
    try:
        for name in order:
            (tmp_path / name).mkdir()
            # the GEMV configs lead matmul_epilogue's decode space
            choosers[name] = CountingChooser(get_family(name), tmp_path / name,
                                             pick=0 if name == "matmul_epilogue" else -1)
            undos.append(get_family(name).patch(model, choosers[name]))
        got = step()
    finally:
        for u in reversed(undos):
            u()
    layers = model.config.num_hidden_layers
    assert choosers["qkv_proj"].calls == layers  # the decode step only
    assert choosers["matmul_epilogue"].calls == 2 * layers  # the prefill's 15 rows too
    assert choosers["gemv"].calls >= 2 * layers  # o_proj and down_proj at least
    assert all(c.calls > 0 for c in choosers.values())
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not any("forward" in m.__dict__ for m in model.modules())


def build_with_full_kv(model_id: str):
    spec = resolve(model_id)
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    torch.manual_seed(0)
    return build(spec, torch.float32, "cpu").eval()
