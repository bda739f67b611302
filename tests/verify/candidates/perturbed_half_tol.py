"""The right result moved up by 0.5 x the tolerance of its dtype (verify/tolerances.py): a
candidate at the tolerance edge.

Computes in float32 into a scratch buffer and rounds once, with torch, into `out`: the Triton
interpreter converts float32 to bfloat16 by truncation (the GPU rounds to nearest), which would
add up to an ulp of its own and blur the edge being tested.
"""

import torch
from rmsnorm_triton import rms_norm_forward

# {dtype name: (atol, rtol)}: written in by the test from verify/tolerances.py (a candidate
# may not import the judge, verify.static)
TOLERANCES: dict = {}


def forward(x, weight, *, out, eps):
    atol, rtol = TOLERANCES[str(out.dtype).removeprefix("torch.")]
    y = torch.empty(out.shape, dtype=torch.float32, device=out.device)
    rms_norm_forward(x, weight, y, eps, perturb=(0.5, atol, rtol))
    out.copy_(y)
