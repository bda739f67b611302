"""`pipeline e2e`: generation end to end on the CPU (tiny-llama), its record, its report section,
and what it does with a run it cannot fully serve or an interruption."""

import json
import shutil
from pathlib import Path

import pytest

from core.artifacts import load
from core.errors import UserError
from core.records import E2E, GenerationPoint
from core.workload import for_generation, parse_generations
from tests.pipeline.cli_runs import run_cli

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "e2e.json"


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """profile --generation 1x8+4, optimize with rmsnorm, then e2e: the README's flow."""
    home = tmp_path_factory.mktemp("e2e")
    run = home / "run"
    steps = [("profile", "tiny-llama", "--generation", "1x8+4", "--device", "cpu",
              "--run-dir", str(run)),
             ("optimize", str(run), "--families", "rmsnorm", "--pairs", "2"),
             ("e2e", str(run))]
    procs = []
    for args in steps:
        procs.append(run_cli(*args, home=home))
        assert procs[-1].returncode == 0, procs[-1].stderr[-3000:]
    return run, procs[-1]


@pytest.fixture(scope="module")
def profiled_only(tmp_path_factory):
    """A run with one prefill workload and no optimize: nothing of ours to measure."""
    home = tmp_path_factory.mktemp("e2e_profile_only")
    run = home / "run"
    proc = run_cli("profile", "tiny-llama", "--batch", "1", "--seq", "8", "--device", "cpu",
                   "--run-dir", str(run), home=home)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_generation_names_its_prefill_and_its_last_decode_step():
    keys = [w.key for w in for_generation("1x1024+128,8x128+128", "bf16", "cuda")]
    assert keys == ["prefill-b1-s1024-bf16", "decode-b1-s1152-bf16", "prefill-b8-s128-bf16",
                    "decode-b8-s256-bf16"]
    assert [w.key for w in for_generation("2x16+8", "fp32", "cpu", "decode")] == [
        "decode-b2-s24-fp32"]
    assert parse_generations("1x8+4, 2x16+8") == [(1, 8, 4), (2, 16, 8)]
    for bad in ("1x8", "ax8+4", "1x0+4", ""):
        with pytest.raises(UserError, match="--generation"):
            parse_generations(bad)


def test_help_explains_the_grid_and_the_variants(tmp_path):
    out = run_cli("e2e", "--help", home=tmp_path).stdout
    for words in ("batch x prompt x new", "hf-static", "ours-graphs", "--generation",
                  "cache_implementation=\"static\"", "--resume"):
        assert words in out, words


def test_bad_input_is_one_line(tmp_path, profiled_only):
    for args, words in ((["e2e", str(profiled_only), "--variants", "nope"], "unknown variant"),
                        (["e2e", str(profiled_only), "--batch", "0"], "--batch"),
                        (["e2e", str(tmp_path / "missing")], "no such directory"),
                        (["profile", "tiny-llama", "--generation", "1x8"], "BxP+N")):
        proc = run_cli(*args, home=tmp_path)
        assert proc.returncode == 2, (args, proc.stderr)
        assert words in proc.stderr and "Traceback" not in proc.stderr


def test_e2e_runs_every_cpu_variant_and_writes_a_valid_record(generated):
    run, proc = generated
    rec = load(run / "e2e.json", E2E, "e2e")
    assert (rec.device, rec.dtype, rec.model) == ("cpu", "float32", "tiny-llama")
    [point] = rec.points  # the run's own generation: its profile recorded it
    assert (point.key, point.batch, point.prompt, point.new) == (
        "generate-b1-p8-n4-fp32", 1, 8, 4)
    assert (point.prefill_workload, point.decode_workload) == (
        "prefill-b1-s8-fp32", "decode-b1-s12-fp32")
    assert point.floor_ms > 0 and point.weight_bytes > 0
    by = {v.name: v for v in point.variants}
    assert list(by) == ["hf-eager", "hf-static", "graph", "ours", "ours-graphs",
                        "ours-static-compile"]
    for name in ("graph", "ours-graphs"):
        assert by[name].skipped == "CUDA graphs need a CUDA device" and by[name].times is None
    for name in ("hf-eager", "hf-static", "ours", "ours-static-compile"):
        t = by[name].times
        assert t is not None and t.ttft_p50 > 0 and t.tpot_p50 > 0 and t.tok_s > 0
        assert t.tpot_p99 >= t.tpot_p50 and by[name].first_call_s > 0
        assert by[name].same_tokens == 1.0 and by[name].first_divergence is None
    assert "does not compile" in by["hf-static"].note
    assert "does not compile" in by["ours-static-compile"].note  # the CPU: eager steps
    assert by["ours"].families == by["ours-static-compile"].families == ["rmsnorm"]
    assert by["ours-static-compile"].kernel_calls["steps"]["rmsnorm"] == 5 * 3
    # the kernel served both phases: 2 layers x 2 norms + the final one per forward
    assert by["ours"].kernel_calls["prefill"]["rmsnorm"] == 5
    assert by["ours"].kernel_calls["steps"]["rmsnorm"] == 5 * 3
    assert "generate-b1-p8-n4-fp32" in proc.stdout


