"""Patched models under torch.compile(fullgraph=True): every family that declares itself
traceable (`Family.traceable`) calls its kernels as its custom op (`codegen.ops`), the graph
has no break, and the logits are the eager patched model's. The attention routed as
`apply_kernels(compiled=True)` routes it (`codegen.sdpa_op`) is one opaque op in the graph,
its fake implementation agreeing with the real call, and undone the model is as it was."""

from __future__ import annotations

import importlib

import pytest
import torch
from family_checks import CountingChooser

from codegen.ops import compilable
from codegen.registry import families, get_family
from codegen.sdpa_op import NAME, route, sdpa_op
from core.family import no_patch
from core.workload import Workload
from pipeline.patching import for_compile, twin
from profiling.capture import make_runner
from profiling.loader import build, resolve

# (model, families patched together, backend): each traceable family in one group where the
# model calls it; aot_eager once, for functionalisation and the ops' fake implementations
PREFILL = [("tiny-llama", ("rmsnorm", "rope", "matmul_epilogue"), "aot_eager"),
           ("tiny-llama", ("add_rmsnorm",), "eager"),
           ("tiny-gpt2", ("layernorm", "gelu", "add_layernorm"), "eager"),
           ("tiny-gpt2", ("matmul_gelu",), "eager")]
DECODE = ("gemv",)  # families a decode step calls and a prefill does not


def patched(model_id, names, tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu")
    choosers = {n: CountingChooser(get_family(n), tmp_path) for n in names}
    undos = [get_family(n).patch(model, compilable(get_family(n), choosers[n])) for n in names]
    return model, choosers, undos


def sdpa_calls(gm) -> tuple[int, int]:
    """(calls of the attention op, of SDPA itself) in an FX graph."""
    targets = [n.target for n in gm.graph.nodes]
    return (targets.count(torch.ops.kernel_pipeline.sdpa_attention.default),
            sum("scaled_dot_product" in str(t) for t in targets))


def test_every_traceable_family_is_compiled_here():
    covered = {n for _, names, _ in PREFILL for n in names} | set(DECODE)
    traceable = {n for n, f in families().items() if f.traceable and f.patch is not no_patch}
    assert traceable == covered


@pytest.mark.parametrize("model_id, names, backend", PREFILL, ids=lambda v: str(v))
def test_a_patched_prefill_compiles_whole_and_runs_its_kernels(model_id, names, backend,
                                                               tmp_path):
    model, choosers, undos = patched(model_id, names, tmp_path)
    ids = torch.arange(3, 19).view(2, 8)
    with torch.no_grad():
        eager = model(ids).logits
        calls = {n: c.calls for n, c in choosers.items()}
        assert all(calls.values()), calls  # each family's kernel ran eagerly
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
    for u in undos:
        u()
    assert {n: c.calls - calls[n] for n, c in choosers.items()} == calls
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)


# what benchmarks/head_to_head.py's ours-compile patches for Llama prefill: the families the
# run keeps there, less those torch.compile cannot trace
LLAMA_KEPT = ("rmsnorm", "rope", "matmul_epilogue", "kv_cache", "add_rmsnorm")


