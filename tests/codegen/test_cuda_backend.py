"""CUDA C++ variants (rmsnorm, gated_act) and the --backend choice.

CPU: the rendered candidates of a case share one CUDA source byte for byte and differ only in
the instantiation they call; sizes and the launch config are constants in the source; the build
cache; backend selection in search, generate and the CLI (which falls back to Triton on a CPU).
GPU (-m gpu): every case compiles (all builds in parallel first), matches the reference on
fp32/fp16/bf16 including edge rows, unaligned views and int64 offsets, passes the verifier, and
runs through the search's worker beside Triton.
"""

from __future__ import annotations

import ast
import difflib
import re
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest
import torch

from codegen import cuda_build
from codegen import search as search_mod
from codegen.gated_act import FAMILY as GATED
from codegen.rmsnorm import FAMILY as RMSNORM
from codegen.search import backend_configs, config_key, render
from core.errors import UserError
from core.family import CudaVariant, Family

REPO = Path(__file__).resolve().parents[2]
FORMS = RMSNORM.extras["forms"]


def rms_case(rows, hidden, dtype, form, eps=1e-6):
    return {"rows": rows, "hidden": hidden, "dtype": dtype, "eps": eps, **FORMS[form]}


def act_case(rows, cols, dtype, act, layout):
    return {"rows": rows, "cols": cols, "dtype": dtype, "act": act, "layout": layout}


def cuda_space(family, case):
    return [{**c, "backend": "cuda"} for c in family.cuda.search_space(case)]


