"""`dtp bench` / `python -m bench`: strong and weak scaling, ratios, plots, a dated results folder."""
from __future__ import annotations

import argparse
import datetime
import os
import json
import platform
import socket
import sys
from pathlib import Path

import torch

from bench import fuzz_speed
from bench.scaling import Config, measure
from dtp.ranks import on_ranks

TPS = (1, 2, 4)


def strong_configs(quick: bool) -> list[Config]:
    """A fixed model at tp = 1, 2, 4."""
    if quick:
        base = dict(n_layer=2, n_head=8, n_embd=256, vocab_size=2048, seq=64, batch=4, warmup=1, steps=3)
    else:
        base = dict(n_layer=4, n_head=8, n_embd=512, vocab_size=8192, seq=128, batch=8, warmup=2, steps=5)
    return [Config(tp=tp, **base) for tp in TPS]


def weak_configs(quick: bool) -> list[Config]:
    """The paper's recipe scaled down: the hidden size grows with tp (head size fixed), so per-rank work
    stays roughly constant."""
    head = 32 if quick else 64
    layers, vocab, seq, batch = (2, 2048, 64, 4) if quick else (4, 8192, 128, 8)
    steps = dict(warmup=1, steps=3) if quick else dict(warmup=2, steps=5)
    heads = {1: 4, 2: 6, 4: 8}  # n_embd ≈ 4·head·sqrt(tp), heads divisible by tp
    return [Config(n_layer=layers, n_head=heads[tp], n_embd=heads[tp] * head, vocab_size=vocab, seq=seq,
                   batch=batch, tp=tp, **steps) for tp in TPS]


def _run(configs: list[Config], progress) -> list[dict]:
    results = []
    for cfg in configs:
        results.append(on_ranks(measure, cfg.tp, cfg, timeout=1800)[0])
        progress.update(1)
    return results


def ratios(strong: list[dict], weak: list[dict]) -> dict:
    """The headline figures, each from the same run."""
    by_tp = {r["config"]["tp"]: r for r in strong}
    out = {
        "vs_megatron_step_time": {tp: r["dtp_ms"] / r["megatron_ms"] for tp, r in by_tp.items()},
        "vs_handwritten_step_time": {tp: r["dtp_ms"] / r["handwritten_ms"] for tp, r in by_tp.items()},
        "collectives_vs_analytic": {tp: r["collectives"]["total"] / max(1, r["analytic_collectives"]["total"])
                                    for tp, r in by_tp.items()},
        "param_memory_vs_ideal": {tp: r["param_bytes_per_rank"] / r["ideal_param_bytes_per_rank"]
                                  for tp, r in by_tp.items()},
        "strong_scaling_efficiency": {tp: by_tp[1]["dtp_ms"] / (tp * r["dtp_ms"]) for tp, r in by_tp.items()},
        "weak_scaling_efficiency": {r["config"]["tp"]: weak[0]["dtp_ms"] / r["dtp_ms"] for r in weak},
        "megatron_strong_scaling_efficiency": {tp: by_tp[1]["megatron_ms"] / (tp * r["megatron_ms"])
                                               for tp, r in by_tp.items()},
    }
    return out


