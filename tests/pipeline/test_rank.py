"""The rank stage: Amdahl by hand, roofline by hand, pattern recognition on every tiny family,
ranking of the committed H200 traces in both regimes, and ranking.json of a tiny CPU run."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from codegen.registry import family_patterns
from core.artifacts import SCHEMA_VERSION, read_json
from core.workload import Workload
from pipeline.pattern_rows import pattern_rows
from pipeline.policy import choose_families
from pipeline.projection import replay as proj_replay
from pipeline.projection import workload as proj_workload
from pipeline.projection.workload import amdahl
from pipeline.stages import rank as rank_stage
from pipeline.stages.rank import rank_workload, run_rank
from profiling.attribution import attribute
from profiling.patterns import BASE_PATTERNS, match
from profiling.roofline import op_cost, roofline_us
from profiling.trace import load_trace, profiler_steps

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PREFILL = FIXTURES / "prefill_b8_s1024_2layer.json.gz"
DECODE = FIXTURES / "decode_b1_kv1024_2layer.json.gz"
# measured on the H200 the fixtures were traced on (`pipeline calibrate`)
H200 = {"bandwidth_GBps": 4128.5, "matmul_TFLOPs": 768.6, "launch_us": 8.5,
        "fused_launch_host_us": 17.3}
BF16 = "c10::BFloat16"


def _patterns():
    return list(BASE_PATTERNS) + family_patterns()


def _assert_claimed_once(ops, occ, unclaimed):
    claimed = [i for o in occ for i in o.ops]
    assert len(claimed) == len(set(claimed)), "an op is claimed by two occurrences"
    assert set(claimed).isdisjoint(unclaimed)
    assert sorted(set(claimed) | set(unclaimed)) == list(range(len(ops)))


# ------------------------------------------------------------------ 1. Amdahl by hand

def test_amdahl_forty_percent_four_times_faster():
    assert amdahl([(0.4, 4.0)]) == pytest.approx(1 / (0.6 + 0.1))
    assert amdahl([(0.4, 4.0)]) == pytest.approx(1.4286, abs=1e-4)


def test_amdahl_at_roofline_and_zero_share_gain_nothing():
    assert amdahl([(0.37, 1.0)]) == 1.0
    assert amdahl([(0.0, 50.0)]) == 1.0
    assert amdahl([]) == 1.0


def test_amdahl_two_parts_combined():
    # 20 % twice as fast, 30 % three times as fast: 1 / (0.5 + 0.1 + 0.1) = 1/0.7
    assert amdahl([(0.2, 2.0), (0.3, 3.0)]) == pytest.approx(1 / 0.7)
    # combined beats either part alone, and is not their product
    both = amdahl([(0.2, 2.0), (0.3, 3.0)])
    assert both > max(amdahl([(0.2, 2.0)]), amdahl([(0.3, 3.0)]))
    assert both != pytest.approx(amdahl([(0.2, 2.0)]) * amdahl([(0.3, 3.0)]))


# ------------------------------------------------------------------ 2. roofline by hand

def test_roofline_bandwidth_bound_add():
    # x + y on [8, 1024, 2048] bf16, as the profiler records it (alpha is a Scalar)
    op = {"name": "aten::add", "shapes": [[8, 1024, 2048], [8, 1024, 2048], []],
          "dtypes": [BF16, BF16, "Scalar"]}
    tensor = 8 * 1024 * 2048 * 2
    nbytes, flops = op_cost(op)
    assert (nbytes, flops) == (3 * tensor, 0)  # read x, read y, write out; alpha moves nothing
    t_mem_us = 3 * tensor / (4128.5e9) * 1e6  # 24.38 us
    assert roofline_us(nbytes, flops, H200) == pytest.approx(t_mem_us + 8.5)
    assert roofline_us(nbytes, flops, H200, launches=0) == pytest.approx(t_mem_us)
    assert roofline_us(nbytes, flops, H200, launches=3) == pytest.approx(t_mem_us + 3 * 8.5)


def test_roofline_flop_bound_linear():
    # q_proj of Llama-3.2-1B at b8 s1024: x [8,1024,2048] @ W[2048,2048]^T, no bias (None)
    op = {"name": "aten::linear", "shapes": [[8, 1024, 2048], [2048, 2048], []],
          "dtypes": [BF16, BF16, ""]}
    m, k, n = 8 * 1024, 2048, 2048
    nbytes, flops = op_cost(op)
    assert flops == 2 * m * n * k
    assert nbytes == (m * k + n * k + m * n) * 2  # x, W read, out written; a None bias is no tensor
    t_math_us = 2 * m * n * k / 768.6e12 * 1e6  # 89.41 us
    t_mem_us = nbytes / 4128.5e9 * 1e6  # 18.29 us
    assert t_math_us > 4 * t_mem_us
    assert roofline_us(nbytes, flops, H200) == pytest.approx(t_math_us + 8.5)


def _op(name, module, cls, calls, shapes, dtypes, time_us, wall_us, launches=1):
    return {"name": name, "module": module, "module_class": cls, "module_calls": calls,
            "functions": [], "shapes": shapes, "dtypes": dtypes, "strides": [],
            "time_us": time_us, "share": time_us / wall_us, "cpu_us": 10.0,
            "launches": launches,
            "kernels": [{"name": f"k_{name}", "us": time_us, "cat": "kernel",
                         "correlation": calls[-1], "stream": 7,
                         "by": name}]}


def _workload(ops, wall_us):
    return {"key": "prefill-b8-s1024-bf16", "workload": {}, "time_basis": "device",
            "wall": {"median_ms": wall_us / 1e3}, "ops": ops, "gpu_busy_share": 0.9,
            "rest_share": 1 - sum(o["share"] for o in ops)}


def _mlp_and_head(factor: float, wall_us: float = 10_000.0):
    """A SwiGLU MLP (silu in its act_fn child, mul in the MLP) and an lm_head Linear, each
    measured at `factor` times its roofline."""
    big = [8, 1024, 8192]
    silu_in, mul_in = [big], [big, big]
    fused_mlp = roofline_us(3 * math.prod(big) * 2, 0, H200)  # read gate, up; write product
    head = {"name": "aten::linear", "shapes": [[8, 1024, 2048], [2048, 2048], []],
            "dtypes": [BF16, BF16, ""]}
    head_floor = roofline_us(*op_cost(head), H200)
    ops = [
        _op("aten::silu", "model.layers.0.mlp.act_fn", "SiLUActivation", [1, 2, 3, 4], silu_in,
            [BF16], factor * fused_mlp * 0.4, wall_us),
        _op("aten::mul", "model.layers.0.mlp", "LlamaMLP", [1, 2, 3], mul_in, [BF16, BF16],
            factor * fused_mlp * 0.6, wall_us),
        _op("aten::linear", "lm_head", "Linear", [1, 5], head["shapes"], head["dtypes"],
            factor * head_floor, wall_us),
    ]
    return _workload(ops, wall_us), fused_mlp, head_floor


@pytest.mark.parametrize("factor", [1.0, 2.5])
def test_pattern_rows_attainable_speedup_is_measured_over_roofline(factor):
    w, fused_mlp, head_floor = _mlp_and_head(factor)
    rows = {r["pattern"]: r for r in pattern_rows(w, H200)}
    assert set(rows) == {"swiglu_mlp", "linear"}
    mlp, head = rows["swiglu_mlp"], rows["linear"]
    # the matmul family acts on projections under their roofline and declines them at it
    assert mlp["family"] == "gated_act"
    assert head["family"] == (None if factor == 1.0 else "matmul")
    assert ("declined" in head) == (factor == 1.0)
    assert mlp["op_calls"] == 2 and mlp["occurrences"] == 1
    assert mlp["roofline_us"] == pytest.approx(fused_mlp)
    assert head["roofline_us"] == pytest.approx(head_floor)
    assert mlp["attainable_speedup"] == pytest.approx(factor)
    assert head["attainable_speedup"] == pytest.approx(factor)
    if factor == 1.0:  # at the roofline: nothing to gain, exactly
        assert mlp["attainable_speedup"] == pytest.approx(1.0, abs=1e-12)
        assert proj_workload.amdahl([(mlp["share"], mlp["attainable_speedup"])]) == \
            pytest.approx(1.0, abs=1e-12)
    assert sum(r["share"] for r in rows.values()) + w["rest_share"] == pytest.approx(1.0)


@pytest.mark.parametrize("factor, ranked", [(3.0, True), (1.1, False), (1.0, False)])
def test_linear_rows_under_the_roofline_rank_the_matmul_family(factor, ranked):
    """GPT-2's LM head ran 8x under the peak: the matmul family acts there. Llama's projections
    run near it: the family declines (never chosen, never searched), and the row says so."""
    w, _, _ = _mlp_and_head(factor)
    out = rank_workload(w, H200, None)
    head = next(r for r in out["rows"] if r["pattern"] == "linear")
    assert head["family"] == ("matmul" if ranked else None)
    assert ("matmul" in choose_families({"workloads": [out]}, None)) == ranked
    if not ranked:
        assert head["declined"]["family"] == "matmul"
        assert "roofline" in head["declined"]["reason"]
    assert any(p["pattern"] == "linear" for p in out["cumulative"]) == ranked


def test_rows_with_headroom_and_no_family_are_listed_as_no_remedy():
    """No silent headroom: an unclaimed op 3x under its roofline and a row its family declines
    (attention: SDPA is faster) are listed with share and attainable speedup; a family row and
    a row at its roofline are not."""
    wall = 10_000.0
    big = [8, 1024, 2048]
    sub = {"name": "aten::sub", "shapes": [big, big], "dtypes": [BF16, BF16]}
    sub_floor = roofline_us(*op_cost(sub), H200)
    q = [8, 32, 1024, 64]
    sdpa = _op("aten::scaled_dot_product_attention", "model.layers.0.self_attn",
               "LlamaAttention", [1, 7], [q, q, q], [BF16] * 3, 2000.0, wall)
    sdpa["functions"] = [["sdpa_attention_forward", 70]]
    w, _, _ = _mlp_and_head(2.5, wall)
    w["ops"] += [_op("aten::sub", "model", "LlamaModel", [1], sub["shapes"], sub["dtypes"],
                     3 * sub_floor, wall), sdpa]
    out = rank_workload(w, H200, None)
    listed = {g["pattern"]: g for g in out["no_remedy"]}
    assert set(listed) == {"op:aten::sub @ LlamaModel", "attention"}
    row = listed["op:aten::sub @ LlamaModel"]
    assert row["attainable_speedup"] == pytest.approx(3.0)
    assert row["share"] == pytest.approx(3 * sub_floor / wall)
    assert row["why"] == "no kernel family replaces it"
    assert listed["attention"]["why"].startswith("attention: no competitive kernel")
    assert "attention" not in choose_families({"workloads": [out]}, None)
    assert rank_stage.no_remedy([{**r, "attainable_speedup": 1.1} for r in out["rows"]]) == []


def test_pattern_rows_faster_than_roofline_is_not_a_slowdown():
    w, _, _ = _mlp_and_head(0.5)
    for r in pattern_rows(w, H200):
        assert r["attainable_speedup"] == pytest.approx(1.0)


def _mlp_with_projections(wall_us: float = 10_000.0, with_up: bool = True):
    """One SwiGLU MLP as the profile records it: its Linear children's matmuls, silu in the
    act_fn child, mul in the MLP itself."""
    x, w = [8, 1024, 2048], [8192, 2048]
    lin = ([x, w, []], [BF16, BF16, ""])
    ops = [_op("aten::linear", "model.layers.0.mlp.gate_proj", "Linear", [1, 2, 3], *lin, 400.0,
               wall_us)]
    if with_up:
        ops.append(_op("aten::linear", "model.layers.0.mlp.up_proj", "Linear", [1, 2, 4], *lin,
                       400.0, wall_us))
    big = [8, 1024, 8192]
    ops += [
        _op("aten::silu", "model.layers.0.mlp.act_fn", "SiLUActivation", [1, 2, 5], [big], [BF16],
            60.0, wall_us),
        _op("aten::mul", "model.layers.0.mlp", "LlamaMLP", [1, 2], [big, big], [BF16, BF16],
            90.0, wall_us),
        _op("aten::linear", "model.layers.0.mlp.down_proj", "Linear", [1, 2, 6],
            [big, [2048, 8192], []], [BF16, BF16, ""], 400.0, wall_us),
    ]
    return ops


def test_an_alternative_pattern_extends_an_occurrence_with_its_absorbed_children():
    """The matmul-epilogue row is gated_act's occurrence plus the gate and up matmuls (not
    down_proj's); `match` itself never claims with it, so every other row is unchanged."""
    from profiling.patterns import alternatives

    pats = _patterns()
    ops = _mlp_with_projections()
    occ, unclaimed = match(ops, pats)
    _assert_claimed_once(ops, occ, unclaimed)
    assert sorted(o.pattern for o in occ) == ["linear", "linear", "linear", "swiglu_mlp"]
    alt = alternatives(occ, pats)
    assert [(o.pattern, o.family, o.extends) for o in alt] == \
        [("gated_mlp_gemm", "matmul_epilogue", "swiglu_mlp")]
    assert sorted(ops[i]["module"] for i in alt[0].ops) == [
        "model.layers.0.mlp", "model.layers.0.mlp.act_fn", "model.layers.0.mlp.gate_proj",
        "model.layers.0.mlp.up_proj"]
    # an MLP without one of the absorbed projections has no alternative occurrence
    occ2, _ = match(_mlp_with_projections(with_up=False), pats)
    assert alternatives(occ2, pats) == []


