"""Attribute every microsecond once: device work -> aten op -> nn.Module -> (later) pattern.

Each device event carries the External id of the innermost cpu_op that launched it; its time
goes to that op, and from there to the *top-level* aten op enclosing it (an `aten::linear`
owns the `aten::mm` under it), so no kernel is counted twice. A device event whose External id
matches no op falls back to the op enclosing its launch call (correlation id), then to an
"(unattributed)" row, which the invariants keep below 1 % on real traces.

Scopes come from `python_function` events (recorded with `with_stack=True`): module events
named `nn.Module: Class_N` give the module path, function frames inside the innermost module
give names such as `apply_rotary_pos_emb` with a per-call id, which is what pattern recognition
needs to tell one call from another.
"""

from __future__ import annotations

import bisect
import re
import statistics
from dataclasses import dataclass, field

from profiling.trace import DEVICE_CATS, LAUNCH_CATS, events, profiler_steps

_MODULE_RE = re.compile(r"^nn\.Module: (.+)_(\d+)$")
_FUNC_RE = re.compile(r"^(.*)\((\d+)\): (.+)$")


@dataclass
class Op:
    """One top-level aten op call (not nested in another aten op)."""

    idx: int
    name: str
    ts: float
    cpu_us: float  # host time of the call, nested aten ops included
    module: str  # dotted module path (or Class_N chain when no name map is given)
    module_class: str
    module_call: int  # id of the innermost module call (Python id)
    functions: list[list] = field(default_factory=list)  # [[name, call_id], ...] inside module
    module_calls: list[int] = field(default_factory=list)  # call ids of enclosing modules
    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    strides: list = field(default_factory=list)
    device_us: float = 0.0
    kernels: list[dict] = field(default_factory=list)
    launches: int = 0

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


@dataclass
class StepAttribution:
    step: str
    index: int  # position among the trace's ProfilerStep spans
    span_us: float  # host span of ProfilerStep#N
    device_span_us: float  # first device start to last device end, for this step's work
    device_busy_us: float  # union of device intervals
    kernel_total_us: float  # plain sum of device event durations
    unattributed_us: float
    ops: list[Op]
    modules: dict[str, dict]
    kernel_count: int


class _Nest:
    """Containment queries over nested intervals on one thread, in O(depth) per query."""

    def __init__(self, evs: list[dict]):
        self.evs = sorted(evs, key=lambda e: (e["ts"], -e["dur"]))
        self.parent: list[int | None] = []
        stack: list[int] = []
        for i, e in enumerate(self.evs):
            end = e["ts"] + e["dur"] - 1e-3
            while stack and self.evs[stack[-1]]["ts"] + self.evs[stack[-1]]["dur"] < end:
                stack.pop()
            self.parent.append(stack[-1] if stack else None)
            stack.append(i)
        self.starts = [e["ts"] for e in self.evs]

    def innermost(self, ts: float, end: float) -> int | None:
        i = bisect.bisect_right(self.starts, ts) - 1
        while i is not None and i >= 0:
            e = self.evs[i]
            if e["ts"] <= ts and e["ts"] + e["dur"] >= end - 1e-3:
                return i
            # with proper nesting, anything containing ts also contains evs[i]: walk up
            i = self.parent[i]
        return None

    def chain(self, i: int | None) -> list[int]:
        out = []
        while i is not None:
            out.append(i)
            i = self.parent[i]
        return out[::-1]


def attribute_step(trace: dict, step_index: int = -1, module_names: dict[str, str] | None = None
                   ) -> StepAttribution:
    """Attribute one ProfilerStep (default: the last). `module_names` maps `Class_N` to paths."""
    steps = profiler_steps(trace)
    if not steps:
        raise ValueError("trace has no ProfilerStep#N spans (profile with a schedule)")
    step = steps[step_index]
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    tid = step["tid"]

    def inside(e):
        return e.get("tid") == tid and e["ts"] >= t0 and e["ts"] + e.get("dur", 0) <= t1 + 1e-3

    cpu_ops = [e for e in events(trace, "cpu_op") if inside(e)]
    py = [e for e in events(trace, "python_function") if inside(e)]
    launches = [e for e in events(trace, *LAUNCH_CATS) if inside(e)]
    corr_launch = {e["args"].get("correlation"): e for e in launches}
    dev_all = [e for e in events(trace, *DEVICE_CATS)]
    dev = [e for e in dev_all if e["args"].get("correlation") in corr_launch]

    op_nest = _Nest(cpu_ops)
    py_nest = _Nest(py)
    top_of: dict[int, int] = {}
    tops: list[int] = []
    for i, p in enumerate(op_nest.parent):
        if p is None:
            top_of[i] = i
            tops.append(i)
        else:
            top_of[i] = top_of[p]
    ext_to_op = {e["args"].get("External id"): i for i, e in enumerate(op_nest.evs)}

    ops: dict[int, Op] = {}
    for n, i in enumerate(tops):
        e = op_nest.evs[i]
        ops[i] = _make_op(n, e, op_nest, py_nest, module_names, t0)
    unattributed = 0.0
    for k in dev:
        i = ext_to_op.get(k["args"].get("External id"))
        if i is None:
            launch = corr_launch[k["args"]["correlation"]]
            i = op_nest.innermost(launch["ts"], launch["ts"] + launch.get("dur", 0))
        if i is None:
            unattributed += k["dur"]
            continue
        op = ops[top_of[i]]
        op.device_us += k["dur"]
        op.kernels.append({"name": k["name"], "us": k["dur"], "cat": k["cat"],
                           "correlation": k["args"].get("correlation"),
                           "stream": k["args"].get("stream"), "by": op_nest.evs[i]["name"]})
    for launch in launches:
        i = op_nest.innermost(launch["ts"], launch["ts"] + launch.get("dur", 0))
        if i is not None:
            ops[top_of[i]].launches += 1

    busy = _union([(k["ts"], k["ts"] + k["dur"]) for k in dev])
    span = (max(k["ts"] + k["dur"] for k in dev) - min(k["ts"] for k in dev)) if dev else 0.0
    op_list = [ops[i] for i in tops]
    return StepAttribution(
        step=step["name"], index=step_index % len(steps), span_us=step["dur"],
        device_span_us=span, device_busy_us=busy,
        kernel_total_us=sum(k["dur"] for k in dev), unattributed_us=unattributed, ops=op_list,
        modules=_module_table(py_nest, module_names, op_list), kernel_count=len(dev),
    )


