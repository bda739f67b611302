"""Launch a Triton kernel with less host time than `kernel[grid](...)`.

Measured on the H200 machine's host (benchmarks/probes/host_cost.py): a launch through Triton's
JIT costs about 16 us of Python, against about 6 us for an aten op and 6 us for the
same compiled kernel launched directly; in a model forward the gap is larger still. Where
the GPU waits for the host (batch 1 prefill, decode, and Qwen2.5-0.5B even at batch 8) that
difference decides whether a fused kernel wins, so generated candidates launch through here.

The first call of each specialisation goes through the JIT (compiles, checks, launches) and
keeps the compiled kernel; later calls launch it directly. The cache key holds what Triton
specialises on (`spec_key`): each tensor's dtype and 16-byte alignment, each integer's
== 1 / 16-divisible / width class, other scalars by value. So a call Triton would compile
differently never reuses a kernel built for another, and a decode step's growing cache
length does not send every call back through the JIT. A call site's repeat launches find
their kernel by an exact key instead (the scalars, each tensor's dtype, device kind and address
modulo 16), which costs the host 4.7 against 13.1 us for the KV-cache append's 33 arguments
(H200, benchmarks/host_profile.py). On Triton 3.6 the launch skips its
Python wrapper too (`_c_launch`), kernels with global scratch included (20.7 against 23.8 us
per call for the TMA gated GEMM, H200, benchmarks/probes/scratch_launch.py); under the CPU
interpreter, or with a Triton this does not know, every call goes through the JIT.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from functools import cache
from operator import itemgetter


def cdiv(a: int, b: int) -> int:
    """Ceiling division for grids; Triton 3.6's `triton.cdiv` is a constexpr function whose
    host-side call costs several microseconds per launch."""
    return -(-a // b)


def guessed_tiles(width: int, programs: Callable[[int], int], block_ns: tuple, block_ks: tuple,
                  min_tile: int, sms: int, target: int, keep: int,
                  cheapest: bool = True) -> list[tuple[int, int]]:
    """(BLOCK_N, BLOCK_K) tiles of a few-row projection kernel whose loads run along `width`,
    guessed best first: BLOCK_K <= width where one fits, tiles of `min_tile` elements and more
    where any are; the widest loads first, then grids of `programs(BLOCK_N)` programs nearest
    `target` (fewer than `sms` after), then the narrower BLOCK_N. At most `keep`, the last of
    them, with `cheapest`, the widest tile (the fewest programs and steps: what the CPU
    interpreter runs)."""
    bks = [b for b in block_ks if b <= width] or [block_ks[0]]
    tiles = [(bn, bk) for bn in block_ns for bk in bks]
    tiles = [t for t in tiles if t[0] * t[1] >= min_tile] or tiles

    def guess(t):
        p = programs(t[0])
        return (-t[1], p < sms, abs(math.log2(p / target)), t[0])

    if not cheapest:
        return sorted(tiles, key=guess)[:keep]
    last = (block_ns[-1], bks[-1])
    return [t for t in sorted(tiles, key=guess) if t != last][:keep - 1] + [last]


def _hooks_getter():
    try:
        from triton import knobs
    except ImportError:  # Triton before knobs: plain class attributes, None when unset
        from triton.compiler.compiler import CompiledKernel

        return lambda: (CompiledKernel.launch_enter_hook, CompiledKernel.launch_exit_hook)

    def launch_hooks() -> tuple:
        """(enter, exit) launch hooks to hand the C launcher: None for a hook chain with
        nothing in it (Triton 3.6 passes an empty HookChain, which the launcher then calls
        twice per launch, and builds launch metadata nobody reads)."""
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        return (enter if getattr(enter, "calls", True) else None,
                leave if getattr(leave, "calls", True) else None)

    return launch_hooks


launch_hooks = _hooks_getter()


def _direct_parts():
    """(device, stream) getters of this Triton, or None when a direct launch is not supported
    here (interpreter, unknown internals)."""
    try:
        from triton.runtime import driver

        active = driver.active
        return active.get_current_device, active.get_current_stream
    except Exception:  # noqa: BLE001 - any missing piece means: use the JIT
        return None


def spec_key(args: tuple) -> tuple[list, list]:
    """(key, values): per argument, what Triton would compile differently for (a tensor's
    dtype, device kind and 16-byte alignment; an integer's == 1 / 16-divisible / width class;
    any other scalar's value), and what to pass the C launcher: a tensor as its address, which
    spares the launcher a Python `data_ptr()` call and a driver pointer query per tensor."""
    key, values = [], []
    for a in args:
        if hasattr(a, "data_ptr"):
            p = a.data_ptr()
            key.append((a.dtype, a.is_cuda, p & 15 == 0))
            values.append(p)
        else:
            key.append((a % 16 == 0, -2**31 <= a < 2**31, a >= 0) if type(a) is int and a != 1
                       else a)
            values.append(a)
    return key, values


# Scratch alignment a cached buffer meets: the caching allocator's blocks start on 512 bytes.
_SCRATCH_ALIGN = 512


def _capturing() -> bool:
    import torch

    return torch.cuda.is_current_stream_capturing()


def _c_launch(k):
    """Triton 3.6's C launch function of compiled kernel `k`, called as `k.run` would call it,
    or None where this cannot be the same (an unknown launcher, profiling scratch).
    A kernel that needs global scratch (the TMA GEMM's device-made descriptors) gets one
    buffer per stream, kept and grown, where `k.run` asks the allocator for a fresh one per
    launch and goes through Triton's Python wrapper. Launches on one stream run in order, so
    they can share it. While a CUDA graph is being captured, `k.run` launches instead: a
    graph replayed on another stream must not share the eager launches' buffer."""
    run = k.run
    fn = getattr(run, "launch", None)
    try:
        params = list(inspect.signature(type(run).__call__).parameters)
    except (TypeError, ValueError):
        return None
    if (fn is None or params != ["self", "gridX", "gridY", "gridZ", "stream", "function", "args"]
            or getattr(run, "profile_scratch_size", 1)):
        return None
    coop, pdl = run.launch_cooperative_grid, run.launch_pdl
    scratch = getattr(run, "global_scratch_size", 1)
    if not scratch:
        def launch(gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
            fn(gx, gy, gz, stream, function, coop, pdl, None, None, packed, meta, enter, leave,
               *args)
        return launch
    per_program = scratch * getattr(run, "num_ctas", 0)
    if not per_program or getattr(run, "global_scratch_align", _SCRATCH_ALIGN + 1) > \
            _SCRATCH_ALIGN:
        return None
    buffers: dict = {}  # by stream; `launcher` makes one closure per device

    def launch_with_scratch(gx, gy, gz, stream, function, packed, meta, enter, leave, *args):
        if _capturing():
            return run(gx, gy, gz, stream, function, packed, meta, enter, leave, *args)
        need = gx * gy * gz * per_program
        buf = buffers.get(stream)
        if buf is None or buf.numel() < need:
            buf = buffers[stream] = _torch_alloc(need, _SCRATCH_ALIGN, stream)
        fn(gx, gy, gz, stream, function, coop, pdl, buf, None, packed, meta, enter, leave,
           *args)
    launch_with_scratch.buffers = buffers  # what tests can inspect
    return launch_with_scratch


def _allocator_state():
    """(current allocator getter, the null allocator's class) of this Triton, or None."""
    try:
        from triton.runtime import _allocation

        return _allocation._allocator.get, _allocation.NullAllocator
    except (ImportError, AttributeError):
        return None


_ALLOCATOR_STATE = _allocator_state()


def _torch_alloc(size: int, alignment: int, stream) -> object:
    """Global scratch from torch's caching allocator (blocks start on 512 bytes): Triton's
    allocator here, and the kept buffers of `_c_launch`."""
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator (torch's caching one) for kernels that need global scratch
    memory, such as TMA descriptors made on the device, unless one is set. Triton keeps it in
    a context variable, so each thread (a `generate` in a worker thread) needs its own: call
    this before every such launch; it is a lookup when one is set."""
    import triton

    if _ALLOCATOR_STATE is not None:
        current, null = _ALLOCATOR_STATE
        if not isinstance(current(), null):
            return
    triton.set_allocator(_torch_alloc)


# Distinct exact launch keys kept per launcher; past it (a decode's every cache length,
# say), calls still find their kernel through spec_key.
_EXACT_KEYS = 1024


def _picker(positions: tuple) -> Callable[[tuple], tuple]:
    """args -> the arguments at `positions`, as a tuple (itemgetter, in C; one position too)."""
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return itemgetter(*positions) if positions else (lambda args: ())


def launcher(kernel, **constexprs_and_options) -> Callable[..., None]:
    """`launch(grid, *runtime_args)` for `kernel` with its trailing constexpr parameters and
    launch options (num_warps, num_stages) bound once. A kernel whose last parameter is
    `PDL` (codegen/pdl.py) and that the caller leaves unbound launches with PDL=False, or
    with PDL=True and the PDL launch attribute while `codegen.pdl.enabled()` is on; one that
    takes `PREFETCH` just before it gets PREFETCH=True where PDL is on and the prefetch is
    too (`PDL_STATE.prefetch`), False otherwise."""
    fn = getattr(kernel, "fn", None)
    names = list(inspect.signature(fn).parameters) if fn is not None else []
    if names[-1:] == [PDL_PARAM] and PDL_PARAM not in constexprs_and_options:
        prefetch = names[-2:-1] == [PREFETCH_PARAM] and \
            PREFETCH_PARAM not in constexprs_and_options
        return _pdl_switch(kernel, constexprs_and_options, prefetch)
    bound = {k: v for k, v in constexprs_and_options.items() if k in names}
    options = {k: v for k, v in constexprs_and_options.items() if k not in names}
    trailing = tuple(bound[n] for n in names[len(names) - len(bound):]) \
        if set(names[len(names) - len(bound):]) == set(bound) else None
    parts = _direct_parts() if trailing is not None and hasattr(kernel, "device_caches") else None

    def via_jit(grid, *args):
        return kernel[grid](*args, **bound, **options)

    if parts is None:
        return via_jit
    get_device, get_stream = parts
    compiled: dict[tuple, tuple] = {}
    # Per call, `spec_key` walks every argument in Python: 33 for the KV-cache append, about
    # 40 us of the H200 host's time per call under cProfile (benchmarks/host_profile.py).
    # `exact` keys a launch on what varies between calls of one call site instead: the
    # scalars as they are (picked out in C), each tensor's dtype, device kind and address
    # modulo 16. That is finer than Triton's classes, so a miss only means the spec_key path,
    # which files the kernel it finds here too. Scalar types are not keyed: an equal value of
    # another type (7.0 for 7) reaches the kernel as the same number or is refused by the C
    # launcher with a TypeError; it cannot launch a wrong computation.
    exact: dict[tuple, tuple] = {}
    layout: list = []  # [tensor positions, scalars' getter], from the first compiled launch

    def launch(grid, *args):  # one Python frame per launch: each costs the host time
        device = get_device()
        hit = sig = None
        if layout:
            tensor_pos, scalars_of = layout
            values, parts = list(args), [device, scalars_of(args)]
            try:
                for i in tensor_pos:
                    t = args[i]
                    p = values[i] = t.data_ptr()
                    parts.append((t.dtype, t.is_cuda, p & 15))
                sig = tuple(parts)
                hit = exact.get(sig)
            except (AttributeError, TypeError, IndexError):  # another argument layout
                sig = None
        if hit is None:
            key, values = spec_key(args)
            hit = compiled.get((device, *key))
            if hit is None:
                k = via_jit(grid, *args)
                if k is not None and hasattr(k, "packed_metadata") and all(
                        t.is_cuda for t in args if hasattr(t, "data_ptr")):
                    compiled[(device, *key)] = (k, _c_launch(k) or k.run)
                    if not layout:
                        tensor_pos = tuple(i for i, a in enumerate(args)
                                           if hasattr(a, "data_ptr"))
                        layout.extend([tensor_pos, _picker(tuple(
                            i for i in range(len(args)) if i not in tensor_pos))])
                return
            # file it under the exact key, unless a tensor sits where the layout has a scalar
            if sig is not None and len(exact) < _EXACT_KEYS and \
                    not any(hasattr(a, "data_ptr") for a in sig[1]):
                exact[sig] = hit
        k, run = hit
        stream = get_stream(device)
        values.extend(trailing)
        enter, leave = launch_hooks()
        meta = k.launch_metadata(grid, stream, *args, *trailing) if enter is not None else None
        run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
            stream, k.function, k.packed_metadata, meta, enter, leave, *values)

    launch.compiled = compiled  # what tests (and a curious user) can inspect
    launch.exact = exact
    return launch


# Programmatic dependent launch (codegen/pdl.py says what and why; its `enabled` turns this on).
# The switch lives here, not there, because this file is also an exported package's launcher
# (pipeline/export.py copies it), which must import nothing of the project.
PDL_PARAM = "PDL"  # the constexpr each PDL-aware kernel takes, last
# the constexpr a weight-streaming PDL-aware kernel takes just before PDL: with PDL on, ask L2
# for the program's weight slab before the wait (codegen/pdl.py says why)
PREFETCH_PARAM = "PREFETCH"


class _PDLState:
    __slots__ = ("on", "prefetch")

    def __init__(self) -> None:
        self.on = False
        self.prefetch = False  # only read while `on`


PDL_STATE = _PDLState()  # read by every PDL-aware launcher at each launch


@cache
def pdl_hardware_reason() -> str | None:
    """Why PDL launches cannot run in this process at all, or None where they can."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter runs the kernels"
    try:
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return "this Triton has no griddepcontrol (gdc_wait)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    major, minor = torch.cuda.get_device_capability()
    if major < 9:
        return f"the GPU is sm_{major}{minor}; PDL needs sm_90 or later"
    return None


# Arrival counters of the FUSED kernels (decode attention's combine, the GEMV's split sum in
# the split kernel's last program): one zeroed int32 buffer per (device, size) for the process.
# Each launch leaves it at zero (the last program of each group resets its own counter), so no
# memset runs per call, and kernels of any family may share one: the calls sharing a buffer
# run one after another on one stream, as a decode step's kernels do (with PDL each waits for
# its predecessor before touching a counter). Make the first call before a CUDA graph is
# captured (the graphs stage's warm-up does), so the graph uses a buffer it does not own; a
# first call inside a capture works too (its torch.zeros is captured and re-zeroes it each
# replay).
ARRIVALS: dict = {}


def arrival_counters(device, size: int):
    """The shared zeroed int32 counters of `size` on `device` (see ARRIVALS)."""
    counts = ARRIVALS.get((device, size))
    if counts is None:
        import torch

        counts = ARRIVALS[(device, size)] = torch.zeros(size, dtype=torch.int32, device=device)
    return counts


def pdl_options() -> dict:
    """What a `kernel[grid](...)` call of a PDL-aware kernel adds: PDL=True and the launch
    attribute while PDL is on, nothing (the kernel's PDL=False) otherwise."""
    return {PDL_PARAM: True, "launch_pdl": True} if PDL_STATE.on else {}


def _pdl_switch(kernel, bound: dict, prefetch: bool) -> Callable[..., None]:
    """The launcher of `kernel` with PDL off, or, where PDL can run in this process, one that
    picks per launch (by `PDL_STATE`) between it and a PDL launcher built on first use (two,
    with the L2 prefetch and without, where the kernel takes `PREFETCH`). The PDL launchers
    compile their own specialisations (PDL and PREFETCH are constexprs), so a graph captured
    with PDL on and one captured with it off hold different kernels."""
    fetch = {PREFETCH_PARAM: False} if prefetch else {}
    off = launcher(kernel, **bound, **fetch, **{PDL_PARAM: False})
    if pdl_hardware_reason() is not None:
        return off
    state, on = PDL_STATE, {}

    def launch(grid, *args):
        if not state.on:
            return off(grid, *args)
        key = prefetch and state.prefetch
        if key not in on:
            on[key] = launcher(kernel, **bound, **({PREFETCH_PARAM: key} if prefetch else {}),
                               **{PDL_PARAM: True}, launch_pdl=True)
        return on[key](grid, *args)

    for name in ("compiled", "exact"):
        if hasattr(off, name):
            setattr(launch, name, getattr(off, name))
    return launch
