"""The family contract, once for every registered family (codegen.registry): each declares
small example cases, and the verifier accepts a rendered candidate on every one of them (its
edge cases, poisoned outputs, stress values, forbidden aten ops, isolation, and the
memoisation probes its declaration of weights and caches calls for). A new family folder is
covered here without editing this file."""

from __future__ import annotations

import pytest
from family_checks import verify_on_cpu_or_gpu

from codegen.registry import families
from core.family import RankHooks, VerifyHooks

FAMILIES = families()
EXAMPLES = [pytest.param(name, case, id=f"{name}-{i}",
                         # the interpreter has no bfloat16: such an example needs a GPU
                         marks=[pytest.mark.gpu] if case.get("dtype") == "bfloat16" else [])
            for name, fam in sorted(FAMILIES.items()) for i, case in enumerate(fam.examples)]


@pytest.mark.parametrize("name, case", EXAMPLES)
def test_the_verifier_accepts_a_rendered_candidate(name, case, tmp_path):
    verify_on_cpu_or_gpu(FAMILIES[name], case, tmp_path)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_declaration_is_complete(name):
    """Example cases, hooks of their own types, and rivals and patterns that name registered
    families."""
    fam = FAMILIES[name]
    assert fam.examples, f"{name}: declare the example cases the verifier runs (Family.examples)"
    assert isinstance(fam.verify, VerifyHooks) and isinstance(fam.rank, RankHooks)
    assert set(fam.rank.rivals) <= set(FAMILIES) - {name}
    assert fam.patterns and all(p.family in (name, None) for p in fam.patterns)
