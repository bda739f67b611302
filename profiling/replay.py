"""What-if replay of one profiler step over a dependency graph (Daydream, USENIX ATC 2020).

The graph (networkx DiGraph) holds, for one `ProfilerStep#N` span:

- ``("start",)``: the step start, time 0 of the replay;
- ``("host", k)``: the k-th host segment of the step's CPU thread, i.e. everything the thread
  did between two consecutive launches/syncs (Python, aten dispatch, other runtime calls);
  kept as a node with its traced duration so host gaps survive the replay;
- ``("launch", i)``: a runtime/driver call that enqueued device work;
- ``("sync", i)``: a blocking call (cudaDeviceSynchronize, cudaStreamSynchronize, a
  synchronous cudaMemcpy, ...). Its duration is only the part after the awaited device work
  finished (wake-up/return overhead), because the waiting itself is what the replay recomputes;
- ``("device", i)``: a kernel, memcpy or memset.

``i`` is the event's index in ``trace["traceEvents"]`` of the loaded file (see
`device_event_ids`); replacements may name device events and launches by that index
(``ids="event"``) or by ``args.correlation`` (``ids="correlation"``, the default, which is what
attribution gives per kernel).

Edges carry ``lag``: the successor starts at max over predecessors of (finish + lag). Host
nodes form one chain with lag 0. A device event has a launch edge, a stream-order edge and,
for ``cudaStreamWaitEvent``, a cross-stream edge. The edge that bound the event in the trace
(smallest observed lag) keeps the observed lag, so the unmodified graph replays the trace
(gaps where the GPU waited for the host included); the others get the typical lag of their
kind (median over events bound by that kind), so that when a what-if moves a predecessor the
event follows the new binding constraint instead of a stale gap.

Traced length of a step: from the step start to the later of the host ProfilerStep end and
the end of the step's device work (equal to the span on the fixtures, which synchronise
before `prof.step()`). `replay` reproduces it; the tests hold it to 2 %.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import networkx as nx

from profiling.trace import DEVICE_CATS, LAUNCH_CATS, indexed_events, profiler_steps

START = ("start",)
HOST_KINDS = frozenset({"start", "host", "launch", "sync"})
# Blocking calls even without a cuda_sync event (older profilers do not record those).
SYNC_CALLS = frozenset({
    "cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize",
    "cuCtxSynchronize", "cuStreamSynchronize", "cuEventSynchronize",
    "cudaMemcpy", "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol",
    "cuMemcpyDtoH_v2", "cuMemcpyHtoD_v2", "cuMemcpy",
})
WAIT_EVENT = "Stream Wait Event"


@dataclass(frozen=True)
class Replacement:
    """Device events that become one event of `new_duration_us`, placed where the first one
    was in stream order. `launches` are the launches whose host dispatch merges into one
    (the first is kept); None means the launches of the replaced device events. Name the
    kernels of one pattern occurrence: the merged event runs at the first one's place, so
    grouping kernels separated by unrelated host work would move work ahead of that work.
    `host_saving_us`: host time each launch this replacement removes also takes off the
    segment before it (None: the `apply_replacements` default), so one pattern's saving stays
    on its own launches.

    `host_saving_total_us`: instead, the host time the replacement saves in all, the launch
    calls it removes included (a measured host delta already pays for them): each removed
    launch node takes its own traced duration with it, and the rest comes off the host
    segments before the removed launches, pooled over them (each shrinks by the same fraction,
    none below zero); a negative rest adds host time to those segments evenly. A replacement
    that removes no launch changes no host time."""

    device: frozenset
    new_duration_us: float
    launches: frozenset | None = None
    host_saving_us: float | None = None
    host_saving_total_us: float | None = None


@dataclass(frozen=True)
class CriticalPath:
    nodes: list
    length_us: float
    host_us: float  # durations of host segments, launches and syncs on the path
    device_us: float  # durations of device events on the path
    gap_us: float  # lags on the path: launch latency, inter-kernel gaps

    @property
    def host_share(self) -> float:
        return self.host_us / self.length_us if self.length_us else 0.0

    @property
    def device_share(self) -> float:
        return self.device_us / self.length_us if self.length_us else 0.0


def _end(e: dict) -> float:
    return e["ts"] + e.get("dur", 0)


def _corr(e: dict):
    return e.get("args", {}).get("correlation")


def _stream(e: dict) -> tuple:
    return (e.get("pid"), e.get("args", {}).get("stream", e.get("tid")))


def device_event_ids(trace: dict) -> dict[int, int]:
    """Device events with a real duration: traceEvents index -> args.correlation."""
    return {i: _corr(e) for i, e in indexed_events(trace, *DEVICE_CATS) if e.get("dur", 0) > 0}


def kernel_table(graph: nx.DiGraph) -> list[dict]:
    """The step's device events in start order: id (traceEvents index), correlation, name,
    stream, dur_us, ts (trace µs); what attribution needs to say "these events belong to
    pattern X"."""
    rows = [
        {"id": n[1], "correlation": a["correlation"], "name": a["name"],
         "stream": a["stream"], "dur_us": a["dur"], "ts": a["ts"]}
        for n, a in graph.nodes(data=True) if a["kind"] == "device"
    ]
    return sorted(rows, key=lambda r: r["ts"])


