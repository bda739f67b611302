"""Deliberately wrong decode attention (tests/codegen/decode_cheats.py: the softmax scale
dropped, one slot past the cache's length attended, the first sequence's mask applied to the
whole batch) is rejected twice over (issue 62, classes 2 and 3): by the verifier, on the
family's cases and edge cases (per-sequence masks among them), and by the whole-model check of
a decode workload, which decodes over the dynamic cache, the static cache and a left-padded
batch on tiny Llama and tiny Qwen2; the honest kernel passes that check. (Its verification is
test_decode_attention.py's.)"""

from __future__ import annotations

import functools

import pytest
import torch
from decode_cheats import accepted, write
from family_checks import DEVICE

from codegen.decode_attention import FAMILY
from codegen.decode_attention.reference import make_case
from core.workload import Workload
from pipeline import integrate as ig
from profiling.loader import build, resolve
from verify.harness import verify_candidates

CHEATS = ("no_scale", "extra_slot", "row0_mask")


def test_the_verifier_rejects_a_wrong_decode_attention(tmp_path):
    case = make_case(2, 4, 2, 16, 100, "float32")
    paths = [write(name, case, tmp_path) for name in CHEATS]
    results = verify_candidates(FAMILY, paths, [case], device=DEVICE, trials=1, timing=False,
                                jobs=2)
    for name, result in zip(CHEATS, results):
        assert result.verdict == "rejected", name
        # wrong on every input set of the case that shows it: numerics first
        failed = result.failed()
        assert "numerics" in failed, (name, result.reasons)
        assert failed <= {"numerics", "memoisation", "stress", "nonfinite"}, result.reasons
        assert result.reasons[0].startswith("numerics in "), (name, result.reasons)
        label = result.reasons[0].split(" in ", 1)[1].split(":", 1)[0]
        case_seen = next(e["case"] for e in result.cases if e["label"] == label)
        if name == "no_scale":
            assert label == "c0"
        if name == "extra_slot":  # where a slot lies past the length: the full cache rewound
            assert result.reasons[0].startswith("numerics in c0: cache_rewound"), result.reasons
        if name == "row0_mask":  # only sequences whose masks differ tell it apart
            assert len(set(case_seen["pads"])) > 1, result.reasons


MODELS = ("tiny-llama", "tiny-qwen2")


@functools.cache
def decoding(model_id: str):
    model = build(resolve(model_id), torch.float32, "cpu")
    workload = Workload(2, 8, mode="decode")
    return model, ig.fp32_reference(model), workload, FAMILY.cases_from_model(model, workload)


def check(model_id: str, name: str, folder):
    model, ref, workload, cases = decoding(model_id)
    return ig.whole_model_check(model, ref, accepted(name, cases, folder), ["decode_attention"],
                                workload, seeds=(0,))


def failing_paths(result) -> set[str]:
    return {t["path"] for t in result["trials"] if not t["passed"]}


@pytest.mark.parametrize("model_id", MODELS)
def test_the_decode_check_passes_the_honest_kernel_on_every_path_and_step(model_id, tmp_path):
    result = check(model_id, "honest", tmp_path)
    assert result["passed"], result["failure"]
    assert result["failure"] is None
    steps = {(t["path"], t["step"]) for t in result["trials"]}
    assert steps == {(p, s) for p in ("dynamic", "static", "padded", "padded_static")
                     for s in range(4)}


@pytest.mark.parametrize("model_id", MODELS)
def test_the_decode_check_fails_a_dropped_scale(model_id, tmp_path):
    result = check(model_id, "no_scale", tmp_path)
    assert not result["passed"]
    assert failing_paths(result) == {"dynamic", "static", "padded", "padded_static"}
    # the prefill does not run the kernel (its query is many tokens); every step does
    assert all(t["passed"] == (t["step"] == 0) for t in result["trials"])
    assert result["failure"].startswith("decode_attention: dynamic cache, step 1 (position 8)")


@pytest.mark.parametrize("model_id", MODELS)
def test_the_decode_check_fails_one_extra_cache_slot(model_id, tmp_path):
    """Only a static cache has a slot past the length, stale (zeros after the prefill)."""
    result = check(model_id, "extra_slot", tmp_path)
    assert not result["passed"]
    assert failing_paths(result) == {"static", "padded_static"}
    assert result["failure"].startswith("decode_attention: static cache, step 1")


def test_the_decode_check_fails_the_first_sequences_mask_for_all(tmp_path):
    result = check("tiny-llama", "row0_mask", tmp_path)
    assert not result["passed"]
    assert failing_paths(result) == {"padded", "padded_static"}


@pytest.mark.gpu
def test_gpu_the_decode_check_replays_the_graphed_step_too(tmp_path):
    """On a GPU the static cache's step is also captured and replayed (what the graphs stage
    ships): the honest kernel passes there, the dropped scale fails there as everywhere."""
    model = build(resolve("tiny-llama"), torch.bfloat16, "cuda")
    workload = Workload(2, 8, dtype="bfloat16", device="cuda", mode="decode")
    cases = FAMILY.cases_from_model(model, workload)
    ref = ig.fp32_reference(model)
    results = {name: ig.whole_model_check(model, ref, accepted(name, cases, tmp_path),
                                          ["decode_attention"], workload, seeds=(0,))
               for name in ("honest", "no_scale")}
    honest, wrong = results["honest"], results["no_scale"]
    assert "paths_skipped" not in honest, honest.get("paths_skipped")
    graphed = [t for t in honest["trials"] if t["path"] == "static_graphed"]
    assert len(graphed) == 4 and all(t["passed"] for t in graphed), graphed
    assert honest["passed"], honest["failure"]
    assert not any(t["passed"] for t in wrong["trials"]
                   if t["path"] == "static_graphed" and t["step"] > 0)
