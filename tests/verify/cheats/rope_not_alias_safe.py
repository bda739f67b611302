"""Cheat (rope): right when out is a fresh buffer, wrong when out is q and k themselves. It
writes the first half of each rotated head before reading the first half of the input again
for the second, so in place the second half is computed from already rotated values."""

import torch


def forward(q, k, cos, sin, *, out):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    for x, o in zip((q, k), out):
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        y1 = torch.addcmul(torch.addcmul(torch.zeros_like(x1), x1, c[..., :half]),
                           x2, s[..., :half], value=-1)
        o[..., :half].copy_(y1)
        y2 = torch.addcmul(torch.addcmul(torch.zeros_like(x2), x2, c[..., half:]),
                           x1, s[..., half:])
        o[..., half:].copy_(y2)