def test_alternative_rows_are_ranked_but_never_replaced_together():
    w = _workload(_mlp_with_projections(), 10_000.0)
    rows = {r["pattern"]: r for r in pattern_rows(w, H200)}
    alt, base = rows["gated_mlp_gemm"], rows["swiglu_mlp"]
    # it repeats the gate and up projections' ops too, so it overlaps the `linear` row
    assert alt["alternative_to"] == ["linear", "swiglu_mlp"] and base["alternative_to"] == []
    assert alt["time_us"] == pytest.approx(400 + 400 + 60 + 90)
    assert alt["flops"] == 2 * 2 * 8 * 1024 * 2048 * 8192
    ranked = rank_workload(w, H200, None)
    fam = [r["pattern"] for r in ranked["rows"] if r["family"]]
    assert set(fam) == {"gated_mlp_gemm", "swiglu_mlp"}
    curve = [p["pattern"] for p in ranked["cumulative"]]
    assert curve == fam[:1]  # the second overlaps the first: replacing both counts ops twice
    assert rank_stage.exclusive(list(reversed(ranked["rows"])))[-1]["pattern"] == fam[1]


# ------------------------------------------------------------------ 3. tiny models on the CPU

TINY = ["tiny-llama", "tiny-qwen2", "tiny-mistral", "tiny-gemma", "tiny-phi3", "tiny-gpt2"]


@pytest.fixture(scope="module", params=TINY)
def tiny(request, tmp_path_factory):
    from pipeline.stages.profile import summarise
    from profiling.capture import capture, make_runner, module_names
    from profiling.loader import build, resolve

    spec = resolve(request.param)
    model = build(spec, torch.float32, "cpu")
    wl = Workload(1, 8, "float32", "cpu")
    runner = make_runner(model, wl)
    names = module_names(model, runner)
    trace = tmp_path_factory.mktemp(request.param) / "trace.json.gz"
    ms = capture(runner, "cpu", trace)
    w = summarise(trace, wl, {"median_ms": ms}, names, ms)
    occ, unclaimed = match(w["ops"], _patterns())
    return request.param, model, w, occ, unclaimed


