"""Decode-attention family: reference == transformers' sdpa_attention_forward on a static and a
dynamic cache, rendered kernels == reference at lengths near the edges (stale slots past the
length never read), split partials merged by the combine kernel and FUSED in the split
kernel (its counters back at zero after each call; a group's heads merged at once, each head's
splits summed in one head's order), the verifier accepts a candidate, and
the patch on tiny-llama (4 query heads over 2 kv heads): a StaticDecoder's eager steps and a
dynamic-cache step give the unpatched logits, the step stays free of host reads
(capturable), prefill keeps HF's code, undo restores. CPU runs the kernels under Triton's
interpreter (fp32, fp16); bf16 and Llama-3.2-1B's shape run on a GPU
(`codegen/decode_attention/bench.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_checks import (
    DEVICE,
    CountingChooser,
    assert_close,
    compiled_script_facts,
    instance_forwards,
    load_rendered,
    verify_on_cpu_or_gpu,
)
from transformers import DynamicCache

from codegen.decode_attention import FAMILY
from codegen.decode_attention.reference import make_case
from core.workload import Workload
from models.graphs import StaticDecoder, cache_argument, host_reads
from profiling.loader import build, resolve

TOL = {"float32": (2e-5, 2e-5), "float16": (2e-3, 2e-3), "bfloat16": (2e-2, 2e-2)}
KERNEL_DTYPES = ["float32", "float16", pytest.param("bfloat16", marks=pytest.mark.gpu)]
BASE = make_case(2, 4, 2, 16, 200, "float32")  # slots 256 (the bucket of 200)
# a left-padded batch whose sequences differ: the first sees its last slot only, the second
# every slot but one
RAGGED = {"length": 70, "pads": [69, 0], "holes": [-1, 35]}


def _inputs(case, seed=0):
    return FAMILY.make_inputs(case, DEVICE, torch.Generator(DEVICE).manual_seed(seed))


def _run(forward, case, inputs):
    out = FAMILY.make_out(case, inputs)
    out.fill_(float("nan"))
    forward(*inputs, out=out, **FAMILY.params(case))
    return out


def test_reference_is_the_hf_function_and_the_float64_math_agrees():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for extra in ({"length": 70}, {"dynamic": True, "length": 9}, {"padded": 2, "length": 30},
                  RAGGED, {"dynamic": True, "length": 9, "pads": [0, 4]}):
        case = {**BASE, **extra}
        q, k, v, length, mask = _inputs(case, 1)
        assert q.stride(1) == 16 and q.shape == (2, 4, 1, 16)  # HF's transposed view
        module = torch.nn.Module()
        module.num_key_value_groups, module.is_causal = 2, True
        want, _ = sdpa_attention_forward(module, q, k, v, mask, dropout=0.0,
                                         scaling=case["scale"])
        got = FAMILY.reference(q, k, v, length, mask, scale=case["scale"])
        assert got.shape == (2, 1, 4, 16) and torch.equal(got, want)
        exact = FAMILY.reference(q.double(), k.double(), v.double(), length, mask,
                                 scale=case["scale"])
        assert_close(got.double(), exact, TOL["float32"])


def test_per_sequence_masks_differ_and_each_sequence_gets_its_own():
    """The edge cases hold sequences whose masks differ (one sees a single slot, one all but
    one); the reference of a batch is each sequence's alone, and the first sequence's mask
    applied to the whole batch gives another answer."""
    edges = [c for c in FAMILY.edge_cases(BASE) if "pads" in c]
    assert any(not c.get("dynamic") for c in edges) and any(c.get("dynamic") for c in edges)
    for case in edges:
        q, k, v, length, mask = _inputs(case)
        rows = mask.reshape(case["batch"], -1)
        assert any(not torch.equal(rows[0], r) for r in rows[1:])
        got = FAMILY.reference(q, k, v, length, mask, scale=case["scale"])
        for b in range(case["batch"]):
            alone = FAMILY.reference(q[b:b + 1], k[b:b + 1], v[b:b + 1], length,
                                     mask[b:b + 1], scale=case["scale"])
            assert torch.equal(got[b:b + 1], alone)
        first_only = FAMILY.reference(q, k, v, length, mask[:1], scale=case["scale"])
        assert (first_only - got).abs().max() > 0.1
    ragged = next(c for c in edges if not c.get("dynamic"))
    visible = _inputs(ragged)[4].reshape(ragged["batch"], -1).sum(-1).tolist()
    assert 1 in visible and ragged["length"] - 1 in visible


def test_the_stale_slots_change_the_answer_when_unmasked():
    """The inputs' slots past the length differ from valid ones enough that a kernel reading
    them unmasked fails: attending to every slot gives another result."""
    case = {**BASE, "length": 70}
    q, k, v, length, mask = _inputs(case)
    masked = FAMILY.reference(q, k, v, length, mask, scale=case["scale"])
    every = FAMILY.reference(q, k, v, length, None, scale=case["scale"])
    assert (masked - every).abs().max() > 0.1


SPLIT4 = {"SPLITS": 4, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2}
FUSED4 = {**SPLIT4, "FUSED": True}  # the combine in the split kernel's last program
EDGES = [{"length": 1}, {"length": 64}, {"length": 65}, {"exact_slots": 200, "length": 200},
         {"dynamic": True, "length": 37}, RAGGED, {"dynamic": True, "length": 37, "pads": [3, 0]}]


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_rendered_kernels_match_the_reference_at_edge_lengths(dtype, tmp_path):
    """Every length on one program per kv head and on split chunks of 64 slots (boundaries at
    64/65; at 64 and below splits 1-3 are empty), merged by the combine kernel and FUSED; fp16
    and bf16 on the split kernels at a few."""
    base = {**BASE, "dtype": dtype}
    one = FAMILY.search_space(base)[-1]
    assert one["SPLITS"] == 1
    runs = [(one, EDGES), (SPLIT4, EDGES), (FUSED4, EDGES)] if dtype == "float32" else \
        [(SPLIT4, EDGES[1:4]), (FUSED4, EDGES[1:4])]
    for config, lengths in runs:
        forward = load_rendered(FAMILY, config, base, tmp_path)
        for extra in lengths:
            case = {**base, **extra}
            inputs = _inputs(case)
            before = [t.clone() if t is not None else None for t in inputs]
            out = _run(forward, case, inputs)
            assert all(b is None or torch.equal(t, b) for t, b in zip(inputs, before))
            assert_close(out, FAMILY.reference(*inputs, **FAMILY.params(case)), TOL[dtype])


def test_slots_past_the_length_are_never_read(tmp_path):
    """NaN in every stale slot (keys, values and mask True there): the output stays the
    reference's over the valid slots, for one program per kv head and for split chunks that
    start past the length (merged by either path)."""
    case = {**BASE, "length": 40}
    q, k, v, length, mask = _inputs(case)
    want = FAMILY.reference(q, k[:, :, :40], v[:, :, :40], None, None, scale=case["scale"])
    k[:, :, 40:], v[:, :, 40:] = float("nan"), float("nan")
    mask[..., 40:] = True
    for config in (FAMILY.search_space(case)[-1], SPLIT4, FUSED4):
        out = _run(load_rendered(FAMILY, config, case, tmp_path), case, (q, k, v, length, mask))
        assert torch.isfinite(out).all()
        assert_close(out, want, TOL["float32"])


def test_the_verifier_accepts_a_fused_split_candidate_in_float32(tmp_path):
    """fp32 is where the "large" stress overflows q.k to -inf at the length-1 edge (the case the
    H200 run rejected in bf16), and the split path is what the search picks on a GPU; FUSED, the
    family's guess, whose counters carry from call to call (the verifier's repeated and
    memoisation calls see each call's own result). The combine kernel's path shares the merge
    (`_merge_group`) and is held to the reference in the tests around this one."""
    verify_on_cpu_or_gpu(FAMILY, make_case(1, 8, 2, 16, 100, "float32"), tmp_path, FUSED4)


def test_all_minus_inf_kept_scores_give_nan_and_no_kept_slot_gives_zero(tmp_path):
    """Softmax's edges, as torch's SDPA has them: a row whose only kept score overflows to -inf
    is NaN (0/0), a -inf score beside a finite one weighs 0, and a row with every slot masked
    is 0 (the fully-masked convention), on one program and on split chunks."""
    case = {**BASE, "length": 70}
    q, k, v, length, mask = _inputs(case)
    q[0, 0] = 1e30  # head 0 of batch 0, kv head 0
    k[0, 0, 0], k[0, 0, 69] = -1e30, 1.0  # slot 0: -inf; slot 69: +1e30 * 16
    mask[0, ..., 1:69] = False  # batch 0 keeps slots 0 and 69
    mask[1] = False  # batch 1 keeps nothing
    for config in (FAMILY.search_space(case)[-1], SPLIT4, FUSED4):
        forward = load_rendered(FAMILY, config, case, tmp_path)
        out = _run(forward, case, (q, k, v, length, mask))
        assert torch.equal(out[0, 0, 0], v[0, 0, 69])  # the -inf slot 0 weighs 0
        assert (out[1] == 0).all()
        mask[0, ..., 69] = False  # now only the -inf slot is kept
        out = _run(forward, case, (q, k, v, length, mask))
        assert torch.isnan(out[0, 0, 0]).all() and torch.isfinite(out[0, 0, 1:]).all()
        mask[0, ..., 69] = True


def _counters(forward, case, device) -> torch.Tensor:
    """The FUSED candidate's arrival counters for `case`'s batch and kv heads (codegen.launch's,
    keyed by the inputs' device: cuda:0, not cuda)."""
    from codegen.launch import ARRIVALS

    return ARRIVALS[(device, case["batch"] * case["kv_heads"])]


@pytest.mark.parametrize("group", [1, 4, 7])
def test_fused_merge_equals_the_combine_kernel_and_leaves_its_counters_at_zero(group, tmp_path):
    """FUSED at GQA ratios 1, 4 and 7, batch 2, called three times in a row (the second with a
    ragged mask: a sequence that sees one slot; the third with a sequence that sees none): one
    kernel launched (the combine kernel is never called), the reference's result, the combine
    kernel's (bit for bit under the interpreter: one merge helper) and one split's (no merge)
    within the fp32 tolerance, and each call leaves its counter buffer, the same one, at zero
    for the next. The interpreter runs a launch's programs one after another, so the last
    split of each (batch, kv head) is the one that merges."""
    base = make_case(2, 2 * group, 2, 16, 200, "float32")
    fused = load_rendered(FAMILY, FUSED4, base, tmp_path)
    two = load_rendered(FAMILY, SPLIT4, base, tmp_path)
    one = load_rendered(FAMILY, FAMILY.search_space(base)[-1], base, tmp_path)
    fused.__globals__["_decode_combine_kernel"] = None  # launching it would raise
    counts = None
    hidden = {"length": 70, "pads": [0, 70]}  # the second sequence sees no slot: zeros
    for seed, extra in enumerate(({"length": 70}, RAGGED, hidden)):  # splits 2 and 3 empty
        case = {**base, **extra}
        inputs = _inputs(case, seed)
        got = _run(fused, case, inputs)
        assert_close(got, FAMILY.reference(*inputs, **FAMILY.params(case)), TOL["float32"])
        merged = _run(two, case, inputs)
        if DEVICE == "cpu":  # compiled, each kernel's own layout may order the split sums
            assert torch.equal(got, merged)
        assert_close(got, merged, TOL["float32"])
        assert_close(got, _run(one, case, inputs), TOL["float32"])
        now = _counters(fused, case, inputs[0].device)
        assert now.dtype == torch.int32 and now.shape == (4,) and (now == 0).all()
        assert counts is None or now is counts
        counts = now
    assert (got[1] == 0).all() and got[0].abs().sum() > 0


class _Launches:
    """Stands in for a kernel in a rendered module's globals: records each launch (grid,
    arguments) and runs it."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((grid, args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.parametrize("group", [1, 4, 7])
def test_the_group_merged_at_once_sums_the_splits_as_one_head_at_a_time(group, tmp_path):
    """16 splits (numpy's pairwise sum, which the interpreter's tl.sum runs, orders a row of 8
    or more otherwise than a column), GQA 1, 4 and 7, a masked slot and a left-padded
    sequence: the combine kernel relaunched on the same partials with the whole group in one
    chunk, in chunks of 2 heads (7: a partial last chunk) and one head at a time (the previous
    merge's [SPLITS, BLOCK_D] load per head) stores the same bits under the interpreter, and
    so does the FUSED tail; on a GPU each layout may order the sums its own way."""
    from codegen.decode_attention.kernel import merge_heads

    config = {"SPLITS": 16, "BLOCK_N": 16, "num_warps": 2, "num_stages": 2}
    case = {**make_case(2, 2 * group, 2, 16, 256, "float32"), "length": 200,
            "pads": [0, 37], "holes": [90, -1]}  # splits 13-15 empty
    two = load_rendered(FAMILY, config, case, tmp_path)
    fused = load_rendered(FAMILY, {**config, "FUSED": True}, case, tmp_path)
    combine = two.__globals__["_decode_combine_kernel"]
    launches = two.__globals__["_decode_combine_kernel"] = _Launches(combine)
    inputs = _inputs(case)
    want = _run(two, case, inputs).clone()
    (grid, args, kwargs), = launches.calls
    whole = merge_heads(group, 16, 16, kwargs["num_warps"])
    assert grid == (4,) and kwargs["MERGE_G"] == whole >= group
    o = args[2]
    for heads in (1, 2, whole):
        o.fill_(float("nan"))
        combine[grid](*args, **{**kwargs, "MERGE_G": heads})
        if DEVICE == "cpu":
            assert torch.equal(o.unsqueeze(1), want), heads
        assert_close(o.unsqueeze(1), want, TOL["float32"])
    got = _run(fused, case, inputs)
    assert_close(got, FAMILY.reference(*inputs, **FAMILY.params(case)), TOL["float32"])
    if DEVICE == "cpu":
        assert torch.equal(got, want)


def test_merge_heads_takes_the_whole_group_where_its_partials_fit():
    """At most 64 fp32 values of the [heads, splits, head_dim] tile a thread, in powers of two
    of heads: Llama-3.2-1B's group of 4 at 32 splits of 64 dims in one chunk at 4 warps, two
    at 2 warps; never fewer than one head."""
    from codegen.decode_attention.kernel import merge_heads

    assert merge_heads(4, 32, 64, 4) == 4 and merge_heads(4, 32, 64, 2) == 2
    assert merge_heads(7, 4, 16, 2) == 8 and merge_heads(1, 64, 128, 2) == 1
    assert merge_heads(8, 64, 256, 2) == 1  # a head alone is over the bound: merged anyway
    for group in range(1, 17):
        for splits in (2, 4, 8, 16, 32, 64):
            for warps in (1, 2, 4, 8):
                heads = merge_heads(group, splits, 64, warps)
                assert heads & (heads - 1) == 0 and heads <= max(group, 2 ** (group - 1)
                                                                  .bit_length())
                assert heads == 1 or heads * splits * 64 <= 64 * 32 * warps


def _sm90_compiler() -> bool:
    """Triton's CUDA backend and its cuobjdump, which compile and inspect without a GPU."""
    import triton

    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists()


@pytest.mark.skipif(not _sm90_compiler(), reason="no Triton CUDA backend with cuobjdump")
def test_the_merge_chunk_compiles_for_sm90_without_spilling():
    """merge_heads' bound: the space's heaviest merging kernels compiled for sm_90 spill
    nothing at the chunk it picks, and the combine kernel at twice the bound (a group of 8
    heads at once) takes more registers (Triton 3.9 spills it)."""
    usage = compiled_script_facts("decode_merge_regs.py")
    whole = usage.pop("combine_32_g7_d64_whole")
    assert len(usage) == 3 and whole["heads"] == 8
    assert whole["reg"] + whole["stack"] > usage["combine_32_g7_d64"]["reg"]
    for name, u in usage.items():
        assert u["stack"] == 0 and u["local"] == 0 and u["reg"] <= 255, (name, u)


def test_the_search_space_leads_with_fused_splits_and_fits_the_default_budget():
    """The FUSED configs first, each with splits to merge, the family's guesses
    (Family.leads) among them; the two-kernel tile the b1 searches picked is still in the
    space; one split last; at Llama-3.2-1B's b1 case the space fits a search's default trial
    budget (an unbudgeted search times all of it) and its guesses are 4-warp FUSED configs of
    16 and 32 splits."""
    from codegen.strategies import DEFAULT_TRIALS

    llama = make_case(1, 32, 8, 64, 1040, "bfloat16")
    for case in (llama, make_case(8, 32, 8, 64, 512, "bfloat16"), BASE):
        space = FAMILY.search_space(case)
        fused = [c for c in space if c.get("FUSED")]
        assert fused and all(c["SPLITS"] > 1 for c in fused)
        assert space[:len(fused)] == fused and space[:FAMILY.leads(case)] == fused[:3]
        assert space[-1]["SPLITS"] == 1 and len(space) == len({repr(c) for c in space})
    space = FAMILY.search_space(llama)
    assert len(space) <= DEFAULT_TRIALS and FAMILY.leads(llama) == 3
    assert {"SPLITS": 32, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2} in space
    assert [(c["SPLITS"], c["num_warps"]) for c in space[:3]] == [(16, 4), (32, 4), (32, 2)]


def test_rendered_source_is_specialised(tmp_path):
    config = {"SPLITS": 8, "BLOCK_N": 32, "num_warps": 2, "num_stages": 2}
    source = FAMILY.render(config, {**BASE, "dtype": "float16"})
    for line in ("HEAD_DIM = 16", 'DTYPE = "float16"', "SPLITS = 8", "BLOCK_N = 32",
                 "def _decode_split_kernel", "def _decode_combine_kernel",
                 "def forward(q, k, v, length, mask, *, out, scale=SCALE)",
                 "enable_fp_fusion=False", "LEN_ON_DEVICE"):
        assert line in source
    assert ".item()" not in source and ".cpu()" not in source  # capturable: no host read
    assert "FUSED = False" in source and "then a combine kernel" in source
    fused = FAMILY.render({**config, "FUSED": True}, {**BASE, "dtype": "float16"})
    assert "FUSED = True" in fused and "Launch: one kernel, 8 splits" in fused
    assert 'sem="acq_rel", scope="gpu"' in fused and 'cache_modifier=".cg"' in fused
    forward = load_rendered(FAMILY, config, {**BASE, "dtype": "float16"}, tmp_path)
    q, k, v, length, mask = _inputs(BASE)  # float32 into a float16 kernel
    with pytest.raises(ValueError, match="float16"):
        forward(q, k, v, length, mask, out=FAMILY.make_out(BASE, (q,)))


# ------------------------------------------------------------------ the patch on tiny-llama

@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build(resolve("tiny-llama"), torch.float32, DEVICE)


def _static_logits(model, prompt, steps, max_len=40):
    decoder = StaticDecoder(model, 1, max_len, graph=False)
    out = [decoder.prefill(prompt).clone()]
    out += [decoder.step(s).clone() for s in steps]
    return out, decoder


def test_patched_static_decode_gives_the_unpatched_logits_then_undo_restores(tiny, tmp_path):
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 500, (1, 6), generator=gen).to(DEVICE)
    steps = [torch.randint(3, 500, (1, 1), generator=gen).to(DEVICE) for _ in range(3)]
    want, _ = _static_logits(tiny, prompt, steps)
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        got, decoder = _static_logits(tiny, prompt, steps)
        # every step of both layers ran the kernel; the prefill (6 queries) kept HF's code
        assert chooser.calls == 2 * len(steps)
        assert chooser.distinct_cases() == [make_case(1, 4, 2, 16, 40, "float32")]
        assert host_reads(lambda: decoder.step(steps[0])) == []  # capturable as it stands
    finally:
        undo()
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, (1e-4, 1e-4))
    assert instance_forwards(tiny) == []
    again, _ = _static_logits(tiny, prompt, steps)
    assert all(torch.equal(a, w) for a, w in zip(again, want))


