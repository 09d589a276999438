"""The vocabulary-parallel ends as ParallelStyles: Megatron's VocabParallelEmbedding, the output
head, and the cross-entropy over logits split by vocabulary, with DTensor parameters and no DTensor
arithmetic.

torch gives these ends as DTensor programs: RowwiseParallel on an Embedding (a masked lookup whose
partial sum is reduced), ColwiseParallel with `Shard(-1)` logits, and `loss_parallel`'s
cross-entropy. Their layouts are fixed when the plan is compiled, so, as for the column/row pairs
(dtp.compiler.megatron), the styles shard the parameters and make the modules layers that compute on
local tensors and communicate where torch's programs do, with the same all-reduces (op, count and
bytes):

- `VocabParallelEmbedding`: rows [start, start + n) of the vocabulary; ids outside them look up row
  0 and are zeroed; g on the sum (forward), nothing in backward;
- `VocabParallelHead`: f on the input, this rank's logits handed on as a `Shard(-1)` DTensor, so
  that every reader (parity, gathers, the loss) sees the global logits;
- `cross_entropy`: all-reduces of the row maxima, of the sums of exponentials and of the target
  logits (the three loss_parallel makes, at the same (N, 1) shapes); its backward is local.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from dtp.compiler.layer import TensorParallelGroup
from dtp.compiler.mappings import all_reduce, copy_to_ranks, sum_over_ranks
from dtp.compiler.megatron import LayerStyle
from dtp.layout.placement import ParamPlacement

IGNORE_INDEX = -100  # F.cross_entropy's default, which transformers' labels use


def _first_row(rows: int, mesh: DeviceMesh) -> int:
    """This rank's first of `rows` vocabulary rows split over `mesh` (torch.chunk's split: ceil(V /
    tp) per rank)."""
    return _row_start(rows, mesh.get_local_rank(), mesh.size())


def _row_start(rows: int, rank: int, ranks: int) -> int:
    return min(rank * -(-rows // ranks), rows)


class VocabRows:
    """The forward of an embedding whose rows are split by vocabulary (VocabParallelEmbedding)."""

    prefix = "VocabParallel"
    _tp: TensorParallelGroup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # noqa: D102 - the class says it
        tp = self._tp
        ids = ids.to_local() if isinstance(ids, DTensor) else ids
        weight = tp.params(self)["weight"]
        start = _row_start(self.weight.shape[0], tp.rank, tp.size)
        local = ids - start
        inside = (local >= 0) & (local < weight.shape[0])
        pad = self.padding_idx
        pad = pad - start if pad is not None and 0 <= pad - start < weight.shape[0] else None
        out = _lookup(weight, local, inside, pad)
        # a new tensor either way: it may be updated in place (CTRL)
        return sum_over_ranks(out, tp.group)


def _lookup(
    weight: torch.Tensor, local: torch.Tensor, inside: torch.Tensor, pad: int | None
) -> torch.Tensor:
    """The rows of `weight` at `local` ids (...) → (..., C), exact zeros where `inside` is False
    (not a product with the mask: a row that is not finite would leak NaN into ids other ranks own).

    Plain CPU tensors in eager mode have their rows zeroed by `index_put_` on the lookup's own
    output: a `masked_fill` with the mask broadcast over C takes longer than the lookup there
    (forward and backward, 0.3 ms of a 25 ms step of `dtp bench --quick` at tp 2). In place on the
    output itself, not on a view of it: g then reduces it in place, and autograd would pay an
    in-place change of a view with a copy of the whole base in backward. Anything else (GPUs,
    torch.compile, meta, fake or simulated ranks' tensors, a single id) takes `masked_fill`: the row
    indices need `nonzero`, a device sync and a shape that depends on the data."""
    index = torch.where(inside, local, 0)
    rows = F.embedding(index, weight, pad)
    eager_cpu = type(index) is torch.Tensor and index.device.type == "cpu" and index.dim() > 0
    if not eager_cpu or torch.compiler.is_compiling():
        return rows.masked_fill(~inside.unsqueeze(-1), 0.0)
    # the lookup's backward reads only the ids
    return rows.index_put_((~inside).nonzero(as_tuple=True), rows.new_zeros(()))


class VocabLogits:
    """The forward of an output head whose rows are split by vocabulary, the logits a `Shard(-1)`
    DTensor (VocabParallelLinear)."""

    prefix = "VocabParallel"
    _tp: TensorParallelGroup
    # (local shape, dtype) → the logits' DTensorSpec, made once by DTensor.from_local
    _logit_specs: dict

    def forward(self, x: torch.Tensor) -> DTensor:  # noqa: D102 - the class says it
        params = self._tp.params(self)
        y = F.linear(copy_to_ranks(x, self._tp.group), params["weight"], params.get("bias"))
        return _as_shards(y, self.weight.shape[0], self._tp.mesh, self._logit_specs)


def vocab_layouts(
    module: nn.Module,
    embedding: bool,
    layouts: tuple[Placement | None, Placement | None],
    local: bool,
) -> bool:
    """Whether vocab_parallel on `module` has the layouts these layers compute: a plain
    nn.Embedding, replicated ids → replicated local output, reading only its rows (no max_norm,
    scale_grad_by_freq or sparse gradient); a plain nn.Linear, replicated input → `Shard(-1)`
    DTensor logits. Else torch's style runs it (sequence parallelism, an embedding option that reads
    the whole table, a subclass with its own forward)."""
    if embedding:
        whole_table = module.max_norm is not None or module.scale_grad_by_freq or module.sparse
        return (
            type(module) is nn.Embedding
            and local
            and not whole_table
            and layouts == (Replicate(), Replicate())
        )
    return type(module) is nn.Linear and not local and layouts == (Replicate(), Shard(-1))


class _VocabEnd(LayerStyle):
    def placements(self, module: nn.Module) -> dict[str, ParamPlacement]:
        """Rows by vocabulary: the weight's, and a head's bias."""
        return {name: ParamPlacement(0) for name, _ in module.named_parameters(recurse=False)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class VocabParallelEmbedding(_VocabEnd):
    """Split an nn.Embedding's rows by vocabulary and make it a `VocabRows` layer."""

    layer = VocabRows