def test_the_report_leads_with_the_generation(generated):
    run, _ = generated
    md = (run / "report.md").read_text()
    verdict = md.split("## Verdict")[1].split("\n## ")[0]
    first = [ln for ln in verdict.splitlines() if ln.startswith("- ")][0]
    assert first.startswith("- generation b1, 8 + 4 tokens: ours ") and "not a GPU timing" in first
    assert md.index("## Generation end to end") < md.index("## Model and environment")
    assert "### generate-b1-p8-n4-fp32" in md and (run / "plots" / "e2e_tpot.png").exists()
    assert "ours, steps: rmsnorm (15 calls)" in md
    assert load(run / "e2e.json", E2E, "e2e").points[0].variants[3].served == {
        "prefill": ["rmsnorm"], "steps": ["rmsnorm"]}


def test_a_run_without_decode_workloads_still_times_transformers(profiled_only):
    from pipeline.e2e import run_e2e

    rec = run_e2e(profiled_only, [(1, 8, 3)], ["hf-eager", "ours"], 1, lambda s: None)
    by = {v.name: v for v in rec.points[0].variants}
    assert by["hf-eager"].times is not None
    assert "run `pipeline optimize` first" in by["ours"].skipped


def test_an_interrupted_e2e_keeps_its_points_and_resume_measures_the_rest(
        profiled_only, monkeypatch):
    from pipeline import e2e

    path = profiled_only / "e2e.json"
    path.unlink(missing_ok=True)
    measured = []

    def point(run_dir, model, batch, prompt, new, dtype, *rest):
        measured.append(prompt)
        if prompt == 6 and len(measured) == 2:
            raise KeyboardInterrupt
        rec = GenerationPoint(key=e2e.point_key(batch, prompt, new, dtype), batch=batch,
                              prompt=prompt, new=new)
        rest[-1](rec)  # save, as the real one does before freeing its variants
        return rec

    monkeypatch.setattr(e2e, "_point", point)
    with pytest.raises(KeyboardInterrupt):
        e2e.run_e2e(profiled_only, [(1, 4, 2), (1, 6, 2)], ["hf-eager"], 1, lambda s: None)
    assert [p.prompt for p in load(path, E2E, "e2e").points] == [4]
    e2e.run_e2e(profiled_only, [(1, 4, 2), (1, 6, 2)], ["hf-eager"], 1, lambda s: None,
                resume=True)
    assert measured == [4, 6, 6]  # the kept point was not measured again
    assert [p.prompt for p in load(path, E2E, "e2e").points] == [4, 6]


def test_the_report_renders_a_gpu_record(profiled_only, tmp_path):
    from pipeline.report import write_report

    run = tmp_path / "run"
    shutil.copytree(profiled_only, run)
    shutil.copy(FIXTURE, run / "e2e.json")
    write_report(run)
    md = (run / "report.md").read_text()
    rec = load(FIXTURE, E2E, "e2e")
    verdict = md.split("## Verdict")[1].split("\n## ")[0]
    assert "tokens/s over transformers' static-cache generate (hf-static" in verdict
    for p in rec.points:
        assert f"### {p.key}" in md
        for v in p.variants:
            if v.projected is not None:
                assert f"{v.projected.speedup:.2f}x ({v.projected.error:.1%})" in md
    data = json.loads((run / "report.json").read_text())
    assert data["e2e"]["points"][0]["key"] == rec.points[0].key


def test_the_ledger_tells_prefill_from_steps():
    from pipeline.e2e_variants import Clock, Ledger

    class Handle:
        calls = {"rmsnorm": 0, "decode_attention": 0}
        declined = {}

    h = Handle()
    ledger, clock = Ledger(h), Clock("cpu")
    ledger.begin(clock)  # the first call: a graphed step is captured in it
    clock.start()
    h.calls["rmsnorm"] += 5
    h.declined["decode_attention"] = ["prefill-case"]
    clock.token()  # the prefill's token
    h.calls["rmsnorm"] += 10
    h.calls["decode_attention"] += 4
    clock.token()
    ledger.end()
    assert ledger.calls == {"prefill": {"rmsnorm": 5, "decode_attention": 0},
                            "steps": {"rmsnorm": 10, "decode_attention": 4}}
    ledger.begin(clock)  # a timed call whose steps replay the graph: no Python, no counts
    clock.start()
    h.calls["rmsnorm"] += 5
    clock.token()
    clock.token()
    ledger.end()
    assert ledger.calls["steps"] == {"rmsnorm": 0, "decode_attention": 0}
    assert ledger.served("prefill") == {"rmsnorm"}
    assert ledger.served("steps") == {"rmsnorm", "decode_attention"}


def test_the_fixture_is_a_gpu_record():
    rec = load(FIXTURE, E2E, "e2e")
    assert rec.device.startswith("cuda") and rec.points
    assert any(v.projected is not None for p in rec.points for v in p.variants)


def test_ours_graphs_first_token_starts_from_graphs_measured_one():
    from core.e2e_records import TokenTimes
    from pipeline.e2e_projection import first_token_base

    def times(ttft):
        return TokenTimes(ttft_p50=ttft, ttft_p99=ttft, tpot_p50=1.0, tpot_p99=1.0,
                          e2e_p50=ttft + 10, tok_s=1.0, samples=1)

    eager, graph = times(22.0), times(13.0)
    assert first_token_base("ours-graphs", eager, graph) == 13.0
    assert first_token_base("ours", eager, graph) == 22.0  # transformers' loop: hf-eager's
    assert first_token_base("graph", eager, graph) == 22.0  # never its own measurement
    assert first_token_base("ours-graphs", eager, None) == 22.0  # graph not in the grid