def _paths(model, pred):
    return sorted(n for n, m in model.named_modules() if pred(n, m))


def _by_pattern(occ):
    out: dict[str, list] = {}
    for o in occ:
        out.setdefault(o.pattern, []).append(o)
    return out


def test_tiny_every_op_claimed_at_most_once(tiny):
    _, _, w, occ, unclaimed = tiny
    _assert_claimed_once(w["ops"], occ, unclaimed)


def test_tiny_pattern_counts_per_layer(tiny):
    from transformers.pytorch_utils import Conv1D

    name, model, w, occ, _ = tiny
    layers = model.config.num_hidden_layers
    found = _by_pattern(occ)
    counts = Counter(o.pattern for o in occ)

    def modules(pattern):
        return sorted(o.module for o in found.get(pattern, []))

    # every projection once: one occurrence per nn.Linear / GPT-2 Conv1D module
    linears = _paths(model, lambda n, m: isinstance(m, (torch.nn.Linear, Conv1D)))
    assert modules("linear") == linears
    if name == "tiny-phi3":  # fused qkv_proj and gate_up_proj: 4 per layer + lm_head
        assert counts["linear"] == 4 * layers + 1
    elif name == "tiny-gpt2":  # c_attn, c_proj, c_fc, mlp c_proj + lm_head
        assert counts["linear"] == 4 * layers + 1
    else:  # q, k, v, o, gate, up, down + lm_head
        assert counts["linear"] == 7 * layers + 1

    attn = _paths(model, lambda n, m: type(m).__name__.endswith("Attention"))
    assert len(attn) == layers
    assert modules("attention") == attn

    if name == "tiny-gpt2":
        lns = _paths(model, lambda n, m: isinstance(m, torch.nn.LayerNorm))
        assert counts["layernorm"] == 2 * layers + 1
        assert modules("layernorm") == lns
        acts = _paths(model, lambda n, m: type(m).__name__ == "NewGELUActivation")
        assert counts["gelu_new"] == layers
        assert modules("gelu_new") == acts
        assert not {"rmsnorm", "rmsnorm_gemma", "rope", "swiglu_mlp"} & set(counts)
        return

    norms = _paths(model, lambda n, m: type(m).__name__.endswith("RMSNorm"))
    assert len(norms) == 2 * layers + 1
    norm_pat, other_norm = (("rmsnorm_gemma", "rmsnorm") if name == "tiny-gemma"
                            else ("rmsnorm", "rmsnorm_gemma"))
    assert counts[norm_pat] == 2 * layers + 1
    assert modules(norm_pat) == norms
    assert counts[other_norm] == 0, f"{name}: a {other_norm} occurrence was recognised"

    rope = "rope_partial" if name == "tiny-phi3" else "rope"
    assert counts[rope] == layers
    assert modules(rope) == attn  # one rotary application inside each attention call
    assert counts[{"rope": "rope_partial", "rope_partial": "rope"}[rope]] == 0

    mlp_pat = "geglu_mlp" if name == "tiny-gemma" else "swiglu_mlp"
    mlps = _paths(model, lambda n, m: type(m).__name__.endswith("MLP"))
    assert counts[mlp_pat] == layers
    assert modules(mlp_pat) == mlps
    assert counts[{"geglu_mlp": "swiglu_mlp", "swiglu_mlp": "geglu_mlp"}[mlp_pat]] == 0
    assert counts["layernorm"] == 0 and counts["gelu_new"] == 0

    # the residual adds of every pre-norm layer, Phi3's dropout-wrapped ones included
    decoder_layers = _paths(model, lambda n, m: type(m).__name__.endswith("DecoderLayer"))
    assert len(decoder_layers) == layers
    assert modules("add_rmsnorm") == decoder_layers
    assert counts["residual_add"] == 0


# ------------------------------------------------------------------ 4/5. H200 fixtures

def _fixture_workload(path: Path, wl: Workload) -> dict:
    from pipeline.stages.profile import summarise

    trace = load_trace(path)
    spans = sorted(s["dur"] for s in profiler_steps(trace))
    median_step_ms = attribute(trace).span_us / 1e3
    wall = {"median_ms": median_step_ms, "p10_ms": spans[0] / 1e3, "p90_ms": spans[-1] / 1e3}
    return summarise(path, wl, wall)


@pytest.fixture(scope="module")
def prefill():
    w = _fixture_workload(PREFILL, Workload(8, 1024, "bfloat16", "cuda"))
    return w, rank_workload(w, H200, PREFILL)


@pytest.fixture(scope="module")
def decode():
    w = _fixture_workload(DECODE, Workload(1, 1024, "bfloat16", "cuda", "decode"))
    return w, rank_workload(w, H200, DECODE)


def test_prefill_fixture_every_occurrence_found_once(prefill):
    w, _ = prefill
    occ, unclaimed = match(w["ops"], _patterns())
    _assert_claimed_once(w["ops"], occ, unclaimed)
    found = _by_pattern(occ)
    for pattern, n in {"rmsnorm": 2 * 2 + 1, "rope": 2, "swiglu_mlp": 2, "attention": 2,
                       "linear": 15}.items():
        mods = [o.module for o in found.get(pattern, [])]
        assert len(mods) == n, f"{pattern}: {len(mods)} occurrences, expected {n}"
        assert len(set(mods)) == n, f"{pattern}: one module claimed twice"
    assert all("RMSNorm" in o.module_class for o in found["rmsnorm"])
    assert all(o.module_class in ("Linear",) for o in found["linear"])
    assert "rmsnorm_gemma" not in found


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_fixture_shares_and_rest_sum_to_one(which, request):
    w, ranked = request.getfixturevalue(which)
    assert sum(o["share"] for o in w["ops"]) + w["rest_share"] == pytest.approx(1.0, abs=1e-9)
    # alternatives repeat ops; the CUDA-graph row is the rest row's remedy, not more time
    own = [r for r in ranked["rows"] if not r["alternative_to"] and not r.get("remedy")]
    assert sum(r["share"] for r in own) + w["rest_share"] == pytest.approx(1.0, abs=1e-9)
    assert all(r["share"] >= 0 for r in ranked["rows"])
    assert w["rest_share"] >= 0


def test_prefill_rank_is_device_bound_and_by_replay(prefill):
    w, ranked = prefill
    assert ranked["ranked_by"] == "replay_gain"
    assert ranked["launch_bound"] is False
    assert ranked["regime"].startswith("device-bound")
    rows = [r for r in ranked["rows"] if not r.get("remedy")]
    fam = [r for r in rows if r["family"]]
    assert {r["pattern"] for r in fam} >= {"rmsnorm", "rope", "swiglu_mlp"}
    # candidates first, by replay gain, each with a replay gain
    assert rows[:len(fam)] == fam
    gains = [r["replay_gain"] for r in fam]
    assert all(g is not None and g >= 1.0 for g in gains)
    assert gains == sorted(gains, reverse=True)
    for r in rows:
        assert r["amdahl_gain"] == pytest.approx(amdahl([(r["share"], r["attainable_speedup"])]))
        assert r["attainable_speedup"] >= 1.0 - 1e-12
        assert "kernel_correlations" not in r


