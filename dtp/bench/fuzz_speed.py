"""Fuzz throughput: examples per minute through persistent rank pools, against launching ranks per
example."""

from __future__ import annotations

import time

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hseed

from dtp.fuzz.cases import zoo_cases
from dtp.fuzz.pool import Pools
from dtp.fuzz.runner import evaluate, fuzz


def measure(examples: int = 40, baseline_examples: int = 6, seed: int = 11) -> dict:
    """Pooled examples/minute, launch-per-example examples/minute, and their ratio."""
    pools = Pools()
    try:
        pooled = fuzz(zoo_cases(max_world=4), examples, seed, pools, shrink=False)
    finally:
        pools.close()
    cases = []

    @settings(
        max_examples=baseline_examples,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hseed(seed)
    @given(zoo_cases(max_world=4))
    def collect(case):
        cases.append(case)

    collect()
    start = time.monotonic()
    # a fresh set of ranks for every example: process start and process group each time
    for case in cases:
        fresh = Pools()
        try:
            evaluate(case, fresh)
        finally:
            fresh.close()
    launch_s = time.monotonic() - start
    pooled_rate = pooled.examples / pooled.seconds * 60
    launch_rate = len(cases) / launch_s * 60
    return {
        "pooled_examples_per_min": pooled_rate,
        "pooled_examples": pooled.examples,
        "launch_per_example_examples_per_min": launch_rate,
        "launch_examples": len(cases),
        "ratio": pooled_rate / launch_rate,
        "failed": pooled.counts["failed"],
    }