def kernel_durations(graph: nx.DiGraph) -> dict:
    """correlation -> device time (µs) of the step's kernel it launched."""
    return {a["correlation"]: a["dur"] for _, a in graph.nodes(data=True)
            if a["kind"] == "device"}


def host_chain_us(graph: nx.DiGraph) -> float:
    """The host's traced time for the step: every host-side node (`HOST_KINDS`) summed."""
    return sum(a["dur"] for _, a in graph.nodes(data=True) if a["kind"] in HOST_KINDS)


def build_graph(trace: dict, step: int = -1) -> nx.DiGraph:
    """The dependency graph of profiler step `step`, an index into `profiler_steps` (default:
    the last, as `attribution.attribute_step`)."""
    spans = profiler_steps(trace)
    span = spans[step]
    t0, t1, thread = span["ts"], _end(span), (span["pid"], span["tid"])
    dev_by_corr: dict = defaultdict(list)
    for i, e in indexed_events(trace, *DEVICE_CATS):
        dev_by_corr[_corr(e)].append((i, e))
    # cuda_sync events sit on the device's row: pid is the device when args lack it.
    sync_args = {_corr(e): {"device": e.get("pid"), **e.get("args", {})}
                 for _, e in indexed_events(trace, "cuda_sync")}
    calls = indexed_events(trace, *LAUNCH_CATS)
    call_ts = {_corr(e): e["ts"] for _, e in calls}

    g = nx.DiGraph(step=span["name"], step_index=step % len(spans), t0=t0)
    g.add_node(START, kind="start", dur=0.0, ts=t0, name=span["name"])
    prev, prev_end, nseg = START, t0, 0
    launched: dict[int, tuple] = {}  # device event index -> (launch node, its traced finish)
    syncs, waits = [], []

    def link(node, until):  # a host segment up to `until`, then `node`, chained after `prev`
        nonlocal nseg
        seg = ("host", nseg)
        nseg += 1
        g.add_node(seg, kind="host", dur=max(0.0, until - prev_end), ts=prev_end, name="host")
        g.add_edge(prev, seg, kind="host", lag=0.0)
        if node is not None:
            g.add_edge(seg, node, kind="host", lag=0.0)

    for i, e in calls:
        if (e["pid"], e["tid"]) != thread or not t0 <= e["ts"] < t1:
            continue
        c, info = _corr(e), sync_args.get(_corr(e))
        kind = info.get("cuda_sync_kind") if info else None
        if kind == WAIT_EVENT:
            waits.append((e, info))
        devs = dev_by_corr.get(c, [])
        is_sync = e["name"] in SYNC_CALLS or (info is not None and kind != WAIT_EVENT)
        if not devs and not is_sync:
            continue  # other runtime calls are host time inside a segment
        if e["ts"] < prev_end:  # nested in the previous chain node: that node launches it
            launched.update((j, (prev, prev_end)) for j, _ in devs)
            continue
        node = None
        if devs:  # a blocking copy is split: a zero-length launch, then its wait
            node = ("launch", i)
            dur = 0.0 if is_sync else float(e["dur"])
            g.add_node(node, kind="launch", dur=dur, ts=e["ts"], name=e["name"], correlation=c)
            link(node, e["ts"])
            launched.update((j, (node, e["ts"] + dur)) for j, _ in devs)
        if is_sync:
            snode = ("sync", i)
            g.add_node(snode, kind="sync", dur=0.0, ts=e["ts"], name=e["name"], correlation=c)
            if node is None:
                link(snode, e["ts"])
            else:
                g.add_edge(node, snode, kind="host", lag=0.0)
            syncs.append((snode, e, info or {}))
            node = snode
        prev, prev_end = node, _end(e)
    link(None, t1)

    # Device work of the step: what its thread launched, plus anything else running in the
    # window (other threads, carry-over from before the step), anchored at its traced time.
    streams: dict = defaultdict(list)
    for i, e in indexed_events(trace, *DEVICE_CATS):
        if e.get("dur", 0) <= 0 or (i not in launched and not (e["ts"] < t1 and _end(e) > t0)):
            continue
        node, start = ("device", i), max(e["ts"], t0)
        lnode, lfin = launched.get(i, (None, None))
        g.add_node(node, kind="device", dur=_end(e) - start, ts=start, name=e["name"],
                   correlation=_corr(e), stream=_stream(e)[1], launch=lnode,
                   launch_ts=g.nodes[lnode]["ts"] if lnode else start)
        if lnode is None:
            g.add_edge(START, node, kind="anchor", lag=start - t0)
        streams[_stream(e)].append(node)

    # Candidate predecessors of each device event with their traced finish times.
    cands: dict = defaultdict(list)
    for nodes in streams.values():
        for a, b in itertools.pairwise(nodes):
            cands[b].append((a, g.nodes[a]["ts"] + g.nodes[a]["dur"], "stream"))
    for i, (lnode, lfin) in launched.items():
        if ("device", i) in g:
            cands[("device", i)].append((lnode, lfin, "launch"))

    def last_before(stream_key, cutoff):
        done = [n for n in streams.get(stream_key, []) if g.nodes[n]["launch_ts"] <= cutoff]
        return done[-1] if done else None

    for e, info in waits:  # device-side: the waiting stream's next event waits on the source
        src_stream = (info["device"], info.get("wait_on_stream", -1))
        cutoff = call_ts.get(info.get("wait_on_cuda_event_record_corr_id"), e["ts"])
        src = last_before(src_stream, cutoff)
        nxt = [n for n in streams.get((src_stream[0], info.get("stream")), [])
               if g.nodes[n]["launch_ts"] > e["ts"]]
        if src is not None and nxt:
            cands[nxt[0]].append((src, g.nodes[src]["ts"] + g.nodes[src]["dur"], "wait"))

    obs = {d: [(p, fin, k, g.nodes[d]["ts"] - fin) for p, fin, k in cs] for d, cs in cands.items()}
    bound = defaultdict(list)
    for cs in obs.values():
        bound[min(cs, key=lambda c: c[3])[2]].append(min(c[3] for c in cs))
    # A typical lag is a latency: never negative, even if timestamp noise says so.
    typical = {k: max(0.0, statistics.median(v)) for k, v in bound.items()}
    g.graph["typical_lag_us"] = typical
    for d, cs in obs.items():
        best = min(cs, key=lambda c: c[3])
        for c in cs:
            lag = c[3] if c is best else min(typical.get(c[2], 0.0), c[3])
            g.add_edge(c[0], d, kind=c[2], lag=max(lag, -g.nodes[c[0]]["dur"]))

    for snode, e, info in syncs:
        scope = [s for s in streams if s[0] == info.get("device")] or list(streams)
        if info.get("cuda_sync_kind") in ("Stream Sync", "Event Sync"):
            key = "stream" if info["cuda_sync_kind"] == "Stream Sync" else "wait_on_stream"
            if info.get(key, -1) not in (-1, None):
                scope = [(info["device"], info[key])]
        cutoff = call_ts.get(info.get("wait_on_cuda_event_record_corr_id"), e["ts"])
        waited = {last_before(s, cutoff) for s in scope} - {None}
        waited |= {("device", j) for j, _ in dev_by_corr.get(_corr(e), []) if ("device", j) in g}
        ready = max([e["ts"]] + [g.nodes[n]["ts"] + g.nodes[n]["dur"] for n in waited])
        g.nodes[snode]["dur"] = max(0.0, _end(e) - ready)
        for n in waited:
            g.add_edge(n, snode, kind="sync", lag=0.0)

    dev_end = max((g.nodes[n]["ts"] + g.nodes[n]["dur"] for ns in streams.values() for n in ns),
                  default=t1)
    g.graph["traced_us"] = max(t1, dev_end) - t0
    g.graph["device_by_corr"] = defaultdict(list)
    g.graph["launch_by_corr"] = defaultdict(list)
    for n, a in g.nodes(data=True):
        if a["kind"] in ("device", "launch"):
            g.graph[f"{a['kind']}_by_corr"][a["correlation"]].append(n)
    return g


