"""`pipeline` command line: a thin click layer over the stage functions."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

from codegen.strategies import STRATEGIES
from core.errors import UserError
from pipeline.progress import progress
from pipeline.rundir import existing_dir, latest_run, new_run_dir

# the run directory `optimize` works on, named in the line a Ctrl-C prints
_RUN: dict[str, Path | None] = {"dir": None}

WORKLOAD_OPTIONS = [
    click.option("--batch", default="1", show_default=True,
                 help="Batch sizes, comma-separated; every batch x seq pair is a workload."),
    click.option("--seq", default="128", show_default=True,
                 help="Sequence lengths (prefill) or KV-cache lengths (decode), comma-separated."),
    click.option("--dtype", default=None, help="fp32, fp16 or bf16 [default: bf16 on cuda, "
                                               "fp32 on cpu]."),
    click.option("--device", default=None, help="cpu or cuda [default: cuda if available]."),
    click.option("--mode", default=None,
                 help="prefill, decode (one token against a KV cache of --seq), or both "
                      "(prefill,decode) [default: prefill; with profile --generation, both]."),
]


def workload_options(f):
    for opt in reversed(WORKLOAD_OPTIONS):
        f = opt(f)
    return f


def _defaults(dtype: str | None, device: str | None) -> tuple[str, str]:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return dtype or ("bf16" if device.startswith("cuda") else "fp32"), device


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks.")
@click.pass_context
def cli(ctx, debug):
    """Profile a Hugging Face model, rank its operators by whole-model gain, generate and
    verify replacement kernels, patch them in, and report projected vs measured speedup.

    \b
    Quick start (CPU, built-in tiny model):
      pipeline profile tiny-llama --batch 2 --seq 64
      pipeline optimize --top 3
    On a GPU:
      pipeline profile llama-3.2-1b --batch 8 --seq 1024 --dtype bf16
    """
    ctx.obj = {"debug": debug}


@cli.command()
@click.argument("model_id")
@workload_options
@click.option("--pretrained", is_flag=True, help="Load real weights from the hub "
              "(default: random weights; timing does not depend on weight values).")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Where artifacts go [default: ./runs/<model>-<UTC time>].")
@click.option("--top", default=10, show_default=True, help="Rows shown in the summary.")
@click.option("--generation", default=None, metavar="BxP+N,...",
              help="Profile what a generation of batch B, a prompt of P tokens and N new ones "
                   "runs, instead of the --batch x --seq x --mode grid: its prefill (b B, s P) "
                   "and its decode step at the KV length it ends at (b B, s P+N), whose static "
                   "cache is the one `pipeline e2e` and `handle.generate` step over. "
                   "E.g. 1x1024+128,8x128+128.")
def profile(model_id, batch, seq, dtype, device, mode, pretrained, run_dir, top, generation):
    """Profile one forward pass of MODEL_ID per workload, then rank.

    MODEL_ID is a hub id (e.g. meta-llama/Llama-3.2-1B), a local folder with config.json,
    or a built-in name: gpt2, smollm2-135m, qwen2.5-0.5b, llama-3.2-1b, llama-3.1-8b,
    mistral-7b, gemma-2b, phi-3-mini, and for the CPU tiny-llama, tiny-qwen2, tiny-mistral,
    tiny-gemma, tiny-phi3, tiny-gpt2, tiny-qwen3, tiny-olmo2, tiny-gemma2, tiny-gemma3,
    tiny-granite, tiny-smollm3, tiny-starcoder2, tiny-gpt-neox, tiny-phi2, tiny-cohere,
    tiny-stablelm, and the mixtures of experts tiny-mixtral, tiny-qwen3-moe, tiny-olmoe.

    \b
    Example:
      pipeline profile llama-3.2-1b --batch 1,8 --seq 128,1024 --dtype bf16
    """
    from core import workload as wl
    from pipeline.stages.profile import check_device, cpu_size_note, run_profile
    from pipeline.summary import console, print_profile
    from profiling.loader import resolve

    dtype, device = _defaults(dtype, device)
    workloads = (wl.for_generation(generation, dtype, device, _modes(mode or "both"))
                 if generation else wl.expand(batch, seq, dtype, device, _modes(mode)))
    check_device(device)
    spec = resolve(model_id, pretrained)
    for note in spec.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    large = cpu_size_note(spec, workloads)
    if large:
        console.print(f"[yellow]warning:[/yellow] {large}")
    run_dir = run_dir or new_run_dir(spec.name)
    with progress(console, "profiling") as say:
        prof = run_profile(spec, workloads, run_dir, say,
                           wl.parse_generations(generation) if generation else None)
    print_profile(prof, top)
    _rank_and_print(run_dir)
    console.print(f"artifacts: {run_dir}")


def _modes(mode: str | None) -> str:
    """`--mode both` is prefill and decode; none given is prefill."""
    mode = mode or "prefill"
    return ",".join("prefill,decode" if m.strip() == "both" else m for m in mode.split(","))


def _rank_and_print(run_dir: Path) -> None:
    from pipeline.stages.rank import print_ranking, run_rank

    print_ranking(run_rank(run_dir))


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
def rank(run_dir):
    """Rank patterns of a profiled run by whole-model gain (writes ranking.json, report).

    RUN_DIR defaults to the latest run under ./runs.
    """
    _rank_and_print(existing_dir(run_dir) if run_dir else latest_run())


@cli.command()
@click.argument("target", required=False)
@click.option("--top", default=5, show_default=True,
              help="How many kernel families to bring into the model, from the top of the "
                   "ranking; one with no verified kernel, slower than the code it replaces "
                   "and saving no host time, or superseded by another that replaces the same "
                   "ops and saves more (matmul_epilogue and gated_act), gives its place to "
                   "the next; a superseded one is still tried on a workload where the other "
                   "does not ship.")
@workload_options
@click.option("--backend", type=click.Choice(["triton", "cuda", "both"]), default="triton",
              show_default=True, help="Kernel source language(s) to generate: Triton, CUDA "
              "C++ (compiled with nvcc; families without a CUDA variant use Triton), or both.")
@click.option("--families", default=None, metavar="A,B",
              help="Generate exactly these kernel families (e.g. rmsnorm,rope) instead of "
                   "the top N of the ranking.")
@click.option("--proposer", default=None, metavar="CMD",
              help="External program that proposes candidate sources (see README), or "
                   "`llm` for the built-in proposer: a model behind an OpenAI-compatible "
                   "endpoint (OPENAI_BASE_URL, OPENAI_API_KEY), e.g. "
                   "`--proposer llm --llm-model qwen2.5-coder --llm-rounds 3`.")
@click.option("--llm-model", default=None, metavar="NAME",
              help="Model for --proposer llm [default: $PIPELINE_LLM_MODEL].")
@click.option("--llm-rounds", type=int, default=3, show_default=True,
              help="Feedback rounds per (family, case) for --proposer llm.")
@click.option("--llm-max-tokens", type=int, default=8192, show_default=True,
              help="Tokens per reply for --proposer llm.")
@click.option("--llm-timeout", type=float, default=300.0, show_default=True,
              help="Seconds per request for --proposer llm.")
@click.option("--llm-wall", type=float, default=3600.0, show_default=True,
              help="Seconds --proposer llm may spend in all; no round starts after that.")
@click.option("--resume", is_flag=True, help="Skip stages and candidates already written.")
@click.option("--redo", default=None, metavar="FAMILIES",
              help="With --resume: search and verify these families (comma-separated) again, "
                   "keeping the others' work; their candidate files stay.")
@click.option("--max-configs", type=int, default=None,
              help="Trials per case (configs timed): the budget of every strategy [default on "
                   "a GPU: the whole space for grid, 10 for random and tpe; 1 on the CPU].")
@click.option("--search", "search", type=click.Choice(STRATEGIES), default="auto",
              show_default=True, help="How each case's configs are chosen: grid (the space "
              "in order, or --max-configs of it evenly spaced), random, or tpe (Optuna's "
              "model-based TPE); auto: grid where the space fits the budget, tpe where it is "
              "larger, and on the CPU, where timings mean nothing, the grid.")
@click.option("--search-seconds", type=float, default=None, metavar="S",
              help="Time budget per case: no trial starts after S seconds.")
@click.option("--search-seed", type=int, default=0, show_default=True,
              help="Seed of random and tpe (the same seed, the same picks for the same "
                   "times).")
@click.option("--fresh-search", is_flag=True,
              help="Ignore the configs earlier searches found best for the same case, GPU "
                   "and torch/Triton versions (kept in the user cache, beside calibrate's); "
                   "by default a search starts from them, re-times them and tries a few "
                   "more.")
@click.option("--proposer-share", type=click.FloatRange(0, 1), default=0.3,
              show_default=True, help="With --proposer: the share of a random or tpe "
                   "search's trials the proposer takes, seeing the search's state (0: it "
                   "runs beside the search, once per case, as it does for grid searches).")
@click.option("--pairs", type=int, default=None,
              help="Interleaved baseline/patched pairs per timing [default: 30 GPU, 3 CPU]; "
                   "on a GPU up to twice as many while a 95% CI is wider than 5% of its "
                   "estimate.")
@click.option("--workers", type=click.Choice(["local", "ray"]), default="local",
              show_default=True, help="Where candidates are screened and verified: this "
              "machine, one at a time, or Ray tasks, one GPU each, side by side "
              "(pip install 'kernel-pipeline[ray]'). Whole-model timings stay on this "
              "machine's GPU.")
@click.option("--ray-address", default=None, metavar="ADDR",
              help="Ray cluster for --workers ray [default: $RAY_ADDRESS, else a local Ray "
                   "started for the run].")
@click.option("--run-dir", type=click.Path(path_type=Path), default=None,
              help="Run directory for a new profile (when TARGET is a model id).")
@click.option("--e2e", "then_e2e", is_flag=True,
              help="Then `pipeline e2e` on the run: generation end to end, on the "
                   "generations it was profiled for (--generation), else the default grid.")
@click.option("--no-pdl", is_flag=True,
              help="Never try programmatic dependent launch in the graphs stage (as "
                   "PIPELINE_NO_PDL=1 does); by default it is kept where it measures faster.")
def optimize(target, top, batch, seq, dtype, device, mode, backend, families, proposer,
             llm_model, llm_rounds, llm_max_tokens, llm_timeout, llm_wall, resume, redo,
             max_configs, search, search_seconds, search_seed, fresh_search, proposer_share,
             pairs, workers, ray_address, run_dir, then_e2e, no_pdl):
    """Rank, generate, verify, integrate and report on a run; profiles first when TARGET is
    a model id. TARGET defaults to the latest run under ./runs.

    \b
    Examples:
      pipeline optimize --top 5                     # on the latest profiled run
      pipeline optimize runs/llama-3.2-1b-... --resume
      pipeline optimize runs/llama-3.2-1b-... --resume --redo decode_attention
      pipeline optimize tiny-llama --top 3 --batch 2 --seq 32   # profile, then optimize
      OPENAI_BASE_URL=http://127.0.0.1:8000/v1 pipeline optimize --proposer llm \\
          --llm-model Qwen/Qwen2.5-Coder-32B-Instruct --llm-rounds 2
    """
    from codegen.cuda_build import resolve_backend
    from codegen.strategies import SearchPlan
    from pipeline.optimize import run_optimize
    from pipeline.rundir import load_run
    from pipeline.summary import console

    if top < 1:
        raise UserError("--top must be at least 1")
    if no_pdl:
        from codegen.pdl import NO_PDL_ENV

        os.environ[NO_PDL_ENV] = "1"  # the graphs stage reads it (codegen.pdl.unavailable)
    if max_configs is not None and max_configs < 1 or \
            search_seconds is not None and search_seconds <= 0:
        raise UserError("--max-configs and --search-seconds must be positive")
    only = _family_list(families)
    again = _family_list(redo)
    if again and not resume:
        raise UserError("--redo needs --resume: it searches families of an existing run again")
    if workers == "ray":
        from verify.workers import import_ray

        import_ray()  # not installed: one line now, not after the profile
    llm = None
    if proposer is not None and proposer.strip() == "llm":
        from codegen.llm_proposer import LLMOptions

        # checked before any stage runs: no model named is one line, not a failure later
        llm = LLMOptions(llm_model, llm_rounds, llm_max_tokens, llm_timeout,
                         llm_wall).resolved()
    if target is not None and not Path(target).is_dir():
        from profiling.loader import looks_like_path

        if looks_like_path(target):
            existing_dir(target)  # a mistyped run directory is not an unknown model
        # a GPU that cannot build CUDA C++ fails before the profile, not after it
        resolve_backend(backend, _defaults(dtype, device)[1])
        _profile_first(target, batch, seq, dtype, device, mode, run_dir)
        from pipeline.rundir import latest_run

        target = str(run_dir or latest_run())
    run = load_run(target)
    if again:
        from pipeline.redo import forget

        for fam, cases in forget(run, again).items():
            console.print(f"redo {fam}: {cases} case(s) to search again")
    if resume:
        (top, only, backend, max_configs, pairs, proposer, workers, ray_address, search,
         search_seconds, search_seed, fresh_search, proposer_share) = _resumed(
            run, top=top, families=only, backend=backend, max_configs=max_configs,
            pairs=pairs, proposer=proposer, workers=workers, ray_address=ray_address,
            search=search, search_seconds=search_seconds, search_seed=search_seed,
            fresh_search=fresh_search, proposer_share=proposer_share)
        if workers == "ray":
            from verify.workers import import_ray

            import_ray()
    if llm is not None:
        from codegen.llm_proposer import save_options

        save_options(run, llm)
    if backend != "triton":
        from core.artifacts import load
        from core.records import Profile

        # the run's device decides (a CPU run falls back to Triton; a GPU that cannot build
        # CUDA C++ fails here, before any stage); run_optimize repeats this for API callers
        device = load(run / "profile.json", Profile, "profile").workloads[0].workload.device
        backend, note = resolve_backend(backend, device)
        if note:
            console.print(f"[yellow]note:[/yellow] {note}")
    _RUN["dir"] = run
    with progress(console, "optimize") as say:
        out = run_optimize(run, top, say, resume=resume, max_configs=max_configs, pairs=pairs,
                           proposer=proposer, backend=backend, only=only, workers=workers,
                           ray_address=ray_address,
                           plan=SearchPlan(search, None, search_seconds, search_seed,
                                           fresh_search, proposer_share))
    from pipeline.summary import print_optimize

    print_optimize(run)
    console.print(f"report: {out['markdown']}")
    if then_e2e:
        _e2e(run, None, None, None, None, None, resume)


def _resumed(run: Path, **given) -> tuple:
    """The options `run` was optimized with, unless named on this command line; said once."""
    from click.core import ParameterSource

    from pipeline.rundir import OPTION_FLAGS, resume_options
    from pipeline.summary import console

    ctx = click.get_current_context()
    explicit = {k for k in OPTION_FLAGS if ctx.get_parameter_source(k) not in (
        ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP, None)}
    merged, line = resume_options(run, given, explicit)
    if line:
        console.print(line, soft_wrap=True)
    return tuple(merged[k] for k in OPTION_FLAGS)


def _profile_first(model_id, batch, seq, dtype, device, mode, run_dir) -> None:
    """`pipeline profile` for `optimize MODEL_ID`. On a GPU in a child process: a profiler
    session leaves CUPTI attached to its process (profiling.capture), and this process goes
    on to time the model. The child prints its own progress and errors."""
    if not _defaults(dtype, device)[1].startswith("cuda"):
        click.get_current_context().invoke(
            profile, model_id=model_id, batch=batch, seq=seq, dtype=dtype, device=device,
            mode=mode, pretrained=False, run_dir=run_dir, top=5, generation=None)
        return
    import subprocess

    args = [sys.executable, "-m", "pipeline", "profile", model_id, "--batch", batch, "--seq",
            seq, *(["--mode", mode] if mode else []), "--top", "5"]
    for flag, value in (("--dtype", dtype), ("--device", device), ("--run-dir", run_dir)):
        if value is not None:
            args += [flag, str(value)]
    code = subprocess.run(args).returncode
    if code:
        raise SystemExit(code)


def _family_list(text: str | None) -> list[str] | None:
    if not text:
        return None
    from codegen.registry import families

    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in families()]
    if unknown or not names:
        raise UserError(f"unknown kernel family {', '.join(unknown) or text!r}; known: "
                        f"{', '.join(sorted(families()))}")
    return names


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
@click.option("--batch", default=None, help="Batch sizes, comma-separated [default: 1,8].")
@click.option("--prompt", default=None,
              help="Prompt lengths in tokens, comma-separated [default: 128,1024].")
@click.option("--new", "new_tokens", default=None,
              help="New tokens per generation, comma-separated [default: 128].")
@click.option("--variants", default=None, metavar="A,B",
              help="Of hf-eager, hf-static, graph, ours, ours-graphs, ours-static-compile "
                   "[default: all; hf-eager always, as the baseline].")
@click.option("--rounds", type=int, default=None,
              help="Timed calls per variant and grid point, in rotating order, after one "
                   "untimed call [default: 3 on a GPU, 1 on the CPU].")
@click.option("--resume", is_flag=True, help="Keep the grid points e2e.json already holds.")
def e2e(run_dir, batch, prompt, new_tokens, variants, rounds, resume):
    """Generation end to end: time to first token, time per output token (p50, p99), tokens/s,
    for every batch x prompt x new combination, against what a user has without us.

    \b
    Variants, all in one process over the same weights, rotating order:
      hf-eager     model.generate(ids, max_new_tokens=N)       (transformers, dynamic cache)
      hf-static    ... cache_implementation="static"           (compiles its step on CUDA)
      graph        the unpatched model, one CUDA graph per step (our generate loop)
      ours         the run's kernels, then model.generate(...)  (eager)
      ours-graphs  the run's kernels + CUDA graph: handle.generate(...), the shipped path
      ours-static-compile  the kernels torch.compile traces, in hf-static's generate

    Every batch x prompt x new combination is a grid point. With none of the three given, the
    grid is the generations the run was profiled for (`pipeline profile --generation`), else
    1,8 x 128,1024 x 128. Greedy, EOS ignored. Writes e2e.json (after every grid point: an
    interrupted run keeps what it measured) and the report's "Generation end to end" section.
    The run's decode
    workloads should be profiled at the generation's final KV length
    (`pipeline profile MODEL --generation 1x1024+128`); without a decode workload of a batch
    the run's variants are skipped there and the transformers ones still run.

    \b
    Example:
      pipeline e2e runs/llama-3.2-1b-... --batch 1 --prompt 1024 --new 128
    """
    from pipeline.rundir import load_run

    run = load_run(str(run_dir)) if run_dir else latest_run()
    _e2e(run, batch, prompt, new_tokens, variants, rounds, resume)


def _e2e(run: Path, batch, prompt, new_tokens, variants, rounds, resume) -> None:
    from pipeline.e2e import DEFAULT_GRID, grid, parse_variants, run_e2e, run_grid
    from pipeline.e2e_report import print_e2e
    from pipeline.report import write_report
    from pipeline.summary import console

    if batch is prompt is new_tokens is None and run_grid(run):
        points = run_grid(run)
    else:
        points = grid(*(given or default for given, default in
                        zip((batch, prompt, new_tokens), DEFAULT_GRID)))
    chosen = parse_variants(variants)
    if rounds is not None and rounds < 1:
        raise UserError("--rounds must be at least 1")
    with progress(console, "e2e") as say:
        result = run_e2e(run, points, chosen, rounds, say, resume=resume)
    print_e2e(result)
    out = write_report(run)
    console.print(f"e2e: {run / 'e2e.json'}; report: {out['markdown']}")


@cli.command("export")
@click.argument("run_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--workload", default=None, metavar="KEY",
              help="Only the kernels kept for this workload [default: every workload's].")
def export_cmd(run_dir, out_dir, workload):
    """Write RUN_DIR's accepted kernels as a package the Hugging Face `kernels` library loads
    from a local path: a torch-noarch build whose `layers` take the Hugging Face modules'
    arguments (kernelize them into any model of the run's architecture), the kernel sources
    and configs per shape, metadata, a README naming the workloads and measured speedups,
    and the acceptance records. OUT_DIR must not exist (or be empty).

    \b
    Example:
      pipeline profile tiny-llama --batch 2 --seq 64 && pipeline optimize --top 3
      pipeline export runs/tiny-llama-... tiny-llama-kernels
      # then, in Python: see tiny-llama-kernels/README.md, "Use"
    """
    from pipeline.export import export
    from pipeline.rundir import load_run
    from pipeline.summary import console

    record = export(load_run(str(run_dir)), out_dir, workload)
    console.print(f"export: {out_dir} ({record.name}, build/{record.variant}): "
                  f"{', '.join(record.families)}" + "".join(
                      f"; {f} not exported: {why}" for f, why in record.not_exported.items()))


@cli.command()
@click.option("--device", default=None, help="cpu or cuda [default: cuda if available].")
@click.option("--refresh", is_flag=True, help="Measure again even when cached.")
def calibrate(device, refresh):
    """Measure this machine's roofline ceilings (copy bandwidth, matmul peak, launch cost),
    cached per device name in the user cache folder; `profile` calibrates on first use."""
    from pipeline.stages.profile import check_device
    from pipeline.summary import console
    from profiling.roofline import ceilings

    _, device = _defaults(None, device)
    check_device(device)
    c = ceilings(device, refresh=refresh)
    console.print(f"{c['device']}: copy {c['bandwidth_GBps']:.0f} GB/s, matmul "
                  f"{c['matmul_TFLOPs']:.1f} TFLOP/s ({c['matmul_dtype']}), launch "
                  f"{c['launch_us']:.2f} us  [{c['method']}]")


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path), required=False)
def report(run_dir):
    """Write report.md, report.html, plots and acceptance records for RUN_DIR."""
    from pipeline.report import write_report
    from pipeline.summary import console

    out = write_report(existing_dir(run_dir) if run_dir else latest_run())
    console.print(f"report: {out['markdown']}")


def one_line(text: str, limit: int = 400) -> str:
    """An exception's message on one line: the first line alone may name only a validator."""
    joined = " ".join(x.strip() for x in text.splitlines() if x.strip())
    return joined if len(joined) <= limit else joined[: limit - 3] + "..."


class Terminated(KeyboardInterrupt):
    """SIGTERM, as `timeout` or a batch scheduler sends it at a time limit: handled like
    Ctrl-C, so the run says how to resume instead of ending without a word."""


def _terminated(signum, frame):
    raise Terminated


def _stopped(e: KeyboardInterrupt) -> None:
    """The line a stopped command ends with, naming how to resume an optimize run; exit 130
    for Ctrl-C, 143 (128 + SIGTERM) for SIGTERM, as a process killed by that signal would."""
    term = isinstance(e, Terminated)
    word = "terminated" if term else "interrupted"
    # before `optimize` has a run directory (a profile: written only once it is complete)
    # there is nothing to resume
    click.echo(f"{word}; resume with `pipeline optimize {_RUN['dir']} --resume`"
               if _RUN["dir"] else word, err=True)
    sys.stderr.flush()
    sys.stdout.flush()
    # not sys.exit: that waits for worker threads, and a second Ctrl-C during the wait
    # prints their KeyboardInterrupt traceback; artifacts are written atomically
    os._exit(143 if term else 130)


def main() -> None:
    debug = "--debug" in sys.argv
    from pipeline.interpreter import use_interpreter_without_gpu

    use_interpreter_without_gpu()  # before anything imports a kernel module
    signal.signal(signal.SIGTERM, _terminated)
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort as e:
        # click turns a KeyboardInterrupt (Ctrl-C, or SIGTERM as `_terminated` raises it) into
        # its own Abort before it reaches this handler; its cause says which it was
        if isinstance(e.__cause__, KeyboardInterrupt):
            _stopped(e.__cause__)
        click.echo("aborted", err=True)
        sys.exit(130)
    except KeyboardInterrupt as e:  # one raised outside click's invocation
        _stopped(e)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - last line of defence: one line, not a traceback
        if debug or os.environ.get("PIPELINE_DEBUG"):
            raise
        name = type(e).__name__
        if "OutOfMemory" in name:
            click.echo("error: out of memory; try a smaller --batch or --seq", err=True)
        else:
            click.echo(f"error: {name}: {one_line(str(e))} (rerun with --debug for the "
                       f"traceback)", err=True)
        sys.exit(1)
