"""dtp's AdamW runs torch's foreach kernels on local tensors: the same update and the same state as
torch's AdamW, and the clip scales without reading the norm on the host."""

from __future__ import annotations

import pytest
import torch

from dtp.train.optim import adamw, clip_


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )


def _steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float | None = None
) -> list[float]:
    norms = []
    for s in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(s))
        model(x).pow(2).mean().backward()
        if clip is not None:
            norms.append(float(clip_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def test_local_adamw_is_torchs_adamw():
    ours, theirs = _model(), _model()
    opt = adamw(ours, 1e-2, 0.1)
    ref = torch.optim.AdamW(
        [
            {"params": [p for p in theirs.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in theirs.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        betas=(0.9, 0.95),
    )
    _steps(ours, opt)
    _steps(theirs, ref)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert opt.state[a].keys() == ref.state[b].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert float(opt.state[a]["step"]) == 3.0


def test_clip_scales_to_the_norm():
    model = _model()
    opt = adamw(model, 0.0, 0.0)
    norms = _steps(model, opt, clip=1e-3)
    assert all(n > 1e-3 for n in norms)
    model(torch.randn(5, 8)).pow(2).mean().backward()
    clip_(model.parameters(), 1e-3)
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert float(total) == pytest.approx(1e-3, rel=1e-4)


def _sgd_runs(rank: int = 0, world: int = 1) -> list[float]:
    """LocalSGD and torch's SGD from the same parameters and gradients (DTensors sharded on dim 0
    when `world` > 1): the largest parameter difference after 3 steps, per momentum configuration."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from dtp.train.optim import LocalSGD

    mesh = init_device_mesh("cpu", (world,)) if world > 1 else None
    shapes = [(8, 4), (8,), (6, 2)]

    def tensor(shape, seed):
        t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        return distribute_tensor(t, mesh, [Shard(0)]) if mesh else t

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    out = []
    for kw in (
        {},
        {"momentum": 0.9, "weight_decay": 0.1},
        {"momentum": 0.9, "dampening": 0.5},
        {"momentum": 0.8, "nesterov": True},
    ):
        runs = []
        for make in (LocalSGD, lambda ps, **k: torch.optim.SGD(ps, foreach=False, **k)):
            params = [torch.nn.Parameter(tensor(s, i)) for i, s in enumerate(shapes)]
            opt = make(params, lr=0.05, **kw)
            for step in range(3):
                for i, p in enumerate(params):
                    p.grad = tensor(p.shape, 100 * step + i)
                opt.step()
            runs.append([full(p.detach()) for p in params])
        out.append(max(float((a - b).abs().max()) for a, b in zip(*runs)))
    return out


def test_local_sgd_is_torchs_sgd():
    assert max(_sgd_runs()) <= 1e-7


def test_local_sgd_on_dtensor_parameters():
    from dtp.runtime.ranks import on_ranks

    assert max(max(r) for r in on_ranks(_sgd_runs, 2)) <= 1e-7
