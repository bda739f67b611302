"""How a case's configs are chosen: the exhaustive grid, random sampling, or Optuna's TPE.

A family's search space is a list of config dicts (block sizes, warps, stages, flags), not a
product of independent axes: a tile set, or cuBLAS beside Triton tiles, is a list. TPE works
on an encoding of it (`Encoding`): one parameter per key, ordinal for integers and flags (the
index among the space's sorted values, so 64 sits between 32 and 128, and a key a config lacks
sits below them), categorical otherwise. TPE samples a point; the point is decoded to the
nearest config of the space not yet tried, and what was timed is told back with that config's
own encoding, so the model learns from what ran. A config that failed the screen is told as
slower than any timing: its neighbours are often out of resources too.

Every strategy tries its `seeds` first (configs remembered from an earlier run,
codegen.search_memory, or files the user edited), then its own picks; none picks a config
twice. `suggest` does not consume: a proposer's trial (codegen.hybrid) shows the suggestion to
the proposer and may time something else instead.

How much TPE helps on spaces this small depends on their shape. On a separable synthetic cost
(tests/codegen/cost_session.py) over matmul_epilogue's 16 prefill configs it found the best
within 6 trials on 18 of seeds 0-19, random search on 9 (tests/codegen/
test_search_strategies.py); over gated_act's 17, where the keys constrain each other (warps
bounded by the block), on 5, random on 10. benchmarks/search_strategies.py measures it on a GPU.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

STRATEGIES = ("auto", "grid", "random", "tpe")
# Trials per case where the user names no budget (on a GPU). At Llama-3.2-1B's shapes the
# spaces hold 10 (gemv), 7 (decode_attention), 8 (matmul), 9 (rmsnorm), 16 (matmul_epilogue) and
# 17 (gated_act) configs: "auto" is exhaustive on the small ones and TPE on the two large.
DEFAULT_TRIALS = 10
# Configs a later run starts from, and how many of the strategy's own trials follow them
# there (codegen.search_memory): a warm case re-times what won before and explores a little.
MEMORY_TOP = 3
WARM_EXTRA = 2
FAILED = 1e9  # what a config that failed the screen is told (ms): worse than any timing


@dataclass(frozen=True)
class SearchPlan:
    """One run's search options. `trials`: configs timed per case (None: the strategy's
    default); `seconds`: no trial starts after that long on one case; `fresh`: ignore the
    remembered configs; `proposer_share`: the share of a sampled search's trials (random,
    TPE) a proposer takes when one is given (codegen.hybrid); `rank_by`: "kernel" orders
    the timed configs by their own timing (launched one by one), "graph" by their time inside
    a CUDA graph where the screen captured both (verify.timing.bench_graphed), what a graphed
    decode step pays: launch-bound kernels rank differently there (gemv's down projection
    lost to cuBLAS by 5 % launched one by one and won by 3 % in a graph, one launch fewer)."""

    strategy: str = "auto"
    trials: int | None = None
    seconds: float | None = None
    seed: int = 0
    fresh: bool = False
    proposer_share: float = 0.3
    rank_by: str = "kernel"


def resolve(plan: SearchPlan, size: int, interpreter: bool = False,
            warm: bool = False) -> tuple[str, int | None]:
    """The strategy a case runs and its trial budget (None: every config). "auto" is the grid
    where the whole space fits the budget and nothing is remembered, and on the CPU
    interpreter (its timings mean nothing); TPE elsewhere. A remembered case (`warm`) re-times
    its remembered configs and WARM_EXTRA more, unless the plan asks for the grid."""
    name = plan.strategy
    if name == "auto":
        fits = plan.trials is None and size <= DEFAULT_TRIALS or \
            plan.trials is not None and size <= plan.trials
        name = "grid" if interpreter or (fits and not warm) else "tpe"
    trials = plan.trials
    if name != "grid":
        trials = trials or DEFAULT_TRIALS
        if warm:
            trials = min(trials, MEMORY_TOP + WARM_EXTRA)
    return name, trials


ABSENT = "-"  # the level of a key a config does not have (cuBLAS has no tile sizes)


def _level(config: dict, key: str):
    v = config.get(key, ABSENT)
    return ABSENT if v is None or v is False else v


class Encoding:
    """The Optuna parameters of a config list, one per key, and the way back to its configs.
    A key whose values are integers (and, where some config lacks it, "absent" below them) or
    a flag (True or absent) is ordinal: TPE's kernels then see 64 between 32 and 128. Any
    other key (a string such as `impl`) is categorical."""

    def __init__(self, configs: list[dict]) -> None:
        import optuna

        dist = optuna.distributions
        self.levels: dict[str, list] = {}
        self.ordinal: set[str] = set()
        for key in sorted({k for c in configs for k in c}):
            values = list(dict.fromkeys(_level(c, key) for c in configs))
            present = [v for v in values if v != ABSENT]
            if all(isinstance(v, int) for v in present):  # ints and flags (bool is an int)
                self.levels[key] = ([ABSENT] if ABSENT in values else []) + sorted(present)
                self.ordinal.add(key)
            else:
                self.levels[key] = sorted(values, key=json.dumps)
        self.distributions = {
            k: dist.IntDistribution(0, len(v) - 1) if k in self.ordinal
            else dist.CategoricalDistribution([json.dumps(x) for x in v])
            for k, v in self.levels.items() if len(v) > 1}

    def params(self, config: dict) -> dict:
        return {k: self.levels[k].index(_level(config, k)) if k in self.ordinal
                else json.dumps(_level(config, k)) for k in self.distributions}

    def nearest(self, point: dict, candidates: list[dict]) -> dict:
        """The candidate closest to a sampled point, each key weighing the same (ties: the
        earlier in the list)."""
        def distance(c):
            mine = self.params(c)
            return sum(abs(mine[k] - point[k]) / (len(self.levels[k]) - 1)
                       if k in self.ordinal else float(mine[k] != point[k])
                       for k in self.distributions)

        return min(candidates, key=distance)


class Strategy:
    """Seeds first, then `_pick` (the strategy's own choice among the untried configs)."""

    name = "strategy"
    adaptive = False  # whether a pick depends on the times told so far

    def __init__(self, configs: list[dict], trials: int | None, seed: int = 0,
                 seeds: list[dict] | None = None) -> None:
        self.configs = list(configs)
        self.budget = len(self.configs) if trials is None else min(trials, len(self.configs))
        self.seed = seed
        self.seeds = [c for c in (seeds or []) if c in self.configs]
        self.told: list[tuple[dict, float | None]] = []

    def tried(self, config: dict) -> bool:
        return any(c == config for c, _ in self.told)

    def untried(self) -> list[dict]:
        return [c for c in self.configs if not self.tried(c)]

    def suggest(self) -> tuple[dict, str] | None:
        """The next config and why ("memory"/"edited" seeds are labelled by the caller: here
        "seed"), or None once the budget or the space is spent."""
        if len(self.told) >= self.budget or not self.untried():
            return None
        seed = next((c for c in self.seeds if not self.tried(c)), None)
        if seed is not None:
            return seed, "seed"
        return self._pick(), self.name

    def tell(self, config: dict, median_ms: float | None) -> None:
        """What `config` measured (None: it failed the screen)."""
        self.told.append((config, median_ms))

    def planned_picks(self) -> list[tuple[dict, str]]:
        """Every pick in order, for a strategy whose picks do not depend on the times."""
        if self.adaptive:
            raise ValueError(f"{self.name} picks from the times told; ask it one at a time")
        picks: list[tuple[dict, str]] = []
        told, self.told = self.told, []
        while (pick := self.suggest()) is not None:
            picks.append(pick)
            self.told.append((pick[0], None))
        self.told = told
        return picks

    def _pick(self) -> dict:
        raise NotImplementedError


class Grid(Strategy):
    """The space in its listed order, or `trials` of it evenly spaced (codegen.search.spread)."""

    name = "grid"

    def __init__(self, configs, trials, seed=0, seeds=None, planned=None) -> None:
        super().__init__(configs, trials, seed, seeds)
        self.planned = planned if planned is not None else self.configs
        self.budget = len(self.planned) + sum(s not in self.planned for s in self.seeds)

    def untried(self) -> list[dict]:
        return [c for c in self.planned if not self.tried(c)]

    def _pick(self) -> dict:
        return self.untried()[0]


class RandomSearch(Strategy):
    """A seeded random order of the space."""

    name = "random"

    def __init__(self, configs, trials, seed=0, seeds=None) -> None:
        super().__init__(configs, trials, seed, seeds)
        self.order = random.Random(seed).sample(self.configs, len(self.configs))

    def _pick(self) -> dict:
        return next(c for c in self.order if not self.tried(c))


class TPE(Strategy):
    """Optuna's TPE sampler over the space's encoding, seeded."""

    name = "tpe"
    adaptive = True

    def __init__(self, configs, trials, seed=0, seeds=None) -> None:
        import optuna

        super().__init__(configs, trials, seed, seeds)
        optuna.logging.set_verbosity(optuna.logging.ERROR)
        self.encoding = Encoding(self.configs)
        # the spaces are small (7-17 configs at real shapes): TPE models after two random
        # trials, not Optuna's ten, which would be more than the whole default budget
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=min(2, self.budget))
        self.study = optuna.create_study(direction="minimize", sampler=sampler)

    def _pick(self) -> dict:
        from optuna.trial import TrialState

        dists = self.encoding.distributions
        if not dists:
            return self.untried()[0]
        trial = self.study.ask(dict(dists))
        point = {k: trial.params[k] for k in dists}
        # the asked point is only a direction; what ran is told with its own encoding
        self.study.tell(trial, state=TrialState.FAIL)
        return self.encoding.nearest(point, self.untried())

    def tell(self, config: dict, median_ms: float | None) -> None:
        import optuna

        super().tell(config, median_ms)
        if not self.encoding.distributions:
            return
        value = FAILED if median_ms is None else median_ms
        self.study.add_trial(optuna.trial.create_trial(
            params=self.encoding.params(config), distributions=dict(self.encoding.distributions),
            value=value))

    def state(self) -> dict:
        """What the model works on, for a proposer: the encoding of the space."""
        return {"sampler": "optuna TPESampler", "seed": self.seed,
                "levels": self.encoding.levels}


def make(name: str, configs: list[dict], trials: int | None, seed: int = 0,
         seeds: list[dict] | None = None, planned: list[dict] | None = None) -> Strategy:
    """`planned`: the grid's configs when its budget spreads it (codegen.search.spread)."""
    if name == "grid":
        return Grid(configs, trials, seed, seeds, planned)
    if name == "random":
        return RandomSearch(configs, trials, seed, seeds)
    if name == "tpe":
        return TPE(configs, trials, seed, seeds)
    raise ValueError(f"unknown search strategy {name!r}; known: {', '.join(STRATEGIES)}")
