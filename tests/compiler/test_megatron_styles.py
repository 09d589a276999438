"""dtp's Megatron styles, op by op, against DTensor's own styles on real gloo ranks (Megatron-LM's
tests/unit_tests/tensor_parallel/test_mappings.py tests each mapping on its own): f and g, the
column → row pair, the vocabulary-parallel embedding and head with the loss. Forward values, input
and parameter gradients in float64, and the collectives each phase issues, counted at the
dispatcher."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from dtp.compiler.local_params import LocalParams
from dtp.compiler.mappings import copy_to_ranks, sum_over_ranks
from dtp.compiler.megatron import MegatronColwise, MegatronRowwise
from dtp.compiler.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelHead,
    _lookup,
    cross_entropy,
)
from dtp.layout.placement import ParamPlacement
from dtp.runtime.comm import CommCounter
from dtp.runtime.ranks import on_ranks
from dtp.verify.reference import full_value

TOL = 1e-12  # float64 throughout: the two sides differ only in summation order


def _mesh(world: int):
    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def _counted(fn) -> tuple[object, dict]:
    counter = CommCounter()
    with counter:
        out = fn()
    return out, dict(counter.counts)


def _mappings(rank: int, world: int) -> dict:
    mesh = _mesh(world)
    group = mesh.get_group(0)
    torch.manual_seed(0)
    x = torch.randn(3, 4, dtype=torch.float64)
    # differs by rank
    weight = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    out = {}
    # f: identity forward, the gradient summed over ranks in backward; DTensor's Replicate → local
    # with Partial grad
    ours, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y, out["f forward"] = _counted(lambda: copy_to_ranks(ours, group))
    out["f value"] = float((y - x).abs().max())
    _, out["f backward"] = _counted(lambda: (y * weight).sum().backward())
    ref = DTensor.from_local(theirs, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()]
    )
    (ref * weight).sum().backward()
    out["f grad"] = float((ours.grad - theirs.grad).abs().max())
    # g: the sum over ranks forward, identity backward; DTensor's Partial → Replicate
    partial = x * (rank + 1)
    ours, theirs = partial.clone().requires_grad_(), partial.clone().requires_grad_()
    y, out["g forward"] = _counted(lambda: sum_over_ranks(ours * 1, group))
    ref = DTensor.from_local(theirs * 1, mesh, [Partial()], run_check=False).redistribute(
        placements=[Replicate()]
    )
    out["g value"] = float((y - ref.to_local()).abs().max())
    _, out["g backward"] = _counted(lambda: (y * weight).sum().backward())
    (ref.to_local() * weight).sum().backward()
    out["g grad"] = float((ours.grad - theirs.grad).abs().max())
    return out


def test_f_and_g_match_dtensors_redistributions_and_communicate_once_each():
    for r in on_ranks(_mappings, 2):
        assert r["f value"] == 0 and r["f grad"] < TOL and r["g value"] < TOL and r["g grad"] < TOL
        assert (r["f forward"], r["f backward"]) == ({}, {"all_reduce": 1})
        assert (r["g forward"], r["g backward"]) == ({"all_reduce": 1}, {})


class MLP(nn.Module):
    def __init__(self, width: int = 8, hidden: int = 12):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict, dict]:
    """Output, forward and backward collective counts of one step on `x` (its gradient taken too)."""
    y, forward = _counted(lambda: model(x))
    _, backward = _counted(
        lambda: (y * torch.arange(y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
    )
    return y, forward, backward


def _pair(rank: int, world: int, leaves: bool) -> dict:
    mesh = _mesh(world)
    torch.manual_seed(0)
    ours, theirs = MLP().double(), MLP().double()
    theirs.load_state_dict(ours.state_dict())
    reference = copy.deepcopy(ours)
    params = LocalParams() if leaves else None
    parallelize_module(
        ours,
        mesh,
        {
            "up": MegatronColwise({"weight": ParamPlacement(0), "bias": ParamPlacement(0)}, params),
            "down": MegatronRowwise(
                {"weight": ParamPlacement(1), "bias": ParamPlacement()}, params
            ),
        },
    )
    parallelize_module(theirs, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(2, 5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    xs = [x.clone().requires_grad_() for _ in range(3)]
    out = {"classes": (type(ours.up).__name__, type(ours.down).__name__)}
    y, out["ours forward"], out["ours backward"] = _step(ours, xs[0])
    z, out["torch forward"], out["torch backward"] = _step(theirs, xs[1])
    w, _, _ = _step(reference, xs[2])
    out["value"] = max(float((y - z).abs().max()), float((y - w).abs().max()))
    out["input grad"] = max(
        float((xs[0].grad - xs[1].grad).abs().max()), float((xs[0].grad - xs[2].grad).abs().max())
    )
    out["param grad"] = max(
        float((full_value(ours.get_parameter(n).grad) - p.grad).abs().max())
        for n, p in reference.named_parameters()
    )
    out["dtensor params"] = all(
        isinstance(p, DTensor) and isinstance(p.grad, DTensor) for p in ours.parameters()
    )
    out["placements"] = (
        ours.up.weight.placements,
        ours.down.weight.placements,
        ours.down.bias.placements,
    )
    return out


def test_column_row_pair_matches_torchs_styles_and_the_unsharded_mlp():
    """One all-reduce forward (g) and one backward (f), as torch's ColwiseParallel/RowwiseParallel
    make; the parameters stay DTensors with DTensor gradients (leaves or to_local())."""
    for leaves in (True, False):
        for r in on_ranks(_pair, 2, leaves):
            assert r["classes"] == ("ColumnParallelLinear", "RowParallelLinear")
            assert r["value"] < TOL and r["input grad"] < TOL and r["param grad"] < TOL
            assert r["dtensor params"]
            assert r["placements"] == ((Shard(0),), (Shard(1),), (Replicate(),))
            assert (r["ours forward"], r["ours backward"]) == ({"all_reduce": 1}, {"all_reduce": 1})
            assert (r["torch forward"], r["torch backward"]) == (
                {"all_reduce": 1},
                {"all_reduce": 1},
            )


class Ends(nn.Module):
    def __init__(self, vocab: int = 11, width: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, width, padding_idx=3)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))


def _ends(rank: int, world: int) -> dict:
    mesh = _mesh(world)
    torch.manual_seed(0)
    ours, theirs = Ends().double(), Ends().double()
    theirs.load_state_dict(ours.state_dict())
    reference = copy.deepcopy(ours)
    params = LocalParams()
    parallelize_module(
        ours, mesh, {"emb": VocabParallelEmbedding(params), "head": VocabParallelHead(params)}
    )
    parallelize_module(
        theirs,
        mesh,
        {
            "emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    ids = torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(1))
    ids[0, 0] = 3  # the padding row
    inputs, targets = ids[:, :-1], ids[:, 1:].clone()
    targets[1, 2] = -100  # ignored
    out = {"classes": (type(ours.emb).__name__, type(ours.head).__name__)}

    def ours_loss():
        return cross_entropy(ours(inputs), targets)

    def theirs_loss():
        with loss_parallel():
            return F.cross_entropy(theirs(inputs).flatten(0, 1), targets.flatten())

    loss, out["ours forward"] = _counted(ours_loss)
    _, out["ours backward"] = _counted(loss.backward)
    ref_loss, out["torch forward"] = _counted(theirs_loss)
    with loss_parallel():
        _, out["torch backward"] = _counted(ref_loss.backward)
    plain = F.cross_entropy(reference(inputs).flatten(0, 1), targets.flatten())
    plain.backward()
    out["loss"] = max(abs(loss.item() - ref_loss.item()), abs(loss.item() - plain.item()))
    out["logits are shards"] = ours(inputs).placements == (Shard(2),)
    out["param grad"] = max(
        float((full_value(ours.get_parameter(n).grad) - p.grad).abs().max())
        for n, p in reference.named_parameters()
    )
    out["torch param grad"] = max(
        float((full_value(theirs.get_parameter(n).grad) - p.grad).abs().max())
        for n, p in reference.named_parameters()
    )
    return out


def test_vocabulary_ends_and_loss_match_torchs_styles_and_loss_parallel():
    """Embedding: one all-reduce forward; head: its input's gradient all-reduced (f); loss: the
    three all-reduces loss_parallel makes (row maxima, sums of exponentials, target logits)."""
    for r in on_ranks(_ends, 2):
        assert r["classes"] == ("VocabParallelEmbedding", "VocabParallelLinear")
        assert r["loss"] < TOL and r["param grad"] < TOL and r["torch param grad"] < TOL
        assert r["logits are shards"]
        assert (r["ours forward"], r["ours backward"]) == ({"all_reduce": 4}, {"all_reduce": 1})
        assert r["ours forward"]["all_reduce"] == r["torch forward"]["all_reduce"]


@pytest.mark.parametrize("compiling", [False, True], ids=["index_put", "masked_fill"])
def test_ids_another_rank_owns_look_up_exact_zeros(monkeypatch, compiling):
    """The embedding's lookup on one rank's rows: ids outside them read exact zeros and send no
    gradient, though they are pointed at row 0, which here is not finite (a product with the mask
    would make them NaN). Both ways of zeroing: index_put_ for plain CPU tensors, masked_fill
    under torch.compile (and on GPUs)."""
    if compiling:
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    gen = torch.Generator().manual_seed(0)
    finite = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    for shape in ((), (5,), (2, 3), (2, 3, 4)):
        # no id inside the rows points at row 0; -3, -1, 5 and 6 belong to other ranks
        local = torch.tensor([-3, -1, 1, 2, 3, 5, 6])[torch.randint(0, 7, shape, generator=gen)]
        inside = (local >= 0) & (local < 4)
        weight = finite.clone()
        weight[0] = float("nan")
        weight.requires_grad_()
        out = _lookup(weight, local, inside, pad=None)
        out.backward(torch.ones_like(out))
        expected = torch.where(inside.unsqueeze(-1), finite[local.clamp(0, 3)], 0.0)
        assert out.shape == (*shape, 3) and torch.equal(out, expected)
        # g reduces it in place next: a view would cost autograd a copy of its base in backward
        assert not out._is_view()
        counts = torch.bincount(local[inside].flatten(), minlength=4).double()
        assert torch.equal(weight.grad, counts.unsqueeze(-1).expand(4, 3))


def _copied_and_compiled(rank: int, world: int) -> dict:
    mesh = _mesh(world)
    torch.manual_seed(0)
    model = MLP().double()
    reference = copy.deepcopy(model)
    parallelize_module(
        model,
        mesh,
        {
            "up": MegatronColwise(
                {"weight": ParamPlacement(0), "bias": ParamPlacement(0)}, LocalParams()
            ),
            "down": MegatronRowwise(
                {"weight": ParamPlacement(1), "bias": ParamPlacement()}, LocalParams()
            ),
        },
    )
    twin = copy.deepcopy(model)  # an EMA copy: its own parameters, the same group
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(2)
    x = torch.randn(2, 3, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    doubled = copy.deepcopy(reference)
    with torch.no_grad():
        for p in doubled.parameters():
            p.mul_(2)
    compiled = torch.compile(model, backend="eager")
    return {
        "twin": float((twin(x) - doubled(x)).abs().max()),
        "model": float((model(x) - reference(x)).abs().max()),
        "compiled": float((compiled(x) - reference(x)).abs().max()),
        "same group": twin.up._tp is model.up._tp,
    }


def test_a_deep_copy_computes_with_its_own_parameters_and_torch_compile_sees_through():
    for r in on_ranks(_copied_and_compiled, 2):
        assert r["twin"] < TOL and r["model"] < TOL and r["compiled"] < TOL and r["same group"]
