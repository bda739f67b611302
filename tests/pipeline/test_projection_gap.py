"""Where a projection and its measurement part: kernel names from candidate sources, and the
per-part table from a synthetic re-profile."""

from __future__ import annotations

import pytest

from core.source import kernel_names
from pipeline.projection.gap import gap

TRITON = '''
import triton
import triton.language as tl

@triton.jit
def _helper(x):
    return x

@triton.autotune(configs=[], key=[])
@triton.jit
def _norm_kernel(X):
    pass

def forward(x, *, out):
    _norm_kernel[(1,)](x)
'''
CUDA = r'''
_KERNEL = r"""
template <int T>
__global__ void __launch_bounds__(T * 2)
rms_kernel(const float* x) {}
__global__ void plain_kernel(float* y) {}
"""
'''


def test_kernel_names_finds_triton_jit_and_cuda_global_functions():
    assert kernel_names(TRITON) == {"_helper", "_norm_kernel"}
    assert kernel_names(CUDA) == {"rms_kernel", "plain_kernel"}
    assert kernel_names("def forward(:") == set()  # not Python: nothing claimed


ROWS = [{"pattern": "rmsnorm", "family": "rmsnorm", "time_us": 8000.0},
        {"pattern": "add", "family": "add_rmsnorm", "time_us": 1000.0},
        {"pattern": "linear", "family": None, "time_us": 30000.0}]
REPROFILE = {
    "families": ["rmsnorm", "add_rmsnorm"],
    "family_kernels": {"rmsnorm": ["_rms_norm_forward_kernel"],
                       "add_rmsnorm": ["_add_rms_norm_forward_kernel"]},
    # names are matched as whole words: rmsnorm's kernel is not the add one's suffix
    "patched_us": {"_add_rms_norm_forward_kernel": 300.0, "_rms_norm_forward_kernel": 900.0,
                   "nvjet_gemm": 30500.0, "void rms_kernel<4>(float*)": 0.0},
    "unpatched_us": {"a": 20000.0, "b": 20500.0},
}


def test_gap_sets_each_family_and_the_rest_against_the_projection():
    combined = {"times_a_ms": [50.0, 52.0, 51.0], "times_b_ms": [40.0, 41.0, 39.0]}
    g = gap(ROWS, {"rmsnorm": 10.0, "add_rmsnorm": 2.0}, REPROFILE,
            {"wall_ms": 50.0, "busy_share": 0.8}, 1.25, combined)
    parts = {p["part"]: p for p in g["parts"]}
    rms, add = parts["rmsnorm"], parts["add_rmsnorm"]
    assert rms["kernels"] == ["_rms_norm_forward_kernel"]
    assert (rms["profiled_ms"], rms["projected_ms"], rms["patched_ms"]) == pytest.approx(
        (8.0, 0.8, 0.9))
    assert (add["profiled_ms"], add["projected_ms"], add["patched_ms"]) == pytest.approx(
        (1.0, 0.5, 0.3))
    busy = 50.0 * 0.8  # the profile's GPU busy time
    rest = parts["rest of the GPU work"]
    assert rest["profiled_ms"] == pytest.approx(busy - 9.0)
    assert rest["patched_ms"] == pytest.approx(30.5)  # every kernel no family claimed
    total = parts["GPU busy"]
    assert total["projected_ms"] == pytest.approx(busy - 9.0 + 0.8 + 0.5)
    assert total["patched_ms"] == pytest.approx(31.7)
    wall = parts["wall (timed, no profiler)"]
    # projected: the unpatched pass timed beside the patched one (51 ms) over the replay
    assert (wall["profiled_ms"], wall["projected_ms"], wall["patched_ms"]) == pytest.approx(
        (50.0, 51.0 / 1.25, 40.0))
    idle = parts["wall - GPU busy (host, launches, gaps)"]
    assert idle["patched_ms"] == pytest.approx(40.0 - 31.7)
    assert idle["projected_ms"] == pytest.approx(51.0 / 1.25 - total["projected_ms"])
    assert g["unpatched_busy_now_ms"] == pytest.approx(40.5)
    assert g["unpatched_wall_now_ms"] == pytest.approx(51.0)