def test_prefill_gain_is_in_memory_bound_families_not_matmuls(prefill):
    _, ranked = prefill
    rows = {r["pattern"]: r for r in ranked["rows"]}
    linear = rows["linear"]
    assert linear["share"] > 0.5  # the matmuls are most of the time ...
    assert linear["attainable_speedup"] < 1.3  # ... and already near their roofline
    fam = [r for r in ranked["rows"] if r["family"]]
    fam_gain = sum(r["amdahl_gain"] - 1 for r in fam)
    assert fam_gain > linear["amdahl_gain"] - 1
    assert ranked["ceiling_amdahl"] > linear["amdahl_gain"]
    others = sum(r["amdahl_gain"] - 1 for r in ranked["rows"] if not r["family"])
    assert fam_gain > others  # the family rows carry most of the projected gain
    assert rows["rmsnorm"]["attainable_speedup"] > 2  # unfused fp32 norm: far off its roofline


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_cumulative_curve(which, request):
    _, ranked = request.getfixturevalue(which)
    fam = [r for r in ranked["rows"] if r["family"]]
    curve = ranked["cumulative"]
    assert [p["n"] for p in curve] == list(range(1, len(fam) + 1))
    assert [p["pattern"] for p in curve] == [r["pattern"] for r in fam]
    amd = [p["amdahl"] for p in curve]
    assert all(b >= a - 1e-12 for a, b in zip(amd, amd[1:]))
    assert amd[-1] == pytest.approx(amdahl([(r["share"], r["attainable_speedup"]) for r in fam]))
    assert ranked["ceiling_amdahl"] == amd[-1]
    assert all(p["replay"] is not None and p["replay"] >= 1.0 - 1e-9 for p in curve)


def test_decode_is_launch_bound_and_kernels_gain_little(decode):
    w, ranked = decode
    assert ranked["launch_bound"] is True
    assert w["gpu_busy_share"] < proj_replay.LAUNCH_BOUND_BUSY
    regime = ranked["regime"]
    assert regime.startswith("launch-bound")
    if "largest host costs" in regime:
        top = sorted(ranked["rows"], key=lambda r: -r["host_us"])[:3]
        named = regime.split("largest host costs: ", 1)[1].split(", ")
        assert named == [r["pattern"] for r in top]
    else:
        assert "CUDA graphs" in regime
    fam = [r for r in ranked["rows"] if r["family"]]
    assert fam
    all_fam = amdahl([(r["share"], r["attainable_speedup"]) for r in fam])
    assert all_fam < 1.05
    assert ranked["ceiling_amdahl"] == pytest.approx(all_fam)


def test_replay_host_delta_already_pays_for_the_removed_launches(decode):
    """A measured host delta is the whole host cost difference of a call, launch calls
    included: with no kernel speedup, a zero delta projects no gain (the removed launch nodes
    come back as host time), and a negative one a slowdown, in a launch-bound pass."""
    w, _ = decode
    graph = proj_replay.workload_graph(w, DECODE)
    rows = [r for r in pattern_rows(w, H200) if r["family"] and r["launches"] > 1]
    assert rows
    for r in rows:
        r["target_us"] = r["time_us"]
    base = proj_replay.replay_gain(graph, [dict(r, host_delta_us=None) for r in rows])
    even = proj_replay.replay_gain(graph, [dict(r, host_delta_us=0.0) for r in rows])
    worse = proj_replay.replay_gain(graph, [dict(r, host_delta_us=-20.0) for r in rows])
    better = proj_replay.replay_gain(graph, [dict(r, host_delta_us=20.0) for r in rows])
    assert base > 1.0  # merging launches, as the rank stage assumes before a kernel exists
    assert even == pytest.approx(1.0, abs=0.01)
    assert worse < 1.0 < better


def test_replay_speeds_up_only_the_occurrences_an_accepted_case_covers(prefill):
    """A family whose accepted case covers one occurrence of its row (GPT-2's matmul: the LM
    head, not the 48 Conv1D GEMMs) projects what replaying that occurrence alone projects, its
    measured host delta paid once, not once per occurrence of the row."""
    w, _ = prefill
    graph = proj_replay.workload_graph(w, PREFILL)
    row = next(r for r in pattern_rows(w, H200) if r["pattern"] == "kv_cache")
    n = len(row["kernel_correlations"])
    assert n > 1
    covered = dict(row, target_us=row["time_us"] / 4.0,
                   occurrence_cases=[{"n": 1}] + [{"n": 2}] * (n - 1),
                   case_speedups=[[{"n": 1, "dtype": "bfloat16"}, 4.0]])
    alone = dict(row, kernel_correlations=row["kernel_correlations"][:1],
                 target_us=row["time_us"] / 4.0, occurrence_cases=None, case_speedups=None)
    every = dict(covered, occurrence_cases=None, case_speedups=None)
    for host in (None, -20.0):
        got = proj_replay.replay_gain(graph, [dict(covered, host_delta_us=host)])
        want = proj_replay.replay_gain(graph, [dict(alone, host_delta_us=host)])
        assert got == pytest.approx(want, rel=1e-9)
        assert got < proj_replay.replay_gain(graph, [dict(every, host_delta_us=None)])


def test_row_times_speed_up_only_the_occurrences_an_accepted_case_covers(prefill):
    """The report's per-family table reads each row's projected time from the replay: one
    covered occurrence of a row loses three quarters of its own kernels' time, the others
    keep theirs (the family's 4x over the whole row would have been a quarter of it)."""
    from profiling.replay import kernel_table

    w, _ = prefill
    graph = proj_replay.workload_graph(w, PREFILL)
    row = next(r for r in pattern_rows(w, H200) if r["pattern"] == "kv_cache")
    dur = {k["correlation"]: k["dur_us"] for k in kernel_table(graph)}
    occ = [sum(dur.get(c, 0.0) for c in corr) for corr in row["kernel_correlations"]]
    i = next(i for i, t in enumerate(occ) if t > 0)  # an occurrence with kernels traced
    first = occ[i]
    covered = dict(row, target_us=row["time_us"] / 4.0,
                   occurrence_cases=[{"n": 1} if j == i else {"n": 2} for j in range(len(occ))],
                   case_speedups=[[{"n": 1, "dtype": "bfloat16"}, 4.0]])
    got = proj_replay.row_times(graph, [covered])
    assert got == {"kv_cache": pytest.approx(row["time_us"] - 0.75 * first)}
    every = proj_replay.row_times(graph, [dict(covered, occurrence_cases=None,
                                               case_speedups=None)])
    assert every["kv_cache"] == pytest.approx(row["time_us"] - 0.75 * sum(occ))
    assert every["kv_cache"] < got["kv_cache"]


# ------------------------------------------------------------------ 6. ranking.json

def test_run_rank_writes_ranking_json(tmp_path, monkeypatch):
    from pipeline.stages.profile import run_profile
    from profiling.loader import resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # measure, don't reuse
    run_dir = tmp_path / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # torch's default on a 2-core machine
    try:
        profile = run_profile(resolve("tiny-llama"), [Workload(1, 16)], run_dir)
        # timed on one intra-op thread (core.env.steady_cpu_timing), and the profile says so
        assert torch.get_num_threads() == 1 and profile["environment"]["cpu_threads"] == 1
    finally:
        torch.set_num_threads(threads)
    ranking = run_rank(run_dir)
    on_disk = read_json(run_dir / rank_stage.RANKING, "ranking")
    assert on_disk["schema_version"] == SCHEMA_VERSION
    assert on_disk["stage"] == "rank" and on_disk["model"] == "tiny-llama"
    assert [w["key"] for w in on_disk["workloads"]] == ["prefill-b1-s16-fp32"]
    assert on_disk["workloads"][0]["rows"] == ranking["workloads"][0]["rows"]
    rest = {w["key"]: w["rest_share"] for w in profile["workloads"]}
    for w in on_disk["workloads"]:
        assert w["time_basis"] == "cpu" and w["ranked_by"] == "amdahl_gain"
        own = [r for r in w["rows"] if not r["alternative_to"] and not r.get("remedy")]
        assert sum(r["share"] for r in own) + rest[w["key"]] == pytest.approx(1.0, abs=1e-9)
        # no CUDA graph on the CPU: the host's remedy is never a row there (it was ranked
        # first at 98.9 % on tiny-gpt2 once the rest row swelled on a busy core)
        assert not [r for r in w["rows"] if r.get("remedy")]
        assert rank_stage.GRAPH_PATTERN not in {r["pattern"] for r in w["rows"]}
        # the named tiny model has the matmul-epilogue alternative beside gated_act's row
        alt = next(r for r in w["rows"] if r["alternative_to"])
        assert alt["family"] == "matmul_epilogue"
        assert alt["alternative_to"] == ["linear", "swiglu_mlp"]
        pats = {r["pattern"] for r in w["rows"]}
        assert {"rmsnorm", "rope", "swiglu_mlp", "linear", "attention"} <= pats


