"""Every decode-relevant family's adapter reaches the model inside a static-cache decode step
(models.graphs.StaticDecoder, the step the graphs stage captures), run eagerly on the CPU: the
family's kernel is called in the step, and the step's logits (two steps: the second reads what
the first wrote) match the unpatched decoder's. And what one step launches, per layer,
unpatched and with every family: aten compute ops (views and allocations launch nothing) plus
one launch per kernel call, counted by a dispatch mode.

Counted here (transformers 5.24, tiny-llama, per decoder layer of one step, module hooks
telling layer from step): unpatched 40 (mul 9, add 8 with the counter's add_, mm 7,
pow/mean/rsqrt 2 each, rotary's cat and neg 2 each, index_copy_ 2, the index's arange 1,
silu 1, sdpa 1 and its boolean mask's where 1); with every family 13: the 5 GEMMs left (q, k,
v, o, down), our 5 kernels (rmsnorm, add_rmsnorm, rope over q and k in one launch, the gated
GEMM, the KV append that also advances the position), sdpa and its mask's where, and the
residual add after the MLP (the norm it would fuse with is the next layer's). The biggest
remaining contributors: the three q/k/v GEMMs (one fused qkv GEMM would save 2 per layer),
the mask's where (the bool mask converted per layer; once per step would do) and the residual
add. On the H200's 5.17 the attention may also repeat_kv; the GPU test
(tests/pipeline/test_graphs_gpu.py) counts device kernels of one graphed step."""

from __future__ import annotations

import collections
import functools
import importlib

import pytest
import torch
from family_checks import CountingChooser
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from models.graphs import StaticDecoder
from profiling.loader import build, resolve

# family -> kernel calls in one tiny-llama step (2 layers): per layer two norms (add_rmsnorm
# fuses the second with the residual add) and the final norm, one rotary, one MLP, one append
CALLS_PER_STEP = {"rmsnorm": 5, "add_rmsnorm": 2, "rope": 2, "gated_act": 2,
                  "matmul_epilogue": 2, "kv_cache": 2, "decode_attention": 2}
