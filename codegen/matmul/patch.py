"""Patching projections: every plain nn.Linear (the LM head among them) and GPT-2's Conv1D
whose output width needs padding (reference.padded; `projections` says why only those), per
instance, reversible, dispatched per input signature.

The module's parameters are never touched. The adapter builds a zero-padded copy of the
weight and bias ONCE, when the model is patched, and keeps it beside the module; undo drops
it. So undo leaves the
weights bit for bit as they were, and a tied LM head stays tied (its Parameter is the
embedding's, before, during and after). The copy's size is what the patch costs in memory:
`extra_bytes` on the returned undo (`patch_memory` sums it per patched model).

A call reaches a kernel when HF calls the module with one tensor, no autograd graph is
needed, the module's weight and bias are still the Parameters seen at patch time with the
same storage and version (a weight updated in place, reassigned, or moved with `.to()` since
falls back to the module's own code: the padded copy would be stale), x has their dtype and
device, and the chooser gives a kernel for the signature (asked once per signature,
`core.family.kernel_by_signature`). The kernel writes an `n_pad`-wide buffer of the adapter's
and the caller gets its first `n` columns: the same shape and values as before, as a view
(row stride n_pad) rather than a fresh contiguous tensor.

The forward wraps what ran before (`models.patching.wrap_instance_forwards`), so hooks the
module's __call__ runs are unaffected and undos may come in any order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.matmul.reference import held_width, make_case, padded, params
from core.family import Case, kernel_by_signature
from models.patching import needs_graph, wrap_instance_forward

CONV1D = "Conv1D"  # transformers.pytorch_utils.Conv1D (GPT-2): weight (in, out), `nf` outputs


def layout_of(module: nn.Module) -> str | None:
    """"linear", "conv1d", or None for a module this family does not replace (a subclass of
    Linear may compute something else: LoRA, quantised layers)."""
    if type(module) is nn.Linear:
        return "linear"
    if type(module).__name__ == CONV1D and getattr(module, "weight", None) is not None \
            and module.weight.dim() == 2 and getattr(module, "nf", None) == module.weight.shape[1]:
        return "conv1d"
    return None


def widths(module: nn.Module, layout: str) -> tuple[int, int]:
    """(k, n): input and output widths."""
    w = module.weight
    return (w.shape[1], w.shape[0]) if layout == "linear" else (w.shape[0], w.shape[1])


def projections(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """The projections this family replaces: those whose output width needs padding
    (reference.padded). At aligned widths cuBLAS already runs near the measured peak (every
    Llama-3.2-1B and Qwen2.5-0.5B GEMM: issue 26), a Triton GEMM without TMA loads did not beat
    it there (matmul_epilogue's pointer kernel was 1-6 % slower), and wrapping every Linear
    would only add an adapter's host time per call to host-bound passes; so those modules
    keep their own code, unwrapped."""
    out = []
    for m in model.modules():
        layout = layout_of(m)
        if layout is not None and padded(widths(m, layout)[1]) != widths(m, layout)[1]:
            out.append((m, layout))
    return out


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """One case per distinct (k, n, layout, bias) projection this family replaces; each sees
    `workload.tokens` rows (the LM head too: the pipeline's pass computes logits for every
    token) as (batch, tokens per sequence), the leading shape the model passes."""
    cases = []
    for m, layout in projections(model):
        k, n = widths(m, layout)
        case = make_case(workload.tokens, k, n, workload.dtype, layout, m.bias is not None,
                         lead=(workload.batch, workload.tokens // workload.batch))
        if case not in cases:
            cases.append(case)
    return cases


def pad_weight(weight: torch.Tensor, bias: torch.Tensor | None, layout: str
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weight (and bias) zero-padded to `held_width(n)` output columns, detached
    copies."""
    n = weight.shape[0] if layout == "linear" else weight.shape[1]
    n_pad = held_width(n)
    with torch.no_grad():
        if layout == "linear":
            w = weight.new_zeros((n_pad, weight.shape[1]))
            w[:n] = weight
        else:
            w = weight.new_zeros((weight.shape[0], n_pad))
            w[:, :n] = weight
        b = None
        if bias is not None:
            b = bias.new_zeros(n_pad)
            b[:n] = bias
    return w, b


class _Undo:
    """The patch's undo, carrying what the patch holds in memory (`extra_bytes`)."""

    def __init__(self, undos: list[Callable[[], None]], held: list, extra_bytes: int) -> None:
        self._undos, self._held, self.extra_bytes = undos, held, extra_bytes

    def __call__(self) -> None:
        for u in reversed(self._undos):
            u()
        self._undos.clear()
        self._held.clear()  # the padded copies go with the patch


def patch_memory(undo: Callable[[], None]) -> int:
    """Bytes a patch made by this family holds beyond the model's own weights (0 for others)."""
    return int(getattr(undo, "extra_bytes", 0))


def _wrapper(module: nn.Module, layout: str, forward_by_case: Callable,
             held: list) -> tuple[Callable[[Callable], Callable], int]:
    k, n = widths(module, layout)
    n_pad = held_width(n)
    weight, bias = module.weight, module.bias
    stamp = (weight.data_ptr(), weight._version,
             None if bias is None else (bias.data_ptr(), bias._version))
    w_use, b_use = pad_weight(weight, bias, layout)
    held.append((w_use, b_use))
    extra = w_use.numel() * w_use.element_size() + (
        0 if b_use is None else b_use.numel() * b_use.element_size())
    has_bias = bias is not None

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case:
        return make_case(shape.numel() // k, k, n, dtype_name(dtype), layout, has_bias,
                         lead=shape[:-1])

    resolve = kernel_by_signature(forward_by_case, case_of, params)

    def unchanged() -> bool:
        w, b = module.weight, module.bias
        return (w is weight and b is bias and w.data_ptr() == stamp[0]
                and w._version == stamp[1]
                and (b is None or (b.data_ptr(), b._version) == stamp[2]))

    def wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:
                (x,) = args
                if (isinstance(x, torch.Tensor) and x.dtype == weight.dtype
                        and x.device == weight.device and x.shape[-1] == k and unchanged()
                        and not needs_graph(x, weight)):
                    kernel, kw = resolve(x.shape, x.dtype)
                    if kernel is not None:
                        lead = x.shape[:-1]
                        out = torch.empty((*lead, n_pad), dtype=x.dtype, device=x.device)
                        kernel(x, w_use, *(() if b_use is None else (b_use,)), out=out, **kw)
                        return out[..., :n]
            return below(*args, **kwargs)

        return forward

    return wrap, extra


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]) -> _Undo:
    """Wrap every plain Linear and Conv1D's forward; the undo restores what each ran before
    and drops the padded copies (`extra_bytes`: their size, held while patched)."""
    held: list = []
    undos, extra = [], 0
    for module, layout in projections(model):
        wrap, nbytes = _wrapper(module, layout, forward_by_case, held)
        undos.append(wrap_instance_forward(module, wrap))
        extra += nbytes
    return _Undo(undos, held, extra)