def test_wall_time_reports_the_enqueue_time_within_the_wall():
    from profiling.capture import wall_time

    class Runner:
        def call(self):
            torch.ones(64, 64) @ torch.ones(64, 64)

        def reset(self):
            pass

    wall = wall_time(Runner(), "cpu", warmup=1, reps=5)
    assert 0 < wall["enqueue_ms"] <= wall["max_ms"]


def test_enqueue_time_sets_the_host_scale_when_it_is_the_tighter_bound(decode):
    """The unprofiled time model() takes to return is the host's own time: a workload that
    records it gets its host chain scaled to it (when tighter than the wall's bound), and a
    faster host shortens the replayed pass."""
    from profiling.replay import HOST_KINDS, build_graph

    w, _ = decode
    host_us = sum(a["dur"] for _, a in build_graph(load_trace(DECODE)).nodes(data=True)
                  if a["kind"] in HOST_KINDS)
    plain = proj_replay.workload_graph(w, DECODE)
    fast = dict(w, wall={**w["wall"], "enqueue_ms": host_us * 0.1 / 1e3})
    graph = proj_replay.workload_graph(fast, DECODE)
    assert graph.graph["host_scale"] == pytest.approx(0.1)
    assert plain.graph["host_scale"] > 0.1
    slow = dict(w, wall={**w["wall"], "enqueue_ms": host_us * 10 / 1e3})
    assert proj_replay.workload_graph(slow, DECODE).graph["host_scale"] == \
        plain.graph["host_scale"]
    from profiling.replay import replay

    assert replay(graph) < replay(plain)


def test_host_probe_tightens_a_device_bound_pass_only(decode, prefill):
    """The host-bound probe (a tiny pass, profiled apart) may make a device-bound pass's host
    chain faster than its wall allows, since such a wall hides the host; a launch-bound
    pass's wall is its host chain, so there the probe is not used and the replayed unpatched
    pass keeps its measured wall (run 14 replayed a 16.1 ms pass in 9.6 ms)."""
    from profiling.replay import replay

    for (w, _), trace, used in ((decode, DECODE, False), (prefill, PREFILL, True)):
        w = {k: v for k, v in w.items() if k != "host_factor"}
        plain = proj_replay.workload_graph(w, trace)
        probed = proj_replay.workload_graph(
            dict(w, host_factor=plain.graph["host_scale"] / 3), trace)
        assert (probed.graph["host_scale"] < plain.graph["host_scale"]) is used
        if not used:
            assert replay(probed) == pytest.approx(w["wall"]["median_ms"] * 1e3, rel=0.01)
    assert decode[0]["gpu_busy_share"] < proj_replay.LAUNCH_BOUND_BUSY \
        <= prefill[0]["gpu_busy_share"]


def test_project_with_a_slower_host_replays_the_host_chain_that_much_longer(prefill, tmp_path,
                                                                           monkeypatch):
    """`host_scale` (the timing's host speed against the profile's) lengthens every host node
    of the calibrated graph: a row sped up 20x gains less once the host, three times slower,
    sets the pace, and exactly what the replay of the scaled graph says."""
    import shutil

    from profiling.replay import scale_host

    w, _ = prefill
    (tmp_path / "trace").mkdir()
    shutil.copy(PREFILL, tmp_path / "trace" / "w.json.gz")
    profile = {"ceilings": H200, "workloads": [{**w, "key": "w", "trace": "trace/w.json.gz"}]}
    monkeypatch.setattr(proj_workload, "load", lambda path, model, kind=None: model.of(profile))
    row = max((r for r in pattern_rows(w, H200) if r["family"]),
              key=lambda r: r["time_us"])
    speed = {row["pattern"]: 20.0}
    same = proj_workload.project_with(tmp_path, "w", speed)
    assert proj_workload.project_with(tmp_path, "w", speed, host_scale=1.0) == same
    slow = proj_workload.project_with(tmp_path, "w", speed, host_scale=3.0)
    assert slow < same
    graph = scale_host(proj_replay.workload_graph(w, PREFILL), 3.0)
    assert slow == pytest.approx(proj_replay.replay_gain(graph, [
        dict(row, target_us=row["time_us"] / 20.0, host_delta_us=None, case_speedups=None)]))


def test_replay_keeps_each_rows_host_saving_on_its_own_launches(decode):
    """Savings add up across rows that do not interact: a row whose claimed host saving is
    larger than its own host segments can hold must not spill it onto another row's launches
    (which over-projected a four-family set by 6 % on the H200)."""
    from profiling.replay import replay

    w, _ = decode
    graph = proj_replay.workload_graph(w, DECODE)
    base = replay(graph)
    rows = [r for r in pattern_rows(w, H200) if r["family"] and r["launches"] > 1]
    assert len(rows) >= 2
    a, b = (dict(r, target_us=r["time_us"]) for r in rows[:2])
    a["host_delta_us"], b["host_delta_us"] = 1e6, 0.0

    def saved(rs):
        return base - base / proj_replay.replay_gain(graph, rs)

    assert saved([a]) > 0
    assert saved([a, b]) == pytest.approx(saved([a]) + saved([b]), abs=1.0)


def test_replay_projects_a_slower_kernel_as_a_slowdown(prefill):
    """A measured kernel slower than the code it replaces projects a slowdown (it used to be
    clamped to no change), about as much as Amdahl says on a device-bound pass."""
    w, _ = prefill
    graph = proj_replay.workload_graph(w, PREFILL)
    row = max((r for r in pattern_rows(w, H200) if r["family"]),
              key=lambda r: r["time_us"])
    slower = dict(row, target_us=row["time_us"] * 3, host_delta_us=None)
    gain = proj_replay.replay_gain(graph, [slower])
    assert gain < 1.0
    assert gain == pytest.approx(amdahl([(row["share"], 1 / 3)]), rel=0.1)


def test_replay_takes_exactly_the_measured_host_delta_off_a_launch_bound_pass(decode):
    """The measured delta per call pays for the launch calls the fused call removes, whatever
    their traced durations: a row whose segments can hold it shortens a launch-bound pass by
    its calls times the delta (the mean launch of the whole pass, subtracted per removed
    launch, lost 4-7 % of it on the H200's batch-1 runs; for attention here, whose fixture
    rows name more launches than the replay removes, most of it). A call that removes no
    launch changes no host time (profiling.replay.Replacement): gemv's row replaces one cuBLAS
    launch by one kernel, except where cuBLAS ran a split-K reduce beside it."""
    from profiling.replay import replay

    w, _ = decode
    graph = proj_replay.workload_graph(w, DECODE)
    base = replay(graph)
    rows = [r for r in pattern_rows(w, H200) if r["family"] and r["launches"] > 1]
    assert rows
    for r in rows:
        r = dict(r, target_us=r["time_us"])
        calls = sum(1 for c in r["kernel_correlations"] if len(set(c)) > 1)
        zero = base - base / proj_replay.replay_gain(graph, [dict(r, host_delta_us=0.0)])
        saved = base - base / proj_replay.replay_gain(graph, [dict(r, host_delta_us=3.0)])
        assert saved - zero == pytest.approx(3.0 * calls, rel=0.02), r["pattern"]


# ------------------------------------------------------------------ the host's remedy row

# graph costs of the kind `measure_ceilings` records on a GPU (per node, once per launch)
GRAPHED = {**H200, "graph_node_us": 1.5, "graph_launch_us": 8.0}


def _graph_row(ranked):
    rows = [r for r in ranked["rows"] if r.get("remedy") == "cuda_graph"]
    assert len(rows) <= 1
    return rows[0] if rows else None


