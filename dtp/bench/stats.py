"""Statistics for interleaved timings: the order arms run in, the median ratio of two arms with a paired
bootstrap 95 % interval, and a verdict against a goal that says "not significant" when the interval
straddles it."""
from __future__ import annotations

import itertools
import statistics
from dataclasses import asdict, dataclass

import numpy as np


def interleaved_orders(arms: tuple[str, ...], rounds: int, warmup: int = 0) -> list[tuple[str, ...]]:
    """The order of each round: every arm once, cycling through all orders of the arms, the timed rounds (those
    after `warmup`) starting the cycle. Over whole cycles each arm runs in each position, and right after each
    other arm, equally often, so that neither the first step after the barrier nor a neighbour's state left
    in the caches favours one arm (rotating a fixed order does not: with three arms each always follows the
    same one)."""
    cycle = list(itertools.permutations(arms))
    return [cycle[(r - warmup) % len(cycle)] for r in range(rounds)]


@dataclass(frozen=True)
class Ratio:
    """median(a) / median(b) over paired samples, with a bootstrap 95 % interval."""

    value: float
    low: float
    high: float
    samples: int

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
