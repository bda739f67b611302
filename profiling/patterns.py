"""Pattern recognition over the attributed ops of one pass.

A pattern occurrence is one call of a scope (module call or Python function call) whose
unclaimed ops match the pattern's op counts. Scopes are visited innermost first, so a Linear
claims its matmul before the MLP around it looks at what is left. Ops no pattern claims stay
visible as rows of their own (`op:<name> @ <module class>`), so nothing is dropped and shares
still sum to 1 with the rest row.

Patterns without a kernel family (embedding, the rotary frequency table, residual adds)
live here; family patterns (the projections' `linear`, attention and the KV-cache update among
them) come from the codegen registry.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from core.family import Pattern

# ops that move no data or only describe views: claimed with any pattern whose scope they are in
VIEW_OPS = frozenset({
    "aten::view", "aten::reshape", "aten::transpose", "aten::unsqueeze", "aten::squeeze",
    "aten::slice", "aten::select", "aten::expand", "aten::permute", "aten::t", "aten::detach",
    "aten::alias", "aten::as_strided", "aten::unflatten", "aten::flatten", "aten::split",
    "aten::chunk", "aten::narrow", "aten::empty", "aten::empty_like", "aten::contiguous",
    "aten::lift_fresh", "aten::_unsafe_view", "aten::expand_as", "aten::size",
})

ANY = -1  # in Pattern.ops: one or more

BASE_PATTERNS: tuple[Pattern, ...] = (
    Pattern("embedding", "token embedding lookup", module_class=r"Embedding$",
            ops={"aten::embedding": 1}),
    Pattern("rotary_table", "cos/sin table of the rotary embedding",
            module_class=r"RotaryEmbedding$", ops={}),
    Pattern("residual_add", "residual additions in a decoder block",
            module_class=r"(DecoderLayer|Block)$", ops={"aten::add": ANY}, partial=True),
)


@dataclass
class Occurrence:
    pattern: str
    family: str | None
    module: str
    module_class: str
    ops: list[int] = field(default_factory=list)  # indices into the profile's op list
    extends: str | None = None  # an alternative to this pattern's occurrence (`alternatives`)

    def to_dict(self) -> dict:
        return {"pattern": self.pattern, "family": self.family, "module": self.module,
                "module_class": self.module_class, "ops": self.ops}


def _scopes(ops: list[dict]) -> dict[tuple, dict]:
    """Every scope call seen: ('m', call_id) for modules, ('f', call_id) for functions.

    Depth orders the visit: a function frame sits just inside its module, a child module
    one level further in.
    """
    scopes: dict[tuple, dict] = {}
    for i, op in enumerate(ops):
        depth = len(op["module_calls"])
        for d, call in enumerate(op["module_calls"]):
            scopes.setdefault(("m", call), {"depth": d * 100, "ops": []})["ops"].append(i)
        for j, (name, call) in enumerate(op["functions"]):
            s = scopes.setdefault(("f", call), {"depth": depth * 100 - 99 + j, "ops": [],
                                                "module": op["module"], "fn": name})
            s["ops"].append(i)
    return scopes


def _module_classes(ops: list[dict]) -> dict[int, tuple[str, str]]:
    """call id -> (class, path) for every module call, from the ops' innermost scopes up."""
    out: dict[int, tuple[str, str]] = {}
    for op in ops:
        if op["module_calls"]:
            out.setdefault(op["module_calls"][-1], (op["module_class"], op["module"]))
    return out


def match(ops: list[dict], patterns: list[Pattern], module_info: dict[int, tuple[str, str]]
          | None = None) -> tuple[list[Occurrence], list[int]]:
    """Return (occurrences, indices of unclaimed ops)."""
    scopes = _scopes(ops)
    info = dict(_module_classes(ops))
    if module_info:
        info.update(module_info)
    claimed: set[int] = set()
    found: list[Occurrence] = []
    for key in sorted(scopes, key=lambda k: -scopes[k]["depth"]):
        scope = scopes[key]
        if key[0] == "m":
            cls, path = info.get(key[1], (None, None))
        else:
            cls, path = None, scope["module"]
        for pat in sorted((p for p in patterns if p.extends is None), key=claim_order):
            if key[0] == "m" and (pat.module_class is None or cls is None
                                  or not re.search(pat.module_class, cls)):
                continue
            if key[0] == "f" and (pat.function is None or not re.search(pat.function, scope["fn"])):
                continue
            free = [i for i in scope["ops"] if i not in claimed]
            take = _check(pat, [ops[i]["name"] for i in free])
            if take is None:
                continue
            idx = [i for i, keep in zip(free, take) if keep]
            if not idx or (pat.accepts is not None and not pat.accepts([ops[i] for i in idx])):
                continue
            claimed.update(idx)
            if pat.inner:  # occurrences inside the scope that belong to this one
                within = set(scope["ops"])
                taken = [o for o in found if o.pattern in pat.inner and set(o.ops) <= within]
                found = [o for o in found if all(o is not t for t in taken)]
                idx = sorted(idx + [i for o in taken for i in o.ops])
            found.append(Occurrence(pat.name, pat.family, path or "", cls or scope["fn"], idx))
            break
    unclaimed = [i for i in range(len(ops)) if i not in claimed]
    return found, unclaimed


