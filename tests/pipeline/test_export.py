"""`pipeline export` on the README's main run (tiny-llama b2 s64, `optimize --top 3`), loaded
back through the `kernels` library from the local path: a fresh tiny Llama kernelized with it
computes apply_kernels' logits with the same kernel calls, eagerly and under
torch.compile(fullgraph=True), and shapes no kernel was accepted for run the original code.

One optimized run and one export (module scope, ~2 min on 2 cores) are shared; the tests run
in one xdist group so that a second worker does not build them again.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from core.artifacts import read_json
from core.errors import UserError
from tests.pipeline.cli_runs import run_cli

pytestmark = [pytest.mark.xdist_group("export"), pytest.mark.skipif(
    torch.cuda.is_available(), reason="a CPU run's package is a torch-cpu build, which kernels "
    "does not load under a CUDA torch; benchmarks/gpu_export.sh exports a GPU run")]

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = "prefill-b2-s64-fp32"
FP32 = {"atol": 1e-5, "rtol": 1e-5}  # verify's float32 tolerances, the families' here


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The README's main run (fewer timing pairs: timings are not what is checked here), then
    `pipeline export RUN OUT`."""
    home = tmp_path_factory.mktemp("export")
    run, out = home / "run", home / "pkg"
    for args in (("profile", "tiny-llama", "--batch", "2", "--seq", "64", "--device", "cpu",
                  "--run-dir", str(run)),
                 ("optimize", str(run), "--top", "3", "--pairs", "2"),
                 ("export", str(run), str(out))):
        proc = run_cli(*args, home=home)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return home, run, out, proc


@pytest.fixture(scope="module")
def package(exported):
    """The package as `kernels` loads it, each kernel's forward counting its calls."""
    _, _, out, _ = exported
    return counting(out)


def counting(out: Path):
    """(the package at `out` as `kernels` loads it, {family: kernel calls}): each kernel's
    forward counts its calls."""
    from kernels import get_local_kernel

    module = get_local_kernel(out)
    spec = module._runtime.SPEC
    calls = {family: 0 for family in spec["families"]}
    for family, fam in spec["families"].items():
        for k in fam["kernels"]:
            kernel = importlib.import_module(f"{module.__name__}._kernels.{k['module']}")

            def counted(*args, _f=kernel.forward, _family=family, **kwargs):
                calls[_family] += 1
                return _f(*args, **kwargs)
            kernel.forward = counted
    return module, calls


def tiny_llama():
    from profiling.loader import build, resolve

    return build(resolve("tiny-llama"), torch.float32, "cpu")


def kernelized(record: dict, out: Path):
    from pipeline.hub_readme import usage

    scope = {"model": tiny_llama()}
    exec(usage(record, str(out)), scope)  # the package README's own "Use" block
    return scope["model"]


def ids(seq: int = 64) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seq))


@pytest.fixture(scope="module")
def applied(exported):
    """apply_kernels' logits on the workload's shape, and its kernel calls."""
    from pipeline.api import apply_kernels

    _, run, _, _ = exported
    model = tiny_llama()
    handle = apply_kernels(model, run, workload=WORKLOAD)
    with torch.no_grad():
        logits = model(ids()).logits
    handle.undo()
    return logits, dict(handle.calls)


def test_the_package_is_laid_out_as_kernels_loads_it(exported, package):
    from kernels._rust import Digest, DigestAlgorithm, Metadata

    _, run, out, proc = exported
    module, _ = package
    variant = out / "build" / "torch-cpu"
    metadata = Metadata.read_from_file(variant / "metadata.json")
    assert str(metadata.name) == "tiny-llama-kernels" and metadata.version == 1
    metadata.digest.validate(Digest.hash_variant(DigestAlgorithm.SHA256, variant))
    assert module.__name__ == metadata.id and module.__all__ == ["layers"]
    for layer in ("RMSNorm", "ApplyRotaryPosEmb", "GatedMLP"):
        cls = getattr(module.layers, layer)
        assert cls.can_torch_compile and not cls.has_backward
    record = read_json(out / "export.json")
    kept = read_json(run / "integration.json")["workloads"][WORKLOAD]["kept"]
    assert sorted(record["families"]) == sorted(kept) and not record["not_exported"]
    readme = (out / "README.md").read_text()
    assert WORKLOAD in readme and "LocalLayerRepository" in readme
    assert sorted(p.name for p in (out / "acceptance").iterdir()) == sorted(
        f"{f}.md" for f in kept)
    assert "tiny-llama-kernels" in proc.stdout


def counted_call(model, calls: dict, seq: int = 64) -> tuple[torch.Tensor, dict]:
    """(logits of one call at batch 2 x seq, each family's kernel calls in it)."""
    before = dict(calls)
    with torch.no_grad():
        logits = model(ids(seq)).logits
    return logits, {f: calls[f] - before[f] for f in calls}