@pytest.mark.parametrize("rotary", ["global", "slot"])
def test_head_to_heads_compiled_twins_trace_the_cached_prefill_whole(rotary, tmp_path,
                                                                      monkeypatch):
    """compile and ours-compile as head_to_head builds them: twins over one model in one
    process, each called through `make_runner` (prefill: `model(ids)`, so a fresh DynamicCache
    per call, use_cache on), fullgraph. Each compiles one frame once, however often it is
    called: no frame of a layer compiled per layer (which hits dynamo's recompile limit, 8
    per code object, on a 16-layer model, and shares it between the twins), no recompile.
    `global`: the rotary reached through the module global it swaps during the attention's
    call, as where transformers finds no usable `kernels` (transformers 5.17 rejects 0.19);
    `slot`: through transformers' per-attention rotary slot."""
    from torch._dynamo.testing import CompileCounterWithBackend

    if rotary == "global":
        rope = importlib.import_module("codegen.rope.patch")  # the package names its function
        monkeypatch.setattr(rope, "rotary_slot", lambda *_: None)
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    assert model.config.use_cache
    names = for_compile(list(LLAMA_KEPT))["families"]
    assert "rope" in names and "kv_cache" not in names
    patched = twin(model)
    choosers = {n: CountingChooser(get_family(n), tmp_path) for n in names}
    undos = [get_family(n).patch(patched, compilable(get_family(n), choosers[n]))
             for n in names]
    workload = Workload(2, 8)
    with torch.no_grad():
        eager = make_runner(patched, workload).call().logits
        calls = {n: c.calls for n, c in choosers.items()}
        assert all(calls.values()), calls
        torch._dynamo.reset()
        counters = {v: CompileCounterWithBackend("eager") for v in ("compile", "ours-compile")}
        runners = {"compile": make_runner(torch.compile(twin(model), fullgraph=True,
                                                        backend=counters["compile"]), workload),
                   "ours-compile": make_runner(torch.compile(patched, fullgraph=True,
                                                             backend=counters["ours-compile"]),
                                               workload)}
        for _ in range(3):
            got = {v: r.call().logits for v, r in runners.items()}
    for u in undos:
        u()
    assert {v: c.frame_count for v, c in counters.items()} == {"compile": 1, "ours-compile": 1}
    # each of the three compiled calls ran every family's kernels
    assert {n: c.calls - calls[n] for n, c in choosers.items()} == {
        n: 3 * k for n, k in calls.items()}
    torch.testing.assert_close(got["ours-compile"], eager, rtol=0, atol=1e-6)
    torch.testing.assert_close(got["compile"], eager, rtol=1e-4, atol=1e-4)


