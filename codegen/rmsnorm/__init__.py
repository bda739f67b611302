"""RMSNorm family: Llama/Qwen2/Mistral/Phi3 form and the Gemma (1 + weight) form.

Case keys: rows, hidden, dtype, eps, offset (0.0 Llama, 1.0 Gemma), cast_first (True: cast to
the input dtype before the weight multiply, as Llama; False: after, as Gemma), and optionally
row_stride (> hidden: x is a strided view). Params passed to forward and the reference: eps,
offset, cast_first (`FAMILY.params(case)`).
"""

from codegen.rmsnorm import kernel, patch, reference
from core.family import CudaVariant, Family, Pattern, VerifyHooks, lazy
from profiling.roofline import streaming_cost

# Counted on torch.profiler CPU traces of the real transformers modules (fp32, fp16 and bf16
# alike): the aten ops called directly inside the module scope. The casts are aten::to (the
# first `.to(float32)`/`.float()` and the weight's `.float()` or the final `.to(dtype)`);
# `extra_ok` lists what those ops run beneath themselves, which a profile may also attribute
# to the scope (_to_copy/copy_ for real casts; sum/fill_/div_ inside mean on the CPU).
_NESTED = ("aten::_to_copy", "aten::empty_strided", "aten::copy_", "aten::result_type",
           "aten::sum", "aten::fill_", "aten::div_")

LLAMA_PATTERN = Pattern(
    name="rmsnorm",
    description="RMSNorm, Llama form: fp32 pow/mean/rsqrt, cast back, then weight * x",
    module_class=r".*RMSNorm$",
    ops={"aten::to": 2, "aten::pow": 1, "aten::mean": 1, "aten::add": 1, "aten::rsqrt": 1,
         "aten::mul": 2},
    extra_ok=_NESTED,
    family="rmsnorm",
    cost=streaming_cost(2, "aten::pow"),  # read x, write out; pow sees the fp32 copy of x
)

GEMMA_PATTERN = Pattern(
    name="rmsnorm_gemma",
    description="RMSNorm, Gemma form: fp32 norm times (1 + weight) in fp32, then cast",
    module_class=r".*RMSNorm$",
    ops={"aten::to": 2, "aten::pow": 1, "aten::mean": 1, "aten::add": 2, "aten::rsqrt": 1,
         "aten::mul": 2, "aten::type_as": 1},
    extra_ok=_NESTED,
    family="rmsnorm",
    cost=streaming_cost(2, "aten::pow"),
)

FAMILY = Family(
    name="rmsnorm",
    patterns=(LLAMA_PATTERN, GEMMA_PATTERN),
    reference=reference.rms_norm,
    make_inputs=reference.make_inputs,
    make_out=reference.make_out,
    edge_cases=reference.edge_cases,
    min_bytes=reference.min_bytes,
    flops=reference.flops,
    search_space=kernel.search_space,
    render=kernel.render,
    patch=patch.patch,
    cases_from_model=patch.cases_from_model,
    aten_ops=("aten::pow", "aten::mean", "aten::rsqrt", "aten::mul", "aten::add"),
    params=reference.params,
    examples=(reference.make_case(16, 64, "float16"),),
    cuda=CudaVariant(search_space=lazy("codegen.rmsnorm.cuda", "search_space"),
                     render=lazy("codegen.rmsnorm.cuda", "render")),
    extras={"forms": reference.FORMS},
    benchmark="codegen.rmsnorm.bench",
    verify=VerifyHooks(
        weights=(-1,),  # the norm's weight
    ),
)
