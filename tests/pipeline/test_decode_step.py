"""The graphed decode step's anatomy: kernels per step, shares, the floor multiple, the lever."""

from __future__ import annotations

import pytest
import torch

from core.records import IntegratedWorkload
from pipeline.decode_step import anatomy, short, weight_bytes

GB = 1e9


def _kernels(layers: int, glue_us: float, gemv_us: float) -> list[tuple[str, float]]:
    """Per layer: a norm, four GEMVs (one cuBLAS), rope, a cache append, attention."""
    per = [("triton_red_fused_rmsnorm_0", glue_us),
           ("_gemv_kernel", gemv_us),
           ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64<...>", gemv_us),
           ("_rope_kernel", glue_us), ("_kv_append_kernel", glue_us),
           ("_decode_attention_kernel", gemv_us), ("_gemv_kernel", gemv_us),
           ("_split_sum_kernel", 1.0)]
    return per * layers


def test_counts_shares_and_the_floor_multiple():
    ks = _kernels(4, 2.0, 10.0)
    busy_ms = sum(us for _, us in ks) / 1e3
    rec = anatomy(ks, step_ms=0.3, weights=int(0.1 * GB), copy_gbps=1000.0, layers=4)
    assert rec["kernels_per_step"] == 32 and rec["kernels_per_layer"] == 8
    assert rec["busy_ms"] == pytest.approx(busy_ms, abs=1e-4)
    assert rec["floor_ms"] == pytest.approx(0.1) and rec["floor_multiple"] == pytest.approx(3.0)
    top = rec["kernels"][0]
    assert top == {"kernel": "_gemv_kernel", "calls": 8, "ms": 0.08,
                   "share": pytest.approx(0.08 / 0.3, abs=1e-4)}
    assert sum(r["calls"] for r in rec["kernels"]) == 32
    assert "tilesize" in rec["kernels"][1]["kernel"] and "<" not in rec["kernels"][1]["kernel"]
    # glue: the norm, rope and the append (6 us per layer); the rest streams weights or cache
    assert rec["levers_ms"]["fusion"] == pytest.approx(0.024)
    assert rec["levers_ms"]["launch gaps"] == pytest.approx(0.3 - busy_ms, abs=1e-4)
    assert rec["levers_ms"]["bandwidth"] == pytest.approx(busy_ms - 0.024 - 0.1, abs=1e-4)


@pytest.mark.parametrize("glue_us, gemv_us, step_ms, lever", [
    (20.0, 10.0, 0.5, "fusion"),        # glue dominates
    (1.0, 40.0, 0.7, "bandwidth"),      # GEMVs far over the floor
    (1.0, 10.0, 2.0, "launch gaps"),    # the GPU idles between kernels
])
def test_the_verdict_names_the_largest_lever(glue_us, gemv_us, step_ms, lever):
    rec = anatomy(_kernels(4, glue_us, gemv_us), step_ms, int(0.1 * GB), 1000.0, 4)
    assert rec["verdict"].startswith(f"next lever: {lever} (")
    assert max(rec["levers_ms"], key=rec["levers_ms"].get) == lever


def test_a_step_at_its_floor_has_no_lever_and_an_unknown_floor_no_multiple():
    rec = anatomy([("_gemv_kernel", 100.0)], 0.1, int(0.1 * GB), 1000.0, 1)
    assert rec["verdict"].startswith("no lever left")
    rec = anatomy([("_gemv_kernel", 100.0)], None, 1000, None, 1)
    assert rec["floor_ms"] is None and rec["floor_multiple"] is None
    assert rec["step_ms"] == rec["busy_ms"] == 0.1


def test_many_kernel_names_are_summed_past_the_top():
    ks = [(f"k{i}", 1.0) for i in range(20)]
    rec = anatomy(ks, 0.05, 1000, 1000.0, 2)
    assert rec["kernels"][-1]["kernel"].startswith("other (8 kernels)")
    assert sum(r["calls"] for r in rec["kernels"]) == 20


def test_tied_weights_are_read_once():
    lin = torch.nn.Linear(8, 16, bias=False)
    head = torch.nn.Linear(8, 16, bias=False)
    head.weight = lin.weight
    model = torch.nn.ModuleList([lin, head, torch.nn.Linear(16, 4)])
    assert weight_bytes(model) == (16 * 8 + 4 * 16 + 4) * 4
    assert short("f(int, float)") == "f" and len(short("x" * 200)) == 72


def test_the_record_is_typed_and_the_report_prints_it():
    from pipeline import report_plots as rp

    rec = anatomy(_kernels(2, 20.0, 10.0), 0.25, int(0.1 * GB), 1000.0, 2)
    IntegratedWorkload.model_validate({"kept": [], "graphs": {"captured": True,
                                                             "decode_step": rec}})
    bad = {**rec, "kernels_per_step": "many"}
    with pytest.raises(Exception, match="kernels_per_step"):
        IntegratedWorkload.model_validate({"kept": [], "graphs": {"decode_step": bad}})
    g = {"captured": True, "decision": "graphs ship", "medians": {}, "decode_step": rec}
    md = rp.to_markdown(rp.graphs_blocks({"graph_row": None, "graphs": g}))
    for text in ("Graphed decode step: 0.250 ms, 16 kernels (8.0 per layer)",
                 "2.50x its weight-read floor of 0.100 ms", "next lever: fusion",
                 "_gemv_kernel"):
        assert text in md, text
    failed = {"captured": True, "decision": "x", "medians": {}, "decode_step_error": "boom"}
    assert "Decode step anatomy failed: boom" in rp.to_markdown(
        rp.graphs_blocks({"graph_row": None, "graphs": failed}))


def test_fused_projections_and_cublas_nvjet_stream_weights():
    """The H100 step's own kernel names: the norm-fused projections, cuBLAS's nvjet GEMV and
    flash-decoding's two kernels stream weights or the cache; the norm, rotary and the cache
    append are the glue the fusion lever counts."""
    names = ["_norm_gate_up_kernel", "_norm_qkv_kernel", "_gemv_kernel",
             "nvjet_sm90_tst_64x8_64x16_2x1_v_bx_splitK_TNT",
             "void cublasLt::splitKreduce_kernel<32, 16, int, float>", "_decode_split_kernel",
             "_decode_combine_kernel", "_rms_norm_forward_kernel", "_rope_forward_kernel",
             "_kv_static_kernel"]
    rec = anatomy([(n, 10.0) for n in names], None, int(0.001 * GB), 1000.0, 1)
    assert rec["levers_ms"]["fusion"] == pytest.approx(0.030)  # the last three only


def test_the_floor_reads_an_untied_embedding_once_per_token_not_whole():
    from profiling.loader import build, resolve

    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    emb = model.get_input_embeddings().weight
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = model.get_output_embeddings().weight is emb
    assert weight_bytes(model) == total - (0 if tied else emb.numel() * emb.element_size())


def test_an_moe_step_reads_the_experts_its_tokens_reach():
    from pipeline.decode_step import active_fraction
    from profiling.loader import build, resolve

    model = build(resolve("tiny-qwen3-moe"), torch.float32, "cpu")
    cfg = model.config
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    assert active_fraction(cfg, 1) == k / e
    assert active_fraction(cfg, 10_000) == 1.0
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if ".experts." in n)
    assert experts > 0
    one, many = weight_bytes(model, 1), weight_bytes(model, 10_000)
    assert many - one == round(experts * (1 - k / e))
