"""benchmarks/probes/qkv_grouping.py's adapter, checked on the CPU before any GPU time goes to
it: grouped q/k/v give the model's logits (Llama without biases, Qwen2 with them), in a prefill
and over a KV cache; a projection called on another input runs its own code; undo restores the
modules and reports the copy's size."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "probes"))
from qkv_grouping import group  # noqa: E402

from codegen.qkv_proj.patch import attentions  # noqa: E402
from models.graphs import cache_argument, output_cache  # noqa: E402
from profiling.loader import build, resolve  # noqa: E402


def _mha(model_id):
    """The tiny model with one kv head per query head: k/v 64 wide, the attentions qkv_proj
    takes (the built-in 32-wide k/v are the matmul family's)."""
    spec = resolve(model_id)
    spec.config.num_key_value_heads = spec.config.num_attention_heads
    return build(spec, torch.float32, "cpu")


@pytest.mark.parametrize("model_id", ["tiny-llama", "tiny-qwen2"])
def test_grouped_projections_give_the_models_logits_and_undo(model_id):
    model = _mha(model_id)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    attn = attentions(model)
    assert len(attn) == model.config.num_hidden_layers
    with torch.no_grad():
        want = model(ids).logits
        out = model(ids[:, :8], use_cache=True)
        want_step = model(ids[:, 8:], **{cache_argument(model): output_cache(out)}).logits
        undo = group(model)
        got = model(ids).logits
        out = model(ids[:, :8], use_cache=True)
        got_step = model(ids[:, 8:], **{cache_argument(model): output_cache(out)}).logits
        # k_proj on an input q_proj never saw: its own weight, not the stashed slice
        x = torch.randn(2, 3, model.config.hidden_size)
        k = attn[0].k_proj
        torch.testing.assert_close(k(x), torch.nn.functional.linear(x, k.weight, k.bias))
        widths = sum(getattr(attn[0], n).weight.shape[0] for n in ("q_proj", "k_proj", "v_proj"))
        per_layer = widths * model.config.hidden_size + (widths if k.bias is not None else 0)
        assert undo.extra_bytes == 4 * per_layer * len(attn)
        undo()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_step, want_step, rtol=1e-5, atol=1e-5)
    assert not [n for n, m in model.named_modules() if "forward" in vars(m)]


def test_a_stashed_slice_is_not_served_after_its_input_changed():
    model = _mha("tiny-llama")
    a = attentions(model)[0]
    undo = group(model)
    with torch.no_grad():
        x = torch.randn(1, 4, model.config.hidden_size)
        a.q_proj(x)
        x.mul_(2.0)  # in place: same tensor, new version
        k = a.k_proj(x)
        undo()
        torch.testing.assert_close(k, a.k_proj(x))
