"""benchmarks/results/latest.json: the newest measured row per (model, workload, variant).

    python3 benchmarks/results_table.py [PATH]   # PATH (default: results/latest.json) as markdown
    python3 benchmarks/results_table.py [PATH] --h2h H2H.json --model M --commit C [--run RUN]
        # upsert the variants one head_to_head.py run timed side by side; a run on another
        # card than PATH's is refused (give it its own PATH, e.g. results/latest-h100.json)
    python3 benchmarks/results_table.py [PATH] --contender OUT.json --commit C
        # upsert the row of one contenders.py run (Liger: eager then Liger, its own process)
    python3 benchmarks/results_table.py [PATH] --e2e RUN_DIR --commit C
        # upsert the rows of one `pipeline e2e` run: workload generate-b{B}-p{P}-n{N}-bf16,
        # ms = TPOT p50, over_eager = end to end over hf-eager

From another script: `upsert(path, rows)` replaces the rows with the same (model, workload,
variant) and adds the others; the file is written atomically (temp file, then os.replace).
Stdlib only, so it runs anywhere the results are read.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

LATEST = Path(__file__).resolve().parent / "results" / "latest.json"
MACHINE = ("NVIDIA H200 (driver 580.159.04), torch 2.11.0+cu130, triton 3.6.0, "
           "transformers 5.17.0")
VARIANTS = ("eager", "ours", "ours-graphs", "graph", "compile", "compile-reduce-overhead",
            "eager-static", "liger", "hf-eager", "hf-static", "ours-compile", "ours-kernels",
            "ours-static-compile", "hf-best-experts", "ours-graphs-pdl", "ours-graphs-nopdl",
            "ours-graphs-pdl-prefetch")


def key(row: dict) -> tuple:
    return row["model"], row["workload"], row["variant"]


def load(path, machine: str | None = None) -> dict:
    """The file's rows; a file not yet written starts empty, for `machine` (default MACHINE)."""
    path = Path(path)
    if not path.exists():
        return {"schema_version": 1, "machine": machine or MACHINE, "rows": []}
    data = json.loads(path.read_text())
    if data.get("schema_version") != 1:
        raise ValueError(f"{path}: schema_version {data.get('schema_version')!r}, expected 1")
    return data


def upsert(rows_path, new_rows: list[dict], machine: str | None = None) -> dict:
    """Replace rows with the same (model, workload, variant), append the rest, write atomically.
    `machine` (the device name first): rows measured on another card than the file's are
    refused, since a file's ratios are compared row against row (H100 rows go in a file of
    their own, e.g. results/latest-h100.json)."""
    path = Path(rows_path)
    data = load(path, machine)
    device = (machine or "").split(",")[0]
    if device and not data["machine"].startswith(device):
        raise ValueError(f"{path} holds rows from {data['machine'].split(',')[0]}; rows from "
                         f"{device} go in a file of their own")
    for row in new_rows:
        if row["variant"] not in VARIANTS:
            raise ValueError(f"variant {row['variant']!r} not one of {VARIANTS}")
    fresh = {key(r) for r in new_rows}
    rows = [r for r in data["rows"] if key(r) not in fresh] + list(new_rows)
    rows.sort(key=lambda r: (r["model"], r["workload"], VARIANTS.index(r["variant"])))
    data["rows"] = rows
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return data


