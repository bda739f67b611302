"""Fused residual add + RMSNorm: reference == the decoder layer's own code, rendered kernels ==
reference, pattern == profile, and the decoder-layer adapter on tiny models (prefill, decode
with a KV cache, stacked with the RMSNorm patch), with undo."""

from __future__ import annotations

import collections

import family_checks
import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

import codegen.rmsnorm
from codegen.add_rmsnorm import ADD_RMSNORM_PATTERN, FAMILY
from codegen.add_rmsnorm.patch import recognise
from core.source import load_forward
from core.workload import Workload
from models.graphs import cache_argument, output_cache
from profiling.loader import build, resolve

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
FORMS = codegen.rmsnorm.FAMILY.extras["forms"]
SHAPES = [(2 * 8, 64), (1, 1023), (3, 257), (7, 4096)]


def case_of(rows, hidden, dtype, form, eps=1e-6):
    return {"rows": rows, "hidden": hidden, "dtype": dtype, "eps": eps, **FORMS[form]}


def run_candidate(config, case, tmp_path, seed=0, rendered_for=None):
    return family_checks.run_candidate(FAMILY, config, case, tmp_path, seed, rendered_for)


def assert_close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_is_bitwise_the_layer_code(form, dtype):
    norm = (LlamaRMSNorm if form == "llama" else GemmaRMSNorm)(96, eps=1e-5)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        norm.weight.normal_(1.0 - FORMS[form]["offset"], 0.1, generator=g)
    norm = norm.to(dtype)
    residual, attn_out = (torch.randn(2, 3, 96, generator=g) * 4).to(dtype).unbind(0)
    with torch.no_grad():
        total = residual + attn_out  # what the decoder layer does, then its norm
        want = (total, norm(total))
        got = FAMILY.reference(attn_out, residual, norm.weight, eps=1e-5, **FORMS[form])
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("rows, hidden", SHAPES)
def test_rendered_matches_reference(rows, hidden, dtype, form, tmp_path):
    case = case_of(rows, hidden, dtype, form)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 12
    for config in (configs[0], configs[-1]):
        out, ref = run_candidate(config, case, tmp_path)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    """One rendered candidate runs on all edge cases of its case, as the verifier runs it."""
    base = case_of(16, 64, dtype, "llama")
    for case in FAMILY.edge_cases(base):
        out, ref = run_candidate(FAMILY.search_space(base)[-1], case, tmp_path,
                                 rendered_for=base)
        assert_close(out, ref, dtype)


def test_pattern_ops_are_what_the_profiler_records():
    """Marks every child module with a record_function range, so the layer's own ops are the
    aten events whose parent is the layer's range."""
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    layer = model.model.layers[0]
    open_ranges, handles = [], []

    def enter(name):
        def hook(module, args, kwargs=None):
            open_ranges.append(torch.profiler.record_function(name))
            open_ranges[-1].__enter__()
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    for name, module in [("layer", layer), *layer.named_children()]:
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        model(torch.arange(3, 11).view(1, 8))
    for h in handles:
        h.remove()
    own = collections.Counter(e.name for e in prof.events()
                              if e.cpu_parent is not None and e.cpu_parent.name == "layer")
    own.pop("self_attn"), own.pop("mlp")
    own.pop("input_layernorm"), own.pop("post_attention_layernorm")
    assert dict(own) == ADD_RMSNORM_PATTERN.ops


def test_recognise_takes_only_the_known_layout():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    layer = model.model.layers[0]
    assert recognise(layer)["form"] == {"eps": 1e-6, **FORMS["llama"]}

    class PostNormLayer(LlamaDecoderLayer):  # same parts, different order of operations
        def forward(self, hidden_states, **kwargs):
            hidden_states = hidden_states + self.self_attn(hidden_states=hidden_states,
                                                          **kwargs)[0]
            return self.post_attention_layernorm(hidden_states)

    assert recognise(PostNormLayer(model.config, 0)) is None
    gpt2 = build(resolve("tiny-gpt2"), torch.float32, "cpu")
    assert not any(recognise(m) for m in gpt2.modules())


