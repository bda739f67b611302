"""KV-cache family: reference == transformers' DynamicLayer.update, rendered kernels == reference
(empty cache, cached prefix, cropped cache, HF's strided states), pattern == what the profile's
matcher finds, per-call patching through the cache layer, composition with the other adapters
of the same attention modules, and undo. CPU runs the kernels under Triton's interpreter (fp32,
fp16); bf16 kernel checks run on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    instance_forwards,
    load_rendered,
    profiled_occurrences,
    run_candidate,
    space_ends,
)
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticLayer

from codegen.attention import FAMILY as ATTENTION
from codegen.kv_cache import FAMILY
from codegen.kv_cache.patch import _TICKETS, dynamic_layer, static_layer
from codegen.kv_cache.reference import (
    dynamic_layer_update,
    is_static,
    make_case,
    make_static_case,
    static_layer_update,
)
from codegen.rope import FAMILY as ROPE
from core.workload import Workload
from models.graphs import cache_argument, output_cache
from pipeline.stages.profile import summarise
from profiling.attribution import attribute
from profiling.loader import build, resolve
from profiling.patterns import BASE_PATTERNS, match
from profiling.trace import load_trace

KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
# (batch, kv_heads, head_dim, past, new): GQA prefill from an empty cache, a decode step after
# a cached prefix, a head_dim that is no power of two, a prime-length prefill.
SHAPES = [(2, 2, 16, 0, 8), (3, 2, 64, 9, 1), (2, 1, 96, 4, 3), (1, 4, 32, 0, 13)]
IDS = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))


def _states(case, seed):
    return FAMILY.make_inputs(case, "cpu", torch.Generator().manual_seed(seed))[2:]


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape and g.stride() == w.stride()
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_reference_is_bitwise_dynamic_layer_update(dtype):
    """A prefill into an empty layer, then a decode step: the real class, the verbatim copy of
    its body and kv_append (given what lazy_initialization leaves) agree bit for bit."""
    assert dynamic_layer() is DynamicLayer  # the installed update is the code we repeat
    layer, copy = DynamicLayer(), DynamicLayer()
    empty = torch.tensor([], dtype=getattr(torch, dtype))
    past = (empty, empty)
    for case in (make_case(2, 2, 16, 0, 5, dtype), make_case(2, 2, 16, 5, 1, dtype)):
        key_states, value_states = _states(case, seed=case["past"])
        assert case["new"] == 1 or not key_states.is_contiguous()  # HF's transposed views
        want = layer.update(key_states, value_states)
        _assert_same(dynamic_layer_update(copy, key_states, value_states), want)
        got = FAMILY.reference(*past, key_states, value_states)
        _assert_same(got, want)
        past = got
    assert layer.keys.shape == (2, 2, 6, 16)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rendered_matches_reference(shape, dtype, tmp_path):
    case = make_case(*shape, dtype)
    configs = FAMILY.search_space(case)
    assert 1 <= len(configs) <= 16
    for config in space_ends(configs):
        out, ref = run_candidate(FAMILY, config, case, tmp_path)
        _assert_same(out, ref)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_edge_cases(dtype, tmp_path):
    base = make_case(2, 2, 16, 0, 8, dtype)
    edges = FAMILY.edge_cases(base)
    assert any(c["new"] == 1 and c["past"] > 0 for c in edges)
    assert any(c.get("contiguous") for c in edges) and any(c.get("cropped") for c in edges)
    assert all(c[k] == base[k] for c in edges for k in ("kv_heads", "head_dim", "dtype"))
    for case in edges:
        out, ref = run_candidate(FAMILY, FAMILY.search_space(base)[-1], case, tmp_path,
                                 rendered_for=base)
        _assert_same(out, ref)


def test_rendered_source_is_specialised_and_checks_its_inputs(tmp_path):
    case = make_case(2, 2, 32, 3, 2, "float16")
    config = {"BLOCK_R": 8, "num_warps": 2}
    source = FAMILY.render(config, case)
    for line in ("KV_HEADS = 2", "HEAD_DIM = 32", "BLOCK_D = 32", "BLOCK_R = 8",
                 "NUM_WARPS = 2", "def _kv_append_kernel", "def _kv_copy_rows",
                 "def forward(keys, values, key_states, value_states, *, out, **params)"):
        assert line in source
    forward = load_rendered(FAMILY, config, case, tmp_path)
    keys, values, key_states, value_states = FAMILY.make_inputs(case)
    out = FAMILY.make_out(case, (keys, values, key_states))
    with pytest.raises(ValueError):  # head count other than the baked one
        forward(keys[:, :1], values[:, :1], key_states[:, :1], value_states[:, :1], out=out)
    with pytest.raises(ValueError):  # cat would promote to float32; the kernel copies bits
        forward(torch.tensor([]), torch.tensor([]), key_states, value_states,
                out=FAMILY.make_out(make_case(2, 2, 32, 0, 2, "float16"), (0, 0, key_states)))
    with pytest.raises(ValueError):
        forward(keys, values, key_states, value_states, out=out, dim=1)


def test_pattern_matches_the_profiled_updates_and_costs_them():
    """The H200 Llama trace (bf16, b8 s1024 prefill): each layer's DynamicLayer.update is one
    occurrence with its two cats, costed as the family's min_bytes."""
    path = Path(__file__).resolve().parents[1] / "fixtures" / "prefill_b8_s1024_2layer.json.gz"
    wall = {"median_ms": attribute(load_trace(path)).span_us / 1e3}
    ops = summarise(path, Workload(8, 1024, "bfloat16", "cuda"), wall)["ops"]
    found, _ = match(ops, list(BASE_PATTERNS) + list(FAMILY.patterns))
    updates = [[ops[i] for i in o.ops] for o in found
               if o.family == "kv_cache" and any(ops[i]["name"] == "aten::cat" for i in o.ops)]
    assert len(updates) == 2
    case = make_case(8, 8, 64, 0, 1024, "bfloat16")  # Llama-3.2-1B: 8 kv heads of 64
    for occurrence in updates:
        assert [o["name"] for o in occurrence] == ["aten::cat", "aten::cat"]
        assert FAMILY.patterns[0].cost(occurrence) == (FAMILY.min_bytes(case), 0)


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-qwen2"])
def test_pattern_is_found_in_profiled_tiny_models(model_id, tmp_path):
    model = build(resolve(model_id), torch.float32, "cpu")
    found = [ops for _, fam, ops in profiled_occurrences(model, tmp_path) if fam == "kv_cache"]
    updates = [ops for ops in found if "aten::cat" in ops]
    assert [ops["aten::cat"] for ops in updates] == [2] * model.config.num_hidden_layers
    # lazy_initialization's two torch.tensor([]) per layer are occurrences of their own
    assert sum(ops["aten::lift_fresh"] for ops in found) == 2 * model.config.num_hidden_layers


