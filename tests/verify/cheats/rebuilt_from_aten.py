"""Cheat (rmsnorm, gated_act): the right result rebuilt from aten ops the pattern does not
name (a vector norm and a division; an exponential, a division and a fused multiply-add)."""

import math

import torch


def forward(*inputs, out, **params):
    if "eps" in params:
        x, w = inputs
        h = x.float()
        rms = torch.linalg.vector_norm(h, dim=-1, keepdim=True) / math.sqrt(x.shape[-1])
        normed = torch.div(h, torch.sqrt(rms * rms + params["eps"])).to(x.dtype)
        out.copy_(torch.addcmul(torch.zeros_like(out), normed, w + params["offset"]))
    else:
        gate, up = inputs
        g = gate.float()
        act = torch.div(g, torch.exp(-g) + 1)
        out.copy_(torch.addcmul(torch.zeros_like(g), act, up.float()))
