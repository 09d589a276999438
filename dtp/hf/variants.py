"""Variant sweep: every config variant of `dtp.hf.variant_list` against its shipped `plans/hf/*.tp`,
at tp 2 and 4, the way a third party's checkpoint would meet it. Per variant and tp: `check` refuses
it (a clean, positioned message: acceptable where the layout cannot serve the config), or the
sharded run reaches parity with measured == analytic collectives; anything else — a traceback in
`check`, a run that crashes or hangs after `check` passed, parity failing, counts differing — is a
bug. Expensive (one rank launch per batch), so it runs outside pytest:

    python -m dtp.hf.variants [--tp 2 4] [--only SUBSTRING] [-o bench/results/hf_variants.md]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.device_mesh import init_device_mesh

from dtp.checks.checker import Checked, check
from dtp.cost.explain import explain
from dtp.errors import DtpError
from dtp.hf.plan import PLANS
from dtp.hf.variant_list import VARIANTS, Variant
from dtp.hf.verify import verify
from dtp.lang.parse import load as load_plan
from dtp.models import hf
from dtp.runtime.ranks import on_ranks

BATCH = 8  # variants per rank launch: the fork and rendezvous cost is shared


@dataclass(frozen=True)
class Outcome:
    """What one variant did at one tp: `kind` is ok, refused, or a bug kind (check-crash, run-crash,
    parity, counts, build); `detail` the message or the numbers."""

    variant: str
    tp: int
    kind: str
    detail: str

    @property
    def bug(self) -> bool:
        """True where dtp misbehaved (refusing cleanly or passing is fine)."""
        return self.kind not in ("ok", "refused", "build")


def verify_variants_on_rank(
    rank: int, world: int, items: list[tuple[str, str, dict, Checked]]
) -> list[dict]:
    """For `dtp.runtime.ranks.on_ranks`: verify each (name, family, overrides, its plan as `precheck`
    checked it) on one tp mesh, in turn."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for name, family, overrides, checked in items:
        try:
            result = verify(family, mesh, overrides=overrides, checked=checked)
        except Exception as err:  # noqa: BLE001 - one variant's failure is reported with the others
            result = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        out.append({**result, "variant": name})
    return out


def _plan(variant: Variant):
    return load_plan(str(PLANS / f"{hf.FAMILIES.get(variant.family, (variant.family,))[0]}.tp"))


