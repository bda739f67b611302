"""Python API: use a run's accepted kernels on a model you already loaded.

    from pipeline.api import apply_kernels
    handle = apply_kernels(model, "runs/llama-3.2-1b-...", workload="prefill-b8-s1024-bf16")
    ...                       # model now runs the accepted kernels where they were accepted
    handle.undo()             # back to the original code, exactly

On a machine without CUDA the kernels run under Triton's interpreter, turned on here as the CLI
does (`pipeline.interpreter`): import this module before any Triton kernel module.

Patches are per model instance and reversible (never class-level). For a given workload only
the kernels kept there (not rolled back by the whole-model measurement) are used, and each
call dispatches by its shape: shapes no kernel was accepted for run the original code.

Where the graphs stage shipped CUDA graphs for the workload, `graphs=True` also captures the
patched model:

    handle = apply_kernels(model, run_dir, workload="prefill-b1-s128-bf16", graphs=True)
    logits = handle(input_ids)   # [1, 128] replays the graph; any other shape runs eagerly
    handle.undo()                # frees the graph, then restores the model

    handle = apply_kernels(model, run_dir, workload="decode-b1-s1024-bf16", graphs=True)
    new_ids = handle.decoder.generate(prompt_ids, 64)   # N tokens over a static KV cache,
                                                        # each step one graph replay
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.artifacts import read_json
from core.errors import UserError
from pipeline.interpreter import use_interpreter_without_gpu

# at import, as the CLI does before anything imports a kernel: @triton.jit reads the switch
# when a kernel is defined
use_interpreter_without_gpu()

# static-cache room a decode handle's decoder has beyond the profiled cache length
DECODE_HEADROOM = 256


@dataclass
class KernelHandle:
    families: list[str]
    _undo: list[Callable[[], None]] = field(default_factory=list)
    model: object = None
    graph: object = None  # models.graphs.GraphedPrefill of the profiled prefill shape
    decoder: object = None  # models.graphs.StaticDecoder(graph=True) of a decode workload

    def __call__(self, input_ids):
        """Logits of `input_ids`: a graph replay for the profiled prefill shape (a static
        buffer, overwritten by the next replay: clone it to keep it), else the eager
        `model(input_ids)`."""
        if self.graph is not None and self.graph.matches(input_ids):
            return self.graph(input_ids)
        return self.model(input_ids).logits

    def undo(self) -> None:
        for g in (self.graph, self.decoder):
            if g is not None:
                g.close()
        self.graph = self.decoder = None
        while self._undo:
            self._undo.pop()()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def apply_kernels(model, run_dir: str | Path, workload: str | None = None,
                  graphs: bool = False, max_len: int | None = None,
                  graph_set: bool = False) -> KernelHandle:
    """Patch `model` with the run's accepted kernels (kept for `workload`, if given).

    `graphs=True` needs `workload`, and CUDA graphs shipped there (integration.json
    workloads[key]["graphs"]["shipped"]): then the patched model is captured, a prefill
    workload's graph behind `handle(input_ids)`, a decode workload's step behind
    `handle.decoder` (a static KV cache of `max_len` positions, default the profiled length
    plus DECODE_HEADROOM). Where graphs did not ship (not faster, capture failed, a CPU run)
    it raises UserError saying why, rather than silently patching kernels alone: the caller
    asked for the measured graph speed, and `graphs=False` is the explicit way to take the
    kernels without it.

    The graph holds the set the graphs stage chose for it (workloads[key]["graphs"]
    ["families"]), which may differ from the eager shipped set: families rolled back in eager
    for host time can win once the host is gone. `graph_set=True` patches that set without
    capturing anything (to capture it yourself, as benchmarks/head_to_head.py does)."""
    use_interpreter_without_gpu()  # in case the environment changed since the import
    from codegen.registry import get_family
    from pipeline.patching import make_chooser

    run_dir = Path(run_dir)
    summary = read_json(run_dir / "verification" / "summary.json", "verification summary")
    accepted = summary["accepted"]
    integ_path = run_dir / "integration.json"
    if not integ_path.exists():
        raise UserError(f"{run_dir} has no integration.json: run `pipeline optimize` first")
    integ = read_json(integ_path, "integration")
    measured = integ["workloads"]
    if workload is not None and workload not in measured:
        raise UserError(f"workload {workload!r} not measured in {run_dir}; measured: "
                        f"{', '.join(measured)}")
    if graphs:
        _graphs_shipped(measured, workload)
    if graph_set and workload is None:
        raise UserError("graph_set=True needs a workload: a graph's set is chosen per workload")
    allowed: dict[str, set[str]] = {}
    for key, w in measured.items():
        if workload is None or key == workload:
            fams = w["kept"]
            if graphs or graph_set:
                fams = (w.get("graphs") or {}).get("families", fams)
            for fam in fams:
                allowed.setdefault(fam, set()).update(w["cases"].get(fam, []))
    handle = KernelHandle(sorted(allowed), model=model)
    try:
        for name in handle.families:
            chooser = make_chooser(accepted, name, allowed[name], run_dir=run_dir)
            handle._undo.append(get_family(name).patch(model, chooser))
        if graphs:
            _capture(handle, model, measured[workload]["workload"], max_len)
    except BaseException:
        handle.undo()
        raise
    return handle


def _graphs_shipped(measured: dict, workload: str | None) -> None:
    if workload is None:
        raise UserError("graphs=True needs a workload: a graph is captured for one shape")
    rec = measured[workload].get("graphs") or {}
    if not rec.get("shipped"):
        why = rec.get("skipped") or rec.get("decision") or rec.get("error") or \
            "the run has no graphs record (optimized before the graphs stage existed)"
        raise UserError(f"CUDA graphs did not ship for {workload}: {why}; use graphs=False "
                        "for the kernels alone")


def _capture(handle: KernelHandle, model, spec: dict, max_len: int | None) -> None:
    import torch

    from models.graphs import GraphedPrefill, StaticDecoder

    device = next(model.parameters()).device
    if spec["mode"] == "decode":
        handle.decoder = StaticDecoder(model, spec["batch"],
                                       max_len or spec["seq"] + DECODE_HEADROOM, graph=True)
        return
    ids = torch.zeros((spec["batch"], spec["seq"]), dtype=torch.long, device=device)
    handle.graph = GraphedPrefill(model, ids)
