"""Cheat (GPU): right result, computed on a stream of its own: correct after a full device
synchronise, a race in a real model whose next kernel runs on the caller's stream."""

import torch
from rmsnorm_triton import rms_norm_forward


def forward(x, weight, *, out, eps):
    stream = torch.cuda.Stream(device=x.device)
    stream.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(stream):
        rms_norm_forward(x, weight, out, eps)
