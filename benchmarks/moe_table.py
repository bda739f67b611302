"""Per-kernel table of a mixture-of-experts block: ours against every experts implementation
of the installed transformers, on the same inputs (GPU).

    python benchmarks/moe_table.py --out DIR [--model olmoe-1b-7b]
        [--workloads prefill:8x1024,decode:1x1024] [--run-dir RUN] [--dry-run]

One MoE layer's block (the router's GEMM, softmax and top-k, the experts, the weighted top-k
sum) at the model's widths (zoo config, random weights, bf16), for each workload's token count
(batch x seq at prefill, batch at a decode step). Contenders: the model's own router and
experts modules under each `experts_implementation` the installed transformers offers
(`models.moe.experts_options`; an option that cannot run here is named with its reason), and
ours: every config of the family's search space rendered, checked and timed, the best median
(or the run's accepted kernel for that case, `--run-dir`). Each is checked first against the
block in fp32 (the same modules on fp32 copies of the inputs): its relative error may be at
most 1.5x that of transformers' default option (grouped_mm) plus 1e-3; a wrong one is
reported, not timed. Writes DIR/moe.json and DIR/moe.md, with ours over the best option.
`--dry-run`: the same flow on the CPU with the zoo's tiny-olmoe in fp32, to test it; its
timings mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/, not the repo root
    sys.path.insert(1, str(ROOT))

WORKLOADS = "prefill:8x1024,decode:1x1024"
ERROR_RATIO, ERROR_FLOOR = 1.5, 1e-3
DRY_BENCH = dict(warmup_ms=1.0, rep_ms=5.0, min_reps=2)


def parse_workloads(text: str) -> list[tuple[str, int, int]]:
    out = []
    for item in text.split(","):
        mode, _, shape = item.partition(":")
        batch, _, seq = shape.partition("x")
        if mode not in ("prefill", "decode") or not batch.isdigit() or not seq.isdigit():
            raise SystemExit(f"moe_table.py: bad workload {item!r} (MODE:BATCHxSEQ, MODE "
                             f"prefill or decode)")
        out.append((mode, int(batch), int(seq)))
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def accepted_source(run_dir: Path | None, case: dict) -> Path | None:
    """The run's accepted moe_experts kernel for exactly this case, if any."""
    if run_dir is None or not (run_dir / "verification" / "summary.json").is_file():
        return None
    summary = json.loads((run_dir / "verification" / "summary.json").read_text())
    for acc in summary.get("accepted", {}).values():
        if acc.get("family") == "moe_experts" and acc.get("case") == case:
            return Path(acc["source"])
    return None


