"""Cheat: silently runs the reference's own aten ops (pow, mean, rsqrt, mul)."""

from verify_families import rms_norm_reference


def forward(x, weight, *, out, eps):
    out.copy_(rms_norm_reference(x, weight, eps=eps))
