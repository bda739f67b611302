"""Fused residual add + LayerNorm: GPT-2's attention residual add and its ln_2 in one kernel,
out = (sum, normed).

The kernel, reference and cases are the layernorm family's fused form (case key
`residual: True`: inputs (x, residual, weight, bias), out = (sum, normed), the norm reading
the sum rounded to the model dtype); this folder adds what makes it reach a model: the
pattern and the adapter, which replaces the GPT2Block forward per instance (patch.py). A
family of its own, the smaller choice: add_rmsnorm's adapter is written around a pre-norm
decoder layer's statements and RMSNorm's forms, GPT2Block has its own (a cross-attention
branch, attn called with positional hidden states), and the arithmetic is layernorm's.

Recognition: on torch.profiler CPU traces of GPT2Block the block's own scope runs two aten
adds, the residual adds, beside whatever of the attention no family claims (SDPA, dropouts);
the pattern is partial and claims the two adds, ahead of the base residual_add pattern.
The kernel replaces the first add together with the ln_2 occurrence of the layernorm
pattern.

Not here: the MLP residual add with the next block's ln_1 (or ln_f after the last block),
which crosses a block boundary.
"""

from dataclasses import replace

from codegen.add_layernorm import patch
from codegen.layernorm import FAMILY as LAYERNORM
from codegen.layernorm.reference import make_case
from core.family import Pattern

ADD_LAYERNORM_PATTERN = Pattern(
    name="add_layernorm",
    description="residual add after attention + ln_2 (GPT-2 block)",
    module_class=r"^GPT2Block$",
    ops={"aten::add": 2},
    family="add_layernorm",
    # the block's scope also holds attention ops no family claims (SDPA, the dropouts):
    # claim the two adds only, before the base residual_add pattern does
    partial=True,
)

# layernorm's family with this folder's pattern and adapter: the same kernel, reference and
# cases (its fused form), so nothing of the arithmetic is declared twice
FAMILY = replace(
    LAYERNORM,
    name="add_layernorm",
    patterns=(ADD_LAYERNORM_PATTERN,),
    patch=patch.patch,
    cases_from_model=patch.cases_from_model,
    examples=(make_case(16, 64, "float16", residual=True),),
)
