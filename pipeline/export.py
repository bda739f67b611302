"""`pipeline export RUN_DIR OUT_DIR`: a run's accepted kernels as a package the Hugging Face
`kernels` library loads from a local path (`LocalLayerRepository`, `kernelize`), laid out as
its kernel requirements describe for a Python-only (Triton) kernel:

    OUT_DIR/README.md, export.json, acceptance/<family>.md   what was accepted, where, how fast
    OUT_DIR/build/torch-cuda/        the noarch build variant (torch-cpu for a CPU run)
        __init__.py                  `from . import layers`, __all__ = ["layers"]
        layers.py                    pure layers taking the Hugging Face modules' arguments
        _runtime.py, _ops.py         dispatch by exact case; the kernels as custom ops
        _launch.py                   the launcher the kernels call (codegen/launch.py)
        _globals.py                  a forward copied to read one global as another value
                                     (models/global_copy.py: RotaryAttention's rotary)
        _kernels/<family>_<i>.py     each accepted kernel's source, specialised to its case
        kernels.json                 per family: cases, configs, workloads, speedups, classes
        metadata.json                name, id (the ops' namespace), version, license,
                                     backend, digest of the files above
        <name>/__init__.py           the same symbols, where kernels before 0.11 look

Only the kernels kept for the workloads (`--workload`, default all of the run's) go in, and
only families with a `kernels` layer for the model's classes (`pipeline.hub_layers`); the
others are listed with why, in export.json, the README and the command's output.
Inside a layer a call whose exact case no kernel was accepted for runs the original forward.
The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import json
import re
import shutil
import tempfile
from collections import defaultdict
from pathlib import Path

from codegen.search import case_key
from core.artifacts import load, read_json, write_json, write_text
from core.errors import UserError
from core.records import (
    Accepted,
    Graphs,
    IntegratedWorkload,
    Integration,
    Profile,
    Ratio,
    Timing,
    VerificationSummary,
)
from pipeline.export_record import ExportedFamily, ExportedKernel, ExportedWorkload, ExportRecord
from pipeline.rundir import relocate

PACKAGE_FILES = Path(__file__).with_name("hub_package")
LICENSE = "Apache-2.0"
VERSION = 1
PROJECT = {"codegen", "core", "models", "profiling", "verify", "pipeline"}
_LAUNCH_IMPORT = re.compile(r"^from codegen\.launch import ", re.MULTILINE)
_NAMESPACE_LINE = 'NAMESPACE = "kernel_pipeline"'
OPS = "_ops.py"  # the custom ops' module, its namespace named per package


def export(run_dir: str | Path, out_dir: str | Path, workload: str | None = None) -> dict:
    """Write the package; returns what export.json records."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UserError(f"{out_dir} exists and is not an empty folder; name a new one")
    profile = load(run_dir / "profile.json", Profile, "profile")
    if not (run_dir / "integration.json").exists():
        raise UserError(f"{run_dir} has no integration.json: run `pipeline optimize` first")
    measured = load(run_dir / "integration.json", Integration, "integration").workloads
    if workload is not None and workload not in measured:
        raise UserError(f"workload {workload!r} not measured in {run_dir}; measured: "
                        f"{', '.join(measured)}")
    keys = [workload] if workload else list(measured)
    accepted = load(run_dir / "verification" / "summary.json", VerificationSummary,
                    "verification summary").accepted
    label = measured[keys[0]].workload
    record = ExportRecord(model=profile.model.id, run=str(run_dir.resolve()),
                          device=label.device, workloads={k: _workload(measured[k])
                                                          for k in keys},
                          families={}, not_exported={})
    model = _meta_model(profile, label.dtype)
    sources: dict[str, str] = {}
    for family, cases in sorted(_kept_cases(measured, keys).items()):
        _family(family, cases, accepted, run_dir, model, record, sources)
    if not record.families:
        raise UserError(f"nothing to export from {run_dir}: "
                        + "; ".join(f"{f}: {why}" for f, why in record.not_exported.items())
                        if record.not_exported else "no kernel was kept")
    _write_atomically(out_dir, lambda tmp: _write(tmp, run_dir, record, sources))
    return record


