"""The routed experts block as Hugging Face computes it, and the case side of the family.

What one MoE layer's block runs, after `hidden_states.view(-1, hidden)` (T tokens):

    _, weights, indices = self.gate(x)         # the model's TopKRouter
    out = self.experts(x, indices, weights)    # the model's Experts, under its
                                               # `experts_implementation`

The reference calls exactly those two modules, instantiated from the model's own classes
(`transformers.models.<model_type>`) on the case's widths and handed the input tensors as their
parameters, so it is the model's code on any input (tests check it bit for bit against the
modules of a built model). Routers, as the models write them:

- Mixtral: softmax(fp32 logits), top-k, always renormalised; the weights stay fp32.
- Qwen2-MoE, Qwen3-MoE, OLMoE: softmax(fp32), top-k, renormalised where `norm_topk_prob`, then
  cast to the logits' dtype.
- gpt-oss: top-k of the biased logits, then softmax over those k; its experts take transposed,
  interleaved gate/up weights with biases and a clamped SwiGLU (`GptOssExperts._apply_gate`).

Inputs: (x, router_weight, gate_up, down), and for gpt-oss (router_bias, gate_up_bias,
down_bias) after them; x is the (T, hidden) view the block hands its router.
"""

from __future__ import annotations

import importlib
from functools import cache

import torch

from codegen.dtypes import element_size, random_normal
from core.family import Case, distinct

# model_type -> (modeling module's name, router class, experts class): the blocks patch.py finds
MODELS = {
    "mixtral": ("mixtral", "MixtralTopKRouter", "MixtralExperts"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeTopKRouter", "Qwen2MoeExperts"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeTopKRouter", "Qwen3MoeExperts"),
    "olmoe": ("olmoe", "OlmoeTopKRouter", "OlmoeExperts"),
    "gpt_oss": ("gpt_oss", "GptOssTopKRouter", "GptOssExperts"),
}
# gpt-oss: top-k on the logits, then a softmax over the k; the others softmax first
TOPK_FIRST = ("gpt_oss",)
BIASED = ("gpt_oss",)  # router and experts with biases, transposed interleaved weights
# edge-case routings (make_inputs): one expert without tokens, one with all, one with one token;
# k experts exactly tied above the others for every token
ROUTINGS = ("skewed", "tied")
IMPLS = ("eager", "batched_mm", "grouped_mm")


def make_case(rows: int, hidden: int, inter: int, experts: int, top_k: int, dtype: str,
              model_type: str, *, norm_topk: bool = True, impl: str = "grouped_mm",
              limit: float | None = None, alpha: float | None = None,
              routing: str | None = None) -> Case:
    """`rows` tokens of width `hidden`; `experts` experts of intermediate width `inter`, `top_k`
    per token; `impl` the model's `experts_implementation` (what its own block runs: the
    baseline); gpt-oss's clamp `limit` and `alpha`."""
    if model_type not in MODELS:
        raise ValueError(f"no MoE block known for {model_type!r}; known: {', '.join(MODELS)}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k {top_k} of {experts} experts")
    case = {"rows": int(rows), "hidden": int(hidden), "inter": int(inter),
            "experts": int(experts), "top_k": int(top_k), "dtype": dtype,
            "model_type": model_type, "norm_topk": bool(norm_topk), "impl": impl}
    if model_type in BIASED:
        case.update(limit=float(limit if limit is not None else 7.0),
                    alpha=float(alpha if alpha is not None else 1.702))
    if routing is not None:
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; known: {', '.join(ROUTINGS)}")
        case["routing"] = routing
    return case


def params(case: Case) -> dict:
    """The keyword params of the reference and of a candidate's forward. `dtype` is the model's
    (the order bound's overflow threshold; the reference runs in its inputs' dtype)."""
    out = {k: case[k] for k in ("model_type", "top_k", "norm_topk", "impl", "dtype")}
    if case["model_type"] in BIASED:
        out.update(limit=case["limit"], alpha=case["alpha"])
    return out


