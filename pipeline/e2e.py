"""`pipeline e2e`: generation end to end, the number a user judges a tool by.

Per grid point (batch x prompt length x new tokens) every variant (`pipeline.e2e_variants`)
is built once in this process over the same weights, called once untimed (compiling,
capturing, Triton's first launches: its one-off cost, reported apart), then timed in `rounds`
rounds whose order rotates, each call synchronised. From each timed call: the time to the
first token, the time between tokens (TPOT), the whole call and tokens per second; p50 and p99
over calls and steps. Beside them: the decode step's weight-read floor (the weights' bytes
over `calibrate`'s copy bandwidth; the input embedding, of which a step reads `batch` rows,
is left out unless tied to the LM head), the tokens each variant made against hf-eager's,
which kernel families served the generation, and the run's frozen projections composed over
it (`pipeline.e2e_projection`).

e2e.json is written after every grid point, so an interrupted run keeps what it measured;
`--resume` measures only the points not in it.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from core.artifacts import load, write_json
from core.errors import UserError
from core.records import E2E, GenerationPoint, GenerationVariant, Integration, Profile, TokenTimes
from core.workload import SHORT, parse_int_list
from pipeline.decode_step import weight_bytes
from pipeline.e2e_variants import (
    GRAPHED,
    NEEDS_RUN,
    UNPATCHED_LOOP,
    VARIANTS,
    Clock,
    Ledger,
    hf_variant,
)

E2E_FILE = "e2e.json"
ROUNDS = {"cuda": 3, "cpu": 1}


def point_key(batch: int, prompt: int, new: int, dtype: str) -> str:
    return f"generate-b{batch}-p{prompt}-n{new}-{SHORT.get(dtype, dtype)}"


def parse_variants(text: str | None) -> list[str]:
    names = [v.strip() for v in (text or ",".join(VARIANTS)).split(",") if v.strip()]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown or not names:
        raise UserError(f"unknown variant(s) {', '.join(unknown) or text!r}; known: "
                        f"{', '.join(VARIANTS)}")
    return ["hf-eager"] + [v for v in dict.fromkeys(names) if v != "hf-eager"]


def grid(batch: str, prompt: str, new: str) -> list[tuple[int, int, int]]:
    """Every combination of `--batch`, `--prompt` and `--new`."""
    return [(b, p, n) for b in parse_int_list(batch, "batch")
            for p in parse_int_list(prompt, "prompt") for n in parse_int_list(new, "new")]


DEFAULT_GRID = ("1,8", "128,1024", "128")


def run_grid(run_dir: Path) -> list[tuple[int, int, int]]:
    """The generations the run was profiled for (`pipeline profile --generation`)."""
    profile = load(run_dir / "profile.json", Profile, "profile")
    return [tuple(g) for g in profile.generations or []]


def run_workloads(run_dir: Path, batch: int, prompt: int, new: int) -> tuple[str | None,
                                                                            str | None, str]:
    """(prefill workload, decode workload, a note) of the run whose kernels serve this point:
    the prefill of this batch and prompt length; the decode of this batch at KV length
    prompt + new (`pipeline profile --generation`), else the nearest one of the batch."""
    path = run_dir / "integration.json"
    if not path.exists():
        return None, None, "the run has no integration.json (run `pipeline optimize` first)"
    measured = load(path, Integration, "integration").workloads
    specs = {k: w.workload for k, w in measured.items() if w.workload is not None}
    pre = next((k for k, s in specs.items() if s.mode == "prefill"
                and s.batch == batch and s.seq == prompt), None)
    decode = sorted((abs(s.seq - (prompt + new)), k) for k, s in specs.items()
                    if s.mode == "decode" and s.batch == batch)
    if not decode:
        return pre, None, (f"the run has no decode workload of batch {batch}: profile it with "
                           f"`pipeline profile MODEL --generation {batch}x{prompt}+{new}`")
    key = decode[0][1]
    note = "" if decode[0][0] == 0 else (
        f"decode kernels from {key}, not KV {prompt + new}: cases of another length run the "
        "original code (see which families served the generation)")
    return pre, key, note


def times_of(calls: list[tuple[float, list[float], float]], batch: int, new: int) -> TokenTimes:
    """TokenTimes from timed calls, each (ms to the first token, [ms between tokens], call ms)."""
    import numpy as np

    ttft = [c[0] for c in calls]
    gaps = [g for c in calls for g in c[1]]
    e2e = statistics.median(c[2] for c in calls)
    return TokenTimes(
        ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
        tpot_p50=float(np.percentile(gaps, 50)) if gaps else None,
        tpot_p99=float(np.percentile(gaps, 99)) if gaps else None,
        e2e_p50=e2e, tok_s=batch * new / (e2e / 1e3), samples=len(calls),
        calls_ms=[c[2] for c in calls])


def _synchronise(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(call: Callable, ids: torch.Tensor, clock: Clock, device: str
            ) -> tuple[tuple[float, list[float], float], torch.Tensor]:
    """One synchronised call: ((ms to the first token, [ms between tokens], call ms), tokens)."""
    _synchronise(device)
    t = time.perf_counter()
    with torch.no_grad():
        out = call(ids, clock)
    _synchronise(device)
    wall = (time.perf_counter() - t) * 1e3
    first, gaps = clock.read()
    return (first, gaps, wall), out


def run_e2e(run_dir: Path, points: list[tuple[int, int, int]], variants: list[str],
            rounds: int | None, say: Callable[[str], None], resume: bool = False) -> E2E:
    """Measure every grid point; writes run_dir/e2e.json after each one and returns it."""
    from profiling.loader import build, resolve

    profile = load(run_dir / "profile.json", Profile, "profile")
    spec_w = profile.workloads[0].workload
    device, dtype = spec_w.device, spec_w.dtype
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"{run_dir} was profiled on {device}, and no CUDA GPU is visible here")
    rounds = rounds or ROUNDS["cuda" if device.startswith("cuda") else "cpu"]
    path = run_dir / E2E_FILE
    done: dict[str, GenerationPoint] = {}
    if resume and path.exists():
        done = {p.key: p for p in load(path, E2E, "e2e").points}
    spec = resolve(profile.model.id)
    say(f"building {spec.model_id} ({dtype}, {device})")
    model = build(spec, getattr(torch, dtype), device)
    bandwidth = profile.ceilings.bandwidth_GBps if profile.ceilings else None
    notes = ["greedy, EOS ignored: every variant makes exactly the tokens asked for"]
    if not device.startswith("cuda"):
        notes.append("CPU run: Triton's interpreter runs the kernels and transformers does not "
                     "compile, so these timings say nothing of a GPU's")
    out = E2E(model=spec.model_id, device=device, dtype=dtype, rounds=rounds, notes=notes,
              points=[])
    results: list[GenerationPoint] = []
    for batch, prompt, new in points:
        key = point_key(batch, prompt, new, dtype)
        if key in done and not done[key].skipped:
            say(f"[{key}] kept from the last run (--resume)")
            results.append(done[key])
            continue
        say(f"[{key}]")

        def save(point: GenerationPoint, before=tuple(results)) -> None:
            write_json(path, out.model_copy(update={"points": [*before, point]}).model_dump())

        results.append(_point(run_dir, model, batch, prompt, new, dtype, device, variants,
                              rounds, bandwidth, say, save))
    out = out.model_copy(update={"points": results})
    write_json(path, out.model_dump())
    return out


def _point(run_dir: Path, model, batch: int, prompt: int, new: int, dtype: str, device: str,
           variants: list[str], rounds: int, bandwidth: float | None,
           say: Callable[[str], None],
           save: Callable[[GenerationPoint], None] = lambda p: None) -> GenerationPoint:
    """One grid point, measured; `save` gets its record before the variants' graphs and twins
    are freed (an 8B model's take seconds), so a step limit there loses nothing."""
    key = point_key(batch, prompt, new, dtype)
    limit = getattr(model.config, "max_position_embeddings", None)
    wbytes = weight_bytes(model, batch)
    base = GenerationPoint(key=key, batch=batch, prompt=prompt, new=new, weight_bytes=wbytes,
                           floor_ms=wbytes / (bandwidth * 1e9) * 1e3 if bandwidth else None)
    if limit is not None and prompt + new > limit:
        return base.model_copy(update={"skipped": f"prompt + new = {prompt + new} is past the "
                                       f"model's {limit} positions"})
    pre, dec, note = run_workloads(run_dir, batch, prompt, new)
    base = base.model_copy(update={"prefill_workload": pre, "decode_workload": dec})
    gen = torch.Generator(device="cpu").manual_seed(batch * 7919 + prompt)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    built, skipped = _build_variants(variants, model, run_dir, device, pre, dec, new, note,
                                     say)
    clock = Clock(device)
    first: dict[str, float] = {}
    tokens: dict[str, torch.Tensor] = {}
    calls: dict[str, list] = {n: [] for n in built}
    ledgers = {n: Ledger(v.handle) for n, v in built.items() if v.handle is not None}

    def once(name: str):
        ledger = ledgers.get(name)
        if ledger is not None:
            ledger.begin(clock)
        else:
            clock.on_first = None
        sample, tok = measure(built[name].call, ids, clock, device)
        if ledger is not None:
            ledger.end()
        return sample, tok

    try:
        for name in built:
            say(f"  {name}: first call (compiling, capturing, loading kernels: untimed)")
            t = time.perf_counter()
            once(name)
            first[name] = time.perf_counter() - t
        names = list(built)
        for r in range(rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            say(f"  round {r + 1}/{rounds}: {', '.join(order)}")
            for name in order:
                calls[name].append((sample := once(name))[0])
                tokens[name] = sample[1]
        times = {n: times_of(calls[n], batch, new) for n in built}
        eager = times.get("hf-eager")
        out = []
        for name in variants:
            if name in skipped:
                out.append(GenerationVariant(name=name, skipped=skipped[name]))
                continue
            v, t = built[name], times[name]
            ledger = ledgers.get(name)
            rec = GenerationVariant(
                name=name, times=t, setup_s=v.setup_s, first_call_s=first[name],
                note="; ".join(v.notes) or None,
                floor_multiple=t.tpot_p50 / base.floor_ms
                if base.floor_ms and t.tpot_p50 else None,
                families=list(getattr(v.handle, "families", []) or []),
                **_ledger_fields(ledger),
                **_against(t, eager), **_same_tokens(tokens[name], tokens["hf-eager"], prompt))
            if name in ("graph", "ours", "ours-graphs") and eager is not None and \
                    device.startswith("cuda"):
                rec = _with_projection(rec, run_dir, eager, new, pre, dec, ledger,
                                       times.get(UNPATCHED_LOOP))
            out.append(rec)
            say(f"  {name}: TTFT {t.ttft_p50:.2f} ms, TPOT {t.tpot_p50 or 0:.3f} ms, "
                f"{t.tok_s:.1f} tok/s" + (f", {rec.over_eager:.2f}x over hf-eager"
                                          if rec.over_eager else ""))
        point = base.model_copy(update={"variants": out})
        save(point)
        return point
    finally:
        for v in built.values():
            v.close()
        built.clear()
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def _build_variants(variants: list[str], model, run_dir: Path, device: str, pre: str | None,
                    dec: str | None, new: int, note: str, say: Callable[[str], None]
                    ) -> tuple[dict, dict[str, str]]:
    """(each variant built, {variant skipped: why})."""
    built, skipped = {}, {}
    for name in variants:
        why = _why_not(name, device, dec, note)
        if why:
            skipped[name] = why
            say(f"  {name}: skipped ({why})")
            continue
        say(f"  {name}: setting up")
        try:
            built[name] = _build(name, model, run_dir, pre, dec, new)
        except (UserError, RuntimeError) as e:
            skipped[name] = str(e).splitlines()[0][:300]
            say(f"  {name}: skipped ({skipped[name]})")
    return built, skipped


def _ledger_fields(ledger) -> dict:
    """A variant's kernel calls, declined cases and served families per phase, where its
    kernels were counted."""
    if ledger is None:
        return {"kernel_calls": {}, "declined": {}, "served": {}}
    return {"kernel_calls": ledger.calls, "declined": ledger.declined,
            "served": {ph: sorted(ledger.served(ph)) for ph in ("prefill", "steps")}}


def _with_projection(rec: GenerationVariant, run_dir: Path, eager, new: int, pre: str | None,
                     dec: str | None, ledger, loop_base=None) -> GenerationVariant:
    """`rec` with the run's frozen projections composed over the generation beside it, and
    their error against what it measured."""
    from pipeline.e2e_projection import compose

    try:
        p = compose(run_dir, rec.name, eager, new, pre, dec,
                    ledger.served("prefill") if ledger else set(),
                    ledger.served("steps") if ledger else set(), loop_base)
    except (KeyError, ValueError, UserError) as e:  # the measurement stands
        p = None
        rec = rec.model_copy(update={"note": f"no projection: {e}"[:300]})
    if p is not None:
        p = p.model_copy(update={"error": abs(p.speedup - rec.over_eager)
                                 / rec.over_eager if rec.over_eager else None})
    return rec.model_copy(update={"projected": p})


def _why_not(name: str, device: str, decode_key: str | None, note: str) -> str | None:
    if name in GRAPHED and not device.startswith("cuda"):
        return "CUDA graphs need a CUDA device"
    if name in NEEDS_RUN and decode_key is None:
        return note
    return None


def _build(name: str, model, run_dir: Path, pre: str | None, dec: str | None, new: int):
    from pipeline.api import KernelHandle, apply_kernels
    from pipeline.e2e_variants import Variant, handle_variant
    from pipeline.patching import twin

    if name in ("hf-eager", "hf-static"):
        return hf_variant(name, model, new)
    t = time.perf_counter()
    copy = twin(model)
    if name == "graph":
        return handle_variant(name, KernelHandle([], model=copy, graphed=True), new,
                              time.perf_counter() - t)
    keys = [k for k in (pre, dec) if k is not None]
    handle = apply_kernels(copy, run_dir, workload=keys, graphs=name == "ours-graphs",
                           compiled=name == "ours-static-compile")
    if name == "ours-graphs":
        return handle_variant(name, handle, new, time.perf_counter() - t)
    v = hf_variant(name, copy, new)
    left_out = [f"{f} left out (torch.compile cannot trace it)" for f in handle.left_out]
    return Variant(name, v.call, handle=handle, setup_s=time.perf_counter() - t,
                   notes=v.notes + left_out + handle.notes)


def _against(t: TokenTimes, eager: TokenTimes | None) -> dict:
    from verify.stats import bootstrap_ci

    if eager is None:
        return {}
    ratios = [a / b for a, b in zip(eager.calls_ms, t.calls_ms)]
    return {"over_eager": eager.e2e_p50 / t.e2e_p50,
            "over_eager_ci": list(bootstrap_ci(ratios)[1:]) if len(ratios) > 1 else None,
            "ttft_over_eager": eager.ttft_p50 / t.ttft_p50,
            "tpot_over_eager": eager.tpot_p50 / t.tpot_p50
            if eager.tpot_p50 and t.tpot_p50 else None}


def _same_tokens(tokens: torch.Tensor, eager: torch.Tensor, prompt: int) -> dict:
    """Share of new tokens equal to hf-eager's, and the first index where any row differs.
    Random weights make near-ties between logits, so a kernel's rounding may pick another
    token: information, not a verdict."""
    a, b = tokens[:, prompt:].cpu(), eager[:, prompt:].cpu()
    n = min(a.shape[1], b.shape[1])
    same = (a[:, :n] == b[:, :n])
    differ = (~same).any(0).nonzero().flatten()
    return {"same_tokens": float(same.float().mean()) if n else None,
            "first_divergence": int(differ[0]) if differ.numel() else None}