def test_a_kernelized_fresh_model_computes_apply_kernels_logits(exported, package, applied):
    _, _, out, _ = exported
    want, want_calls = applied
    got, got_calls = counted_call(kernelized(read_json(out / "export.json"), out), package[1])
    assert got_calls == want_calls
    torch.testing.assert_close(got, want, **FP32)


def test_shapes_no_kernel_was_accepted_for_run_the_original_code(exported, package):
    _, _, out, _ = exported
    got, got_calls = counted_call(kernelized(read_json(out / "export.json"), out), package[1],
                                  seq=32)
    assert not any(got_calls.values())
    with torch.no_grad():
        assert torch.equal(got, tiny_llama()(ids(32)).logits)


def test_the_kernelized_model_compiles_whole(exported, package, applied):
    from pipeline.export import kernelize_package

    _, _, out, _ = exported
    want, want_calls = applied
    model = kernelize_package(tiny_llama(), out, compiled=True)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    got, got_calls = counted_call(compiled, package[1])
    assert got_calls == want_calls
    torch.testing.assert_close(got, want, **FP32)


def test_the_main_run_compiles_whole_through_apply_kernels(exported, applied):
    """compiled=True: the kernels and the attention (one opaque op, `codegen.sdpa_op`) in one
    graph, apply_kernels' eager logits exactly; undone, the config is as it was. The eager
    handle (compiled=False) leaves the attention alone."""
    from torch._dynamo.testing import EagerAndRecordGraphs

    from codegen.sdpa_op import NAME
    from pipeline.api import apply_kernels

    _, run, _, _ = exported
    want, want_calls = applied
    model = tiny_llama()
    config = dict(vars(model.config))
    with apply_kernels(model, run, workload=WORKLOAD) as handle:
        assert model.config._attn_implementation == "sdpa" and not handle.notes
    handle = apply_kernels(model, run, workload=WORKLOAD, compiled=True)
    assert handle.families == sorted(want_calls) and not handle.left_out
    assert model.config._attn_implementation == NAME
    assert [n.split(" (")[0] for n in handle.notes] == ["attention: transformers' SDPA as one "
                                                         "opaque op"]
    torch._dynamo.reset()
    backend = EagerAndRecordGraphs()
    with torch.no_grad():
        got = torch.compile(model, fullgraph=True, backend=backend)(ids()).logits
    targets = [n.target for n in backend.graphs[0].graph.nodes]
    assert targets.count(torch.ops.kernel_pipeline.sdpa_attention.default) == \
        model.config.num_hidden_layers
    assert handle.calls == want_calls
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    handle.undo()
    assert vars(model.config) == config


def test_compiled_users_are_not_offered_an_untraceable_family(exported, monkeypatch):
    from codegen.registry import get_family
    from pipeline.api import apply_kernels

    _, run, _, _ = exported
    monkeypatch.setattr(get_family("rope"), "traceable", False)
    model = tiny_llama()
    handle = apply_kernels(model, run, workload=WORKLOAD, compiled=True)
    assert "rope" not in handle.families and list(handle.left_out) == ["rope"]
    handle.undo()
    with pytest.raises(UserError, match="compiled=True alone"):
        apply_kernels(model, run, workload=WORKLOAD, compiled=True, graphs=True)


def test_the_compatibility_folder_exports_the_same_layers(exported):
    _, _, out, _ = exported
    init = out / "build" / "torch-cpu" / "tiny_llama_kernels" / "__init__.py"
    spec = importlib.util.spec_from_file_location("old_kernels_view", init)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_kernels_view"] = module
    spec.loader.exec_module(module)
    assert module.__all__ == ["layers"] and module.layers.RMSNorm.__name__ == "RMSNorm"


def test_one_workload_and_bad_input(exported, tmp_path):
    from pipeline.export import export

    home, run, out, _ = exported
    record = export(run, tmp_path / "one", workload=WORKLOAD)
    assert list(record["workloads"]) == [WORKLOAD]
    kernels = json.loads((tmp_path / "one" / "build" / "torch-cpu" / "kernels.json").read_text())
    assert sorted(kernels["families"]) == sorted(record["families"])
    proc = run_cli("export", str(run), str(out), home=home)  # exists, not empty
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "not an empty" in proc.stderr
    with pytest.raises(UserError, match="not measured"):
        export(run, tmp_path / "two", workload="decode-b1-s8-fp32")
    assert not (tmp_path / "two").exists() and not list(tmp_path.glob(".two.*"))


