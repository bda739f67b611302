"""Triton's CPU interpreter wherever no CUDA device is present, for the CLI and the Python API
alike.

`@triton.jit` reads TRITON_INTERPRET when a kernel is *defined*, so this must run before any
kernel module is imported; worker processes inherit the environment.
"""

from __future__ import annotations

import os
import warnings

# numpy, which the interpreter computes with, warns on the overflow that the GPU's arithmetic
# wraps or saturates silently (exp of a large negative input, fp16 casts); the checks judge
# the results, so the warning is noise
_OVERFLOW = "ignore:overflow encountered:RuntimeWarning"


def use_interpreter_without_gpu() -> bool:
    """Set TRITON_INTERPRET=1 (unless set) when CUDA is unavailable; True when interpreting."""
    import torch

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    os.environ.setdefault("TRITON_INTERPRET", "1")
    quiet_interpreter()
    return os.environ["TRITON_INTERPRET"] == "1"


def quiet_interpreter() -> None:
    """Silence numpy's overflow warnings here and in every process started from here."""
    warnings.filterwarnings("ignore", message="overflow encountered", category=RuntimeWarning)
    current = os.environ.get("PYTHONWARNINGS", "")
    if _OVERFLOW not in current.split(","):
        os.environ["PYTHONWARNINGS"] = ",".join(x for x in (current, _OVERFLOW) if x)
