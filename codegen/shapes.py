"""The leading shape of a case's tensors, as the adapter hands them to the kernel.

Models pass (batch, seq, width) activations, not (rows, width): a case that records the
leading dims makes the verifier build tensors of the model's very shape and strides (issue 27,
class 5). Kept as a string ("2x8"): a case is hashed (dispatch) and goes through JSON, where a
tuple would come back a list.
"""

from __future__ import annotations

import torch

from core.family import Case


def lead_key(lead, rows: int) -> str:
    """"2x8" for (2, 8); a leading shape that does not hold `rows` rows is a caller's bug."""
    dims = [int(n) for n in lead]
    total = 1
    for n in dims:
        total *= n
    if total != int(rows):
        raise ValueError(f"leading shape {dims} does not hold {rows} rows")
    return "x".join(map(str, dims))


def lead_of(case: Case) -> list[int]:
    """The case's leading shape; (rows,) where it records none (a 2-D call)."""
    lead = case.get("lead")
    return [int(n) for n in lead.split("x")] if lead else [case["rows"]]


def with_rows(case: Case, rows: int, lead: str) -> Case:
    """`case` with another row count, and the leading shape `lead` where the case has one."""
    return {**case, "rows": rows, **({"lead": lead} if "lead" in case else {})}


def strides(t: torch.Tensor) -> tuple:
    """t's strides, None along dims of size 1: no index there but 0 ever multiplies them, so
    two tensors that differ only there address the same elements (torch's own contiguity
    ignores them too; a (batch, heads, 1, dim) result and a transposed view of it differ only
    there)."""
    return tuple(None if n == 1 else s for n, s in zip(t.shape, t.stride()))


def canonical(shape, stride) -> tuple:
    """`strides` of a layout given as numbers."""
    return tuple(None if n == 1 else s for n, s in zip(shape, stride))


def gemm_k_n(ops: list[dict]) -> dict | None:
    """{"k", "n"} of a profiled GEMM occurrence: aten::linear's input [.., k] and weight [n, k],
    or HF Conv1D's aten::addmm (bias [n], input [rows, k], weight [k, n]); None for another op."""
    for op in ops:
        shapes = op.get("shapes") or []
        if op["name"] == "aten::linear" and len(shapes) >= 2 and shapes[0] and shapes[1]:
            return {"k": shapes[0][-1], "n": shapes[1][0]}
        if op["name"] == "aten::addmm" and len(shapes) >= 3 and shapes[1] and shapes[2]:
            return {"k": shapes[1][-1], "n": shapes[2][-1]}
    return None
