"""The vocabulary-parallel ends on local tensors (dtp.compiler.vocab_parallel.py) and the
parameters' local leaves (dtp/compiler/local_params.py), on real gloo ranks against independent
references: F.cross_entropy in float64 on the whole logits, torch's own `loss_parallel`, and the
unsharded model trained step by step."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

import dtp
from dtp.compiler.vocab_parallel import IGNORE_INDEX, cross_entropy
from dtp.runtime.comm import CommCounter
from dtp.runtime.ranks import on_ranks
from dtp.verify.reference import full_value

PLAN = """dtp 1
plan tiny version 1
mesh tp
emb: vocab_parallel
head: vocab_parallel
"""


class Tiny(nn.Module):
    """An embedding with a padding row, one hidden layer, and a head (tied to the embedding or not)."""

    def __init__(self, vocab: int, tied: bool, width: int = 8, pad: int = 5):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=pad)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(ids))))


def _logits_and_targets(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 5, vocab, generator=gen, dtype=torch.float64) * 4
    targets = torch.randint(0, vocab, (3, 5), generator=gen)
    targets[0, 1] = targets[2, 4] = IGNORE_INDEX
    return logits, targets


def _losses(rank: int, world: int, vocab: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full, targets = _logits_and_targets(vocab)
    full.requires_grad_()
    truth = F.cross_entropy(full.flatten(0, 1), targets.flatten())
    (truth_grad,) = torch.autograd.grad(truth, full)
    out = {"truth": truth.item()}
    for name in ("local", "torch"):
        logits = distribute_tensor(full.detach().float(), mesh, [Shard(-1)]).requires_grad_()
        fwd, bwd = CommCounter(), CommCounter()
        with loss_parallel() if name == "torch" else torch.enable_grad():
            with fwd:
                loss = (
                    cross_entropy(logits, targets)
                    if name == "local"
                    else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                )
            # the gradient itself: accumulating an uneven Shard into a leaf DTensor gathers it on
            # torch 2.11
            with bwd:
                (grad,) = torch.autograd.grad(loss, logits)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        grad = grad.full_tensor().double()
        out[name] = {
            "loss": loss.item(),
            "grad_err": float((grad - truth_grad).abs().max()),
            "forward": (dict(fwd.counts), dict(fwd.comm_bytes)),
            "backward": dict(bwd.counts),
        }
    half = distribute_tensor(full.detach().to(torch.bfloat16), mesh, [Shard(-1)])
    out["bf16"] = cross_entropy(half, targets).item()
    out["bf16_truth"] = F.cross_entropy(
        full.to(torch.bfloat16).double().flatten(0, 1), targets.flatten()
    ).item()
    return out


def test_local_cross_entropy_matches_float64_truth_and_loss_parallel_collectives():
    for world, vocab in ((2, 12), (3, 11)):  # 11 over 3 ranks: rows 4, 4, 3 (torch.chunk's split)
        results = on_ranks(_losses, world, vocab)
        r = results[0]
        # one value on every rank
        assert all(abs(x["local"]["loss"] - r["local"]["loss"]) == 0 for x in results)
        assert abs(r["local"]["loss"] - r["truth"]) <= 1e-6 * abs(r["truth"])
        assert r["local"]["grad_err"] <= 1e-7 and r["torch"]["grad_err"] <= 1e-7
        assert abs(r["local"]["loss"] - r["torch"]["loss"]) <= 1e-6 * abs(r["truth"])
        # loss_parallel's collectives exactly: 3 all-reduces of (15, 1) float32 forward, none in
        # backward
        assert (
            r["local"]["forward"]
            == r["torch"]["forward"]
            == ({"all_reduce": 3}, {"all_reduce": 3 * 15 * 4})
        )
        assert r["local"]["backward"] == r["torch"]["backward"] == {}
        # read in float32, not bf16
        assert abs(r["bf16"] - r["bf16_truth"]) <= 1e-5 * abs(r["bf16_truth"])


def _sharded_and_reference(mesh, tied: bool, vocab: int = 12) -> tuple[nn.Module, nn.Module]:
    """A Tiny model sharded by PLAN and its unsharded twin, from the same weights."""
    torch.manual_seed(0)
    model, ref = Tiny(vocab, tied=tied), Tiny(vocab, tied=tied)
    ref.load_state_dict(model.state_dict())
    dtp.apply(dtp.parse(PLAN, "tiny.tp"), model, mesh)
    return model, ref


def _inputs_and_targets(rows: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 12, (rows, 6), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1], ids[:, 1:]


def _grad_error(model: nn.Module, ref: nn.Module) -> float:
    """The largest gradient difference between the sharded model and its unsharded twin."""
    return max(
        float((full_value(model.get_parameter(n).grad) - p.grad).abs().max())
        for n, p in ref.named_parameters()
    )


def _train(rank: int, world: int, vocab: int, tied: bool) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, ref = _sharded_and_reference(mesh, tied, vocab)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (2, 6), generator=gen) for _ in range(4)]
    for ids in batches:
        ids[0, 0] = 5  # the padding row: no gradient
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref))
    errors, counts = [], []

    def step(m, ids, local: bool) -> torch.Tensor:
        logits = m(ids[:, :-1])
        return (
            cross_entropy(logits, ids[:, 1:])
            if local
            else F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        )

    for i, ids in enumerate(batches):
        counter = CommCounter()
        with counter:
            step(model, ids, True).backward()
        step(ref, ids, False).backward()
        counts.append(dict(counter.counts))
        if i == 1:  # accumulate a second batch into the same gradients before stepping
            continue
        errors.append(_grad_error(model, ref))
        pad_grad = float(full_value(model.emb.weight.grad)[5].abs().max())
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=(i != 2))  # set_to_none, then zeroing in place once
        ref_opt.zero_grad()
    params = {n: full_value(p) for n, p in model.named_parameters()}
    param_err = max(float((params[n] - p).abs().max()) for n, p in ref.named_parameters())
    ref.load_state_dict({n: p.detach() for n, p in params.items()}, strict=False)
    model.double()  # the parameters' local tensors are replaced: the leaves must follow them
    ref.double()
    ids = batches[0][:, :-1]
    moved = float((model(ids).full_tensor() - ref(ids)).abs().max())
    return {
        "grad_err": errors,
        "param_err": param_err,
        "pad_grad": pad_grad,
        "counts": counts,
        "moved": moved,
        "tied": model.head.weight is model.emb.weight,
    }


def test_vocab_parallel_ends_train_like_the_unsharded_model():
    for world, vocab, tied in ((2, 12, True), (3, 11, False)):
        r = on_ranks(_train, world, vocab, tied)[0]
        assert r["tied"] == tied
        assert max(r["grad_err"]) <= 1e-6 and r["param_err"] <= 1e-6
        # the padding row (on rank 1 of 3) gets no gradient from the lookup
        assert tied or r["pad_grad"] == 0.0
        # embedding: 1 (forward); head: 1 (its input gradient, backward); loss: 3; tanh layer
        # replicated
        assert r["counts"] == [{"all_reduce": 5}] * 4
        assert r["moved"] <= 1e-12


def _twin(rank: int, world: int) -> dict:
    import copy

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = Tiny(12, tied=False)
    dtp.apply(dtp.parse(PLAN, "tiny.tp"), model, mesh)
    ids = torch.randint(0, 12, (2, 6), generator=torch.Generator().manual_seed(1))
    before = model(ids).full_tensor()
    twin = copy.deepcopy(model)  # an EMA copy, say: it must compute with its own parameters
    with torch.no_grad():
        twin.head.weight.zero_()
    out = twin(ids)
    cross_entropy(out, ids).backward()
    return {
        "twin": float(out.full_tensor().abs().max()),
        "original": float((model(ids).full_tensor() - before).abs().max()),
        "twin_grad": twin.head.weight.grad is not None,
        "original_grad": model.head.weight.grad is None,
    }


def test_a_deep_copy_computes_with_its_own_parameters():
    r = on_ranks(_twin, 2)[0]
    assert r == {"twin": 0.0, "original": 0.0, "twin_grad": True, "original_grad": True}


def _observed(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, ref = _sharded_and_reference(mesh, tied=False)
    x, y = _inputs_and_targets()
    errors = {}
    # what happens to the logits between the head and the loss: the loss reads the head's own local
    # tensor only when nothing can have happened to them
    for case in ("untouched", "scaled in place", "retained", "hooked"):
        logits, ref_logits = model(x), ref(x)
        if case == "scaled in place":
            logits.mul_(2)
            ref_logits = ref_logits * 2
        if case == "retained":
            logits.retain_grad()
            ref_logits.retain_grad()
        if case == "hooked":
            logits.register_hook(lambda g: g * 3)
            ref_logits.register_hook(lambda g: g * 3)
        cross_entropy(logits, y).backward()
        F.cross_entropy(ref_logits.flatten(0, 1), y.flatten()).backward()
        err = max(
            float((model.head.weight.grad.full_tensor() - ref.head.weight.grad).abs().max()),
            float((model.mid.weight.grad - ref.mid.weight.grad).abs().max()),
        )
        if case == "retained":
            err = max(err, float((logits.grad.full_tensor() - ref_logits.grad).abs().max()))
        errors[case] = err
        model.zero_grad()
        ref.zero_grad()
    return errors


def test_the_loss_sees_what_happened_to_the_logits():
    for r in on_ranks(_observed, 2):
        assert max(r.values()) <= 1e-6, r


def _accumulated(rank: int, world: int, create_graph: bool) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    errors = {}
    for tied in (False, True):
        model, ref = _sharded_and_reference(mesh, tied)
        x, y = _inputs_and_targets(rows=3)
        # gradients accumulated over three micro-batches, no zero_grad between
        for part in range(3):
            cross_entropy(model(x[part : part + 1]), y[part : part + 1]).backward(
                create_graph=create_graph
            )
            F.cross_entropy(
                ref(x[part : part + 1]).flatten(0, 1), y[part : part + 1].flatten()
            ).backward(create_graph=create_graph)
        errors[tied] = _grad_error(model, ref)
    return errors


def test_gradients_accumulate_over_backward_passes_as_unsharded():
    """Three backward passes into the same gradients, plain and under create_graph (where autograd
    accumulates out of place, into a new tensor each time): every gradient as the unsharded model's."""
    for create_graph in (False, True):
        for r in on_ranks(_accumulated, 2, create_graph):
            assert max(r.values()) <= 1e-6, (create_graph, r)