def make_chooser(tmp_path, calls):
    loaded = {}

    def chooser(case):
        key = repr(sorted(case.items()))
        if key not in loaded:
            path = tmp_path / f"chosen_{len(loaded)}.py"
            path.write_text(FAMILY.render(FAMILY.search_space(case)[0], case))
            loaded[key] = load_forward(path)

        def counted(*args, **kwargs):
            calls.append(case["rows"])
            return loaded[key](*args, **kwargs)

        return counted

    return chooser


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-gemma", "tiny-phi3"])
def test_patch_prefill_and_decode_and_undo(model_id, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    nxt = torch.tensor([[5], [7]], device=DEVICE)

    def prefill_and_step():
        out = model(ids, use_cache=True)
        step = model(nxt, **{cache_argument(model): output_cache(out)})
        return out.logits, step.logits

    calls = []
    with torch.no_grad():
        before = prefill_and_step()
        undo = FAMILY.patch(model, make_chooser(tmp_path, calls))
        patched = prefill_and_step()
        undo()
        after = prefill_and_step()
    assert calls == [16, 16, 2, 2]  # two layers, prefill then one decode step
    for p, b in zip(patched, before, strict=True):
        torch.testing.assert_close(p, b, atol=1e-4, rtol=1e-4)
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_patch_stacks_with_the_rmsnorm_patch(tmp_path):
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    fused, plain = [], []
    rms_family = codegen.rmsnorm.FAMILY

    def rms_chooser(case):
        path = tmp_path / f"rms_{len(plain)}.py"
        path.write_text(rms_family.render(rms_family.search_space(case)[0], case))
        plain.append(case["rows"])
        return load_forward(path)

    with torch.no_grad():
        before = model(ids).logits
        undo_rms = rms_family.patch(model, rms_chooser)
        undo_fused = FAMILY.patch(model, make_chooser(tmp_path, fused))
        patched = model(ids).logits
        undo_fused()
        undo_rms()
        after = model(ids).logits
    # Input norms of both layers and the final norm stay with the RMSNorm kernel; the
    # post-attention norms run inside the fused kernel instead.
    assert len(fused) == 2 and len(plain) == 3
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert not any("forward" in m.__dict__ for m in model.modules())


def _aten_counts(fn) -> collections.Counter:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return collections.Counter(e.name for e in prof.events())


def _patched_and_counts(model, tmp_path, ids, extra_patch=None):
    with torch.no_grad():
        before = model(ids).logits
        plain = _aten_counts(lambda: model(ids))
        undo_extra = extra_patch(model) if extra_patch else (lambda: None)
        undo = FAMILY.patch(model, make_chooser(tmp_path, []))
        patched = model(ids).logits
        fused = _aten_counts(lambda: model(ids))
        undo()
        undo_extra()
        after = model(ids).logits
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert not any("forward" in m.__dict__ for m in model.modules())
    return plain, fused


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-gemma", "tiny-phi3"])
def test_last_residual_add_runs_in_down_proj_gemm(model_id, tmp_path, monkeypatch):
    """Per layer, the MLP's residual add becomes down_proj's GEMM with the sum as C, in
    place: one addmm_ per layer and one add fewer than the same patch without the fold, same
    logits; Phi-3's eval-mode dropout is the identity."""
    import codegen.add_rmsnorm.residual_gemm as residual_gemm

    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    _, fused = _patched_and_counts(model, tmp_path, ids)
    monkeypatch.setattr(residual_gemm, "mlp_returns_down_proj", lambda mlp: False)
    _, unfolded = _patched_and_counts(model, tmp_path, ids)
    layers = model.config.num_hidden_layers
    assert unfolded["aten::addmm_"] == 0 and fused["aten::addmm_"] == layers
    assert fused["aten::add"] == unfolded["aten::add"] - layers


@pytest.mark.parametrize("mlp_family", ["gated_act", "matmul_epilogue"])
def test_the_fold_goes_through_the_mlp_families_forwards(mlp_family, tmp_path):
    """gated_act's forward (which never calls the one below) and matmul_epilogue's (which may)
    declare that they return down_proj's output: the add is still folded under them."""
    from codegen.registry import get_family

    family = get_family(mlp_family)
    loaded = {}

    def chooser(case):
        key = repr(sorted(case.items()))
        if key not in loaded:
            path = tmp_path / f"{mlp_family}_{len(loaded)}.py"
            path.write_text(family.render(family.search_space(case)[-1], case))
            loaded[key] = load_forward(path)
        return loaded[key]

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    _, fused = _patched_and_counts(model, tmp_path, ids, lambda m: family.patch(m, chooser))
    assert fused["aten::addmm_"] == model.config.num_hidden_layers


def test_no_fold_where_the_mlp_changes_down_projs_output(tmp_path):
    """An MLP whose forward scales down_proj's output, or one with a forward hook, or an
    instance forward nobody declared: the layer adds as before, and the logits stay right."""
    from codegen.add_rmsnorm.residual_gemm import class_returns_down_proj, mlp_returns_down_proj

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    mlp_class = type(model.model.layers[0].mlp)

    class ScaledMLP(mlp_class):
        def forward(self, x):
            return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5

    class InheritedMLP(mlp_class):
        pass

    assert class_returns_down_proj(mlp_class) and class_returns_down_proj(InheritedMLP)
    assert not class_returns_down_proj(ScaledMLP)
    model.model.layers[0].mlp.__class__ = ScaledMLP
    hooked = model.model.layers[1].mlp
    handle = hooked.register_forward_hook(lambda module, args, out: out * 2)
    assert not mlp_returns_down_proj(hooked) and not mlp_returns_down_proj(
        model.model.layers[0].mlp)
    ids = torch.arange(3, 19, device=DEVICE).view(2, 8)
    _, fused = _patched_and_counts(model, tmp_path, ids)
    assert fused["aten::addmm_"] == 0
    handle.remove()
    hooked.forward = lambda x: mlp_class.forward(hooked, x)  # someone else's instance forward
    assert not mlp_returns_down_proj(hooked)


def test_cases_from_model():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    cases = FAMILY.cases_from_model(model, Workload(batch=3, seq=8, mode="decode"))
    assert cases == [{"rows": 3, "hidden": 64, "dtype": "float32", "eps": 1e-6,
                      **FORMS["llama"]}]


def test_fast_binding_equals_signature_bind():
    """The adapter binds HF's call (hidden_states positional, the rest by keyword) without
    Signature.bind; it must give exactly what bind + apply_defaults gives, and refuse what
    bind refuses."""
    from codegen.add_rmsnorm.patch import _arguments, layer_template

    template = layer_template(LlamaDecoderLayer)
    assert template is not None
    hs, mask = torch.zeros(1, 2, 4), torch.ones(1, 1)
    old_names = list(template["renames"])  # e.g. past_key_values -> cache in transformers 5.2x
    for kwargs in ({}, {"attention_mask": mask, "use_cache": True},
                   {"position_ids": None, "output_foo": 3}, dict.fromkeys(old_names, 7)):
        renamed = {template["renames"].get(k, k): v for k, v in kwargs.items()}
        bound = template["signature"].bind(None, hs, **renamed)
        bound.apply_defaults()
        want = {k: v for k, v in bound.arguments.items() if k != "self"}
        got = _arguments(template, None, (hs,), kwargs)
        assert got.keys() == want.keys()
        assert all(got[k] is v or got[k] == v for k, v in want.items())
    assert _arguments(template, None, (), {}) is None  # hidden_states missing: bind refuses


@pytest.mark.parametrize("bad", ["residual_rows", "out_width", "three_dims"])
def test_rendered_forward_rejects_tensors_of_another_shape(bad, tmp_path):
    case = case_of(6, 64, "float32", "llama")
    path = tmp_path / "cand.py"
    path.write_text(FAMILY.render(FAMILY.search_space(case)[0], case))
    forward = load_forward(path)
    x, residual, weight = FAMILY.make_inputs(case)
    total, normed = torch.empty_like(x), torch.empty_like(x)
    if bad == "residual_rows":
        residual = residual[:5]
    elif bad == "out_width":
        normed = torch.empty(6, 65)
    else:
        x, residual = x.view(2, 3, 64), residual.view(2, 3, 64)
        total, normed = total.view(2, 3, 64), normed.view(2, 3, 64)
    with pytest.raises(ValueError, match="expected \\(rows, 64\\) tensors"):
        forward(x, residual, weight, out=(total, normed))


@pytest.mark.parametrize("gemv_first", [True, False])
def test_at_a_decode_step_the_fold_runs_in_gemvs_epilogue(gemv_first, tmp_path):
    """With the gemv family on down_proj (patched before or after this one), the residual add
    runs in the GEMV's epilogue (`accumulate`), one launch per layer and no addmm_; logits as
    unpatched; undo in any order restores every module."""
    from transformers import DynamicCache

    from codegen.gemv import FAMILY as GEMV

    model = build(resolve("tiny-llama"), torch.float32, DEVICE).eval()
    ids = torch.arange(3, 15, device=DEVICE).view(2, 6)

    def step(prof=None):
        """The decode step's logits after a prefill; `prof` profiles the step alone."""
        cache = DynamicCache()
        arg = {cache_argument(model): cache}
        with torch.no_grad():
            model(ids[:, :-1], use_cache=True, **arg)
            if prof is None:
                return model(ids[:, -1:], use_cache=True, **arg).logits
            with prof:
                return model(ids[:, -1:], use_cache=True, **arg).logits

    want = step()
    counts = collections.Counter()

    def chooser_of(family, name):
        loaded = {}

        def chooser(case):
            key = repr(sorted(case.items()))
            if key not in loaded:
                path = tmp_path / f"{name}_{len(loaded)}.py"
                path.write_text(family.render(family.search_space(case)[-1], case))
                kernel = load_forward(path)

                def counted(*args, kernel=kernel, **kwargs):
                    counts[name, bool(kwargs.get("accumulate"))] += 1
                    return kernel(*args, **kwargs)
                counted.__wrapped__ = kernel
                loaded[key] = counted
            return loaded[key]
        return chooser

    pairs = [(GEMV, chooser_of(GEMV, "gemv")), (FAMILY, chooser_of(FAMILY, "add_rmsnorm"))]
    undos = [f.patch(model, c) for f, c in (pairs if gemv_first else pairs[::-1])]
    try:
        prof = profile(activities=[ProfilerActivity.CPU])
        got = step(prof)
    finally:
        for u in undos if gemv_first else reversed(undos):
            u()
    layers = model.config.num_hidden_layers
    assert counts["gemv", True] == layers
    assert not [e for e in prof.events() if e.name == "aten::addmm_"]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not any("forward" in m.__dict__ for m in model.modules())
