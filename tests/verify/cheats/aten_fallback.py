"""Cheat: silently runs the reference's own aten ops (pow, mean, rsqrt, mul)."""

import torch


def forward(x, weight, *, out, eps):
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(weight * h.to(x.dtype))
