"""dtp's AdamW runs torch's foreach kernels on local tensors: the same update and the same state as torch's AdamW,
and the clip scales without reading the norm on the host."""
from __future__ import annotations

import pytest
import torch

from dtp.train.optim import adamw, clip_


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))


def _steps(model: torch.nn.Module, opt: torch.optim.Optimizer, clip: float | None = None) -> list[float]:
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
    ref = torch.optim.AdamW([
        {"params": [p for p in theirs.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in theirs.parameters() if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2, betas=(0.9, 0.95))
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