def _step(model, ids, cache=None):
    """(logits, cache) of one forward that fills or extends a cache."""
    kwargs = {} if cache is None else {cache_argument(model): cache}
    out = model(ids, use_cache=True, **kwargs)
    return out.logits, output_cache(out)


def _contents(cache) -> list:
    """Per layer: keys, values (update replaces them, so these stay as they are now) and
    every other attribute, where lazy_initialization's side effects show (device; dtype in
    5.17)."""
    return [((layer.keys, layer.values),
             {k: v for k, v in vars(layer).items() if k not in ("keys", "values")})
            for layer in cache.layers]


def _assert_same_cache(got: list, want: list):
    assert len(got) == len(want)
    for (tensors, fields), (want_tensors, want_fields) in zip(got, want):
        _assert_same(tensors, want_tensors)
        assert fields == want_fields


def test_patch_runs_the_kernel_on_prefill_and_decode_and_undo_restores(tmp_path):
    """Logits and the returned cache bitwise the unpatched model's, after the prefill and
    after a decode step with that cache; undo leaves nothing on modules or cache layers."""
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    layers = model.config.num_hidden_layers
    ids, step_ids = IDS.to(DEVICE), IDS[:, :1].to(DEVICE)
    with torch.no_grad():
        logits, cache = _step(model, ids)
        prefilled = _contents(cache)
        step_logits, cache = _step(model, step_ids, cache)
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        assert len(instance_forwards(model)) == layers
        patched, patched_cache = _step(model, ids)
        assert chooser.calls == layers
        patched_prefilled = _contents(patched_cache)
        patched_step, patched_cache = _step(model, step_ids, patched_cache)
        undo()
        after, _ = _step(model, ids)
    assert chooser.calls == 2 * layers
    assert chooser.distinct_cases() == (
        FAMILY.cases_from_model(model, Workload(2, 8))
        + [c for c in FAMILY.cases_from_model(model, Workload(2, 8, mode="decode"))
           if not is_static(c)])
    assert torch.equal(patched, logits) and torch.equal(patched_step, step_logits)
    _assert_same_cache(patched_prefilled, prefilled)
    _assert_same_cache(_contents(patched_cache), _contents(cache))
    assert torch.equal(after, logits)
    assert instance_forwards(model) == []
    assert all("update" not in vars(layer) for layer in patched_cache.layers)


