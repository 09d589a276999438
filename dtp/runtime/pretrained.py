"""The third filler of a sharded model (dtp.runtime.build): a pretrained Hugging Face directory's
weights, each rank reading only the rows it holds.

Every parameter is seen through its index map (dtp.runtime.rows.ParamLayout): a replicated one is
read whole, a sharded one as the model-layout rows `lay.rows(tp_rank)` of `lay.dim` (packed parts
included), one `get_slice(name)[start:stop]` per contiguous run, so no rank ever holds more than its
shards plus one tensor's slice in flight. Buffers keep the values the model's __init__ computed
(allocate put them back).
"""

from __future__ import annotations

import torch

from dtp.models.pretrained import Weights, aliases
from dtp.runtime.rows import param_layouts
from dtp.runtime.shard import Applied


@torch.no_grad()
def fill_pretrained(applied: Applied, directory: str) -> None:
    """Fill this rank's shards of `applied.model` from the safetensors files of `directory`,
    converted to each parameter's dtype; a missing or mis-shaped tensor is a UsageError (the same on
    every rank, before any collective)."""
    names = aliases(applied.model)
    with Weights(directory) as weights:
        for lay in param_layouts(applied):
            name = weights.find(names.get(lay.name, [lay.name]), lay.shape)
            if lay.dim is None:
                lay.local.copy_(weights.read(name))
                continue
            rank = lay.param.device_mesh.get_local_rank()
            lay.local.copy_(weights.read(name, lay.dim, lay.rows(rank)))
