"""The `dtp apply` report: one typed record of what ran and what it found (`ApplyReport`, whose
`to_json()` is `dtp apply --json`), and its human rendering."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from dtp.cost.explain import human_bytes
from dtp.verify.parity import QUANTITIES


@dataclass(frozen=True)
class ApplyReport:
    """What one `dtp apply` run did and found; the fields are the keys of its JSON."""

    plan: dict  # {name, version, file}
    model: str
    mesh: dict  # {tp, dp}
    config: dict  # the RunConfig that ran (its to_json: the plan by name)
    torch: str
    backend: str
    parity: dict  # ParityCheck.to_json(): ok, the rule, the worst tensor, margins
    collectives: dict  # measured per step: total, by_op, forward, backward, sent_bytes
    comm_bytes: int
    analytic_collectives: dict  # dtp.cost.schedule's prediction, same keys
    tied_parameters: list[list[str]]
    param_bytes_unsharded: int
    param_bytes_per_rank: list[int]
    ideal_param_bytes_per_rank: int
    activation_bytes_per_rank: list[int]
    peak_memory_kind: str  # "rss" or "cuda_max_allocated"
    peak_memory_bytes: list[int]
    step_time_ms: float  # median
    tokens_per_s: float

    @property
    def ok(self) -> bool:
        """Whether parity held."""
        return bool(self.parity["ok"])

    def to_json(self) -> dict:
        """The report as `dtp apply --json` writes it."""
        return asdict(self)


def _ops(counts: dict) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items())) or "none"


def _rule(rule: dict, dtype: str) -> str:
    if "C" not in rule:
        return f"each tensor: |sharded − unsharded| ≤ {rule['rtol']:g}·max|unsharded| + {rule['atol']:g}"
    return (
        f"each tensor: |sharded − float64| ≤ {rule['C']:g}·|unsharded {dtype} − float64| + "
        f"{rule['F']:g}·eps·max|float64|; margin = error / bound"
    )


def _why(par: dict) -> list[str]:
    """What the user should know about a failure beyond the numbers."""
    lines = []
    bad = par.get("nonfinite")
    if bad:
        lines.append(
            f"  non-finite values: {bad['tensor']} was the first tensor with NaN or inf, in the "
            f"{bad['side']}"
        )
    if par.get("dropout"):
        where = ", ".join(par["dropout"][:4]) + (
            f" and {len(par['dropout']) - 4} more" if len(par["dropout"]) > 4 else ""
        )
        lines.append(
            f"  dropout is on ({where}): masks are random, so the sharded and unsharded runs cannot "
            "agree; "
            "turn it off for a parity run (dropout 0 in the model's config, e.g. `dropout: 0` in a "
            "YAML "
            "config or config.attention_dropout=0 in a factory, or nn.Dropout(p=0))"
        )
    return lines


def _quantities(par: dict) -> list[str]:
    """One line per quantity compared, with its worst tensor and the problems found."""
    lines = []
    for q in QUANTITIES:
        d = par.get(q)
        if not d or not d["compared"]:
            continue
        mark = "ok" if d["ok"] else "FAIL"
        resolution = f"  resolution {d['resolution']:.2g}" if d.get("resolution") else ""
        lines.append(
            f"  {q:<8} {mark:<4}  max abs {d['max_abs']:.3g}  max rel {d['max_rel']:.3g}  "
            f"margin {d['margin']:.2g}{resolution}  ({d['compared']} tensors; worst "
            f"{d['worst'] or '-'})"
        )
        lines += [f"           {p}" for p in d["problems"][:5]]
    return lines


def _low_precision(par: dict, dtype: str) -> list[str]:
    """The low-precision run's own agreement, under the float32 run that decided."""
    low = par.get("low_precision")
    if not low:
        return []
    coarsest = max((low[q].get("resolution", 0.0), q) for q in QUANTITIES if q in low)
    if low["nonfinite"] is not None:
        verdict = "FAILED (non-finite values)"
    elif low["ok"]:
        verdict = f"within {dtype}'s rounding"
    else:
        proof_holds = all(par[q]["ok"] for q in QUANTITIES) and par["nonfinite"] is None
        why = (
            "the float32 run holds, so either the model takes another path in this dtype or the "
            "difference is "
            "this dtype's precision (an MoE router whose top-k choice a rounding flips)"
            if proof_holds
            else "the float32 run fails too"
        )
        verdict = (
            f"FAILED, beyond {dtype}'s rounding: margin {low[low['worst_quantity']]['margin']:.2g} "
            "at "
            f"{low['worst_tensor']}; {why}"
        )
    return [
        f"{dtype} run vs its unsharded {dtype} run: {verdict}  (the same rule in {dtype}: relative "
        "errors below "
        f"{coarsest[0]:.2g} of a tensor ({coarsest[1]}) could pass it unseen, which is why float32 "
        "decides)"
    ] + _quantities(low)