def run_workload(setup: dict, mode: str, batch: int, seq: int, dtype: str, device: str,
                 run_dir: Path | None, bench_kw: dict, tmp: Path) -> dict:
    from codegen.moe_experts import FAMILY
    from codegen.moe_experts import bench as moe_bench
    from codegen.moe_experts.reference import moe_block
    from core.source import load_forward
    from models.graphs import capture_reason
    from models.moe import experts_options
    from verify.timing import bench

    case = moe_bench.case(setup, batch, seq, dtype, mode=mode)
    inputs = FAMILY.make_inputs(case, device, torch.Generator(device).manual_seed(0))
    params = FAMILY.params(case)
    ref32 = moe_block(*(t.float() for t in inputs), **{**params, "impl": "eager"})
    cost = dict(min_bytes=FAMILY.min_bytes(case), flops=FAMILY.flops(case))
    rows, errors = {}, {}

    def timed(name, fn, out):
        err = rel_error(out, ref32)
        errors[name] = err
        limit = ERROR_RATIO * errors.get("grouped_mm", err) + ERROR_FLOOR
        if err > limit:
            rows[name] = {"wrong": f"relative error {err:.3g} > {limit:.3g}"}
            return
        t = bench(fn, device=device, **cost, **bench_kw)
        rows[name] = {"median_us": t.median_ms * 1e3, "p20_us": t.p20_ms * 1e3,
                      "p80_us": t.p80_ms * 1e3, "gbps": t.gbps, "tflops": t.tflops,
                      "rel_error": err, "meaningful": t.meaningful}

    # grouped_mm first: its error is the yardstick of the others
    options = sorted(experts_options(), key=lambda o: o != "grouped_mm")
    for impl in options:
        try:
            kw = {**params, "impl": impl}
            out = moe_block(*inputs, **kw)
            timed(f"hf:{impl}", lambda kw=kw: moe_block(*inputs, **kw), out)
            errors.setdefault(impl, errors[f"hf:{impl}"])
        except Exception as exc:  # an option this machine cannot run is named, not fatal
            # (batched_mm gathers every pair's expert weights: out of memory at a long prefill)
            rows[f"hf:{impl}"] = {"skipped": capture_reason(exc)}
            if device == "cuda":
                torch.cuda.empty_cache()
    accepted = accepted_source(run_dir, case)
    configs = [None] if accepted else FAMILY.search_space(case)
    best = None
    for i, config in enumerate(configs):
        path = accepted or tmp / f"moe_{mode}_{i}.py"
        if config is not None:
            path.write_text(FAMILY.render(config, case))
        forward = load_forward(path)
        out = torch.empty_like(inputs[0])
        try:
            forward(*inputs, out=out, **params)
        except Exception as exc:  # a config that does not compile here is named
            rows[f"ours:{i}"] = {"skipped": capture_reason(exc), "config": config}
            continue
        timed(f"ours:{i}", lambda f=forward, o=out: f(*inputs, out=o, **params), out)
        rows[f"ours:{i}"]["config"] = config or str(accepted)
        r = rows[f"ours:{i}"]
        if "median_us" in r and (best is None or r["median_us"] < rows[best]["median_us"]):
            best = f"ours:{i}"
    hf = {k: v for k, v in rows.items() if k.startswith("hf:") and "median_us" in v}
    best_hf = min(hf, key=lambda k: hf[k]["median_us"]) if hf else None
    out = {"mode": mode, "batch": batch, "seq": seq, "case": case, "rows": rows,
           "ours": best, "best_hf": best_hf, "min_bytes": cost["min_bytes"],
           "flops": cost["flops"]}
    if best and best_hf:
        out["ours_over_best_hf"] = hf[best_hf]["median_us"] / rows[best]["median_us"]
    return out


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def markdown(data: dict) -> str:
    lines = [f"# MoE experts block, {data['model']} ({data['device']}, {data['dtype']})", "",
             "| workload | contender | median us | GB/s | TFLOP/s | rel. error | note |",
             "|---|---|---:|---:|---:|---:|---|"]
    for w in data["workloads"]:
        label = f"{w['mode']} b{w['batch']} s{w['seq']}"
        for name, r in w["rows"].items():
            if name.startswith("ours:") and name != w["ours"] and "median_us" in r:
                continue  # the best config of ours only
            note = r.get("skipped") or r.get("wrong") or ""
            if name == w["best_hf"]:
                note = "best experts_implementation"
            if "median_us" not in r:
                lines.append(f"| {label} | {name} | - | - | - | - | {note} |")
                continue
            cells = [_num(r["median_us"], 1), _num(r["gbps"], 1), _num(r["tflops"], 2),
                     f"{r['rel_error']:.2e}"]
            lines.append(f"| {label} | {'ours' if name == w['ours'] else name} | "
                         f"{' | '.join(cells)} | {note} |")
        if "ours_over_best_hf" in w:
            lines.append(f"| {label} | **ours over {w['best_hf']}** | "
                         f"**{w['ours_over_best_hf']:.2f}x** | | | | |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="olmoe-1b-7b")
    ap.add_argument("--workloads", default=WORKLOADS)
    ap.add_argument("--run-dir", type=Path, help="take ours from this run's accepted kernels")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny-olmoe, fp32: the flow")
    args = ap.parse_args(argv)
    workloads = parse_workloads(args.workloads)
    if args.dry_run:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        model, device, dtype, bench_kw = "tiny-olmoe", "cpu", "float32", DRY_BENCH
    elif not torch.cuda.is_available():
        raise SystemExit("moe_table.py: no CUDA GPU here (--dry-run tests the flow on the CPU)")
    else:
        model, device, dtype, bench_kw = args.model, "cuda", "bfloat16", {}
    return _run(args, workloads, model, device, dtype, bench_kw)


def _run(args, workloads, model, device, dtype, bench_kw) -> int:
    import warnings

    from transformers import AutoConfig

    from models.zoo import ZOO

    if model not in ZOO:
        raise SystemExit(f"moe_table.py: {model!r} is not in the zoo")
    params = dict(ZOO[model])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(params.pop("model_type"), **params)
    setup = {"config": cfg}
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"model": model, "device": torch.cuda.get_device_name(0) if device == "cuda"
            else "cpu (interpreter: timings mean nothing)", "dtype": dtype,
            "torch": torch.__version__, "workloads": []}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, batch, seq in workloads:
            print(f"[{mode} b{batch} s{seq}]", flush=True)
            data["workloads"].append(run_workload(setup, mode, batch, seq, dtype, device,
                                                  args.run_dir, bench_kw, Path(tmp)))
    (args.out / "moe.json").write_text(json.dumps(data, indent=1))
    text = markdown(data)
    (args.out / "moe.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
