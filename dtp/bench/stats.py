"""Statistics for interleaved timings: the order arms run in, the median ratio of two arms with a
paired bootstrap 95 % interval, and a verdict against a goal that says "not significant" when the
interval straddles it."""

from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass

import numpy as np


def interleaved_orders(
    arms: tuple[str, ...], rounds: int, warmup: int = 0
) -> list[tuple[str, ...]]:
    """The order of each round: every arm once, cycling through all orders of the arms, the timed
    rounds (those after `warmup`) starting the cycle. Over whole cycles each arm runs in each
    position, and right after each other arm, equally often, so that neither the first step after
    the barrier nor a neighbour's state left in the caches favours one arm (rotating a fixed order
    does not: with three arms each always follows the same one)."""
    cycle = list(itertools.permutations(arms))
    return [cycle[(r - warmup) % len(cycle)] for r in range(rounds)]


@dataclass(frozen=True)
class Ratio:
    """median(a) / median(b) over paired samples, with a bootstrap 95 % interval."""

    value: float
    low: float
    high: float
    samples: int
    runs: int = 1

    def to_json(self) -> dict:
        """A plain dict."""
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.value:.3f} [{self.low:.3f}, {self.high:.3f}]"


def median_ratio(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> Ratio:
    """Ratio of medians; the interval resamples rounds (pairs), since a slow round slows both arms."""
    if len(a) != len(b) or not a:
        raise ValueError("median_ratio needs two equally long, non-empty sample lists")
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    idx = np.random.default_rng(seed).integers(0, len(x), size=(resamples, len(x)))
    boot = np.median(x[idx], axis=1) / np.median(y[idx], axis=1)
    low, high = np.percentile(boot, [2.5, 97.5])
    return Ratio(statistics.median(a) / statistics.median(b), float(low), float(high), len(a))


def median_ratio_runs(
    a_runs: list[list[float]], b_runs: list[list[float]], resamples: int = 2000, seed: int = 0
) -> Ratio:
    """Over several runs: the geometric mean of each run's ratio of medians (a run's level, which
    moves with the machine's state, cancels within the run, as it would not in medians of pooled
    samples), with a two-level bootstrap interval: runs resampled, then rounds within each (the
    hierarchical bootstrap, Saravanan et al. 2020), so that the interval carries how much whole runs
    differ, not only rounds."""
    if (
        len(a_runs) != len(b_runs)
        or not a_runs
        or any(len(x) != len(y) or not x for x, y in zip(a_runs, b_runs))
    ):
        raise ValueError("median_ratio_runs needs two equally long, non-empty sample lists per run")
    runs = [
        (np.asarray(x, dtype=float), np.asarray(y, dtype=float)) for x, y in zip(a_runs, b_runs)
    ]
    rng = np.random.default_rng(seed)
    boot = np.empty(resamples)
    for i in range(resamples):
        logs = []
        for k in rng.integers(0, len(runs), size=len(runs)):
            x, y = runs[k]
            j = rng.integers(0, len(x), size=len(x))
            logs.append(np.log(np.median(x[j]) / np.median(y[j])))
        boot[i] = np.exp(np.mean(logs))
    low, high = np.percentile(boot, [2.5, 97.5])
    value = float(np.exp(np.mean([np.log(np.median(x) / np.median(y)) for x, y in runs])))
    return Ratio(value, float(low), float(high), sum(len(x) for x, _ in runs), len(runs))


def verdict(r: Ratio, low: float | None = None, high: float | None = None) -> str:
    """'met' when the whole interval lies within [low, high], 'not met' when it lies wholly outside,
    else 'not significant' (the interval covers a threshold)."""
    lo_ok = low is None or r.low >= low
    hi_ok = high is None or r.high <= high
    if lo_ok and hi_ok:
        return "met"
    if (high is not None and r.low > high) or (low is not None and r.high < low):
        return "not met"
    return "not significant"
