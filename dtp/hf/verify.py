"""Parity of a shipped `plans/hf/*.tp` plan on a tiny Hugging Face model, in this process's rank (no
CommDebugMode): one forward + backward of the sharded model next to an unsharded copy, every
gradient gathered and compared, and the collectives counted by dtp.runtime.comm's dispatch counter,
set against the analytic schedule; several families can run in one rank launch. As `dtp apply`'s
pre-flight does, the parent checks each plan before the ranks fork (`checked_cases`) and the ranks take it
as checked: they inherit the check, the modelling code it imported and the parser, rather than
repeating them on every rank.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from dtp.checks.checker import Checked, checked_for
from dtp.compiler.vocab_parallel import cross_entropy
from dtp.cost.schedule import schedule, summarize
from dtp.hf.plan import PLANS
from dtp.lang.parse import load as load_plan
from dtp.models import hf
from dtp.runtime.build import build_sharded
from dtp.runtime.comm import CommCounter
from dtp.runtime.preflight import trusted
from dtp.verify.parity import ParityCheck
from dtp.verify.reference import copy_in, forward_as, full_value


@dataclass(frozen=True)
class Case:
    """One family to verify: its plan (the shipped one unless named) and, where the parent checked it,
    that check (its plan at the ranks' tp)."""

    family: str
    plan_path: Path | None = None
    checked: Checked | None = None


def _plan(family: str, plan_path: Path | None):
    return load_plan(str(plan_path or PLANS / f"{hf.FAMILIES[family][0]}.tp"))


def checked_cases(items: list[str | tuple[str, Path]], tp: int) -> list[Case]:
    """In the parent, before the ranks fork: a Case per family (or (family, plan path)), its plan
    checked at `tp` against its meta model. A plan the checker refuses (or a family that does not
    build) goes unchecked to the ranks, whose check reports it with the other families' results."""
    cases = []
    for item in items:
        family, plan_path = item if isinstance(item, tuple) else (item, None)
        try:
            with torch.device("meta"):
                meta = hf.build(family)
            checked = checked_for(_plan(family, plan_path), meta, tp)
        except Exception:  # noqa: BLE001 - the rank repeats it and reports it with the others
            checked = None
        cases.append(Case(family, plan_path, checked))
    return cases


def verify(
    family: str,
    mesh,
    plan_path: Path | None = None,
    batch: int = 2,
    seq: int = 8,
    seed: int = 0,
    overrides: dict | None = None,
    checked: Checked | None = None,
) -> dict:
    """{family, ok, logits, loss, grads, worst, measured, analytic} for one family (its tiny config
    with `overrides` on top) on `mesh` (every rank). `checked`: the plan as the parent checked it at
    this tp (for this family with these overrides), only matched to this rank's model
    (dtp.runtime.preflight.trusted), and `plan_path` is not read; otherwise the rank checks the plan
    at `plan_path` (the shipped one unless named)."""
    rank = mesh.get_local_rank()
    torch.manual_seed(seed)
    # unsharded, float32: the error sharding may add is measured against its own
    reference = hf.build(family, **(overrides or {})).train()
    # the parity rule's ground truth (dtp/verify/parity.py)
    truth = copy_in(reference, torch.float64)

    # The sharded model comes from the build path `dtp apply` uses: meta → shard → blocks scattered
    # from rank 0.
    def source() -> torch.nn.Module:
        return hf.build(family, **(overrides or {}))

    with torch.device("meta"):
        meta = source()
    if checked is None:
        checked = checked_for(_plan(family, plan_path), meta, mesh.size())
    elif checked.tp != mesh.size():
        raise ValueError(f"{family}: checked at tp {checked.tp}, run at {mesh.size()}")
    else:
        checked = trusted(checked.plan, meta, mesh.size())
    applied = build_sharded(
        checked,
        source,
        mesh,
        seed=seed,
        device=torch.device("cpu"),
        dtype=None,
        full=reference if rank == 0 else None,
        from_rank0=True,
    )
    model = applied.model.train()
    vocab = model.config.vocab_size
    ids = torch.randint(
        0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed + 1)
    )
    inputs, targets = ids[:, :-1], ids[:, 1:]
    fwd, bwd = CommCounter(), CommCounter()
    with fwd:
        logits = model(inputs).logits
        loss = cross_entropy(logits, targets)
    with bwd:
        loss.backward()
    dtype = next(reference.parameters()).dtype  # a config may ask for bfloat16
    parity = ParityCheck(dtype)
    ref_logits = reference(inputs).logits
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    true_logits = forward_as(truth, torch.float64, inputs)
    true_loss = F.cross_entropy(true_logits.flatten(0, 1), targets.flatten())
    true_loss.backward()
    parity.compare("logits", "logits", full_value(logits), true_logits, ref_logits)
    parity.compare("loss", "loss", full_value(loss), true_loss, ref_loss)
    ref_params, true_params = dict(reference.named_parameters()), dict(truth.named_parameters())
    for name, p in model.named_parameters():
        got = applied.full(name, p.grad) if p.grad is not None else None
        parity.compare("grads", f"{name}.grad", got, true_params[name].grad, ref_params[name].grad)
    tp = mesh.size()
    analytic = summarize(
        schedule(
            applied.checked,
            tp,
            batch,
            seq,
            dtype=dtype,
            lowered=applied.compiled.lowered,
            plain=applied.plain,
        ),
        tp,
    )
    measured = {
        "forward": fwd.get_comm_counts(),
        "backward": bwd.get_comm_counts(),
        "bytes": dict(Counter(fwd.comm_bytes) + Counter(bwd.comm_bytes)),
    }
    report = parity.to_json()
    return {
        "family": family,
        "rank": rank,
        "ok": report["ok"],
        "worst": report["worst_tensor"],
        "errors": {q: report[q]["max_rel"] for q in ("logits", "loss", "grads")},
        "problems": [p for q in ("logits", "loss", "grads") for p in report[q]["problems"]],
        "measured": measured,
        "analytic": {
            "forward": analytic["forward"],
            "backward": analytic["backward"],
            "bytes": analytic["bytes"],
        },
    }


def verify_on_rank(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Verify every case (`checked_cases`') in turn on one tp mesh of an initialised world."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for case in cases:
        try:
            out.append(verify(case.family, mesh, case.plan_path, checked=case.checked))
        except Exception as err:  # noqa: BLE001 - one family's failure is reported with the others
            out.append(
                {
                    "family": case.family,
                    "rank": rank,
                    "ok": False,
                    "error": f"{type(err).__name__}: {err}",
                }
            )
    return out
