"""The profile's tokens-per-expert count: every (token, expert) pair of each MoE layer once,
nothing for a dense model, the hooks gone afterwards; the report's paragraph names the share,
the busiest expert against the mean and the random-router caveat."""

from __future__ import annotations

import torch

from profiling import expert_load
from profiling.loader import build, resolve


def test_counts_every_pair_of_each_layer_once():
    model = build(resolve("tiny-olmoe"), torch.float32, "cpu")
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0))
    load = expert_load.measure(model, lambda: model(ids), random_router=True)
    assert load["layers"] == 2 and load["experts"] == 4
    k = model.config.num_experts_per_tok
    for counts in load["per_layer"].values():
        assert sum(counts) == 2 * 8 * k and len(counts) == 4
    assert load["busiest_over_mean"] >= 1.0
    assert all(not ex._forward_pre_hooks for _, ex in expert_load.experts_modules(model))
    text = expert_load.describe(load, 0.5)
    assert "50.0% of the pass" in text and "random" in text


def test_a_dense_model_has_no_load():
    model = build(resolve("tiny-llama"), torch.float32, "cpu")
    assert expert_load.measure(model, lambda: None, random_router=True) is None


def test_idle_experts_are_counted():
    load = expert_load.summarise({"a": [0, 8, 4, 4], "b": [4, 4, 4, 4]}, random_router=False)
    assert load["idle_experts"] == 1 and load["max_tokens_per_expert"] == 8
    assert load["busiest_over_mean"] == 2.0 and "caveat" not in load
    assert "1 expert-layer(s) got no token" in expert_load.describe(load, None)