def _make_op(n, e, op_nest, py_nest, module_names, t0) -> Op:
    args = e.get("args", {})
    frames = [py_nest.evs[j] for j in py_nest.chain(py_nest.innermost(e["ts"], e["ts"] + e["dur"]))]
    path, cls, call, functions, module_calls = "", "", -1, [], []
    for f in frames:
        m = _MODULE_RE.match(f["name"])
        if m and _transparent(path, m.group(1), m.group(2), module_names):
            continue
        if m:
            path = _join(path, m.group(1), m.group(2), module_names)
            cls, call, functions = m.group(1), f["args"].get("Python id", -1), []
            module_calls.append(call)
        else:
            fm = _FUNC_RE.match(f["name"])
            if fm and fm.group(3) not in ("forward", "_call_impl", "_wrapped_call_impl"):
                functions.append([fm.group(3), f["args"].get("Python id", -1)])
    return Op(
        idx=n, name=e["name"], ts=e["ts"] - t0, cpu_us=e["dur"],
        module=path, module_class=cls, module_call=call, functions=functions,
        module_calls=module_calls, shapes=args.get("Input Dims", []),
        dtypes=args.get("Input type", []), strides=args.get("Input Strides", []),
    )


def _join(path: str, cls: str, n: str, module_names: dict[str, str] | None) -> str:
    if module_names and f"{cls}_{n}" in module_names:
        return module_names[f"{cls}_{n}"]
    return f"{path}/{cls}_{n}" if path else f"{cls}_{n}"


def _transparent(path: str, cls: str, n: str, module_names: dict[str, str] | None) -> bool:
    """A module the model does not hold, called inside one it does: its ops stay the outer
    module's. With the `kernels` package (transformers >= 5.25) `apply_rotary_pos_emb` is a
    global nn.Module ("Func") the attention calls; its ops are the attention's."""
    return bool(module_names) and bool(path) and f"{cls}_{n}" not in module_names


def _module_table(py_nest: _Nest, module_names, ops: list[Op]) -> dict[str, dict]:
    """Per module path: calls, host time of its calls, device time launched inside it."""
    table: dict[str, dict] = {}
    path_of_call: dict[int, str] = {}
    for i, f in enumerate(py_nest.evs):
        m = _MODULE_RE.match(f["name"])
        if not m:
            continue
        path, own = "", True
        for j in py_nest.chain(i):
            mm = _MODULE_RE.match(py_nest.evs[j]["name"])
            if mm:
                own = not _transparent(path, mm.group(1), mm.group(2), module_names)
                if own:
                    path = _join(path, mm.group(1), mm.group(2), module_names)
        if not own:  # the frame itself is a transparent module: no row of its own
            continue
        path_of_call[f["args"].get("Python id", -1)] = path
        row = table.setdefault(path, {"class": m.group(1), "calls": 0, "host_us": 0.0,
                                      "device_us": 0.0, "ops": 0})
        row["calls"] += 1
        row["host_us"] += f["dur"]
    for op in ops:
        for call in op.module_calls:
            row = table[path_of_call[call]]
            row["device_us"] += op.device_us
            row["ops"] += 1
    return table


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def attribute(trace: dict, module_names: dict[str, str] | None = None) -> StepAttribution:
    """Attribute every profiled step and return the median one (by host span).

    Averaging op by op across steps would blur the per-call shapes; the median step is a real
    pass, and the spread across steps is reported separately by the caller.
    """
    n = len(profiler_steps(trace))
    results = [attribute_step(trace, i, module_names) for i in range(n)]
    spans = [r.span_us for r in results]
    med = statistics.median_low(spans)
    return results[spans.index(med)]
