"""Acceptance records: one per verified kernel family, in the DESIGN.md form (Workload,
Environment, Comparison, Correctness, Measurements, Decision), each its own file under
acceptance/; the report links them."""

from __future__ import annotations

from pathlib import Path

from core.records import Environment, ModelInfo, Timing, VerificationRecord, VerifyEnvironment
from pipeline.report_render import NOT_MEANINGFUL, case_text, ci, config_text, speed
from pipeline.report_view import AcceptedKernel, RejectedKernel, ReportView, WorkloadView

CONCURRENCY = ("concurrency: one process, one stream, one call at a time (the batch is the only "
               "parallelism)")
BASELINE = ("baseline: the model's own code for the pattern (the family reference mirrors the "
            "Hugging Face forward), same inputs, same harness")
END_TO_END = ("end to end: baseline and patched model interleaved in one process, median paired "
              "ratio with a bootstrap 95% CI; it counts only when the CI excludes 1.0")
REFERENCE = ("reference: float64 run of the baseline (float32 where float64 fails); an element "
             "passes when |c - r| <= |b - r| + atol + rtol*|r|")


def kernel_path(source: str | None, run_dir: Path | None) -> str:
    """A candidate's kernel.py relative to the run directory (artifacts store absolute paths
    of the machine that wrote them)."""
    if not source:
        return "-"
    parts = Path(source).parts
    if "candidates" in parts:
        return str(Path(*parts[parts.index("candidates"):]))
    if run_dir is not None:
        try:
            return str(Path(source).relative_to(run_dir))
        except ValueError:
            pass
    return source


ROLLBACK_RULE = ("rolled back on a workload when the 95% CI of its paired whole-model ratio "
                 "shows a slowdown, alone or in the set against the set without it, when the "
                 "combined set regresses there, or when the patched logits' error against the "
                 "fp32 model exceeds 1.5x the unpatched error")


def acceptance_fields(fam: str, data: ReportView, load, run_dir: Path | None = None
                      ) -> dict[str, list[str]]:
    """One kernel family's acceptance record in the DESIGN.md form: six labelled fields."""
    acc = [a for a in data.kernels.accepted if a.family == fam]
    rej = [r for r in data.kernels.rejected if r.family == fam]
    recs = [(a.case_key, _record(load(a.record))) for a in acc]
    tried = [(x, _record(load(x.record))) for r in rej for x in r.tried]
    renv = next((r.environment for _, r in recs + tried if r), None) or VerifyEnvironment()
    cases = [(a.case_key, a.case) for a in acc] + [(r.key.split("/", 1)[-1], r.case)
                                                         for r in rej]
    dtypes = sorted({str((c or {}).get("dtype")) for _, c in cases})
    ws = data.workloads
    return {"Workload": _workload_field(data.model, cases, ws),
            "Environment": _environment_field(data.environment, renv, dtypes),
            "Comparison": _comparison_field(acc, recs, tried, run_dir),
            "Correctness": _correctness_field(fam, recs, tried, renv, dtypes, ws),
            "Measurements": _measurements_field(fam, acc, ws),
            "Decision": _decision_field(fam, acc, rej, ws)}


def _record(r) -> VerificationRecord | None:
    return VerificationRecord.of(r) if r is not None else None


def _workload_field(m: ModelInfo, cases: list, ws: list[WorkloadView]) -> list[str]:
    return [
        (f"model {m.id} ({m.source}, {m.weights} weights, "
         f"{m.model_type}); revision {m.revision or 'not pinned'}"),
        *[f"case {case_text(c, k)}" for k, c in cases],
        "workloads: " + "; ".join(f"{w.key} (batch {w.workload.batch}, seq "
                                  f"{w.workload.seq}, {w.workload.mode})"
                                  for w in ws),
        CONCURRENCY]


def _environment_field(env: Environment, renv: VerifyEnvironment, dtypes: list[str]) -> list[str]:
    return [
        (f"accelerator: {env.gpu or renv.accelerator or 'none (CPU)'}, driver "
         f"{env.driver or 'n/a'}"),
        (f"compiler: triton {renv.triton or env.triton}, torch "
         f"{renv.torch or env.torch}, CUDA {env.cuda or 'n/a'}"),
        "precision: " + ", ".join(dtypes)]


def _comparison_field(acc: list[AcceptedKernel], recs: list, tried: list,
                      run_dir: Path | None) -> list[str]:
    return [
        BASELINE,
        *[f"candidate for {case_text(a.case, a.case_key)}: "
          f"{kernel_path(a.source, run_dir)}, {config_text(a.config)} "
          f"({a.origin or 'generated'}), sha256 {((r.source_sha256 if r else None) or '')[:12]}"
          for a, (_, r) in zip(acc, recs, strict=True)],
        *[f"candidate (rejected): {x.candidate}" for x, _ in tried],
        "kernel timing: " + ("; ".join(sorted({a.kernel.method for a in acc if a.kernel}))
                             + ", median of n repetitions, spread p20-p80" if acc else
                             "none (no candidate accepted, nothing timed)"),
        END_TO_END]


