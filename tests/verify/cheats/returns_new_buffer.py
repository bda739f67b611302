"""Cheat: computes into a buffer of its own and returns it; the caller's `out` stays as it was
(uninitialised memory in a real model)."""

import torch
from rmsnorm_triton import rms_norm_forward


def forward(x, weight, *, out, eps):
    result = torch.empty_like(out)
    rms_norm_forward(x, weight, result, eps)
    return result
