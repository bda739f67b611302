"""Cheat (rmsnorm, gated_act): caches its answer keyed on the first 8 values of its first input
(compared on the device), so an input that repeats an earlier one's leading rows with a new
tail gets the earlier answer."""

import torch
from cheat_kernels import cached_by_prefix, honest


def forward(*inputs, out, **params):
    fresh = torch.empty_like(out)
    honest(*inputs, out=fresh, **params)
    cached_by_prefix(inputs[0], out, fresh)