def test_the_attention_compiles_as_one_opaque_op_as_eager_runs_it(tmp_path):
    """Routed, a patched tiny Llama compiles whole under aot_eager with each layer's attention
    one call of the op (no SDPA for Inductor to lower) and the eager patched logits; eager
    calls of the routed model run transformers' function itself; undo restores the config
    exactly."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    model, choosers, undos = patched("tiny-llama", PREFILL[0][1], tmp_path)
    ids = torch.arange(3, 19).view(2, 8)
    config = dict(vars(model.config))
    with torch.no_grad():
        before = model(ids).logits
        undo, note = route(model)
        assert model.config._attn_implementation == NAME and "sdpa_attention" in note
        eager = model(ids).logits
        torch._dynamo.reset()
        backend = AotEagerAndRecordGraphs()
        compiled = torch.compile(model, fullgraph=True, backend=backend)(ids).logits
    layers = model.config.num_hidden_layers
    assert [sdpa_calls(g) for g in backend.graphs + backend.fw_graphs] == [(layers, 0)] * 2
    assert torch.equal(eager, before)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-6)
    undo()
    assert vars(model.config) == config
    for u in undos:
        u()
    with torch.no_grad():
        torch._dynamo.reset()
        backend = AotEagerAndRecordGraphs()
        torch.compile(model, fullgraph=True, backend=backend)(ids)
    assert sdpa_calls(backend.graphs[0]) == (0, layers)  # back to transformers' SDPA


def test_a_model_not_on_sdpa_keeps_its_attention():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    model.set_attn_implementation("eager")
    undo, note = route(model)
    assert undo is None and "configured eager" in note
    assert model.config._attn_implementation == "eager"


def _qkv(batch, heads, kv_heads, q_len, k_len, dim=16):
    g = torch.Generator().manual_seed(q_len)
    # q a transposed view of its projection, as HF hands it over
    q = torch.randn(batch, q_len, heads, dim, generator=g).transpose(1, 2)
    return (q, *torch.randn(2, batch, kv_heads, k_len, dim, generator=g))


@pytest.mark.parametrize("call", [
    "prefill, grouped heads, causal, no mask",
    "decode step, grouped heads, boolean mask, scale",
    "float mask, not causal, position bias"])
def test_the_attention_ops_fake_agrees_with_its_call(call):
    """torch.library.opcheck: schema, fake tensor shapes and strides against the real call,
    AOT dispatch with dynamic shapes."""
    mask = torch.arange(12) < torch.tensor([[9], [12]])
    args = {"prefill, grouped heads, causal, no mask":
            (*_qkv(2, 4, 2, 8, 8), None, 0.0, None, True, None, 2),
            "decode step, grouped heads, boolean mask, scale":
            (*_qkv(2, 4, 2, 1, 12), mask.view(2, 1, 1, 12), 0.0, 0.25, True, None, 2),
            "float mask, not causal, position bias":
            (*_qkv(1, 4, 4, 8, 8), torch.zeros(1, 1, 8, 8), 0.0, None, False,
             torch.randn(1, 4, 8, 8), 1)}[call]
    torch.library.opcheck(sdpa_op(), args)


def test_a_patched_decode_step_compiles_in_transformers_static_generate(tmp_path):
    """What `generate(cache_implementation="static")` does on a GPU, made to happen on the CPU
    (`_compile_all_devices`): its compiled step calls the kernels and the attention op (a
    boolean mask over the static cache), fullgraph."""
    from transformers.generation.configuration_utils import CompileConfig

    model, choosers, undos = patched("tiny-llama", DECODE + ("rmsnorm",), tmp_path)
    undos.append(route(model)[0])
    ids = torch.arange(3, 19).view(2, 8)
    graphs = []

    def backend(gm, example_inputs, **options):  # eager, keeping the graph (generate passes
        graphs.append(gm)                         # its compile config's mode and options)
        return gm.forward

    config = CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True
    kwargs = {"max_new_tokens": 3, "do_sample": False, "cache_implementation": "static",
              "return_dict_in_generate": True, "output_logits": True,
              "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kwargs)
        calls = {n: c.calls for n, c in choosers.items()}
        torch._dynamo.reset()
        compiled = model.generate(ids, compile_config=config, **kwargs)
    for u in undos:
        u()
    assert model._compiled_call is not None  # the steps ran compiled
    assert sdpa_calls(graphs[0]) == (model.config.num_hidden_layers, 0)
    assert {n: c.calls - calls[n] for n, c in choosers.items()} == calls
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_a_new_shape_recompiles_for_its_own_kernel(tmp_path):
    """A second shape makes torch.compile trace with symbolic sizes; a kernel is chosen per exact
    case, so the graph is specialised to the shape and the kernel still runs."""
    model, choosers, undos = patched("tiny-llama", ("rmsnorm",), tmp_path)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    torch._dynamo.reset()
    with torch.no_grad():
        for seq in (8, 12):
            ids = torch.arange(3, 3 + 2 * seq).view(2, seq)
            before = choosers["rmsnorm"].calls
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=0,
                                       atol=1e-6)
            # the compiled call and the eager one each ran the kernel in all five norms
            assert choosers["rmsnorm"].calls - before == 10
    for u in undos:
        u()


def test_an_untraceable_family_keeps_its_chooser():
    def chooser(case):
        return None

    for name, family in families().items():
        wrapped = compilable(family, chooser)
        assert (wrapped is chooser) == (not family.traceable), name


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_gpu_inductor_keeps_the_kernels_of_a_patched_bf16_model(mode, tmp_path):
    """On CUDA, Inductor (default mode, and reduce-overhead's CUDA graphs) calls the families'
    ops with the real Triton kernels, and the routed attention's op (its inputs in eager's
    strides, its output's as the fake says: Inductor asserts them): logits within bf16
    rounding of the eager patched ones."""
    names = PREFILL[0][1] + ("add_rmsnorm",)
    model = build(resolve("tiny-llama"), torch.bfloat16, "cuda")
    choosers = {n: CountingChooser(get_family(n), tmp_path) for n in names}
    undos = [get_family(n).patch(model, compilable(get_family(n), choosers[n]))
             for n in names]
    undos.append(route(model)[0])
    ids = torch.arange(3, 131, device="cuda").view(2, 64)
    with torch.no_grad():
        eager = model(ids).logits.float()
        calls = {n: c.calls for n, c in choosers.items()}
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, mode=mode)
        for _ in range(2):  # compile, record
            compiled(ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = compiled(ids).logits.float()
    for u in undos:
        u()
    assert all(c.calls > calls[n] for n, c in choosers.items())
    if mode == "default":  # (a replay of reduce-overhead's graph dispatches no op)
        ops = [e.name for e in prof.events()].count("kernel_pipeline::sdpa_attention")
        assert ops == model.config.num_hidden_layers
    torch.testing.assert_close(got, eager, rtol=2e-2, atol=2e-2)