def markdown(data: dict) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [f"Machine: {data['machine']}", "",
             "| model | workload | variant | ms | over eager | 95 % CI | projected | commit "
             "| date |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        ci = "-" if not r.get("ci") else f"[{r['ci'][0]:.3f}, {r['ci'][1]:.3f}]"
        lines.append(f"| {r['model']} | {r['workload']} | {r['variant']} | {num(r['ms'], '.2f')} | "
                     f"{num(r['over_eager'], '.3f')}x | {ci} | {num(r.get('projected'), '.3f')} | "
                     f"{r['commit']} | {r['date']} |")
    return "\n".join(lines)


def rows_from_h2h(h2h: dict, model: str, commit: str, date: str,
                  run_dir: Path | None = None) -> list[dict]:
    """One row per variant head_to_head.py timed (one process, rotating rounds); `projected`
    on ours (the frozen replay projection) and ours-graphs (kernels + graph) from the run.

    A graphed pass holds no host time, so its projection is frozen as a pass time
    (`projected_ms`, on graph and ours-graphs); the speedup on ours-graphs is that time over
    the eager median timed in this same process. Over the profile's own eager pass instead,
    host drift between processes decides the ratio: Llama-3.2-1B b1's eager ran 12.4 ms in
    the profile and 14.6 ms here, with the graphed pass projected within 0.2 %."""
    proj, pass_ms, floor_ms = {}, {}, None
    if run_dir is not None and (Path(run_dir) / "projection.json").exists():
        p = json.loads((Path(run_dir) / "projection.json").read_text())["workloads"].get(
            h2h["workload"]) or {}
        proj = {"ours": p.get("replay"), "ours-graphs": (p.get("graphs") or {}).get("kept")}
        integ = Path(run_dir) / "integration.json"
        w = json.loads(integ.read_text())["workloads"].get(h2h["workload"]) or {} \
            if integ.exists() else {}
        # the projection of the set that shipped, where integration rolled some back
        if (w.get("projection_for_kept") or {}).get("replay"):
            proj["ours"] = w["projection_for_kept"]["replay"]
        if ((w.get("graphs") or {}).get("projected_for_kept") or {}).get("kept"):
            proj["ours-graphs"] = w["graphs"]["projected_for_kept"]["kept"]
        g = (w.get("graphs") or {}).get("projected_for_kept") \
            or (p.get("graphs") or {}) or {}
        for variant, field in (("graph", "unpatched_pass_us"), ("ours-graphs", "kept_pass_us")):
            if g.get(field):
                pass_ms[variant] = g[field] / 1e3
        floor_ms = ((w.get("graphs") or {}).get("decode_step") or {}).get("floor_ms")
        eager = h2h["median_ms"].get("eager")
        if eager and "ours-graphs" in pass_ms:
            proj["ours-graphs"] = eager / pass_ms["ours-graphs"]
    over = h2h.get("over_eager") or {}
    rows = []
    for variant, ms in h2h["median_ms"].items():
        o = over.get(variant) or {}
        rows.append({"model": model, "workload": h2h["workload"], "variant": variant,
                     "ms": round(ms, 4),
                     "over_eager": 1.0 if variant == "eager" else round(o["speedup"], 4),
                     "ci": None if variant == "eager" else [round(c, 4) for c in o["ci"]],
                     "projected": proj.get(variant),
                     **({"projected_ms": round(pass_ms[variant], 4)} if variant in pass_ms
                        else {}),
                     "kernels_per_pass":
                     (h2h.get("kernels_per_pass") or {}).get(variant), "commit": commit,
                     "date": date, "source": "head_to_head.py"})
        if floor_ms:  # a graphed decode step's weight-read floor (pipeline.decode_step)
            rows[-1]["floor_ms"] = round(floor_ms, 4)
            if variant.startswith("ours-graphs"):
                rows[-1]["multiple_of_floor"] = round(ms / floor_ms, 3)
        if variant == "hf-best-experts" and h2h.get("hf_best_experts"):
            rows[-1]["option"] = h2h["hf_best_experts"]["option"]  # which experts_implementation
    return rows


def rows_from_e2e(e2e: dict, commit: str, date: str) -> list[dict]:
    """One row per (grid point, measured variant) of a `pipeline e2e` record: `ms` the time
    per output token at p50, `over_eager` the whole call against hf-eager's (its CI from the
    per-round pairs), beside them the time to first token, TPOT p99, tokens/s, the decode
    step's weight-read floor, and on graph and ours rows the composed projection."""
    def r(x, n=4):
        return None if x is None else round(x, n)

    rows = []
    for p in e2e["points"]:
        for v in p["variants"]:
            t = v.get("times")
            if v.get("skipped") or not t:
                continue
            proj = v.get("projected") or {}
            rows.append({
                "model": e2e["model"], "workload": p["key"], "variant": v["name"],
                "ms": r(t.get("tpot_p50")), "over_eager": r(v.get("over_eager")),
                "ci": [r(c) for c in v["over_eager_ci"]] if v.get("over_eager_ci") else None,
                "projected": r(proj.get("speedup")),
                "projection_error": r(proj.get("error")), "kernels_per_pass": None,
                "floor_ms": r(p.get("floor_ms")), "ttft_ms": r(t["ttft_p50"], 3),
                "tpot_p99_ms": r(t.get("tpot_p99")), "tok_s": r(t["tok_s"], 1),
                "first_call_s": r(v.get("first_call_s"), 2),
                "same_tokens": v.get("same_tokens"), "families": v.get("families") or [],
                "commit": commit, "date": date, "source": "pipeline e2e"})
    return rows


def row_from_contender(c: dict, commit: str, date: str) -> dict:
    """The row of one contenders.py result: a ratio of medians, so no CI."""
    return {"model": c["model"], "workload": c["workload"], "variant": c["contender"],
            "ms": round(c["contender_ms"], 4), "over_eager": round(c["speedup"], 4), "ci": None,
            "projected": None, "kernels_per_pass": None, "commit": commit, "date": date,
            "source": f"contenders.py {c['contender']} ({c['method']})"}


if __name__ == "__main__":
    import argparse
    import datetime

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", default=LATEST)
    ap.add_argument("--h2h", type=Path)
    ap.add_argument("--model")
    ap.add_argument("--commit")
    ap.add_argument("--run", type=Path)
    ap.add_argument("--contender", type=Path)
    ap.add_argument("--e2e", type=Path, metavar="RUN_DIR")
    args = ap.parse_args()
    today = datetime.date.today().isoformat()
    new, machine = [], None
    if args.h2h:
        h2h = json.loads(args.h2h.read_text())
        new = rows_from_h2h(h2h, args.model, args.commit, today, args.run)
        machine = h2h.get("device") and ", ".join(
            [h2h["device"]] + ([f"torch {h2h['torch']}"] if h2h.get("torch") else []))
    elif args.e2e:
        e2e = json.loads((args.e2e / "e2e.json").read_text())
        env = json.loads((args.e2e / "profile.json").read_text())["environment"]
        new = rows_from_e2e(e2e, args.commit, today)
        machine = ", ".join(x for x in (env.get("gpu"), f"torch {env.get('torch')}",
                                        f"triton {env.get('triton')}",
                                        f"transformers {env.get('transformers')}") if x)
    elif args.contender:
        c = json.loads(args.contender.read_text())
        new = [row_from_contender(c, args.commit, today)]
        machine = f"{c['gpu']}, torch {c['torch']}"
    if new:
        try:
            upsert(args.path, new, machine)
        except ValueError as e:
            raise SystemExit(f"results_table.py: {e}") from None
    print(markdown(load(args.path)))
