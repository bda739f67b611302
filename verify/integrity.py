"""Integrity: poisoned and guarded outputs, input snapshots, the aten-op recorder, stream checks.

These catch kernels that are numerically right for the wrong reasons: they leave part of `out`
unwritten (poison survives), write beyond it (guard bytes change), write into their inputs,
rebind `out` to other storage, run the very aten ops they claim to replace, or work on a side
stream (right after a full device synchronise, racy in a real model).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Poison is written byte-wise so one value serves every dtype. 0xFF bytes are a NaN in every IEEE
# float format (fp64 to fp8) and -1 in integers; 0x7B bytes are a large finite number in every
# float format (fp16 6.1e4, bf16/fp32 ~1e36, e4m3fn 352), so a kernel that leaves poison is seen
# both as NaN-where-none-belongs and as a wrong finite value.
POISON_NAN = 0xFF
POISON_BIG = 0x7B
_BOOL_POISON = {POISON_NAN: 0x01, POISON_BIG: 0x00}  # other bytes are not valid booleans
GUARD_BYTES = 16384  # guard before and after `out`: a row or more of a typical hidden size

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor reinterpreted as integers of the same width: bitwise equality, NaN included."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def _poison_byte(dtype: torch.dtype, byte: int) -> int:
    return _BOOL_POISON[byte] if dtype == torch.bool else byte


def poison_bits(dtype: torch.dtype, byte: int) -> int:
    one = torch.empty(1, dtype=dtype)
    one.view(torch.uint8).fill_(_poison_byte(dtype, byte))
    return int(bits(one)[0])


@dataclass
class GuardedOut:
    """An output tensor placed inside a larger prefilled buffer: `view` is what the candidate
    gets; every element of `backing` outside the view's must still hold its prefill afterwards.

    The prefill is a byte pattern (`like`) or fresh random finite values (`random`): a fixed
    pattern can be recognised by a candidate that looks at `out` before writing, values drawn
    from a per-run seed cannot."""

    backing: torch.Tensor  # flat, the whole allocation
    view: torch.Tensor
    outside: torch.Tensor  # bool over backing: True where no element of the view lives
    fill: torch.Tensor  # the prefill's bits, shaped like backing
    offset: int

    @staticmethod
    def _allocate(template: torch.Tensor) -> tuple[torch.Tensor, int]:
        if any(s < 0 for s in template.stride()):
            raise ValueError("output with a negative stride")
        span = 1 + sum((n - 1) * s for n, s in zip(template.shape, template.stride())) \
            if template.numel() else 0
        guard = max(1, GUARD_BYTES // template.element_size())
        return torch.empty(span + 2 * guard, dtype=template.dtype,
                           device=template.device), guard

    @classmethod
    def _place(cls, template: torch.Tensor, backing: torch.Tensor, guard: int) -> GuardedOut:
        view = backing.as_strided(template.shape, template.stride(), guard)
        outside = torch.ones(backing.shape, dtype=torch.bool, device=template.device)
        outside.as_strided(template.shape, template.stride(), guard).fill_(False)
        return cls(backing, view, outside, bits(backing).clone(), guard)

    @classmethod
    def like(cls, template: torch.Tensor, byte: int) -> GuardedOut:
        backing, guard = cls._allocate(template)
        backing.view(torch.uint8).fill_(_poison_byte(template.dtype, byte))
        return cls._place(template, backing, guard)

    @classmethod
    def random(cls, template: torch.Tensor, seed: int) -> GuardedOut:
        """Prefilled with random finite values of an activation's spread (and random integers
        or booleans), drawn from `seed` by a generator on the output's own device.

        Drawn where the output lives: on the CPU, the LM head's 8192 x 50257 logits took
        seconds per input set to draw (two serial generator passes over 412 M values) and
        then a pageable copy to the GPU, which made it the largest cost of verifying that
        case (verify.harness's cost note); a device generator draws them in about a
        millisecond. The fill is as unpredictable; it repeats per (seed, device type)."""
        backing, guard = cls._allocate(template)
        gen = torch.Generator(device=template.device).manual_seed(seed)
        n, dtype, dev = backing.numel(), template.dtype, template.device
        if dtype.is_floating_point:
            # a few units, and now and then a large value (as a real uninitialised buffer has)
            v = torch.randn(n, generator=gen, dtype=torch.float32, device=dev) * \
                torch.where(torch.rand(n, generator=gen, device=dev) < 0.01, 1e3, 2.0)
            half = torch.finfo(dtype).max / 2  # fp16/fp8 would turn the large ones into inf
            values = v.clamp(-half, half).to(dtype)
        elif dtype == torch.bool:
            values = torch.rand(n, generator=gen, device=dev) < 0.5
        else:
            values = torch.randint(-100, 100, (n,), generator=gen, device=dev).to(dtype)
        backing.copy_(values)
        return cls._place(template, backing, guard)

    def meta(self) -> tuple:
        return _meta(self.view)

    def changed_outside(self) -> int:
        """Elements outside the view (guards, gaps of a strided view) that changed."""
        return int((bits(self.backing)[self.outside] != self.fill[self.outside]).sum())

    def unwritten(self) -> torch.Tensor:
        """Bool mask over the view: still exactly the prefill."""
        want = self.fill.as_strided(self.view.shape, self.view.stride(), self.offset)
        return bits(self.view) == want


def clone_layouts(values: Sequence) -> tuple:
    """Copies of the tensors in `values` with their very layout: shape, strides, storage offset
    and which of them share storage (column halves of one buffer stay halves of one copy).
    `Tensor.clone()` would make a view with gaps contiguous, and the copy would no longer be
    the layout the adapter passes."""
    storages: dict[int, torch.UntypedStorage] = {}
    out = []
    for v in values:
        if not isinstance(v, torch.Tensor):
            out.append(v)
            continue
        key = v.untyped_storage().data_ptr()
        if key not in storages:
            storages[key] = v.untyped_storage().clone()
        copy = torch.empty(0, dtype=v.dtype, device=v.device)
        copy.set_(storages[key], v.storage_offset(), v.shape, v.stride())
        out.append(copy)
    return tuple(out)


def _meta(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.data_ptr(), t.dtype)


@dataclass
class InputSnapshot:
    """The whole storage behind an input (not only its elements: a kernel writing into the gaps
    of a strided view corrupts the model's other data just the same) and its geometry."""

    tensor: torch.Tensor
    storage: torch.UntypedStorage
    meta: tuple

    @classmethod
    def take(cls, t: torch.Tensor) -> InputSnapshot:
        return cls(t, t.untyped_storage().clone(), _meta(t))

    def problems(self, index: int) -> list[str]:
        t = self.tensor
        if _meta(t) != self.meta:
            return [(f"input {index}: shape/strides/offset/storage changed from "
                     f"{self.meta[:3]} to {_meta(t)[:3]}")]
        now = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        before = torch.empty(0, dtype=torch.uint8, device=t.device).set_(self.storage)
        if torch.equal(now, before):
            return []
        old = torch.empty(0, dtype=t.dtype, device=t.device).set_(
            self.storage, t.storage_offset(), t.shape, t.stride())
        inside = int((bits(old) != bits(t)).sum())
        return [(f"input {index}: {int((now != before).sum())} bytes of its storage changed "
                 f"({inside} of its {t.numel()} elements)")]


def normalize_op(name: str) -> str:
    """'mul', 'aten.mul.Tensor', 'aten::mul_', 'aten::mul.out' -> 'aten::mul'.

    In-place and out= variants are the same computation, so they count as the op.
    """
    if "::" in name:
        ns, rest = name.split("::", 1)
    elif name.startswith("aten."):
        ns, rest = "aten", name[len("aten."):]
    else:
        ns, rest = "aten", name
    base = rest.split(".", 1)[0]
    if base.endswith("_") and not base.endswith("__"):
        base = base[:-1]
    return f"{ns}::{base}"


# What a candidate's forward may dispatch on the host: everything a kernel's wrapper needs to
# get buffers and launch, nothing that computes a value from the inputs. The one list, with why:
ALLOWED_OPS: dict[str, str] = {
    **dict.fromkeys(
        ("empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "zeros",
         "zeros_like", "new_zeros", "zero", "fill", "resize"),
        "allocation and initialising a buffer the kernel then writes (scratch, atomics)"),
    **dict.fromkeys(
        ("view", "_unsafe_view", "reshape", "_reshape_alias", "as_strided", "transpose", "t",
         "permute", "select", "slice", "narrow", "expand", "expand_as", "unsqueeze", "squeeze",
         "flatten", "unflatten", "view_as", "split", "split_with_sizes", "chunk", "unbind",
         "alias", "detach", "contiguous", "lift_fresh", "lift_fresh_copy", "movedim",
         "_reshape_copy"),
        "views and layout changes: what a wrapper does to hand the kernel its pointers"),
    **dict.fromkeys(
        ("copy", "clone", "_to_copy", "to", "_copy_from", "_copy_from_and_resize",
         "resolve_conj", "resolve_neg", "type_as"),
        "copies and dtype moves (the interpreter moves arguments to the host and back)"),
    "set": "the Triton interpreter points host copies at storages (set_); a candidate that "
           "rebinds `out` itself fails out_buffer",
    **dict.fromkeys(
        ("size", "stride", "sym_size", "sym_stride", "storage_offset", "sym_storage_offset",
         "is_contiguous", "sym_is_contiguous", "dim", "numel", "sym_numel", "is_same_size",
         "is_floating_point", "is_complex", "element_size", "_has_compatible_shallow_copy_type",
         "is_non_overlapping_and_dense", "is_pinned"),
        "shape, stride and dtype metadata"),
}
# Namespaces of torch's own compute ops; any other namespace is an extension's custom op (a
# family's CUDA variant registers its own) and is the candidate's own launch.
COMPUTE_NAMESPACES = ("aten", "prims", "prim", "quantized", "sparse", "_c10d_functional",
                      "c10d", "torchvision")


def disallowed_ops(seen: Counter, also: tuple[str, ...] = ()) -> dict[str, int]:
    """The dispatched ops a candidate's forward may not run: torch compute ops outside
    ALLOWED_OPS (aten::<name> after normalize_op) and outside `also`, the library calls its
    family declares as its own implementation (`VerifyHooks.library_ops`)."""
    bad = {}
    extra = {op.split("::", 1)[-1] for op in also}
    for op, n in sorted(seen.items()):
        ns, base = op.split("::", 1) if "::" in op else ("aten", op)
        if ns in COMPUTE_NAMESPACES and base not in ALLOWED_OPS and base not in extra:
            bad[op] = n
    return bad


class OpRecorder(TorchDispatchMode):
    """Counts every aten op dispatched while active (after autograd and composite decomposition,
    on any device), so a candidate that computes with torch ops instead of its kernel is seen."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[normalize_op(func._schema.name)] += 1
        return func(*args, **(kwargs or {}))


def forbidden_ops(seen: Counter, forbidden: set[str]) -> dict[str, int]:
    return {op: n for op, n in sorted(seen.items()) if op in forbidden}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_streams(call: Callable[[], None], device: torch.device) -> dict:
    """Run `call` under torch.profiler and report the streams its GPU work ran on and the aten ops
    it dispatched. A marker kernel launched and finished just before identifies the stream the
    caller uses (the trace's stream ids are CUPTI's, not torch's)."""
    from torch.profiler import ProfilerActivity, profile

    marker = torch.zeros(1, device=device)
    stream_before = torch.cuda.current_stream(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marker.add_(1)
        torch.cuda.synchronize(device)
        with torch.profiler.record_function("verify::forward"):
            call()
        torch.cuda.synchronize(device)
    stream_after = torch.cuda.current_stream(device)
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e.get("ts", 0))
    window = [e for e in events if e.get("name") == "verify::forward"
              and e.get("cat") == "user_annotation"]  # not its gpu_user_annotation twin
    start = window[0]["ts"] if window else None
    end = start + window[0].get("dur", 0) if window else None
    ops = Counter(normalize_op(e["name"]) for e in events
                  if e.get("cat") == "cpu_op" and str(e.get("name", "")).startswith("aten::")
                  and start is not None and start <= e.get("ts", -1) <= end)
    default = gpu[0].get("args", {}).get("stream") if gpu else None
    others = [(e.get("name", "?"), e.get("args", {}).get("stream")) for e in gpu[1:]
              if e.get("args", {}).get("stream") != default]
    return {"default_stream": default, "other_streams": others, "ops": ops,
            "n_gpu_events": max(0, len(gpu) - 1),
            "current_stream_changed": stream_before != stream_after}


def snapshot_inputs(inputs: Sequence) -> list[tuple[int, InputSnapshot]]:
    return [(i, InputSnapshot.take(a)) for i, a in enumerate(inputs)
            if isinstance(a, torch.Tensor)]
