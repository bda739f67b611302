"""Memoisation probes that call a kernel the way a model does.

In a model a kernel's weights never change between calls (the same buffers, the same values),
its activations change every call, and a decode step's KV cache is the same buffers one
position longer than at the step before. A kernel that caches its answer keyed on a few values
of the activation and a few of a weight (or of the cache) hits in the model, and returns a
stale answer, whenever the activation's keyed values repeat; it never hits in a verifier that
draws every input afresh. So, after the family's declaration of which inputs stay fixed
(`VerifyHooks.weights`, `VerifyHooks.cache`; core/family.py), each given case also gets, right after
its random trials and generic memo probes (verify/numerics.py's `repeat_in_part`):

    new_activations  the last input set's own tensors, the fixed inputs untouched, each other
                     floating input changed in one element (in place: the same buffers)
    new_weights      the activations as the last input set left them (the same tensors),
                     each fixed input a new buffer of the same values, changed in one element
    cache_rewound    a fresh draw with its cache one position short (`Cache.rewind`)
    cache_grows      that same cache one position longer again, new values in its new slot
                     (`Cache.grow`): the same buffers, as a static cache's next step

One changed element at a position drawn from the seed: a memo keyed on a few values still
hits, unless its key happens to hold that very element, and the element changes the result
(a row of the output, a column, a head), so the stale answer is visibly wrong. The element is
a non-zero one where one of 64 draws finds it: a zero may be padding no result reads (matmul's
padded weight rows). Each probe is judged like any input set, under the `memoisation` check
(cache_rewound, a fresh draw where nothing repeats yet, under `numerics`), and the reason of a
rejected candidate names it with what it held and changed.
"""

from __future__ import annotations

import torch

from core.family import Family, fixed_inputs

MODEL_KINDS = ("new_activations", "new_weights")
CACHE_KINDS = ("cache_rewound", "cache_grows")
PROBE_KINDS = MODEL_KINDS + CACHE_KINDS


def probe_kinds(family: Family) -> tuple[str, ...]:
    """The probes a family's declaration calls for: none without fixed inputs; the cache's
    growth only where it says how its cache grows."""
    cache = family.verify.cache
    kinds = MODEL_KINDS if family.verify.weights or cache is not None else ()
    if cache is not None and cache.rewind is not None and cache.grow is not None:
        kinds += CACHE_KINDS
    return kinds


# positions drawn at once, the first non-zero one taken (a zero where all are)
_DRAWS = 64


def change_one(t, gen: torch.Generator) -> list[int] | None:
    """Add 1 to one element of `t` in place, at a position drawn from `gen`; its index, or None
    where `t` is no floating tensor with elements (an integer length, a boolean mask)."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()):
        return None
    if t.dim() == 0:
        t.add_(1)
        return []
    flat = torch.randint(t.numel(), (_DRAWS,), generator=gen)
    index = []
    for size in reversed(t.shape):
        index.append(flat % size)
        flat = flat // size
    index.reverse()
    # gathered where they lie, not through a flat copy of the tensor (an LM head's weight)
    found = (t[tuple(i.to(t.device) for i in index)] != 0).nonzero()
    k = int(found[0]) if len(found) else 0
    at = tuple(int(i[k]) for i in index)
    t[at] = t[at] + 1
    return list(at)


def _where(changed: dict[int, list[int]]) -> str:
    return ", ".join(f"input {i} at {idx}" for i, idx in changed.items()) or "nothing"


def new_activations(family: Family, previous: tuple, seed: int) -> tuple[tuple, str]:
    """(inputs, what changed): `previous`' tensors, its weights and caches untouched, each
    other floating input changed in one element."""
    fixed = fixed_inputs(family, len(previous))
    gen = torch.Generator().manual_seed(seed)
    changed = {i: idx for i, t in enumerate(previous)
               if i not in fixed and (idx := change_one(t, gen)) is not None}
    return tuple(previous), (f"weights and caches (inputs {list(fixed)}) held, "
                             f"activations changed: {_where(changed)}")


def new_weights(family: Family, previous: tuple, seed: int) -> tuple[tuple, str]:
    """(inputs, what changed): `previous`' activations (the same tensors), each weight and
    cache input a new buffer of its values, changed in one element if floating."""
    fixed = fixed_inputs(family, len(previous))
    gen = torch.Generator().manual_seed(seed)
    inputs, changed = list(previous), {}
    for i in fixed:
        if isinstance(inputs[i], torch.Tensor):
            inputs[i] = inputs[i].clone()
            if (idx := change_one(inputs[i], gen)) is not None:
                changed[i] = idx
    return tuple(inputs), (f"activations held, weights and caches new buffers, changed: "
                           f"{_where(changed)}")