PROMPT = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
STEPS = torch.randint(3, 500, (1, 2), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build(resolve("tiny-llama"), torch.float32, "cpu").eval()


def _steps(model, chooser=None) -> list[torch.Tensor]:
    dec = StaticDecoder(model, 1, PROMPT.shape[1] + 4, graph=False)
    dec.prefill(PROMPT)
    if chooser is not None:  # count the steps' calls only (the prefill has its own cases)
        chooser.calls, chooser.cases = 0, []
    out = [dec.step(STEPS[:, i:i + 1]).clone() for i in range(STEPS.shape[1])]
    assert dec.position == PROMPT.shape[1] + STEPS.shape[1]
    return out


@pytest.mark.parametrize("name", sorted(CALLS_PER_STEP))
def test_family_kernel_runs_in_a_static_decode_step(model, name, tmp_path):
    family = importlib.import_module(f"codegen.{name}").FAMILY
    want = _steps(model)
    chooser = CountingChooser(family, tmp_path)
    undo = family.patch(model, chooser)
    try:
        got = _steps(model, chooser)
    finally:
        undo()
    assert chooser.calls == STEPS.shape[1] * CALLS_PER_STEP[name], chooser.distinct_cases()
    # one-token cases: rows or seq or new positions 1 (decode_attention's are one-token by
    # construction: its case has no query length)
    assert name == "decode_attention" or all(
        1 in (c.get("rows"), c.get("seq"), c.get("new")) for c in chooser.cases)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_static_kv_append_and_decode_attention_stack_in_one_step(model, tmp_path):
    """The append advances the on-device position in its own launch and the attention reads
    it: stacked, the step still reads exactly the slots written so far."""
    want = _steps(model)
    undos, choosers = [], []
    for name in ("kv_cache", "decode_attention"):
        family = importlib.import_module(f"codegen.{name}").FAMILY
        (tmp_path / name).mkdir()
        choosers.append(CountingChooser(family, tmp_path / name))
        undos.append(family.patch(model, choosers[-1]))
    try:
        got = _steps(model)
    finally:
        for undo in reversed(undos):
            undo()
    assert all(c.calls > 0 for c in choosers)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


VIEWS = {"view", "_unsafe_view", "unsqueeze", "squeeze", "t", "transpose", "expand", "slice",
         "select", "alias", "permute", "as_strided", "reshape", "detach", "lift_fresh",
         "_reshape_alias", "split", "unbind", "empty", "empty_strided", "new_empty",
         "empty_like", "scalar_tensor"}  # scalar_tensor: a CPU scalar, never a kernel
DECODE_FAMILIES = ("add_rmsnorm", "rmsnorm", "rope", "matmul_epilogue", "kv_cache")


class _Launches(TorchDispatchMode):
    """Launches by where they ran: inside a decoder layer (`layer`, set by module hooks) or
    once per step (`step`)."""

    def __init__(self):
        super().__init__()
        self.counts = {"layer": collections.Counter(), "step": collections.Counter()}
        self.where = "step"

    def add(self, name: str) -> None:
        self.counts[self.where][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.add(name.rstrip("_"))
        return func(*args, **(kwargs or {}))


def _step_launches(model, families, tmp_path) -> dict[str, dict]:
    """{"layer": launches per decoder layer, "step": once per step} of one static step."""
    mode = _Launches()
    undos = []
    for layer in model.model.layers:
        undos.append(layer.register_forward_pre_hook(
            lambda *_: setattr(mode, "where", "layer")).remove)
        undos.append(layer.register_forward_hook(lambda *_: setattr(mode, "where", "step")).remove)
    for name in families:
        family = importlib.import_module(f"codegen.{name}").FAMILY
        (tmp_path / name).mkdir(exist_ok=True)
        chooser = CountingChooser(family, tmp_path / name)

        def launch(case, chooser=chooser, name=name):
            fn = chooser(case)
            if fn is None:
                return None

            @functools.wraps(fn)
            def run(*args, **kwargs):
                mode.add(f"kernel:{name}")
                with _disable_current_modes():  # the interpreter's own torch calls
                    return fn(*args, **kwargs)
            return run
        undos.append(family.patch(model, launch))
    try:
        dec = StaticDecoder(model, 1, PROMPT.shape[1] + 2, graph=False)
        dec.prefill(PROMPT)
        dec.step(STEPS[:, :1])  # warm: first calls resolve and compile
        dec.rewind(PROMPT.shape[1])
        mode.counts = {"layer": collections.Counter(), "step": collections.Counter()}
        with torch.no_grad(), mode:
            dec.step(STEPS[:, :1])
    finally:
        for undo in reversed(undos):
            undo()
    layers = len(model.model.layers)
    assert all(n % layers == 0 for n in mode.counts["layer"].values()), mode.counts
    return {"layer": {k: n // layers for k, n in mode.counts["layer"].items()},
            "step": dict(mode.counts["step"])}


def test_a_patched_static_step_launches_far_fewer_ops_per_layer(model, tmp_path):
    base = _step_launches(model, (), tmp_path)
    ours = _step_launches(model, DECODE_FAMILIES, tmp_path)
    per_layer = {k: sum(v["layer"].values()) for k, v in (("base", base), ("ours", ours))}
    assert per_layer == {"base": 40, "ours": 12}, (base, ours)
    assert {f"kernel:{f}": 1 for f in DECODE_FAMILIES if f != "rmsnorm"}.items() <= \
        ours["layer"].items()
    # what the families replace is gone from every layer; the GEMMs they leave are not
    for op in ("pow", "mean", "rsqrt", "cat", "neg", "silu", "index_copy", "arange"):
        assert base["layer"].get(op) and op not in ours["layer"], op
    # down_proj's GEMM takes the residual add after the MLP as its C (add_rmsnorm's fold)
    assert ours["layer"]["mm"] == 4 and base["layer"]["mm"] == 7
    assert ours["layer"]["addmm"] == 1 and "add" not in ours["layer"], ours["layer"]
    assert sum(ours["step"].values()) < sum(base["step"].values())


# on the GPU: the same step captured as a CUDA graph ------------------------------------------

def _graph_kernels(dec) -> list[str]:
    """Device kernel names of one graph replay (the step at the prompt's end)."""
    from torch.profiler import ProfilerActivity, profile

    dec.rewind(PROMPT.shape[1])
    dec.step(STEPS[:, :1].cuda())
    torch.cuda.synchronize()
    dec.rewind(PROMPT.shape[1])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        dec.step(STEPS[:, :1].cuda())
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset"))]


@pytest.mark.gpu
def test_graphed_static_step_runs_every_family_kernel_and_fewer_kernels(tmp_path):
    """One captured tiny-llama step (fp16): unpatched, then with every decode family; each
    family's kernel is among the replay's kernels, the replay's logits equal the eager
    patched step's, and the step launches fewer kernels. Prints both counts (the lead's
    kernels-per-step figure for the report)."""
    from core.source import kernel_names

    model = build(resolve("tiny-llama"), torch.float16, "cuda").eval()
    prompt = PROMPT.cuda()
    counts, names = {}, {}
    undos, choosers = [], {}
    for label, families in (("unpatched", ()), ("patched", DECODE_FAMILIES)):
        for name in families:
            family = importlib.import_module(f"codegen.{name}").FAMILY
            (tmp_path / name).mkdir(exist_ok=True)
            choosers[name] = CountingChooser(family, tmp_path / name)
            undos.append(family.patch(model, choosers[name]))
        try:
            graphed = StaticDecoder(model, 1, PROMPT.shape[1] + 2, graph=True)
            eager = StaticDecoder(model, 1, PROMPT.shape[1] + 2, graph=False)
            for dec in (graphed, eager):
                dec.prefill(prompt)
            got = graphed.step(STEPS[:, :1].cuda()).clone()
            want = eager.step(STEPS[:, :1].cuda())
            torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
            names[label] = _graph_kernels(graphed)
            counts[label] = len(names[label])
            graphed.close()
            eager.close()
        finally:
            while undos:
                undos.pop()()
    print(f"kernels per graphed tiny-llama step: {counts}")
    for name, chooser in choosers.items():
        family = importlib.import_module(f"codegen.{name}").FAMILY
        ours = set().union(*(kernel_names(family.render(family.search_space(c)[-1], c))
                             for c in chooser.distinct_cases()))
        assert any(any(k in n for k in ours) for n in names["patched"]), (name, ours)
    assert counts["patched"] < counts["unpatched"], counts
