"""Small statistics for timings: quantile summaries and a bootstrap confidence interval."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_STATISTICS = {"median": np.median, "mean": np.mean}


def summarize(times_ms: Sequence[float]) -> dict[str, float]:
    """Median and spread: p20/p80 and the interquartile range, min and max."""
    t = np.asarray(times_ms, dtype=float)
    p20, q25, p50, q75, p80 = np.quantile(t, [0.2, 0.25, 0.5, 0.75, 0.8])
    return {"median_ms": float(p50), "p20_ms": float(p20), "p80_ms": float(p80),
            "iqr_ms": float(q75 - q25), "min_ms": float(t.min()), "max_ms": float(t.max()),
            "n": int(t.size)}


def bootstrap_ci(values: Sequence[float], statistic: str = "median", confidence: float = 0.95,
                 n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """(estimate, low, high): the statistic of `values` and its percentile-bootstrap interval.

    A fixed seed makes the interval a pure function of the data, so a verdict can be reproduced
    from the recorded per-pair values.
    """
    if statistic not in _STATISTICS:
        raise ValueError(f"statistic must be one of {sorted(_STATISTICS)}, got {statistic!r}")
    v = np.asarray(values, dtype=float)
    if v.size == 0:
        raise ValueError("bootstrap of no values")
    fn = _STATISTICS[statistic]
    rng = np.random.default_rng(seed)
    # Chunked so a long series does not need an n_boot x n index matrix at once.
    chunk = max(1, 2_000_000 // v.size)
    stats = np.concatenate([
        fn(v[rng.integers(0, v.size, size=(min(chunk, n_boot - start), v.size))], axis=1)
        for start in range(0, n_boot, chunk)
    ])
    alpha = (1.0 - confidence) / 2
    low, high = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(fn(v)), float(low), float(high)
