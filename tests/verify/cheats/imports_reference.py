"""Cheat (rmsnorm, gated_act): imports the family's reference and copies its answer."""

from codegen.gated_act.reference import gated_act
from codegen.rmsnorm.reference import rms_norm


def forward(*inputs, out, **params):
    out.copy_(rms_norm(*inputs, **params) if "eps" in params else gated_act(*inputs, **params))
