"""Cheat (rmsnorm, gated_act): writes its result only where `out` holds a poison pattern it can
recognise (all-0xFF NaN bytes, the 0x7B fill); a real, uninitialised buffer is left as found."""

import torch
from cheat_kernels import honest, write_where_poison


def forward(*inputs, out, **params):
    tmp = torch.empty_like(out)
    honest(*inputs, out=tmp, **params)
    write_where_poison(tmp, out)
