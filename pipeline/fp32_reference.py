"""The whole-model check's fp32 reference, as a copy where it fits and layer by layer where not.

The check's rule (pipeline.integrate.judge) compares the patched and the unpatched model, both
in the model's dtype, against the model computed in fp32. A copy of the model in fp32 costs
twice a bf16 model's weights again: 14 GB beside a 7B bf16 model, 120 GB beside Qwen3-30B-A3B's
61 GB, more than any one card holds. So where the copy does not fit in the memory free on the
model's device (with room left for the check's activations, `COPY_SHARE`), the reference is
`layerwise`: a twin over the model's own parameters (`pipeline.patching.twin`, nothing copied)
in which each module, for the length of its own call only, sees fp32 copies of its own
parameters and floating buffers (a forward pre-hook swaps them in, a forward hook that runs
even when the call raises swaps the originals back). Every op then runs on fp32 operands in
the order the model runs it, as in the copy: the two references give the same logits up to
the order of fp32 roundings (tests/pipeline/test_fp32_reference.py checks the check's verdicts
agree). Cost: at most one module's fp32 weights at a time (the largest: a vocabulary's
embedding or LM head, or one MoE layer's experts: 2.1 GB for Llama-3.1-8B's LM head, 2.4 GB
for a Qwen3-30B-A3B layer's experts) and one cast of every weight per reference pass, which
a copy pays once.
"""

from __future__ import annotations

import copy
import os

import torch

# the fp32 copy must fit in this share of the free memory: the rest is the check's (activations
# of three models, fp32 logits and their float64 error sums)
COPY_SHARE = 0.6


def _fp32_bytes(model: torch.nn.Module) -> int:
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * 4 for t in tensors if t.is_floating_point())


def free_bytes(device: torch.device) -> int:
    """Memory free for new tensors on `device`: the card's, or the host's available pages."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(
            device))
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no such counter here: assume it fits
        return 1 << 62


def copy_fits(model: torch.nn.Module) -> bool:
    p = next(model.parameters(), None)
    if p is None:
        return True
    return _fp32_bytes(model) <= COPY_SHARE * free_bytes(p.device)


def plain_experts(ref: torch.nn.Module) -> torch.nn.Module:
    """An MoE reference runs transformers' eager experts loop: torch's grouped GEMM (the
    default) takes bf16 only on a GPU, and a reference wants the plainest path anyway. The
    reference's config is its own (a copy or a twin's), so the model keeps its option."""
    from models.moe import is_moe, set_experts

    if is_moe(ref):
        set_experts(ref, "eager")
    return ref


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    return plain_experts(copy.deepcopy(model).float().eval())


def _floating(tensors: dict) -> list[str]:
    return [n for n, t in tensors.items()
            if t is not None and t.is_floating_point() and t.dtype != torch.float32]


def layerwise(model: torch.nn.Module) -> torch.nn.Module:
    """A twin of `model` over the same weights whose every module runs on fp32 copies of its
    own parameters and buffers, made at its call and dropped after it."""
    from pipeline.patching import twin

    ref = plain_experts(twin(model).eval())
    for m in ref.modules():
        params, bufs = _floating(m._parameters), _floating(m._buffers)
        if not params and not bufs:
            continue
        saved: list[tuple[dict, str, torch.Tensor]] = []

        def up(module, args, params=params, bufs=bufs, saved=saved):
            for table, names in ((module._parameters, params), (module._buffers, bufs)):
                for n in names:
                    t = table[n]
                    saved.append((table, n, t))
                    # a plain tensor, as nn.Module lets _parameters hold: no copy of the
                    # Parameter's autograd state, and the original comes back after the call
                    table[n] = t.detach().float()

        def down(module, args, output, saved=saved):
            while saved:
                table, n, t = saved.pop()
                table[n] = t

        m.register_forward_pre_hook(up)
        m.register_forward_hook(down, always_call=True)
    ref.fp32_layerwise = True  # what the check records (`describe`)
    return ref


def fp32_reference(model: torch.nn.Module, layer_by_layer: bool | None = None):
    """The check's reference: an fp32 copy where it fits (`copy_fits`), else `layerwise`;
    `layer_by_layer` forces one or the other."""
    if layer_by_layer is None:
        layer_by_layer = not copy_fits(model)
    return layerwise(model) if layer_by_layer else fp32_copy(model)


def describe(ref) -> str:
    return ("fp32 layer by layer (a twin over the model's weights)"
            if getattr(ref, "fp32_layerwise", False) else "fp32 copy")
