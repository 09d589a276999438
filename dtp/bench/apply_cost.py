"""What the comparisons beyond the steps cost (dtp.verify.probes: eval and long-sequence forwards, buffers,
replicas): `dtp apply` on the Quickstart with and without them, interleaved, as a median ratio with a paired
bootstrap 95 % interval. `python -m dtp.bench.apply_cost [ROUNDS]`."""
from __future__ import annotations

import sys
import time
from dataclasses import replace

from dtp.bench.stats import interleaved_orders, median_ratio
from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

QUICKSTART = RunConfig(plan="plans/gpt2.tp", model="gpt2-tiny", tp=2)


def measure(rounds: int = 15, cfg: RunConfig = QUICKSTART) -> dict:
    """Wall seconds of whole runs (ranks started, built, stepped, compared, reported) per arm, and their ratio."""
    arms = {"with": cfg, "without": replace(cfg, probes=False)}
    times: dict[str, list[float]] = {a: [] for a in arms}
    for order in interleaved_orders(tuple(arms), rounds):
        for arm in order:
            start = time.perf_counter()
            report = launch_apply(arms[arm])
            times[arm].append(time.perf_counter() - start)
            if not report.ok:
                raise RuntimeError(f"the Quickstart failed parity in the '{arm}' arm: {report.parity['worst_tensor']}")
    return {"rounds": rounds, "seconds": times, "ratio": median_ratio(times["with"], times["without"]).to_json()}


if __name__ == "__main__":
    result = measure(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
    r = result["ratio"]
    medians = {arm: sorted(t)[len(t) // 2] for arm, t in result["seconds"].items()}
    print(f"dtp apply on the Quickstart, with ÷ without the probes: {r['value']:.3f} "
          f"[{r['low']:.3f}, {r['high']:.3f}] over {result['rounds']} interleaved rounds "
          f"(median {medians['with']:.2f} s with, {medians['without']:.2f} s without)")
