"""Parity on the paths users run that `model(ids)` on random ids does not: a left-padded batch
with its attention mask (and pad ids present whatever the seed), bfloat16 autocast over float32
weights, ignored labels in the loss, and data parallelism compared against one forward of the whole
batch. The planted models are in tests/fixtures/user_paths.py."""

from __future__ import annotations

import pytest
import torch
from fixtures.user_paths import PAD, PLAN, VOCAB, masked

from dtp.verify.apply import launch_apply
from dtp.verify.probes import padded_batch
from dtp.verify.rank import RunConfig, _batch

USER = "tests.fixtures.user_paths"
CPU = torch.device("cpu")


def _parity(tmp_path, model: str, plan: str = PLAN, **kw) -> dict:
    path = tmp_path / "plan.tp"
    path.write_text(plan)
    return launch_apply(RunConfig(plan=str(path), model=model, **{"tp": 2, **kw})).parity


def _failing(parity: dict) -> dict[str, str]:
    return {
        q: parity[q]["worst"]
        for q in ("logits", "loss", "grads", "params", "buffers", "probes", "replicas")
        if not parity[q]["ok"]
    }


def test_the_control_passes_every_probe_and_they_are_stated(tmp_path, repo):
    parity = _parity(tmp_path, f"{USER}:masked")
    assert parity["ok"], _failing(parity)
    assert parity["shapes"][1:] == [
        "eval, 2×16: logits",
        "eval, 2×16, left-padded: logits",
        "eval, 2×16, bfloat16 autocast: logits",
        "eval, 1×32: logits",
        "train, 1×32: logits",
        "train, 2×16, bfloat16 autocast: gradients (one forward and backward, no step)",
    ]
    # 5 probes' logits, then every parameter's gradient under autocast
    assert parity["probes"]["compared"] == 5 + len(list(masked().parameters()))


@pytest.mark.parametrize(
    ("factory", "probe"),
    [
        ("masked_wrong", "logits (eval, 2×16, left-padded)"),
        ("pad_id_wrong", "logits (eval, 2×16, left-padded)"),
        # the logits move less than bfloat16's rounding there; the gradients of q do not
        ("autocast_wrong", "layers.1.attention.wq.weight.grad (bfloat16 autocast)"),
    ],
)
def test_a_model_wrong_only_on_a_users_path_fails_there(tmp_path, repo, factory, probe):
    # a seed whose random batch holds no pad id: the steps see nothing wrong
    seed = next(s for s in range(100) if PAD not in _batch(_cfg(seed=s), None, VOCAB, CPU)[0])
    # --max-seq 16: no longer probe, whose random ids may hold a pad id too
    parity = _parity(tmp_path, f"{USER}:{factory}", seed=seed, max_seq=16)
    assert _failing(parity) == {"probes": probe}, parity["probes"]["margin"]
    print(factory, parity["probes"]["margin"])
    assert parity["probes"]["margin"] > 1


def _cfg(**kw) -> RunConfig:
    return RunConfig(plan="p.tp", plan_text="dtp 1\n", model="gpt2-tiny", **kw)


def test_padded_rows_have_different_lengths_and_always_a_pad():
    ids, mask = padded_batch(3, 16, 64, 5, torch.Generator().manual_seed(0))
    assert mask.sum(1).tolist() == [14, 11, 8]  # 2, 5 and 8 pad tokens on the left
    assert bool((ids[mask == 0] == 5).all()) and bool((mask[:, -1] == 1).all())


def test_one_label_in_eight_is_ignored_in_every_row():
    inputs, targets, mine = _batch(_cfg(batch=4, seq=16), None, 100, CPU)
    assert ((targets == -100).sum(1) == 2).all() and mine == slice(None)
    assert ((targets >= 0) & (targets < 100) | (targets == -100)).all()


def test_data_parallel_reference_is_one_forward_of_the_whole_batch(tmp_path, repo):
    # a correct model whose integer buffer counts train-mode forwards: a second reference forward
    # on rank 0's rows alone would count twice (a false failure); blocks a ModuleDict of parts
    parity = _parity(tmp_path, f"{USER}:masked", tp=1, dp=2, batch=4)
    assert parity["ok"], _failing(parity)
    assert parity["buffers"]["compared"] > 0


def test_a_batch_statistic_in_eval_is_compared_against_the_whole_batch(tmp_path, repo):
    # dp 2: each rank's rows run sharded, the references run the global batch once, as in the steps
    dp = _parity(tmp_path, f"{USER}:batch_eval", tp=1, dp=2)
    assert _failing(dp) == {"probes": "logits (eval, 1×16)"}, dp["probes"]
    assert dp["probes"]["margin"] > 100
    assert _parity(tmp_path, f"{USER}:batch_eval")["ok"]  # tp 2: every rank sees the whole batch