def test_patched_dynamic_cache_step_gives_the_unpatched_logits(tiny, tmp_path):
    ids = torch.randint(3, 500, (2, 5), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    nxt = ids[:, -1:]

    def step():
        cache = DynamicCache()
        with torch.no_grad():
            tiny(ids, use_cache=True, **{cache_argument(tiny): cache})
            return tiny(nxt, use_cache=True, **{cache_argument(tiny): cache}).logits

    want = step()
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(tiny, chooser)
    try:
        got = step()
    finally:
        undo()
    assert chooser.calls == 2
    assert_close(got, want, (1e-4, 1e-4))


def test_cases_from_model_are_the_decode_steps_and_match_the_dispatch(tiny):
    assert FAMILY.cases_from_model(tiny, Workload(2, 64, "float32", DEVICE)) == []
    cases = FAMILY.cases_from_model(tiny, Workload(1, 30, "float32", DEVICE, "decode"))
    assert cases == [make_case(1, 4, 2, 16, 31, "float32", tiny.model.layers[0].self_attn.scaling)]
    assert cases[0]["slots"] == 256  # a static cache of 40 slots dispatches to the same case


@pytest.mark.gpu
def test_gpu_llama_decode_shape_correct_and_faster_than_hf():
    """Llama-3.2-1B's step (b1, 32/8 heads, d 64, 1040 slots, length 1024, bf16): every config
    within bf16 error of the float64 reference, and the best under HF's sdpa path (repeat_kv
    or pack_gqa + SDPA with the mask) per call inside a CUDA graph."""
    from codegen.decode_attention.bench import run

    summary = run(1, 32, 8, 64, 1040, 1024, "bfloat16")
    assert summary["all_ok"], summary
    assert summary["speedup_graph"] > 1.0, summary


@pytest.mark.gpu
def test_gpu_fused_merge_replays_in_a_cuda_graph_at_successive_lengths(tmp_path):
    """A FUSED candidate (Llama-3.2-1B's heads, batch 2, bf16) called once, then captured twice
    back to back in a CUDA graph (with PDL where it runs: the second call's programs start
    early and must wait for the first's counter resets), replayed at lengths that leave splits
    empty, fill them all and take one slot: both calls of each replay are the reference over
    the valid slots, and the counters are back at zero."""
    from codegen import pdl

    case = {**make_case(2, 32, 8, 64, 1040, "bfloat16"), "exact_slots": 1040, "length": 1024}
    forward = load_rendered(FAMILY, {"SPLITS": 32, "BLOCK_N": 32, "num_warps": 2,
                                     "num_stages": 2, "FUSED": True}, case, tmp_path)
    q, k, v, length, _ = _inputs(case)
    outs = [FAMILY.make_out(case, (q, k, v, length, None)) for _ in range(2)]
    forward(q, k, v, length, None, out=outs[0], **FAMILY.params(case))  # allocates the counters
    graph = torch.cuda.CUDAGraph()
    with pdl.enabled(), torch.cuda.graph(graph):
        for out in outs:
            forward(q, k, v, length, None, out=out, **FAMILY.params(case))
    for n in (1024, 100, 1040, 1, 700):
        length.fill_(n)
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        want = FAMILY.reference(q, k[:, :, :n], v[:, :, :n], None, None, **FAMILY.params(case))
        for out in outs:
            assert_close(out, want, TOL["bfloat16"])
        assert (_counters(forward, case, q.device) == 0).all()


@pytest.mark.gpu
def test_gpu_patched_static_decode_captures_and_replays_at_successive_positions(tmp_path):
    """The patched tiny-llama's one-token step captured as a CUDA graph replays the eager
    patched logits at each position (the kernel reads the advancing length on the device)."""
    model = build(resolve("tiny-llama"), torch.bfloat16, "cuda")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 500, (1, 6), generator=gen).cuda()
    steps = [torch.randint(3, 500, (1, 1), generator=gen).cuda() for _ in range(4)]
    chooser = CountingChooser(FAMILY, tmp_path)
    undo = FAMILY.patch(model, chooser)
    try:
        want, _ = _static_logits(model, prompt, steps)
        graphed = StaticDecoder(model, 1, 40, graph=True)
        got = [graphed.prefill(prompt).clone()] + [graphed.step(s).clone() for s in steps]
        graphed.close()
    finally:
        undo()
    assert chooser.calls > 0
    for g, w in zip(got, want, strict=True):  # same kernels; cuBLAS may pick others in capture
        assert_close(g, w, TOL["bfloat16"])
