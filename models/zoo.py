"""Offline zoo: configs of well-known models, so profiling works with no network.

Numbers are the models' published config.json values (see shared FACTS.md). Tiny variants keep
each family's structure (norm type, activation, rotary, GQA, biases) at CPU-sized widths.
"""

from __future__ import annotations

_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

ZOO: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", n_embd=768, n_inner=3072, n_layer=12, n_head=12,
                 vocab_size=50257, n_positions=1024, activation_function="gelu_new"),
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
                         tie_word_embeddings=True, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768,
                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                         tie_word_embeddings=True, rms_norm_eps=1e-6),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, max_position_embeddings=131072, head_dim=64,
                         rope_parameters=_LLAMA3_ROPE, tie_word_embeddings=True,
                         rms_norm_eps=1e-5),
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256, max_position_embeddings=131072,
                         rope_parameters={**_LLAMA3_ROPE, "factor": 8.0},
                         tie_word_embeddings=False, rms_norm_eps=1e-5),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=32000, max_position_embeddings=32768, sliding_window=4096,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                       tie_word_embeddings=False, rms_norm_eps=1e-5),
    "gemma-2b": dict(model_type="gemma", hidden_size=2048, intermediate_size=16384,
                     num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
                     head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                     hidden_activation="gelu_pytorch_tanh"),
    "phi-3-mini": dict(model_type="phi3", hidden_size=3072, intermediate_size=8192,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                       vocab_size=32064, max_position_embeddings=4096),
    # mixtures of experts: 64 experts of which 8 per token, unnormalised top-k weights (OLMoE);
    # 128 experts, 8 per token, renormalised (Qwen3-30B-A3B)
    "olmoe-1b-7b": dict(model_type="olmoe", hidden_size=2048, intermediate_size=1024,
                        num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                        num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                        vocab_size=50304, max_position_embeddings=4096, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                        tie_word_embeddings=False, pad_token_id=1, eos_token_id=50279),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                          moe_intermediate_size=768, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          tie_word_embeddings=False),
}

_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=512)

ZOO.update({
    "tiny-llama": dict(model_type="llama", **_TINY, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "tiny-qwen2": dict(model_type="qwen2", **_TINY, tie_word_embeddings=True),
    "tiny-mistral": dict(model_type="mistral", **_TINY, sliding_window=256),
    "tiny-gemma": dict(model_type="gemma", **{**_TINY, "num_key_value_heads": 1}, head_dim=16,
                       pad_token_id=0, eos_token_id=1, bos_token_id=2,
                       hidden_activation="gelu_pytorch_tanh"),
    "tiny-phi3": dict(model_type="phi3", **{**_TINY, "num_key_value_heads": 4},
                      pad_token_id=0, eos_token_id=1, bos_token_id=1),
    "tiny-gpt2": dict(model_type="gpt2", n_embd=64, n_inner=176, n_layer=2, n_head=4,
                      vocab_size=512, n_positions=512, activation_function="gelu_new"),
    # Architectures no family was written for, each with what sets it apart: q/k norms per
    # head (Qwen3) or across the projection (OLMo-2), logit soft-capping and eager-only
    # attention (Gemma-2), sliding and global layers (Gemma-3), scaled residuals and logits
    # (Granite), layers without rotary (SmolLM3), a partial rotary (Phi-2, StableLM, GPT-NeoX
    # with its fused per-head q/k/v), biased projections and LayerNorm (Starcoder2), a
    # parallel block and LayerNorm without bias (Cohere)
    "tiny-qwen3": dict(model_type="qwen3", **_TINY, head_dim=16, tie_word_embeddings=True),
    "tiny-olmo2": dict(model_type="olmo2", **_TINY),
    "tiny-gemma2": dict(model_type="gemma2", **_TINY, head_dim=16),
    "tiny-gemma3": dict(model_type="gemma3_text", **_TINY, head_dim=16, sliding_window=32,
                        layer_types=["sliding_attention", "full_attention"]),
    "tiny-granite": dict(model_type="granite", **_TINY),
    "tiny-smollm3": dict(model_type="smollm3", **_TINY, no_rope_layers=[1, 0]),
    "tiny-starcoder2": dict(model_type="starcoder2", **_TINY),
    "tiny-gpt-neox": dict(model_type="gpt_neox", **{k: v for k, v in _TINY.items()
                                                     if k != "num_key_value_heads"}),
    "tiny-phi2": dict(model_type="phi", **_TINY),
    "tiny-cohere": dict(model_type="cohere", **_TINY),
    "tiny-stablelm": dict(model_type="stablelm", **_TINY),
    # Mixtures of experts, 4 experts of which each token takes 2: enough for a router to
    # leave an expert without tokens on a short prompt
    "tiny-mixtral": dict(model_type="mixtral", **_TINY, num_local_experts=4,
                         num_experts_per_tok=2),
    "tiny-qwen3-moe": dict(model_type="qwen3_moe", **_TINY, head_dim=16, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=88),
    "tiny-olmoe": dict(model_type="olmoe", **_TINY, num_experts=4, num_experts_per_tok=2),
})

# Hub ids the zoo can stand in for when the hub is unreachable.
HUB_ALIASES = {
    "openai-community/gpt2": "gpt2", "gpt2": "gpt2",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "qwen/qwen2.5-0.5b": "qwen2.5-0.5b", "qwen/qwen2.5-0.5b-instruct": "qwen2.5-0.5b",
    "meta-llama/llama-3.2-1b": "llama-3.2-1b", "meta-llama/llama-3.2-1b-instruct": "llama-3.2-1b",
    "meta-llama/llama-3.1-8b": "llama-3.1-8b", "meta-llama/llama-3.1-8b-instruct": "llama-3.1-8b",
    "mistralai/mistral-7b-v0.1": "mistral-7b", "google/gemma-2b": "gemma-2b",
    "microsoft/phi-3-mini-4k-instruct": "phi-3-mini",
    "allenai/olmoe-1b-7b-0924": "olmoe-1b-7b", "allenai/olmoe-1b-7b-0924-instruct": "olmoe-1b-7b",
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
}


def zoo_name(model_id: str) -> str | None:
    key = model_id.lower()
    if key in ZOO:
        return key
    return HUB_ALIASES.get(key)
