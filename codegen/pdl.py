"""Programmatic dependent launch (PDL) for the generated Triton kernels of a decode step.

A CUDA graph removes the host from a decode step, but each kernel still starts only once the
previous one has finished: its launch, its programs' start-up and its first weight loads sit
in the gap between two kernels. With PDL (Hopper and later) a kernel launched with the
programmatic-serialization attribute may start while its predecessor runs; it must then wait
(`griddepcontrol.wait`, which returns once the predecessor grid has completed and its writes
are visible) before it touches anything the predecessor writes or reads, and the predecessor
lets it start early (`griddepcontrol.launch_dependents`). Stream capture keeps the attribute
as a programmatic edge of the graph.

Each decode-path kernel takes a `PDL` constexpr (last parameter, default False). Set, it
loads what no kernel of the step writes (weights) first, then waits, then lets its own
successor launch, then reads and writes activations. The wait comes before the first read
AND the first write of any activation: a kernel that wrote a buffer its still-running
predecessor reads (write after read) would race as surely as one reading too early. Every
program waits unconditionally, so a kernel's completion implies its predecessor's and the
chain holds across the whole step. `launch_dependents` comes after the wait, not before:
a successor's programs then occupy SM slots only one kernel ahead, not the whole step's.

The weight-streaming kernels (gemv, matmul_epilogue's GEMV, qkv_proj, norm_qkv,
norm_gate_up) also take a `PREFETCH` constexpr, just before `PDL`. A decode step's cost is
its weight stream, and a kernel's first tile alone covers little of the predecessor's tail:
set, each program asks L2 for every 128-byte line of the weight slab it will stream
(`prefetch.global.L2`, codegen/prefetch.py) before it waits, so the slab lands in L2 while the
predecessor finishes and the loop after the wait reads it from there. It is a hint (nothing
is read into registers, nothing changes the arithmetic) and binds only where PDL is on:
without PDL a program starts after its predecessor, with nothing to overlap.

`codegen.launch.launcher` binds `PDL` and `PREFETCH` itself (the switch, `PDL_STATE`, lives
in launch.py, which an exported package copies and which must import nothing of the
project): off, unless `enabled()` is set around the call, and on only where `unavailable()`
says nothing (never under the interpreter, which must not execute the griddepcontrol
instructions, nor on a GPU older than sm_90 or a Triton without them). Whether PDL pays is
a whole-graph question (a kernel's gain is its predecessor's tail), so the graphs stage
captures the step both ways and keeps the faster by a paired timing; `NO_PDL_ENV` (or
`optimize --no-pdl`) keeps it off. The prefetch is opt-in (`PREFETCH_ENV`, or
`enabled(prefetch=True)` for one capture): on the H100 it cost the graphed Llama-3.2-1B decode
step 12 % (1.411 ms against 1.246 ms with PDL alone, benchmarks/results/README.md), the slabs
it pulls into L2 evicting what the running predecessor still reads; it stays to be timed on
other GPUs and shapes (benchmarks/head_to_head.py's ours-graphs-pdl-prefetch).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from codegen import launch
from codegen.launch import PDL_PARAM as PARAM  # noqa: F401 - the name kernels take
from codegen.launch import PDL_STATE as STATE
from codegen.launch import pdl_options as launch_options  # noqa: F401 - for kernel[grid] calls

NO_PDL_ENV = "PIPELINE_NO_PDL"
PREFETCH_ENV = "PIPELINE_PDL_PREFETCH"


def _set(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def forced_off() -> bool:
    """Whether the user turned PDL off (`NO_PDL_ENV` set to anything but "" or "0")."""
    return _set(NO_PDL_ENV)


def prefetch_opted_in() -> bool:
    """Whether the user turned the L2 prefetch of PDL launches on (`PREFETCH_ENV` set to
    anything but "" or "0")."""
    return _set(PREFETCH_ENV)


def hardware_reason() -> str | None:
    """Why PDL launches cannot run in this process at all (the interpreter, no sm_90 GPU, a
    Triton without griddepcontrol), or None where they can."""
    return launch.pdl_hardware_reason()


def unavailable() -> str | None:
    """Why PDL stays off here (forced off, or `hardware_reason`), or None where it may be on."""
    if forced_off():
        return f"{NO_PDL_ENV} is set"
    return hardware_reason()


@contextmanager
def enabled(on: bool = True, prefetch: bool | None = None):
    """PDL launches for every PDL-aware kernel launched inside (a graph captured inside keeps
    them), the weight-streaming ones with the L2 prefetch where `prefetch` is True or, left
    None, where `PREFETCH_ENV` is set; a no-op where `unavailable()` says why not."""
    before = STATE.on, STATE.prefetch
    STATE.on = bool(on) and unavailable() is None
    STATE.prefetch = STATE.on and (prefetch_opted_in() if prefetch is None else bool(prefetch))
    try:
        yield STATE.on
    finally:
        STATE.on, STATE.prefetch = before