def simulate(graph: nx.DiGraph) -> dict:
    """Node -> (start, finish) in µs from the step start: earliest start = max over
    predecessors of (finish + lag), i.e. the longest path through the weighted DAG."""
    times = {}
    for n in nx.topological_sort(graph):
        start = max((times[p][1] + graph.edges[p, n]["lag"] for p in graph.predecessors(n)),
                    default=0.0)
        times[n] = (start, start + graph.nodes[n]["dur"])
    return times


def replay(graph: nx.DiGraph) -> float:
    """Replayed step length in µs: end of the last event minus the step start."""
    return max(f for _, f in simulate(graph).values())


def critical_path(graph: nx.DiGraph) -> CriticalPath:
    """The chain of binding predecessors back from the last event to the step start."""
    times = simulate(graph)
    node = max(times, key=lambda n: times[n][1])
    length = times[node][1]
    path = [node]
    while preds := list(graph.predecessors(node)):
        node = max(preds, key=lambda p: times[p][1] + graph.edges[p, node]["lag"])
        path.append(node)
    path.reverse()
    host = sum(graph.nodes[n]["dur"] for n in path if graph.nodes[n]["kind"] in HOST_KINDS)
    device = sum(graph.nodes[n]["dur"] for n in path if graph.nodes[n]["kind"] == "device")
    return CriticalPath(path, length, host, device, length - host - device)


