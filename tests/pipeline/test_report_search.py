"""The report's search table (pipeline/report_search.py): one row per searched case, from the
search log alone, including logs written before the search recorded its strategy."""

from pipeline.report_search import search_blocks


def _cand(trial, ms, screen="pass", meaningful=True, **more):
    timing = {"median_ms": ms, "meaningful": meaningful} if ms is not None else None
    return {"path": f"k{trial}.py", "trial": trial, "elapsed_s": trial * 1.5, "screen": screen,
            "timing": timing, **more}


def test_one_row_per_case_with_what_the_search_took():
    log = {"searches": [
        {"family": "gated_act", "case_key": "a", "case": {},
         "search": {"strategy": "tpe", "asked": "auto", "trials": 4, "budget_trials": 8,
                    "memory": {"used": True, "remembered": 2}},
         "candidates": [_cand(1, 2.0), _cand(2, None, "error: OutOfResources"),
                        _cand(3, 1.005), _cand(4, 1.0)],
         "proposals": [{"trial": 4}]},
        {"family": "rmsnorm", "case_key": "b", "case": {},
         "search": {"strategy": "grid", "asked": "tpe", "trials": 1, "budget_trials": 1,
                    "memory": {"used": False, "ignored": "--fresh-search"}},
         "candidates": [_cand(1, 3.0, meaningful=False)]},
        {"family": "rope", "case_key": None, "case": None, "note": "no call"},
        # a log from before strategies: no `search` record, no trial numbers
        {"family": "gelu", "case_key": "c", "case": {},
         "candidates": [{"path": "x.py", "screen": "pass", "timing": {"median_ms": 1.0}}]},
    ]}
    blocks = search_blocks(log)
    assert blocks[0] == ("h", 2, "Search")
    _, headers, rows = blocks[-1]
    assert headers[-1] == "proposer trials"
    assert rows[0] == ["gated_act", "a", "tpe", "4 of 8", 2, "1.000 ms", "trial 3, 4.5 s", 1, 1]
    assert rows[1] == ["rmsnorm", "b", "grid (asked tpe)", "1 of 1", "ignored",
                       "3.000 ms (not meaningful)", "trial 1, 1.5 s", 0, "-"]
    assert rows[2] == ["gelu", "c", "-", "1 of 1", "-", "1.000 ms", "trial 1", 0, "-"]


def test_no_search_no_table():
    assert search_blocks(None) == [] and search_blocks({"searches": []}) == []
