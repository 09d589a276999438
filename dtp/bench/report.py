"""What a benchmark run says: headline ratios with intervals and verdicts, the Markdown tables,
plots."""

from __future__ import annotations

import datetime
import socket
import statistics
from pathlib import Path

from dtp.bench.stats import Ratio, median_ratio, median_ratio_runs, verdict

# dtp ÷ Megatron-style step time, upper end of the 95 % interval, tp ≥ 2, n_embd ≥ 512
GOAL_VS_MEGATRON = 1.05
# dtp ÷ hand-written parallelize_module: no slower (dtp's local hot path is faster)
GOAL_VS_HAND = 1.02


def _ms(r: dict, arm: str) -> float:
    return statistics.median(r["times_ms"][arm])


def _ratio(r: dict, a: str, b: str) -> Ratio:
    """Arm `a` ÷ arm `b`: over one run's rounds, or over several runs (`--repeats`) with a two-level
    interval."""
    by_run = r.get("times_ms_by_run")
    if by_run and len(by_run[a]) > 1:
        return median_ratio_runs(by_run[a], by_run[b])
    return median_ratio(r["times_ms"][a], r["times_ms"][b])


def compare(r: dict) -> dict:
    """One configuration's ratios, verdicts and independent references (Megatron's own counts and
    bytes)."""
    t, out = r["times_ms"], {}
    if "megatron" in t:
        vm = _ratio(r, "dtp", "megatron")
        applies = r["config"]["tp"] >= 2 and r["config"]["n_embd"] >= 512
        out["dtp_vs_megatron"] = vm.to_json() | {
            "verdict": verdict(vm, high=GOAL_VS_MEGATRON),
            "goal_applies": applies,
        }
    if "hand" in t:
        vh = _ratio(r, "dtp", "hand")
        out["dtp_vs_hand"] = vh.to_json() | {"verdict": verdict(vh, high=GOAL_VS_HAND)}
    if "dtp-compile" in t and "megatron" in t:
        vc = _ratio(r, "dtp-compile", "megatron")
        out["dtp_compile_vs_megatron"] = vc.to_json() | {
            "verdict": verdict(vc, high=GOAL_VS_MEGATRON)
        }
    if "megatron" in r["collectives"]:
        dtp_c, meg_c = r["collectives"]["dtp"], r["collectives"]["megatron"]
        out["collectives_equal_megatron"] = dtp_c == meg_c
        out["collectives_vs_megatron"] = sum(dtp_c.values()) / max(1, sum(meg_c.values()))
        out["comm_bytes_vs_megatron"] = sum(r["comm_bytes"]["dtp"].values()) / max(
            1, sum(r["comm_bytes"]["megatron"].values())
        )
        pb = r["param_bytes_per_rank"]
        out["param_bytes_vs_megatron"] = pb["dtp"] / pb["megatron"]
    return out


def ratios(result: dict) -> dict:
    """The headline figures, per kind of scaling and tp, each from interleaved samples of one run."""
    out: dict = {}
    peak = result["gemm_flops_single_thread"]
    for part in ("strong", "weak"):
        ok = [r for r in result[part] if r["ok"]]
        per_tp = {r["config"]["tp"]: compare(r) for r in ok}
        t1 = next((r for r in ok if r["config"]["tp"] == 1), None)
        for r in ok:
            tp, c = r["config"]["tp"], per_tp[r["config"]["tp"]]
            # strong: the same work split tp ways; weak: tp times the work in the same time
            if t1 is not None:
                scale = tp if part == "strong" else 1
                c["efficiency"] = _ms(t1, "dtp") / (scale * _ms(r, "dtp"))
            # per rank: FLOPs of a step / tp over the median step time, against one core's GEMM rate
            c["utilization"] = r["flops_per_step"] / tp / (_ms(r, "dtp") / 1e3) / peak
        out[part] = per_tp
    return out


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def _samples(r: dict) -> str:
    runs, n = r.get("runs", 1), r["config"]["samples"]
    return f"{runs} × {n}" if runs > 1 else str(n)


def _cell(c: dict, key: str) -> str:
    if key not in c:
        return "–"
    v = c[key]
    mark = (
        {"met": "", "not met": " ✗", "not significant": " ~"}[v["verdict"]]
        if v.get("goal_applies", True)
        else ""
    )
    return f"{v['value']:.2f} [{v['low']:.2f}, {v['high']:.2f}]{mark}"


