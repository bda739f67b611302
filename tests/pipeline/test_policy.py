"""The pipeline's choices between families, on small fake families (`tests.pipeline.
fake_family`): which go on to be measured in the model, which give way to a rival, which the
ranking backfills, and how the report holds the projection against what ran. Nothing here
depends on a real family's kernels or numbers; tests of a family are beside it."""

from __future__ import annotations

import pytest


def accepted_entry(fam, base_ms, kernel_ms, host_us=1.0) -> dict:
    """A verification summary's accepted-kernel entry, as far as the integrate stage reads it."""
    return {"family": fam, "speedup": base_ms / kernel_ms, "host_delta_us": host_us,
            "baseline": {"median_ms": base_ms}, "kernel": {"median_ms": kernel_ms}}


def test_a_family_that_cannot_win_is_not_integrated(fake_families):
    """Slower on the device in every accepted case and no host time saved: skipped, with the
    numbers in the reason. Faster on the device, or saving host time (a launch-bound pass),
    is enough to be measured in the model."""
    from pipeline.policy import cannot_win

    def acc(fam, speedup, host):
        return {"family": fam, "speedup": speedup, "host_delta_us": host}

    accepted = {"slow/a": acc("slow", 0.19, -30.0), "slow/b": acc("slow", 0.69, None),
                "narrow/a": acc("narrow", 1.7, -8.0), "spare/a": acc("spare", 0.9, 12.0),
                "extra/a": acc("extra", 0.8, -1.0), "extra/b": acc("extra", 1.2, -1.0)}
    skipped = cannot_win(accepted, ["slow", "narrow", "spare", "extra", "norm"])
    assert list(skipped) == ["slow"]
    assert "0.19x, 0.69x" in skipped["slow"] and "+30.0 us" in skipped["slow"]
    # faster inside a CUDA graph is enough too
    accepted["slow/a"]["graph_speedup"] = 1.3
    assert cannot_win(accepted, ["slow"]) == {}
    accepted["slow/a"]["graph_speedup"] = 0.9
    assert list(cannot_win(accepted, ["slow"])) == ["slow"]


def test_the_graph_projection_takes_each_familys_in_graph_speedup_where_measured(
        fake_families):
    from pipeline.projection.frozen import in_graph_speedups
    from pipeline.stages.verify import _graph_speedup

    assert _graph_speedup({"graph_ms": 0.006}, {"graph_ms": 0.002}) == pytest.approx(3.0)
    assert _graph_speedup({"graph_ms": 0.006}, {"graph_ms": None}) is None
    summary = {"accepted": {
        "norm/a": {"family": "norm", "speedup": 5.0, "graph_speedup": 2.0},
        "norm/b": {"family": "norm", "speedup": 5.0, "graph_speedup": 4.0},
        "extra/a": {"family": "extra", "speedup": 6.8, "graph_speedup": None}}}
    got = in_graph_speedups(summary, {"norm": 5.0, "extra": 6.8})
    assert got == {"norm": pytest.approx(3.0), "extra": 6.8}


def test_of_two_families_replacing_the_same_ops_the_one_saving_more_is_integrated(
        fake_families):
    """wide (a GEMM with the activation in its epilogue) and narrow (the activation alone) are
    rivals: only the one whose kernels save more device time per call goes on, the other is
    skipped with both numbers; the projection counts only what goes on."""
    from pipeline.policy import integrable, superseded

    acc = accepted_entry
    accepted = {"narrow/a": acc("narrow", 0.190, 0.110), "wide/a": acc("wide", 0.884, 0.860),
                "norm/a": acc("norm", 0.5, 0.05)}
    fams = ["wide", "norm", "narrow"]
    skipped = superseded(accepted, fams)
    assert list(skipped) == ["wide"]
    assert "superseded by narrow" in skipped["wide"]
    assert "saves 80.0 us" in skipped["wide"]
    assert "saves 24.0 us" in skipped["wide"]
    # a kernel slower than the original costs time; it never "saves" a negative amount
    slow = {**accepted, "wide/a": acc("wide", 0.884, 0.900)}
    assert "costs 16.0 us" in superseded(slow, fams)["wide"]
    assert "saves -" not in superseded(slow, fams)["wide"]
    kept, why = integrable(accepted, fams, "cuda")
    assert kept == ["norm", "narrow"] and set(why) == {"wide"}
    # a faster wide kernel wins instead
    accepted["wide/a"] = acc("wide", 0.884, 0.700)
    assert list(superseded(accepted, fams)) == ["narrow"]
    # alone, neither gives way
    assert superseded(accepted, ["wide", "norm"]) == {}


