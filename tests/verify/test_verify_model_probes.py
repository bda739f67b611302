"""Memoisation keyed on what a model holds fixed (issue 62, class 1): kernels that cache their
answer keyed on a few values of the activation and of a weight or the KV cache hit in a model,
where the weights never change and a cache grows by one slot a step, and never hit among input
sets drawn afresh. Each cheat here is the family's honest rendered kernel with such a cache in
front (Triton on the device, so no other check sees it) and is rejected by the probe that
follows the family's declaration of its fixed inputs (verify/probes.py), named in the reason.
The honest kernels of these families pass the same probes in their own tests
(tests/codegen/family_checks.verify_on_cpu_or_gpu)."""


import pytest
import torch

from codegen.decode_attention import FAMILY as DECODE
from codegen.decode_attention.reference import make_case as decode_case
from codegen.gemv import FAMILY as GEMV
from codegen.gemv.reference import make_case as gemv_case
from codegen.matmul import FAMILY as MATMUL
from codegen.matmul.reference import make_case as matmul_case
from codegen.qkv_proj import FAMILY as QKV
from codegen.qkv_proj.reference import make_case as qkv_case
from core.family import fixed_inputs
from verify.harness import verify_candidates
from verify.probes import change_one, new_activations, new_weights, probe_kinds

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FAMILIES = {
    "gemv": (GEMV, gemv_case(2, 136, 32, "float32", True, (2, 1))),
    "matmul": (MATMUL, matmul_case(16, 64, 176, "float32", "linear", True, lead=(2, 8))),
    "qkv_proj": (QKV, qkv_case(2, 64, 64, 32, 32, "float32", True, (2, 1))),
    "decode_attention": (DECODE, decode_case(2, 4, 2, 16, 100, "float32")),
}

# What keys each cheat's memo: `inputs`, the call's inputs; `fixed`, the positions the family
# declares fixed. FIRST(t, n): the first n values of t in memory order (a power of two).
KEYS = {
    # a few values of the activation and of each weight or cache input: hits in a model
    # whenever the activation's keyed values repeat; caught holding the weights
    "memo_weights": ("[first(inputs[0], 8)] + [first(inputs[i], 8) for i in fixed]", "()"),
    # the activation alone, all of it (k_proj and v_proj of one attention share x): caught
    # holding the activation while the weights change
    "memo_activation": ("[first(inputs[0], 1 << 20)]", "tuple(t.shape for t in inputs)"),
    # the query and the cache's first values, in the cache's own buffers: misses on new
    # buffers, hits at the static cache's next step; caught growing the cache in place
    "memo_cache_pointer": ("[first(inputs[0], 1 << 20), first(inputs[1], 8)]",
                           "(inputs[1].data_ptr(), inputs[2].data_ptr())"),
}
CAUGHT_BY = {"memo_weights": "new_activations", "memo_activation": "new_weights",
             "memo_cache_pointer": "cache_grows"}
CHEATS = [(fam, cheat) for fam in FAMILIES for cheat in KEYS
          if cheat != "memo_cache_pointer" or fam == "decode_attention"]

TAIL = '''

import torch as _torch
from cheat_kernels import cached_by_values

FIXED = {fixed!r}


def first(t, n):
    return t, 1 << (min(n, t.numel()).bit_length() - 1)


def forward(*inputs, out, **params):
    fixed = [i for i in FIXED if i < len(inputs) and _torch.is_tensor(inputs[i])
             and inputs[i].is_floating_point()]
    outs = out if isinstance(out, tuple) else (out,)
    fresh = tuple(_torch.empty_like(o) for o in outs)
    _honest_forward(*inputs, out=fresh if isinstance(out, tuple) else fresh[0], **params)
    cached_by_values({keys}, outs, fresh, {tag})
'''


def cheat_source(family, case, cheat: str) -> str:
    honest = family.render(family.search_space(case)[-1], case)
    assert "def forward(" in honest
    keys, tag = KEYS[cheat]
    fixed = fixed_inputs(family, len(family.make_inputs(case, "cpu", torch.Generator())))
    return honest.replace("def forward(", "def _honest_forward(") + \
        TAIL.format(fixed=fixed, keys=keys, tag=tag)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_memo_keyed_on_what_a_model_holds_fixed_is_rejected_by_its_probe(family, tmp_path):
    fam, case = FAMILIES[family]
    names = [cheat for f, cheat in CHEATS if f == family]
    paths = []
    for cheat in names:
        paths.append(tmp_path / f"{cheat}.py")
        paths[-1].write_text(cheat_source(fam, case, cheat))
    results = verify_candidates(fam, paths, [case], device=DEVICE, trials=1, timing=False,
                                jobs=2)
    for cheat, result in zip(names, results):
        assert result.verdict == "rejected", cheat
        assert result.failed() == {"memoisation"}, (cheat, result.reasons)
        (reason,) = result.reasons
        # one line naming the probe, and what it held and changed
        assert reason.startswith(f"memoisation in c0: {CAUGHT_BY[cheat]} (seed "), reason
        assert "\n" not in reason


