"""RMSNorm family: reference == transformers, rendered kernels == reference, pattern == profile,
per-instance patching and undo on tiny models. CPU runs the kernels under Triton's interpreter
(fp32, fp16); bf16 kernel checks run only on a GPU (the interpreter gets bf16 math wrong)."""

from __future__ import annotations

import collections

import family_checks
import pytest
import torch
from family_checks import CountingChooser
from torch.profiler import ProfilerActivity, profile
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from codegen.rmsnorm import FAMILY, GEMMA_PATTERN, LLAMA_PATTERN
from codegen.rmsnorm.patch import recognise
from core.source import load_forward
from core.workload import Workload
from profiling.loader import build, resolve

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}
KERNEL_DTYPES = ["float32", "float16",
                 pytest.param("bfloat16", marks=pytest.mark.gpu)]
FORMS = FAMILY.extras["forms"]
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
def test_reference_is_bitwise_the_hf_module(form, dtype):
    hidden, eps = 96, 1e-5
    module = (LlamaRMSNorm if form == "llama" else GemmaRMSNorm)(hidden, eps=eps)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        module.weight.copy_(FAMILY.make_inputs(case_of(1, hidden, "float32", form), "cpu", g)[1])
    module = module.to(dtype)
    x = (torch.randn(3, 5, hidden, generator=g) * 3).to(dtype)
    with torch.no_grad():
        want = module(x)
    got = FAMILY.reference(x, module.weight.detach(), eps=eps, **FORMS[form])
    assert got.dtype == want.dtype and torch.equal(got, want)


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


def test_every_config_of_a_space_is_correct(tmp_path):
    case = case_of(6, 257, "float16", "llama")
    for config in FAMILY.search_space(case):
        out, ref = run_candidate(config, case, tmp_path)
        assert_close(out, ref, "float16")


@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, form, tmp_path):
    """One rendered candidate runs on all edge cases of its case, as the verifier runs it."""
    base = case_of(16, 64, dtype, form)
    edges = FAMILY.edge_cases(base)
    assert any(c["rows"] == 1 for c in edges) and any("row_stride" in c for c in edges)
    for case in edges:
        out, ref = run_candidate(FAMILY.search_space(base)[-1], case, tmp_path,
                                 rendered_for=base)
        assert_close(out, ref, dtype)


def test_rendered_source_is_specialised_and_guards_its_params(tmp_path):
    case = case_of(4, 300, "float32", "gemma", eps=1e-5)
    source = FAMILY.render({"rows_per_program": 2, "num_warps": 4}, case)
    for line in ("HIDDEN = 300", "BLOCK = 512", "ROWS_PER_PROGRAM = 2", "NUM_WARPS = 4",
                 "def _rms_norm_forward_kernel", "def forward(x, weight, *, out, **params)"):
        assert line in source
    path = tmp_path / "cand.py"
    path.write_text(source)
    forward = load_forward(path)
    x, w = FAMILY.make_inputs(case)
    with pytest.raises(ValueError):
        forward(x, w, out=torch.empty_like(x), eps=1e-6, offset=1.0, cast_first=False)


def _direct_ops(module, x):
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        module(x)
    direct = collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)
    every = {e.name for e in prof.events()}
    return dict(direct), every


@pytest.mark.parametrize("form", ["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pattern_ops_are_what_the_profiler_records(form, dtype):
    module = (LlamaRMSNorm if form == "llama" else GemmaRMSNorm)(64).to(dtype)
    pattern = LLAMA_PATTERN if form == "llama" else GEMMA_PATTERN
    direct, every = _direct_ops(module, torch.randn(4, 64).to(dtype))
    assert direct == pattern.ops
    assert every <= set(pattern.ops) | set(pattern.extra_ok)


def test_recognise_tells_the_forms_apart_and_rejects_lookalikes():
    assert recognise(LlamaRMSNorm(32, eps=1e-5)) == {"eps": 1e-5, **FORMS["llama"]}
    assert recognise(GemmaRMSNorm(32, eps=1e-6)) == {"eps": 1e-6, **FORMS["gemma"]}

    class ScaledRMSNorm(LlamaRMSNorm):  # right name, different computation
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    assert recognise(ScaledRMSNorm(32)) is None
    assert recognise(torch.nn.LayerNorm(32)) is None



@pytest.mark.parametrize("model_id, n_norms", [("tiny-llama", 5), ("tiny-gemma", 5)])
def test_patch_runs_the_kernel_and_undo_restores(model_id, n_norms, tmp_path):
    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        patched = model(ids).logits
        undo()
        after = model(ids).logits
    assert chooser.calls == n_norms
    assert {c["rows"] for c in chooser.cases} == {16}
    torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, before)
    assert not any("forward" in m.__dict__ for m in model.modules())




def test_cases_from_model():
    model = build(resolve("tiny-gemma"), torch.float32, "cpu")
    prefill = FAMILY.cases_from_model(model, Workload(batch=2, seq=8, dtype="bfloat16"))
    decode = FAMILY.cases_from_model(model, Workload(batch=4, seq=8, mode="decode"))
    assert prefill == [{"rows": 16, "hidden": 64, "dtype": "bfloat16", "eps": 1e-6,
                        **FORMS["gemma"]}]
    assert [c["rows"] for c in decode] == [4]


@pytest.mark.parametrize("model_type, extra, calls", [
    ("qwen3", {"head_dim": 16}, {(16, 64), (64, 16), (32, 16)}),
    ("olmo2", {}, {(16, 64), (16, 32)}),
])
def test_cases_from_model_are_the_q_k_norm_calls(model_type, extra, calls):
    """q/k norms as wide as a head (Qwen3: one row per head) and as wide as the whole
    projection (OLMo-2, whose k_norm is kv_heads x head_dim = 32 wide: one row per token; read
    as one per head it was a case no call asks for, and the kernel missed those calls)."""
    from transformers import AutoConfig

    from profiling.loader import ModelSpec

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=176,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, **extra)
    model = build(ModelSpec(model_type, "local", "random", cfg), torch.float32, "cpu")
    seen = set()

    def record(module, args, out):
        seen.add((args[0].numel() // module.weight.shape[0], module.weight.shape[0]))

    for m in model.modules():
        if recognise(m) is not None:
            m.register_forward_hook(record)
    with torch.no_grad():
        model(torch.randint(3, 500, (2, 8)))
    cases = FAMILY.cases_from_model(model, Workload(batch=2, seq=8, dtype="float32"))
    assert seen == calls  # (rows, width) of the model's norms, q_norm's and k_norm's
    assert {(c["rows"], c["hidden"]) for c in cases} == calls
