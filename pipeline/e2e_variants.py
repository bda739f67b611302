"""The ways of generating that `pipeline e2e` puts side by side, and the clock it reads them by.

Every variant is one call a user can make, run as its documentation says:
- hf-eager: `model.generate(ids, max_new_tokens=N)` (transformers' dynamic cache);
- hf-static: the same with `cache_implementation="static"`, which on CUDA compiles the decode
  step itself (its `compile_config`, reduce-overhead); on a CPU it runs eagerly;
- graph: the unpatched model behind `KernelHandle.generate`, one CUDA graph per step;
- ours: the run's kernels patched in, then `model.generate(...)` as hf-eager;
- ours-graphs: the run's kernels and the CUDA graph, `apply_kernels(..., graphs=True)`
  and `handle.generate(...)`, the shipped decode path;
- ours-static-compile: the run's kernels that torch.compile traces (`apply_kernels(...,
  compiled=True)`: each call one custom op) in hf-static's generate, which compiles its step
  with them on CUDA; on a CPU it runs eagerly.
The patched and graphed variants run on twins over the same weights (`pipeline.patching.twin`).
Greedy, EOS ignored (`eos_token_id=None`, as vLLM's `ignore_eos`), so every variant makes
exactly N tokens and their tokens can be compared.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

VARIANTS = ("hf-eager", "hf-static", "graph", "ours", "ours-graphs", "ours-static-compile")
GRAPHED = ("graph", "ours-graphs")
UNPATCHED_LOOP = GRAPHED[0]  # our loop without our kernels: ours-graphs' first-token base
NEEDS_RUN = ("ours", "ours-graphs", "ours-static-compile")
STATIC = ("hf-static", "ours-static-compile")  # transformers' static cache, compiling on CUDA


class Clock:
    """When each token of one call was chosen: CUDA events on the current stream (recorded,
    never waited for, so timing does not add a synchronisation the call lacks), else the host's
    clock (a CPU computes synchronously)."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.marks: list = []
        self._start = None
        self.on_first: Callable[[], None] | None = None  # runs once the prefill's token is out

    def start(self) -> None:
        self.marks = []
        self._start = self._mark()

    def token(self, _index: int | None = None) -> None:
        self.marks.append(self._mark())
        if len(self.marks) == 1 and self.on_first is not None:
            self.on_first()

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def read(self) -> tuple[float, list[float]]:
        """(ms to the first token, [ms between consecutive tokens]); after a synchronise."""
        if self.cuda:
            ms = [self._start.elapsed_time(e) for e in self.marks]
        else:
            ms = [(t - self._start) * 1e3 for t in self.marks]
        return ms[0], [b - a for a, b in zip(ms, ms[1:])]


def _clock_criteria(clock: Clock, batch: int, device):
    """A transformers StoppingCriteria that never stops and marks each token on `clock`:
    transformers calls its stopping criteria once per chosen token."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    never = torch.zeros(batch, dtype=torch.bool, device=device)

    class _Marks(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            clock.token()
            return never

    return StoppingCriteriaList([_Marks()])


@dataclass
class Variant:
    """A variant ready to call: `call(ids, clock) -> token ids [batch, prompt + new]`."""

    name: str
    call: Callable
    handle: object = None  # the KernelHandle of a patched or graphed variant
    setup_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    def close(self) -> None:
        if self.handle is not None:
            self.handle.undo()
            self.handle = None


class Ledger:
    """Which kernels served a generation, its prefill and its steps apart: each family's calls
    in one call, and the cases it had no kernel for (run by the original code). Adapters ask
    their chooser once per call signature, and a graphed step calls its kernels while it is
    captured, in the first call (a replay runs no Python): which families served is read off
    the first call, the call counts (`calls`) off the last."""

    def __init__(self, handle):
        self.handle = handle
        self.calls = {"prefill": {}, "steps": {}}
        self.first_calls: dict[str, dict[str, int]] = {}
        self.declined: dict[str, dict[str, list[str]]] = {"prefill": {}, "steps": {}}
        self._first = True

    def begin(self, clock: Clock) -> None:
        self.handle.calls.update({f: 0 for f in self.handle.calls})
        clock.on_first = self._prefill_done

    def _prefill_done(self) -> None:
        self.calls["prefill"] = dict(self.handle.calls)
        if self._first:
            self.declined["prefill"] = {f: list(c) for f, c in self.handle.declined.items()}

    def end(self) -> None:
        done = self.calls["prefill"]
        self.calls["steps"] = {f: n - done.get(f, 0) for f, n in self.handle.calls.items()}
        if self._first:
            self.first_calls = {k: dict(v) for k, v in self.calls.items()}
            before = self.declined["prefill"]
            self.declined["steps"] = {
                f: [c for c in cases if c not in before.get(f, [])]
                for f, cases in self.handle.declined.items()
                if any(c not in before.get(f, []) for c in cases)}
            self._first = False

    def served(self, phase: str) -> set[str]:
        """Families whose kernel ran in `phase` and served every call of it."""
        return {f for f, n in self.first_calls.get(phase, {}).items()
                if n > 0 and f not in self.declined[phase]}


def hf_variant(name: str, model, new: int) -> Variant:
    """hf-eager or hf-static (and ours or ours-static-compile, on a patched twin):
    transformers' own generate."""
    static = {"cache_implementation": "static"} if name in STATIC else {}

    def call(ids, clock):
        clock.start()
        return model.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                              stopping_criteria=_clock_criteria(clock, ids.shape[0], ids.device),
                              **static)
    notes = []
    if name in STATIC and not next(model.parameters()).is_cuda:
        notes.append("on a CPU transformers does not compile: the static cache runs eagerly")
    return Variant(name, call, notes=notes)


def handle_variant(name: str, handle, new: int, setup_s: float) -> Variant:
    """graph or ours-graphs: `KernelHandle.generate`, one graph replay per step."""

    def call(ids, clock):
        clock.start()
        return handle.generate(ids, max_new_tokens=new, do_sample=False, eos_token_id=None,
                               on_token=clock.token)
    return Variant(name, call, handle=handle, setup_s=setup_s)
