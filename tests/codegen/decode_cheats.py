"""Deliberately wrong decode attention kernels: the family's rendered kernel with one line
changed, each wrong only where a decode step differs from a one-token call with no cache (what
the whole-model check once ran on a decode workload, where all three were exact)."""

from __future__ import annotations

from pathlib import Path

from codegen.decode_attention import FAMILY
from codegen.search import case_key

_MASK_LOAD = "(tl.load(mask_ptr + b * m_sb + offs_n * m_ss, mask=n_ok, other=0) != 0)"
EDITS = {
    "honest": [],
    # the softmax scale skipped
    "no_scale": [("scale * LOG2E,", "LOG2E,")],
    # one slot past the cache's length read and attended (the mask's False there ignored)
    "extra_slot": [
        ("length = tl.minimum(tl.load(len_ptr).to(tl.int32), slots)",
         "length = tl.minimum(tl.load(len_ptr).to(tl.int32) + 1, slots)"),
        (f"keep = keep & {_MASK_LOAD}", f"keep = keep & ({_MASK_LOAD} | (offs_n == length - 1))"),
    ],
    # the first sequence's mask row applied to the whole batch
    "row0_mask": [
        ("m_sb, m_ss = (mask_arg.stride(0) if mask_arg.shape[0] > 1 else 0), mask_arg.stride(3)",
         "m_sb, m_ss = 0, mask_arg.stride(3)"),
    ],
}


def source(name: str, case: dict) -> str:
    """The kernel rendered for `case` (one program per kv head), with `name`'s edits."""
    text = FAMILY.render(FAMILY.search_space(case)[-1], case)
    for old, new in EDITS[name]:
        assert text.count(old) == 1, (name, old)
        text = text.replace(old, new)
    return text


def write(name: str, case: dict, folder: Path) -> Path:
    path = folder / f"{name}_{abs(hash(case_key(case)))}.py"
    path.write_text(source(name, case))
    return path


def accepted(name: str, cases: list[dict], folder: Path) -> dict:
    """An `accepted` map (pipeline.integrate's) holding `name`'s kernel for every case."""
    return {case_key(c): {"family": "decode_attention", "case": c,
                          "source": str(write(name, c, folder))} for c in cases}
