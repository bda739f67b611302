"""Cheat (any family): launches on a stream of its own, which the caller's does not wait for."""

import torch


def forward(*inputs, out, **params):
    with torch.cuda.stream(torch.cuda.Stream()):
        out.copy_(inputs[0])
