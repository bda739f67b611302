"""Cheat: points `out` at fresh storage (out.set_) and writes there; the caller's buffer, and
every other view of it, never sees the result."""

import torch
from rmsnorm_triton import rms_norm_forward


def forward(x, weight, *, out, eps):
    out.set_(torch.empty_like(out))
    rms_norm_forward(x, weight, out, eps)
