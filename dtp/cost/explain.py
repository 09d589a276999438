"""`dtp explain`: where every parameter lives under a plan, and what that costs per rank."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from dtp.checks.checker import Checked
from dtp.cost.param_bytes import ideal_param_bytes, param_bytes_per_rank
from dtp.cost.schedule import Collective, NotModeled, schedule, summarize
from dtp.lang.vocabulary import slice_names
from dtp.layout.placement import ParamPlacement
from dtp.layout.resolve import generic_path
from dtp.layout.styles import Style


@dataclass(frozen=True)
class ParamRow:
    """One parameter under the plan."""

    name: str
    module: str
    module_type: str
    rule: str  # "file:line" of the claiming rule, or "-"
    style: str  # the plan style, or "-" for untouched
    placement: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    bytes_per_rank: int  # rank 0's (the largest when shards are uneven)
    tied_with: tuple[str, ...]
    uneven: bool = False  # shards differ in size: the last ranks hold fewer rows


@dataclass(frozen=True)
class Explanation:
    """Every parameter's placement plus per-rank totals."""

    plan_name: str | None
    plan_version: int | None
    plan_file: str
    model: str
    tp: int
    dtype: str
    rows: tuple[ParamRow, ...]
    bytes_unsharded: int
    bytes_per_rank: int
    ideal_bytes_per_rank: int  # replicated + sharded / tp
    untouched: tuple[str, ...]  # modules with parameters that no sharding rule claims (grouped)
    batch: int = 1
    seq: int = 1
    # None: a layout the analytic model does not cover
    schedule: tuple[Collective, ...] | None = None
    schedule_summary: dict | None = None
    not_modeled: str | None = None
    # slice_input: "module: inputs at dim D", grouped (no communication)
    sliced_inputs: tuple[str, ...] = ()

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def _group_paths(paths: list[str]) -> tuple[str, ...]:
    # transformer.h.0.ln_1 … transformer.h.71.ln_1 → "transformer.h.*.ln_1 (×72)"
    counts = Counter(generic_path(p) for p in paths)
    return tuple(f"{k} (×{n})" if n > 1 else k for k, n in counts.items())


def explain(
    checked: Checked,
    model: nn.Module,
    model_name: str,
    tp: int,
    *,
    dtype: torch.dtype = torch.float32,
    batch: int = 1,
    seq: int = 1024,
    dp: int = 1,
    checkpoint_activations: bool = False,
) -> Explanation:
    """Tabulate `model`'s parameters under the checked plan at `tp` (the model may be on meta), and
    the collectives of one training step on `batch` × `seq` tokens (block forwards recomputed in
    backward with `checkpoint_activations`)."""
    res = checked.resolution
    assert res is not None, "explain needs a plan checked against a model"
    elem = torch.empty((), dtype=dtype).element_size()
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)
    rows: list[ParamRow] = []
    untouched: list[str] = []
    for path, module in res.modules.items():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        rule = res.claims.get(path)
        style = rule.style.name if rule else None
        placements = res.placements(path)
        if style in (None, Style.REPLICATE):
            untouched.append(path)
        for pname, p in own:
            full = f"{path}.{pname}" if path else pname
            names = aliases[id(p)]
            if names[0] != full:
                continue  # a tied parameter is listed once, under its first name
            placement: ParamPlacement = placements[pname]
            shape = tuple(p.shape)
            local = placement.local_shape(shape, tp)
            local_bytes = int(torch.Size(local).numel()) * elem
            rows.append(
                ParamRow(
                    full,
                    path,
                    type(module).__name__,
                    f"{rule.pos.file}:{rule.pos.line}" if rule else "-",
                    style or "-",
                    str(placement),
                    shape,
                    local,
                    local_bytes,
                    tuple(names[1:]),
                    placement.is_uneven(shape, tp),
                )
            )
    sliced = [
        f"{path}: {', '.join(slice_names(rule.style))} at dim {rule.style.option('dim', 0)}"
        for path, rule in res.claims.items()
        if rule.style.name == Style.SLICE_INPUT
    ]
    plan = checked.plan
    try:
        steps, not_modeled = (
            tuple(
                schedule(
                    checked,
                    tp,
                    batch,
                    seq,
                    dtype=dtype,
                    dp=dp,
                    model=model,
                    checkpoint_activations=checkpoint_activations,
                )
            ),
            None,
        )
    except NotModeled as err:
        steps, not_modeled = None, str(err)
    return Explanation(
        plan.name,
        plan.plan_version,
        plan.file,
        model_name,
        tp,
        str(dtype).replace("torch.", ""),
        tuple(rows),
        param_bytes_per_rank(checked, model, 1, 1, elem)[0],
        param_bytes_per_rank(checked, model, tp, 1, elem)[0],
        ideal_param_bytes(checked, model, tp, 1, elem),
        _group_paths(untouched),
        batch,
        seq,
        steps,
        summarize(list(steps), tp, dp) if steps is not None else None,
        not_modeled,
        _group_paths(sliced),
    )


