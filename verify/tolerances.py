"""The one tolerance table: what error a candidate may add, per output dtype.

How a candidate is judged (decided here, used by verify/numerics.py):

    r = the family's reference run on inputs upcast to float64 (float32 where float64 fails)
    b = the baseline: the same reference run in the case's own dtype (what the model runs today)
    c = the candidate's output

    an element passes when |c - r| <= |b - r| + atol + rtol * |r|

The baseline's own error |b - r| is slack, element by element: a kernel is held to "not worse than
the baseline by more than the tolerance" rather than to an accuracy the baseline itself does not
reach (a bf16 reduction, or an fp32 sum of squares that overflows on stress values, loses far more
than any table could allow for). Because the slack is never negative this is never stricter than a
plain allclose against r, and never looser than the baseline plus the tolerance. Where b is not
finite the slack is dropped: c must then equal b's non-finite value or be close to r on its own.
Non-finite reference values must be reproduced exactly (NaN where r or b is NaN, inf of the same
sign), so NaN/Inf propagate as the reference does.

A family whose kernel sums long products in another order than the baseline (a GEMM) may give
`VerifyHooks.order_bound`: per output element, the classic bound on what any summation order in the
accumulator's precision may change (for a dot product of K terms, K u / (1 - K u) * sum |x_k w_k|),
carried through the epilogue. Where terms cancel, the baseline's own error at that element is luck
(on fp32 stress inputs the matmul-epilogue kernel's and torch's errors had the same median and
99.9th percentile, yet one in 10^4 elements came out on the wrong side). So an element outside
the rule passes within the bound, but only for at most 1 % of an output's elements and only
when the candidate's errors match the baseline's as a distribution (median and 99.9th
percentile within 4x, `numerics.ORDER_SHARE`, `PARITY`): the bound is a worst case over all
orders, loose enough to excuse TF32 products or an fp16 accumulator at hidden sizes of 2048 and
more, which the distribution test rejects. Where the family marks that an fp32 accumulator may
overflow in some order, a non-finite output passes (a finite one is still judged).

The tolerance therefore only has to cover the candidate's own rounding, which differs from the
baseline's by reduction order, fused operations and where it rounds to the output dtype. The
rtol of the narrow float types is two units in the last place at the worst point of a binade
(2 * 2**-mantissa_bits), so a kernel that rounds once more than the baseline passes and one that
computes in a narrower type fails.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


TOLERANCES: dict[str, Tolerance] = {
    "float64": Tolerance(1e-10, 1e-9, "reduction order only; float64 rounding is ~1e-16"),
    # Not 2 ulps (2.4e-7): fp32 reductions over thousands of elements in another order (a
    # tree in one program instead of torch's vectorised loop) move the result by ~1e-6.
    "float32": Tolerance(1e-5, 1e-5, "reduction order over long rows; ~80 ulps"),
    "float16": Tolerance(1e-4, 2e-3, "2 ulps (2**-10 at the worst point of a binade)"),
    "bfloat16": Tolerance(1e-3, 1.6e-2, "2 ulps (2**-7 at the worst point of a binade)"),
    "float8_e4m3fn": Tolerance(1e-2, 2.5e-1, "2 ulps (3 mantissa bits)"),
    "float8_e5m2": Tolerance(1e-2, 5e-1, "2 ulps (2 mantissa bits)"),
}

# Integer and boolean outputs (indices, masks, counts) have no rounding: they must be exact.
EXACT = Tolerance(0.0, 0.0, "integer or boolean output: exact")


def dtype_name(dtype) -> str:
    """'torch.bfloat16' or torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")


def tolerance_for(dtype) -> Tolerance:
    """The tolerance for an output of this dtype; ValueError for a dtype nobody has judged."""
    name = dtype_name(dtype)
    if name in TOLERANCES:
        return TOLERANCES[name]
    if name == "bool" or name.startswith(("int", "uint")):
        return EXACT
    raise ValueError(f"no tolerance for output dtype {name}; add one to verify/tolerances.py")
