"""The budgeted search keeps the ends of a family's space, not just its first entries."""

from codegen.search import spread


def test_spread_covers_the_space_evenly():
    space = [{"i": i} for i in range(12)]
    assert spread(space, None) == space
    assert spread(space, 20) == space
    picked = [c["i"] for c in spread(space, 4)]
    assert picked == [0, 4, 7, 11]
    assert len({c["i"] for c in spread(space, 5)}) == 5
    assert spread(space, 1) == [{"i": 6}]
