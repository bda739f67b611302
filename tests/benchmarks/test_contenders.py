"""benchmarks/contenders.py liger: each apply function gets only the arguments it takes, and a
model type without one is named (Liger is not installed on the CPU: fake apply functions)."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import contenders  # noqa: E402


def test_only_the_arguments_each_apply_function_accepts_are_passed():
    got = {}

    def apply_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                    fused_linear_cross_entropy=True, model=None):
        got["llama"] = dict(rope=rope, swiglu=swiglu, fused=fused_linear_cross_entropy,
                            model=model)

    def apply_gemma(rope=True, rms_norm=True, geglu=True, cross_entropy=False, model=None):
        got["gemma"] = dict(geglu=geglu, model=model)

    passed = contenders.call_accepted(apply_llama, contenders.LIGER_ARGS, model="M")
    assert "geglu" not in passed and passed["swiglu"] is True
    assert got["llama"] == {"rope": True, "swiglu": True, "fused": False, "model": "M"}
    passed = contenders.call_accepted(apply_gemma, contenders.LIGER_ARGS, model="M")
    assert "swiglu" not in passed and "fused_linear_cross_entropy" not in passed
    assert got["gemma"] == {"geglu": True, "model": "M"}


def test_a_model_type_without_liger_support_is_named():
    lk = types.SimpleNamespace(apply_liger_kernel_to_llama=lambda **k: None)
    assert contenders.liger_apply(lk, "llama") is lk.apply_liger_kernel_to_llama
    with pytest.raises(SystemExit, match="no Liger support for gpt2"):
        contenders.liger_apply(lk, "gpt2")
