"""Probe: how much host time does Hugging Face's Python around the kernels cost per pass?

On a slow lent host, Qwen2.5-0.5B b8 with our kernels waits on its Python (25.7 ms of
wall against about 17.7 ms of GPU work), and torch.compile, with less Python per pass, wins.
Before building anything that replaces HF's glue, this measures what it would be worth: each
decoder layer's forward is swapped for a lean one that makes the same torch calls in the same
order (norms, q/k/v projections, the module-global `apply_rotary_pos_emb`, the cache's
`update`, SDPA, o_proj, the MLP), without HF's per-call machinery (keyword plumbing, the
attention-interface lookup, `sdpa_attention_forward`'s checks):

- hf: the model as built;
- lean: the lean layer forward, submodules still called as modules (`m(x)`);
- direct: the same, with each submodule's `forward` called directly (no `nn.Module.__call__`);
- fused_qkv: direct, with q/k/v as one matmul on the three weights (and biases) concatenated,
  split by views: two launches fewer per layer, at a rounding cuBLAS may change.

Each variant's logits are checked against hf's before timing. Timing: interleaved rounds, each
pass's time until the forward returns (its host time; the device is synchronised before and
after, not inside) and its wall time; medians and p20/p80.

    python3 benchmarks/glue_probe.py OUT.json [--model qwen2.5-0.5b] [--batch 8] [--seq 1024]
        [--rounds 30]

On a machine without a GPU it runs the flow on a small zoo model in fp32 (host times of a CPU
run include the compute, so they say nothing about a GPU host).
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

VARIANTS = ("hf", "lean", "direct", "fused_qkv")


def lean_forward(layer, direct: bool, fused_qkv: bool = False):
    """A decoder layer forward (Llama/Qwen2 shape: pre-norm attention and MLP with residuals)
    making the same torch calls as HF's, for causal passes without padding masks."""
    attn, mlp = layer.self_attn, layer.mlp
    fn = inspect.unwrap(type(attn).forward)
    module_globals = fn.__globals__  # the rope adapter swaps the global here, per call
    head_dim, scaling, idx = attn.head_dim, attn.scaling, attn.layer_idx

    def call(m):
        return m.forward if direct else m

    norm1, norm2 = call(layer.input_layernorm), call(layer.post_attention_layernorm)
    q_proj, k_proj, v_proj, o_proj = (call(getattr(attn, n)) for n in
                                      ("q_proj", "k_proj", "v_proj", "o_proj"))
    mlp_fn = call(mlp)
    if fused_qkv:
        projs = (attn.q_proj, attn.k_proj, attn.v_proj)
        w = torch.cat([p.weight for p in projs])
        bias = torch.cat([p.bias for p in projs]) if attn.q_proj.bias is not None else None
        sizes = [p.out_features for p in projs]

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, cache_position=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        h = norm1(hidden_states)
        b, s, _ = h.shape
        if fused_qkv:
            q, k, v = (t.view(b, s, -1, head_dim).transpose(1, 2)
                       for t in F.linear(h, w, bias).split(sizes, -1))
        else:
            q = q_proj(h).view(b, s, -1, head_dim).transpose(1, 2)
            k = k_proj(h).view(b, s, -1, head_dim).transpose(1, 2)
            v = v_proj(h).view(b, s, -1, head_dim).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = module_globals["apply_rotary_pos_emb"](q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, idx, {"sin": sin, "cos": cos,
                                                      "cache_position": cache_position})
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=scaling, enable_gqa=True,
            is_causal=attention_mask is None and s > 1)
        h = residual + o_proj(o.transpose(1, 2).reshape(b, s, -1))
        return h + mlp_fn(norm2(h))

    return forward


def swap(model, variant: str) -> list:
    """Instance-level forwards on every decoder layer; returns the layers to restore."""
    layers = list(model.model.layers)
    for layer in layers:
        if variant == "hf":
            layer.__dict__.pop("forward", None)
        else:
            layer.forward = lean_forward(layer, direct=variant != "lean",
                                         fused_qkv=variant == "fused_qkv")
    return layers


def main() -> None:
    from profiling.capture import sync
    from profiling.loader import build, resolve
    from verify.stats import summarize

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    model_id, batch, seq = (args.model, args.batch, args.seq) if gpu else ("tiny-qwen2", 2, 16)
    model = build(resolve(model_id), dtype, device)
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, model.config.vocab_size, (batch, seq),
                        generator=torch.Generator().manual_seed(0)).to(device)

    def run():
        with torch.no_grad():
            return model(ids).logits

    want = run().float()
    errors = {}
    for variant in VARIANTS[1:]:
        swap(model, variant)
        errors[variant] = (run().float() - want).abs().max().item()
    swap(model, "hf")
    # same calls, same order: bitwise on the CPU; the fused matmul may round differently
    tol = {v: 0.5 if gpu else (1e-4 if v == "fused_qkv" else 0.0) for v in errors}
    bad = {v: e for v, e in errors.items() if e > tol[v]}
    if bad:
        raise SystemExit(f"lean forwards disagree with HF's: max abs logit error {bad}")
    host = {v: [] for v in VARIANTS}
    wall = {v: [] for v in VARIANTS}
    for v in VARIANTS:  # warm each path once
        swap(model, v)
        run()
    for i in range(args.rounds):
        k = i % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            swap(model, v)
            sync(device)
            t = time.perf_counter()
            run()
            returned = time.perf_counter()
            sync(device)
            host[v].append((returned - t) * 1e3)
            wall[v].append((time.perf_counter() - t) * 1e3)
    swap(model, "hf")

    result = {
        "model": model_id, "batch": batch, "seq": seq, "dtype": str(dtype), "device":
        torch.cuda.get_device_name(0) if gpu else "cpu", "torch": torch.__version__,
        "rounds": args.rounds, "max_abs_logit_error": errors,
        "host": {v: summarize(x) for v, x in host.items()},
        "wall": {v: summarize(x) for v, x in wall.items()},
        "host_saved_per_pass_ms": {v: statistics.median(a - b for a, b in zip(host["hf"],
                                                                               host[v]))
                                   for v in VARIANTS[1:]},
        "note": None if gpu else "CPU: host times include the compute; flow check only",
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