def test_a_family_without_a_kernel_speedup_leaves_the_projected_total_open():
    """add_rmsnorm has no speedup in the projection: its row and the GPU-busy total show no
    projected time, rather than a total that counts its 1 ms as 0."""
    g = gap(ROWS, {"rmsnorm": 10.0}, REPROFILE, {"wall_ms": 50.0, "busy_share": 0.8}, 1.25,
            None)
    parts = {p["part"]: p for p in g["parts"]}
    assert parts["add_rmsnorm"]["projected_ms"] is None
    assert parts["rmsnorm"]["projected_ms"] == pytest.approx(0.8)
    assert parts["GPU busy"]["projected_ms"] is None
    assert parts["wall - GPU busy (host, launches, gaps)"]["projected_ms"] is None


def test_the_replays_row_times_stand_for_a_row_a_family_covers_in_part():
    """A family that patches one case of its row (GPT-2's matmul: the LM head of 49 linears)
    is projected at the time the replay gave its row, not the row over the family's speedup;
    and one whose kernel is a library's (cuBLAS on a padded weight) has no kernel name to
    find, so its patched time is unknown here (it stays in the rest), not 0."""
    reprofile = {**REPROFILE, "family_kernels": {**REPROFILE["family_kernels"], "rmsnorm": []}}
    g = gap(ROWS, {"rmsnorm": 10.0, "add_rmsnorm": 2.0}, reprofile,
            {"wall_ms": 50.0, "busy_share": 0.8}, 1.25, None,
            row_ms={"rmsnorm": 6.0, "add": 0.5})
    parts = {p["part"]: p for p in g["parts"]}
    assert parts["rmsnorm"]["projected_ms"] == pytest.approx(6.0)  # not 8.0 / 10
    assert parts["rmsnorm"]["patched_ms"] is None
    assert parts["rest of the GPU work"]["patched_ms"] == pytest.approx(30.5 + 0.9)
    assert parts["GPU busy"]["projected_ms"] == pytest.approx(40.0 - 9.0 + 6.0 + 0.5)
    # a replay without the row's time (projections frozen before row_ms) keeps the old rule
    old = gap(ROWS, {"rmsnorm": 10.0, "add_rmsnorm": 2.0}, REPROFILE,
              {"wall_ms": 50.0, "busy_share": 0.8}, 1.25, None, row_ms={"add": 0.5})
    assert {p["part"]: p for p in old["parts"]}["rmsnorm"]["projected_ms"] == pytest.approx(0.8)


def test_no_reprofile_no_table():
    assert gap(ROWS, {}, None, {"wall_ms": 1.0, "busy_share": 1.0}, None, None) is None


@pytest.mark.gpu
def test_gpu_kernel_times_sum_one_pass_per_kernel_name():
    import time

    import torch

    from core.workload import Workload
    from pipeline.integrate import gpu_kernel_times
    from profiling.capture import make_runner
    from profiling.loader import build, resolve

    model = build(resolve("tiny-llama"), torch.bfloat16, "cuda")
    runner = make_runner(model, Workload(2, 64, "bfloat16", "cuda"))
    runner.once()
    start = time.perf_counter()
    one = gpu_kernel_times(runner)
    elapsed_us = (time.perf_counter() - start) * 1e6
    assert one and all(t > 0 for t in one.values())
    # one pass's kernels on one stream fit inside the time the profiled call took
    assert sum(one.values()) < elapsed_us
    again = gpu_kernel_times(runner)
    assert set(again) == set(one)  # the same pass, the same kernels


def test_slower_in_both_names_the_untouched_kernels_that_grew():
    from pipeline.projection.gap import slower_in_both

    before = {"gemm_a": 1000.0, "gemm_b": 2000.0, "mean": 500.0, "ours": 10.0, "copy": 80.0,
              "tiny": 2.0, "big": 9000.0}
    after = {"gemm_a": 1100.0, "gemm_b": 2050.0, "ours": 900.0, "copy": 60.0, "new": 400.0,
             "tiny": 2.5, "big": 9100.0}
    got = slower_in_both(before, after, {"ours"})
    # only kernels in both passes, not a family's, that grew by 10 us and 2 %, largest first
    # (tiny: +0.5 us; big: +1.1 %)
    assert [k["kernel"] for k in got] == ["gemm_a", "gemm_b"]
    assert (got[0]["unpatched_ms"], got[0]["patched_ms"]) == pytest.approx((1.0, 1.1))


def test_a_failed_reprofile_is_reported_not_raised():
    g = gap(ROWS, {}, {"families": ["rmsnorm"], "error": "RuntimeError: CUPTI"},
            {"wall_ms": 1.0, "busy_share": 1.0}, None, None)
    assert g == {"error": "RuntimeError: CUPTI"}