def test_launch_bound_decode_gets_the_graph_row_removing_host_keeping_gpu(decode):
    from profiling.replay import device_busy_us

    w, _ = decode
    ranked = rank_workload(w, GRAPHED, DECODE)
    row = _graph_row(ranked)
    assert row is not None and row["family"] is None
    assert row["pattern"] == rank_stage.GRAPH_PATTERN
    assert row["share"] == pytest.approx(w["rest_share"])
    wall_us = w["wall"]["median_ms"] * 1e3
    busy_us = device_busy_us(proj_replay.workload_graph(w, DECODE))
    assert busy_us <= row["graphed_pass_us"] < wall_us
    assert row["replay_gain"] == pytest.approx(wall_us / row["graphed_pass_us"], rel=0.02)
    assert row["amdahl_gain"] == pytest.approx(row["replay_gain"], rel=0.02)
    # kernels + graph: the candidates' kernels at their targets, then graphed, never slower
    assert row["graph_with_kernels_gain"] >= row["replay_gain"] - 1e-9
    assert "launch-bound" in row["why"] and "GPU busy" in row["why"]
    # ranked beside the kernel rows by its replay gain: the largest here
    assert ranked["rows"][0] is row
    # the family chooser never picks it, and the cumulative curve holds only families
    from pipeline.policy import choose_families

    assert None not in choose_families({"workloads": [ranked]}, None)
    assert row["pattern"] not in [p["pattern"] for p in ranked["cumulative"]]


def test_uncalibrated_graph_costs_give_no_projection(decode):
    w, _ = decode
    row = _graph_row(rank_workload(w, H200, DECODE))
    assert row is not None  # launch-bound: listed, with why it has no projection
    assert row["replay_gain"] is None and row["graphed_pass_us"] is None
    assert row["note"] == proj_replay.NOT_CALIBRATED


def test_device_bound_prefill_gets_the_graph_row_only_where_replay_says_it_helps(prefill):
    from profiling.replay import device_busy_us

    w, _ = prefill
    assert _graph_row(rank_workload(w, H200, PREFILL)) is None  # no calibration: no claim
    # graph costs that eat the idle time it removes: not listed
    costly = {**H200, "graph_node_us": 50.0, "graph_launch_us": 8.0}
    assert _graph_row(rank_workload(w, costly, PREFILL)) is None
    row = _graph_row(rank_workload(w, GRAPHED, PREFILL))
    if row is not None:
        assert row["replay_gain"] > rank_stage.GRAPH_MIN_GAIN
        # a graph removes at most the time the GPU is not busy
        busy_us = device_busy_us(proj_replay.workload_graph(w, PREFILL))
        assert row["graphed_pass_us"] >= busy_us
        assert row["replay_gain"] <= w["wall"]["median_ms"] * 1e3 / busy_us + 1e-9


def test_frozen_graphs_projection_unpatched_and_kernels_plus_graph(decode, tmp_path):
    from core.artifacts import write_json

    w, _ = decode
    write_json(tmp_path / "profile.json", {"model": {"id": "fixture"}, "ceilings": GRAPHED,
                                           "workloads": [{**w, "trace": str(DECODE)}]})
    row = _graph_row(rank_workload(w, GRAPHED, DECODE))
    proj = proj_workload.project_graphs_with(tmp_path, w["key"], {"rmsnorm": 2.0, "rope": 3.0})
    assert proj["unpatched"] == pytest.approx(row["replay_gain"])
    # faster kernels inside the graph shorten it: kernel time decides once the host is gone
    assert proj["kept"] > proj["unpatched"]
    assert proj["patterns"] == ["rmsnorm", "rope"] and proj["note"] is None
    none = proj_workload.project_graphs_with(tmp_path, w["key"], {})
    assert none["kept"] == pytest.approx(none["unpatched"])


def _assert_rows_add_up(rows, rest_share):
    from pipeline.stages.rank import top_level

    groups = top_level(rows)
    shown = [r for r, _ in groups] + [o for _, opts in groups for o in opts]
    assert sorted(r["pattern"] for r in shown) == sorted(r["pattern"] for r in rows)
    # the CUDA-graph row is the rest row's remedy (its share is the rest row's), not more time
    assert sum(r["share"] for r, _ in groups if not r.get("remedy")) + rest_share == \
        pytest.approx(1.0, abs=1e-9)
    for r, options in groups:
        assert r["option_of"] is None and not r["alternative_to"]
        assert all(o["option_of"] == r["pattern"] for o in options)
    # ordered by the one key the table names
    keys = [max(m["rank_gain"] for m in (r, *opts)) for r, opts in groups]
    assert keys == sorted(keys, reverse=True)
    gains = [r["rank_gain"] for r in rows]
    assert gains == sorted(gains, reverse=True)
    return groups


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_fixture_top_level_rows_and_rest_sum_to_one_with_options_beneath(which, request):
    w, ranked = request.getfixturevalue(which)
    groups = _assert_rows_add_up(ranked["rows"], w["rest_share"])
    assert ranked["ordered_by"].startswith("rank_gain")
    assert all(o["option_of"] in o["overlaps"] for _, opts in groups for o in opts)


def test_an_alternative_is_an_option_beneath_the_row_it_replaces_and_names_its_overlaps():
    """gated_mlp_gemm holds swiglu_mlp's ops and the gate/up GEMMs of `linear`: it is shown
    beneath swiglu_mlp, and the top-level rows (linear included) still add up to 1."""
    w = _workload(_mlp_with_projections(), 10_000.0)
    ranked = rank_workload(w, H200, None)
    groups = _assert_rows_add_up(ranked["rows"], w["rest_share"])
    assert [r["pattern"] for r, _ in groups if r["pattern"] != "linear"] == ["swiglu_mlp"]
    (gemm,) = next(opts for r, opts in groups if r["pattern"] == "swiglu_mlp")
    assert gemm["pattern"] == "gated_mlp_gemm" and gemm["overlaps"] == ["linear", "swiglu_mlp"]


def test_tiny_top_level_rows_and_rest_sum_to_one(tiny):
    from pipeline.stages.rank import rank_workload

    _, _, w, _, _ = tiny
    ranked = rank_workload(w, H200, None)
    _assert_rows_add_up(ranked["rows"], w["rest_share"])


def test_decode_graph_projection_replays_the_static_cache_step(decode, tmp_path):
    """With a static-cache step trace the graph row replays its device work (what the graph
    captures) and takes the kernels' saving from the dynamic step."""
    from profiling.replay import build_graph, graphed, graphed_with
    from profiling.trace import load_trace

    w, _ = decode
    # a stand-in static step with other device work: the prefill fixture's
    static = build_graph(load_trace(PREFILL))
    node, launch = GRAPHED["graph_node_us"], GRAPHED["graph_launch_us"]
    plain = _graph_row(rank_workload(w, GRAPHED, DECODE))
    row = _graph_row(rank_workload(w, GRAPHED, DECODE, static=static))
    assert row["graphed_pass_us"] == pytest.approx(graphed(static, node, launch))
    assert row["graphed_pass_us"] != pytest.approx(plain["graphed_pass_us"])
    assert row["graph_basis"] == "the step over a static KV cache"
    assert plain["graph_basis"] == "the profiled step"
    # kernels + graph: the static step graphed, less what the kernels save in the dynamic one
    dyn = proj_replay.workload_graph(w, DECODE)
    cands = [r for r in pattern_rows(w, GRAPHED) if r["family"]
             and r["pattern"] in row["with_kernels"]]
    rank_stage.project(w, cands, dyn)
    saving = graphed(dyn, node, launch) - graphed_with(
        dyn, proj_replay.replacements(dyn, cands), node, launch)
    assert saving > 0
    assert row["graph_with_kernels_pass_us"] == pytest.approx(
        graphed(static, node, launch) - saving, rel=1e-6)
    # the frozen projection reads the static trace named in the profile
    import shutil

    from core.artifacts import write_json

    shutil.copy(PREFILL, tmp_path / "static.json.gz")
    write_json(tmp_path / "profile.json", {"model": {"id": "fixture"}, "ceilings": GRAPHED,
                                           "workloads": [{**w, "trace": str(DECODE),
                                                          "static_trace": "static.json.gz"}]})
    proj = proj_workload.project_graphs_with(tmp_path, w["key"], {})
    assert proj["unpatched_pass_us"] == pytest.approx(graphed(static, node, launch))
    assert proj["basis"] == "the step over a static KV cache"


