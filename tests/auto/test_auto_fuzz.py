"""`dtp plan --auto` never writes a plan that fails parity.

Hypothesis draws model structures (tests/auto/strategies.py: fused or separate q/k/v, MHA/GQA/MQA,
head counts from the tensor or from attributes, q/k norms, SwiGLU/gate_up/GELU, sequential or
parallel blocks, tied heads); `auto_plan` writes each one's plan at tp 2 or 4 (a few tp-2 plans run
at tp 4 too, where their header says `dtp check` accepts them); then every plan runs on real gloo
ranks, one launch per tp for all structures together, as dtp/hf/verify.py does for the Hugging Face
families: one forward + backward of the sharded model beside the unsharded one and a float64 truth,
with the parity rule of `dtp apply` on the logits, the loss and every gradient, and the collectives
counted against the analytic schedule. A structure the planner could not split in part must still
reach parity with that part left replicated (AutoPlan.refused says which).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import asdict

import torch
import torch.nn.functional as F
from auto.strategies import cases
from fixtures.auto_models import Structure, build
from hypothesis import HealthCheck, Phase, given, settings
from torch.distributed.tensor.parallel import loss_parallel

from dtp.auto.planner import AutoPlan, auto_plan
from dtp.cost.schedule import schedule, summarize
from dtp.lang.parse import parse
from dtp.runtime.comm import CommCounter
from dtp.runtime.ranks import on_ranks
from dtp.verify.parity import ParityCheck
from dtp.verify.reference import copy_in, full_value

# drawn structures; with FIXED, about 30 structures in two launches: ~30 s on 2 CPU cores
EXAMPLES = 20
BATCH, SEQ = 2, 8
# plans written for tp 2 that also run at tp 4, the header claiming `dtp check` accepts them there
CLAIMED = 4
# Run whatever hypothesis draws: one structure for each way a plan can go wrong that the issue
# names.
FIXED = [
    (
        Structure(
            qkv="packed",
            n_head=4,
            n_kv_head=2,
            heads_from="attribute",
            mlp="gate_up",
            parallel=True,
            tied=True,
        ),
        2,
    ),
    # view(…, nh, 3, hd)
    (Structure(qkv="interleaved", n_head=4, n_kv_head=4, heads_from="attribute", bias=True), 2),
    # Falcon-40B's groups [q q q q k v], sized by n_rep
    (Structure(qkv="interleaved", n_head=8, n_kv_head=2), 2),
    # and by n_kv_head
    (Structure(qkv="interleaved", n_head=4, n_kv_head=2, heads_from="attribute", tied=True), 2),
    # [q | k | v] widths from n_rep
    (Structure(qkv="packed", n_head=4, n_kv_head=2, qk_norm=True, mlp="gelu"), 2),
    # multi-query
    (Structure(qkv="interleaved", n_head=4, n_kv_head=1, qk_norm=True, mlp="gelu", tied=True), 4),
    (
        Structure(
            qkv="separate",
            n_head=4,
            n_kv_head=2,
            heads_from="attribute",
            qk_norm=True,
            parallel=True,
        ),
        4,
    ),  # repeat(kv)
    # MLP refused, uneven vocab
    (Structure(qkv="packed", n_head=8, n_kv_head=8, mlp="gelu", intermediate=66, vocab=66), 4),
]
# The control: the first FIXED plan with gate_up's `packed=2` dropped, which `dtp check` accepts and
# which mixes gate and up features on a rank. The harness must fail it, or a pass of the auto plans
# proves nothing.
CONTROL = ("mlp.gate_up_proj: colwise(packed=2)", "mlp.gate_up_proj: colwise")


def _drawn() -> list[tuple[Structure, int]]:
    """EXAMPLES (structure, tp) pairs, the same on every run."""
    out: list[tuple[Structure, int]] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases())
    def collect(case: tuple[Structure, int]) -> None:
        out.append(case)

    collect()
    return out


def _verify(structure: dict, text: str, mesh, seed: int = 0) -> dict:
    """dtp.hf.verify.verify for a fixture structure: {ok, worst, errors, problems, measured,
    analytic} of one forward + backward of `text`'s sharded model beside the unsharded one (every
    rank)."""
    from dtp.checks.checker import check
    from dtp.runtime.build import build_sharded

    torch.manual_seed(seed)
    reference = build(structure).train()
    # the parity rule's ground truth (dtp/verify/parity.py)
    truth = copy_in(reference, torch.float64)
    with torch.device("meta"):
        meta = build(structure)
    checked = check(parse(text, "<auto>"), meta, mesh.size())
    # The build path `dtp apply` uses: meta → shard → rank 0's weights scattered.
    applied = build_sharded(
        checked,
        lambda: build(structure),
        mesh,
        seed=seed,
        device=torch.device("cpu"),
        dtype=None,
        full=reference if mesh.get_local_rank() == 0 else None,
        from_rank0=True,
    )
    model = applied.model.train()
    ids = torch.randint(
        0, structure["vocab"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed + 1)
    )
    inputs, targets = ids[:, :-1], ids[:, 1:]
    ctx = loss_parallel if applied.compiled.loss_parallel else contextlib.nullcontext
    fwd, bwd = CommCounter(), CommCounter()
    with ctx():
        with fwd:
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        with bwd:
            loss.backward()
    parity = ParityCheck(torch.float32)
    losses = {}
    for side, net in (("reference", reference), ("truth", truth)):
        out = net(inputs)
        losses[side] = (out, F.cross_entropy(out.flatten(0, 1), targets.flatten()))
        losses[side][1].backward()
    (ref_logits, ref_loss), (true_logits, true_loss) = losses["reference"], losses["truth"]
    parity.compare("logits", "logits", full_value(logits), true_logits, ref_logits)
    parity.compare("loss", "loss", full_value(loss), true_loss, ref_loss)
    ref_params, true_params = dict(reference.named_parameters()), dict(truth.named_parameters())
    for name, p in model.named_parameters():
        got = applied.full(name, p.grad) if p.grad is not None else None
        parity.compare("grads", f"{name}.grad", got, true_params[name].grad, ref_params[name].grad)
    tp = mesh.size()
    analytic = summarize(
        schedule(
            applied.checked, tp, BATCH, SEQ, dtype=torch.float32, lowered=applied.compiled.lowered
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


def verify_on_rank(rank: int, world: int, items: list[tuple[dict, str]]) -> list[dict]:
    """_verify every (structure, plan text) in turn on one tp mesh of the world; a failure is
    reported, not raised."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out = []
    for structure, text in items:
        try:
            out.append(_verify(structure, text, mesh))
        except Exception as err:  # noqa: BLE001 - one structure's failure is reported with the others
            out.append({"ok": False, "error": f"{type(err).__name__}: {err}"})
    return out