def _resolve(graph, ids_, kind, by) -> list:
    if by == "correlation":
        return [n for c in ids_ for n in graph.graph[f"{kind}_by_corr"].get(c, ())]
    if by == "event":
        return [(kind, i) for i in ids_ if (kind, i) in graph]
    raise ValueError(f"ids must be 'correlation' or 'event', not {by!r}")


def _add_edge(g, a, b, kind, lag):
    if a == b:
        return
    if g.has_edge(a, b):
        lag = max(lag, g.edges[a, b]["lag"])
    g.add_edge(a, b, kind=kind, lag=lag)


def _remove_device(g, r, keep):
    # r's stream neighbours close ranks; anything that waited on r now waits on the merged event
    stream_preds = [p for p in g.predecessors(r) if g.edges[p, r]["kind"] == "stream"]
    for s in list(g.successors(r)):
        edge = g.edges[r, s]
        if edge["kind"] == "stream":
            for p in stream_preds:
                _add_edge(g, p, s, "stream", edge["lag"])
        else:
            _add_edge(g, keep, s, edge["kind"], edge["lag"])
    g.remove_node(r)


def _remove_launch(g, lnode, keep, host_saving_us) -> float:
    host_preds = [p for p in g.predecessors(lnode) if g.edges[p, lnode]["kind"] == "host"]
    saved = g.nodes[lnode]["dur"]
    for p in host_preds:  # the dispatching op's host time, taken from the segment before it
        if g.nodes[p]["kind"] == "host" and host_saving_us:
            # negative: the replacement costs the host more than the launches it removes
            cut = min(host_saving_us, g.nodes[p]["dur"])
            g.nodes[p]["dur"] -= cut
            saved += cut
    for s in list(g.successors(lnode)):
        edge = g.edges[lnode, s]
        if edge["kind"] == "host":
            for p in host_preds:
                _add_edge(g, p, s, "host", 0.0)
        else:
            _add_edge(g, keep, s, edge["kind"], edge["lag"])
    g.remove_node(lnode)
    return saved


