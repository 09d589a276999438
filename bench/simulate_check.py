"""`python bench/simulate_check.py OUT_DIR` (a lab script, not part of the package): calibrate this
machine (microbenchmarks only: dtp.simulate.calibrate), then run `dtp apply` (plans/gpt2.tp, fp32,
SGD, batch 8 × 128, ranks on one thread each, as the calibration measures) at tp 1, 2, 4 on three
GPT sizes (two small ones, where per-op costs weigh, and GPT-2 small's dimensions: 12 layers, width
768, its 50,257-token vocabulary) and set `dtp simulate`'s prediction next to each measured step
time and activation size, with the 1-minute load average before and after every row (and before the
calibration). Nothing is fitted to the measured rows. The CPU share the ranks got (their CPU seconds
÷ wall seconds × busy cores) scales a second column, kept for comparison with earlier runs: at tp >
1 a rank waiting in gloo uses no CPU, so that share is low on an idle machine too. Its report:
bench/results/simulate-vs-apply_cpu-2core_2026-12-04_dtp.md."""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from pathlib import Path

from dtp.simulate.calibrate import profile_yaml
from dtp.simulate.memory import activation_bytes
from dtp.simulate.model import Run, simulate
from dtp.simulate.prepare import Prepared
from dtp.simulate.profile import parse
from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

MODELS = {
    "gpt-4x256": dict(n_layer=4, n_head=4, n_embd=256, vocab_size=4096),
    "gpt-4x512": dict(n_layer=4, n_head=8, n_embd=512, vocab_size=8192),
    "gpt2-small": dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257),
}
BATCH, SEQ = 8, 128
# the checkout's, whatever the cwd
PLAN = str(Path(__file__).resolve().parents[1] / "plans" / "gpt2.tp")


def main(out: str) -> None:
    """Measure, predict, write Markdown and JSON under `out`."""
    Path(out).mkdir(parents=True, exist_ok=True)
    # One intra-op thread per rank, as the calibration measures (tp 1 would otherwise take both
    # cores).
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    calibration_load = os.getloadavg()[0]
    text, raw = profile_yaml("this-machine")
    Path(out, "this-machine.yaml").write_text(text)
    prof = parse(text, "this-machine")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in MODELS.items():
            spec = Path(tmp, f"{name}.yaml")
            spec.write_text(
                "".join(
                    f"{k}: {v}\n" for k, v in {**cfg, "block_size": SEQ, "dropout": 0.0}.items()
                )
            )
            prepared = Prepared(PLAN, str(spec), SEQ)
            for tp in (1, 2, 4):
                load = os.getloadavg()[0]
                before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
                report = launch_apply(
                    RunConfig(
                        plan=PLAN,
                        model=str(spec),
                        tp=tp,
                        batch=BATCH,
                        seq=SEQ,
                        steps=5,
                        timeout=900,
                    )
                )
                share = _cpu_share(before, time.perf_counter() - t0, min(tp, os.cpu_count() or 1))
                load_after = os.getloadavg()[0]
                work = prepared.workload(tp, BATCH, "fp32")
                sim = simulate(work, Run(tp, 1, BATCH, BATCH, SEQ, "fp32", "none", "sgd"), prof)
                acts = activation_bytes(
                    work.shape, BATCH, SEQ, tp, elem=4, recompute="none", dropout=False, flash=True
                )
                rows.append(
                    {
                        "model": name,
                        "tp": tp,
                        "load": load,
                        "load_after": load_after,
                        "measured_ms": report.step_time_ms,
                        "optimizer_ms": sim.optimizer_s * 1e3,
                        "predicted_ms": sim.iteration_s * 1e3,
                        "compute_ms": sim.compute_s * 1e3,
                        "tp_comm_ms": sim.tp_comm_s * 1e3,
                        "cpu_share": share,
                        "adjusted_ms": sim.iteration_s * 1e3 / share,
                        "measured_activation_bytes": report.activation_bytes_per_rank[0],
                        "predicted_activation_bytes": acts,
                    }
                )
                print(rows[-1], flush=True)
    lines = [
        f"calibration at load average {calibration_load:.2f}; ranks on "
        f"{os.environ['OMP_NUM_THREADS']} thread(s)",
        "",
        "| model | tp | load avg before → after | measured ms | predicted ms (compute + TP comm + "
        "optimizer) | error "
        "| CPU share | predicted ÷ share | error | activations measured → predicted |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['load']:.2f} → {r['load_after']:.2f} | "
            f"{r['measured_ms']:.0f} "
            f"| {r['predicted_ms']:.0f} ({r['compute_ms']:.0f} + {r['tp_comm_ms']:.0f} + "
            f"{r['optimizer_ms']:.0f}) "
            f"| {100 * (r['predicted_ms'] / r['measured_ms'] - 1):+.0f} % "
            f"| {r['cpu_share']:.2f} | {r['adjusted_ms']:.0f} | "
            f"{100 * (r['adjusted_ms'] / r['measured_ms'] - 1):+.0f} % "
            f"| {r['measured_activation_bytes'] / 2**20:.1f} → "
            f"{r['predicted_activation_bytes'] / 2**20:.1f} MiB |"
        )
    Path(out, "this-machine.md").write_text("\n".join(lines) + "\n")
    Path(out, "this-machine.json").write_text(
        json.dumps(
            {"calibration": raw, "calibration_load": calibration_load, "rows": rows},
            indent=2,
            default=str,
        )
    )
    print("\n".join(lines))


def _cpu_share(before: resource.struct_rusage, wall: float, cores: int) -> float:
    """CPU seconds the run's ranks got ÷ what `cores` busy ranks would get in `wall` seconds: on a
    shared machine the other processes take the rest, which a calibration of rates cannot see."""
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return min(1.0, max(cpu / (wall * cores), 1e-3))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Calibrate this machine, then set dtp simulate's prediction beside "
        "dtp apply's measured steps."
    )
    parser.add_argument(
        "out", metavar="OUT_DIR", help="where the calibrated profile and the tables go"
    )
    main(parser.parse_args().out)