ADAPTERS = {"rope": ROPE, "attention": ATTENTION, "kv_cache": FAMILY}


@pytest.mark.parametrize("order", [("rope", "kv_cache"), ("kv_cache", "rope"),
                                   ("kv_cache", "attention", "rope")])
@pytest.mark.parametrize("undo_order", ["as_patched", "reversed"])
def test_composes_with_the_other_attention_adapters(order, undo_order, tmp_path):
    """rope, attention and kv_cache all wrap the same attention instances: patched in any
    order each runs its kernel; undone in any order, the adapters still patched keep running
    theirs, and the last undo leaves the model as it was."""
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    layers = model.config.num_hidden_layers
    ids = IDS.to(DEVICE)
    with torch.no_grad():
        before, _ = _step(model, ids)
        choosers = {name: CountingChooser(ADAPTERS[name], tmp_path) for name in order}
        undos = {name: ADAPTERS[name].patch(model, choosers[name]) for name in order}
        live = list(order)
        for name in order if undo_order == "as_patched" else order[::-1]:
            calls = {n: c.calls for n, c in choosers.items()}
            patched, _ = _step(model, ids)
            torch.testing.assert_close(patched, before, atol=1e-4, rtol=1e-4)
            assert {n: c.calls - calls[n] for n, c in choosers.items()} == \
                {n: layers if n in live else 0 for n in order}
            undos[name]()
            live.remove(name)
        after, _ = _step(model, ids)
    assert torch.equal(after, before)
    assert instance_forwards(model) == []


def test_layers_of_other_types_and_late_layers_keep_their_code(tmp_path):
    """Sliding-window layers (tiny-mistral) never reach the kernel; a cache built without a
    config adds its layers inside Cache.update, so its first call keeps HF's code and the
    next one, with the layer in place, takes the kernel."""
    mistral = build(resolve("tiny-mistral"), torch.float32, DEVICE)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(mistral, chooser)
    with torch.no_grad():
        _step(mistral, IDS.to(DEVICE))
    undo()
    assert chooser.cases == [] and FAMILY.cases_from_model(mistral, Workload(2, 8)) == []

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(model, chooser)
    with torch.no_grad():
        _, cache = _step(model, IDS.to(DEVICE), DynamicCache())
        assert chooser.calls == 0
        _step(model, IDS[:, :1].to(DEVICE), cache)
    undo()
    assert chooser.calls == model.config.num_hidden_layers


def _changed_update(self, key_states, value_states, *args, **kwargs):
    """DynamicLayer.update as a later transformers might write it: one statement differs."""
    if not self.is_initialized:
        self.lazy_initialization(key_states, value_states)

    self.keys = torch.cat([self.keys, key_states.contiguous()], dim=-2)
    self.values = torch.cat([self.values, value_states], dim=-2)
    return self.keys, self.values


def test_a_changed_dynamic_layer_update_keeps_its_own_code(monkeypatch, tmp_path):
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    monkeypatch.setattr(DynamicLayer, "update", _changed_update)
    dynamic_layer.cache_clear()
    try:
        chooser = CountingChooser(FAMILY, tmp_path)
        undo = FAMILY.patch(model, chooser)
        # the attentions stay wrapped for the static layer's path, which is still known
        assert len(instance_forwards(model)) == (0 if static_layer() is None else
                                                 model.config.num_hidden_layers)
        with torch.no_grad():
            _step(model, IDS.to(DEVICE))
        undo()
        assert chooser.cases == []
        assert FAMILY.cases_from_model(model, Workload(2, 8)) == []
    finally:
        monkeypatch.undo()
        dynamic_layer.cache_clear()
    assert dynamic_layer() is DynamicLayer


def _changed_static_update(self, key_states, value_states, *args, **kwargs):
    """StaticLayer.update as another transformers might write it (the position read on the
    host): the static dispatcher must not stand in for it."""
    start = int(self.cumulative_length)
    self.keys[:, :, start:start + key_states.shape[-2]] = key_states
    self.values[:, :, start:start + key_states.shape[-2]] = value_states
    self.cumulative_length.add_(key_states.shape[-2])
    return self.keys, self.values


