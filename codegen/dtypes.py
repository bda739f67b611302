"""Dtype names in cases (JSON-serialisable strings such as "bfloat16") and their torch types."""

from __future__ import annotations

import torch

from codegen.family import Case


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_size(case: Case) -> int:
    return torch.empty((), dtype=torch_dtype(case["dtype"])).element_size()
