"""The comparison rule, the tolerance table, poison and guards, snapshots, the op recorder and
the stress inputs, in-process (no worker)."""

import math

import pytest
import torch

from verify.integrity import (
    POISON_BIG,
    POISON_NAN,
    GuardedOut,
    InputSnapshot,
    OpRecorder,
    normalize_op,
)
from verify.numerics import apply_stress, compare_one, inject_nonfinite, seed_for
from verify.tolerances import TOLERANCES, tolerance_for

FP32 = TOLERANCES["float32"]


def t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_baseline_error_is_slack_but_only_up_to_the_tolerance():
    ref = t(1.0, 1.0)
    base = t(1.1, 1.0)  # the baseline itself is 0.1 off in element 0
    assert compare_one(t(1.1, 1.0), ref, base, FP32).ok  # as wrong as the baseline: fine
    assert compare_one(t(0.9, 1.0), ref, base, FP32).ok  # as wrong, other side: fine
    worse = compare_one(t(1.0 + 0.1 + 3e-5, 1.0), ref, base, FP32)
    assert not worse.ok and worse.n_bad == 1  # worse than the baseline by more than tolerance
    assert not compare_one(t(1.0, 1.0 + 1e-4), ref, base, FP32).ok  # no slack in element 1


def test_nonfinite_values_must_propagate_as_the_reference_does():
    ref = t(math.nan, math.inf, -math.inf, 1.0)
    assert compare_one(ref.clone(), ref, ref, FP32).ok
    lost = compare_one(t(0.0, math.inf, -math.inf, 1.0), ref, ref, FP32)
    assert not lost.ok and lost.n_nonfinite_bad == 1
    assert not compare_one(t(math.nan, -math.inf, -math.inf, 1.0), ref, ref, FP32).ok  # sign
    accidental = compare_one(t(math.nan, math.inf, -math.inf, math.nan), ref, ref, FP32)
    assert not accidental.ok and "[3]" in accidental.first_bad


def test_a_baseline_overflow_may_be_matched_exactly():
    ref, base = t(1e5), t(math.inf)  # fp16 baseline overflows where float64 does not
    assert compare_one(t(math.inf), ref, base, FP32).ok
    assert not compare_one(t(1.0), ref, base, FP32).ok  # finite must then be close on its own


def test_an_order_bound_excuses_few_elements_and_only_errors_like_the_baseline():
    """The family's bound lets an element outside the rule pass (a cancelling dot product where
    the baseline was luckier), at most ORDER_SHARE of them, and only while the candidate's error
    distribution matches the baseline's; a non-finite bound excuses nothing; where the
    accumulator may overflow, a non-finite result passes and a finite one is still judged."""
    from verify.numerics import ORDER_SHARE

    tol = tolerance_for(torch.float32)
    n = 4096
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(n, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, generator=gen, dtype=torch.float64)
    b = r + 1e-7 * noise  # the baseline's own errors
    c = r + 1e-7 * noise.roll(1)  # the same distribution, other elements
    c[7] = r[7] + 5e-4  # one cancelling element, far outside the rule
    none = torch.zeros(n, dtype=torch.bool)
    slack = {"bound": torch.full((n,), 1e-3, dtype=torch.float64), "overflow": none}
    assert not compare_one(c, r, b, tol).ok
    assert compare_one(c, r, b, tol, slack).ok
    many = c.clone()
    many[: int(ORDER_SHARE * n) + 2] += 5e-4  # more elements than the bound may excuse
    assert not compare_one(many, r, b, tol, slack).ok
    tf32 = r + 3e-4 * noise  # errors of another kind everywhere, each within the bound
    out = compare_one(tf32, r, b, tol, slack)
    assert not out.ok and "not the baseline's" in out.first_bad
    # non-finite inputs give a non-finite bound: nothing excused there
    inf_bound = {"bound": torch.full((n,), math.inf, dtype=torch.float64), "overflow": none}
    assert not compare_one(c, r, b, tol, inf_bound).ok
    # a small output (2 x 64) under "large" stress, where the baseline has cancelling elements
    # too: up to ORDER_MIN elements in the bound pass (1 % would be one), more do not
    from verify.numerics import ORDER_MIN

    m = 128
    small_r, small_slack = r[:m], {k: v[:m] for k, v in slack.items()}
    small_b = b[:m].clone()
    small_b[64:64 + ORDER_MIN + 1] += 5e-4
    small = small_r + 1e-7 * noise[:m].roll(1)
    small[:ORDER_MIN] += 5e-4
    assert compare_one(small, small_r, small_b, tol, small_slack).ok
    small[ORDER_MIN] += 5e-4
    assert not compare_one(small, small_r, small_b, tol, small_slack).ok
    # where the accumulator may overflow: inf passes, a finite wrong value does not
    overflow = none.clone()
    overflow[:3] = True
    flows = {"bound": torch.zeros(n, dtype=torch.float64), "overflow": overflow}
    c2 = b.clone()
    c2[0] = math.inf
    c2[1] = math.nan
    assert compare_one(c2, r, b, tol, flows).ok
    c2[2] = 0.0 if abs(r[2]) > 1e-3 else 1.0
    assert not compare_one(c2, r, b, tol, flows).ok