def test_a_row_the_static_step_has_is_replaced_there(decode, prefill, tmp_path):
    """With the static step attributed (profile's `w["static"]`), a row whose pattern that step
    has is replaced in it, at the row's own target over time; a row it lacks (here the decode
    attention, absent from the stand-in) saves what it saves in the dynamic step graphed."""
    import shutil

    from core.artifacts import write_json
    from profiling.replay import graphed, graphed_with

    w, _ = decode
    pw, _ = prefill  # a stand-in static step with its own patterns and correlations
    node, launch = GRAPHED["graph_node_us"], GRAPHED["graph_launch_us"]
    shutil.copy(PREFILL, tmp_path / "static.json.gz")
    ws = {**w, "trace": str(DECODE), "static_trace": "static.json.gz", "static": pw}
    write_json(tmp_path / "profile.json", {"model": {"id": "fixture"}, "ceilings": GRAPHED,
                                           "workloads": [ws]})
    speed = {"rmsnorm": 2.0, "decode_attention": 3.0}
    proj = proj_workload.project_graphs_with(tmp_path, w["key"], speed)
    static = proj_workload.static_graph(ws, tmp_path, GRAPHED)
    there = static.graph["pattern_rows"]
    assert "rmsnorm" in there and "decode_attention" not in there
    moved = [{**there["rmsnorm"], "target_us": there["rmsnorm"]["time_us"] / 2.0}]
    dyn = proj_replay.workload_graph(w, DECODE)
    attn = [{**r, "target_us": r["time_us"] / 3.0} for r in pattern_rows(w, GRAPHED)
            if r["pattern"] == "decode_attention"]
    saved = graphed(dyn, node, launch) - graphed_with(
        dyn, proj_replay.replacements(dyn, attn), node, launch)
    want = graphed_with(static, proj_replay.replacements(static, moved), node, launch) - saved
    assert saved > 0
    assert proj["kept_pass_us"] == pytest.approx(want, rel=1e-9)
    assert proj["kept_pass_us"] < proj["unpatched_pass_us"] - saved
    # without the attribution (an older profile) rmsnorm's saving came from the dynamic step
    old = proj_replay.graph_projection(dyn, GRAPHED, [
        {**r, "target_us": r["time_us"] / speed[r["pattern"]]}
        for r in pattern_rows(w, GRAPHED) if r["pattern"] in speed],
        static=proj_workload.static_graph({**ws, "static": None}, tmp_path, GRAPHED))
    assert old["pass_us"] != pytest.approx(proj["kept_pass_us"], rel=1e-3)


def test_two_rows_replacing_the_same_kernels_are_projected_once_each(decode):
    """Two rows sharing kernels (GPT-2: `linear`, which the matmul family patches, holds the
    c_fc GEMM that mlp_gemm_gelu fuses with its activation; that decode run stopped on
    "replacements overlap"): projected together, the fused alternative takes the shared
    occurrences and the other row keeps the rest. Here a stand-in alternative holds half of
    the decode fixture's rmsnorm occurrences."""
    from profiling.replay import graphed_with

    w, _ = decode
    norm = next(r for r in pattern_rows(w, GRAPHED) if r["pattern"] == "rmsnorm")
    half = norm["kernel_correlations"][::2]
    fused = {**norm, "pattern": "fused_norm", "extends": "rmsnorm", "kernel_correlations": half,
             "target_us": norm["target_us"] / 4}
    pairs = proj_replay.disjoint([norm, fused])
    assert pairs[0][:2] == (fused, half)
    assert pairs[1][0] is norm and pairs[1][1] == norm["kernel_correlations"][1::2]
    graph = proj_replay.workload_graph(w, DECODE)
    node, launch = GRAPHED["graph_node_us"], GRAPHED["graph_launch_us"]
    both = graphed_with(graph, proj_replay.replacements(graph, [norm, fused]), node, launch)
    alone = graphed_with(graph, proj_replay.replacements(graph, [fused]), node, launch)
    assert both < alone  # rmsnorm's other occurrences still count
    assert proj_replay.replay_gain(graph, [norm, fused]) > proj_replay.replay_gain(graph, [fused])


def test_a_gemm_row_is_sped_up_per_case_and_only_where_a_case_was_accepted(decode, tmp_path):
    """gemv's one row holds every projection of the step; a case's speedup applies to the
    occurrences of its (k, n) alone, and an occurrence no accepted case matches is left as it
    is, as the patch leaves its module."""
    from codegen.shapes import gemm_k_n
    from core.artifacts import write_json
    from profiling.replay import graphed, graphed_with

    w, _ = decode
    row = next(r for r in pattern_rows(w, GRAPHED) if r["pattern"] == "gemv")
    cases = row["occurrence_cases"]
    assert len(cases) == len(row["kernel_correlations"]) and all(c for c in cases)
    kinds = sorted({(c["k"], c["n"]) for c in cases})
    assert len(kinds) >= 3  # q, k/v, o, gate/up, down, LM head: several shapes
    k, n = kinds[0]
    assert gemm_k_n([{"name": "aten::addmm", "shapes": [[n], [1, k], [k, n], [], []]}]) == \
        {"k": k, "n": n}
    write_json(tmp_path / "profile.json", {"model": {"id": "fixture"}, "ceilings": GRAPHED,
                                           "workloads": [{**w, "trace": str(DECODE)}]})
    per_case = proj_workload.project_graphs_with(tmp_path, w["key"], {"gemv": 1.5},
                                              {"gemv": [[{"k": k, "n": n, "rows": 1}, 3.0]]})
    graph = proj_replay.workload_graph(w, DECODE)
    only = [c for c, keys in zip(row["kernel_correlations"], cases)
            if (keys["k"], keys["n"]) == (k, n)]
    assert 0 < len(only) < len(cases)
    mine = {**row, "kernel_correlations": only, "occurrence_cases": None,
            "target_us": 1.0, "time_us": 3.0}
    node, launch = GRAPHED["graph_node_us"], GRAPHED["graph_launch_us"]
    want = graphed_with(graph, proj_replay.replacements(graph, [mine]), node, launch)
    assert per_case["kept_pass_us"] == pytest.approx(want, rel=1e-9)
    assert per_case["kept_pass_us"] < graphed(graph, node, launch)
    # without the cases every occurrence runs at the median speedup
    median = proj_workload.project_graphs_with(tmp_path, w["key"], {"gemv": 1.5})
    assert median["kept_pass_us"] != pytest.approx(per_case["kept_pass_us"], rel=1e-3)


def test_a_cached_graph_node_cost_from_before_the_chain_is_measured_again(
        tmp_path, monkeypatch):
    import json

    from profiling import roofline

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(roofline, "measure_ceilings", lambda d: calls.append(d) or {"new": 1})
    name = roofline.device_name('cpu').replace(' ', '_').replace('/', '_')
    path = roofline.cache_dir() / f"ceilings-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"graph_node_us": 1.28, "graph_launch_us": 23.0}))
    assert roofline.ceilings("cpu") == {"new": 1} and calls == ["cpu"]
    path.write_text(json.dumps({"graph_node_us": 0.4, "graph_tiny_kernel_us": 0.9}))
    assert roofline.ceilings("cpu") == {"new": 1} and calls == ["cpu", "cpu"]
    path.write_text(json.dumps({"graph_node_us": 0.6, "graph_chain_kernels": 200}))
    assert roofline.ceilings("cpu")["graph_node_us"] == 0.6 and calls == ["cpu", "cpu"]
    path.write_text(json.dumps({"bandwidth_GBps": 50.0}))  # a CPU's: no graph costs to redo
    assert roofline.ceilings("cpu") == {"bandwidth_GBps": 50.0} and len(calls) == 2


