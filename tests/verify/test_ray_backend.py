"""The Ray backend (verify.workers) on a local Ray started here (interpreter kernels on the
CPU; on a GPU machine one task per GPU): the same verdicts as the local backend for a tiny
model's rmsnorm candidates, a crashing and a hanging candidate failing alone, cancelled
candidates leaving no record, and the cluster shut down afterwards. The GPU test runs every
config of the case through both backends, timed, on one GPU."""

from __future__ import annotations

import sys
import tempfile
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch

from core.errors import UserError
from verify.harness import verify_each
from verify.workers import LocalWorkers, make_workers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WRONG = '''
def forward(x, weight, *, out, **params):
    out.zero_()  # runs, writes every element, and is wrong
'''
CRASH = '''
import ctypes


def forward(x, weight, *, out, **params):
    ctypes.string_at(0)
'''
HANG = '''
import time


def forward(x, weight, *, out, **params):
    while True:
        time.sleep(3600)
'''


def start_local_ray(ray) -> None:
    """A 2-CPU Ray for this module alone: no dashboard, its own short temp folder (the raylet's
    socket paths must stay under 107 characters), a new cluster, not one running beside it.
    Its dashboard agent still starts (Ray 2.60 always starts it): on a loaded 2-core machine
    the raylet can give up waiting 15 s for the agent's port file (ray-project/ray#65983);
    neither ray.init's options nor fixed agent ports (`ray start`) avoid that wait."""
    ray.init(num_cpus=2, num_gpus=None if DEVICE == "cuda" else 0, include_dashboard=False,
             log_to_driver=False, configure_logging=False, object_store_memory=80 * 1024 * 1024,
             _temp_dir=tempfile.mkdtemp(prefix="ray-", dir="/tmp"), address="local")


@pytest.fixture(scope="module")
def ray_workers():
    ray = pytest.importorskip("ray")
    started = time.monotonic()
    try:
        start_local_ray(ray)
    except Exception as e:  # noqa: BLE001 - Ray's own start-up, not the code under test
        ray.shutdown()
        pytest.skip(f"a local Ray did not start here ({type(e).__name__}: {str(e)[:200]}); "
                    "see ray-project/ray#65983")
    print(f"local Ray started in {time.monotonic() - started:.1f} s")
    try:
        workers = make_workers("ray", gpu=DEVICE == "cuda")
        yield workers
        workers.close()
    finally:
        ray.shutdown()
    assert not ray.is_initialized()


@pytest.fixture(scope="module")
def tiny_case():
    """The rmsnorm call of tiny-llama at batch 1, seq 8, as the generate stage finds it."""
    from codegen.rmsnorm import FAMILY
    from core.workload import Workload
    from profiling.loader import build, resolve

    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    model = build(resolve("tiny-llama"), getattr(torch, dtype), DEVICE)
    cases = FAMILY.cases_from_model(model, Workload(1, 8, dtype, DEVICE))
    assert cases
    return FAMILY, cases[0]


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


def test_ray_and_local_verdicts_agree(ray_workers, tiny_case, tmp_path):
    fam, case = tiny_case
    good = write(tmp_path, "good", fam.render(fam.search_space(case)[-1], case))
    wrong = write(tmp_path, "wrong", WRONG)
    kw = {"device": DEVICE, "trials": 1, "timing": False}
    local = list(verify_each(fam, [good, wrong], [case], workers=LocalWorkers(), **kw))
    on_ray = list(verify_each(fam, [good, wrong], [case], workers=ray_workers,
                              record_dir=tmp_path / "run", **kw))
    assert [r.verdict for r in local] == [r.verdict for r in on_ray] == ["accepted", "rejected"]
    assert local[1].failed() == on_ray[1].failed() and "numerics" in on_ray[1].failed()
    for r in on_ray:
        assert r.worker["backend"] == "ray" and r.worker["ray_node_id"]
        assert r.worker["hostname"] and (r.worker["gpu"] is None) == (DEVICE == "cpu")
        assert Path(r.record_path).is_file()
    assert local[0].worker["backend"] == "local" and local[0].worker["hostname"]


def test_crash_and_hang_fail_alone_on_ray(ray_workers, tiny_case, tmp_path):
    fam, case = tiny_case
    paths = [write(tmp_path, "crash", CRASH), write(tmp_path, "hang", HANG),
             write(tmp_path, "wrong", WRONG)]
    started = time.monotonic()
    crash, hang, after = verify_each(fam, paths, [case], device=DEVICE, trials=1, timing=False,
                                     timeout_s=5, workers=ray_workers)
    assert crash.failed() == {"crash"} and "SIGSEGV" in crash.reasons[0]
    assert hang.failed() == {"timeout"} and "5 s" in hang.reasons[0]
    # judged in full by a Ray worker that ran the crash or the hang before it
    assert "numerics" in after.failed() and not {"crash", "timeout"} & after.failed()
    assert time.monotonic() - started < 60