def constants(source: str) -> dict:
    """The module-level constants of a rendered candidate file, read without importing it
    (importing compiles)."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


# Lines of a candidate that name its config; everything else is shared by the case.
CONFIG_LINE = re.compile(r"^(Launch:|vectors |\d+ values |\(element|This file calls|config: |"
                         r"(THREADS_PER_ROW|ROWS_PER_BLOCK|THREADS|VEC|ITEMS|KERNEL) = )")

CPU_CASES = [
    (RMSNORM, rms_case(8192, 2048, "bfloat16", "llama")),
    (RMSNORM, rms_case(13, 1009, "float16", "gemma")),
    (RMSNORM, rms_case(64, 64, "float32", "gemma")),
    (GATED, act_case(8192, 8192, "bfloat16", "silu", "separate")),
    (GATED, act_case(7, 4863, "float16", "gelu_tanh", "packed")),
]


@pytest.mark.parametrize("family, case", CPU_CASES, ids=lambda v: getattr(v, "name", None))
def test_candidates_of_a_case_share_the_cuda_source(family, case):
    configs = cuda_space(family, case)
    assert len(configs) >= 2
    sources = [render(family, c, case) for c in configs]
    consts = [constants(s) for s in sources]
    for key in ("CUDA_SOURCE", "CPP_SOURCE", "FUNCTIONS"):
        assert len({c[key] for c in consts}) == 1, f"{key} differs between configs"
    kernels = [c["KERNEL"] for c in consts]
    assert len(set(kernels)) == len(configs), "each config calls its own instantiation"
    assert set(kernels) <= set(consts[0]["FUNCTIONS"])
    for name in kernels:
        assert f"void {name}(" in consts[0]["CUDA_SOURCE"]
        assert f"void {name}(" in consts[0]["CPP_SOURCE"]
    for other in sources[1:]:
        changed = [line[1:] for line in difflib.unified_diff(
            sources[0].splitlines(), other.splitlines(), lineterm="", n=0)
            if line[:1] in "+-" and line[:3] not in ("+++", "---")]
        assert changed and all(CONFIG_LINE.match(line) for line in changed), changed


def test_the_row_count_does_not_change_the_build():
    """Cases that differ only in rows (prefill, decode) compile once."""
    from codegen.gated_act.cuda import cuda_source as act_source
    from codegen.rmsnorm.cuda import cuda_source as rms_source

    assert rms_source(rms_case(8192, 896, "bfloat16", "llama")) == \
        rms_source(rms_case(1, 896, "bfloat16", "llama"))
    assert act_source(act_case(8192, 4864, "bfloat16", "silu", "separate")) == \
        act_source(act_case(3, 4864, "bfloat16", "silu", "separate"))
    assert rms_source(rms_case(8, 896, "bfloat16", "llama")) != \
        rms_source(rms_case(8, 896, "bfloat16", "gemma"))


def test_rmsnorm_sizes_form_and_config_are_constants():
    case = rms_case(4, 300, "bfloat16", "gemma", eps=1e-5)
    config = {"backend": "cuda", "threads_per_row": 32, "rows_per_block": 2, "vec": 4}
    assert config in cuda_space(RMSNORM, case)
    source = render(RMSNORM, config, case)
    c = constants(source)
    cu = c["CUDA_SOURCE"]
    for line in ("#define HIDDEN 300", "typedef __nv_bfloat16 scalar_t;", "#define CAST_FIRST 0",
                 "#define SCALE(w) (1.0f + to_float(w))", "#define WEIGHT_FP32 1",
                 "rms_norm<32, 2, 4>(x, w, out, eps);"):
        assert line in cu, line
    assert (c["HIDDEN"], c["THREADS_PER_ROW"], c["ROWS_PER_BLOCK"], c["THREADS"], c["VEC"]) == \
        (300, 32, 2, 64, 4)
    assert c["KERNEL"] == "rms_norm_tpr32_r2_v4" and c["EPS"] == 1e-5
    assert c["BAKED_PARAMS"] == {"eps": 1e-5, "offset": 1.0, "cast_first": False}
    assert "def forward(x, weight, *, out, **params)" in source
    assert "--use_fast_math" not in cuda_build.CFLAGS
    llama = constants(render(RMSNORM, cuda_space(RMSNORM, rms_case(4, 300, "float16", "llama"))[0],
                             rms_case(4, 300, "float16", "llama")))["CUDA_SOURCE"]
    for line in ("#define CAST_FIRST 1", "#define SCALE(w) (to_float(w))", "#define WEIGHT_FP32 0",
                 "typedef __half scalar_t;"):
        assert line in llama, line


def test_gated_act_sizes_act_layout_and_config_are_constants():
    case = act_case(7, 4864, "float32", "gelu_tanh", "packed")
    config = {"backend": "cuda", "threads": 256, "vec": 4, "items": 2}
    assert config in cuda_space(GATED, case)
    source = render(GATED, config, case)
    c = constants(source)
    cu = c["CUDA_SOURCE"]
    for line in ("#define COLS 4864", "typedef float scalar_t;", "tanhf(inner)",
                 "gated_act_packed<256, 4, 2>(gate_up, out);"):
        assert line in cu, line
    assert "expf" not in cu and "gated_act<" not in cu.split("// One exported")[1]
    assert (c["COLS"], c["THREADS"], c["VEC"], c["ITEMS"], c["KERNEL"]) == \
        (4864, 256, 4, 2, "gated_act_t256_v4_i2")
    assert "def forward(gate_up, *, out, **params)" in source
    silu = constants(render(GATED, config, {**case, "act": "silu", "layout": "separate"}))
    assert "expf(-g)" in silu["CUDA_SOURCE"] and "gated_act<256, 4, 2>(gate, up, out);" in \
        silu["CUDA_SOURCE"]


def test_a_config_outside_the_compiled_space_is_refused():
    case = rms_case(4, 2048, "bfloat16", "llama")
    with pytest.raises(ValueError):
        render(RMSNORM, {"backend": "cuda", "threads_per_row": 8, "rows_per_block": 1,
                         "vec": 8}, case)


ODD = [1, 7, 8, 64, 257, 896, 1009, 2049, 4863, 8192, 65537]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("width", ODD)
def test_search_spaces_are_valid_for_any_width(width, dtype):
    size = {"float32": 4, "float16": 2, "bfloat16": 2}[dtype]
    for rows in (1, 13, 8192):
        space = cuda_space(RMSNORM, rms_case(rows, width, dtype, "llama"))
        assert 1 <= len(space) <= 12
        for c in space:
            tpr, rpb, vec = c["threads_per_row"], c["rows_per_block"], c["vec"]
            assert tpr & (tpr - 1) == 0 and (tpr * rpb) % 32 == 0 and tpr * rpb <= 1024
            assert width % vec == 0 and vec * size <= 16
        if any(c["rows_per_block"] == 1 for c in space):
            assert all(c["rows_per_block"] <= rows for c in space)
        space = cuda_space(GATED, act_case(rows, width, dtype, "silu", "packed"))
        assert space
        for c in space:
            assert width % c["vec"] == 0 and c["vec"] * size <= 16
            assert c["threads"] % 32 == 0 and c["threads"] <= 1024 and c["items"] >= 1
    # widths that allow 16-byte vectors get them
    if width % 8 == 0:
        assert cuda_space(GATED, act_case(1, width, dtype, "silu", "separate"))[0]["vec"] == \
            16 // size


def test_config_key_differs_between_backends():
    case = rms_case(64, 896, "bfloat16", "llama")
    both = backend_configs(RMSNORM, case, "both")
    keys = [config_key(c) for c in both]
    assert len(set(keys)) == len(keys)
    cuda = [c for c in both if c.get("backend") == "cuda"]
    assert cuda and all("backendcuda" in config_key(c) for c in cuda)
    triton = [c for c in both if "backend" not in c]
    assert triton == RMSNORM.search_space(case)
    assert config_key(cuda[0]) != config_key({k: v for k, v in cuda[0].items()
                                              if k != "backend"})


# -- backend selection, with fake families: nothing compiles --------------------------------

def _fake_family(name: str, with_cuda: bool) -> Family:
    def render_triton(config, case):
        return f"# triton {config}\ndef forward(*a, out, **p):\n    pass\n"

    def render_cuda(config, case):
        return f"# cuda {config}\ndef forward(*a, out, **p):\n    pass\n"

    cuda = CudaVariant(search_space=lambda case: [{"threads": 128}, {"threads": 256},
                                                  {"threads": 512}],
                       render=render_cuda) if with_cuda else None
    return Family(name=name, patterns=(), reference=None, make_inputs=None, make_out=None,
                  edge_cases=lambda c: [], min_bytes=lambda c: 1, flops=lambda c: 1,
                  search_space=lambda case: [{"BLOCK": 64}, {"BLOCK": 128}, {"BLOCK": 256}],
                  render=render_triton, patch=None, cases_from_model=lambda m, w: [],
                  cuda=cuda)


@pytest.mark.parametrize("backend, want", [
    ("triton", ["triton"] * 3), ("cuda", ["cuda"] * 3), ("both", ["triton"] * 3 + ["cuda"] * 3)])
def test_backend_selects_the_spaces(backend, want):
    fam = _fake_family("fake", with_cuda=True)
    configs = backend_configs(fam, {"rows": 1}, backend)
    assert [search_mod.config_backend(c) for c in configs] == want
    assert backend_configs(_fake_family("plain", False), {"rows": 1}, backend) == \
        [{"BLOCK": 64}, {"BLOCK": 128}, {"BLOCK": 256}], "no CUDA variant: Triton"
    # a budget spreads over each space, so "both" keeps both backends
    budgeted = backend_configs(fam, {"rows": 1}, backend, budget=1)
    assert sorted({search_mod.config_backend(c) for c in budgeted}) == sorted(set(want))


class _FakeSession:
    """The screen, answered without running anything: every candidate passes, in order."""

    def __init__(self, family, case, device, timeout_s=300.0):
        self.baseline, self.n = None, 0

    def run(self, jobs):
        self.n += len(jobs)
        return [{**j, "screen": "pass", "timing": {"median_ms": float(self.n - len(jobs) + i)}}
                for i, j in enumerate(jobs, 1)]

    def close(self):
        pass


def test_search_renders_each_config_with_its_backend(tmp_path, monkeypatch):
    monkeypatch.setattr(search_mod, "ScreenSession", _FakeSession)
    fam = _fake_family("fake", with_cuda=True)
    entry = search_mod.search(fam, {"rows": 3, "dtype": "float32"}, tmp_path, "cuda",
                              backend="both")
    assert entry["backend"] == "both"
    assert [c["backend"] for c in entry["candidates"]] == ["triton"] * 3 + ["cuda"] * 3
    for c in entry["candidates"]:
        text = Path(c["path"]).read_text()
        assert text.startswith(f"# {c['backend']} ")
        assert ("backendcuda" in c["path"]) == (c["backend"] == "cuda")
    assert len({c["path"] for c in entry["candidates"]}) == 6
    plain = search_mod.search(_fake_family("plain", False), {"rows": 3, "dtype": "float32"},
                              tmp_path, "cuda", backend="cuda")
    assert plain["backend"] == "triton"
    assert all(c["backend"] == "triton" for c in plain["candidates"])


def test_generate_stage_threads_the_backend(tmp_path, monkeypatch):
    from pipeline import optimize

    fams = {"withcuda": _fake_family("withcuda", True), "plain": _fake_family("plain", False)}
    for fam in fams.values():
        fam.cases_from_model = lambda model, w: [{"rows": 2, "dtype": "float32"}]
    calls = []

    def fake_search(family, case, root, device, max_configs=None, timeout_s=300.0,
                    backend="triton", **how):
        calls.append((family.name, backend))
        return {"family": family.name, "case": case, "case_key": search_mod.case_key(case),
                "device": device, "backend": search_mod.family_backend(family, backend),
                "baseline": None, "candidates": [], "order": []}

    monkeypatch.setattr("codegen.registry.get_family", fams.__getitem__)
    monkeypatch.setattr(search_mod, "search", fake_search)
    said = []
    log = optimize.generate_stage(tmp_path, ["withcuda", "plain"], None, [None], "cuda",
                                  said.append, resume=False, max_configs=None, backend="cuda")
    assert calls == [("withcuda", "cuda"), ("plain", "cuda")]
    assert [s["backend"] for s in log["searches"]] == ["cuda", "triton"]
    assert said.count("plain has no CUDA C++ variant; generating Triton") == 1
    assert not any("withcuda has no" in s for s in said)

    # resume: the same backend skips both; another backend searches again what it changes
    calls.clear()
    optimize.generate_stage(tmp_path, ["withcuda", "plain"], None, [None], "cuda", said.append,
                            resume=True, max_configs=None, backend="cuda")
    assert calls == []
    optimize.generate_stage(tmp_path, ["withcuda", "plain"], None, [None], "cuda", said.append,
                            resume=True, max_configs=None, backend="triton")
    assert calls == [("withcuda", "triton")]


def test_resolve_backend(monkeypatch):
    assert cuda_build.resolve_backend("triton", "cuda") == ("triton", None)
    backend, note = cuda_build.resolve_backend("cuda", "cpu")
    assert backend == "triton" and note == "CUDA C++ variants need a CUDA GPU; generating Triton"
    assert cuda_build.resolve_backend("both", "cpu")[0] == "triton"
    with pytest.raises(UserError, match="unknown backend"):
        cuda_build.resolve_backend("cuda++", "cuda")
    monkeypatch.setattr(cuda_build, "build_problem", lambda: "no CUDA toolkit found")
    with pytest.raises(UserError, match="no CUDA toolkit found"):
        cuda_build.resolve_backend("cuda", "cuda:0")
    monkeypatch.setattr(cuda_build, "build_problem", lambda: None)
    assert cuda_build.resolve_backend("both", "cuda:0") == ("both", None)


def test_build_problem_on_this_machine():
    problem = cuda_build.build_problem()
    if not torch.cuda.is_available():
        assert problem == "no CUDA device is visible to torch"
    else:
        from torch.utils import cpp_extension

        assert (problem is None) == (cpp_extension.CUDA_HOME is not None
                                     and cpp_extension.is_ninja_available())


def test_builds_are_cached_by_source(tmp_path, monkeypatch):
    """One build per source under $PIPELINE_CUDA_CACHE/<sha1>; a fresh process (the in-process
    table cleared) imports the built module without compiling again."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv(cuda_build.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(cuda_build, "_loaded", {})
    builds, imports = [], []

    def fake_load_inline(name, cpp_sources, cuda_sources, functions, build_directory, **kw):
        assert not (Path(build_directory) / "lock").exists(), "a killed build's lock is cleared"
        builds.append((name, build_directory, kw))
        (Path(build_directory) / f"{name}.so").write_text("binary")
        return f"module {name}"

    monkeypatch.setattr(cpp_extension, "load_inline", fake_load_inline)
    monkeypatch.setattr(cuda_build, "_import", lambda name, lib: imports.append(lib) or name)
    args = ("// cuda A", "void f();", ("f",))
    key = cuda_build.build_key(*args)
    assert cuda_build.load_extension(*args) == f"module kp_cuda_{key[:16]}"
    assert cuda_build.load_extension(*args) == f"module kp_cuda_{key[:16]}"  # in-process
    assert len(builds) == 1 and builds[0][1] == str(tmp_path / key)
    assert builds[0][2]["extra_cuda_cflags"] == ["-O3"]
    monkeypatch.setattr(cuda_build, "_loaded", {})  # as a new worker process
    assert cuda_build.load_extension(*args) == f"kp_cuda_{key[:16]}"
    assert len(builds) == 1 and imports == [tmp_path / key / f"kp_cuda_{key[:16]}.so"]
    # torch's lock file left by a build killed mid-way does not block the next one
    leftover = tmp_path / cuda_build.build_key("// cuda B", "void f();", ("f",)) / "lock"
    leftover.parent.mkdir()
    leftover.write_text("")
    cuda_build.load_extension("// cuda B", "void f();", ("f",))
    assert len(builds) == 2 and builds[1][1] != builds[0][1]
    monkeypatch.delenv(cuda_build.CACHE_ENV)
    assert cuda_build.cache_root() == Path.home() / ".cache" / "kernel-pipeline" / "cuda"