def alternatives(occurrences: list[Occurrence], patterns: list[Pattern],
                 ops: list[dict] | None = None) -> list[Occurrence]:
    """Occurrences of the patterns that extend another (`Pattern.extends`): one per pattern and
    occurrence of the extended pattern whose scope has every absorbed child module's own
    occurrence (the gate and up Linears of an MLP), with the ops of all of them. They overlap
    what `match` found, so they are ranked beside it and never replaced together with it.
    With `ops` (the profile's op list), a pattern's `accepts` judges the occurrence's ops too
    (the grouped q/k/v takes a decode step's GEMVs only, not a projection the matmul family
    pads).
    Children are found by module path, so this needs a profile that names modules (the
    pipeline's own profiles do; a bare trace's `Linear_4` does not say which projection it
    is). Two patterns may extend one occurrence with overlapping children (the grouped q/k/v
    projection, and the same with the input norm before it): each is an occurrence of its
    own, rivals the ranking keeps apart (`RankHooks.rivals`); a child is absorbed once per
    pattern."""
    by_module: dict[str, list[Occurrence]] = {}
    for o in occurrences:
        by_module.setdefault(o.module, []).append(o)
    taken: dict[str, set[int]] = {}
    found = []
    for o in occurrences:
        for pat in patterns:
            if pat.extends != o.pattern:
                continue
            mine = taken.setdefault(pat.name, set())
            parts = [next((c for c in by_module.get(_child_path(o.module, child), [])
                           if id(c) not in mine), None) for child in pat.absorbs]
            if any(c is None for c in parts):
                continue
            own = [] if pat.absorbs_only else o.ops
            idx = sorted(own + [i for c in parts for i in c.ops])
            if ops is not None and pat.accepts is not None \
                    and not pat.accepts([ops[i] for i in idx]):
                continue
            mine.update(id(c) for c in parts)
            # absorbs_only: shown beneath, and an alternative to, the children's own row
            found.append(Occurrence(pat.name, pat.family, o.module, o.module_class, idx,
                                    extends=parts[0].pattern if pat.absorbs_only
                                    else o.pattern))
    return found


def _child_path(module: str, child: str) -> str:
    """The module path of an absorbed child: `module.child`, or for "../name" the sibling
    `name` under module's parent (GPT-2's c_fc beside the activation module it feeds)."""
    if child.startswith("../"):
        parent = module.rpartition(".")[0]
        return f"{parent}.{child[3:]}" if parent else child[3:]
    return f"{module}.{child}"


def claim_order(pat: Pattern) -> tuple:
    """Which pattern tries a scope first. A pattern with op counts matches only a scope with
    exactly those ops, so two of them never both fit one scope; they go first, the larger op
    set first for a stable order. Then a whole-scope pattern (no ops: claims everything inside),
    which must not take a scope a specific pattern fits; last a partial one, which claims only
    its ops and leaves the rest (residual adds after add_rmsnorm, which claims them when
    fusable)."""
    return (pat.partial, not pat.ops, -sum(max(n, 1) for n in pat.ops.values()))


def _check(pat: Pattern, names: list[str]) -> list[bool] | None:
    """Which of `names` the pattern claims, or None when the op counts do not match."""
    counts = Counter(n for n in names if n not in VIEW_OPS and n not in pat.extra_ok)
    if not pat.ops:  # a whole-scope pattern (e.g. the rotary table): claims everything inside
        return [True] * len(names)
    for name, want in pat.ops.items():
        have = counts.get(name, 0)
        if (want == ANY and have == 0) or (want != ANY and have != want):
            return None
    if pat.partial:
        return [n in pat.ops for n in names]
    if set(counts) - set(pat.ops):
        return None
    return [True] * len(names)
