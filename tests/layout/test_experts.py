"""Expert layouts (dtp/layout/experts.py): Mixtral's [gate; up] experts and GPT-OSS's transposed,
interleaved experts with biases; what `check` refuses and what the HF export cannot say. Parity of
both families on ranks is in tests/hf/test_families.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

pytest.importorskip("transformers")

from conftest import dtp_cli

from dtp.checks.checker import check
from dtp.errors import PlanError
from dtp.lang.parse import load
from dtp.layout.experts import ExpertsLayout, experts_layout
from dtp.layout.placement import REPLICATE, ParamPlacement
from dtp.layout.styles import param_placements
from dtp.models import hf


class Experts(nn.Module):
    """Expert parameters of the given shapes, without transformers' layout flags."""

    def __init__(self, **shapes: tuple[int, ...]):
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


def test_the_layouts_of_transformers_expert_modules():
    module = hf.build("mixtral").model.layers[0].mlp.experts
    mixtral = experts_layout(module)
    assert mixtral == ExpertsLayout(
        experts=4, hidden=64, inter=128, transposed=False, concatenated=True
    )
    assert param_placements("experts", module) == {
        "gate_up_proj": ParamPlacement(1, 2),
        "down_proj": ParamPlacement(2),
    }
    module = hf.build("gpt_oss").model.layers[0].mlp.experts
    oss = experts_layout(module)
    assert oss == ExpertsLayout(
        experts=4, hidden=64, inter=128, transposed=True, concatenated=False
    )
    assert param_placements("experts", module) == {
        "gate_up_proj": ParamPlacement(2),
        "down_proj": ParamPlacement(1),
        "gate_up_proj_bias": ParamPlacement(1),
        "down_proj_bias": REPLICATE,
    }


def test_without_flags_the_shapes_decide_the_orientation():
    # H = 2·I, where a look at one parameter alone could not tell the two apart
    plain = experts_layout(Experts(gate_up_proj=(3, 64, 64), down_proj=(3, 64, 32)))
    assert (plain.transposed, plain.hidden, plain.inter, plain.concatenated) == (
        False,
        64,
        32,
        True,
    )
    transposed = experts_layout(Experts(gate_up_proj=(3, 64, 64), down_proj=(3, 32, 64)))
    assert (transposed.transposed, transposed.hidden, transposed.inter) == (True, 64, 32)
    biased = experts_layout(
        Experts(
            gate_up_proj=(3, 8, 12),
            down_proj=(3, 6, 8),
            gate_up_proj_bias=(3, 12),
            down_proj_bias=(3, 8),
        )
    )
    assert (biased.transposed, biased.hidden, biased.inter) == (True, 8, 6)


@pytest.mark.parametrize(
    "shapes",
    [
        # a parameter of unknown role
        dict(gate_up_proj=(3, 64, 64), down_proj=(3, 64, 32), scale=(3,)),
        # bias of the wrong width
        dict(gate_up_proj=(3, 8, 12), down_proj=(3, 6, 8), down_proj_bias=(3, 6)),
        dict(gate_up_proj=(3, 8, 12), down_proj=(2, 6, 8)),  # expert counts differ
        dict(gate_up_proj=(3, 8, 13), down_proj=(3, 6, 8)),  # no FFN dimension both agree on
        dict(gate_up_proj=(3, 8, 12)),  # no down_proj
    ],
)
def test_modules_dtp_cannot_split_have_no_layout(shapes):
    assert experts_layout(Experts(**shapes)) is None


def test_an_ffn_dimension_tp_does_not_divide_is_refused_with_its_position():
    model = hf.build("gpt_oss", intermediate_size=6)
    with pytest.raises(PlanError) as err:
        check(load("plans/hf/gpt_oss.tp"), model, 4)
    assert [f"{d.pos.line}:{d.pos.column}: {d.message}" for d in err.value.diagnostics] == [
        "23:18: model.layers.0.mlp.experts (and 1 more module): experts shards the expert FFN "
        "dimension of 6 "
        "(gate_up_proj dim 2, down_proj dim 1 in gate/up pairs) over tp=4, which does not divide "
        "it; tp values "
        "that work: 1, 2, 3, 6"
    ]
    check(load("plans/hf/gpt_oss.tp"), model, 2)  # 3 gate/up pairs per rank


def test_gpt_oss_experts_do_not_export_to_hf(repo):
    refused = dtp_cli("plan", "--to-hf", "plans/hf/gpt_oss.tp", "dtp.models.hf:gpt_oss")
    assert refused.returncode == 2 and refused.stdout == ""
    assert (
        "line 23 (model.layers.*.mlp.experts: experts): HF's moe_tp_experts splits [gate; up] "
        "experts without "
        "biases; these are gate_up_proj (E, H, 2·I), down_proj (E, I, H), gate/up interleaved, with "
        "biases"
    ) in refused.stderr