# -- the CLI on the CPU: the note, then Triton -----------------------------------------------

def run_cli(*args, home: Path):
    return subprocess.run(
        [sys.executable, "-m", "pipeline", *args], capture_output=True, text=True, cwd=home,
        timeout=600, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(home),
                          "PIPELINE_RUNS": str(home / "runs"), "PYTHONPATH": str(REPO)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cli_backend_cuda_without_a_gpu_fails_before_profiling(tmp_path):
    proc = run_cli("optimize", "tiny-llama", "--device", "cuda", "--backend", "cuda",
                   "--run-dir", str(tmp_path / "run"), home=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == "error: --backend cuda cannot build CUDA C++ variants: no " \
                                  "CUDA device is visible to torch; use --backend triton"
    assert not (tmp_path / "run").exists()


def test_cli_backend_cuda_on_cpu_notes_and_generates_triton(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("optimize", "tiny-llama", "--top", "1", "--batch", "1", "--seq", "8",
                   "--device", "cpu", "--pairs", "2", "--backend", "cuda", "--run-dir",
                   str(run_dir), home=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "CUDA C++ variants need a CUDA GPU; generating Triton" in proc.stdout
    assert "not built by this version" not in proc.stdout
    from core.artifacts import read_json

    searches = [s for s in read_json(run_dir / "candidates" / "search_log.json")["searches"]
                if s.get("case_key")]
    assert searches
    for s in searches:
        assert s["backend"] == "triton"
        assert s["candidates"] and all(c["backend"] == "triton" for c in s["candidates"])
        assert all("backendcuda" not in c["path"] for c in s["candidates"])
    assert any(c["screen"] == "pass" for s in searches for c in s["candidates"]), \
        "Triton candidates ran (under the interpreter)"


# -- GPU: compile, numerics, verifier, search ------------------------------------------------

GPU_CASES = [
    # realistic widths (16-byte vectors), prime widths (element by element), just over a block
    ("rmsnorm", rms_case(64, 2048, "bfloat16", "llama", eps=1e-5)),
    ("rmsnorm", rms_case(64, 1009, "bfloat16", "gemma")),
    ("rmsnorm", rms_case(64, 2056, "float16", "llama")),
    ("rmsnorm", rms_case(64, 64, "float16", "gemma")),
    ("rmsnorm", rms_case(64, 1031, "float32", "llama")),
    ("rmsnorm", rms_case(64, 4100, "float32", "gemma")),
    ("gated_act", act_case(64, 4864, "bfloat16", "silu", "separate")),
    ("gated_act", act_case(64, 4863, "float16", "gelu_tanh", "packed")),
    ("gated_act", act_case(64, 1025, "float32", "silu", "packed")),
    ("gated_act", act_case(64, 8192, "bfloat16", "gelu_tanh", "separate")),
]
FAMILIES = {"rmsnorm": RMSNORM, "gated_act": GATED}
TOL = {"float32": (1e-5, 1e-5), "float16": (4e-3, 4e-3), "bfloat16": (3e-2, 3e-2)}


def _case_id(item):
    name, case = item
    return f"{name}-{case['dtype']}-" + "-".join(str(v) for k, v in case.items()
                                                  if k in ("hidden", "cols", "act", "layout",
                                                           "cast_first"))


@pytest.fixture(scope="module")
def built():
    """Every GPU case compiled first, side by side (one build each, about a minute alone)."""
    from codegen.gated_act.cuda import cuda_source as act_source
    from codegen.rmsnorm.cuda import cuda_source as rms_source

    sources = [(rms_source if name == "rmsnorm" else act_source)(case) for name, case in GPU_CASES]
    with ProcessPoolExecutor(max_workers=len(sources), mp_context=get_context("spawn")) as ex:
        folders = list(ex.map(cuda_build.build, *zip(*sources)))
    assert all((Path(f) / "built.ok").is_file() for f in folders)


def _load(family, config, case, tmp_path):
    from core.source import load_forward

    path = tmp_path / f"{config_key(config)}.py"
    path.write_text(render(family, config, case))
    return load_forward(path), path


def _inputs(family, case, seed=0):
    return family.make_inputs(case, "cuda", torch.Generator("cuda").manual_seed(seed))


def _check(family, forward, case, inputs=None, out=None):
    inputs = inputs if inputs is not None else _inputs(family, case)
    params = family.params(case)
    out = out if out is not None else family.make_out(case, inputs)
    out.fill_(float("nan"))
    forward(*inputs, out=out, **params)
    atol, rtol = TOL[case["dtype"]]
    torch.testing.assert_close(out, family.reference(*inputs, **params), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("item", GPU_CASES, ids=_case_id)
def test_every_config_matches_the_reference_on_edge_cases(item, built, tmp_path):
    name, case = item
    family = FAMILIES[name]
    for config in cuda_space(family, case):
        forward, _ = _load(family, config, case, tmp_path)
        for c in [case, *family.edge_cases(case)]:  # one row, odd rows, strided rows
            _check(family, forward, c)


@pytest.mark.gpu
@pytest.mark.parametrize("item", GPU_CASES, ids=_case_id)
def test_unaligned_views_take_the_scalar_path(item, built, tmp_path):
    """Inputs and outputs one element off a 16-byte boundary still compute right."""
    name, case = item
    family = FAMILIES[name]
    forward, _ = _load(family, cuda_space(family, case)[-1], case, tmp_path)
    ref_inputs = _inputs(family, case)
    shifted = []
    for t in ref_inputs:
        if t.dim() == 2:
            buf = torch.empty((t.shape[0], t.shape[1] + 3), dtype=t.dtype, device=t.device)
            buf[:, 1:1 + t.shape[1]] = t
            t = buf[:, 1:1 + t.shape[1]]
        shifted.append(t)
    ref_out = family.make_out(case, ref_inputs)
    out_buf = torch.empty(ref_out.numel() + 1, dtype=ref_out.dtype, device="cuda")
    out = out_buf[1:].view(ref_out.shape)
    _check(family, forward, case, tuple(shifted), out)


@pytest.mark.gpu
def test_gemma_norm_takes_an_fp32_weight(built, tmp_path):
    case = rms_case(64, 1009, "bfloat16", "gemma")
    forward, _ = _load(RMSNORM, cuda_space(RMSNORM, case)[0], case, tmp_path)
    x, w = _inputs(RMSNORM, case)
    _check(RMSNORM, forward, case, (x, w.float()))


@pytest.mark.gpu
def test_offsets_past_2_31_elements(built, tmp_path):
    """int64 indexing: the last rows of a tensor larger than 2**31 elements."""
    _, case = GPU_CASES[6]  # gated_act bf16 separate 4864: 16-byte vectors, prebuilt
    rows = 2**31 // case["cols"] + 5
    big = {**case, "rows": rows}
    forward, _ = _load(GATED, cuda_space(GATED, big)[0], big, tmp_path)
    gate, up = (torch.zeros((rows, case["cols"]), dtype=torch.bfloat16, device="cuda")
                for _ in range(2))
    for t in (gate, up):
        t[-3:] = torch.randn((3, case["cols"]), device="cuda").to(torch.bfloat16)
    out = torch.full((rows, case["cols"]), float("nan"), dtype=torch.bfloat16, device="cuda")
    forward(gate, up, out=out, act="silu")
    torch.testing.assert_close(out[-3:], GATED.reference(gate[-3:], up[-3:], act="silu"),
                               atol=3e-2, rtol=3e-2)
    assert not out[:-3].isnan().any()
    del gate, up, out
    _, case = GPU_CASES[0]  # rmsnorm bf16 2048
    rows = 2**31 // case["hidden"] + 5
    big = {**case, "rows": rows}
    forward, _ = _load(RMSNORM, cuda_space(RMSNORM, big)[-1], big, tmp_path)
    x = torch.ones((rows, case["hidden"]), dtype=torch.bfloat16, device="cuda")
    x[-3:] = torch.randn((3, case["hidden"]), device="cuda").to(torch.bfloat16)
    w = _inputs(RMSNORM, case)[1]
    out = torch.full_like(x, float("nan"))
    forward(x, w, out=out, **RMSNORM.params(case))
    params = RMSNORM.params(case)
    torch.testing.assert_close(out[-3:], RMSNORM.reference(x[-3:], w, **params),
                               atol=3e-2, rtol=3e-2)
    assert not out[:-3].isnan().any()


@pytest.mark.gpu
def test_the_verifier_accepts_them(built, tmp_path):
    """The project's verifier (its edge cases, poisoned and guarded outputs, stress values,
    NaN/inf, forbidden aten ops, the caller's stream) on one config of every case."""
    from concurrent.futures import ThreadPoolExecutor

    from verify.harness import verify_candidate

    def verify(i):
        name, case = GPU_CASES[i]
        family = FAMILIES[name]
        space = cuda_space(family, case)
        path = tmp_path / f"{i}.py"
        path.write_text(render(family, space[len(space) // 2], case))
        return verify_candidate(family, path, [case], device="cuda", trials=1, timing=False,
                                fail_fast=False, timeout_s=240)

    with ThreadPoolExecutor(max_workers=5) as pool:
        results = list(pool.map(verify, range(len(GPU_CASES))))
    for (_, case), res in zip(GPU_CASES, results):
        assert res.accepted, (case, res.reasons)


@pytest.mark.gpu
def test_search_screens_cuda_beside_triton_and_cuda_launches_cost_less(built, tmp_path):
    _, case = GPU_CASES[0]
    entry = search_mod.search(RMSNORM, case, tmp_path, "cuda", max_configs=2, backend="both")
    assert entry["backend"] == "both"
    by_backend = {}
    for c in entry["candidates"]:
        assert c["screen"] == "pass", c
        by_backend.setdefault(c["backend"], []).append(c["host_us"])
    assert len(by_backend["cuda"]) == 2 and len(by_backend["triton"]) == 2
    # the point of the C++ launcher: less host time per call than Triton's
    assert min(by_backend["cuda"]) < min(by_backend["triton"]), by_backend
