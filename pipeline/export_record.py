"""export.json: what `pipeline export` put in a package (`pipeline.export`), which the
package's README (`pipeline.hub_readme`) and `kernelize_package` read back. Fields in the order
the file writes them."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from core.record import Record


class ExportedClass(Record):
    """A model class a family's layer replaces (`pipeline.hub_layers.classes`)."""
    module: str
    class_name: str = Field(alias="class")
    name: str
    replaces: Any = None
    facts: Any = None
    kernel_layer_name: str | None = None  # transformers' name for its kernel layer, if any


class ExportedKernel(Record):
    """One accepted kernel in the package: its case, module and where it was kept."""
    case: dict
    module: str
    config: Any = None
    workloads: list[str] = []
    source_sha256: str | None = None
    kernel_ms: float | None = None
    speedup: float | None = None


class ExportedFamily(Record):
    layer: str
    classes: list[ExportedClass] = []
    kernels: list[ExportedKernel] = []
    skipped: dict[str, str] = {}  # case key -> why its kernel is not in the package


class ExportedWorkload(Record):
    """A workload the package's kernels were kept for, as its run measured it."""
    kept: list[str] = []
    speedup: float | None = None
    ci: list[float] | None = None
    note: str | None = None
    graphs_speedup: float | None = None


class ExportRecord(Record):
    model: str
    run: str
    device: str
    workloads: dict[str, ExportedWorkload] = {}
    families: dict[str, ExportedFamily] = {}
    not_exported: dict[str, str] = {}  # family -> why it is not in the package
    # once written
    name: str | None = None
    id: str | None = None
    variant: str | None = None
    version: int | None = None
