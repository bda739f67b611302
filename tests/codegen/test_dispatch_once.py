"""Adapters ask the chooser once per input signature and per patched instance, then call the
kernel on every call (core.family.kernel_by_signature): a second forward of the same shape adds
kernel calls but no chooser calls, and a new shape is asked about afresh."""

from __future__ import annotations

import pytest
import torch
from family_checks import DEVICE, CountingChooser

from codegen.registry import get_family
from core.family import kernel_by_signature
from profiling.loader import build, resolve


def test_kernel_by_signature_resolves_each_key_once():
    seen = []

    def case_of(shape, dtype):
        seen.append((shape, dtype))
        return {"n": len(seen)}

    resolve = kernel_by_signature(lambda case: (lambda: case["n"]), case_of,
                                  lambda case: {"p": case["n"]})
    a, b = torch.Size([2, 3]), torch.Size([4, 3])
    got = [resolve(a, torch.float16), resolve(a, torch.float16), resolve(b, torch.float16),
           resolve(a, torch.float32), resolve(b, torch.float16)]
    assert [params["p"] for _, params in got] == [1, 1, 2, 3, 2]
    assert [kernel() for kernel, _ in got] == [1, 1, 2, 3, 2]
    assert seen == [(a, torch.float16), (b, torch.float16), (a, torch.float32)]
    declined = kernel_by_signature(lambda case: None, case_of, dict)
    assert declined(a, torch.float16) == (None, None)


@pytest.mark.parametrize("name,model_id", [(n, "tiny-llama") for n in (
    "rmsnorm", "add_rmsnorm", "rope", "gated_act", "kv_cache")] + [("gelu", "tiny-gpt2")])
def test_the_chooser_is_asked_once_per_signature(name, model_id, tmp_path):
    family = get_family(name)
    model = build(resolve(model_id), torch.float32, DEVICE)
    ids = torch.randint(3, 500, (2, 8), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    chooser = CountingChooser(family, tmp_path)
    undo = family.patch(model, chooser)
    try:
        with torch.no_grad():
            model(ids)
            asked, ran = len(chooser.cases), chooser.calls
            assert asked > 0 and ran > 0
            model(ids)
            assert len(chooser.cases) == asked and chooser.calls == 2 * ran
            model(ids[:1])  # batch 1: another signature
            assert len(chooser.cases) > asked and chooser.calls == 3 * ran
    finally:
        undo()
