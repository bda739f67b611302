"""Cheat: computes once per shape, then returns the cached result for any later input."""

from rmsnorm_triton import rms_norm_forward

_cache = {}


def forward(x, weight, *, out, eps):
    key = (tuple(x.shape), x.dtype)
    if key in _cache:
        out.copy_(_cache[key])
        return
    rms_norm_forward(x, weight, out, eps)
    _cache[key] = out.clone()