def _kept_cases(measured: dict[str, IntegratedWorkload], keys: list[str]
                ) -> dict[str, dict[str, list[str]]]:
    """family -> case key -> the workloads (of `keys`) it was kept for."""
    out: dict[str, dict[str, list[str]]] = defaultdict(dict)
    for key in keys:
        w = measured[key]
        for family in w.kept or []:
            for ck in w.cases.get(family, []):
                out[family].setdefault(ck, []).append(key)
    return dict(out)


def _workload(w: IntegratedWorkload) -> ExportedWorkload:
    combined = w.combined or Ratio()
    meaningful = bool(combined.meaningful) and bool(combined.estimate)
    graphs = w.graphs or Graphs()
    return ExportedWorkload(
        kept=list(w.kept or []), speedup=1 / combined.estimate if meaningful else None,
        ci=[1 / combined.ci_high, 1 / combined.ci_low]
        if meaningful and combined.ci_low and combined.ci_high else None,
        note=None if meaningful else combined.reason or "not measured",
        graphs_speedup=graphs.measured_speedup if graphs.shipped else None)


def _meta_model(profile: Profile, dtype: str):
    """The run's model with no weights (the meta device): what the layers' classes are."""
    import torch

    from profiling.loader import build, resolve

    return build(resolve(profile.model.id), getattr(torch, dtype), "meta")


def _family(family: str, cases: dict, accepted: dict[str, Accepted], run_dir: Path, model,
            record: ExportRecord, sources: dict) -> None:
    from pipeline.hub_layers import classes

    layer, found, why = classes(model, family)
    if why:
        record.not_exported[family] = why
        return
    by_case = {case_key(a.case): a for a in accepted.values() if a.family == family}
    kernels, skipped = [], {}
    for ck, workloads in sorted(cases.items()):
        acc = by_case.get(ck)
        text, why = _source(acc, run_dir) if acc else (None, "no accepted kernel on record")
        if why:
            skipped[ck] = why
            continue
        module = f"{family}_{len(kernels)}"
        sources[module] = text
        timing = acc.kernel or Timing()
        kernels.append(ExportedKernel(
            case=acc.case, module=module, config=acc.config, workloads=workloads,
            source_sha256=acc.source_sha256, kernel_ms=timing.median_ms,
            speedup=acc.speedup if timing.meaningful else None))
    if not kernels:
        record.not_exported[family] = "; ".join(f"{k}: {v}" for k, v in skipped.items())
        return
    record.families[family] = ExportedFamily(layer=layer, classes=found, kernels=kernels,
                                             skipped=skipped)


def _source(acc: Accepted, run_dir: Path) -> tuple[str | None, str | None]:
    """The kernel's source with its launcher imported from the package, or why not."""
    path = relocate(acc.source, run_dir)
    if not Path(path).is_file():
        return None, f"source not found: {path}"
    text = _LAUNCH_IMPORT.sub("from .._launch import ", Path(path).read_text())
    for node in ast.walk(ast.parse(text)):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and \
            node.module else []
        if any(n.split(".")[0] in PROJECT for n in names):
            return None, f"imports {names[0]} (a CUDA C++ kernel builds through the project)"
    return text, None


def _write_atomically(out_dir: Path, fill) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}."))
    try:
        fill(tmp)
        if out_dir.exists():
            out_dir.rmdir()  # empty, checked above
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def package_name(model_id: str) -> str:
    """A `kernels` kernel name (`^[a-z][-a-z0-9]*[a-z0-9]$`) for the model's package."""
    slug = re.sub(r"[^a-z0-9]+", "-", model_id.lower().rsplit("/", 1)[-1]).strip("-")
    return f"{slug if slug[:1].isalpha() else 'm-' + slug}-kernels"