def test_decode_attention_is_proposed_on_the_decode_fixture_from_its_roofline(decode, prefill):
    """The decode step's SDPA calls (one query token over the cached slots) are the
    decode_attention family's row, costed as K/V read once over the kv heads; the prefill's stay
    the attention family's. On this dynamic-cache step one cuDNN call of ~6 us is already
    under one eager launch (launch_us 8.5) plus 0.5 us of bytes, so the roofline promises
    nothing there; the static-cache step below is where it pays."""
    w, ranked = decode
    rows = {r["pattern"]: r for r in ranked["rows"]}
    assert "attention" not in rows
    row = rows["decode_attention"]
    assert row["family"] == "decode_attention" and row["occurrences"] == 2
    sdpa = [o for o in w["ops"] if o["name"] == "aten::scaled_dot_product_attention"]
    b, kv, slots, d = sdpa[0]["shapes"][1]
    assert kv == 8 and sdpa[0]["shapes"][0][2] == 1
    moved = (2 * b * kv * slots * d + 2 * b * 32 * d) * 2
    assert row["min_bytes"] == 2 * moved
    floor = min(roofline_us(moved, 4 * 32 * d * slots, H200), sdpa[0]["time_us"])
    assert row["roofline_us"] == pytest.approx(floor + min(
        roofline_us(moved, 4 * 32 * d * slots, H200), sdpa[1]["time_us"]))
    assert "decode_attention" in choose_families({"workloads": [ranked]}, None)
    pre = {r["pattern"] for r in prefill[1]["rows"]}
    assert "attention" in pre and "decode_attention" not in pre


def test_static_cache_decode_attention_row_gains_the_repeat_kv_copies_and_mask_work():
    """transformers 5.17's static-cache step: repeat_kv's two reshapes copy k and v over all
    1040 slots to 32 heads (6.6 us each on the H200), then SDPA with the bool mask (6.8 us, its
    mask conversion inside): one scope, one row, whose floor reads 8 kv heads' K/V once."""
    wall = 2000.0
    k5, k4, q = [1, 8, 4, 1040, 64], [1, 32, 1040, 64], [1, 32, 1, 64]
    ops = []
    for n, (name, shapes, t) in enumerate([
            ("aten::expand", [[1, 8, 1, 1040, 64]], 0.0), ("aten::reshape", [k5], 6.6),
            ("aten::expand", [[1, 8, 1, 1040, 64]], 0.0), ("aten::reshape", [k5], 6.6),
            ("aten::scaled_dot_product_attention", [q, k4, k4, [1, 1, 1, 1040]], 6.8)]):
        op = _op(name, "model.layers.0.self_attn", "LlamaAttention", [1, 10 + n], shapes,
                 [BF16] * len(shapes), t, wall, launches=1 if t else 0)
        op["functions"] = [["sdpa_attention_forward", 70]]
        ops.append(op)
    rows = {r["pattern"]: r for r in pattern_rows(_workload(ops, wall), H200)}
    row = rows["decode_attention"]
    moved = (2 * 8 * 1040 * 64 + 2 * 32 * 64) * 2
    assert row["min_bytes"] == moved
    assert row["attainable_speedup"] == pytest.approx(20.0 / roofline_us(moved, 4 * 32 * 64 * 1040,
                                                                         H200))
    assert row["attainable_speedup"] > 2


H200_GRAPHS = {**H200, "graph_node_us": 0.08, "graph_launch_us": 19.7,
               "graph_tiny_kernel_us": 1.0}


def test_launch_bound_pass_ranks_families_by_their_gain_inside_the_graph(decode):
    """Once the graphs stage removes the host, what a row saves inside the graph decides: the
    decode GEMMs' floor is priced with an in-graph launch (not the eager 8.5 us that capped it
    at the profiled time), and the family rows are ordered by graph_gain, each above 1 where
    its kernels cut device time."""
    w, eager_ranked = decode
    ranked = rank_workload(w, H200_GRAPHS, DECODE)
    assert eager_ranked["ranked_by"] == "replay_gain"  # no graph costs: no graph projection
    assert ranked["ranked_by"] == "graph_gain"
    fam = [r for r in ranked["rows"] if r["family"]]
    gains = [r["graph_gain"] for r in fam]
    assert all(g is not None and g >= 1.0 - 1e-9 for g in gains)
    assert gains == sorted(gains, reverse=True)
    assert [r["rank_gain"] for r in fam] == gains
    by = {r["pattern"]: r for r in ranked["rows"]}
    eager_by = {r["pattern"]: r for r in eager_ranked["rows"]}
    assert eager_by["gemv"]["attainable_speedup"] == pytest.approx(1.0)
    assert by["gemv"]["attainable_speedup"] > 1.1
    for name in ("gemv", "decode_attention", "kv_cache"):
        assert by[name]["graph_gain"] > 1.005, name
        assert by[name]["graph_gain"] > eager_by[name]["replay_gain"], name
    top5 = [r["family"] for r in fam[:5]]
    assert {"gemv", "decode_attention", "rmsnorm"} <= set(top5)
    assert ranked["rows"][0].get("remedy") == "cuda_graph"  # the host's own row stays first


def test_device_bound_pass_keeps_the_replay_ranking_with_graph_costs(prefill):
    w, ranked = prefill
    again = rank_workload(w, H200_GRAPHS, PREFILL)
    assert again["ranked_by"] == "replay_gain"
    assert all("graph_gain" not in r for r in again["rows"])
    assert [r["pattern"] for r in again["rows"] if r["family"]] == \
        [r["pattern"] for r in ranked["rows"] if r["family"]]


@pytest.mark.parametrize("kv_heads_equal", [True, False])
def test_a_decode_steps_qkv_projections_rank_as_an_option_of_their_gemv_row(
        kv_heads_equal, tmp_path):
    """qkv_proj holds the three projections' gemv occurrences of each attention, not the
    attention it is found through (`absorbs_only`): an option beneath `gemv`, one occurrence
    per layer. With tiny-llama's own 32-wide k/v (widths the matmul family pads) there is
    none: the pattern's `accepts` takes unpadded GEMVs only."""
    from pipeline.stages.profile import summarise
    from profiling.capture import capture, make_runner, module_names
    from profiling.loader import build, resolve

    spec = resolve("tiny-llama")
    if kv_heads_equal:
        spec.config.num_key_value_heads = spec.config.num_attention_heads
    model = build(spec, torch.float32, "cpu")
    wl = Workload(1, 8, "float32", "cpu", "decode")
    runner = make_runner(model, wl)
    names = module_names(model, runner)
    ms = capture(runner, "cpu", tmp_path / "trace.json.gz")
    w = summarise(tmp_path / "trace.json.gz", wl, {"median_ms": ms}, names, ms)
    ranked = rank_workload(w, H200, None)
    rows = {r["pattern"]: r for r in ranked["rows"]}
    layers = model.config.num_hidden_layers
    if not kv_heads_equal:
        assert "qkv_proj" not in rows
        return
    qkv = rows["qkv_proj"]
    assert qkv["family"] == "qkv_proj" and qkv["occurrences"] == layers
    assert qkv["alternative_to"] == ["gemv"] and qkv["option_of"] == "gemv"
    assert qkv["op_calls"] == 3 * layers * (rows["gemv"]["op_calls"] // rows["gemv"][
        "occurrences"])  # every op of the three Linears' own occurrences, nothing else
    assert "decode_attention" not in qkv["overlaps"]
    _assert_rows_add_up(ranked["rows"], w["rest_share"])
