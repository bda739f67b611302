"""Launch a Triton kernel with less host time than `kernel[grid](...)`.

Measured on the H200 machine's host (benchmarks/results/host_cost.json): a launch through
Triton's JIT costs about 16 us of Python, against about 6 us for an aten op and 6 us for the
same compiled kernel launched directly; in a model forward the gap is larger still. Where
the GPU waits for the host (batch 1 prefill, decode, and Qwen2.5-0.5B even at batch 8) that
difference decides whether a fused kernel wins, so generated candidates launch through here.

The first call of each specialisation goes through the JIT (compiles, checks, launches) and
keeps the compiled kernel; later calls launch it directly. The cache key holds what Triton
specialises on: every scalar argument's value and every tensor's 16-byte alignment, so a
call Triton would compile differently never reuses a kernel built for another. Under the
CPU interpreter, or with a Triton this does not know, every call goes through the JIT.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable


def _direct_parts():
    """(device, stream, hooks) getters of this Triton, or None when a direct launch is not
    supported here (interpreter, unknown internals)."""
    try:
        from triton.runtime import driver

        active = driver.active
        get_device, get_stream = active.get_current_device, active.get_current_stream
    except Exception:  # noqa: BLE001 - any missing piece means: use the JIT
        return None
    try:
        from triton import knobs

        def hooks():
            return knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    except ImportError:
        from triton.compiler.compiler import CompiledKernel

        def hooks():
            return CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook
    return get_device, get_stream, hooks


def launcher(kernel, **constexprs_and_options) -> Callable[..., None]:
    """`launch(grid, *runtime_args)` for `kernel` with its trailing constexpr parameters and
    launch options (num_warps, num_stages) bound once."""
    fn = getattr(kernel, "fn", None)
    names = list(inspect.signature(fn).parameters) if fn is not None else []
    bound = {k: v for k, v in constexprs_and_options.items() if k in names}
    options = {k: v for k, v in constexprs_and_options.items() if k not in names}
    trailing = tuple(bound[n] for n in names[len(names) - len(bound):]) \
        if set(names[len(names) - len(bound):]) == set(bound) else None
    parts = _direct_parts() if trailing is not None and hasattr(kernel, "device_caches") else None

    def via_jit(grid, *args):
        return kernel[grid](*args, **bound, **options)

    if parts is None:
        return via_jit
    get_device, get_stream, hooks = parts
    compiled: dict[tuple, object] = {}

    def launch(grid, *args):
        device = get_device()
        key = (device, *(a.data_ptr() % 16 == 0 if hasattr(a, "data_ptr") else a for a in args))
        k = compiled.get(key)
        if k is None:
            k = via_jit(grid, *args)
            if k is not None and hasattr(k, "packed_metadata"):
                compiled[key] = k
            return
        stream = get_stream(device)
        full = args + trailing
        enter, leave = hooks()
        meta = k.launch_metadata(grid, stream, *full)
        k.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
              stream, k.function, k.packed_metadata, meta, enter, leave, *full)

    launch.compiled = compiled  # what tests (and a curious user) can inspect
    return launch
