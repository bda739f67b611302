"""Applying accepted kernels to a model: per case, per instance, reversibly.

A chooser maps each call's case to the accepted kernel for that exact case, or to None (the
original code); `patched` applies a set of families through their adapters and undoes them on
exit; `twin` is a second module tree over the same weights, so a patched variant and the
unpatched model can run interleaved without re-patching per call.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from pathlib import Path

from codegen.ops import compilable
from codegen.registry import get_family
from codegen.search import case_key
from core.records import Accepted
from core.source import load_forward
from pipeline.rundir import relocate


def make_chooser(accepted: dict, family: str, allowed_cases: set[str] | None = None,
                 run_dir: Path | None = None):
    """case -> forward for the exact cases accepted for `family` (and allowed), else None.
    `run_dir`: where the run lives now, if it was moved since the kernels were accepted."""
    by_case = {}
    for acc in Accepted.map_of(accepted).values():
        if acc.family == family:
            key = case_key(acc.case)
            if allowed_cases is None or key in allowed_cases:
                by_case[key] = acc.source
    loaded: dict[tuple, Callable | None] = {}

    def chooser(case):
        # called on every patched call: a dict lookup, not a hash of the case, on the hot path
        frozen = tuple(sorted(case.items()))
        if frozen not in loaded:
            src = by_case.get(case_key(case))
            loaded[frozen] = load_forward(relocate(src, run_dir)) if src is not None else None
        return loaded[frozen]

    return chooser


@contextmanager
def patched(model, accepted: dict, families: list[str], workload_cases: dict | None = None,
            calls: dict[str, int] | None = None, declined: dict | None = None):
    """Apply the accepted kernels of `families`; undone on exit, whatever happens. `calls`:
    each family's kernel calls are counted into calls[name], and with `declined` the cases
    it had no kernel for listed (`counting_chooser`)."""
    with ExitStack() as stack:
        for name in families:
            allowed = None if workload_cases is None else workload_cases.get(name, set())
            chooser = make_chooser(accepted, name, allowed)
            if calls is not None:
                calls.setdefault(name, 0)
                chooser = counting_chooser(chooser, calls, name, declined)
            family = get_family(name)
            stack.callback(family.patch(model, compilable(family, chooser)))
        yield model


UNTRACEABLE = "torch.compile cannot trace its adapter (Family.traceable)"


def for_compile(names: list[str]) -> dict:
    """What a compiled user of these families is offered: {"families": those torch.compile
    traces, "left_out": {family: why}} (`Family.traceable`)."""
    left_out = {n: UNTRACEABLE for n in names if not get_family(n).traceable}
    return {"families": sorted(n for n in names if n not in left_out), "left_out": left_out}


def patch_memory(model, families: list[str]) -> dict[str, int]:
    """family -> bytes its patch holds beyond the model's own weights (copies it builds when
    patched, such as padded weights: the undo's `extra_bytes`, core.family), nonzero only.
    Each family is patched and undone once, with a chooser that declines every call: what a
    patch builds, it builds at patch time, before any call."""
    out = {}
    for name in families:
        undo = get_family(name).patch(model, lambda case: None)
        try:
            held = int(getattr(undo, "extra_bytes", 0))
        finally:
            undo()
        if held:
            out[name] = held
    return out


def counting_chooser(inner, calls: dict, name: str, declined: dict | None = None):
    """`inner`'s kernels, each call counted in calls[name] (adapters ask once per signature
    and call every time, so the wrapper, not the chooser, counts). `declined`: the case keys
    `inner` had no kernel for, listed in declined[name]: a signature the model's pass hands
    the adapter that no accepted case covers runs the original code there, silently (4 of
    Llama-3.2-1B's 16 MLPs, whose weights the allocator had put back to back, asked
    matmul_epilogue for a "packed" case nobody had verified)."""

    asked: list[dict] = []  # declined cases, until a more general case serves the call

    def chooser(case):
        fn = inner(case)
        if declined is not None:
            note_declined(declined, name, asked, case, fn is None)
        if fn is None:
            return None

        @functools.wraps(fn)  # adapters may read the kernel's signature (kv_cache's ticket)
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted
    return chooser


def note_declined(declined: dict, name: str, asked: list[dict], case: dict, miss: bool) -> None:
    """declined[name]: the keys of the cases in `asked` that no kernel served. An adapter may
    ask again with a more general case (rope's whole_table_fallback drops `equal_halves`);
    one that gets a kernel clears the specialised cases it generalises."""
    from codegen.search import case_key

    if miss:
        if case not in asked:
            asked.append(case)
    else:
        asked[:] = [a for a in asked if not all(k in a and a[k] == v for k, v in case.items())]
    if asked:
        declined[name] = [case_key(a) for a in asked]
    else:
        declined.pop(name, None)


def twin(model):
    """A second module tree over the same parameters and buffers (no weight copy), so the
    baseline and a patched variant can run interleaved without re-patching per call."""
    shared = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo=shared)


def workload_cases(model, workload, families: list[str]) -> dict[str, list[str]]:
    """family -> the case keys `workload` calls it with in `model` (sorted)."""
    from codegen.registry import get_family
    from codegen.search import case_key

    return {f: sorted({case_key(c) for c in get_family(f).cases_from_model(model, workload)})
            for f in families}