def _remove_launches_pooled(g, removed: list, kept, total_us: float) -> float:
    """Remove the `removed` launch nodes, which together save `total_us` of host time, their
    own durations included: the rest is taken off (or, negative, added to) the host segments
    before them, in proportion to their lengths. Returns the host time removed."""
    if not removed:
        return 0.0
    segs = [p for n in removed for p in g.predecessors(n)
            if g.edges[p, n]["kind"] == "host" and g.nodes[p]["kind"] == "host"]
    calls = sum(g.nodes[n]["dur"] for n in removed)
    rest = total_us - calls
    if rest > 0:
        room = sum(g.nodes[p]["dur"] for p in segs)
        frac = min(1.0, rest / room) if room > 0 else 0.0
        cuts = {p: g.nodes[p]["dur"] * frac for p in segs}
    else:
        cuts = {p: rest / len(segs) for p in segs} if segs else {}
    for p, cut in cuts.items():
        g.nodes[p]["dur"] -= cut
    for n in removed:
        _remove_launch(g, n, kept, 0.0)
    return calls + sum(cuts.values())


def apply_replacements(graph: nx.DiGraph, replacements: Iterable, *, host_saving_us: float = 0.0,
                       ids: str = "correlation") -> nx.DiGraph:
    """A copy of `graph` with each replacement applied (see `Replacement`; a plain tuple
    (device ids, new_duration_us[, launch ids]) works too). Ids not in this step are ignored,
    since attribution may list the kernels of every step, but each replacement must name at
    least one device event of the step. Each removed launch also removes up to
    `host_saving_us` of host time from the segment before it (adds it, when negative)."""
    g = graph.copy()
    g.graph = {**graph.graph, "host_removed_us": 0.0}
    touched: set = set()
    for rep in replacements:
        rep = rep if isinstance(rep, Replacement) else Replacement(*rep)
        # Ids resolve on the unmodified graph, so an event named twice is caught as an overlap.
        devs = sorted(set(_resolve(graph, rep.device, "device", ids)),
                      key=lambda n: graph.nodes[n]["ts"])
        if not devs:
            raise ValueError(f"no device event of step {g.graph['step']} in {set(rep.device)}")
        if touched & set(devs):
            raise ValueError("replacements overlap: a device event is in two of them")
        touched |= set(devs)
        if rep.launches is None:
            launches = {g.nodes[d]["launch"] for d in devs} - {None}
        else:
            launches = set(_resolve(graph, rep.launches, "launch", ids))
        keep = devs[0]
        g.nodes[keep]["dur"] = float(rep.new_duration_us)
        for r in devs[1:]:
            _remove_device(g, r, keep)
        launches = sorted((n for n in launches if n in g and g.nodes[n]["kind"] == "launch"),
                          key=lambda n: g.nodes[n]["ts"])
        if launches:
            first = g.nodes[keep]["launch"]
            kept = first if first in launches else launches[0]
            removed = [n for n in launches if n != kept]
            if rep.host_saving_total_us is not None:
                g.graph["host_removed_us"] += _remove_launches_pooled(
                    g, removed, kept, rep.host_saving_total_us)
            else:
                for lnode in removed:
                    g.graph["host_removed_us"] += _remove_launch(
                        g, lnode, kept, host_saving_us if rep.host_saving_us is None
                        else rep.host_saving_us)
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("the replacements create a dependency cycle")
    return g