class VocabParallelHead(_VocabEnd):
    """Split an output nn.Linear's rows by vocabulary and make it a `VocabLogits` layer."""

    layer = VocabLogits

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module._logit_specs = {}
        return super()._apply(module, device_mesh)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


SPECS_KEPT = 16  # logits shapes whose spec a head keeps (sequence lengths vary in evaluation)


def _as_shards(y: torch.Tensor, vocab: int, mesh: DeviceMesh, specs: dict) -> DTensor:
    """This rank's logits `y` (..., V/tp) as the `Shard(-1)` DTensor of global width `vocab`:
    DTensor.from_local the first time for a shape, then the DTensor constructor on the spec that
    call made (from_local's checks and spec building, run after the head's GEMM on every step, cost
    as much as the rest of the head's Python)."""
    key = (y.shape, y.dtype)
    spec = specs.get(key)
    if spec is None:
        shape = (*y.shape[:-1], vocab)
        out = DTensor.from_local(
            y,
            mesh,
            [Shard(y.ndim - 1)],
            run_check=False,
            shape=shape,
            stride=_contiguous_stride(shape),
        )
        if len(specs) >= SPECS_KEPT:
            specs.clear()
        specs[key] = out._spec
        return out
    return _FromLocalShards.apply(y, spec)


class _FromLocalShards(torch.autograd.Function):
    """DTensor.from_local on a spec already made: the local tensor's gradient is the DTensor
    gradient's shard (redistributed to the forward's placements first, as from_local's backward
    does)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, spec) -> DTensor:
        ctx.spec = spec
        return DTensor(y.view_as(y), spec, requires_grad=y.requires_grad)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if isinstance(grad, DTensor):
            if grad.placements != ctx.spec.placements:
                grad = grad.redistribute(ctx.spec.mesh, ctx.spec.placements)
            grad = grad.to_local()
        return grad, None


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary, a `Shard(-1)` DTensor (..., V) taken whole:
    the forward reads its local (..., V/tp) shard, the backward hands back the gradient as a
    DTensor on the same spec. (`to_local()` in front would be one more autograd node whose backward
    wraps the gradient with `from_local`, for the head's node to unwrap it again.) Targets (...) are
    global ids; half-precision logits are read in float32."""

    @staticmethod
    def forward(ctx, logits: DTensor, targets: torch.Tensor, start: int) -> torch.Tensor:
        group = logits.device_mesh.get_group(0)
        shard = logits._local_tensor
        ctx.spec, ctx.shape, ctx.dtype = logits._spec, shard.shape, shard.dtype
        shard = shard.detach().flatten(0, -2)
        if shard.dtype in (torch.float16, torch.bfloat16):
            shard = shard.float()
        targets = targets.flatten()
        row_max = all_reduce(shard.amax(dim=-1, keepdim=True), group, "max")
        shifted = shard - row_max
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1, keepdim=True), group)
        valid = targets != IGNORE_INDEX
        local = targets - start
        inside = valid & (local >= 0) & (local < shard.shape[-1])
        local = torch.where(inside, local, 0).unsqueeze(-1)
        picked = all_reduce(
            shifted.gather(-1, local).masked_fill_(~inside.unsqueeze(-1), 0.0), group
        )
        count = valid.sum()
        loss = (sum_exp.log() - picked).squeeze(-1).masked_fill(~valid, 0.0).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp), local, inside, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, inside, valid, count = ctx.saved_tensors
        # per row: the mean's weight, 0 for an ignored row (one pass over the logits, not two)
        weight = (valid.to(softmax.dtype) * (grad / count).to(softmax.dtype)).unsqueeze(-1)
        out = softmax * weight  # not in place: a retained graph may run this backward again
        # − the target's one-hot (inside implies valid)
        out.scatter_add_(-1, local, -inside.unsqueeze(-1).to(softmax.dtype) * weight)
        out = out.view(ctx.shape).to(ctx.dtype)
        return DTensor(out, ctx.spec, requires_grad=False), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy of logits (..., V) against `targets` (...), ignoring
    IGNORE_INDEX.

    Logits split by vocabulary (a `Shard(-1)` DTensor on a 1-D mesh, the vocabulary-parallel head's
    output) go through the vocabulary-parallel loss on their local shard; the loss is a plain
    tensor, equal on every rank. Other logits take F.cross_entropy. Half-precision logits are read
    in float32, as autocast and loss_parallel compute it."""
    if not isinstance(logits, DTensor):
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    if logits.device_mesh.ndim != 1 or logits.placements not in (
        (Shard(-1),),
        (Shard(logits.ndim - 1),),
    ):
        raise ValueError(
            f"vocabulary-parallel logits must be Shard(-1) on a 1-D mesh, got {logits.placements}"
        )
    start = _first_row(logits.shape[-1], logits.device_mesh)
    return _VocabParallelCrossEntropy.apply(logits, targets, start)