def _write(root: Path, run_dir: Path, record: ExportRecord, sources: dict) -> None:
    from pipeline.hub_readme import readme

    name = package_name(record.model)
    python_name = name.replace("-", "_")
    cuda = record.device.startswith("cuda")
    variant = root / "build" / ("torch-cuda" if cuda else "torch-cpu")
    files = {"__init__.py": f'"""{name}: kernel-pipeline\'s accepted kernels for '
                            f'{record.model} (README.md beside build/)."""\n\n'
                            "from . import layers\n\n__all__ = [\"layers\"]\n",
             "layers.py": (PACKAGE_FILES / "layers.py").read_text(),
             "_runtime.py": (PACKAGE_FILES / "runtime.py").read_text(),
             "_launch.py": (Path(__file__).parents[1] / "codegen" / "launch.py").read_text(),
             "_globals.py": (Path(__file__).parents[1] / "models" / "global_copy.py").read_text(),
             "_kernels/__init__.py": '"""The accepted kernels, one module per case."""\n',
             f"{python_name}/__init__.py": (PACKAGE_FILES / "compat.py").read_text(),
             "kernels.json": json.dumps({"schema_version": 1, "model": record.model,
                                         "families": {f: spec.to_dict() for f, spec in
                                                      record.families.items()}},
                                        indent=1) + "\n",
             **{f"_kernels/{m}.py": text for m, text in sources.items()}}
    ops = (Path(__file__).parents[1] / "codegen" / "ops.py").read_text()
    if _NAMESPACE_LINE not in ops:
        raise RuntimeError("codegen/ops.py no longer names its namespace as export expects")
    digest = _digest(files)
    op_namespace = f"_{python_name}_{_short(digest)}"
    files[OPS] = ops.replace(_NAMESPACE_LINE, f'NAMESPACE = "{op_namespace}"')
    digest[OPS] = _b64sha(files[OPS])
    for rel, text in files.items():
        write_text(variant / rel, text)
    metadata = {"name": name, "id": op_namespace, "version": VERSION, "license": LICENSE,
                "python-depends": [],
                "backend": {"type": "cuda" if cuda else "cpu"},
                "digest": {"algorithm": "sha256", "files": dict(sorted(digest.items()))}}
    write_text(variant / "metadata.json", json.dumps(metadata, indent=1) + "\n")
    record.update(name=name, id=op_namespace, variant=variant.name, version=VERSION)
    for family in record.families:
        src = run_dir / "acceptance" / f"{family}.md"
        if src.exists():
            write_text(root / "acceptance" / f"{family}.md", src.read_text())
    write_json(root / "export.json", record)
    write_text(root / "README.md", readme(record))


def _b64sha(text: str) -> str:
    return base64.b64encode(hashlib.sha256(text.encode()).digest()).decode()


def _digest(files: dict[str, str]) -> dict[str, str]:
    """`kernels`' digest of a variant: base64 SHA-256 per file, by path (metadata.json aside)."""
    return {rel: _b64sha(text) for rel, text in files.items()}


def _short(digest: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(digest, sort_keys=True).encode()).hexdigest()[:7]


def kernelize_package(model, out_dir: str | Path, compiled: bool = False):
    """`model` kernelized with the package at `out_dir`, as its README's "Use" block does
    (`kernels` installed): for torch.compile too where `compiled`."""
    import importlib

    from kernels import (
        LocalLayerRepository,
        Mode,
        kernelize,
        replace_kernel_forward_from_hub,
        use_kernel_mapping,
    )

    from pipeline.hub_layers import kernel_mapping

    out_dir = Path(out_dir)
    record = ExportRecord.of(read_json(out_dir / "export.json", "export record"))
    device = "cuda" if record.device.startswith("cuda") else "cpu"
    replaced, mapping = kernel_mapping(record)
    for module, name, key in replaced:
        replace_kernel_forward_from_hub(getattr(importlib.import_module(module), name), key)
    repos = {key: {device: LocalLayerRepository(repo_path=out_dir, layer_name=layer)}
             for key, layer in mapping.items()}
    mode = Mode.INFERENCE | Mode.TORCH_COMPILE if compiled else Mode.INFERENCE
    with use_kernel_mapping(repos, inherit_mapping=False):
        return kernelize(model, mode=mode, device=device)
