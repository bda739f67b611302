"""Adapters ask the chooser once per input signature and per patched instance, then call the
kernel on every call (models.patching.per_signature): a second forward of the same shape adds
kernel calls but no chooser calls, and a new shape is asked about afresh."""

from __future__ import annotations

import pytest
import torch
from family_checks import DEVICE, CountingChooser

from codegen.registry import get_family
from models.loader import build, resolve


@pytest.mark.parametrize("name", ["rmsnorm", "add_rmsnorm", "rope", "gated_act", "kv_cache"])
def test_the_chooser_is_asked_once_per_signature(name, tmp_path):
    family = get_family(name)
    model = build(resolve("tiny-llama"), torch.float32, DEVICE)
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
