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


@dataclass
class KernelHandle:
    families: list[str]
    _undo: list[Callable[[], None]] = field(default_factory=list)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def apply_kernels(model, run_dir: str | Path, workload: str | None = None) -> KernelHandle:
    """Patch `model` with the run's accepted kernels (kept for `workload`, if given)."""
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
    allowed: dict[str, set[str]] = {}
    for key, w in measured.items():
        if workload is None or key == workload:
            for fam in w["kept"]:
                allowed.setdefault(fam, set()).update(w["cases"].get(fam, []))
    handle = KernelHandle(sorted(allowed))
    try:
        for name in handle.families:
            chooser = make_chooser(accepted, name, allowed[name], run_dir=run_dir)
            handle._undo.append(get_family(name).patch(model, chooser))
    except BaseException:
        handle.undo()
        raise
    return handle