def test_closing_early_cancels_the_rest_and_records_only_what_was_taken(
        ray_workers, tiny_case, tmp_path):
    fam, case = tiny_case
    wrong, hang = write(tmp_path, "wrong", WRONG), write(tmp_path, "hang", HANG)
    run = tmp_path / "run"
    results = verify_each(fam, [wrong, hang], [case], device=DEVICE, trials=1, timing=False,
                          timeout_s=120, record_dir=run, workers=ray_workers)
    with closing(results):
        first = next(results)
    assert first.verdict == "rejected"
    started = time.monotonic()
    ray_workers.drain(timeout_s=60)  # the cancelled hang ends long before its 120 s
    assert time.monotonic() - started < 30
    assert sorted(p.name for p in (run / "verification" / fam.name).iterdir()) == ["wrong.json"]


def test_verify_stage_on_ray_takes_the_first_accepted_in_order(ray_workers, tiny_case,
                                                              tmp_path):
    """The stage submits a case's candidates side by side; the first accepted in the screen's
    order wins, as on one GPU, and the one after it is cancelled and leaves no record."""
    from codegen.search import case_key
    from pipeline.stages.verify import verify_stage

    fam, case = tiny_case
    good = write(tmp_path, "good", fam.render(fam.search_space(case)[-1], case))
    order = [write(tmp_path, "wrong", WRONG), good, write(tmp_path, "hang", HANG)]
    log = {"searches": [{
        "family": fam.name, "case": case, "case_key": case_key(case),
        "order": [str(p) for p in order], "baseline": {"median_ms": 2.0, "host_us": None},
        "candidates": [{"path": str(p), "config": {}, "timing": {"median_ms": 1.0},
                        "host_us": None} for p in order]}]}
    summary = verify_stage(tmp_path, log, DEVICE, lambda _: None, resume=False,
                           workers=ray_workers)
    [accepted] = summary["accepted"].values()
    assert accepted["source"] == str(good) and summary["rejected"] == []
    ray_workers.drain(timeout_s=60)
    records = sorted(p.stem.split("__")[1] for p in (tmp_path / "verification" / fam.name)
                     .iterdir())
    assert records == [f"{tmp_path.name}_good", f"{tmp_path.name}_wrong"]


@pytest.mark.skipif(DEVICE == "cuda", reason="the cluster here has a GPU")
def test_a_gpu_run_on_a_cluster_without_gpus_is_one_line(ray_workers):
    with pytest.raises(UserError, match="has no GPU for a GPU run"):
        make_workers("ray", gpu=True)


def test_workers_ray_without_ray_is_one_line(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from pipeline.cli import cli

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    res = CliRunner().invoke(cli, ["optimize", str(tmp_path), "--workers", "ray"])
    assert isinstance(res.exception, UserError), res.output  # main() prints it as one line
    assert str(res.exception) == "--workers ray needs Ray: pip install 'kernel-pipeline[ray]'"
    with pytest.raises(UserError, match=r"pip install 'kernel-pipeline\[ray\]'"):
        make_workers("ray")
    with pytest.raises(UserError, match="unknown workers backend"):
        make_workers("dask")


@pytest.mark.gpu
def test_one_familys_candidates_on_one_gpu_through_both_backends(ray_workers, tiny_case,
                                                                 tmp_path):
    """Every rmsnorm config of the case, timed, locally and on Ray (one task per candidate,
    num_gpus=1, the same GPU here): equal verdicts; Ray's records name the GPU; the kernel
    times agree within noise."""
    fam, case = tiny_case
    paths = [write(tmp_path, f"cfg{i}", fam.render(cfg, case))
             for i, cfg in enumerate(fam.search_space(case))]
    kw = {"device": DEVICE, "trials": 2, "timing": True}
    local = list(verify_each(fam, paths, [case], workers=LocalWorkers(), **kw))
    on_ray = list(verify_each(fam, paths, [case], workers=ray_workers, **kw))
    assert [r.verdict for r in local] == [r.verdict for r in on_ray]
    assert any(r.accepted for r in on_ray)
    for a, b in zip(local, on_ray):
        gpu = b.worker["gpu"]
        assert gpu["name"] and gpu["uuid"] and gpu["pci_bus_id"], b.worker
        assert gpu["uuid"] == a.worker["gpu"]["uuid"]  # one GPU: the same card
        if a.accepted:
            ta, tb = (r.timing["cases"][0]["candidate"]["median_ms"] for r in (a, b))
            print(f"{Path(a.source).name}: local {ta:.4f} ms, ray {tb:.4f} ms")
            assert 0.5 < tb / ta < 2.0