def _failure(structure: Structure, plan: AutoPlan, tp: int, result: dict) -> str | None:
    """Why `result` (of `plan` run at `tp`) fails the property, naming the structure and the plan;
    None when it holds."""
    if "error" in result:
        why = f"the run raised {result['error']}"
    elif not result["ok"]:
        why = f"parity failed: worst {result['worst']}, max rel {result['errors']}, {result['problems']}"
    elif result["measured"] != result["analytic"]:
        why = f"collectives {result['measured']} differ from the analytic schedule {result['analytic']}"
    else:
        return None
    refused = "".join(f"\n  refused: {r}" for r in plan.refused)
    replay = f"DTP_AUTO_MODEL='{structure.to_json()}' dtp plan --auto tests.fixtures.auto_models:from_env --tp {plan.tp}"
    written = "" if tp == plan.tp else f" (written for tp {plan.tp}, claimed for tp {tp})"
    return (
        f"{structure.label()} at tp {tp}{written}: {why}\n  replay: {replay}{refused}\n"
        + "".join(f"    {line}\n" for line in plan.text.splitlines())
    )


def test_auto_plans_of_drawn_structures_reach_parity():
    chosen = list(dict.fromkeys(FIXED + _drawn()))  # hypothesis may draw a structure twice
    runs: dict[int, list[tuple[Structure, AutoPlan]]] = {}  # by the tp each plan runs at
    for structure, tp in chosen:
        with torch.device("meta"):
            model = build(structure)
        plan = auto_plan(model, structure.label(), tp)
        assert tp in plan.checked_tp, (
            f"{structure.label()}: auto wrote a plan `dtp check` refuses at tp {tp}"
        )
        runs.setdefault(tp, []).append((structure, plan))
    runs.setdefault(4, []).extend([(s, p) for s, p in runs[2] if 4 in p.checked_tp][:CLAIMED])
    control_structure, control_plan = runs[2][0]
    assert CONTROL[0] in control_plan.text
    control = (asdict(control_structure), control_plan.text.replace(*CONTROL))
    failures = []
    for tp, written in sorted(runs.items()):
        items = [(asdict(s), p.text) for s, p in written] + ([control] if tp == 2 else [])
        results = on_ranks(verify_on_rank, tp, items, timeout=300)
        if tp == 2:
            assert all(not rank[-1]["ok"] and "error" not in rank[-1] for rank in results), (
                f"the harness passed a plan that mixes gate and up features: {results[0][-1]}"
            )
        for i, (structure, plan) in enumerate(written):
            why = next(
                (w for rank in results if (w := _failure(structure, plan, tp, rank[i]))), None
            )
            if why:
                failures.append(why)
    total = sum(map(len, runs.values()))
    assert not failures, f"{len(failures)} of {total} runs of auto plans fail:\n" + "\n".join(
        failures
    )
