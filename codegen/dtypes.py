"""Dtype names in cases (JSON-serialisable strings such as "bfloat16") and their torch types."""

from __future__ import annotations

import torch

from core.family import Case


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_size(case: Case) -> int:
    return torch.empty((), dtype=torch_dtype(case["dtype"])).element_size()


def random_normal(shape, device, generator, dtype: str, scale: float = 1.0) -> torch.Tensor:
    """`scale` x standard normal values of the dtype named, drawn in fp32 on the generator's
    device (so one seed gives the same values wherever the tensor goes), then moved."""
    gen_device = generator.device if generator is not None else "cpu"
    x = torch.randn(shape, generator=generator, device=gen_device, dtype=torch.float32)
    return (scale * x).to(device=device, dtype=torch_dtype(dtype))


def random_heads(case: Case, n_heads: int, device="cpu", generator=None) -> torch.Tensor:
    """Random (batch, n_heads, seq, head_dim) of the case's dtype, laid out as HF makes q, k
    and v: a transposed view of a (batch, seq, heads, head_dim) projection, or contiguous
    when the case says `contiguous`. Drawn on the generator's device, then moved."""
    b, s, d = case["batch"], case["seq"], case["head_dim"]
    gen_device = generator.device if generator is not None else "cpu"
    if case.get("contiguous"):
        x = torch.randn((b, n_heads, s, d), generator=generator, device=gen_device)
        return x.to(device=device, dtype=torch_dtype(case["dtype"]))
    x = torch.randn((b, s, n_heads, d), generator=generator, device=gen_device)
    return x.to(device=device, dtype=torch_dtype(case["dtype"])).transpose(1, 2)
