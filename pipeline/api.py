"""Python API: use a run's accepted kernels on a model you already loaded.

    from pipeline.api import apply_kernels
    handle = apply_kernels(model, "runs/llama-3.2-1b-...", workload="prefill-b8-s1024-bf16")
    ...                       # model now runs the accepted kernels where they were accepted
    handle.undo()             # back to the original code, exactly

On a machine without CUDA the kernels run under Triton's interpreter, turned on here as the CLI
does (`pipeline.interpreter`): import this module before any Triton kernel module.

Patches are per model instance and reversible (never class-level). For a given workload only
the kernels kept there (not rolled back by the whole-model measurement) are used, and each
call dispatches by its shape: shapes no kernel was accepted for run the original code.

Where the graphs stage shipped CUDA graphs for the workload, `graphs=True` also captures the
patched model:

    handle = apply_kernels(model, run_dir, workload="prefill-b1-s128-bf16", graphs=True)
    logits = handle(input_ids)   # [1, 128] replays the graph; any other shape runs eagerly
    handle.undo()                # frees the graph, then restores the model

    handle = apply_kernels(model, run_dir, workload="decode-b1-s1152-bf16", graphs=True)
    out = handle.generate(prompt_ids, max_new_tokens=128)  # transformers' generate, over a
                                                           # static cache, one replay a step
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.artifacts import load
from core.errors import UserError
from core.integration_records import IntegratedWorkload, Integration
from core.records import VerificationSummary, WorkloadSpec
from pipeline.interpreter import use_interpreter_without_gpu

# at import, as the CLI does before anything imports a kernel: @triton.jit reads the switch
# when a kernel is defined
use_interpreter_without_gpu()

# static-cache room a decode handle's decoder has beyond the profiled cache length
DECODE_HEADROOM = 256


def generation_cache_len(prompt: int, new: int) -> int:
    """Static cache slots `generate` gives a prompt of `prompt` tokens and `new` new ones: the
    slots a decode workload at KV length prompt + new steps over (`models.graphs.static_len`),
    so that the kernels accepted for `pipeline profile --generation` serve every step of it."""
    from models.graphs import static_len

    return static_len(prompt + new)


@dataclass
class KernelHandle:
    families: list[str]
    _undo: list[Callable[[], None]] = field(default_factory=list)
    model: object = None
    graph: object = None  # models.graphs.GraphedPrefill of the profiled prefill shape
    decoder: object = None  # models.graphs.StaticDecoder(graph=True) of a decode workload
    graphed: bool = False  # generate's steps replay a CUDA graph (graphs shipped and asked)
    # entered around each capture: codegen.pdl.enabled where the graphs stage kept PDL on
    capture_context: object = None
    # the unpatched model over the same weights that `generate` prefills with where every
    # workload patched is a decode step (`apply_kernels`); None: the patched model
    prefill_model: object = None
    # each family's kernel calls since patching, and the cases it had no kernel for (those
    # calls ran the original code): which kernels served a generation
    calls: dict[str, int] = field(default_factory=dict)
    declined: dict[str, list[str]] = field(default_factory=dict)
    # families kept for the workload but not patched: {family: why} (compiled=True leaves out
    # those torch.compile cannot trace)
    left_out: dict[str, str] = field(default_factory=dict)
    # compiled=True: what became of the model's attention (`codegen.sdpa_op.route`)
    notes: list[str] = field(default_factory=list)
    _generator: object = None  # the StaticDecoder `generate` steps over, kept between calls

    def __call__(self, input_ids):
        """Logits of `input_ids`: a graph replay for the profiled prefill shape (a static
        buffer, overwritten by the next replay: clone it to keep it), else the eager
        `model(input_ids)`."""
        if self.graph is not None and self.graph.matches(input_ids):
            return self.graph(input_ids)
        return self.model(input_ids).logits

    def generate(self, input_ids, max_new_tokens: int | None = None, attention_mask=None,
                 on_token=None, **kwargs):
        """`model.generate(input_ids, max_new_tokens=..., attention_mask=..., **kwargs)` as
        transformers does it (greedy or sampling: `do_sample`, `temperature`, `top_k`, `top_p`,
        `eos_token_id`, `pad_token_id`, repetition penalty and the other logits processors its
        generation config names; left-padded batches through `attention_mask`), over a static
        KV cache sized for the call (prompt + new tokens, rounded up to 16): one CUDA graph
        replay per step where graphs shipped for the workload (`graphs=True`), eager steps
        elsewhere. Returns the prompt and the new tokens, as transformers does.

        The cache and its graph are kept for the next call of the same batch and length; a
        call of another shape builds (and captures) its own, freeing the last. `on_token(i)`
        runs once token i is chosen (enqueued on the GPU, not waited for): a timing hook."""
        from models.generation import GenerationError, decode, plan

        try:
            p = plan(self.model, input_ids, attention_mask, max_new_tokens=max_new_tokens,
                     **kwargs)
        except GenerationError as e:
            raise UserError(str(e)) from None
        decoder = self._generation_decoder(input_ids.shape[0],
                                           generation_cache_len(input_ids.shape[1],
                                                                p.new_tokens))
        return decode(decoder, p, input_ids, attention_mask, on_token)

    def _generation_decoder(self, batch: int, max_len: int):
        from models.graphs import StaticDecoder

        dec = self._generator
        if dec is None or (dec.batch, dec.max_len) != (batch, max_len):
            if dec is not None:
                dec.close()
            self._generator = None
            self._generator = StaticDecoder(self.model, batch, max_len, graph=self.graphed,
                                            capture_context=self.capture_context,
                                            prefill_model=self.prefill_model)
        return self._generator

    def undo(self) -> None:
        for g in (self.graph, self.decoder, self._generator):
            if g is not None:
                g.close()
        self.graph = self.decoder = self._generator = self.prefill_model = None
        while self._undo:
            self._undo.pop()()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def apply_kernels(model, run_dir: str | Path, workload: str | list[str] | None = None,
                  graphs: bool = False, max_len: int | None = None,
                  graph_set: bool = False, compiled: bool = False) -> KernelHandle:
    """Patch `model` with the run's accepted kernels (kept for `workload`, if given; a list
    of workloads takes each one's kernels, each dispatched by shape: a generation's prefill
    and decode workloads together).

    `graphs=True` needs `workload`, and CUDA graphs shipped there (integration.json
    workloads[key]["graphs"]["shipped"]): then the patched model is captured, a prefill
    workload's graph behind `handle(input_ids)`, a decode workload's step behind
    `handle.decoder` (a static KV cache of `max_len` positions, default the profiled length
    plus DECODE_HEADROOM). Where graphs did not ship (not faster, capture failed, a CPU run)
    it raises UserError saying why, rather than silently patching kernels alone: the caller
    asked for the measured graph speed, and `graphs=False` is the explicit way to take the
    kernels without it.

    The graph holds the set the graphs stage chose for it (workloads[key]["graphs"]
    ["families"]), which may differ from the eager shipped set: families rolled back in eager
    for host time can win once the host is gone. `graph_set=True` patches that set without
    capturing anything (to capture it yourself, as benchmarks/head_to_head.py does).

    `compiled=True` patches only the families torch.compile traces (`Family.traceable`: each
    kernel call then becomes a custom op, `codegen.ops`), for a model you compile yourself or
    hand to transformers' static-cache `generate`, which compiles its step; `handle.left_out`
    names the others and why. Its attention then runs transformers' SDPA as one opaque op
    (`codegen.sdpa_op`: Inductor's own SDPA lowering lays q, k and v out for itself, which made
    the same cuDNN kernel 2.8x slower than eager on Llama-3.2-1B's prefill); `handle.notes`
    says so, or why the model's attention was left to the compiler."""
    use_interpreter_without_gpu()  # in case the environment changed since the import
    from codegen.ops import compilable
    from codegen.registry import get_family
    from pipeline.patching import counting_chooser, for_compile, make_chooser

    run_dir = Path(run_dir)
    accepted = load(run_dir / "verification" / "summary.json", VerificationSummary,
                    "verification summary").accepted
    integ_path = run_dir / "integration.json"
    if not integ_path.exists():
        raise UserError(f"{run_dir} has no integration.json: run `pipeline optimize` first")
    measured = load(integ_path, Integration, "integration").workloads
    keys = _checked_keys(measured, workload, run_dir, graphs, graph_set, compiled)
    in_graph = _graph_key(measured, keys) if graphs or graph_set else None
    graphed = _shipped(measured, in_graph) if graphs else None
    allowed = _allowed_cases(measured, keys, in_graph)
    left_out = for_compile(list(allowed))["left_out"] if compiled else {}
    allowed = {f: c for f, c in allowed.items() if f not in left_out}
    handle = KernelHandle(sorted(allowed), model=model, graphed=graphed is not None,
                          calls={f: 0 for f in allowed}, declined={}, left_out=left_out)
    if not compiled and allowed and all(w.workload.mode == "decode" for k, w in measured.items()
                                        if keys is None or k in keys):
        # a decode-only run verified no prefill case: a prompt's pass would only decline
        from pipeline.patching import twin

        handle.prefill_model = twin(model)
    try:
        for name in handle.families:
            chooser = counting_chooser(make_chooser(accepted, name, allowed[name],
                                                    run_dir=run_dir),
                                       handle.calls, name, handle.declined)
            family = get_family(name)
            handle._undo.append(family.patch(model, compilable(family, chooser)))
        if compiled:
            _route_attention(handle, model)
        if graphed is not None:
            handle.capture_context = capture_context(measured[graphed].graphs)
            _capture(handle, model, measured[graphed].workload, max_len)
    except BaseException:
        handle.undo()
        raise
    return handle


def _checked_keys(measured: dict[str, IntegratedWorkload], workload, run_dir: Path,
                  graphs: bool, graph_set: bool, compiled: bool) -> list[str] | None:
    """The workload keys `apply_kernels` was asked for (None: all), or UserError saying why
    they or the flags do not go together."""
    keys = [workload] if isinstance(workload, str) else workload
    for key in keys or []:
        if key not in measured:
            raise UserError(f"workload {key!r} not measured in {run_dir}; measured: "
                            f"{', '.join(measured)}")
    if compiled and graphs:
        raise UserError("graphs=True captures the eager patched model; for torch.compile "
                        "use compiled=True alone (mode='reduce-overhead' graphs it)")
    if (graphs or graph_set) and not keys:
        raise UserError(f"{'graphs' if graphs else 'graph_set'}=True needs a workload: a graph "
                        "is captured for one shape, its set chosen per workload")
    return keys


def _allowed_cases(measured: dict[str, IntegratedWorkload], keys: list[str] | None,
                   in_graph: str | None) -> dict[str, set[str]]:
    """family -> the case keys kept for the workloads asked (the graph's set for the one
    captured)."""
    allowed: dict[str, set[str]] = {}
    for key, w in measured.items():
        if keys is None or key in keys:
            fams = w.kept
            if key == in_graph and w.graphs is not None and w.graphs.has("families"):
                fams = w.graphs.families
            for fam in fams:
                allowed.setdefault(fam, set()).update(w.cases.get(fam, []))
    return allowed


def _route_attention(handle: KernelHandle, model) -> None:
    """compiled=True: the model's SDPA attention as one opaque op (`codegen.sdpa_op`), undone
    with the kernels; handle.notes says so, or why not."""
    from codegen.sdpa_op import route

    undo, note = route(model)
    handle.notes.append(note)
    if undo is not None:
        handle._undo.append(undo)


def _graph_key(measured: dict[str, IntegratedWorkload], keys: list[str]) -> str:
    """The workload whose graph (and graph set) `graphs=True` takes: the one named, or among
    several the decode workload (a generation's prefill runs eagerly, its steps replay the
    graph)."""
    if len(keys) == 1:
        return keys[0]
    decode = [k for k in keys if measured[k].workload.mode == "decode"]
    if len(decode) != 1:
        raise UserError("a graph over several workloads needs exactly one decode workload "
                        f"among them; got {', '.join(keys)}")
    return decode[0]


def _shipped(measured: dict[str, IntegratedWorkload], key: str) -> str:
    rec = measured[key].graphs
    if rec is None or not rec.shipped:
        why = (rec is not None and (rec.skipped or rec.decision or rec.error)) or \
            "the run has no graphs record (optimized before the graphs stage existed)"
        raise UserError(f"CUDA graphs did not ship for {key}: {why}; use graphs=False "
                        "for the kernels alone")
    return key


def capture_context(graphs) -> Callable | None:
    """What to enter around a capture of this workload's graph: PDL where the graphs stage
    kept it on (`Graphs.pdl`; codegen/pdl.py), with the L2 prefetch as the stage timed it,
    None otherwise. PIPELINE_NO_PDL still wins: `enabled` turns nothing on where PDL is
    unavailable or forced off."""
    rec = getattr(graphs, "pdl", None)
    if rec is None or not rec.on:
        return None
    from functools import partial

    from codegen.pdl import enabled

    return partial(enabled, prefetch=rec.prefetch)


def _capture(handle: KernelHandle, model, spec: WorkloadSpec, max_len: int | None) -> None:
    import torch

    from models.graphs import GraphedPrefill, StaticDecoder

    device = next(model.parameters()).device
    if spec.mode == "decode":
        handle.decoder = StaticDecoder(model, spec.batch, max_len or spec.seq + DECODE_HEADROOM,
                                       graph=True, capture_context=handle.capture_context,
                                       prefill_model=handle.prefill_model)
        return
    ids = torch.zeros((spec.batch, spec.seq), dtype=torch.long, device=device)
    handle.graph = GraphedPrefill(model, ids, capture_context=handle.capture_context)
