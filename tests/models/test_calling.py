"""How dtp calls a model the field wrote (dtp/models/calling.py), the copies its references are
(clone.py), and casts that keep complex buffers (spec.cast)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from fixtures import field_models

from dtp.errors import UsageError
from dtp.models import calling, cast
from dtp.models.clone import clone

IDS = torch.randint(0, field_models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def test_nanogpt_is_called_with_targets_and_stopped_at_its_head():
    """Without targets nanoGPT returns the last position's logits only; with them, (logits, loss):
    dtp calls it with targets, takes output[0], and ends the forward at lm_head so its own loss
    (which would view the sharded logits whole) never runs."""
    torch.manual_seed(0)
    model = field_models.nanogpt()
    forward = calling.discover(model, field_models.VOCAB, "nanogpt")
    assert forward == calling.Forward(targets="targets", path=(0,), stop="lm_head")
    logits = forward(model, IDS, IDS)
    assert torch.equal(logits, model(IDS, IDS)[0]) and logits.shape == (2, 8, field_models.VOCAB)


def test_positions_dict_and_plain_outputs():
    assert calling.discover(field_models.gptfast(), field_models.VOCAB, "g") == calling.Forward(
        positions="input_pos"
    )
    assert calling.discover(field_models.partial_bound(), field_models.VOCAB, "p").path == (
        "logits",
    )
    # minGPT gives every position's logits without targets: output[0], and the forward runs to its
    # end
    assert calling.discover(field_models.mingpt(), field_models.VOCAB, "m") == calling.Forward(
        path=(0,)
    )
    model = field_models.gptfast()
    out = calling.discover(model, field_models.VOCAB, "g")(model, IDS)
    assert torch.equal(out, model(IDS, input_pos=torch.arange(8)))


@dataclass
class _Out:
    loss: torch.Tensor | None
    scores: torch.Tensor


class _Dataclass(nn.Module):
    def __init__(self, last_only: bool = False):
        super().__init__()
        self.embed, self.head, self.last_only = nn.Embedding(64, 8), nn.Linear(8, 64), last_only

    def forward(self, ids: torch.Tensor) -> _Out:
        h = self.embed(ids)
        return _Out(None, self.head(h[:, -1:] if self.last_only else h))


def test_a_dataclass_output_and_a_last_position_only_model():
    assert calling.discover(_Dataclass(), 64, "d").path == ("scores",)
    with pytest.raises(UsageError) as err:
        calling.discover(_Dataclass(last_only=True), 64, "last")
    assert str(err.value) == (
        "model last returns logits for only some positions (output.scores has shape (2, 1, 64) "
        "for 2×4 token ids); dtp compares the logits of every position, so make the forward "
        "return them (nanoGPT returns them when it is given targets)"
    )


def test_clone_follows_lambdas_partials_and_bound_methods():
    """minGPT's `self.mlpf` lambda, a `functools.partial` over a ModuleDict and a bound method held
    by another module: deepcopy would leave each calling the original's weights; the clone calls its
    own."""
    for factory, x in ((field_models.mingpt, IDS), (field_models.partial_bound, IDS)):
        torch.manual_seed(0)
        model = factory()
        twin = clone(model)
        before = calling.candidates(model(x), field_models.VOCAB)[0][1].detach().clone()
        with torch.no_grad():
            for p in twin.parameters():
                p.add_(1.0)
        after = calling.candidates(model(x), field_models.VOCAB)[0][1]
        changed = calling.candidates(twin(x), field_models.VOCAB)[0][1]
        assert torch.equal(before, after)  # the original is untouched by the twin's weights
        # the twin runs its own (every path: lambda, partial, method)
        assert not torch.allclose(changed, before)
    model = field_models.partial_bound()
    twin = clone(model)
    assert twin.project.__self__ is twin.heads and twin.steps[0].args[0] is twin.blocks["block0"]
    assert field_models.mingpt().transformer.h[0].mlpf.__closure__[0].cell_contents is not None
    block = clone(field_models.mingpt()).transformer.h[0]
    assert block.mlpf.__closure__[0].cell_contents is block.mlp


def test_cast_keeps_complex_buffers_complex():
    """torchtitan's rotary `freqs_cis` is complex64: `.to(float64)` would drop its imaginary part."""
    model = field_models.titan()
    before = model.freqs_cis.clone()
    cast(model, torch.float64)
    assert (
        model.freqs_cis.dtype == torch.complex128
        and model.tok_embeddings.weight.dtype == torch.float64
    )
    assert torch.equal(model.freqs_cis.imag.float(), before.imag) and before.imag.abs().max() > 0.5