def test_on_the_cpu_interpreter_timings_do_not_decide_between_rivals(fake_families):
    """The same kernel numbers that make one rival win on a GPU decide nothing on the CPU:
    there the one the ranking puts first is kept, whichever order the timings say, and the
    reason says what a GPU would decide on."""
    from pipeline.policy import fallbacks, integrable, superseded

    acc = accepted_entry
    for slow, fast in (("narrow", "wide"), ("wide", "narrow")):
        accepted = {f"{slow}/a": acc(slow, 0.1, 5.0), f"{fast}/a": acc(fast, 5.0, 0.1)}
        fams = [slow, fast]  # the ranking's order: the slower one first
        why = superseded(accepted, fams, "cpu")
        assert list(why) == [fast], why
        assert "ranking's order" in why[fast] and "on a GPU" in why[fast]
        assert "cannot tell" in why[fast] and " us per call against" not in why[fast]
        assert integrable(accepted, fams, "cpu")[0] == [slow]
        assert fallbacks(accepted, fams, "cpu") == {fast: slow}
        assert list(superseded(accepted, fams, "cuda")) == [slow]


def test_top_n_backfills_a_family_that_cannot_reach_the_model(fake_families):
    """`--top 3` with `slow` ranked 2nd but slower than the code it replaces: the 4th family is
    generated and verified in its place, so three families reach the model; nothing more is
    added once three can."""
    from pipeline import policy

    ranking = {"workloads": [{"rows": [
        {"family": f, "replay_gain": g, "amdahl_gain": g}
        for f, g in (("norm", 1.3), ("slow", 1.2), ("extra", 1.1), ("spare", 1.05),
                     ("wide", 1.01))]}]}
    verdicts = {"norm": 1.5, "slow": 0.2, "extra": 1.4, "spare": 1.2, "wide": 1.1}
    generated = []

    def generate(run_dir, fams, *args):
        generated.extend(fams)
        return {"searches": generated[:]}

    def verify(run_dir, log, *args):
        return {"accepted": {f"{f}/c": {"family": f, "speedup": verdicts[f],
                                        "host_delta_us": None} for f in log["searches"]}}

    def search(more):
        log = generate(None, more)
        return log, verify(None, log)

    chosen = policy.choose_families(ranking, 3)
    log = generate(None, chosen)
    messages = []
    fams, summary = policy.backfill(ranking, chosen, 3, "cuda:0", messages.append,
                                    verify(None, log), search)
    assert chosen == ["norm", "slow", "extra"]
    assert fams == ["norm", "slow", "extra", "spare"]
    assert generated == fams  # only the backfilled family was generated again
    assert policy.integrable(summary["accepted"], fams, "cuda:0")[0] == ["norm", "extra", "spare"]
    assert messages == ["slow will not reach the model; next in the ranking: spare"]


def test_projection_error_is_against_the_set_that_shipped(fake_families):
    """A rollback changes the measured set; the error is then taken against the projection of
    that set (computed from the frozen kernel numbers), not the set that never ran."""
    from pipeline.report import _integration
    from pipeline.report_plots import _proj_cells

    def ratio(est, decision):
        return {"estimate": est, "ci_low": est - 0.01, "ci_high": est + 0.01,
                "meaningful": True, "verdict": "x", "decision": decision, "ratios": [est] * 3}

    iw = {"per_family": {"norm": ratio(0.86, "kept"), "narrow": ratio(1.06, "rolled back")},
          "combined": ratio(0.8, "kept"), "kept": ["norm"], "check": {},
          "projection_for_kept": {"families": ["norm"], "amdahl": 1.3, "replay": 1.25}}
    projected = {"amdahl": 1.4, "replay": 1.3, "families": ["narrow", "norm"], "note": None}
    out = _integration(iw, projected)
    measured = out["measured"]["speedup"]
    assert measured == pytest.approx(1 / 0.8)
    assert out["projection_error"]["replay"] == pytest.approx(abs(1.25 - measured) / measured)
    assert out["projection_error"]["amdahl"] == pytest.approx(abs(1.3 - measured) / measured)
    assert "projected for that set" in out["measured"]["note"]
    # the report's projected cells are the values the error is taken against
    assert _proj_cells({"projected": projected, **out}) == ("1.300x", "1.250x")
    # without a projection for the kept set, the error stays against the projected set
    out = _integration({**iw, "projection_for_kept": None}, projected)
    assert out["projection_error"]["replay"] == pytest.approx(abs(1.3 - measured) / measured)
    assert _proj_cells({"projected": projected, **out}) == ("1.400x", "1.300x")


def test_the_fake_families_are_registered_for_the_test_only(fake_families):
    from codegen.registry import families, get_family
    from tests.pipeline.fake_family import fake, registered

    assert get_family("wide").rank.rivals == ("narrow",)
    assert not any(f.patterns for f in fake_families.values())  # nothing for a profile to find
    with registered((fake("other"),)):
        assert "other" in families()
    assert "other" not in families() and set(fake_families) <= set(families())
