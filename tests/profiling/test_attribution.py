"""Attribution invariants on real H200 traces (2-layer Llama-3.2-1B widths, bf16)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from profiling.attribution import attribute, attribute_step
from profiling.trace import device_events, load_trace, profiler_steps

FIXTURES = Path(__file__).parent.parent / "fixtures"


@pytest.fixture(scope="module", params=["prefill_b8_s1024_2layer", "decode_b1_kv1024_2layer"])
def trace(request):
    return load_trace(FIXTURES / f"{request.param}.json.gz")


def test_every_kernel_of_the_step_is_attributed_once(trace):
    for i in range(len(profiler_steps(trace))):
        att = attribute_step(trace, i)
        attributed = sum(op.device_us for op in att.ops)
        assert attributed + att.unattributed_us == pytest.approx(att.kernel_total_us, rel=1e-9)
        assert att.unattributed_us < 0.01 * att.kernel_total_us
        corr = Counter(k["correlation"] for op in att.ops for k in op.kernels)
        assert corr and max(corr.values()) == 1
        assert len(corr) == att.kernel_count


def test_steps_partition_the_traced_kernels(trace):
    steps = [attribute_step(trace, i) for i in range(len(profiler_steps(trace)))]
    in_steps = sum(s.kernel_total_us for s in steps)
    # every kernel with a duration launched inside a step is counted in exactly one step;
    # warm-up kernels before the first step are outside all of them
    assert in_steps <= sum(e["dur"] for e in device_events(trace)) + 1e-6
    assert len({s.step for s in steps}) == len(steps) == 3


def test_busy_time_is_bounded_by_span(trace):
    att = attribute(trace)
    assert 0 < att.device_busy_us <= att.device_span_us + 1e-6
    assert att.device_busy_us <= att.kernel_total_us + 1e-6


def test_prefill_op_counts():
    att = attribute(load_trace(FIXTURES / "prefill_b8_s1024_2layer.json.gz"))
    names = Counter(op.name for op in att.ops)
    # 7 matmuls per layer (q, k, v, o, gate, up, down) x 2 layers + the LM head
    assert names["aten::linear"] == 15
    assert names["aten::scaled_dot_product_attention"] == 2
    assert names["aten::silu"] == 2
    modules = {op.module_class for op in att.ops}
    assert {"LlamaRMSNorm", "LlamaMLP", "LlamaAttention", "Linear"} <= modules


def test_a_module_the_model_does_not_hold_is_transparent_inside_one_it_does():
    """kernels' global "Func" module (transformers >= 5.25) called inside the attention keeps
    the attention's path; without names, or at the top, labels stay as the profiler gives."""
    from profiling.attribution import _join, _transparent

    names = {"LlamaAttention_0": "model.layers.0.self_attn"}
    assert _transparent("model.layers.0.self_attn", "Func", "0", names)
    assert not _transparent("model.layers.0.self_attn", "LlamaAttention", "0", names)
    assert not _transparent("", "Func", "0", names)  # nothing outer to belong to
    assert not _transparent("a", "Func", "0", None)
    assert _join("a", "Func", "0", None) == "a/Func_0"