@cache
def _modules(model_type: str, hidden: int, inter: int, experts: int, top_k: int,
             norm_topk: bool, limit: float | None, alpha: float | None):
    """The model's router and experts modules at these widths, on the meta device (their
    parameters are bound per call, `_bind`)."""
    import warnings

    from transformers import AutoConfig

    name, router_cls, experts_cls = MODELS[model_type]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    extra = {"swiglu_limit": limit, "swiglu_alpha": alpha} if model_type in BIASED else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = AutoConfig.for_model(
            model_type, hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
            num_local_experts=experts, num_experts=experts, num_experts_per_tok=top_k,
            norm_topk_prob=norm_topk, num_attention_heads=1, num_key_value_heads=1,
            head_dim=hidden, router_jitter_noise=0.0, **extra)
    with torch.device("meta"):
        router = getattr(module, router_cls)(config).eval()
        experts_mod = getattr(module, experts_cls)(config).eval()
    return router, experts_mod


def _bind(module: torch.nn.Module, **tensors) -> None:
    """The module's parameters replaced by these tensors (no copy), bypassing nn.Module's check
    that a parameter be an nn.Parameter."""
    for name, t in tensors.items():
        module._parameters[name] = t


def runnable_impl(impl: str, dtype: torch.dtype, device: torch.device) -> str:
    """`impl`, or eager where that implementation cannot run these tensors: torch's grouped
    GEMM takes fp32/fp16/bf16 on the CPU and bf16 on a GPU, never fp64 (the verifier's
    reference). The three compute the same sums; only their order and roundings differ."""
    if impl == "grouped_mm":
        ok = (dtype in (torch.float32, torch.float16, torch.bfloat16) if device.type == "cpu"
              else dtype == torch.bfloat16)
        return impl if ok else "eager"
    return impl


def moe_block(x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, router_bias: torch.Tensor | None = None,
              gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
              *, model_type: str, top_k: int, norm_topk: bool = True,
              impl: str = "grouped_mm", dtype: str | None = None, limit: float | None = None,
              alpha: float | None = None) -> torch.Tensor:
    """The model's router, then its experts under `impl`, on x (T, hidden)."""
    hidden, experts = x.shape[-1], router_weight.shape[0]
    inter = down.shape[-1] if model_type not in BIASED else down.shape[1]
    router, experts_mod = _modules(model_type, hidden, inter, experts, top_k, bool(norm_topk),
                                   limit, alpha)
    experts_mod.config._experts_implementation = runnable_impl(impl, x.dtype, x.device)
    if model_type in BIASED:
        _bind(router, weight=router_weight, bias=router_bias)
        _bind(experts_mod, gate_up_proj=gate_up, gate_up_proj_bias=gate_up_bias,
              down_proj=down, down_proj_bias=down_bias)
    else:
        _bind(router, weight=router_weight)
        _bind(experts_mod, gate_up_proj=gate_up, down_proj=down)
    try:
        with torch.no_grad():
            flat = x.reshape(-1, hidden)
            _, weights, indices = router(flat)
            return experts_mod(flat, indices, weights).reshape(x.shape)
    finally:  # no reference to the caller's tensors outlives the call
        for m in (router, experts_mod):
            for name in m._parameters:
                m._parameters[name] = None


def weight_shapes(case: Case) -> dict[str, tuple[int, ...]]:
    """Each weight input's shape, as the model's modules hold them."""
    h, i, e = case["hidden"], case["inter"], case["experts"]
    if case["model_type"] in BIASED:  # transposed: (experts, in, out); gate/up interleaved
        return {"router_weight": (e, h), "gate_up": (e, h, 2 * i), "down": (e, i, h),
                "router_bias": (e,), "gate_up_bias": (e, 2 * i), "down_bias": (e, h)}
    return {"router_weight": (e, h), "gate_up": (e, 2 * i, h), "down": (e, h, i)}


