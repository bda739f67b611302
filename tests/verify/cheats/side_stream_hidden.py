"""Cheat (GPU): side_stream.py with its stream made by a helper module, so nothing in this
source names a stream: the static check passes it and the profiler must see the stream."""

from cheat_kernels import side_stream
from rmsnorm_triton import rms_norm_forward


def forward(x, weight, *, out, eps):
    with side_stream(x.device):
        rms_norm_forward(x, weight, out, eps)
