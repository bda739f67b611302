"""The contract every kernel family folder fulfils.

A family folder `codegen/<name>/` holds `reference.py` (PyTorch code identical in behaviour to
the Hugging Face code it replaces), `kernel.py` (the Triton kernel, its host wrapper, and a
`render(config, case)` that writes a specialised, readable source file), and `__init__.py`
exposing `FAMILY`. The registry (`codegen.registry`) discovers the folders; nothing in
pipeline/ names a family.

Calling convention, shared by generated, proposed and hand-written candidates: a candidate is a
Python source file defining

    def forward(*inputs, out, **params) -> None

which writes its result into `out` (a tensor, or a tuple of tensors for multi-output families
such as rotary q/k) supplied by the caller, so the verifier can poison it first.

How every family is verified (verify/checks.py runs it; what a new family must declare for it):

- Cases are the calls the adapter makes in a model, exact shapes, strides and offsets, plus the
  family's edge cases. Where the patch accepts per-sequence data (a mask row per sequence, a
  position per sequence), the cases or edge cases carry sequences that differ: a left-padded
  batch of different lengths, a sequence that sees one slot only; one mask row expanded over
  the batch cannot tell a kernel that reads row 0 for all from one that reads each row.
- Memoisation is probed the way a model calls a kernel, after the family's declaration of which
  inputs stay fixed across a model's calls (`VerifyHooks.weights`, `VerifyHooks.cache`): the
  weights and caches held (the same buffers and values) while the activations change in one
  element; the activations held while the weights and caches are new buffers changed in one
  element; and, for a cache that grows in place (`Cache.rewind`/`Cache.grow`), the same
  buffers one position longer between two calls. Undeclared, weights are drawn afresh with
  every input set, as in the generic probes (the last set's buffers with new values; its
  leading half with a new tail), and a memo keyed on a weight never hits: a family with
  parameters or a cache declares them.
- The whole-model check (pipeline/integrate.py) compares the patched model's logits with an
  fp32 reference: the patched error may be at most 1.5x the unpatched model's. On a decode
  workload it decodes: a prefill, then several steps over the dynamic cache, the static cache
  (eager, and graphed on a GPU) and a left-padded batch, every step judged. A family needs
  nothing for it beyond a patch that dispatches the model's calls to its accepted cases.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

# A "case" is one concrete call: shapes, dtype name and scalar params, JSON-serialisable, e.g.
# {"rows": 8192, "hidden": 2048, "dtype": "bfloat16", "eps": 1e-5, "offset": 0.0}.
Case = dict[str, Any]


@dataclass(frozen=True)
class Pattern:
    """How the profile recognises one occurrence of what a fused kernel would replace.

    An occurrence is one call of a scope: an nn.Module whose class name matches `module_class`
    or a Python function frame whose name matches `function`. Its ops are the aten ops inside
    the scope that no inner pattern claimed (a Linear inside an MLP claims its own matmul).
    `ops` lists the aten op names a true occurrence runs and how many times; recognition checks
    them, not only the class name (a Gemma (1 + weight) norm runs one more add than Llama's).
    `extra_ok` names ops that may also appear (views, casts) and are then claimed too.
    """

    name: str
    description: str
    module_class: str | None = None
    function: str | None = None
    ops: dict[str, int] = field(default_factory=dict)
    extra_ok: tuple[str, ...] = ()
    family: str | None = None  # the kernel family that replaces it, if any
    # partial: claim only the listed ops and leave the rest of the scope to others (residual
    # adds in a decoder layer); otherwise any unlisted compute op means "not this pattern".
    partial: bool = False
    # cost(ops) -> (min_bytes, flops) of one fused occurrence, from the recorded op shapes and
    # dtypes (profile op dicts); None: the rank stage treats each op as its own roofline.
    cost: Callable[[list[dict]], tuple[int, int]] | None = None
    # An alternative to another pattern rather than a rival claimant: each occurrence of the
    # pattern named `extends` (on the same scope) plus the occurrences of the child modules
    # named in `absorbs` (a Linear's own `linear` occurrence) forms one occurrence of this one.
    # Ranked beside the pattern it extends, never replaced together with it (a GEMM with the
    # gated activation in its epilogue replaces the activation that gated_act would replace).
    # An `absorbs` entry "../name" names a sibling of the scope (GPT-2's c_fc beside its act).
    extends: str | None = None
    absorbs: tuple[str, ...] = ()
    # absorbs_only: the occurrence holds the absorbed children's ops alone, not the extended
    # pattern's, which only locates the scope (an attention's q/k/v projections grouped into
    # one launch replace the three Linears, not the attention the scope also runs); it is then
    # an alternative to the children's own rows only
    absorbs_only: bool = False
    # accepts(ops) -> whether a scope whose op names fit is an occurrence, judged on the ops'
    # recorded shapes (a one-token decode query against a prefill's causal square, both one
    # SDPA call); None: the op names decide alone
    accepts: Callable[[list[dict]], bool] | None = None
    # names of patterns whose occurrences inside this one's scope belong to it: they claim
    # their ops first (an inner scope), and this occurrence takes them over (an MoE block's
    # router softmax, a call of F.softmax, is part of the block's row, not a softmax row)
    inner: tuple[str, ...] = ()


@dataclass(frozen=True)
class CudaVariant:
    """A family's CUDA C++ kernels (`pipeline optimize --backend cuda|both`), searched beside
    the Triton ones; configs carry {"backend": "cuda"} so their folders differ."""

    search_space: Callable[[Case], list[dict]]
    render: Callable[[dict, Case], str]


@dataclass(frozen=True)
class Cache:
    """Inputs of a family that hold a cache a model keeps across its calls (a KV cache and what
    says which of its slots are valid: the length, the mask). Held fixed, like weights, by the
    memoisation probes while the activations change, and changed while they are held.

    rewind(case, inputs) -> bool and grow(case, inputs, generator) -> None, both in place on
    the inputs `make_inputs` drew (or their rewound state), for a cache that grows in place (a
    static cache): rewind drops the last valid position (its slot keeps its values, stale as a
    model's are; False where no position can be dropped: a cache of one position, or a layout
    that does not grow in place, and the probe is skipped); grow is the next decode step,
    new values written into the next slot and the valid length and mask advanced by one. None:
    no growth probe (a cache the model rebuilds on every call)."""

    inputs: tuple[int, ...]
    rewind: Callable[[Case, tuple], bool] | None = None
    grow: Callable[[Case, tuple, Any], None] | None = None


@dataclass(frozen=True)
class VerifyHooks:
    """What the verifier needs to know beyond the contract, where a family differs from the
    default (verify/checks.py reads it). Every field is optional: `VerifyHooks()` is a family
    whose inputs are all activations, stressed alike, written to `out` only, compared whole."""

    # the input positions that get the verifier's stress values; None: every floating input
    stress_inputs: tuple[int, ...] | None = None
    # The input positions that are a model's weights (parameters: the same buffers and values
    # on every call of one module; negative counts from the end; a position past the inputs, an
    # absent bias, is ignored). The memoisation probes hold them fixed while the activations
    # change, and change them while the activations are held (see the module's doc).
    weights: tuple[int, ...] = ()
    # The inputs that hold a cache kept across calls (`Cache`); None: no cache input.
    cache: Cache | None = None
    # order_bound(*inputs, reference, **params) -> per output, the classic bound on what any
    # summation order can change (dot products that cancel); the verifier allows either order
    # within it. `reference`: the float64 reference outputs of those inputs, or None (a bound
    # that needs the exact result reuses them instead of computing a second float64 GEMM)
    order_bound: Callable[..., Any] | None = None
    # in_place(inputs) -> the inputs the kernel overwrites with its result (the adapter runs it
    # that way); the verifier then runs each candidate in place too. None (the field, or what
    # it returns for a case's inputs): writes `out` only.
    in_place: Callable[[tuple], tuple] | None = None
    # out_region(case, out) -> the part of make_out's buffer(s) that holds the result, the same
    # structure (a tensor, or a tuple per output), taken by indexing alone: the verifier
    # applies it to masks shaped like `out` too. The reference is compared with it and every
    # element of it must be written; the rest of the buffer (matmul's pad columns, which the
    # caller slices away) may be written with anything or left alone, while writes outside
    # the buffer are still caught. None: the whole of `out` is the result.
    out_region: Callable[[Case, Any], Any] | None = None
    # aten ops a candidate may call as its own implementation (the matmul family's cuBLAS
    # call on a padded weight); the verifier allows them beside its allow-list of
    # allocation, views and copies. Empty: a kernel family, which computes in its own launches
    library_ops: tuple[str, ...] = ()
    # baseline_case(case) -> the case whose inputs the unpatched model's own code runs on,
    # where the adapter hands the kernel another layout than HF's code sees: gated_act's
    # "halves" (gate and up as column halves of one fused GEMM's output) against the two
    # contiguous tensors HF's MLP multiplies. The baseline (the reference) is timed on it, the
    # candidate on `case`, so a speedup is over what the model ran. None: the same case.
    baseline_case: Callable[[Case], Case] | None = None


@dataclass(frozen=True)
class RankHooks:
    """How the ranking and the choice of families treat the family's rows, where they differ
    from the default (every occurrence at the family's median speedup, every row acted on, no
    rival). The cost of one occurrence is its pattern's (`Pattern.cost`)."""

    # occurrence_case(ops) -> the case keys one ranked occurrence's ops give (a subset of a
    # case's keys: a GEMM's k and n), for a family whose pattern spans cases of different work
    # that it patches one by one: the graph projection then speeds each occurrence up by the
    # speedup of the accepted case it matches, and leaves one that no accepted case matches as
    # it is (the patch leaves that module alone). None: every occurrence at the family's median.
    occurrence_case: Callable[[list[dict]], dict | None] | None = None
    # declines(row) -> why the family does not act on one of its ranked rows (the rank stage's
    # row: attainable_speedup, share, ...), or None where it does. A declined row is ranked
    # without a family (never chosen, so never generated) and carries the reason; None: the
    # family acts on every row of its patterns.
    declines: Callable[[Any], str | None] | None = None
    # families that replace the same ops as this one: at most one of each pair is integrated
    # in a run, the one whose accepted kernels save more device time per call summed over its
    # cases (pipeline.policy.superseded); the other is tried where the winner does not ship
    rivals: tuple[str, ...] = ()


@dataclass
class Family:
    """One kernel family: the twelve names every family fills, then what some declare
    (`codegen/README.md` walks through adding one)."""

    name: str
    patterns: tuple[Pattern, ...]
    # reference(*inputs, **params) -> output tensor or tuple; the numerical reference.
    reference: Callable[..., Any]
    # make_inputs(case, device, generator) -> tuple of input tensors for that case.
    make_inputs: Callable[..., tuple]
    # make_out(case, inputs) -> output tensor(s) with the shape/dtype forward must write: the
    # buffer the adapter hands the kernel, which may be wider than the result (out_region).
    make_out: Callable[..., Any]
    # edge_cases(case) -> list of extra cases (one row, primes, just over a block, ...).
    edge_cases: Callable[[Case], list[Case]]
    # min_bytes(case) / flops(case): what a perfect fused kernel must move / compute.
    min_bytes: Callable[[Case], int]
    flops: Callable[[Case], int]
    # search_space(case) -> list of config dicts (block sizes, warps, rows per program...).
    search_space: Callable[[Case], list[dict]]
    # render(config, case) -> Python source text of a specialised candidate (defines forward).
    render: Callable[[dict, Case], str]
    # patch(model, forward_by_case) -> undo callable: per-instance, reversible; dispatches each
    # call to forward_by_case(case) (a callable or None = keep the original code). An undo
    # may carry `extra_bytes`: memory the patch holds beyond the model's weights (padded
    # copies built at patch time); the report shows it per model.
    patch: Callable[..., Callable[[], None]]
    # cases_from_model(model, workload) -> the cases this family sees in that model's forward.
    cases_from_model: Callable[..., list[Case]]
    # What a family may declare beyond the contract; everything outside the family's folder
    # reads these fields, never the folder's own names.
    aten_ops: tuple[str, ...] = ()  # aten compute ops the kernel must NOT run (verify checks)
    # params(case) -> the scalar keyword parameters of reference and forward; None: the case
    # entries the reference names as keyword parameters (verify.loading.case_params).
    params: Callable[[Case], dict] | None = None
    # small cases the family contract test (tests/codegen/test_family_contract.py) runs the
    # whole verifier on, with the search space's last config: seconds under the CPU
    # interpreter (a bfloat16 one is verified on a GPU only: the interpreter has no bfloat16)
    examples: tuple[Case, ...] = ()
    verify: VerifyHooks = field(default_factory=VerifyHooks)
    rank: RankHooks = field(default_factory=RankHooks)
    cuda: CudaVariant | None = None
    # the module of the family's contenders in benchmarks/kernel_table.py's per-kernel table (its
    # case at a model's shape, HF's own code, Liger's kernel); None: not in that table
    benchmark: str | None = None
    # whether torch.compile can trace the adapter (each kernel call then becomes the family's
    # custom op, codegen.ops); False: compiled users are not offered the family (its adapter
    # reads what a trace cannot: addresses, versions, globals swapped during a call)
    traceable: bool = True
    # leads(case) -> how many of search_space(case)'s first configs are the family's best
    # guesses (gemv: cuBLAS, then the guessed tile): a GPU search with nothing remembered times
    # them first, whatever its strategy (two random starts and an even spread both skipped
    # gemv's guess at four trials, and o_proj stayed on cuBLAS). None: no guesses
    leads: Callable[[Case], int] | None = None
    # data private to the family's own folder and its tests; nothing outside them reads it
    extras: dict[str, Any] = field(default_factory=dict)


def result_region(family: Family, case: Case, out: Any) -> Any:
    """The part of `out` (make_out's structure) that must hold the reference's result
    (`VerifyHooks.out_region`; all of it where the family declares none)."""
    region = family.verify.out_region
    return out if region is None else region(case, out)


def fixed_inputs(family: Family, n_inputs: int) -> tuple[int, ...]:
    """The positions among `n_inputs` inputs that stay fixed across a model's calls: the
    declared weights and cache inputs (`VerifyHooks.weights`, `VerifyHooks.cache`), sorted, negative
    positions resolved, positions past the inputs dropped."""
    hooks = family.verify
    declared = hooks.weights + (hooks.cache.inputs if hooks.cache is not None else ())
    return tuple(sorted({i % n_inputs for i in declared if -n_inputs <= i < n_inputs}))


def baseline_case_of(family: Family, case: Case) -> Case:
    """The case the baseline is timed on (`VerifyHooks.baseline_case`)."""
    rule = family.verify.baseline_case
    return rule(case) if rule is not None else case


def lazy(module: str, attr: str) -> Callable[..., Any]:
    """`module.attr`, imported on first call. Importing a kernel module applies @triton.jit,
    which fixes the interpreter-or-compiled choice (TRITON_INTERPRET) for the process, so
    discovering families must not import their kernels."""

    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)

    call.__name__ = attr
    return call


