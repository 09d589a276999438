"""`vocab_parallel`: the vocabulary split by rows, on the input embedding (each rank looks up its
own rows, the sum over ranks is the embedding) or on the output projection (logits left split by
vocabulary for the vocabulary-parallel loss)."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

from dtp.lang import ir
from dtp.layout.modules import features
from dtp.layout.placement import ParamPlacement
from dtp.layout.styles.spec import LayoutContext, ModuleLayout, Region, Style, StyleSpec, written


def _params(module: nn.Module, **_) -> dict[str, ParamPlacement]:
    return {"weight": ParamPlacement(0), "bias": ParamPlacement(0)}


def _sizes(module: nn.Module, packed: int) -> list[tuple[str, int]]:
    rows = module.num_embeddings if isinstance(module, nn.Embedding) else module.out_features
    return [(f"the vocabulary of {rows} rows (weight dim 0)", rows)]


def _layout(style: ir.Style, module: nn.Module, ctx: LayoutContext) -> ModuleLayout:
    if isinstance(module, nn.Embedding):
        return ModuleLayout(
            Style.VOCAB_PARALLEL,
            True,
            written(style, "input", Replicate()),
            written(style, "output", ctx.between),
            style.option("local", not ctx.sp),
        )
    return ModuleLayout(
        Style.VOCAB_PARALLEL, False, written(style, "input", ctx.between), Shard(-1), False
    )


def _collectives(r: Region) -> None:
    # the loss's three all-reduces are the model's (dtp/cost/schedule.py), tp 1 included
    if r.layout.embedding:
        r.leave(r.layout.output, r.module.embedding_dim)
    else:
        r.enter(features(r.module)[0])


VOCAB_PARALLEL = StyleSpec(
    Style.VOCAB_PARALLEL,
    "the vocabulary's rows split: the embedding sums over ranks, the head leaves logits split",
    params=_params,
    sizes=_sizes,
    layout=_layout,
    collectives=_collectives,
)
