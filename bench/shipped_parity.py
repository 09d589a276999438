"""Every shipped Hugging Face plan through the whole `dtp apply` (steps, probes, buffers, replicas;
bfloat16 decided on a float32 run) at tp 2 and 4, in float32 and bfloat16, on the tiny configs of
dtp.models.hf: the evidence that the proof's added comparisons pass correct plans. A family whose
heads tp does not divide is refused by `check` (exit 2) and listed so. A lab script, not part of the
package: `python bench/shipped_parity.py [OUT.md]` from a checkout with dtp installed (its report:
bench/results/apply-probes_cpu-2core_2026-12-03_dtp.md)."""

from __future__ import annotations

import sys
import time

from dtp import models
from dtp.checks.checker import check
from dtp.errors import DtpError
from dtp.hf.plan import PLANS
from dtp.lang.parse import load
from dtp.models import hf
from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig


def one(family: str, tp: int, dtype: str) -> dict:
    """One `dtp apply` of a family's shipped plan; its verdict, worst margins and resolution."""
    plan = str(PLANS / f"{hf.FAMILIES[family][0]}.tp")
    spec = f"dtp.models.hf:{family}"
    try:
        check(load(plan), models.build(models.resolve(spec), device="meta"), tp)
    except DtpError as err:
        return {
            "family": family,
            "tp": tp,
            "dtype": dtype,
            "refused": str(err).splitlines()[0][:100],
        }
    start = time.perf_counter()
    report = launch_apply(RunConfig(plan=plan, model=spec, tp=tp, dtype=dtype, timeout=600))
    par = report.parity
    worst = max(
        (par[q]["margin"], q)
        for q in ("logits", "loss", "grads", "params", "buffers", "probes")
        if q in par
    )
    return {
        "family": family,
        "tp": tp,
        "dtype": dtype,
        "ok": par["ok"],
        "margin": worst[0],
        "where": worst[1],
        "shapes": par["shapes"][1:],
        "seconds": time.perf_counter() - start,
        "low_ok": par.get("low_precision", {}).get("ok"),
    }


def main(out: str | None) -> int:
    """Run every family at tp 2 and 4 in both dtypes; print (and write) a table; 1 if any failed."""
    rows = []
    for tp in (2, 4):
        for dtype in ("float32", "bfloat16"):
            for family in hf.FAMILIES:
                try:
                    rows.append(one(family, tp, dtype))
                except Exception as err:  # noqa: BLE001 - one family's failure is a row, not the end of the run
                    rows.append(
                        {
                            "family": family,
                            "tp": tp,
                            "dtype": dtype,
                            "ok": False,
                            "error": str(err)[:200],
                        }
                    )
                r = rows[-1]
                print(r, flush=True)
    lines = [
        "| family | tp | dtype | verdict | worst margin | shapes | s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['family']} | {r['tp']} | {r['dtype']} | refused by check | | | |")
        elif "error" in r:
            lines.append(f"| {r['family']} | {r['tp']} | {r['dtype']} | ERROR {r['error']} | | | |")
        else:
            lines.append(
                f"| {r['family']} | {r['tp']} | {r['dtype']} | {'OK' if r['ok'] else 'FAILED'} | "
                f"{r['margin']:.2g} ({r['where']}) | {'; '.join(r['shapes'])} | {r['seconds']:.1f} "
                "|"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
