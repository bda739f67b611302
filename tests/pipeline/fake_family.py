"""Small fake kernel families for tests of the pipeline's mechanics (choosing, setting aside,
backfilling, integrating): they name no pattern the profile could find and compute nothing,
so a test of the pipeline depends on no real family's shapes, kernels or numbers.

`registered` puts them in the registry (`codegen.registry.families`) for one test; outside
tests they do not exist.
"""

from __future__ import annotations

from contextlib import contextmanager

from core.family import Family, RankHooks


def _unused(*args, **kwargs):
    raise AssertionError("a fake family is not generated, verified or patched in")


def fake(name: str, rivals: tuple[str, ...] = ()) -> Family:
    """A family with every required field and nothing behind it; `rivals`: the families that
    replace the same ops (`RankHooks.rivals`)."""
    return Family(name=name, patterns=(), reference=_unused, make_inputs=_unused,
                  make_out=_unused, edge_cases=_unused, min_bytes=_unused, flops=_unused,
                  search_space=_unused, render=_unused, patch=_unused,
                  cases_from_model=_unused, rank=RankHooks(rivals=rivals))


# "wide" replaces the ops "narrow" does and more (as an epilogue GEMM does a gated activation's):
# rivals, one of which gives way; the others stand alone
FAKES = (fake("wide", rivals=("narrow",)), fake("narrow", rivals=("wide",)), fake("norm"),
         fake("slow"), fake("extra"), fake("spare"))


@contextmanager
def registered(families=FAKES):
    from codegen.registry import families as registry

    known = registry()
    clash = [f.name for f in families if f.name in known]
    assert not clash, f"fake families named as real ones: {clash}"
    known.update({f.name: f for f in families})
    try:
        yield {f.name: f for f in families}
    finally:
        for f in families:
            known.pop(f.name, None)