def human_bytes(n: float) -> str:
    """1536 → '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _shape(s: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, s)) + ")"


def render(ex: Explanation) -> str:
    """The human table."""
    header = ("parameter", "rule", "style", "placement", "shape", "per rank", "bytes/rank")
    body = [
        (
            r.name + (f" = {', '.join(r.tied_with)}" if r.tied_with else ""),
            r.rule.rsplit("/", 1)[-1],
            r.style,
            r.placement,
            _shape(r.shape),
            _shape(r.local_shape) + ("*" if r.uneven else ""),
            human_bytes(r.bytes_per_rank),
        )
        for r in ex.rows
    ]
    widths = [max(len(row[i]) for row in [header, *body]) for i in range(len(header))]
    fmt = "  ".join(f"{{:{'>' if i == 6 else '<'}{w}}}" for i, w in enumerate(widths))
    title = f"plan {ex.plan_name or '(unnamed)'}" + (
        f" version {ex.plan_version}" if ex.plan_version is not None else ""
    )
    lines = [
        f"{title} ({ex.plan_file}) on {ex.model}, tp={ex.tp}, {ex.dtype}",
        "",
        fmt.format(*header),
        fmt.format(*("-" * w for w in widths)),
    ]
    lines += [fmt.format(*row) for row in body]
    lines += [
        "",
        f"parameters, unsharded:      {human_bytes(ex.bytes_unsharded):>12}  ({ex.bytes_unsharded} "
        "B)",
        f"parameters on rank 0:       {human_bytes(ex.bytes_per_rank):>12}  ({ex.bytes_per_rank} "
        "B)",
        f"ideal per rank (repl + shard/tp): {human_bytes(ex.ideal_bytes_per_rank):>6}  "
        f"({ex.ideal_bytes_per_rank} B)",
    ]
    if any(r.uneven for r in ex.rows):
        lines.append(
            "* uneven shards (torch.chunk layout): rank 0's shape shown; the last ranks hold fewer "
            "rows"
        )
    if ex.untouched:
        lines.append("untouched by any sharding rule (replicated): " + ", ".join(ex.untouched))
    if ex.sliced_inputs:
        lines.append(
            "inputs cut to each rank's heads (slice_input, no communication): "
            + "; ".join(ex.sliced_inputs)
        )
    lines += [
        "",
        f"communication per training step (batch {ex.batch} × seq {ex.seq} per data-parallel rank, "
        "analytic):",
    ]
    if ex.schedule is None:
        lines.append(f"  not modeled: {ex.not_modeled}")
        return "\n".join(lines)
    if not ex.schedule and ex.tp == 1:
        lines.append(
            "  tp 1: apply and train run the model as plain PyTorch (no DTensor), so nothing is "
            "communicated"
        )
    groups: dict[tuple, list[Collective]] = {}
    for c in ex.schedule:  # one line per kind of collective, layers folded together
        key = (c.phase, c.op, generic_path(c.module), c.reason, c.buffer_bytes)
        groups.setdefault(key, []).append(c)
    for (phase, op, module, reason, nbytes), cs in groups.items():
        lines.append(
            f"  {phase:<8} {len(cs):>4} × {op:<14} {human_bytes(nbytes):>10}  {module}: {reason}"
        )
    summary = ex.schedule_summary
    ops = ", ".join(f"{n} {op}" for op, n in sorted(summary["by_op"].items())) or "none"
    sent = sum(summary["sent_bytes"].values())
    lines.append(
        f"  total: {summary['total']} collectives ({ops}); {human_bytes(sent)} sent per rank (ring)"
    )
    return "\n".join(lines)