def markdown(result: dict) -> str:
    """The results tables."""
    m = result["machine"]
    lines = [
        f"# dtp bench — {result['date']} on {m['host']}",
        "",
        f"{m['cpu']} · {m['cores']} cores · load average {m['load_average'][0]:.1f} at the end · "
        "torch "
        f"{m['torch']} · cpu (gloo) · {result['kind']} run · single-thread GEMM "
        f"{result['gemm_flops_single_thread'] / 1e9:.1f} GFLOP/s (measured alone). Ranks beyond the "
        "core "
        f"count share cores.",
        "",
        "Arms interleaved step by step (every order of the arms in turn), the slowest rank's time "
        "per "
        "step; ratios are of medians with a paired-bootstrap 95 % interval. ✗: the interval lies "
        "outside "
        "the goal "
        f"(dtp/Megatron ≤ {GOAL_VS_MEGATRON}, dtp/hand ≤ {GOAL_VS_HAND}); ~: not significant (the "
        "interval covers a threshold). Collectives and parameter bytes: dtp's, then the "
        "Megatron-style "
        "baseline's own count.",
        "",
    ]
    runs = max((r.get("runs", 1) for part in ("strong", "weak") for r in result[part]), default=1)
    if runs > 1:
        lines += [
            f"Each configuration ran {runs} times with fresh ranks (the configurations in turn "
            "between "
            "runs). Step times are medians of the pooled samples; a ratio is the geometric mean of "
            "the "
            "runs' own ratios of medians, its interval from a two-level bootstrap (runs resampled, "
            "then "
            "rounds within each), so it carries how much whole runs differ.",
            "",
        ]
    for part in ("strong", "weak"):
        lines += [
            f"## {part.capitalize()} scaling",
            "",
            "| tp | n_embd | samples | dtp ms | Megatron ms | hand ms | dtp/Megatron [95 %] | "
            "dtp/hand [95 %] | "
            "efficiency | comm ms | collectives dtp (Megatron) | params/rank dtp (Megatron) | "
            "utilization | "
            "parity (max rel. err) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in result[part]:
            cfg = r["config"]
            if not r["ok"]:
                lines.append(f"| {cfg['tp']} | {cfg['n_embd']} | FAILED: {r['error']} |")
                continue
            c = result["ratios"][part][cfg["tp"]]
            col = r["collectives"]
            n = lambda arm: sum(col.get(arm, {}).values())
            pb = r["param_bytes_per_rank"]
            worst = max(v for errs in r["parity"].values() for v in errs.values())
            lines.append(
                f"| {cfg['tp']} | {cfg['n_embd']} | {_samples(r)} | {_ms(r, 'dtp'):.1f} | "
                f"{_ms(r, 'megatron'):.1f} | {_ms(r, 'hand'):.1f} | {_cell(c, 'dtp_vs_megatron')} | "
                ""
                f"{_cell(c, 'dtp_vs_hand')} | {_pct(c.get('efficiency'))} | {r['comm_ms']:.1f} | "
                f"{n('dtp')} ({n('megatron')}) | {pb['dtp'] / 2**20:.2f} "
                f"({pb['megatron'] / 2**20:.2f}) MiB | "
                f"{c['utilization']:.0%} | {worst:.1e} |"
            )
            if "dtp_compile_vs_megatron" in c:
                lines.append(
                    f"|  | torch.compile |  | {_ms(r, 'dtp-compile'):.1f} |  |  | "
                    f"{_cell(c, 'dtp_compile_vs_megatron')} |  |  |  |  |  |  |  |"
                )
        lines.append("")
    f = result.get("fuzz")
    if f:
        lines += [
            "## Fuzz throughput",
            "",
            f"{f['pooled_examples_per_min']:.0f} examples/min through persistent rank pools "
            f"({f['pooled_examples']} examples) vs "
            f"{f['launch_per_example_examples_per_min']:.0f}/min "
            f"launching ranks per example: {f['ratio']:.1f}×.",
            "",
        ]
    return "\n".join(lines)


def plots(result: dict, out: Path) -> list[str]:
    """PNG plots (step time per arm vs tp; dtp/Megatron with intervals); none, with a note, without
    matplotlib."""
    try:
        import matplotlib  # optional package
    except ImportError:
        print("note: matplotlib is not installed; plots skipped (pip install matplotlib)")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional package, after use("Agg")

    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for i, part in enumerate(("strong", "weak")):
        ok = [r for r in result[part] if r["ok"]]
        tps = [r["config"]["tp"] for r in ok]
        for arm in ok[0]["times_ms"] if ok else ():
            ax[0].plot(
                tps,
                [_ms(r, arm) for r in ok],
                marker="o",
                ls="-" if part == "strong" else ":",
                label=f"{arm} ({part})",
            )
        rs = [result["ratios"][part][t]["dtp_vs_megatron"] for t in tps]
        ax[1].errorbar(
            [t + 0.05 * i for t in tps],
            [v["value"] for v in rs],
            yerr=[[v["value"] - v["low"] for v in rs], [v["high"] - v["value"] for v in rs]],
            marker="o",
            capsize=3,
            label=part,
        )
    ax[0].set(
        xlabel="tp", ylabel="median step time (ms)", title="step time", xticks=list(TPS_TICKS)
    )
    ax[0].legend(fontsize=7)
    ax[1].axhline(GOAL_VS_MEGATRON, ls="--", c="gray", label=f"goal {GOAL_VS_MEGATRON}")
    ax[1].axhline(1.0, ls=":", c="gray")
    ax[1].set(
        xlabel="tp",
        ylabel="dtp ÷ Megatron-style",
        title="ratio, 95 % interval",
        xticks=list(TPS_TICKS),
    )
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=100)
    plt.close("all")
    return ["scaling.png"]


TPS_TICKS = (1, 2, 4)


def results_folder(root: Path, kind: str, now: datetime.datetime) -> Path:
    """A new folder `<root>/<YYYYmmdd-HHMMSS>-<kind>-<host>/`; never one that exists."""
    base = f"{now:%Y%m%d-%H%M%S}-{kind}-{socket.gethostname()}"
    for n in range(100):
        out = root / (base if n == 0 else f"{base}.{n}")
        try:
            out.mkdir(parents=True, exist_ok=False)
            return out
        except FileExistsError:
            continue
    raise FileExistsError(f"no free results folder under {root} for {base}")