def readme_blocks() -> tuple[str, str]:
    """The compile block and the `kernels` block of README.md's "Three ways in", as written."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Three ways in"):].split("\n## ", 1)[0]
    blocks = [b.split("```", 1)[0] for b in section.split("```python\n")[1:]]
    assert len(blocks) == 2
    return tuple("\n".join(line.removeprefix("   ") for line in b.splitlines()) for b in blocks)


def test_the_readme_blocks_run_as_a_user_runs_them(exported):
    """Both blocks in a fresh interpreter, the run and the package at their test paths; the
    compile block on the eager backend (Inductor's C++ build is benchmarks' cost, not CI's)."""
    home, run, out, _ = exported
    compile_block, kernels_block = readme_blocks()
    assert "latest_run()" in compile_block and 'Path("tiny-llama-kernels")' in kernels_block
    code = (compile_block.replace("latest_run()", repr(str(run)))
            .replace("fullgraph=True)", 'fullgraph=True, backend="eager")')
            + "\n" + kernels_block.replace('"tiny-llama-kernels"', repr(str(out))))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=home, timeout=600,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(home),
             "PYTHONPATH": os.pathsep.join(
                 [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled, kernelized = proc.stdout.strip().splitlines()[-2:]
    assert compiled.startswith("['matmul_epilogue', 'rmsnorm', 'rope'] {} torch.Size([2, 64,")
    assert "'rmsnorm': 5" in compiled  # the compiled call ran the kernels
    assert kernelized.startswith("torch.Size([2, 64,")


def test_integration_and_the_report_name_what_compiles(exported):
    from codegen.registry import get_family
    from pipeline.hub_layers import HUB_LAYERS

    _, run, _, _ = exported
    record = read_json(run / "integration.json")["workloads"][WORKLOAD]["compiled"]
    assert record == {"families": ["matmul_epilogue", "rmsnorm", "rope"], "left_out": {}}
    assert "Under torch.compile (`apply_kernels(..., compiled=True)`" in (
        run / "report.md").read_text()
    assert all(get_family(f).traceable for f in HUB_LAYERS)  # the layers all compile


FUSED = ("rmsnorm", "rope", "matmul_epilogue", "add_rmsnorm")  # what Llama-3.2-1B b8 kept,
# kv_cache aside


@pytest.fixture(scope="module")
def fused_run(exported):
    """A run that kept add_rmsnorm beside the main run's families (`--families`): a copy of
    the main run resumed with them, so that only add_rmsnorm is searched and verified (the
    main run's three families are kept as they were) before the four are integrated."""
    home, main, _, _ = exported
    run = home / "fused"
    shutil.copytree(main, run)
    proc = run_cli("optimize", str(run), "--resume", "--families", ",".join(FUSED), "--pairs",
                   "2", home=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(read_json(run / "integration.json")["workloads"][WORKLOAD]["kept"]) == sorted(
        FUSED)
    return run


@pytest.mark.parametrize("slot", [True, False], ids=["rotary-slot", "no-rotary-slot"])
def test_every_family_of_a_fused_run_exports_and_runs_as_apply_kernels(fused_run, slot,
                                                                      tmp_path, monkeypatch):
    """add_rmsnorm as the decoder layer's forward; rope through transformers' rotary slot, or,
    where transformers gives none (transformers 5.17 beside kernels 0.19), as the attention's
    own forward calling the package's rotary. Kernelized, eager and compiled whole: the kernels
    apply_kernels runs, as often, and its logits."""
    from pipeline.api import apply_kernels
    from pipeline.export import export, kernelize_package

    if not slot:
        rope = importlib.import_module("codegen.rope.patch")  # the package names its function
        monkeypatch.setattr(rope, "rotary_slot", lambda *_: None)
    record = export(fused_run, tmp_path / "pkg")
    assert {f: spec["layer"] for f, spec in record["families"].items()} == {
        "rmsnorm": "RMSNorm", "rope": "ApplyRotaryPosEmb" if slot else "RotaryAttention",
        "matmul_epilogue": "GatedMLP", "add_rmsnorm": "PreNormDecoderLayer"}
    assert not record["not_exported"]
    _, calls = counting(tmp_path / "pkg")
    model = tiny_llama()
    handle = apply_kernels(model, fused_run, workload=WORKLOAD)
    with torch.no_grad():
        want = model(ids()).logits
    handle.undo()
    assert all(handle.calls[f] for f in FUSED), handle.calls
    got, got_calls = counted_call(kernelize_package(tiny_llama(), tmp_path / "pkg"), calls)
    assert got_calls == handle.calls
    torch.testing.assert_close(got, want, **FP32)
    torch._dynamo.reset()
    compiled = torch.compile(kernelize_package(tiny_llama(), tmp_path / "pkg", compiled=True),
                             fullgraph=True, backend="eager")
    got, got_calls = counted_call(compiled, calls)
    assert got_calls == handle.calls
    torch.testing.assert_close(got, want, **FP32)


def test_a_family_without_a_layer_says_why():
    from pipeline.hub_layers import classes

    model = tiny_llama()
    layer, found, why = classes(model, "kv_cache")
    assert layer is None and not found and "Cache.update" in why
    assert classes(model, "rmsnorm")[0] == "RMSNorm"