def markdown(result: dict) -> str:
    """The results table."""
    m = result["machine"]
    lines = [f"# dtp bench — {result['date']} on {m['host']}", "",
             f"{m['cpu']} · {m['cores']} cores · torch {m['torch']} · {m['device']} (gloo) · "
             f"{'quick' if result['quick'] else 'full'} run. Ranks beyond the core count share cores.", ""]
    for kind in ("strong", "weak"):
        lines += [f"## {kind.capitalize()} scaling", "",
                  "| tp | n_embd | dtp ms | Megatron ms | hand-written ms | dtp/Megatron | dtp/hand | efficiency | "
                  "comm ms (share) | collectives (analytic) | params/rank | utilization | parity |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        eff = result["ratios"][f"{kind}_scaling_efficiency"]
        for r in result[kind]:
            c, tp = r["config"], r["config"]["tp"]
            lines.append(
                f"| {tp} | {c['n_embd']} | {r['dtp_ms']:.1f} | {r['megatron_ms']:.1f} | {r['handwritten_ms']:.1f} | "
                f"{r['dtp_ms'] / r['megatron_ms']:.2f} | {r['dtp_ms'] / r['handwritten_ms']:.2f} | "
                f"{eff[tp]:.0%} | {r['comm_ms']:.1f} ({r['comm_ms'] / r['dtp_ms']:.0%}) | "
                f"{r['collectives']['total']} ({r['analytic_collectives']['total']}) | "
                f"{r['param_bytes_per_rank'] / 2**20:.1f} MiB | {r['utilization']:.0%} | "
                f"{r['parity_vs_unsharded']:.1e} |")
        lines.append("")
    f = result.get("fuzz")
    if f:
        lines += ["## Fuzz throughput", "",
                  f"{f['pooled_examples_per_min']:.0f} examples/min through persistent rank pools "
                  f"({f['pooled_examples']} examples) vs {f['launch_per_example_examples_per_min']:.0f}/min "
                  f"launching ranks per example: {f['ratio']:.1f}×.", ""]
    return "\n".join(lines)


def plots(result: dict, out: Path) -> list[str]:
    """PNG plots: step time and efficiency vs tp, share of time in communication, memory per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    strong = result["strong"]
    tps = [r["config"]["tp"] for r in strong]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("dtp_ms", "dtp"), ("megatron_ms", "Megatron-style"), ("handwritten_ms", "hand-written")):
        ax[0].plot(tps, [r[key] for r in strong], marker="o", label=label)
    ax[0].set(xlabel="tp", ylabel="step time (ms)", title="strong scaling: step time", xticks=tps)
    ax[0].legend()
    for kind in ("strong", "weak"):
        eff = result["ratios"][f"{kind}_scaling_efficiency"]
        ax[1].plot(tps, [eff[t] for t in tps], marker="o", label=f"{kind} (dtp)")
    ax[1].axhline(0.77, ls="--", c="gray", label="Megatron paper, 8 GPUs weak: 77%")
    ax[1].set(xlabel="tp", ylabel="efficiency", title="scaling efficiency", xticks=tps, ylim=(0, 1.1))
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    names.append("scaling.png")
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].bar([str(t) for t in tps], [r["comm_ms"] / r["dtp_ms"] for r in strong])
    ax[0].set(xlabel="tp", ylabel="share of step time", title="time in communication (strong)")
    ax[1].bar([str(t) for t in tps], [r["param_bytes_per_rank"] / 2**20 for r in strong])
    ax[1].set(xlabel="tp", ylabel="MiB", title="parameters per rank (strong)")
    fig.tight_layout()
    fig.savefig(out / "comm_memory.png", dpi=100)
    names.append("comm_memory.png")
    plt.close("all")
    return names


def main(argv: list[str] | None = None) -> int:
    """Run the benchmarks and write bench/results/<date>-<host>/."""
    from tqdm import tqdm

    p = argparse.ArgumentParser(prog="dtp bench", description="scaling benchmarks next to a Megatron-style baseline")
    p.add_argument("--quick", action="store_true", help="small models, a couple of minutes on 2 cores")
    p.add_argument("--json", metavar="PATH", help="also write the whole result here")
    p.add_argument("--out", metavar="DIR", default="bench/results", help="where the dated folder goes")
    p.add_argument("--no-fuzz", action="store_true", help="skip the fuzz throughput measurement")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args(argv)
    if args.device == "cuda":
        print("error: --device cuda: the GPU benchmark (bf16 gpt2-medium at tp=1) needs a CUDA machine; this "
              "build measures gloo on CPU only", file=sys.stderr)
        return 2
    strong, weak = strong_configs(args.quick), weak_configs(args.quick)
    with tqdm(total=len(strong) + len(weak) + (0 if args.no_fuzz else 1), desc="bench", unit="run") as bar:
        result = {"strong": _run(strong, bar), "weak": _run(weak, bar)}
        if not args.no_fuzz:
            result["fuzz"] = fuzz_speed.measure(examples=20 if args.quick else 60,
                                                baseline_examples=3 if args.quick else 8)
            bar.update(1)
    now = datetime.datetime.now(datetime.timezone.utc)
    result |= {"date": now.strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick,
               "machine": {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
                           "cores": os.cpu_count(),
                           "torch": torch.__version__, "device": "cpu", "python": platform.python_version()},
               "ratios": ratios(result["strong"], result["weak"])}
    out = Path(args.out) / f"{now:%Y-%m-%d}-{socket.gethostname()}"
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2, default=str)
    (out / "result.json").write_text(text + "\n")
    (out / "results.md").write_text(markdown(result) + "\n")
    result["plots"] = plots(result, out)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(markdown(result))
    print(f"written to {out}/")
    return 0