def _after_a_failed_backward(rank: int, world: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model, ref = _sharded_and_reference(mesh, tied=False)
    x, y = _inputs_and_targets()

    def fail(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("out of memory (planted)")

    # the head's leaf accumulates, then the pass raises before it ends (before the embedding's
    # gradient)
    hidden = model.mid(model.emb(x))
    hidden.register_hook(fail)
    raised = False
    try:
        cross_entropy(model.head(torch.tanh(hidden)), y).backward()
    except RuntimeError:
        raised = True
    model.zero_grad()  # the loop recovers: this step's gradients are gone
    cross_entropy(model(x), y).backward()
    F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    return {"raised": raised, "err": _grad_error(model, ref)}


def test_a_backward_pass_that_raised_leaves_no_gradient_behind():
    for r in on_ranks(_after_a_failed_backward, 2):
        assert r["raised"] and r["err"] <= 1e-6, r


def _checkpointed(rank: int, world: int) -> dict:
    from torch.utils.checkpoint import checkpoint

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    errors = {}
    # reentrant: the recomputation's backward is a pass of its own, nested
    for reentrant in (False, True):
        model, ref = _sharded_and_reference(mesh, tied=True)
        x, y = _inputs_and_targets()
        for _ in range(2):
            hidden = model.emb(x)
            logits = checkpoint(
                lambda t: model.head(torch.tanh(model.mid(t))), hidden, use_reentrant=reentrant
            )
            cross_entropy(logits, y).backward()
            F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        errors[reentrant] = _grad_error(model, ref)
    return errors


def test_checkpointed_recomputation_accumulates_as_unsharded():
    """The head recomputed in backward (a forward inside a backward pass, reading the gradients
    accumulated so far), twice without zero_grad, with torch's two checkpoint implementations."""
    for r in on_ranks(_checkpointed, 2):
        assert max(r.values()) <= 1e-6, r


def _twice(rank: int, world: int, vocab: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    full, targets = _logits_and_targets(vocab)
    truth = torch.autograd.grad(
        F.cross_entropy(full.requires_grad_().flatten(0, 1), targets.flatten()), full
    )[0]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        logits = distribute_tensor(full.detach().to(dtype), mesh, [Shard(-1)]).requires_grad_()
        loss = cross_entropy(logits, targets)
        loss.backward(retain_graph=True)  # the saved softmax is not consumed by a backward
        loss.backward()
        grad = logits.grad.full_tensor()
        out[str(dtype)] = (grad.dtype, float((grad.double() - 2 * truth).abs().max()))
    return out


def test_the_loss_backward_runs_twice_on_a_retained_graph_in_the_logits_dtype():
    r = on_ranks(_twice, 2, 12)[0]
    assert r["torch.float32"][0] == torch.float32 and r["torch.float32"][1] <= 1e-7
    # bfloat16 logits: their gradient in bfloat16 (computed in float32), within its resolution
    assert r["torch.bfloat16"][0] == torch.bfloat16 and r["torch.bfloat16"][1] <= 2e-3
