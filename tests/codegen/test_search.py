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


def test_one_config_under_the_interpreter_is_the_widest():
    """On the CPU a single config per case is the last of the space (widest tiles, fewest
    programs for the interpreter to run); on a GPU a budget of one is the middle one."""
    from codegen.rope import FAMILY as ROPE
    from codegen.rope.reference import make_case
    from codegen.search import backend_configs

    case = make_case(2, 64, 4, 2, 16, 16, "float32")
    space = ROPE.search_space(case)
    assert backend_configs(ROPE, case, "triton", 1, interpreter=True) == space[-1:]
    assert backend_configs(ROPE, case, "triton", 1) == [space[len(space) // 2]]
    assert backend_configs(ROPE, case, "triton", 3, interpreter=True) == spread(space, 3)
