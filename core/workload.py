"""Workloads: what a forward pass is measured under (batch, sequence, dtype, device, mode)."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

from core.errors import UserError

DTYPES = {"fp32": "float32", "float32": "float32", "fp16": "float16", "float16": "float16",
          "bf16": "bfloat16", "bfloat16": "bfloat16"}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
MODES = ("prefill", "decode")


@dataclass(frozen=True)
class Workload:
    """prefill: model(input_ids[batch, seq]). decode: one token against a KV cache of `seq`."""

    batch: int
    seq: int
    dtype: str = "float32"
    device: str = "cpu"
    mode: str = "prefill"

    @property
    def key(self) -> str:
        return f"{self.mode}-b{self.batch}-s{self.seq}-{SHORT[self.dtype]}"

    @property
    def tokens(self) -> int:
        return self.batch * (self.seq if self.mode == "prefill" else 1)

    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        return cls(**{k: d[k] for k in ("batch", "seq", "dtype", "device", "mode")})


def parse_int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UserError(f"--{name} must be positive integers separated by commas, "
                        f"got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise UserError(f"--{name} must be positive integers separated by commas, got {text!r}")
    return values


def parse_dtype(text: str) -> str:
    try:
        return DTYPES[text.lower()]
    except KeyError:
        raise UserError(f"unknown dtype {text!r}; use one of fp32, fp16, bf16") from None


def expand(batch: str, seq: str, dtype: str, device: str, mode: str) -> list[Workload]:
    """`--batch 1,8 --seq 128,1024` means every combination (four workloads)."""
    modes = [m.strip() for m in mode.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise UserError(f"unknown mode {m!r}; use prefill, decode or prefill,decode")
    dt = parse_dtype(dtype)
    return [
        Workload(b, s, dt, device, m)
        for m, b, s in itertools.product(modes, parse_int_list(batch, "batch"),
                                         parse_int_list(seq, "seq"))
    ]


def parse_generations(text: str) -> list[tuple[int, int, int]]:
    """`1x1024+128,8x128+128` -> [(1, 1024, 128), (8, 128, 128)]: batch x prompt + new."""
    out = []
    for item in (x.strip() for x in str(text).split(",") if x.strip()):
        try:
            b, rest = item.lower().split("x")
            p, n = rest.split("+")
            b, p, n = int(b), int(p), int(n)
        except ValueError:
            raise UserError(f"--generation takes BxP+N items (batch x prompt + new tokens), "
                            f"comma-separated, e.g. 1x1024+128; got {item!r}") from None
        if min(b, p, n) <= 0:
            raise UserError(f"--generation {item!r}: batch, prompt and new tokens must be "
                            "positive")
        out.append((b, p, n))
    if not out:
        raise UserError("--generation names no generation; e.g. 1x1024+128")
    return out


def for_generation(text: str, dtype: str, device: str,
                   mode: str = "prefill,decode") -> list[Workload]:
    """`--generation 1x1024+128,8x128+128`: per generation of batch B, prompt P and N new
    tokens, its prefill (B, P) and its decode step at the KV length it ends at (B, P + N);
    `mode` keeps one of the two."""
    modes = [m.strip() for m in mode.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise UserError(f"unknown mode {m!r}; use prefill, decode or prefill,decode")
    out: list[Workload] = []
    dt = parse_dtype(dtype)
    for b, p, n in parse_generations(text):
        for w in (Workload(b, p, dt, device, "prefill"), Workload(b, p + n, dt, device, "decode")):
            if w.mode in modes and w not in out:
                out.append(w)
    return out