def test_a_changed_static_layer_update_keeps_its_own_code(monkeypatch):
    monkeypatch.setattr(StaticLayer, "update", _changed_static_update)
    static_layer.cache_clear()
    try:
        assert static_layer() is None
        model = build(resolve("tiny-llama"), torch.float32, DEVICE)
        assert not any(is_static(c) for c in FAMILY.cases_from_model(
            model, Workload(1, 8, mode="decode")))
    finally:
        monkeypatch.undo()
        static_layer.cache_clear()
    assert static_layer() is StaticLayer


def test_a_known_lazy_initialization_is_set_without_its_empty_tensors(tmp_path):
    """The installed transformers' lazy_initialization is one the dispatcher knows, so a
    patched prefill makes none of its two `torch.tensor([])` per layer (aten::lift_fresh),
    yet leaves every layer attribute as HF's code does (the prefill test above compares
    them all)."""
    from codegen.kv_cache.patch import initialised_attributes

    assert initialised_attributes() is not None
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)

    def lift_fresh() -> int:
        with torch.no_grad(), torch.profiler.profile() as prof:
            _step(model, IDS.to(DEVICE))
        return sum(e.name == "aten::lift_fresh" for e in prof.events())

    before = lift_fresh()
    undo = FAMILY.patch(model, CountingChooser(FAMILY, tmp_path))
    try:
        after = lift_fresh()
    finally:
        undo()
    assert before - after == 2 * model.config.num_hidden_layers


def _noted_initialization(self, key_states, value_states):
    """A lazy_initialization the dispatcher does not know: one more side effect."""
    self.device = key_states.device
    self.keys = torch.tensor([], dtype=key_states.dtype, device=self.device)
    self.values = torch.tensor([], dtype=value_states.dtype, device=self.device)
    self.noted = key_states.shape[-2]
    self.is_initialized = True


def test_an_unknown_lazy_initialization_runs_as_it_is(monkeypatch, tmp_path):
    from codegen.kv_cache.patch import initialised_attributes

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    monkeypatch.setattr(DynamicLayer, "lazy_initialization", _noted_initialization)
    initialised_attributes.cache_clear()
    try:
        with torch.no_grad():
            logits, cache = _step(model, IDS.to(DEVICE))
            want = _contents(cache)
            chooser = CountingChooser(FAMILY, tmp_path)
            undo = FAMILY.patch(model, chooser)
            patched, patched_cache = _step(model, IDS.to(DEVICE))
            undo()
        assert initialised_attributes() is None
        assert chooser.calls == model.config.num_hidden_layers  # the kernel still ran
        assert torch.equal(patched, logits)
        _assert_same_cache(_contents(patched_cache), want)
        assert all(layer.noted == IDS.shape[1] for layer in patched_cache.layers)
    finally:
        monkeypatch.undo()
        initialised_attributes.cache_clear()
    assert initialised_attributes() is not None


# the static layout: StaticLayer.update, what a captured decode step runs ---------------------

def test_static_reference_is_bitwise_static_layer_update():
    """The installed StaticLayer.update is the code the static dispatcher repeats, and the
    reference (out of place) gives what the real layer leaves in its buffers, bit for bit."""
    assert static_layer() is StaticLayer
    case = make_static_case(2, 2, 16, 1, "float32")
    keys, values, key_states, value_states, position = FAMILY.make_inputs(
        case, "cpu", torch.Generator().manual_seed(0))
    layer, copy = StaticLayer(keys.shape[2]), StaticLayer(keys.shape[2])
    for lay in (layer, copy):
        lay.lazy_initialization(key_states, value_states)
        lay.keys.copy_(keys)
        lay.values.copy_(values)
        lay.cumulative_length.fill_(int(position))
    want = FAMILY.reference(keys, values, key_states, value_states, position)
    _assert_same(layer.update(key_states, value_states), want)
    _assert_same(static_layer_update(copy, key_states, value_states), want)
    assert int(layer.cumulative_length) == int(position) + 1


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_static_kernel_writes_at_the_device_position_in_place_and_out_of_place(dtype,
                                                                               tmp_path):
    base = make_static_case(2, 2, 16, 1, dtype)
    edges = FAMILY.edge_cases(base)
    assert {c.get("position") for c in edges} >= {0, 8} and all(is_static(c) for c in edges)
    config = FAMILY.search_space(base)[-1]
    forward = load_rendered(FAMILY, config, base, tmp_path)
    for case in [base] + edges:
        out, ref = run_candidate(FAMILY, config, case, tmp_path, rendered_for=base)
        _assert_same(out, ref)
        inputs = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(1))
        ref = FAMILY.reference(*inputs)
        forward(*inputs, out=FAMILY.verify.in_place(inputs))  # the verifier's in-place run
        _assert_same(inputs[:2], ref)
        # the adapter's way: in place, and the same launch advances the position
        inputs = FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(2))
        ref, start = FAMILY.reference(*inputs), int(inputs[4])
        ticket = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        forward(*inputs, out=FAMILY.verify.in_place(inputs), ticket=ticket)
        _assert_same(inputs[:2], ref)
        assert int(inputs[4]) == start + case["new"] and int(ticket) == 0


