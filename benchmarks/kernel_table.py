"""Per-kernel table: each memory-bound family under HF eager, torch.compile, Liger and ours.

    python benchmarks/kernel_table.py --out DIR [--models llama-3.2-1b,qwen2.5-0.5b]
        [--families rmsnorm,rope,...] [--contenders copy,eager,ours,liger,compile]
        [--run-dir RUN] [--max-configs N]

Per model (zoo config, random weights, bf16, batch 8 x seq 1024) and family, on the same
inputs. The families come from the registry: every family that declares its contenders
(`Family.benchmark`, a `bench.py` in its folder: its case at the model's shape, HF's own code,
Liger's kernel); those marked IN_TABLE = False (matmul_epilogue, compute-bound: its copy column
is no ceiling) only on request with --families. Contenders:
eager: the unmodified HF module or function; compile: torch.compile (default mode) of exactly
that callable; liger: Liger-Kernel's kernel for the op (rope: in place); ours: every config of
the family's search space rendered, screened and timed, in place where the family's adapter
runs it so (rope), best median (or the accepted kernel of `--run-dir`); copy:
dst.copy_(src) moving the family's min_bytes, plus a 1 GiB copy as the bandwidth ceiling.
Every contender is checked against the family reference first; a wrong one is reported, not
timed. Each contender runs in its own process (`--worker`): compile caches and Liger's global
state must not leak into the others. Writes DIR/kernels.json and DIR/kernels.md.
`--dry-run`: the same flow on the CPU at toy widths, to test it; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch  # project modules are imported lazily: TRITON_INTERPRET must be set before them

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/, not the repo root
    sys.path.insert(1, str(ROOT))

MODELS = "llama-3.2-1b,qwen2.5-0.5b"
CONTENDERS = ("copy", "eager", "ours", "liger", "compile")  # run order: the core first
TIMED = ("eager", "compile", "liger", "ours")  # copy is the yardstick, never "best"
BATCH, SEQ, DTYPE = 8, 1024, "bfloat16"
LARGE_COPY = 2 << 30  # bytes moved: 1 GiB read + 1 GiB written
# Dry run: each model's structure at toy widths, 2 x 2 tokens (rows 4, hidden 64); short timing.
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16)
TINY_BATCH, TINY_SEQ, TINY_COPY = 2, 2, 2 << 20
DRY_BENCH = dict(warmup_ms=1.0, rep_ms=5.0, min_reps=2)
CPU_REFUSAL = ("benchmarks/kernel_table.py: no CUDA GPU here; per-kernel timings on the CPU mean "
               "nothing (--dry-run tests the flow on the CPU)")


def table_families(default_only: bool = True) -> list[str]:
    """Families with per-kernel contenders (`Family.benchmark`), from the registry; by default
    those in the table unless asked for (`IN_TABLE`)."""
    import importlib

    from codegen.registry import families

    return [name for name, fam in families().items() if fam.benchmark and (
        not default_only or importlib.import_module(fam.benchmark).IN_TABLE)]


def bench_module(fam: str):
    import importlib

    from codegen.registry import get_family

    family = get_family(fam)
    if not family.benchmark:
        raise LookupError(f"n/a: {fam} declares no per-kernel contenders")
    return importlib.import_module(family.benchmark)


def model_setup(name: str, dry: bool, fams: list[str]) -> dict:
    """The zoo config, its HF modeling module and class prefix, and the case of each family."""
    import importlib
    import warnings

    from transformers import AutoConfig

    from models.zoo import ZOO

    params = {**ZOO[name], **(TINY if dry else {})}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(params.pop("model_type"), **params)
    module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_"
                                     f"{cfg.model_type}")
    prefix = next(n.removesuffix("PreTrainedModel") for n in vars(module)
                  if n.endswith("PreTrainedModel") and n != "PreTrainedModel")  # "Llama", "Qwen2"
    b, s = (TINY_BATCH, TINY_SEQ) if dry else (BATCH, SEQ)
    setup = {"config": cfg, "module": module, "prefix": prefix}
    setup["cases"] = {f: bench_module(f).case(setup, b, s, DTYPE) for f in fams}
    return setup


def timing_us(t) -> dict:
    return {"median_us": t.median_ms * 1e3, "p20_us": t.p20_ms * 1e3, "p80_us": t.p80_ms * 1e3,
            "n": t.n, "gbps": t.gbps, "meaningful": t.meaningful}


def measure(job, build) -> dict:
    """Check build(copies of the inputs)() against the reference, then time build(other
    copies). Copies both times: a contender that writes its inputs (Liger's rope, ours where
    the adapter rotates in place) must neither change what later calls see nor be checked on
    what an earlier call left."""
    from codegen.search import SCREEN_RTOL
    from verify.timing import bench

    got = build(tuple(t.clone() for t in job.inputs))()
    got, refs = (x if isinstance(x, tuple) else (x,) for x in (got, job.ref))
    if len(got) != len(refs) or any(g.shape != r.shape for g, r in zip(got, refs)):
        return {"status": "wrong", "error": f"shapes {[tuple(g.shape) for g in got]}"}
    err = max((g.float() - r.float()).abs().max().item() for g, r in zip(got, refs))
    tol = SCREEN_RTOL.get(job.case["dtype"], 1e-2)
    if not all(torch.allclose(g.float(), r.float(), rtol=tol, atol=tol) for g, r in zip(got, refs)):
        return {"status": "wrong", "max_abs_err": err}
    t = bench(build(tuple(t.clone() for t in job.inputs)), device=job.device,
              min_bytes=job.min_bytes, **job.bench_kw)
    return {"status": "ok", "max_abs_err": err, **timing_us(t)}


def ours(job, args, tmp: Path) -> dict:
    """The accepted kernel of --run-dir for this case, else every config rendered and timed."""
    from codegen.search import case_key, spread
    from core.family import result_region
    from core.source import load_forward

    family, case, sources, origin = job.family, job.case, [], "search"
    summary = Path(args.run_dir or "-") / "verification" / "summary.json"
    if args.run_dir and summary.exists():  # as pipeline/integrate.py finds accepted sources
        from pipeline.rundir import relocate

        acc = json.loads(summary.read_text())["accepted"].get(f"{family.name}/{case_key(case)}")
        if acc:
            sources = [(acc.get("config"), relocate(acc["source"], Path(args.run_dir)))]
            origin = f"run {args.run_dir}"
    for cfg in [] if sources else spread(family.search_space(case), args.max_configs):
        path = Path(tempfile.mkdtemp(prefix=f"{family.name}-", dir=tmp)) / "kernel.py"
        path.write_text(family.render(cfg, case))  # a folder each: every candidate is kernel.py
        sources.append((cfg, path))

    alias = family.verify.in_place

    def builder(fwd):  # out is allocated once, outside the timing, as the pipeline calls it
        def build(inp):  # written over the inputs where the family's adapter does that (rope)
            over = alias(inp) if alias else None
            out = over or family.make_out(case, inp)
            # what the caller keeps of the buffer (matmul's pad columns are not the result)
            got = over or result_region(family, case, out)
            return lambda: (fwd(*inp, out=out, **job.params), got)[1]
        return build

    results = []
    for cfg, path in sources:
        try:
            r = measure(job, builder(load_forward(path)))
        except Exception as e:  # noqa: BLE001 - a failing config is a result, not a crash
            r = {"status": f"error: {type(e).__name__}: {e}"[:200]}
        results.append({**r, "config": cfg, "source": str(path) if origin != "search" else
                        "rendered into a temporary folder"})
    timed = [r for r in results if r["status"] == "ok"]
    # none right: report a wrong one (with its error) before one that crashed
    best = min(timed, key=lambda r: r["median_us"]) if timed else next(
        (r for r in results if r["status"] == "wrong"), results[0])
    every = [{k: r.get(k) for k in ("config", "status", "median_us", "p20_us", "p80_us")}
             for r in results]  # the search's side by side, for probes of new config axes
    return {**best, "origin": origin, "configs_tried": len(results), "configs_ok": len(timed),
            "configs": every}


def run_case(args, setup, fam: str, device: str, bench_kw: dict, tmp: Path) -> dict:
    from codegen.registry import get_family
    from verify.loading import case_params
    from verify.timing import copy_reference

    family, case = get_family(fam), setup["cases"][fam]
    if args.worker == "copy":
        t = copy_reference(family.min_bytes(case), device, **bench_kw)
        return {"status": "ok", **timing_us(t)}
    contenders = bench_module(fam)
    inputs = family.make_inputs(case, device, torch.Generator(device=device).manual_seed(0))
    if hasattr(contenders, "model_inputs"):  # inputs the model itself makes (rope's cos/sin)
        inputs = contenders.model_inputs(setup, case, inputs, device)
    params = case_params(family, case)
    job = SimpleNamespace(family=family, case=case, inputs=inputs, params=params, device=device,
                          ref=family.reference(*inputs, **params), bench_kw=bench_kw,
                          min_bytes=family.min_bytes(case))
    if args.worker == "ours":
        return ours(job, args, tmp)
    fn, extra = contenders.hf(setup, inputs, device), {}
    if args.worker == "compile":
        torch._dynamo.reset()  # each case compiles afresh, static shapes, as in a model's 1st call
        fn = torch.compile(fn)
        t = time.perf_counter()
        fn(*(x.clone() for x in inputs))
        if device == "cuda":
            torch.cuda.synchronize()
        extra["compile_s"] = time.perf_counter() - t
    elif args.worker == "liger":
        fn = contenders.liger(case)
        if hasattr(contenders, "impl"):  # dispatched: say which implementation it chose
            extra["impl"] = contenders.impl(inputs[0].device)
    return {**measure(job, lambda inp: lambda: fn(*inp)), **extra}


def versions() -> dict:
    import importlib.metadata as md

    import transformers
    import triton

    try:
        liger = md.version("liger-kernel")
    except md.PackageNotFoundError:
        liger = "not installed"
    try:  # torch does not tell the driver version
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=30).stdout.strip().splitlines()[0].replace(", ", ", driver ")
    except (OSError, subprocess.SubprocessError, IndexError):
        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "transformers": transformers.__version__, "liger_kernel": liger}


def worker(args) -> int:
    if args.dry_run:  # the kernels run under Triton's interpreter; set before any @triton.jit
        os.environ["TRITON_INTERPRET"] = "1"
    if not args.dry_run and not torch.cuda.is_available():
        print(CPU_REFUSAL, file=sys.stderr)
        return 2
    from codegen.registry import get_family
    from verify.timing import copy_reference

    device, bench_kw = ("cpu", DRY_BENCH) if args.dry_run else ("cuda", {})
    result = {"contender": args.worker, "versions": versions(), "models": {}}
    if args.worker == "liger":
        try:
            import liger_kernel.ops  # noqa: F401
        except ImportError as e:
            result["error"] = f"n/a: liger-kernel not importable ({e})"[:200]
            Path(args.json).write_text(json.dumps(result))
            return 3
    if args.worker == "copy":
        n = TINY_COPY if args.dry_run else LARGE_COPY
        result["large_copy"] = {"bytes_moved": n,
                                **timing_us(copy_reference(n, device, **bench_kw))}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in args.models.split(","):
            setup = model_setup(name, args.dry_run, args.families.split(","))
            for fam in args.families.split(","):
                try:
                    r = run_case(args, setup, fam, device, bench_kw, Path(tmp))
                except LookupError as e:  # the contender has no kernel for this op
                    r = {"status": str(e).strip("'")}
                except Exception as e:  # noqa: BLE001 - one failing case must not lose the rest
                    r = {"status": f"error: {type(e).__name__}: {e}"[:200]}
                case = setup["cases"][fam]
                result["models"].setdefault(name, {})[fam] = {
                    "case": case, "min_bytes": get_family(fam).min_bytes(case), **r}
                print(f"[{args.worker}] {name} {fam}: {r['status']} "
                      f"{r.get('median_us', float('nan')):.1f} us", flush=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def run_workers(args, out: Path, merged: dict) -> None:
    """Each contender in its own process; a crash, a timeout or a missing Liger is one line."""
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if args.dry_run else {})}
    data = {}
    for c in args.contenders.split(","):
        path, log = out / f"worker-{c}.json", out / f"worker-{c}.log"
        path.unlink(missing_ok=True)
        cmd = [sys.executable, __file__, "--worker", c, "--models", args.models,
               "--families", args.families, "--json", str(path)] + ["--dry-run"] * args.dry_run
        cmd += ["--run-dir", args.run_dir] if args.run_dir else []
        cmd += ["--max-configs", str(args.max_configs)] if args.max_configs else []
        t = time.monotonic()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = None
        got = json.loads(path.read_text()) if path.exists() else {}
        lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
        why = f"timed out after {args.timeout} s" if rc is None else \
            f"rc {rc}: {lines[-1] if lines else 'no output'}"
        status = (got.get("error") or ("ok" if rc == 0 and got else f"failed: {why}"))[:300]
        merged["workers"][c] = {"status": status, "seconds": round(time.monotonic() - t, 1),
                                "log": log.name}
        print(f"{c}: {status} ({merged['workers'][c]['seconds']} s)", flush=True)
        data[c] = got if status == "ok" else {"error": status}
        write(args, out, merged, data)  # after each worker: a run cut short keeps what it has


def write(args, out: Path, merged: dict, data: dict) -> None:
    done = copy.deepcopy(merged)
    merge(args, copy.deepcopy(data), done)
    (out / "kernels.json").write_text(json.dumps(done, indent=1))
    (out / "kernels.md").write_text(markdown(done))


def merge(args, data: dict, merged: dict) -> None:
    """Per model/family/contender, with the derived columns (copy %, speedup, best)."""
    for got in data.values():
        merged["versions"] = merged["versions"] or got.get("versions")
        merged["large_copy"] = merged["large_copy"] or got.get("large_copy")
    large = (merged["large_copy"] or {}).get("gbps")
    for m in args.models.split(","):
        for fam in args.families.split(","):
            row = merged["models"].setdefault(m, {}).setdefault(fam, {"contenders": {}})
            for c, got in data.items():
                e = got.get("models", {}).get(m, {}).get(fam) or {"status": got.get("error", "?")}
                row["case"] = e.pop("case", row.get("case"))
                row["min_bytes"] = e.pop("min_bytes", row.get("min_bytes"))
                row["contenders"][c] = e
            cs = row["contenders"]
            ok = {c: e for c, e in cs.items() if e.get("status") == "ok" and c in TIMED}
            copy_us, eager_us = (cs.get(c, {}).get("median_us") for c in ("copy", "eager"))
            for e in ok.values():
                e["pct_same_byte_copy"] = 100 * copy_us / e["median_us"] if copy_us else None
                e["pct_large_copy"] = 100 * e["gbps"] / large if large and e["gbps"] else None
                e["speedup_vs_eager"] = eager_us / e["median_us"] if "eager" in ok else None
            row["best"] = min(ok, key=lambda c: ok[c]["median_us"]) if ok else None


def cell(e: dict | None, key="median_us", fmt="{:.1f}") -> str:
    """A number; else why not: 'wrong (err x)', 'n/a', 'failed', 'error'."""
    if not e or e.get("status") == "ok":
        return fmt.format(e[key]) if e and e.get(key) is not None else "-"
    if e.get("status") == "wrong" and e.get("max_abs_err") is not None:
        return f"wrong (err {e['max_abs_err']:.2g})"
    return e.get("status", "?").split(":")[0]


def markdown(merged: dict) -> str:
    v, lc = merged["versions"] or {}, merged["large_copy"] or {}
    ceiling = f"{lc['gbps'] / 1e3:.2f} TB/s" if lc.get("gbps") else "n/a"
    lines = ["# Per-kernel timings (issue 4)", "",
             f"Machine: {v.get('gpu')}; Python {v.get('python')}, torch {v.get('torch')} (CUDA "
             f"{v.get('cuda')}), triton {v.get('triton')}, transformers {v.get('transformers')}, "
             f"liger-kernel {v.get('liger_kernel')}. {merged['date']}.",
             f"Command: `{merged['command']}`.",
             f"Workload: {merged['workload']}. Large copy "
             f"({lc.get('bytes_moved', 0) / 2**30:g} GiB read + written): {ceiling}.",
             f"Timing: {merged['method']}; GB/s at the family's min_bytes; every contender checked "
             "against the family reference first (a wrong one is not timed).", ""]
    if merged["dry_run"]:
        lines += ["**DRY RUN on the CPU at toy widths: the timings mean nothing.**", ""]
    for m, fams in merged["models"].items():
        lines += [f"## {m}", "", "| family | eager us | compile us | liger us | ours us "
                  f"| ours GB/s | ours % of same-byte copy | ours % of {ceiling} ceiling "
                  "| ours vs eager | best contender |", "|---" * 10 + "|"]
        for fam, row in fams.items():
            cs, o = row["contenders"], row["contenders"].get("ours")
            lines.append("| " + " | ".join([
                fam, *(cell(cs.get(c)) for c in TIMED), cell(o, "gbps", "{:.0f}"),
                cell(o, "pct_same_byte_copy", "{:.0f} %"), cell(o, "pct_large_copy", "{:.0f} %"),
                cell(o, "speedup_vs_eager", "{:.2f}x"), row["best"] or "-"]) + " |")
        lines += ["", "Same-byte copy us: " + ", ".join(
            f"{f} {cell(r['contenders'].get('copy'))}" for f, r in fams.items()) + ".",
            "Ours: " + "; ".join(f"{f} {json.dumps(r['contenders']['ours'].get('config'))} "
                                 f"({r['contenders']['ours'].get('origin')})"
                                 for f, r in fams.items() if "ours" in r["contenders"]) + ".", ""]
    lines.append("Workers: " + "; ".join(f"{c} {w['status']} ({w['seconds']} s)"
                                         for c, w in merged["workers"].items()) + ".")
    return "\n".join(lines) + "\n"


def driver(args) -> int:
    if not args.dry_run and not torch.cuda.is_available():
        print(CPU_REFUSAL, file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    b, s = (TINY_BATCH, TINY_SEQ) if args.dry_run else (BATCH, SEQ)
    merged = {"command": shlex.join([Path(sys.executable).name, *sys.argv]),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "dry_run": args.dry_run, "workload": f"batch {b} x seq {s}, {DTYPE}",
              "method": "verify.timing.bench, CUDA events with the L2 flushed and a host head "
                        "start per repetition, median and p20/p80", "versions": None,
              "large_copy": None, "workers": {}, "models": {}}
    run_workers(args, out, merged)
    print(f"wrote {out / 'kernels.json'} and {out / 'kernels.md'}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="driver: folder for kernels.json, kernels.md and worker logs")
    p.add_argument("--models", default=MODELS)
    p.add_argument("--families", default=None, help="default: every family in the table "
                   f"({', '.join(table_families())})")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--worker", choices=CONTENDERS, help="internal: run one contender")
    p.add_argument("--json", help="internal: the worker's output file")
    p.add_argument("--run-dir", help="take ours from this pipeline run's accepted kernels")
    p.add_argument("--max-configs", type=int, help="ours: at most N configs per case (spread)")
    p.add_argument("--timeout", type=int, default=300, help="seconds per worker process")
    p.add_argument("--dry-run", action="store_true", help="CPU, toy widths: tests the flow")
    args = p.parse_args(argv)
    args.families = args.families or ",".join(table_families())
    if args.worker:
        return worker(args)
    unknown = set(args.contenders.split(",")) - set(CONTENDERS)
    if not args.out or unknown:
        p.error(f"--out is required; contenders are {', '.join(CONTENDERS)}")
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