def test_tolerance_table():
    assert tolerance_for(torch.bfloat16) is TOLERANCES["bfloat16"]
    assert tolerance_for("torch.float16") is TOLERANCES["float16"]
    assert tolerance_for(torch.int64).atol == 0 and tolerance_for(torch.bool).rtol == 0
    for name in ("float16", "bfloat16"):  # >= 2 ulps at the worst point of a binade
        bits = torch.finfo(getattr(torch, name)).eps
        assert TOLERANCES[name].rtol >= 2 * bits
    with pytest.raises(ValueError):
        tolerance_for(torch.complex64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_poison_bytes_are_nan_and_large_finite_in_every_float_type(dtype):
    a = GuardedOut.like(torch.empty(3, dtype=dtype), POISON_NAN).view
    b = GuardedOut.like(torch.empty(3, dtype=dtype), POISON_BIG).view
    assert torch.isnan(a).all()
    assert torch.isfinite(b).all() and (b.abs() > 1e4).all()


def test_guards_catch_writes_outside_the_view_and_into_its_gaps():
    template = torch.empty(4, 8)[:, :5]  # a strided view with gaps between rows
    g = GuardedOut.like(template, POISON_NAN)
    g.view.fill_(1.0)
    assert g.changed_outside() == 0 and not g.unwritten().any()
    g.backing[g.backing.numel() - 1] = 0.0  # past the end
    base = g.view.storage_offset()
    g.backing[base + 6] = 0.0  # in the gap after row 0
    assert g.changed_outside() == 2


def test_snapshot_sees_writes_into_the_gaps_of_a_strided_input():
    wide = torch.randn(3, 8)
    x = wide[:, :4]
    snap = InputSnapshot.take(x)
    assert snap.problems(0) == []
    wide[0, 6] = 99.0  # outside x's elements but inside its storage
    (problem,) = snap.problems(0)
    assert "0 of its 12 elements" in problem
    x[1, 1] = math.nan
    assert "1 of its 12 elements" in snap.problems(0)[0]


def test_op_recorder_and_names():
    rec = OpRecorder()
    x = torch.randn(4)
    with rec:
        y = torch.empty_like(x)
        torch.mul(x, 2, out=y)
        y.add_(1)
    assert rec.counts["aten::mul"] == 1 and rec.counts["aten::add"] == 1
    assert normalize_op("aten.pow.Tensor_Scalar") == "aten::pow"
    assert normalize_op("rsqrt") == "aten::rsqrt"
    assert normalize_op("aten::__and__") == "aten::__and__"


def test_stress_values():
    for kind in ("large", "tiny", "mixed", "equal"):
        x = torch.zeros(4, 16, dtype=torch.float16)
        assert apply_stress([x], [0], kind, seed=1)
        assert torch.isfinite(x).all()
        if kind == "large":
            assert x.abs().min() >= 0.09 * torch.finfo(torch.float16).max
        if kind == "tiny":
            assert x.abs().max() <= 16 * torch.finfo(torch.float16).tiny
        if kind == "equal":
            assert (x == x[:, :1]).all()
    assert not apply_stress([torch.zeros(3, dtype=torch.int64)], [0], "large", seed=1)
    x = torch.zeros(6, 5)
    placed = inject_nonfinite([x], [0], seed=2)
    assert len(placed) == 3 and torch.isnan(x).sum() == 1 and torch.isinf(x).sum() == 2


def test_seeds_are_stable_and_distinct():
    assert seed_for(0, "c0", "random", 0) == seed_for(0, "c0", "random", 0)
    assert len({seed_for(0, "c0", "random", i) for i in range(5)}) == 5
    assert seed_for(0, "c0", "random", 0) != seed_for(1, "c0", "random", 0)
