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


def test_a_graphed_search_ranks_by_the_time_inside_a_graph():
    """rank_by "graph" (decode runs on a GPU) orders by graph_ms where every timed candidate
    has one; otherwise, and by default, by the kernel's own median."""
    from codegen.search import rank_entries

    def entry(rank_by, graph=(0.019, 0.0184)):
        return {"search": {"rank_by": rank_by}, "candidates": [
            {"path": "cublas", "screen": "ok", "timing": {"median_ms": 0.0229},
             "graph_ms": graph[0]},
            {"path": "gemv", "screen": "ok", "timing": {"median_ms": 0.0240},
             "graph_ms": graph[1]},
            {"path": "broken", "screen": "error: compile"}]}

    for rank_by, graph, order in (("graph", (0.019, 0.0184), ["gemv", "cublas"]),
                                  ("kernel", (0.019, 0.0184), ["cublas", "gemv"]),
                                  ("graph", (0.019, None), ["cublas", "gemv"])):
        e = entry(rank_by, graph)
        rank_entries(e)
        assert e["order"] == order, (rank_by, graph)
        assert e["candidates"][2]["decision"] == "discarded: error: compile"
