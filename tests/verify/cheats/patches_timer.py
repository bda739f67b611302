"""Cheat (any family): makes every timed call look fast by patching the clocks."""

import time

import torch

_real = time.perf_counter
time.perf_counter = lambda: _real() / 1000


def forward(*inputs, out, **params):
    torch.cuda.synchronize = lambda *a, **k: None
