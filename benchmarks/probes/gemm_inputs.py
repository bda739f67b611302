"""Do our kernels hand the GEMMs they leave alone a different input, and does cuBLAS run slower
on it (GPU)? Issue 29: in Phi-3-mini's re-profile the untouched GEMMs took 8.7 % longer
patched than unpatched.

    python benchmarks/probes/gemm_inputs.py RUN_DIR WORKLOAD [OUT.json]

One unpatched and one patched prefill pass (RUN_DIR's kept set for WORKLOAD, `apply_kernels`),
with a forward pre-hook on every nn.Linear and HF Conv1D that records its input's layout: shape,
strides, storage offset, the data pointer's alignment and dtype. For every GEMM whose input
layout differs between the passes, both layouts are rebuilt on fresh storage and the GEMM is
timed on each (`verify.timing.bench`: CUDA events, L2 flushed, medians): a slower patched
layout is a cause the patch can remove; equal times put the slowdown elsewhere (cuBLAS's
choice, clocks, L2).
"""

from __future__ import annotations

import json
import sys

import torch

from core.artifacts import read_json
from profiling.loader import build, resolve
from verify.timing import bench


def layout(x: torch.Tensor) -> dict:
    return {"shape": list(x.shape), "stride": list(x.stride()),
            "offset": x.storage_offset(), "align": x.data_ptr() % 256,
            "contiguous": x.is_contiguous(), "dtype": str(x.dtype).removeprefix("torch.")}


def record(model, ids) -> dict[str, dict]:
    from transformers.pytorch_utils import Conv1D

    seen: dict[str, dict] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, Conv1D)):
            def pre(m, args, name=name):
                seen.setdefault(name, layout(args[0]))
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return seen


def rebuilt(lay: dict) -> torch.Tensor:
    """A tensor with `lay`'s shape, strides, offset and pointer alignment, random values."""
    dtype = getattr(torch, lay["dtype"])
    span = 1 + sum((n - 1) * s for n, s in zip(lay["shape"], lay["stride"]))
    extra = lay["align"] // dtype.itemsize + lay["offset"]
    base = torch.randn(span + extra + 256, device="cuda").to(dtype)
    pad = (-base.data_ptr() % 256) // dtype.itemsize  # the allocator aligns to 512 anyway
    return base.as_strided(lay["shape"], lay["stride"], pad + extra)


def gemm_us(mod, x: torch.Tensor) -> float:
    with torch.no_grad():
        return bench(lambda: mod(x), device="cuda").median_ms * 1e3


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    run_dir, key = sys.argv[1], sys.argv[2]
    out = sys.argv[3] if len(sys.argv) > 3 else None
    from pipeline.api import apply_kernels

    integ = read_json(f"{run_dir}/integration.json", "integration")
    spec = integ["workloads"][key]["workload"]
    profile = read_json(f"{run_dir}/profile.json", "profile")
    model = build(resolve(profile["model"]["id"]), torch.bfloat16, "cuda")
    ids = torch.randint(0, model.config.vocab_size, (spec["batch"], spec["seq"]), device="cuda")
    before = record(model, ids)
    handle = apply_kernels(model, run_dir, key)
    after = record(model, ids)
    mods = dict(model.named_modules())
    rows = []
    for name, lay in before.items():
        new = after.get(name)
        if new is None or new == lay:
            continue
        t0, t1 = gemm_us(mods[name], rebuilt(lay)), gemm_us(mods[name], rebuilt(new))
        rows.append({"module": name, "unpatched": lay, "patched": new,
                     "unpatched_us": round(t0, 2), "patched_us": round(t1, 2)})
        print(f"{name}: {lay['stride']}@{lay['offset']} -> {new['stride']}@{new['offset']} "
              f"align {lay['align']} -> {new['align']}: {t0:.1f} -> {t1:.1f} us")
    handle.undo()
    print(f"{len(before)} GEMM inputs, {len(rows)} with another layout patched "
          f"({handle.families})")
    if out:
        with open(out, "w") as f:
            json.dump({"run_dir": str(run_dir), "workload": key, "families": handle.families,
                       "gemms": len(before), "changed": rows}, f, indent=1)


if __name__ == "__main__":
    main()