# Router logits of trained models spread over a few units (random ones, std 0.02 weights on
# unit-variance hidden states, about one); biases of a tenth keep the bias paths visible.
BIAS_SCALE = 0.1


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """(x, router_weight, gate_up, down[, router_bias, gate_up_bias, down_bias]): x of unit
    variance, weights scaled by their fan-in**-0.5 as initialised and trained ones are, so the
    logits, gate, up and the output keep x's spread at any width. A `routing` edge reshapes x
    and the router weight (`_route`)."""
    t, h, i, dtype = case["rows"], case["hidden"], case["inter"], case["dtype"]
    shapes = weight_shapes(case)
    # drawn and edited in fp32 where the generator lives (an OLMoE layer's experts are 400 M
    # values: seconds per draw on a CPU), then cast and moved
    where = generator.device if generator is not None else "cpu"
    x = random_normal((t, h), where, generator, "float32")
    w = {name: random_normal(s, where, generator, "float32",
                             BIAS_SCALE if name.endswith("bias") else
                             (i if name == "down" else h) ** -0.5)
         for name, s in shapes.items()}
    if "routing" in case:
        _route(case, x, w)
    order = ("router_weight", "gate_up", "down", "router_bias", "gate_up_bias", "down_bias")
    return tuple(v.to(device=device, dtype=getattr(torch, dtype))
                 for v in (x, *(w[n] for n in order if n in w)))


# a feature every token carries, and the router weight given to it: logits of +-STRONG * FEATURE
# rule the routing over the random part's unit spread
FEATURE, STRONG = 3.0, 4.0


def _route(case: Case, x: torch.Tensor, w: dict) -> None:
    """In place, on x and the weights `w` (a router bias, gpt-oss's, set to zero).

    "skewed": every token carries feature 0; expert 0 weighs it -STRONG (no token ever picks
    it), expert 1 +STRONG (every token does), expert 2 -2 (none does) unless the token also
    carries feature 1, which only token 0 does (expert 2 gets exactly one token). Needs
    top_k <= experts - 2 (else a token must take expert 0 or 2).

    "tied": experts 0..k-1 share one router row r, experts k..2k-1 have -r, every other expert
    a zero row, so for any x (the verifier's stress values too) the logits are s, -s and 0 with
    s = x . r: the top k are one group of k experts tied bit for bit, picked as a set whichever
    way a kernel breaks the tie (a tie across the k-th place would be the implementation's
    choice: torch.topk's is neither the lower nor the higher index). Needs experts >= 2 top_k.
    x's feature 0 makes s = +FEATURE * STRONG on random draws: the first group."""
    k, e = case["top_k"], case["experts"]
    router = w["router_weight"]
    if "router_bias" in w:
        w["router_bias"].zero_()
    x[:, 0] = FEATURE
    if case["routing"] == "skewed":
        if k > e - 2:
            raise ValueError(f"a skewed routing needs top_k <= experts - 2, got {k} of {e}")
        x[:, 1] = 0.0
        x[0, 1] = FEATURE
        router[:, :2] = 0.0
        router[0, 0], router[1, 0], router[2, 0] = -STRONG, STRONG, -2.0
        router[2, 1] = 4 * STRONG
        return
    if e < 2 * k:
        raise ValueError(f"a tied routing needs experts >= 2 top_k, got {k} of {e}")
    row = router[0].clone()
    row[0] = STRONG
    router.zero_()
    router[:k] = row
    router[k:2 * k] = -row


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    x = inputs[0]
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive. The widths, expert count and
    top-k are baked into it; the token count stays free: one token (a decode step at batch 1),
    a prime count, one past the largest row block (128), and the two routings of `_route` at
    the case's own token count (an expert with no token, one with one, one with all; ties)."""
    rows = [1, 7, 129]
    cases = [{**case, "rows": n} for n in rows]
    routed = {k: v for k, v in case.items() if k != "routing"}
    if case["top_k"] <= case["experts"] - 2:
        cases.append({**routed, "routing": "skewed", "rows": max(case["rows"], 4)})
    if case["experts"] >= 2 * case["top_k"]:
        cases.append({**routed, "routing": "tied", "rows": max(case["rows"], 4)})
    return distinct(case, cases)