def _landed(config, key: str, want) -> bool:
    """Whether override `key` = `want` shows in the built config (rotary fractions move into
    rope_parameters)."""
    if key == "attn_implementation":
        return config._attn_implementation == want
    if key == "dtype":
        return str(config.dtype).removeprefix("torch.") == want
    if key in ("rotary_pct", "partial_rotary_factor"):
        return (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor") == want
    return getattr(config, key, object()) == want


def precheck(variant: Variant, tp: int) -> Outcome | Checked:
    """The outcome decided before any rank starts (a build failure, `check` refusing or crashing),
    or the plan checked at `tp`, which the ranks take as checked."""
    try:
        model = hf.build(variant.family, **variant.overrides)
    except Exception as err:  # noqa: BLE001 - transformers rejects the config itself: not dtp's business
        return Outcome(variant.name, tp, "build", f"{type(err).__name__}: {err}")
    missed = [k for k, want in variant.overrides.items() if not _landed(model.config, k, want)]
    if missed:  # a variant whose knob did not reach the model would pass without testing anything
        return Outcome(variant.name, tp, "build", f"config ignored {missed}")
    plan = _plan(variant)
    try:
        check(plan, model)  # no tp: the admissible tp values, over every branch `when … tp` selects
    except DtpError:
        pass
    except Exception as err:  # noqa: BLE001 - a crash of the checker is what the sweep looks for
        return Outcome(variant.name, tp, "check-crash", f"(no tp) {type(err).__name__}: {err}")
    try:
        checked = check(plan, model, tp)
    except DtpError as err:
        return Outcome(variant.name, tp, "refused", str(err))
    except Exception as err:  # noqa: BLE001 - a crash of the checker is what the sweep looks for
        return Outcome(variant.name, tp, "check-crash", f"{type(err).__name__}: {err}")
    try:
        explain(checked, model, variant.name, tp, batch=2, seq=8)
    except Exception as err:  # noqa: BLE001 - a crash of explain is what the sweep looks for
        return Outcome(variant.name, tp, "check-crash", f"(explain) {type(err).__name__}: {err}")
    return checked


def judge(variant: str, tp: int, r: dict) -> Outcome:
    """One rank result as an Outcome."""
    if "error" in r:
        return Outcome(variant, tp, "run-crash", r["error"])
    errs = ", ".join(f"{q} {v:.1e}" for q, v in r["errors"].items())
    if not r["ok"]:
        return Outcome(variant, tp, "parity", f"worst {r['worst']}: {errs}; {r['problems'][:2]}")
    if r["measured"] != r["analytic"]:
        return Outcome(
            variant, tp, "counts", f"measured {r['measured']} != analytic {r['analytic']}"
        )
    counts = {ph: dict(sorted(r["measured"][ph].items())) for ph in ("forward", "backward")}
    return Outcome(variant, tp, "ok", f"{errs}; {counts}")


def run_batch(batch: list[tuple[Variant, Checked]], tp: int, timeout: float) -> list[Outcome]:
    """Run `batch` (each variant with its plan as `precheck` checked it) on tp ranks; a launch that
    fails as a whole (crash, hang) is retried one variant at a time."""
    items = [(v.name, v.family, v.overrides, checked) for v, checked in batch]
    try:
        results = on_ranks(verify_variants_on_rank, tp, items, timeout=timeout * len(batch))
    except DtpError as err:
        if len(batch) > 1:
            return [o for one in batch for o in run_batch([one], tp, timeout)]
        return [Outcome(batch[0][0].name, tp, "run-crash", f"launch failed: {err}")]
    out = []
    for i, (v, _) in enumerate(batch):
        per_rank = [judge(v.name, tp, rank_results[i]) for rank_results in results]
        out.append(next((o for o in per_rank if o.kind != "ok"), per_rank[0]))
    return out


def sweep(
    variants: list[Variant], tps: list[int], timeout: float = 120, log=print
) -> list[Outcome]:
    """Every variant at every tp: prechecked here, the rest run in batches per family."""
    outcomes: list[Outcome] = []
    for tp in tps:
        pending: list[tuple[Variant, Checked]] = []
        for v in variants:
            pre = precheck(v, tp)
            if isinstance(pre, Checked):
                pending.append((v, pre))
            else:
                outcomes.append(pre)
                log(f"tp={tp} {v.name}: {pre.kind}")
        for start in range(0, len(pending), BATCH):
            t0 = time.perf_counter()
            for o in run_batch(pending[start : start + BATCH], tp, timeout):
                outcomes.append(o)
                log(
                    f"tp={tp} {o.variant}: {o.kind}"
                    + ("" if o.kind == "ok" else f" — {o.detail[:300]}")
                )
            log(
                f"  (batch of {len(pending[start : start + BATCH])} in "
                f"{time.perf_counter() - t0:.0f} s)"
            )
    return outcomes


def _relative(text: str) -> str:
    """Plan paths in messages as the repository names them (plans/hf/…), not this checkout's
    absolute path."""
    return re.sub(r"\S*/(plans/hf/)", r"\1", text)


def table(outcomes: list[Outcome], variants: list[Variant]) -> str:
    """A markdown table: one row per variant, one column per tp."""
    tps = sorted({o.tp for o in outcomes})
    by = {(o.variant, o.tp): o for o in outcomes}
    lines = [
        "| variant | like | " + " | ".join(f"tp {t}" for t in tps) + " |",
        "|---|---|" + "---|" * len(tps),
    ]
    for v in variants:
        cells = []
        for t in tps:
            o = by.get((v.name, t))
            if o is None:
                cells.append("")
            elif o.kind == "ok":
                cells.append(
                    "ok "
                    + o.detail.split("; ", 1)[1]
                    .replace("'", "")
                    .replace("all_reduce", "AR")
                    .replace("all_gather", "AG")
                    .replace("forward", "f")
                    .replace("backward", "b")
                )
            else:
                cells.append(
                    f"**{o.kind}**: "
                    + _relative(o.detail).replace("|", "/").replace("\n", " ")[:200]
                )
        lines.append(f"| `{v.name}` | {v.like} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Run the sweep, print progress and the table; exit 1 if any variant found a bug."""
    ap = argparse.ArgumentParser(
        prog="python -m dtp.hf.variants", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--only", default="", help="run variants whose name contains this")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per variant")
    ap.add_argument("-o", "--output", type=Path, help="write the markdown table here")
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    variants = [v for v in VARIANTS if args.only in v.name]
    outcomes = sweep(variants, args.tp, args.timeout, log=lambda s: print(s, flush=True))
    text = table(outcomes, variants)
    bugs = [o for o in outcomes if o.bug]
    summary = (
        f"{len(variants)} variants × tp {args.tp}: {sum(o.kind == 'ok' for o in outcomes)} ok, "
        f"{sum(o.kind == 'refused' for o in outcomes)} refused by check, {len(bugs)} bugs\n"
    )
    print(text + summary)
    if args.output:
        args.output.write_text(text + "\n" + summary)
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
