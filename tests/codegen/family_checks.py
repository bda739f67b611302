"""Checks shared by the family tests: run a rendered candidate the way the verifier does (poisoned
output, inputs checked untouched), count the calls a patched model sends to a kernel, and run a
model under the profiler through the project's own attribution and pattern matching."""

from __future__ import annotations

import collections
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from core.family import result_region
from core.source import load_forward
from core.workload import Workload
from profiling.attribution import attribute
from profiling.capture import capture, make_runner, module_names
from profiling.patterns import BASE_PATTERNS, match
from profiling.trace import load_trace

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def as_tuple(x) -> tuple:
    return x if isinstance(x, tuple) else (x,)


def compiled_script_facts(script: str) -> dict:
    """The JSON object that `script` (a file beside these tests) prints last, run in a process
    of its own without Triton's interpreter: a test process runs the interpreter, whose
    kernels cannot be compiled for a GPU target."""
    here = Path(__file__).parent
    root = here.parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(here / script)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def load_rendered(family, config, case, tmp_path):
    # the family in the name: rmsnorm and add_rmsnorm render the same config for the same case
    digest = abs(hash((repr(config), repr(sorted(case.items())))))
    path = tmp_path / f"cand_{family.name}_{digest}.py"
    path.write_text(family.render(config, case))
    return load_forward(path)


def poison(outs: tuple) -> None:
    for o in outs:
        if o.dtype.is_floating_point:
            o.fill_(float("nan"))


def run_candidate(family, config, case, tmp_path, seed=0, rendered_for=None):
    """(out, reference) for one config on one case; asserts every output element was written
    and no input was modified. `rendered_for`: the case the candidate is specialised to, when
    it differs from the one it runs (edge cases run the candidate of their base case, as the
    verifier does)."""
    forward = load_rendered(family, config, rendered_for or case, tmp_path)
    inputs = family.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(seed))
    before = [t.clone() for t in inputs]
    out = family.make_out(case, inputs)
    poison(as_tuple(out))
    params = family.params(case)
    forward(*inputs, out=out, **params)
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "candidate modified its input"
    ref = family.reference(*inputs, **params)
    return result_region(family, case, out), ref


def assert_close(out, ref, tol):
    atol, rtol = tol
    for o, r in zip(as_tuple(out), as_tuple(ref)):
        assert o.shape == r.shape and o.dtype == r.dtype
        torch.testing.assert_close(o, r, atol=atol, rtol=rtol, equal_nan=True)


class CountingChooser:
    """A forward_by_case that renders and loads one candidate per case (the last config of its
    space: the widest blocks, the fewest programs for the interpreter to run) and
    counts the calls that reach a kernel; `give=False` declines every case; `pick`: which
    config of the space (an index)."""

    def __init__(self, family, tmp_path, give=True, pick=-1):
        self.family, self.tmp_path, self.give, self.pick = family, tmp_path, give, pick
        self.calls, self.cases, self._cache = 0, [], {}

    def __call__(self, case):
        self.cases.append(case)
        if not self.give:
            return None
        key = repr(sorted(case.items()))
        if key not in self._cache:
            config = self.family.search_space(case)[self.pick]
            self._cache[key] = load_rendered(self.family, config, case, self.tmp_path)

        @functools.wraps(self._cache[key])  # adapters may read the kernel's signature
        def counted(*args, **kwargs):
            self.calls += 1
            return self._cache[key](*args, **kwargs)

        return counted

    def distinct_cases(self) -> list:
        out = []
        for c in self.cases:
            if c not in out:
                out.append(c)
        return out


def logits_patched(family, model, ids, tmp_path) -> tuple:
    """(logits unpatched, logits with `family` patched by a CountingChooser, that chooser);
    the model is unpatched again on return."""
    with torch.no_grad():
        before = model(ids).logits
        chooser = CountingChooser(family, tmp_path)
        undo = family.patch(model, chooser)
        try:
            patched = model(ids).logits
        finally:
            undo()
    return before, patched, chooser


