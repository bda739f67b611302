"""benchmarks/glue_probe.py's lean decoder-layer forwards make HF's torch calls in HF's order:
on the CPU their logits are HF's bit for bit (Llama and Qwen2 layouts, with the KV cache the
model fills during prefill), and swapping back restores the class forward."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from glue_probe import swap  # noqa: E402

from profiling.loader import build, resolve  # noqa: E402


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-qwen2"])
def test_lean_layers_give_hf_logits_bit_for_bit_and_swap_back(model_id):
    model = build(resolve(model_id), torch.float32, "cpu")
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        for variant in ("lean", "direct"):
            layers = swap(model, variant)
            assert all("forward" in vars(layer) for layer in layers)
            assert torch.equal(model(ids).logits, want), variant
        swap(model, "fused_qkv")
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        layers = swap(model, "hf")
        assert not any("forward" in vars(layer) for layer in layers)
        assert torch.equal(model(ids).logits, want)