def active_experts(case: Case) -> int:
    """Experts a call reads at least: every one at prefill, at most rows * top_k at decode."""
    return min(case["experts"], case["rows"] * case["top_k"])


def min_bytes(case: Case) -> int:
    """x read and the output written once, the router's weight and every active expert's
    gate/up and down weights read once (biases aside)."""
    t, h, i, e = case["rows"], case["hidden"], case["inter"], case["experts"]
    return (2 * t * h + e * h + active_experts(case) * 3 * h * i) * element_size(case)


def flops(case: Case) -> int:
    """The router's GEMM and, per (token, expert) pair, the gate/up and down GEMMs."""
    t, h, i, e, k = case["rows"], case["hidden"], case["inter"], case["experts"], case["top_k"]
    return 2 * t * h * e + 2 * t * k * 3 * h * i


def expert_widths(gate_up: torch.Tensor, down: torch.Tensor, model_type: str) -> int:
    """The intermediate width from the weights' shapes."""
    return down.shape[1] if model_type in BIASED else down.shape[-1]


def _unit(dtype: str) -> float:
    """The unit roundoff of rounding to `dtype`."""
    return torch.finfo(getattr(torch, dtype)).eps / 2


def largest(dtype: str) -> float:
    """The dtype's largest finite value."""
    return float(torch.finfo(getattr(torch, dtype)).max)


def _gamma(n: int, unit: float) -> float:
    return n * unit / (1 - n * unit)


# the steepest slope of silu (1.0998 at x = 2.40) and of gpt-oss's clamped gate, rounded up
MAX_SLOPE = 1.13
FP32_UNIT = 2.0 ** -24


def order_bound(x, router_weight, gate_up, down, router_bias=None, gate_up_bias=None,
                down_bias=None, *, model_type, top_k, norm_topk=True, impl="grouped_mm",
                dtype="float32", limit=None, alpha=None, reference=None) -> dict:
    """Per output element (inputs in float64), how far an implementation that accumulates in
    fp32, rounds the intermediate (activation times up) and each expert's weighted output
    once to `dtype`, and routes on fp32 logits, may land from the exact value: the classic dot
    bound K u / (1 - K u) * sum |a_k b_k| of the gate, up and down GEMMs carried through the
    activation and the weighted sum, plus those two roundings. A token whose k-th and
    (k+1)-th router scores lie within what fp32 summation may change is routed either way by
    a right kernel: its row's bound is then the most any routing can change, twice the sum
    over all experts of |expert output|. "overflow": rows where some stage's magnitude passes
    `dtype`'s largest value (fp32's for the router), so any order may overflow."""
    hidden = x.shape[-1]
    inter = expert_widths(gate_up, down, model_type)
    experts = router_weight.shape[0]
    u32, ud = FP32_UNIT, _unit(dtype)
    top, top32 = largest(dtype), largest("float32")
    logits = x @ router_weight.T
    mag_l = x.abs() @ router_weight.abs().T
    if router_bias is not None:
        logits = logits + router_bias
        mag_l = mag_l + router_bias.abs()
    d_l = _gamma(hidden, u32) * mag_l + u32 * logits.abs()
    scores = logits if model_type in TOPK_FIRST else torch.softmax(logits, dim=-1)
    ranked, idx = torch.sort(scores, dim=-1, descending=True)
    ambiguous = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
    if top_k < experts:
        # logit gap at the k-th place against what fp32 summation and exp may move it by
        gap_logits = logits.gather(1, idx[:, top_k - 1:top_k]) - logits.gather(
            1, idx[:, top_k:top_k + 1])
        slack = 2 * d_l.max(dim=-1, keepdim=True).values + 1e-6
        ambiguous = (gap_logits.abs() <= slack).squeeze(1) | (ranked[:, top_k - 1] ==
                                                               ranked[:, top_k])
    chosen = idx[:, :top_k]
    weights = ranked[:, :top_k]
    if model_type in TOPK_FIRST:
        weights = torch.softmax(weights, dim=-1)
    elif norm_topk or model_type == "mixtral":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # the weights' own error: fp32 logits move a softmax weight by about its value times the
    # logits' error (twice: the normaliser), plus fp32 rounding
    d_w = weights.abs() * (4 * d_l.max(dim=-1, keepdim=True).values + 8 * u32)
    bound = torch.zeros_like(x)
    anywhere = torch.zeros_like(x)  # sum over all experts of |output|, for ambiguous rows
    overflow_row = (mag_l.max(dim=-1).values >= top32)
    for e in range(experts):
        hit = (chosen == e)
        rows = hit.any(dim=-1) | ambiguous
        if not bool(rows.any()):
            continue
        t = rows.nonzero().squeeze(1)
        y, d_y, m1, m2 = _expert_bound(x[t], gate_up[e], down[e], gate_up_bias, down_bias, e,
                                       model_type, inter, hidden, limit, alpha, ud)
        w_e = (weights * hit).sum(dim=-1)[t]
        dw_e = (d_w * hit).sum(dim=-1)[t]
        routed = hit.any(dim=-1)[t]
        part = (w_e.abs()[:, None] * (d_y + ud * y.abs()) + dw_e[:, None] * y.abs())
        bound[t] += torch.where(routed[:, None], part, 0.0)
        anywhere[t] += y.abs()
        overflow_row[t] |= (m1 >= top32) | (m2 >= top)
        overflow_row[t] |= routed & ((y.abs() + d_y).max(dim=-1).values >= top)
    bound += _gamma(top_k, u32) * anywhere  # the fp32 sum of the k weighted outputs
    bound = torch.where(ambiguous[:, None], 2 * anywhere, bound)
    return {"bound": bound, "overflow": overflow_row[:, None].expand_as(bound)}


