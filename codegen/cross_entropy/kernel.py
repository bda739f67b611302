"""Triton cross-entropy: logits to per-row loss in one read, then a deterministic mean.

Kernel 1, one program per row: a running max and running sum of exponentials per lane over
BLOCK-wide chunks of the vocabulary (the online softmax recurrence), so the row is read once
and no log-probability is written; loss = logsumexp - logit[target], 0 for ignored rows.
Kernel 2, one program: sums the fp32 row losses in a fixed order and divides by the number of
rows not ignored. An atomic add in kernel 1 would save the launch but make the mean depend on
the order programs finish in, and repeated runs must agree bit for bit.

Arithmetic runs in fp32 on values converted right after the load and rounded once before the
store (this also keeps the kernels exact under Triton's CPU interpreter). Targets outside
[0, vocab) other than ignore_index are not checked on the device; torch raises for them.
"""

from __future__ import annotations

import json
import textwrap

import torch
import triton
import triton.language as tl

from core.family import Case
from core.source import kernel_source

BLOCKS = (1024, 2048, 4096, 8192)
WARPS = (4, 8, 16)
MEAN_BLOCK = 1024


@triton.jit
def _cross_entropy_forward_kernel(logits_ptr, target_ptr, loss_ptr, row_loss_ptr,
                                  logits_row_stride, ignore_index,
                                  VOCAB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row)
    lanes = tl.arange(0, BLOCK)
    # The most negative fp32 rather than -inf: a lane that only ever sees -inf (the masked
    # tail, -inf logits) then keeps d = 0 with no NaN from -inf - -inf; an all -inf row still
    # ends as -inf - -inf = NaN, as torch's does.
    m = tl.full([BLOCK], -3.4028234663852886e38, tl.float32)
    d = tl.zeros([BLOCK], tl.float32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + lanes
        x = tl.load(row_ptr + cols, mask=cols < VOCAB, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        d = d * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    row_max = tl.max(m, axis=0)
    total = tl.sum(d * tl.exp(m - row_max), axis=0)
    ignored = target == ignore_index
    # An ignored row reads logit 0 (its target is no column); its loss is forced to 0 below.
    safe_target = tl.where(ignored, 0, target)
    picked = tl.load(row_ptr + safe_target).to(tl.float32)
    # (max - picked) first: with logits near 1e38, max + log(total) rounds log(total) away and
    # the loss of a row whose target is its maximum would come out 0 instead of log(total).
    loss = tl.where(ignored, 0.0, (row_max - picked) + tl.log(total))
    tl.store(loss_ptr + row, loss)
    tl.store(row_loss_ptr + row, loss.to(row_loss_ptr.dtype.element_ty))


@triton.jit
def _cross_entropy_mean_kernel(loss_ptr, target_ptr, mean_ptr, n_rows, ignore_index,
                               BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, n_rows, BLOCK):
        rows = start + lanes
        mask = rows < n_rows
        acc += tl.load(loss_ptr + rows, mask=mask, other=0.0)
        target = tl.load(target_ptr + rows, mask=mask, other=ignore_index)
        count += (target != ignore_index).to(tl.int32)
    mean = tl.sum(acc, axis=0) / tl.sum(count, axis=0).to(tl.float32)
    tl.store(mean_ptr, mean.to(mean_ptr.dtype.element_ty))


def search_space(case: Case) -> list[dict]:
    """Vocabulary chunk x warps, chunks up to the first power of two covering the vocabulary,
    keeping 4 to 64 values per thread."""
    widest = max(BLOCKS[0], triton.next_power_of_2(case["vocab"]))
    configs = [{"BLOCK": b, "num_warps": w} for b in BLOCKS if b <= widest for w in WARPS
               if 4 <= b / (32 * w) <= 64]
    return configs[:12]


def cross_entropy_forward(logits, target, *, out, ignore_index: int = -100, BLOCK: int = 4096,
                          num_warps: int = 8) -> None:
    """Host wrapper: logits (rows, vocab) with unit column stride, target (rows,) int64;
    out = (mean (), row losses (rows,))."""
    mean, row_loss = out
    rows, vocab = logits.shape
    scratch = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    _cross_entropy_forward_kernel[(rows,)](logits, target, scratch, row_loss, logits.stride(0),
                                           ignore_index, VOCAB=vocab, BLOCK=BLOCK,
                                           num_warps=num_warps)
    _cross_entropy_mean_kernel[(1,)](scratch, target, mean, rows, ignore_index,
                                     BLOCK=MEAN_BLOCK, num_warps=4)



_FORWARD = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def forward(logits, target, *, out, **params) -> None:
    """logits (rows, VOCAB), target (rows,) integer; out = (mean loss (), row losses (rows,))
    in the logits' dtype. Ignored rows (target == IGNORE_INDEX) lose 0 and leave the mean."""
    _check_params(params)
    mean, row_loss = out
    rows = logits.shape[0]
    if (logits.dim() != 2 or logits.shape[1] != VOCAB or tuple(target.shape) != (rows,)
            or mean.dim() != 0 or tuple(row_loss.shape) != (rows,)):
        raise ValueError(f"expected logits (rows, {VOCAB}), target (rows,), out ((), (rows,)); "
                         f"got {tuple(logits.shape)}, {tuple(target.shape)}, "
                         f"({tuple(mean.shape)}, {tuple(row_loss.shape)})")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    target = target.contiguous()
    # fp32 row losses for the mean, so it sums unrounded values whatever the output dtype.
    scratch = torch.empty((rows,), dtype=torch.float32, device=logits.device)
    _cross_entropy_forward_kernel[(rows,)](logits, target, scratch, row_loss, logits.stride(0),
                                           IGNORE_INDEX, VOCAB=VOCAB, BLOCK=BLOCK,
                                           num_warps=NUM_WARPS)
    _cross_entropy_mean_kernel[(1,)](scratch, target, mean, rows, IGNORE_INDEX,
                                     BLOCK=MEAN_BLOCK, num_warps=4)
'''


def render(config: dict, case: Case) -> str:
    vocab, block, warps = case["vocab"], config["BLOCK"], config["num_warps"]
    header = textwrap.dedent(f'''\
        """Cross-entropy candidate: (mean, per-row) loss of logits against targets, fused.

        Generated by codegen.cross_entropy.kernel.render. Never writes log-probabilities:
        logsumexp in one pass over each row ({block}-wide chunks, {warps} warps, one program per
        row), then a single-program mean in a fixed order. fp32 arithmetic, rounded once.
        Specialised for vocab={vocab}, ignore_index={case["ignore_index"]}; tuned for
        {case["rows"]} rows of {case["dtype"]}.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        VOCAB = {vocab}
        BLOCK = {block}
        NUM_WARPS = {warps}
        MEAN_BLOCK = {MEAN_BLOCK}
        IGNORE_INDEX = {case["ignore_index"]}
        BAKED_PARAMS = {{"ignore_index": {case["ignore_index"]}}}
        ''')
    return "\n\n".join([header, kernel_source(_cross_entropy_forward_kernel),
                        kernel_source(_cross_entropy_mean_kernel), _FORWARD])