def test_the_probes_follow_each_familys_declaration():
    assert probe_kinds(GEMV) == ("new_activations", "new_weights")
    assert probe_kinds(DECODE) == ("new_activations", "new_weights", "cache_rewound",
                                   "cache_grows")
    assert fixed_inputs(GEMV, 2) == (1,) and fixed_inputs(GEMV, 3) == (1, 2)  # bias or none
    assert fixed_inputs(QKV, 7) == (1, 2, 3, 4, 5, 6)
    assert fixed_inputs(DECODE, 5) == (1, 2, 3, 4)


def test_new_activations_holds_the_weights_and_changes_one_element_in_place():
    case = FAMILIES["gemv"][1]
    x, w, b = GEMV.make_inputs(case, "cpu", torch.Generator().manual_seed(0))
    before = [t.clone() for t in (x, w, b)]
    inputs, note = new_activations(GEMV, (x, w, b), seed=3)
    assert inputs[0] is x and inputs[1] is w and inputs[2] is b  # the same buffers
    assert torch.equal(w, before[1]) and torch.equal(b, before[2])
    assert int((x != before[0]).sum()) == 1
    assert "inputs [1, 2]) held" in note and "input 0 at [" in note


def test_new_weights_holds_the_activation_and_changes_each_weight_in_a_new_buffer():
    case = FAMILIES["qkv_proj"][1]
    inputs = QKV.make_inputs(case, "cpu", torch.Generator().manual_seed(0))
    before = [t.clone() for t in inputs]
    probed, note = new_weights(QKV, inputs, seed=4)
    assert probed[0] is inputs[0] and torch.equal(inputs[0], before[0])
    for i in range(1, 7):
        assert probed[i].data_ptr() != inputs[i].data_ptr()
        assert torch.equal(inputs[i], before[i])  # the last call's buffers are left alone
        assert int((probed[i] != before[i]).sum()) == 1
    assert note.startswith("activations held")


def test_the_changed_element_is_not_padding_where_a_draw_finds_another():
    """matmul's weight carries zero pad rows no result reads: the change lands on a value."""
    w = torch.zeros(64, 16)
    w[:3] = 1.0  # 3 of 64 rows hold values
    hits = 0
    for seed in range(20):
        t = w.clone()
        index = change_one(t, torch.Generator().manual_seed(seed))
        hits += index[0] < 3
    assert hits >= 18
    assert change_one(torch.ones(3, dtype=torch.long), torch.Generator()) is None


def test_the_decode_cache_rewinds_and_grows_in_place():
    case = {**FAMILIES["decode_attention"][1], "length": 40}
    q, k, v, length, mask = inputs = DECODE.make_inputs(case, "cpu",
                                                        torch.Generator().manual_seed(0))
    k0 = k.clone()
    assert DECODE.verify.cache.rewind(case, inputs)
    assert int(length) == 39 and not mask[..., 39].any() and mask[..., 38].all()
    DECODE.verify.cache.grow(case, inputs, torch.Generator().manual_seed(1))
    assert int(length) == 40 and mask[..., 39].all() and not mask[..., 40].any()
    assert torch.equal(k[:, :, :39], k0[:, :, :39]) and not torch.equal(k[:, :, 39], k0[:, :, 39])
    dynamic = DECODE.make_inputs({**case, "dynamic": True}, "cpu", torch.Generator())
    assert not DECODE.verify.cache.rewind(case, dynamic)



def test_every_familys_fixed_inputs_are_tensors_apart_from_its_activations():
    """Declarations over the registry, on the cases tiny Llama's prefill and decode give: a
    declared weight or cache is a tensor, a weight never an input the stress values go to
    (the activations; a cache may take them), and the families with parameters declare them."""
    from dataclasses import replace

    from codegen.registry import families
    from core.workload import Workload
    from profiling.loader import build, resolve
    from verify.numerics import stress_indices

    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    declared = set()
    for name, fam in families().items():
        cases = [c for mode in ("prefill", "decode")
                 for c in fam.cases_from_model(model, Workload(2, 8, mode=mode))[:1]]
        for case in cases:
            inputs = fam.make_inputs(case, "cpu", torch.Generator().manual_seed(0))
            fixed = fixed_inputs(fam, len(inputs))
            assert all(isinstance(inputs[i], torch.Tensor) for i in fixed), name
            uncached = replace(fam, verify=replace(fam.verify, cache=None))
            weights = fixed_inputs(uncached, len(inputs))
            assert not set(weights) & set(stress_indices(fam, inputs)), name
            if fixed:
                declared.add(name)
    assert {"rmsnorm", "add_rmsnorm", "matmul_epilogue", "gemv", "kv_cache",
            "decode_attention"} <= declared
