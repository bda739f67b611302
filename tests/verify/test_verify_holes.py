"""The holes of issue 27, each closed as a class: cheats of each class against two real families
(rmsnorm, gated_act at the layout its adapter passes), rejected for the reason that names the
class, while the families' honest rendered kernels are accepted."""

from pathlib import Path

import pytest
import torch

from codegen.gated_act import FAMILY as GATED
from codegen.gated_act.reference import make_case as gated_case
from codegen.gelu import FAMILY as GELU
from codegen.gelu.reference import make_case as gelu_case
from codegen.rmsnorm import FAMILY as RMSNORM
from verify.harness import verify_candidate, verify_candidates
from verify.numerics import inject_nonfinite, repeat_in_part
from verify.static import source_problems

HERE = Path(__file__).parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RMS_CASE = {"rows": 6, "hidden": 64, "dtype": "float32", "eps": 1e-6, "offset": 0.0,
            "cast_first": True}
# What the patched Llama MLP hands the kernel: (batch, seq, cols) column halves of one fused
# (batch, seq, 2 * cols) product.
GATED_CASE = gated_case(6, 48, "float32", "silu", "separate", lead=(2, 3), operands="halves")
FAMILIES = {"rmsnorm": (RMSNORM, RMS_CASE), "gated_act": (GATED, GATED_CASE)}

# cheat: (the check it must fail, text its reason must hold)
CHEATS = {
    "poison_aware": ("numerics", "out prefilled with random values"),
    "rebuilt_from_aten": ("aten_ops", "compute ops outside the allow-list"),
    "memo_pointer": ("memoisation", "same_buffers"),
    "memo_prefix": ("memoisation", "same_prefix"),
    "nonfinite_fixed_rows": ("nonfinite", "non-finite mismatches"),
    "flat_rows_only": ("numerics", "elements outside tolerance"),
    "patches_timer": ("static", "monkeypatching"),
    "starts_thread": ("static", "threads or processes"),
    "own_stream": ("static", "stream creation"),
    "imports_reference": ("static", "reference"),
}


@pytest.fixture(scope="module")
def results():
    got = {}
    for fam_name, (family, case) in FAMILIES.items():
        paths = [HERE / "cheats" / f"{name}.py" for name in CHEATS]
        for name, result in zip(CHEATS, verify_candidates(
                family, paths, [case], device=DEVICE, trials=2, timing=False, jobs=2)):
            got[fam_name, name] = result
    return got


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(CHEATS))
def test_cheat_is_rejected_for_its_class(results, family, name):
    check, text = CHEATS[name]
    result = results[family, name]
    assert result.verdict == "rejected"
    assert text in reason(result, check), result.reasons


def reason(result, check: str) -> str:
    found = [r for r in result.reasons if r.startswith(check)]
    assert found, (check, result.reasons)
    return found[0]


def test_the_allow_list_names_the_op(results):
    assert "aten::linalg_vector_norm" in reason(results["rmsnorm", "rebuilt_from_aten"],
                                                "aten_ops")
    assert "aten::exp" in reason(results["gated_act", "rebuilt_from_aten"], "aten_ops")


def test_the_gated_act_layout_cheat_fails_on_the_given_case_itself(results):
    """The 2-D-only kernel passed every case when they were plain (rows, cols) tensors; on the
    adapter's layout its first failure is the given case, not an edge."""
    assert "in c0:" in reason(results["gated_act", "flat_rows_only"], "numerics")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_honest_rendered_kernels_are_accepted(family, tmp_path):
    fam, case = FAMILIES[family]
    space = fam.search_space(case)
    paths = []
    for i, config in enumerate((space[0], space[-1])):
        path = tmp_path / f"honest{i}.py"
        path.write_text(fam.render(config, case))
        paths.append(path)
    for result in verify_candidates(fam, paths, [case], device=DEVICE, trials=2, jobs=2):
        assert result.accepted, result.reasons
        timed = [c for c in result.checks if c["name"] == "timed_results"]
        assert timed and all(c["passed"] for c in timed)
        assert result.seeds["nonce"] > 0


def test_the_random_prefill_differs_from_run_to_run(tmp_path):
    path = tmp_path / "k.py"
    path.write_text(RMSNORM.render(RMSNORM.search_space(RMS_CASE)[0], RMS_CASE))
    a, b = (verify_candidate(RMSNORM, path, [RMS_CASE], device=DEVICE, trials=1, timing=False)
            for _ in range(2))
    assert a.accepted and b.accepted
    assert a.seeds["nonce"] != b.seeds["nonce"]


