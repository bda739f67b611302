"""LayerNorm family (nn.LayerNorm with weight and bias, as in GPT-2), with an optional fused
residual add (case key `residual`: inputs (x, residual, weight, bias), out=(sum, normed)).

Case keys: rows, hidden, dtype, eps, residual (default False), row_stride (optional).
Params for forward and the reference: eps (`FAMILY.params(case)`).
"""

from codegen.layernorm import kernel, patch, reference
from core.family import Family, Pattern, VerifyHooks
from profiling.roofline import streaming_cost

# On torch.profiler CPU traces of GPT-2's nn.LayerNorm the module scope runs one aten op,
# aten::layer_norm; native_layer_norm and its allocations/views run beneath it.
LAYERNORM_PATTERN = Pattern(
    name="layernorm",
    description="LayerNorm with weight and bias over the last dimension (nn.LayerNorm)",
    module_class=r".*LayerNorm$",
    ops={"aten::layer_norm": 1},
    extra_ok=("aten::native_layer_norm", "aten::empty", "aten::view"),
    family="layernorm",
    cost=streaming_cost(2, "aten::layer_norm"),
)

FAMILY = Family(
    name="layernorm",
    patterns=(LAYERNORM_PATTERN,),
    reference=reference.layer_norm,
    make_inputs=reference.make_inputs,
    make_out=reference.make_out,
    edge_cases=reference.edge_cases,
    min_bytes=reference.min_bytes,
    flops=reference.flops,
    search_space=kernel.search_space,
    render=kernel.render,
    patch=patch.patch,
    cases_from_model=patch.cases_from_model,
    aten_ops=("aten::layer_norm", "aten::native_layer_norm", "aten::add"),
    params=reference.params,
    examples=(reference.make_case(16, 64, "float16"),),
    verify=VerifyHooks(
        weights=(-2, -1),  # the norm's weight and bias, after x (and the residual)
    ),
)
