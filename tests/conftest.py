"""CPU by default: Triton kernels run under the interpreter when no CUDA device is present.

TRITON_INTERPRET must be set before any module with @triton.jit is imported, hence here.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (the README's `-n 2`) each worker gets one core's worth of intra-op
# threads: two workers with torch's default of one thread per core would oversubscribe CI's 2.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def call_order(monkeypatch):
    """watch(module, attr="label", ...) wraps those module attributes so each call appends its
    label to the list watch returns (one list per test), then runs the real function."""
    order: list[str] = []

    def watch(module, **labels) -> list[str]:
        for attr, label in labels.items():
            real = getattr(module, attr)

            def wrapped(*args, _real=real, _label=label, **kwargs):
                order.append(_label)
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, attr, wrapped)
        return order
    return watch