def _family_patterns() -> list:
    """The patterns of the families these tests cover, imported directly: under pytest,
    tests/codegen (no __init__.py, on sys.path) shadows the codegen package as a namespace
    package, so codegen.registry's folder walk would list test files, not families."""
    from codegen.cross_entropy import FAMILY as cross_entropy
    from codegen.gated_act import FAMILY as gated_act
    from codegen.gelu import FAMILY as gelu
    from codegen.kv_cache import FAMILY as kv_cache
    from codegen.matmul import FAMILY as matmul
    from codegen.rope import FAMILY as rope
    from codegen.softmax import FAMILY as softmax

    return [p for f in (gated_act, gelu, rope, softmax, cross_entropy, kv_cache, matmul)
            for p in f.patterns]


def profiled_ops(model, tmp_path, batch=1, seq=8) -> list[dict]:
    """The attributed ops (as profile.json holds them) of one profiled CPU forward."""
    runner = make_runner(model, Workload(batch, seq))
    trace_path = tmp_path / "trace.json.gz"
    capture(runner, "cpu", trace_path)
    return [op.to_dict() for op in attribute(load_trace(trace_path),
                                             module_names(model, runner)).ops]


def profiled_occurrences(model, tmp_path, batch=1, seq=8):
    """Pattern occurrences of one profiled CPU forward: [(pattern, family, ops Counter)]."""
    ops = profiled_ops(model, tmp_path, batch, seq)
    found, _ = match(ops, list(BASE_PATTERNS) + _family_patterns())
    return [(o.pattern, o.family, collections.Counter(ops[i]["name"] for i in o.ops))
            for o in found]


def verify_on_cpu_or_gpu(family, case, tmp_path, config=None):
    """The project's verifier on one rendered candidate (its case plus the family's edge cases,
    poisoned outputs, stress values, NaN/inf, forbidden aten ops, isolation, and the
    memoisation probes its declaration of fixed inputs calls for): `config`, or the last of
    the search space (the interpreter's cheapest)."""
    from verify.harness import verify_candidate
    from verify.numerics import MEMO_KINDS
    from verify.probes import probe_kinds

    path = tmp_path / "kernel.py"
    path.write_text(family.render(config or family.search_space(case)[-1], case))
    result = verify_candidate(family, path, [case], device=DEVICE, trials=1, timing=False,
                              fail_fast=False, timeout_s=240)
    assert result.accepted, result.reasons
    # every probe ran on the given case (cache_rewound counts under numerics)
    probes = [k for k in MEMO_KINDS + probe_kinds(family) if k != "cache_rewound"]
    memo = next(c for c in result.checks if c["name"] == "memoisation" and c["case"] == "c0")
    assert memo["detail"].startswith(f"{len(probes)} input sets"), memo["detail"]


def instance_forwards(model) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


def space_ends(configs: list[dict]) -> list[dict]:
    """The first and last config of a search space (once, when they are the same): the
    smallest and the widest blocks, what a rendered-kernel test runs."""
    return list({repr(c): c for c in (configs[0], configs[-1])}.values())


def declines_then_trains(family, model_id: str, ids, tmp_path):
    """A patched model whose chooser declines every case gives the unpatched logits bit for
    bit (having asked once per case signature); with a chooser that would give kernels, a
    backward pass still runs the original code (the kernels write plain buffers). Returns the
    model (after backward, gradients set) and the second chooser, for family-specific asserts."""
    from profiling.loader import build, resolve

    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = ids.to(DEVICE)
    with torch.no_grad():
        before = model(ids).logits
        declining = CountingChooser(family, tmp_path, give=False)
        undo = family.patch(model, declining)
        declined = model(ids).logits
    undo()
    assert len(declining.cases) == 2 and declining.calls == 0
    assert torch.equal(declined, before)
    chooser = CountingChooser(family, tmp_path)
    undo = family.patch(model, chooser)
    model(ids).logits.sum().backward()
    undo()
    return model, chooser