def render(report: ApplyReport) -> str:
    """A few aligned sections: what ran, parity, communication, memory, speed."""
    plan, mesh, par, coll = report.plan, report.mesh, report.parity, report.collectives
    name = plan["name"] or "(unnamed plan)"
    version = f" version {plan['version']}" if plan["version"] is not None else ""
    cfg = report.config
    lines = [
        f"dtp apply: {name}{version} ({plan['file']}) on {report.model}",
        f"  mesh tp={mesh['tp']} dp={mesh['dp']} · {report.backend} · {cfg['dtype']} · batch "
        f"{cfg['batch']} × "
        f"seq {cfg['seq']} · {cfg['steps']} SGD steps · seed {cfg['seed']} · torch {report.torch}",
        "",
        f"parity vs unsharded reference: {'OK' if par['ok'] else 'FAILED'}  "
        f"({_rule(par['rule'], par.get('decided_in', cfg['dtype']))})",
    ]
    if par.get("decided_in"):
        lines.append(
            f"  decided on a {par['decided_in']} run of the same plan; the {cfg['dtype']} run below"
        )
    lines += [f"  compared: {s}" for s in par.get("shapes", [])]
    lines += _quantities(par) + _low_precision(par, cfg["dtype"])
    if not par["ok"]:
        lines.append(f"  worst: {par['worst_tensor']} ({par['worst_quantity']})")
        lines += _why(par)
    lines += [
        "",
        f"collectives per training step: {coll['total']} ({_ops(coll['by_op'])})",
        f"  forward {_ops(coll['forward'])} · backward {_ops(coll['backward'])}",
        f"  bytes sent per rank (ring): {human_bytes(report.comm_bytes)} ({report.comm_bytes} B)",
    ]
    analytic = report.analytic_collectives
    if "not_modeled" in analytic:
        lines.append(f"  analytic schedule: not modeled ({analytic['not_modeled']})")
    elif analytic:
        same = all(analytic[k] == coll[k] for k in ("by_op", "forward", "backward", "bytes"))
        lines.append(
            f"  analytic schedule: {analytic['total']} ({_ops(analytic['by_op'])}) — "
            + ("matches the measurement" if same else "DIFFERS from the measurement")
        )
    per_rank = report.param_bytes_per_rank
    peaks = report.peak_memory_bytes
    lines += [
        "",
        f"parameters: {human_bytes(report.param_bytes_unsharded)} unsharded; per rank "
        f"{', '.join(human_bytes(b) for b in per_rank)} (ideal "
        f"{human_bytes(report.ideal_param_bytes_per_rank)})",
        "activations saved for backward per rank: "
        f"{', '.join(human_bytes(b) for b in report.activation_bytes_per_rank)}",
        f"peak memory ({report.peak_memory_kind}) per rank: "
        f"{', '.join(human_bytes(b) for b in peaks)}",
        f"step time (median): {report.step_time_ms:.1f} ms · {report.tokens_per_s:.0f} tokens/s",
    ]
    return "\n".join(lines)
