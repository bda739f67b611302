"""The whole-model check sees what random prompts on a freshly built model hid: a norm kernel
that skips its weight (every norm weight is 1 from the config) and a kernel that caches its
answer across prompts (random prompts never share a prefix). tiny-llama, fp32, on the CPU."""

from __future__ import annotations

import pytest
import torch

from codegen.rmsnorm import FAMILY as RMSNORM
from codegen.search import case_key
from core.workload import Workload
from pipeline import integrate as ig
from profiling.loader import build, resolve

WORKLOAD = Workload(2, 8)

SKIPS_WEIGHT = '''
import torch


def forward(x, weight, *, out, eps, offset, cast_first):
    h = x.float()
    out.copy_((h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))
'''

HONEST = '''
import torch


def forward(x, weight, *, out, eps, offset, cast_first):
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out.copy_(h * (weight.float() + offset).to(x.dtype))
'''

# Right answers, but a result is reused for any later input whose first row starts alike.
CACHES_ACROSS_PROMPTS = HONEST.replace("def forward(", "def _forward(") + '''

_cache = {}


def forward(x, weight, *, out, **params):
    key = (tuple(x.shape), weight.data_ptr(), tuple(x[0, :4].tolist()))
    if key not in _cache:
        _forward(x, weight, out=out, **params)
        _cache[key] = out.clone()
    out.copy_(_cache[key])
'''


def model_and_reference():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    return model, ig.fp32_reference(model)


def accepted_for(model, source: str, tmp_path) -> dict:
    path = tmp_path / f"k{abs(hash(source))}.py"
    path.write_text(source)
    return {case_key(c): {"family": "rmsnorm", "case": c, "source": str(path)}
            for c in RMSNORM.cases_from_model(model, WORKLOAD)}


def test_a_norm_kernel_that_skips_its_weight_is_rejected(tmp_path):
    model, ref = model_and_reference()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    bad = ig.whole_model_check(model, ref, accepted_for(model, SKIPS_WEIGHT, tmp_path),
                               ["rmsnorm"], WORKLOAD)
    good = ig.whole_model_check(model, ref, accepted_for(model, HONEST, tmp_path), ["rmsnorm"],
                                WORKLOAD)
    assert not bad["passed"], bad["trials"]
    assert good["passed"], good["trials"]
    perturbed = bad["constants_perturbed"]["parameters"]
    assert any(name.endswith("input_layernorm.weight") for name in perturbed)
    # the caller's model (and its reference) come out as they went in
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(bool((p == 1).all()) for n, p in ref.named_parameters() if "norm" in n)


def test_a_kernel_that_caches_across_prompts_is_rejected(tmp_path):
    model, ref = model_and_reference()
    result = ig.whole_model_check(model, ref,
                                  accepted_for(model, CACHES_ACROSS_PROMPTS, tmp_path),
                                  ["rmsnorm"], WORKLOAD)
    first, *later = result["trials"]
    assert first["passed"] and first["shares_prefix"] is None  # nothing cached yet
    assert later[0]["shares_prefix"] == {"dim": "seq", "length": WORKLOAD.seq // 2}
    assert not result["passed"], result["trials"]


def test_prompts_share_prefixes_with_new_tails():
    prompts = ig.shared_prefix_prompts(512, (2, 8), (0, 1, 2), "cpu")
    a, b = prompts[0]["ids"], prompts[1]["ids"]
    assert torch.equal(a[:, :4], b[:, :4]) and not torch.equal(a[:, 4:], b[:, 4:])
    decode = ig.shared_prefix_prompts(512, (4, 1), (0, 1), "cpu")
    assert torch.equal(decode[0]["ids"][:2], decode[1]["ids"][:2])


def test_logits_error_in_slices_equals_the_whole_norm():
    """The check's error is summed a slice of rows at a time (whole float64 copies of Gemma's
    b8 logits ran an 80 GB card out of memory): slicing must not change it, nor drop rows."""
    from pipeline.integrate import logits_error

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(3, 7, 11, generator=gen)
    out = (ref + 0.01 * torch.randn(3, 7, 11, generator=gen)).bfloat16()
    whole = float((out.double() - ref.double()).norm() / ref.double().norm())
    for chunk in (1, 11, 50, 1 << 26):  # a row per slice, one row, a ragged last slice, all
        assert logits_error(out, ref, chunk=chunk) == pytest.approx(whole, rel=1e-12)
    last = out.clone()
    last[-1, -1, -1] += 5.0  # a difference in the very last row counts
    assert logits_error(last, ref, chunk=50) > whole + 0.01
    assert logits_error(ref, ref) == 0.0


def test_a_rejected_family_is_named_with_the_trial_it_failed(tmp_path):
    model, ref = model_and_reference()
    result = ig.check_and_bisect(model, ref, accepted_for(model, SKIPS_WEIGHT, tmp_path),
                                 ["rmsnorm"], WORKLOAD)
    assert result["rejected"].keys() == {"rmsnorm"} and result["kept"] == []
    (line,) = result["reasons"].values()
    assert line.startswith("rmsnorm: seed 100: patched logits error ")
    assert "\n" not in line


def test_left_padding_differs_per_sequence_and_leaves_each_a_token():
    from pipeline.decode_check import left_pads

    assert left_pads(1, 8) == [2]
    assert left_pads(3, 8) == [0, 2, 4]
    assert left_pads(2, 64) == [0, 32]
    assert all(p < 2 for p in left_pads(4, 2))


@pytest.mark.parametrize("path", ["padded", "padded_static"])
def test_a_left_padded_batch_decodes_each_sequence_as_it_would_alone(path):
    """The check's padded decoders (a 2-D mask, per-sequence positions; over the dynamic and a
    static cache) give each sequence the logits of its unpadded prompt decoded alone."""
    from pipeline.decode_check import decode, left_pads

    model = build(resolve("tiny-qwen2"), torch.float32, "cpu").eval()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 512, (3, 8), generator=gen)
    tokens = [torch.randint(0, 512, (3, 1), generator=gen) for _ in range(3)]
    with torch.no_grad():
        padded = decode(model, path, prompt, tokens)
        for row, pad in enumerate(left_pads(3, 8)):
            alone = decode(model, "dynamic", prompt[row:row + 1, pad:],
                           [t[row:row + 1] for t in tokens])
            for got, want in zip(padded, alone):
                torch.testing.assert_close(got[row:row + 1], want, atol=1e-5, rtol=1e-5)


def test_a_run_of_both_modes_is_checked_decoding_too(tmp_path):
    """Workloads of one dtype share a check: it runs on the first of each mode, so a kernel
    accepted only for a decode step's cases is judged decoding, and the failure names where."""
    model, ref = model_and_reference()
    decode = Workload(2, 8, mode="decode")
    path = tmp_path / "skips_weight.py"
    path.write_text(SKIPS_WEIGHT)
    accepted = {case_key(c): {"family": "rmsnorm", "case": c, "source": str(path)}
                for c in RMSNORM.cases_from_model(model, decode)}
    result = ig.check_modes(model, ref, accepted, ["rmsnorm"],
                            [WORKLOAD, Workload(4, 8), decode])
    assert result["workloads"] == [WORKLOAD.key, decode.key]
    by_workload = {}
    for t in result["trials"]:
        by_workload.setdefault(t["workload"], []).append(t["passed"])
    assert all(by_workload[WORKLOAD.key]) and not all(by_workload[decode.key])
    assert not result["passed"]
    assert result["failure"].startswith(f"rmsnorm: {decode.key}, dynamic cache, step 1 ")
