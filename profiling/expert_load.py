"""Tokens per expert in one pass of a mixture-of-experts model: the load balance the profile saw.

Every MoE block transformers ships calls its experts as `experts(hidden, top_k_index,
top_k_weights)` (Mixtral, Qwen2/3-MoE, OLMoE, gpt-oss), so a forward pre-hook on each experts
module reads which experts each token took, whatever the experts implementation. The hooks
live for one extra unprofiled pass only (a hooked experts module makes patches fall back).

Why it matters: a grouped GEMM's time follows the busiest expert, and a decode step reads the
weights of every expert some token took. A model built from its config has a random router,
whose picks are close to uniform; a trained router's are not (and vary with the text), so
the numbers of such a run hold for an even load only.
"""

from __future__ import annotations

import torch

RANDOM_ROUTER = ("the router's weights are random (a model built from its config): its "
                 "tokens spread about evenly; a trained router's load is uneven and depends on "
                 "the text, so grouped GEMMs then wait on the busiest expert, and the numbers "
                 "here hold for an even load only")


def experts_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, experts module) of every MoE block: a module with `experts` and a router
    (`gate` or `router`), whose experts know their count."""
    out = []
    for path, m in model.named_modules():
        ex = getattr(m, "experts", None)
        if isinstance(ex, torch.nn.Module) and (hasattr(m, "gate") or hasattr(m, "router")) \
                and isinstance(getattr(ex, "num_experts", None), int):
            out.append((f"{path}.experts" if path else "experts", ex))
    return out


def measure(model: torch.nn.Module, call, random_router: bool) -> dict | None:
    """Tokens per expert per MoE layer in one `call()` of the model (None for a dense model):
    per layer the counts; over layers the mean, the busiest expert against the mean (what a
    grouped GEMM waits on) and the experts left without a token."""
    blocks = experts_modules(model)
    if not blocks:
        return None
    counts: dict[str, list[int]] = {}

    def hook(path, n):
        def pre(_module, args):
            if len(args) >= 2 and isinstance(args[1], torch.Tensor):
                c = torch.bincount(args[1].reshape(-1).long().cpu(), minlength=n)
                prev = counts.get(path)
                counts[path] = (c if prev is None else torch.tensor(prev) + c).tolist()
        return pre

    handles = [ex.register_forward_pre_hook(hook(path, ex.num_experts)) for path, ex in blocks]
    try:
        with torch.no_grad():
            call()
    finally:
        for h in handles:
            h.remove()
    if not counts:
        return None
    return summarise(counts, random_router)


def summarise(counts: dict[str, list[int]], random_router: bool) -> dict:
    per_layer = list(counts.values())
    experts = len(per_layer[0])
    pairs = sum(per_layer[0])
    mean = pairs / experts if experts else 0.0
    busiest = max(max(c) for c in per_layer)
    return {
        "layers": len(per_layer), "experts": experts, "pairs_per_layer": pairs,
        "mean_tokens_per_expert": mean,
        "min_tokens_per_expert": min(min(c) for c in per_layer),
        "max_tokens_per_expert": busiest,
        "busiest_over_mean": busiest / mean if mean else None,
        "idle_experts": sum(1 for c in per_layer for x in c if x == 0),
        "per_layer": counts,
        "random_router": random_router,
        **({"caveat": RANDOM_ROUTER} if random_router else {}),
    }


def describe(load: dict, share: float | None) -> str:
    """One paragraph for the report: the experts block's share and the load it saw."""
    head = (f"Mixture of experts: the experts blocks (router, experts and combine, one row) "
            f"take {share:.1%} of the pass. " if share is not None else
            "Mixture of experts: ")
    idle = load["idle_experts"]
    ratio = load["busiest_over_mean"]
    text = (f"{head}Tokens per expert over {load['layers']} layers of {load['experts']} "
            f"experts: mean {load['mean_tokens_per_expert']:.1f}, min "
            f"{load['min_tokens_per_expert']}, max {load['max_tokens_per_expert']}"
            + (f" (the busiest {ratio:.2f}x the mean)" if ratio is not None else "")
            + (f"; {idle} expert-layer(s) got no token" if idle else "") + ".")
    if load.get("caveat"):
        text += f" Note: {load['caveat']}."
    return text
