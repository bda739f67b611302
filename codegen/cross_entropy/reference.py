"""Cross-entropy over logits, per row and averaged, as torch computes it; the case side too.

`F.cross_entropy(logits, target, ignore_index=-100)` is log_softmax + nll_loss: torch writes
the whole (rows, vocab) log-probability matrix to memory before picking one value per row. At
a 128k vocabulary that matrix is the size of the logits. The fused kernel never writes it.

Output: (mean loss over the rows whose target is not ignore_index, per-row losses with 0 for
ignored rows), both in the logits' dtype as torch returns them. An all-ignored batch has a NaN
mean, as in torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, torch_dtype
from core.family import Case, distinct


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *,
                  ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    mean = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="mean")
    rows = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction="none")
    return mean, rows


def make_case(rows: int, vocab: int, dtype: str, ignore_index: int = -100) -> Case:
    return {"rows": int(rows), "vocab": int(vocab), "dtype": dtype,
            "ignore_index": int(ignore_index)}


def params(case: Case) -> dict:
    """The keyword params a candidate's forward and the reference take for `case`."""
    return {"ignore_index": case["ignore_index"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """Logits (rows, vocab) (strided when `row_stride` > vocab) and int64 targets; every 5th
    row is ignored, as padding tokens are in a real batch."""
    rows, vocab = case["rows"], case["vocab"]
    stride = case.get("row_stride", vocab)
    gen_device = generator.device if generator is not None else "cpu"
    buf = torch.randn((rows, stride), generator=generator, device=gen_device,
                      dtype=torch.float32)
    # LM-head logits spread over several units; x4 keeps the max subtraction honest.
    logits = (4.0 * buf).to(device=device, dtype=torch_dtype(case["dtype"]))[:, :vocab]
    target = torch.randint(0, vocab, (rows,), generator=generator, device=gen_device)
    target[4::5] = case["ignore_index"]
    return logits, target.to(device)


def make_out(case: Case, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    logits = inputs[0]
    return (torch.empty((), dtype=logits.dtype, device=logits.device),
            torch.empty((case["rows"],), dtype=logits.dtype, device=logits.device))


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive: the vocabulary is baked into it,
    so edges vary what stays free at run time: one row, a prime row count, strided logits, and
    one row more than the mean's reduction block (MEAN_BLOCK = 1024), so the mean walks two
    blocks with a single live lane in the second."""
    cases = [
        {**case, "rows": 1},
        {**case, "rows": 7},
        {**case, "rows": 4, "row_stride": case["vocab"] + 64},
        {**case, "rows": 1025},
    ]
    return distinct(case, cases)



def min_bytes(case: Case) -> int:
    """Read the logits once and the int64 targets; write one loss per row and the mean."""
    rows = case["rows"]
    return rows * case["vocab"] * element_size(case) + 8 * rows + element_size(case) * (rows + 1)


def flops(case: Case) -> int:
    """Per logit: the running max, the subtract, exp (counted as one), the sum."""
    return 4 * case["rows"] * case["vocab"]