def test_static_cache_decode_steps_take_the_kernel_and_match_hf(tmp_path):
    """Two steps of the static-cache decoder (models.graphs) patched: one kernel call per
    layer and step, the cache buffers and positions bitwise the unpatched decoder's, and
    neither the arange/add nor the index_copy_ of HF's update left; the decode workload lists
    the static case."""
    from models.graphs import StaticDecoder
    from verify.integrity import OpRecorder

    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
    layers = model.config.num_hidden_layers
    steps = IDS[:1, :2].to(DEVICE)
    runs = {}
    for name in ("hf", "patched"):
        dec = StaticDecoder(model, 1, 12, graph=False)
        dec.prefill(IDS[:1].to(DEVICE))
        chooser = CountingChooser(FAMILY, tmp_path, give=name == "patched")
        undo = FAMILY.patch(model, chooser)
        try:
            with OpRecorder() as rec:
                logits = [dec.step(steps[:, i:i + 1]).clone() for i in range(2)]
        finally:
            undo()
        runs[name] = (logits, dec, rec.counts, chooser)
    (want, hf, hf_ops, _), (got, dec, ops, chooser) = runs["hf"], runs["patched"]
    assert chooser.calls == 2 * layers
    assert chooser.distinct_cases() == [make_static_case(1, 2, 16, 1, "float32")]
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    for a, b in zip(dec.cache.layers, hf.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        assert int(a.cumulative_length) == int(b.cumulative_length) == IDS.shape[1] + 2
    assert hf_ops.get("aten::index_copy", 0) == 2 * 2 * layers
    assert ops.get("aten::index_copy", 0) == 0
    # the index's add and the counter's add_ per layer and step: the counter advances in the
    # kernel's own launch (its ticket back at 0 for the next one)
    assert hf_ops["aten::add"] - ops["aten::add"] == 2 * 2 * layers
    assert all(int(t) == 0 for t in _TICKETS.values())
    assert ops.get("aten::arange", 0) < hf_ops.get("aten::arange", 0)
    assert make_static_case(1, 2, 16, 1, "float32") in FAMILY.cases_from_model(
        model, Workload(1, 8, mode="decode"))
    assert not any(is_static(c) for c in FAMILY.cases_from_model(model, Workload(1, 8)))


def test_a_profiled_update_is_matched_to_its_kind_of_case():
    """The graph projection speeds a static cache's index_copy_ update up by the static case's
    speedup and a dynamic cache's cat by the dynamic case's at its past length."""
    static = [{"name": "aten::index_copy_", "shapes": [[1, 12, 528, 64], [], [1], [1, 12, 1, 64]]}]
    dynamic = [{"name": "aten::cat", "shapes": [[[1, 12, 512, 64], [1, 12, 1, 64]], []]}]
    of = FAMILY.rank.occurrence_case
    assert of(static) == {"layout": "static"}
    assert of(dynamic) == {"layout": None, "past": 512}
    s_case = {"batch": 1, "kv_heads": 12, "head_dim": 64, "new": 1, "layout": "static"}
    d_case = {"batch": 1, "kv_heads": 12, "head_dim": 64, "new": 1, "past": 512}
    from pipeline.projection.replay import scales as _scales

    row = {"kernel_correlations": [[1], [2], [3]], "target_us": 1.0, "time_us": 1.0,
           "occurrence_cases": [of(static), of(dynamic), {"layout": None, "past": 128}],
           "case_speedups": [[s_case, 7.0], [d_case, 1.8]]}
    assert _scales(row) == [pytest.approx(1 / 7.0), pytest.approx(1 / 1.8), None]