def kernel_by_signature(forward_by_case: Callable[[Case], Callable | None],
                        case_of: Callable[..., Case],
                        params_of: Callable[[Case], dict]) -> Callable[..., tuple]:
    """An adapter's dispatch: `resolve(*key)` -> (kernel, its params), or (None, None) where
    the chooser declines, with the case built by `case_of(*key)`. Computed once per distinct
    key (input shapes, dtype) rather than on every call: a host-bound pass pays an adapter's
    Python on every layer (`benchmarks/adapter_overhead.py`). The chooser must give one answer
    per case while the patch lives, as the pipeline's does (accepted kernels are fixed when a
    model is patched)."""
    from torch.compiler import is_compiling  # an adapter is built: torch is loaded

    declined: set[tuple] = set()

    @cache
    def resolved(*key):
        case = case_of(*key)
        kernel = forward_by_case(case)
        if kernel is None:
            declined.add(key)
            return None, None
        return kernel, params_of(case)

    def resolve(*key):  # a plain function: torch.compile reads `declines` off it, not off a cache
        return resolved(*key)

    def declines(*key) -> bool:
        """Whether `resolve(*key)` was asked already and had no kernel. An adapter may then
        run the original code before its other checks, whose outcome can no longer matter:
        a call the run has no kernel for (a prefill's, where only decode workloads were
        optimized) costs a set lookup, not the adapter's checks. Asks no chooser; False in a
        torch.compile trace, which takes the full path as before (it runs once)."""
        return not is_compiling() and key in declined

    resolve.declines = declines
    return resolve


def no_cases(model, workload) -> list[Case]:
    """For families no profiled forward calls (a loss without labels; softmax under SDPA)."""
    return []


def no_patch(model, chooser) -> Callable[[], None]:
    """Nothing to patch where no call is made; the undo is a no-op too."""
    return lambda: None


def distinct(case: Case, cases: list[Case]) -> list[Case]:
    """Edge cases without repeats and without the case itself (an edge that coincides with the
    recorded shape adds nothing)."""
    unique: list[Case] = []
    for c in cases:
        if c not in unique and c != case:
            unique.append(c)
    return unique