def _correctness_field(fam: str, recs: list, tried: list, renv: VerifyEnvironment,
                       dtypes: list[str],
                       ws: list[WorkloadView]) -> list[str]:
    out = [
        REFERENCE,
        "tolerances: " + "; ".join(
            f"{d} atol {t.atol:g} rtol {t.rtol:g}"
            for d, t in renv.tolerances.items() if d in dtypes) or "not recorded"]
    for name, r in recs + [(Path(str(x.candidate)).parent.name, r) for x, r in tried]:
        out += _record_lines(name, r)
    for w in ws:
        chk = w.check
        if chk and fam in (chk.families or []):
            errs = ", ".join(f"{t.error_patched:.3g} vs {t.error_unpatched:.3g}"
                             for t in chk.trials)
            out.append(f"whole model {w.key}: logits error patched vs unpatched "
                       f"(fp32 reference) {errs}: "
                       f"{'failed' if fam in chk.rejected else 'passed'}")
    return out


def _record_lines(name: str, r: VerificationRecord | None) -> list[str]:
    """A candidate's verification record in a line, with its first failures."""
    if r is None:
        return [f"{name}: verification record not found"]
    edges = [c.label for c in r.cases if c.origin != "given"]
    ok = sum(1 for c in r.checks if c.passed)
    seeds = r.seeds
    return [
        f"{r.candidate if r.candidate is not None else name}: {r.verdict}, "
        f"{ok}/{len(r.checks)} checks passed on {len(r.cases)} input sets ({len(edges)} edge "
        f"cases), seeds master {seeds and seeds.master} x {seeds and seeds.trials} trials",
        *[f"  failure: {x}" for x in (r.reasons or [])[:3]]]


def _measurements_field(fam: str, acc: list[AcceptedKernel], ws: list[WorkloadView]
                        ) -> list[str]:
    out = [_kernel_line(a) for a in acc]
    for w in ws:
        per = next((x for x in w.per_family if x.family == fam), None)
        if not per:
            continue
        out.append(
            f"end to end {w.key} ({fam} alone, {per.pairs} pairs): " +
            (f"{speed(per.speedup)} {ci(per.ci)}, {per.verdict}"
             if per.meaningful else NOT_MEANINGFUL))
        inset = per.in_set
        if inset and inset.meaningful:
            out.append(
                f"end to end {w.key} (the set with {fam} against the set without it, "
                f"{inset.pairs} pairs): {speed(inset.speedup)} "
                f"{ci(inset.ci)}, {inset.verdict}")
    return out or ["none: no candidate was accepted, nothing timed end to end"]


def _kernel_line(a: AcceptedKernel) -> str:
    kt, bt, s = a.kernel or Timing(), a.baseline or Timing(), a.search
    line = (f"{case_text(a.case, a.case_key)}: baseline {bt.median_ms or 0:.4f} ms "
            f"[{bt.p20_ms or 0:.4f}-{bt.p80_ms or 0:.4f}], kernel "
            f"{kt.median_ms or 0:.4f} ms [{kt.p20_ms or 0:.4f}-"
            f"{kt.p80_ms or 0:.4f}], n={kt.n}: ")
    line += (f"{speed(a.speedup)}" + (f", {kt.gbps:.0f} GB/s" if kt.gbps
                                         else "")) if a.meaningful else NOT_MEANINGFUL
    return line + (f"; {s.configs} configs tried, "
                   f"{s.passed_screen} passed the screen" if s else "")


def _decision_field(fam: str, acc: list[AcceptedKernel], rej: list[RejectedKernel],
                    ws: list[WorkloadView]) -> list[str]:
    decision = [f"accepted for cases: {'; '.join(case_text(a.case, a.case_key) for a in acc)}"
                if acc else
                "rejected: " + "; ".join(f"{r.key}: {r.reason}" for r in rej)]
    if rej and acc:
        decision.append("rejected cases: " + "; ".join(f"{r.key}: {r.reason}" for r in rej))
    for w in ws:
        per = next((x for x in w.per_family if x.family == fam), None)
        aside = (w.set_aside or {}).get(fam)
        if aside:
            decision.append(f"set aside on {w.key} before integration: {aside}")
        rb = [r for r in w.rollbacks if fam in r.family.split(", ")]
        if rb:
            decision.append(f"rolled back on {w.key}: " + "; ".join(r.reason for r in rb))
        elif w.kept is not None and fam in w.kept:
            instead = per.fallback_for if per else None
            decision.append(f"kept on {w.key}" + (
                f", in place of {instead}, which does not ship there" if instead else ""))
    return decision + [f"rollback conditions: {ROLLBACK_RULE}"]


def acceptance_record(fam: str, data: ReportView, load, run_dir: Path | None = None) -> str:
    """One kernel family's acceptance record in the DESIGN.md form (six labelled fields)."""
    return "\n".join(f"{(label + ':'):<14}{line}" if i == 0 else f"{'':14}{line}"
                     for label, lines in acceptance_fields(fam, data, load, run_dir).items()
                     for i, line in enumerate(lines))

