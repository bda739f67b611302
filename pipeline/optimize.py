"""`pipeline optimize`: rank -> generate -> verify -> integrate -> report on one run directory.

Each stage writes its artifact atomically; with `--resume` a stage whose artifact exists is
skipped, and inside generate/verify every (family, case) already done is skipped too.

Decisions written down here:
- The top N are families (a family replaces all its occurrences), taken from the ranking by
  whole-model gain, best rank over all profiled workloads.
- A candidate is specialised to its case (constexpr widths); families give edge cases that keep
  those widths (one row, prime row counts, strided rows), so the verifier runs the very file
  that will run in the model on them. Awkward widths exercise the generator: tests/codegen
  renders and checks them on every commit.
- The projection is frozen (written to projection.json) before integration measures anything.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from pipeline.artifacts import read_json, write_json
from pipeline.errors import UserError


def choose_families(ranking: dict, top: int | None) -> list[str]:
    """Families by their best whole-model gain on any workload; the first `top` (all: None)."""
    best: dict[str, tuple] = {}
    for w in ranking["workloads"]:
        fam_rows = [r for r in w["rows"] if r["family"]]
        for i, r in enumerate(fam_rows):
            gain = r["replay_gain"] or r["amdahl_gain"]
            cur = best.get(r["family"])
            if cur is None or (-gain, i) < cur:
                best[r["family"]] = (-gain, i)
    return [f for f, _ in sorted(best.items(), key=lambda kv: kv[1])][:top]


def generate_stage(run_dir: Path, families: list[str], model, workloads, device: str,
                   say: Callable[[str], None], resume: bool, max_configs: int | None,
                   backend: str = "triton") -> dict:
    """`backend`: "triton", "cuda" or "both" (already checked against the device)."""
    from codegen.registry import get_family
    from codegen.search import case_key, family_backend, search

    path = run_dir / "candidates" / "search_log.json"
    log = read_json(path, "search log") if (resume and path.exists()) else {"searches": []}
    index = {(s["family"], s["case_key"]): i for i, s in enumerate(log["searches"])}
    # a case whose candidate file was edited after it was screened is searched again: the
    # edit is kept (write_candidate) and screened, then verified, as it is now
    done = {k for k, i in index.items() if not _edited_since_screened(log["searches"][i])}
    changed = not (resume and path.exists())
    for name in families:
        fam = get_family(name)
        wanted = family_backend(fam, backend)
        if wanted != backend:
            say(f"{name} has no CUDA C++ variant; generating Triton")
        cases = []
        for w in workloads:
            for c in fam.cases_from_model(model, w):
                if c not in cases:
                    cases.append(c)
        if not cases:
            if (name, None) not in index:
                index[(name, None)] = len(log["searches"])
                log["searches"].append({"family": name, "case_key": None, "case": None,
                                        "note": "the model has no call this family can replace"})
                changed = True
            continue
        for case in cases:
            key = (name, case_key(case))
            # a case searched for another backend is searched again (logs written before
            # backends existed searched Triton)
            if key in done and log["searches"][index[key]].get("backend", "triton") == wanted:
                continue
            say(f"generate {name} {case_key(case)}")
            entry = search(fam, case, run_dir / "candidates", device, max_configs=max_configs,
                           backend=backend)
            if key in index:
                log["searches"][index[key]] = entry
            else:
                index[key] = len(log["searches"])
                log["searches"].append(entry)
            write_json(path, log)
            changed = False
    if changed:
        write_json(path, log)
    return log


def _edited_since_screened(search: dict) -> bool:
    for c in search.get("candidates") or []:
        if c.get("sha1") is None:  # proposals, and logs written before sha1 was recorded
            continue
        p = Path(c["path"])
        if not p.is_file() or hashlib.sha1(p.read_bytes()).hexdigest() != c["sha1"]:
            return True
    return False


def _sha256(path) -> str | None:
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def _candidate_name(case_key: str, path: str) -> str:
    """The record name: generated files are all kernel.py (named by their config folder);
    proposals share one out/ folder (named by their file)."""
    p = Path(path)
    return f"{case_key}__{p.parent.name}" + ("" if p.name == "kernel.py" else f"_{p.stem}")


def verify_stage(run_dir: Path, log: dict, device: str, say: Callable[[str], None],
                 resume: bool) -> dict:
    """Fully verify the fastest screened candidate of every (family, case); next if rejected."""
    from codegen.registry import get_family
    from verify.harness import verify_candidate

    path = run_dir / "verification" / "summary.json"
    summary = read_json(path, "verification summary") if (resume and path.exists()) \
        else {"accepted": {}, "rejected": []}
    changed = not path.exists()
    for s in log["searches"]:
        if not s.get("case_key"):
            continue
        key = f"{s['family']}/{s['case_key']}"
        # a decision stands while the files it was made on are unchanged (else: verify again)
        acc = summary["accepted"].get(key)
        if acc is not None:
            if acc.get("source_sha256", "unknown") in ("unknown", _sha256(acc["source"])):
                continue
            del summary["accepted"][key]
        rej = next((r for r in summary["rejected"] if r["key"] == key), None)
        if rej is not None:
            if rej.get("sources", "unknown") in ("unknown", _fingerprint(s)):
                continue
            summary["rejected"].remove(rej)
        fam = get_family(s["family"])
        tried = []
        for cand in s["order"] or []:
            name = _candidate_name(s["case_key"], cand)
            say(f"verify {key} {name.split('__', 1)[1]}")
            res = verify_candidate(fam, cand, [s["case"]], device=device, record_dir=run_dir,
                                   candidate=name)
            tried.append({"candidate": cand, "verdict": res.verdict, "reasons": res.reasons,
                          "record": res.record_path})
            if res.accepted:
                entry = next(e for e in s["candidates"] if e["path"] == cand)
                summary["accepted"][key] = {
                    "family": s["family"], "case": s["case"], "source": cand,
                    "source_sha256": res.source_sha256, "config": entry["config"],
                    "kernel": entry["timing"],
                    "baseline": s["baseline"], "record": res.record_path,
                    "speedup": s["baseline"]["median_ms"] / entry["timing"]["median_ms"],
                    "host_delta_us": (s["baseline"].get("host_us") - entry["host_us"])
                    if entry.get("host_us") is not None and s["baseline"].get("host_us")
                    is not None else None,
                    "verification_timing": res.timing}
                break
        else:
            summary["rejected"].append({"key": key, "family": s["family"], "tried": tried,
                                        "sources": _fingerprint(s),
                                        "reason": "no candidate passed verification"
                                        if tried else "no candidate passed the screen"})
        write_json(path, summary)
        changed = False
    if changed:
        write_json(path, summary)
    return summary


def _fingerprint(search: dict) -> dict[str, str | None]:
    return {p: _sha256(p) for p in search.get("order") or []}


def kernel_speedups(summary: dict, key: str = "speedup") -> dict[str, float]:
    """family -> median over its accepted cases of `key` (kernel speedup, or host_us)."""
    import statistics

    by_family: dict[str, list[float]] = {}
    for acc in summary["accepted"].values():
        if acc.get(key) is not None:
            by_family.setdefault(acc["family"], []).append(acc[key])
    return {f: statistics.median(v) for f, v in by_family.items()}


def freeze_projection(run_dir: Path, summary: dict, families: list[str], on_gpu: bool,
                      in_model: dict | None = None, in_model_set: dict | None = None) -> dict:
    """Re-rank with measured kernel times (not rooflines) and freeze the projection.
    `in_model`: per workload, the host deltas measured in the model (`host_stage`); they
    replace the search's per-kernel ones for that workload. `in_model_set`: per workload, the
    host share the families save together (`host_delta.set_host_share`); what it saves beyond
    their own deltas is spread over their calls (`host_delta.spread_set_share`)."""
    from pipeline.host_delta import spread_set_share

    ranking = read_json(run_dir / "ranking.json", "ranking")
    # only what will reach the model: a family skipped before any measurement (one that
    # cannot win, or one superseded by another replacing the same ops) is not projected
    device = "cuda" if on_gpu else "cpu"
    fams, _ = integrable(summary["accepted"], families, device)
    # a family set aside may still ship where the one it was set aside for does not: its
    # numbers are kept for the projection of the set that ships (`project_kept`)
    known = fams + list(fallbacks(summary["accepted"], families, device))
    speed = {f: v for f, v in kernel_speedups(summary).items() if f in known} if on_gpu else {}
    host = {f: v for f, v in kernel_speedups(summary, "host_delta_us").items()
            if f in known} if on_gpu else {}
    out = {"stage": "projection", "kernel_speedups": speed, "host_delta_us": host,
           "families": families, "workloads": {}}
    for w in ranking["workloads"]:
        measured = (in_model or {}).get(w["key"]) or {}
        together = (in_model_set or {}).get(w["key"])
        host_w, extra = spread_set_share({**host, **rescaled_host(w, measured)}, measured,
                                         together, w.get("enqueue_ms"))
        if extra is not None:
            together = {**together, "extra_us_per_call": extra}
        out["workloads"][w["key"]] = {
            **project_set(run_dir, w, speed, host_w, on_gpu, only=fams),
            "host_delta_us": host_w, "host_in_model": measured,
            "host_set": together,
            "note": None if on_gpu else "CPU/interpreter run: kernel times are not GPU "
                                        "timings, so no speedup is projected",
        }
    write_json(run_dir / "projection.json", out)
    return out


def rescaled_host(ranked: dict, measured: dict, basis: str | None = None) -> dict:
    """family -> the in-model host delta per call (`basis`: which of host_delta's readings,
    default HOST_BASIS) at the host speed of the profile: its share of the unpatched pass's
    host time, pair by pair, times the profile's host time; for deltas measured before shares
    were recorded, the delta rescaled by `host_drift`."""
    from pipeline.host_delta import HOST_BASIS

    basis = basis or HOST_BASIS
    share = basis.replace("us_per_call", "share_per_call")
    then = ranked.get("enqueue_ms")
    return {f: d[share] * then * 1e3 if then and d.get(share) is not None
            else d[basis] * host_drift(ranked, d)
            for f, d in measured.items() if d.get(basis) is not None}


def host_drift(ranked: dict, measured: dict) -> float:
    """The profile's enqueue time over the one measured with the in-model delta: the same
    host, minutes apart, ran the unpatched Qwen2.5-0.5B decode step at 46 ms and at 22 ms within
    one call (H200 host, 2026-11-30), and the replay's host chain is calibrated to the profile's
    moment. 1 when either is unknown."""
    then = ranked.get("enqueue_ms")
    now = measured.get("base_enqueue_ms")
    return then / now if then and now else 1.0


def host_of(proj: dict, key: str) -> dict:
    """The host deltas a workload's projection used (per workload since they are measured in
    the model; projections frozen before that have one set for all)."""
    return (proj["workloads"].get(key) or {}).get("host_delta_us") or proj["host_delta_us"]


def host_stage(model, workloads, summary: dict, families: list[str],
               say: Callable[[str], None], profile_ms: dict | None = None
               ) -> tuple[dict, dict]:
    """Per workload of the model's dtype: each integrable family's host delta per call,
    measured in the model (pipeline.host_delta), before any whole-model timing; and the host
    share the integrable families save together (`set_host_share`).
    `profile_ms`: workload key -> the profile's unpatched host time (the ranking's
    enqueue_ms), which the measurements are taken near."""
    from pipeline.host_delta import in_model_host_deltas, set_host_share

    accepted = summary["accepted"]
    fams, _ = integrable(accepted, families, workloads[0].device)
    together = list(fams)  # the set integration checks first
    fams += list(fallbacks(accepted, families, workloads[0].device))
    out, sets = {}, {}
    for w in workloads:
        if w.dtype != workloads[0].dtype or not fams:
            continue
        say(f"host time per call in the model: {w.key}")
        cases = {f: set(v) for f, v in workload_cases(model, w, fams).items()}
        out[w.key] = in_model_host_deltas(model, w, accepted, fams, cases,
                                          profile_ms=(profile_ms or {}).get(w.key))
        if together:
            sets[w.key] = set_host_share(model, w, accepted, together, cases)
    return out, sets


def project_set(run_dir: Path, ranked: dict, speed: dict, host: dict, on_gpu: bool,
                only: list[str] | None = None) -> dict:
    """Amdahl and replay projection of one workload for the families in `speed` (or `only`),
    from kernel-level numbers alone: no whole-model measurement enters it."""
    from pipeline.rank_stage import amdahl, project_with

    rows = [r for r in ranked["rows"] if r["family"] in speed
            and (only is None or r["family"] in only)]
    parts = [(r["share"], speed[r["family"]]) for r in rows]
    return {
        "amdahl": amdahl(parts) if parts else 1.0,
        "replay": (project_with(run_dir, ranked["key"],
                                {r["pattern"]: speed[r["family"]] for r in rows},
                                {r["pattern"]: host.get(r["family"]) for r in rows})
                   if rows else 1.0) if on_gpu else None,
        "patterns": [r["pattern"] for r in rows],
    }


def project_kept(run_dir: Path, on_gpu: bool) -> None:
    """After integration: the projection for the set each workload shipped, computed from the
    kernel numbers frozen in projection.json before integration (kernel speedups and host
    deltas), so a rollback does not leave the report comparing the measurement with a set
    that never ran. Written into integration.json; projection.json stays as frozen."""
    proj = read_json(run_dir / "projection.json", "projection")
    integ = read_json(run_dir / "integration.json", "integration")
    ranking = {w["key"]: w for w in read_json(run_dir / "ranking.json", "ranking")["workloads"]}
    changed = False
    for key, w in (integ.get("workloads") or {}).items():
        kept = list(w.get("kept") or [])
        if key in ranking and set(kept) != set(proj["families"]):
            w["projection_for_kept"] = {"families": kept, **project_set(
                run_dir, ranking[key], proj["kernel_speedups"], host_of(proj, key),
                on_gpu, only=kept)}
            changed = True
    if changed:
        write_json(run_dir / "integration.json", integ)


def backfill(run_dir: Path, ranking: dict, families: list[str], top: int, model, workloads,
             device: str, say: Callable[[str], None], max_configs, backend: str, log: dict,
             summary: dict) -> tuple[list[str], dict, dict]:
    """`--top N` means N families that reach the model: a chosen family with no accepted
    kernel, or one that cannot win (`cannot_win`: our attention, ranked 3rd on Llama-3.2-1B b8
    by its roofline and 0.23x of cuDNN's SDPA once measured), gives its place to the next
    family in the ranking, which is generated and verified in turn (without proposals)."""
    ranked = choose_families(ranking, None)
    while True:
        useful, _ = integrable(summary["accepted"], families, device)
        more = [f for f in ranked if f not in families][:top - len(useful)]
        if not more:
            return families, log, summary
        say(f"{', '.join(sorted(set(families) - set(useful)))} will not reach the model; next "
            f"in the ranking: {', '.join(more)}")
        families = families + more
        log = generate_stage(run_dir, more, model, workloads, device, say, True, max_configs,
                             backend)
        summary = verify_stage(run_dir, log, device, say, True)


def load_run(target: str | None) -> Path:
    from pipeline.rundir import latest_run

    if target is None:
        return latest_run()
    p = Path(target)
    if p.is_dir():
        if not (p / "profile.json").exists():
            raise UserError(f"{p} has no profile.json; run `pipeline profile` first")
        return p
    raise UserError(f"{target} is not a run directory")




def cannot_win(accepted: dict, families: list[str]) -> dict[str, str]:
    """Families no workload can gain from by their own kernel-level numbers: every accepted
    case is slower on the device than the code it replaces and saves the host nothing per
    call. Integrating one would only spend measurement time on a certain rollback (the
    attention kernel at 0.19x of cuDNN's SDPA on the H200, 2026-11-30)."""
    out = {}
    for fam in families:
        accs = [a for a in accepted.values() if a["family"] == fam]
        if accs and all(a["speedup"] < 1 and (a.get("host_delta_us") or 0.0) <= 0
                        for a in accs):
            speeds = ", ".join(f"{a['speedup']:.2f}x" for a in accs)
            hosts = ", ".join(f"{-(a.get('host_delta_us') or 0.0):+.1f} us" for a in accs)
            out[fam] = (f"not integrated: slower than the code it replaces at kernel level "
                        f"({speeds}) and no host time saved per call ({hosts})")
    return out


def superseded(accepted: dict, families: list[str]) -> dict[str, str]:
    """Of two families that replace the same ops (`extras["overlaps"]`: the matmul with the
    gated activation in its epilogue, and gated_act alone), the one whose accepted kernels save
    less device time per call, summed over its cases, gives way: both patch the same MLP, and
    each one's saving is measured against the same HF code by the same harness. Under the CPU
    interpreter the times mean nothing, but the rule still keeps one of the two.
    Decided once per run, before any in-model measurement: where each family wins on another
    workload, only one is kept for all of them; gated_act's number leaves out its in-model
    gate/up GEMM fusion. (Run 6, H200: matmul_epilogue saved more at prefill b8 on both
    models; at batch 1 on Llama gated_act was not among the top 5.) Where the winner does not
    ship on a workload, the loser is tried there in its place (`integrate.fall_back`)."""
    saved = _device_saved_us(accepted)
    return {loser: (f"superseded by {winner}, which replaces the same ops: it saves "
                    f"{saved(winner):.1f} us per call against {saved(loser):.1f} us "
                    f"(kernel-level, summed over cases)")
            for loser, winner in superseded_by(accepted, families).items()}


def _device_saved_us(accepted: dict) -> Callable[[str], float]:
    def saved_us(fam: str) -> float:
        return sum((a["baseline"]["median_ms"] - a["kernel"]["median_ms"]) * 1e3
                   for a in accepted.values() if a["family"] == fam)
    return saved_us


def superseded_by(accepted: dict, families: list[str]) -> dict[str, str]:
    """{family set aside: the family it was set aside for} (`superseded`)."""
    from codegen.registry import get_family

    saved_us = _device_saved_us(accepted)
    out: dict[str, str] = {}
    for fam in families:
        for other in get_family(fam).extras.get("overlaps", ()):
            if other not in families or fam in out or other in out:
                continue
            loser, winner = sorted((fam, other), key=saved_us)
            out[loser] = winner
    return out


def _may_win(accepted: dict, families: list[str], device: str) -> tuple[list, dict]:
    """(families with an accepted kernel that may gain somewhere, {the others: why}). Only GPU
    timings say a kernel is slower; the interpreter's say nothing."""
    fams = [f for f in families if any(a["family"] == f for a in accepted.values())]
    skipped = cannot_win(accepted, fams) if device.startswith("cuda") else {}
    return [f for f in fams if f not in skipped], skipped


def integrable(accepted: dict, families: list[str], device: str) -> tuple[list, dict]:
    """(families integrated, {skipped family: why}): those that may win, less one of each two
    that replace the same ops (`superseded`)."""
    fams, skipped = _may_win(accepted, families, device)
    skipped.update(superseded(accepted, fams))
    return [f for f in fams if f not in skipped], skipped


def fallbacks(accepted: dict, families: list[str], device: str) -> dict[str, str]:
    """{family set aside: the family it was set aside for}: tried where that one does not
    ship."""
    return superseded_by(accepted, _may_win(accepted, families, device)[0])


def workload_cases(model, workload, families: list[str]) -> dict[str, list[str]]:
    """family -> the case keys `workload` calls it with in `model` (sorted)."""
    from codegen.registry import get_family
    from codegen.search import case_key

    return {f: sorted({case_key(c) for c in get_family(f).cases_from_model(model, workload)})
            for f in families}


def integrate_stage(run_dir: Path, spec, workloads, summary: dict, families: list[str],
                    say: Callable[[str], None], pairs: int, built: dict | None = None) -> dict:
    """`built`: models already built, keyed by (dtype, device), reused instead of rebuilt."""
    import torch

    from models.loader import build
    from pipeline import integrate as ig
    from pipeline.env import environment
    from verify.timing import paired_ratio

    # on a GPU, up to twice the pairs while an interval is wide (a host slowing down for a
    # stretch); CPU interpreter timings mean nothing, so more of them would only cost time
    timer = partial(paired_ratio, max_n=2 * pairs) if workloads[0].device.startswith("cuda") \
        else paired_ratio
    accepted = summary["accepted"]
    fams, skipped = integrable(accepted, families, workloads[0].device)
    spare = fallbacks(accepted, families, workloads[0].device)
    for fam, why in skipped.items():
        say(f"{fam}: {why}")
    result = {"stage": "integrate", "families": fams, "chosen": families, "environment":
              environment(workloads[0].device), "workloads": {}}
    by_dtype: dict[tuple, list] = {}
    for w in workloads:
        by_dtype.setdefault((w.dtype, w.device), []).append(w)
    for (dtype, device), ws in by_dtype.items():
        model = (built or {}).pop((dtype, device), None)
        if model is None:
            say(f"building {spec.model_id} ({dtype}) for integration")
            model = build(spec, ws[0].torch_dtype(), device)
        ref = ig.fp32_reference(model)
        say("whole-model check")
        check = ig.check_and_bisect(model, ref, accepted, fams, ws[0])
        # a family set aside is checked in the set it could ship in: the checked set without
        # the family it was set aside for; here, before any timing shows whether it will be
        # tried, because the fp32 reference is freed before the timing
        spare_checks = {f: ig.check_and_bisect(
            model, ref, accepted, [k for k in check["kept"] if k != instead] + [f], ws[0])
            for f, instead in spare.items()}
        usable = {f: instead for f, instead in spare.items() if f in spare_checks[f]["kept"]}
        del ref
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        kept = check["kept"]
        measured = {}
        for w in ws:
            say(f"measure {w.key}")
            cases = workload_cases(model, w, fams + list(usable))
            allowed = {f: set(v) for f, v in cases.items()}
            m = ig.measure(model, w, accepted, kept, allowed, pairs, timer)
            for f, instead in usable.items():
                if instead not in m["kept"]:
                    say(f"{f}: {instead} does not ship on {w.key}; trying {f} in its place")
                    ig.fall_back(model, w, accepted, m, f, instead, allowed, pairs, timer)
            measured[w.key] = (cases, allowed, m)
        # after the timing: its GPU re-profile is a profiler session, which leaves CUPTI
        # attached, and later launches of this process may cost more (profiling.capture).
        # Run 6 timed after it and measured Llama-3.2-1B b1 prefill at 1.501x; run 7 timed
        # first, 1.270x and 1.358x (other hosts, so not a controlled comparison).
        effect = ig.patch_took_effect(model, accepted, kept, ws[0]) if kept else None
        shipped = {f: instead for f, instead in usable.items()
                   if any(f in m["kept"] for _, _, m in measured.values())}
        for f, instead in shipped.items():  # proven in the set it ships in, without its rival
            effect = ig.with_effect_of(f, effect, ig.patch_took_effect(
                model, accepted, [k for k in kept if k != instead] + [f], ws[0]))
        for w in ws:
            cases, allowed, m = measured[w.key]
            if device.startswith("cuda") and m["kept"]:
                say(f"re-profile {w.key}")
                m["reprofile"] = ig.reprofile(model, accepted, m["kept"], w, allowed)
            result["workloads"][w.key] = {
                "workload": w.to_dict(), "check": check, "patch_effect": effect, "cases": cases,
                # a family tried in place of another has its measurement, not a reason
                "skipped": {f: why for f, why in skipped.items() if f not in m["per_family"]},
                **({"fallback_checks": spare_checks} if spare_checks else {}), **m}
        del model
    write_json(run_dir / "integration.json", result)
    return result


def run_optimize(run_dir: Path, top: int, say: Callable[[str], None], resume: bool = False,
                 max_configs: int | None = None, pairs: int | None = None,
                 proposer: str | None = None, backend: str = "triton",
                 only: list[str] | None = None) -> dict:
    """All stages after profile on `run_dir`; returns the paths of what was written.
    `only`: exactly these families (in the ranking's order), instead of the top `top`.
    `backend`: kernel languages to generate, "triton", "cuda" or "both"; CUDA C++ falls back
    to Triton on a CPU run and raises UserError on a GPU that cannot build it."""
    from codegen.cuda_build import resolve_backend
    from models.loader import resolve
    from pipeline.rank_stage import run_rank
    from pipeline.workload import Workload

    profile = read_json(run_dir / "profile.json", "profile")
    workloads = [Workload.from_dict(w["workload"]) for w in profile["workloads"]]
    device = workloads[0].device
    on_gpu = device.startswith("cuda")
    backend, note = resolve_backend(backend, device)  # before any stage runs
    if note:
        say(note)
    if not on_gpu:
        # Triton kernels run under its CPU interpreter; workers inherit the environment
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not (resume and (run_dir / "ranking.json").exists()):
        say("rank")
        run_rank(run_dir)
    ranking = read_json(run_dir / "ranking.json", "ranking")
    families = choose_families(ranking, None if only else top)
    if only:
        families = [f for f in families if f in only] + [f for f in only if f not in families]
    if not families:
        raise UserError("the ranking names no pattern a kernel family can replace")
    spec = resolve(profile["model"]["id"])
    from models.loader import build

    model = build(spec, workloads[0].torch_dtype(), device)
    # on the CPU the interpreter makes timings meaningless: one config per case is enough
    max_configs = max_configs or (None if on_gpu else 1)
    log = generate_stage(run_dir, families, model, workloads, device, say, resume, max_configs,
                         backend)
    if proposer:
        from codegen.proposer import run_proposer

        log = run_proposer(proposer, run_dir, log, device, say)
    summary_path = run_dir / "verification" / "summary.json"
    verified_before = read_json(summary_path, "verification summary") \
        if (resume and summary_path.exists()) else None
    summary = verify_stage(run_dir, log, device, say, resume)
    if not only:
        families, log, summary = backfill(run_dir, ranking, families, top, model, workloads,
                                          device, say, max_configs, backend, log, summary)
    # later stages are skipped on --resume only if what they read did not change in this run
    # (an edited kernel, verified again, must reach the projection and the model)
    integ_path = run_dir / "integration.json"
    unchanged = resume and verified_before == summary and integ_path.exists() \
        and read_json(integ_path, "integration").get("chosen") == families
    if not (unchanged and (run_dir / "projection.json").exists()):
        enqueue = {w["key"]: w.get("enqueue_ms") for w in ranking["workloads"]}
        in_model, in_model_set = host_stage(model, workloads, summary, families, say,
                                            enqueue) if on_gpu else (None, None)
        freeze_projection(run_dir, summary, families, on_gpu, in_model, in_model_set)
    if not unchanged:
        integrate_stage(run_dir, spec, workloads, summary, families, say,
                        pairs or (30 if on_gpu else 3),
                        built={(workloads[0].dtype, device): model})
        project_kept(run_dir, on_gpu)
    from pipeline.report import write_report

    say("report")
    return write_report(run_dir)
