"""The README of an exported `kernels` package (`pipeline export`): the workloads and their
measured speedups, the layers and the classes they replace, the kernels per case, what was not
exported and why, and the code that kernelizes a model with it."""

from __future__ import annotations

from pipeline.export_record import ExportRecord

ROPE = "rope"  # the family whose layer needs a word on the transformers that takes it


def usage(record: ExportRecord | dict, repo: str = "OUT_DIR") -> str:
    """Python that kernelizes `model` (in scope) with the package at `repo` for inference;
    for torch.compile, the mode adds Mode.TORCH_COMPILE."""
    from pipeline.hub_layers import kernel_mapping

    record = ExportRecord.of(record)
    device = "cuda" if record.device.startswith("cuda") else "cpu"
    replaced, mapping = kernel_mapping(record)
    names = "LocalLayerRepository, Mode, kernelize, use_kernel_mapping"
    if replaced:
        names = ("(LocalLayerRepository, Mode, kernelize, replace_kernel_forward_from_hub,\n"
                 "                     use_kernel_mapping)")
    lines = ["from pathlib import Path", "", f"from kernels import {names}"]
    lines += [f"from {module} import {name}" for module, name, _ in replaced]
    lines += [""] + [f'replace_kernel_forward_from_hub({name}, "{key}")  # no kernel layer name'
                     for _, name, key in replaced]
    lines += [f"repo = Path({repo!r})", "mapping = {"]
    lines += [f'    "{key}": {{"{device}": LocalLayerRepository(repo_path=repo, '
              f'layer_name="{layer}")}},' for key, layer in mapping.items()]
    lines += ["}", "with use_kernel_mapping(mapping, inherit_mapping=False):",
              f'    model = kernelize(model, mode=Mode.INFERENCE, device="{device}")']
    return "\n".join(lines) + "\n"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}x"


def _rotary_note(record: ExportRecord) -> str:
    rope = record.families.get(ROPE)
    layer = rope.layer if rope else None
    if layer == "ApplyRotaryPosEmb":
        return (" (and a transformers that takes that `kernels` version: it then gives each "
                "attention its own rotary slot, which `rotary_pos_emb` maps)")
    if layer == "RotaryAttention":
        return (" (the transformers this was exported with gave the attentions no rotary "
                "slot, so `RotaryAttention` replaces the attention's forward: a copy of it "
                "that calls the package's rotary)")
    return ""


def readme(record: ExportRecord | dict) -> str:
    record = ExportRecord.of(record)
    name, model = record.name, record.model
    out = [f"# {name}", "",
           f"Kernels that kernel-pipeline generated, verified and kept for `{model}`, packaged "
           "for the Hugging Face `kernels` library: a Python-only (Triton) build variant, "
           f"`build/{record.variant}/`, whose `layers` take the Hugging Face modules' own "
           "arguments. A call whose exact shape and dtype no kernel was accepted for runs the "
           "module's original forward, as do calls that need autograd (the kernels compute "
           "no gradient: `has_backward = False`).", "",
           f"Run: `{record.run}`; package version {record.version}, id `{record.id}` "
           f"(its custom ops are `torch.ops.{record.id}.<family>`).", "",
           "## Workloads and measured speedups", "",
           "Whole-model speedup over the model's own code, measured by the run (interleaved "
           "pairs, median ratio, bootstrap 95 % CI) with every kernel it kept there; this "
           "package holds the kept kernels of the families listed.", "",
           "| workload | kept by the run | in this package | eager (95 % CI) | "
           "with CUDA graphs | note |", "|---|---|---|---|---|---|"]
    for key, w in record.workloads.items():
        inside = [f for f in w.kept if f in record.families]
        ci = f" [{w.ci[0]:.3f}, {w.ci[1]:.3f}]" if w.ci else ""
        out.append(f"| {key} | {', '.join(w.kept) or '-'} | {', '.join(inside) or '-'} | "
                   f"{_x(w.speedup)}{ci} | {_x(w.graphs_speedup)} | {w.note or ''} |")
    out += ["", "## Layers", "", "| layer | replaces | kernelize name | cases |",
            "|---|---|---|---|"]
    for family, spec in record.families.items():
        for cls in spec.classes:
            out.append(f"| `{spec.layer}` ({family}) | `{cls.replaces}` | "
                       f"`{cls.kernel_layer_name or cls.name}` | "
                       f"{len(spec.kernels)} |")
    out += ["", "## Kernels", "", "| family | case | config | workloads | kernel speedup |",
            "|---|---|---|---|---|"]
    for family, spec in record.families.items():
        for k in spec.kernels:
            case = ", ".join(f"{a}={b}" for a, b in k.case.items())
            config = ", ".join(f"{a}={b}" for a, b in (k.config or {}).items())
            out.append(f"| {family} | {case} | {config} | {', '.join(k.workloads)} | "
                       f"{_x(k.speedup)} |")
    if record.not_exported:
        out += ["", "## Not in this package", "",
                "Kept by the run but not exported, and why: the speedups above include their "
                "share, which a model kernelized with this package does not get "
                "(`apply_kernels` runs them).", ""]
        out += [f"- {f}: {why}" for f, why in record.not_exported.items()]
    out += ["", "## Use", "", f"With `kernels` installed{_rotary_note(record)}, on a model "
            "you built or loaded:", "",
            "```python", usage(record).rstrip(), "```", "",
            "For torch.compile, kernelize with `mode=Mode.INFERENCE | Mode.TORCH_COMPILE`, "
            "then `torch.compile(model)`: every layer declares `can_torch_compile`, and each "
            "kernel call is one custom op. `transformers.KernelConfig` names a local package "
            "as `\"/abs/path/to/OUT_DIR:Layer\"` with `use_local_kernel=True` (on the devices "
            "it supports; not the CPU).", "",
            "The verification and acceptance record of each family: `acceptance/<family>.md`;"
            " everything above, machine-readable: `export.json`.", ""]
    return "\n".join(out)