def what_if(graph: nx.DiGraph, replacements: Sequence, *, host_saving_us: float = 0.0,
            ids: str = "correlation") -> float:
    """Replayed step length in µs after applying `replacements` (see `apply_replacements`)."""
    return replay(apply_replacements(graph, replacements, host_saving_us=host_saving_us, ids=ids))


def scale_host(graph: nx.DiGraph, factor: float) -> nx.DiGraph:
    """A copy with every host segment, launch and sync shortened by `factor`."""
    g = graph.copy()
    g.graph = dict(graph.graph)
    for _, a in g.nodes(data=True):
        if a["kind"] in HOST_KINDS:
            a["dur"] = a["dur"] * factor
    return g


def calibrate_host(graph: nx.DiGraph, target_us: float) -> tuple[nx.DiGraph, float]:
    """Scale host time so the replay matches an unprofiled wall time.

    with_stack profiling slows the host (a device-bound prefill replays longer than its wall,
    with host work on most of its critical path), which would make a device-bound pass look
    host-bound; the unprofiled wall time tells how fast the host really is. Device events
    keep their traced durations. Returns (graph, factor); factor 1 when the trace is already
    no longer than the target.
    """
    if replay(graph) <= target_us:
        return graph, 1.0
    lo, hi = 0.0, 1.0
    for _ in range(20):
        mid = (lo + hi) / 2
        if replay(scale_host(graph, mid)) > target_us:
            hi = mid
        else:
            lo = mid
    return scale_host(graph, hi), hi


# Edges between two device events that a CUDA graph keeps: stream order and cross-stream waits.
GRAPH_EDGES = frozenset({"stream", "wait"})


def graphed(graph: nx.DiGraph, node_us: float, launch_us: float) -> float:
    """The step's length in µs if it were replayed as one CUDA graph.

    The device work keeps its stream order and cross-stream waits; every host node, launch and
    sync leaves, and with them every lag the host imposed (a graph's nodes start when their
    dependencies finish). Each device event costs `node_us` more, the graph's own per-node
    overhead, and the pass once `launch_us`, the graph launch; both are measured
    (`roofline.measure_ceilings`)."""
    dev = nx.DiGraph()
    for n, a in graph.nodes(data=True):
        if a["kind"] == "device":
            dev.add_node(n, dur=max(0.0, a["dur"] + node_us))  # the node cost can be < 0
    for a, b, e in graph.edges(data=True):
        if a in dev and b in dev and e["kind"] in GRAPH_EDGES:
            dev.add_edge(a, b)
    finish: dict = {}
    for n in nx.topological_sort(dev):
        start = max((finish[p] for p in dev.predecessors(n)), default=0.0)
        finish[n] = start + dev.nodes[n]["dur"]
    return launch_us + max(finish.values(), default=0.0)


def graphed_with(graph: nx.DiGraph, replacements: Iterable, node_us: float, launch_us: float,
                 *, ids: str = "correlation") -> float:
    """"Kernels + graph": `replacements` applied first (`apply_replacements`; host savings
    do not matter, the host leaves anyway), then the step replayed as one CUDA graph."""
    return graphed(apply_replacements(graph, replacements, ids=ids), node_us, launch_us)


def device_busy_us(graph: nx.DiGraph) -> float:
    """Union of the device events' intervals in the traced step: the GPU's busy time."""
    spans = sorted((a["ts"], a["ts"] + a["dur"]) for _, a in graph.nodes(data=True)
                   if a["kind"] == "device")
    busy, end = 0.0, float("-inf")
    for s, f in spans:
        if f > end:
            busy += f - max(s, end)
            end = f
    return busy