def _expert_bound(x, gate_up, down, gate_up_bias, down_bias, e, model_type, inter, hidden,
                  limit, alpha, ud):
    """(y, bound on y's error, max gate/up magnitude, max intermediate magnitude) for tokens x
    through expert e, float64."""
    if model_type in BIASED:  # (hidden, 2 inter) interleaved; down (inter, hidden)
        wg, wu, wd = gate_up[:, 0::2].T, gate_up[:, 1::2].T, down.T
        bg, bu = gate_up_bias[e, 0::2], gate_up_bias[e, 1::2]
        bd = down_bias[e]
    else:
        wg, wu, wd = gate_up[:inter], gate_up[inter:], down
        bg = bu = bd = None
    g, u = x @ wg.T, x @ wu.T
    mg, mu = x.abs() @ wg.abs().T, x.abs() @ wu.abs().T
    if bg is not None:
        g, u, mg, mu = g + bg, u + bu, mg + bg.abs(), mu + bu.abs()
    dg, du = _gamma(hidden, FP32_UNIT) * mg, _gamma(hidden, FP32_UNIT) * mu
    if model_type in BIASED:
        gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
        act = gc * torch.sigmoid(alpha * gc)
        h = (uc + 1) * act
        slope = MAX_SLOPE * max(1.0, alpha)
        dh = slope * dg * ((uc + 1).abs() + du) + act.abs() * du
    else:
        act = g * torch.sigmoid(g)
        h = act * u
        dh = MAX_SLOPE * dg * (u.abs() + du) + act.abs() * du
    dh = dh + ud * (h.abs() + dh)  # the intermediate rounded once to the model's dtype
    y = h @ wd.T
    dy = _gamma(inter, FP32_UNIT) * (h.abs() @ wd.abs().T) + dh @ wd.abs().T
    if bd is not None:
        y = y + bd
    m1 = torch.maximum(mg, mu).max(dim=-1).values
    m2 = (h.abs() + dh).max(dim=-1).values
    return y, dy, m1, m2
