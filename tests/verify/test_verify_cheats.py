"""Deliberately cheating candidates: each is rejected, by the check that names its cheat.

All go through the one entry point (verify_candidates -> verify_candidate), two workers at a
time. `must` are the checks the cheat has to fail; `may` are consequences that may fail with it
(an unwritten output is also numerically wrong); anything else failing is a wrong diagnosis.
"""

from pathlib import Path

import pytest
import torch
from verify_families import CASE_FP16, CASE_FP32, CASE_PAIR, PAIR, RMSNORM

from verify.harness import verify_candidate, verify_candidates

HERE = Path(__file__).parent
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WRONG = {"numerics", "memoisation", "stress", "nonfinite"}

CHEATS = {
    # name: (must fail, may also fail)
    "writes_nothing": ({"writes_all"}, WRONG),
    "returns_new_buffer": ({"writes_all"}, WRONG),
    "partial_write": ({"writes_all"}, WRONG),
    "cached_result": ({"numerics"}, WRONG),
    "first_shape_only": ({"numerics"}, WRONG),
    "low_precision": ({"numerics"}, WRONG),
    "nan_to_num": ({"nonfinite"}, set()),
    # run 2 sees the mutated input
    "mutates_input": ({"inputs_unchanged"}, {"deterministic"} | WRONG),
    "aten_fallback": ({"aten_ops"}, set()),
    # On a GPU the extra element races with the next row's program, so its value may be wrong too.
    "off_by_one": ({"out_of_bounds"}, WRONG | {"deterministic"}),
    "nondeterministic": ({"deterministic"}, set()),
    "rebinds_out": ({"out_buffer"}, set()),
    "raises": ({"runs"}, set()),
    "compile_error": ({"runs"}, set()),
    "syntax_error": ({"load"}, set()),
    "crash_abort": ({"crash"}, set()),
    "crash_segfault": ({"crash"}, set()),
    "crash_exit": ({"crash"}, set()),
}


# Written at test time: a file that does not parse would trip every linter run over tests/.
SYNTAX_ERROR = '''"""Cheat: does not even parse."""


def forward(x, weight, *, out, eps)
    pass
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    broken = tmp_path_factory.mktemp("cheats") / "syntax_error.py"
    broken.write_text(SYNTAX_ERROR)
    paths = [broken if name == "syntax_error" else HERE / "cheats" / f"{name}.py"
             for name in CHEATS]
    got = verify_candidates(RMSNORM, paths, [CASE_FP32, CASE_FP16], device=DEVICE, trials=2,
                            timeout_s=120, timing=False, jobs=2)
    return dict(zip(CHEATS, got))


@pytest.mark.parametrize("name", list(CHEATS))
def test_cheat_is_rejected_for_the_right_reason(results, name):
    must, may = CHEATS[name]
    result = results[name]
    assert result.verdict == "rejected"
    failed = result.failed()
    assert must <= failed, (name, result.reasons)
    assert failed <= must | may, (name, result.reasons)
    # The most fundamental failure comes first in the reasons.
    assert any(result.reasons[0].startswith(m) for m in must), result.reasons


def test_crash_reasons_name_the_signal(results):
    details = {n: results[n].reasons[0] for n in ("crash_abort", "crash_segfault", "crash_exit")}
    assert "SIGABRT" in details["crash_abort"]
    assert "SIGSEGV" in details["crash_segfault"]
    assert "status 3" in details["crash_exit"]
    # The phase it died in is reported, down to the input set.
    assert "c0: random trial 0" in details["crash_segfault"]


def test_cheat_details_point_at_the_evidence(results):
    def detail(name, check):
        return next(c["detail"] for c in results[name].checks
                    if c["name"] == check and not c["passed"])

    assert "never written" in detail("writes_nothing", "writes_all")
    assert "aten::pow" in detail("aten_fallback", "aten_ops")
    assert "reference nan" in detail("nan_to_num", "nonfinite")
    assert "input 0" in detail("mutates_input", "inputs_unchanged")
    assert "SyntaxError" in results["syntax_error"].reasons[0]
    # Stopped after the first failing case: the verdict was settled.
    assert results["writes_nothing"].cases_skipped


def test_a_stream_in_the_source_is_rejected_before_it_runs():
    result = verify_candidate(RMSNORM, HERE / "cheats" / "side_stream.py", [CASE_FP32],
                              device=DEVICE, trials=1, timing=False)
    assert result.failed() == {"static"}, result.reasons
    assert "stream creation" in result.reasons[0]


@pytest.mark.gpu
def test_side_stream_is_rejected():
    """The stream made out of the source's sight: the profiler sees the work on it."""
    result = verify_candidate(RMSNORM, HERE / "cheats" / "side_stream_hidden.py", [CASE_FP32],
                              device=DEVICE, trials=1, timing=False)
    assert result.failed() == {"default_stream"}, result.reasons


def test_second_output_left_unwritten_is_caught():
    results = verify_candidates(PAIR, [HERE / "candidates" / "good_pair.py",
                                       HERE / "cheats" / "pair_first_only.py"],
                                [CASE_PAIR], device=DEVICE, trials=1, timing=False, jobs=2)
    good, cheat = results
    assert good.verdict == "accepted", good.reasons
    assert "writes_all" in cheat.failed()
    assert "output 1" in next(c["detail"] for c in cheat.checks if c["name"] == "writes_all")


def test_a_kernel_that_cannot_run_in_place_is_rejected_where_the_adapter_needs_it(tmp_path):
    """rope's adapter writes the rotation over q and k; a candidate right only out of place
    fails `in_place` alone, and a rendered rope kernel passes it."""
    from codegen.rope import FAMILY as ROPE
    from codegen.rope.reference import make_case

    case = make_case(2, 5, 4, 2, 16, 16, "float32")
    rendered = tmp_path / "kernel.py"
    rendered.write_text(ROPE.render(ROPE.search_space(case)[-1], case))
    cheat, good = verify_candidates(ROPE, [HERE / "cheats" / "rope_not_alias_safe.py", rendered],
                                    [case], device=DEVICE, trials=1, timing=False, jobs=2)
    # its torch arithmetic also falls outside the allow-list of host ops
    assert cheat.failed() == {"in_place", "aten_ops"}, cheat.reasons
    assert any(r.startswith("in_place") and "differ when out aliases the inputs" in r
               for r in cheat.reasons)
    assert good.verdict == "accepted", good.reasons
    assert any(c["name"] == "in_place" and c["passed"] for c in good.checks)