def test_nonfinite_positions_are_drawn_from_the_seed():
    def rows_hit(seed):
        x = torch.zeros(64, 32)
        inject_nonfinite([x], [0], seed)
        return set((~torch.isfinite(x)).any(1).nonzero().flatten().tolist())

    assert rows_hit(1) == rows_hit(1)
    assert rows_hit(1) != rows_hit(2)
    assert not rows_hit(1) <= {0, 21, 42}  # not the fixed rows of before


def test_memo_probes_repeat_part_of_the_last_input():
    old = (torch.randn(6, 8), torch.randn(8))
    fresh = (torch.randn(6, 8), torch.randn(8))
    same = repeat_in_part("same_buffers", old, (fresh[0].clone(), fresh[1].clone()))
    assert same[0] is old[0] and torch.equal(same[0], fresh[0])
    prev = tuple(t.clone() for t in old)
    prefix = repeat_in_part("same_prefix", prev, (torch.randn(6, 8), torch.randn(8)))
    assert torch.equal(prefix[0][:3], prev[0][:3]) and not torch.equal(prefix[0][3:], prev[0][3:])


def test_the_gated_act_case_is_the_adapters_layout():
    gate, up = GATED.make_inputs(GATED_CASE, "cpu", torch.Generator().manual_seed(0))
    assert gate.shape == (2, 3, 48) and gate.stride() == (3 * 96, 96, 1)
    assert up.storage_offset() == 48 and up.untyped_storage().data_ptr() == \
        gate.untyped_storage().data_ptr()
    assert GATED.make_out(GATED_CASE, (gate, up)).shape == (2, 3, 48)


def test_static_check_reads_the_source():
    assert source_problems("import time\ntime.perf_counter = lambda: 0\n")
    assert source_problems("import time as t\nt.monotonic = None\n")
    assert source_problems("import torch\ns = torch.cuda.Stream()\n")
    assert source_problems("from concurrent.futures import ThreadPoolExecutor\n")
    assert source_problems("from verify.tolerances import TOLERANCES\n")
    assert source_problems("def forward(x, *, out):\n    v = x.tolist()\n")
    assert source_problems("import torch\n\ndef forward(x, *, out):\n    out.copy_(x)\n") == []


def test_bf16_on_the_cpu_is_said_to_be_blind_to_bf16_accumulation(tmp_path):
    case = {**RMS_CASE, "dtype": "bfloat16"}
    path = tmp_path / "k.py"
    path.write_text(RMSNORM.render(RMSNORM.search_space(case)[0], case))
    result = verify_candidate(RMSNORM, path, [case], device=DEVICE, trials=1, timing=False)
    assert result.accepted, result.reasons
    if DEVICE == "cpu":
        assert any("truncates fp32 -> bf16" in n for n in result.notes)


@pytest.mark.gpu
def test_bf16_candidates_are_held_to_the_reference_distribution(tmp_path):
    """On the GPU (round-to-nearest bf16): the rendered fp32-accumulating kernel passes, one that
    accumulates the sum of squares in bf16 over a long row fails."""
    case = {**RMS_CASE, "rows": 64, "hidden": 8192, "dtype": "bfloat16"}
    honest = tmp_path / "honest.py"
    honest.write_text(RMSNORM.render(RMSNORM.search_space(case)[0], case))
    good, bad = verify_candidates(RMSNORM, [honest, HERE / "cheats" / "bf16_accumulate.py"],
                                  [case], device=DEVICE, trials=2, timing=False)
    assert good.accepted, good.reasons
    assert bad.verdict == "rejected"
    assert any(r.startswith("numerics") for r in bad.reasons), bad.reasons


def test_same_prefix_splices_only_the_data_inputs():
    """A table outside the family's data inputs comes whole from the fresh draw: a spliced
    rope table (halves that differ) is an input no model passes."""
    prev = (torch.randn(6, 8), torch.randn(1, 8))
    fresh = (torch.randn(6, 8), torch.randn(1, 8))
    table = fresh[1].clone()
    out = repeat_in_part("same_prefix", prev, fresh, data=(0,))
    assert torch.equal(out[0][:3], prev[0][:3]) and torch.equal(out[1], table)


def test_a_gelu_kernel_right_only_for_2d_rows_fails_on_the_adapters_layout():
    """Class 5 for a second family: the cheat passes the 2-D cases gelu had before they carried
    the adapter's (batch, seq, cols) shape, and fails the given case that carries it."""
    flat = gelu_case(16, 176, "float32")
    model = gelu_case(16, 176, "float32", lead=(2, 8))
    cheat = HERE / "cheats" / "rows_of_dim0.py"
    old, new = (verify_candidate(GELU, cheat, [c], device=DEVICE, trials=1, timing=False)
                for c in (flat, model))
    assert old.accepted, old.reasons
    assert new.verdict == "rejected"
    assert "in c0:" in reason(new, "numerics"), new.reasons
