"""Cheat (rmsnorm, gated_act): caches its answer keyed on the inputs' data pointers and shape, so
new values written into the same buffers get the old answer."""

import torch
from cheat_kernels import honest

_cache = {}


def forward(*inputs, out, **params):
    key = tuple((t.data_ptr(), tuple(t.shape)) for t in inputs)
    if key not in _cache:
        _cache[key] = torch.empty_like(out)
        honest(*inputs, out=_cache[key], **params)
    out.copy_(_cache[key])
