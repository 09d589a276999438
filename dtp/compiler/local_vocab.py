"""The vocabulary-parallel ends on local tensors: Megatron's VocabParallelEmbedding, the head and the
cross-entropy over logits split by vocabulary, with DTensor parameters and no DTensor arithmetic.

torch gives these ends as DTensor programs: RowwiseParallel on an Embedding (a masked lookup whose partial
sum is reduced), ColwiseParallel with `Shard(-1)` logits, and `loss_parallel`'s cross-entropy. Their layouts
are fixed when the plan is compiled, so, as for the column/row pairs (dtp.compiler.local_pair), the hot path
runs on local tensors and communicates only where torch's programs do, with the same functional all-reduces
(op, count and bytes):

- embedding: rows [start, start + n) of the vocabulary; ids outside them look up row 0 and are zeroed;
  one all-reduce of the sum (forward), none in backward;
- head: f on the input (its gradient all-reduced in backward), this rank's logits as a `Shard(-1)` DTensor,
  so that every reader (parity, gathers, the loss) still sees the global logits; `cross_entropy` reads the
  local logits the DTensor was made from, skipping DTensor's two autograd functions, when nothing can have
  changed them since (`_head_local`);
- cross-entropy: all-reduces of the row maxima, of the sums of exponentials and of the target logits (the
  three loss_parallel makes, at the same (N, 1) shapes); its backward is local.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from dtp.compiler.local_leaves import LocalLeaves, owned_params
from dtp.compiler.local_pair import all_reduce, bind_forward, colwise_input, drop_style_hooks, g
from dtp.compiler.placed import VocabParallelEmbedding

IGNORE_INDEX = -100  # F.cross_entropy's default, which transformers' labels use


def vocab_side(style: ParallelStyle, module: nn.Module) -> str | None:
    """'embedding' or 'head' when `style` is the vocabulary-parallel style on a plain Embedding (replicated ids
    → replicated local output) or Linear (replicated input → `Shard(-1)` DTensor logits); else None (sequence
    parallelism, an embedding option that reads the whole table, a subclass with its own forward)."""
    if not isinstance(style, (VocabParallelEmbedding, ColwiseParallel)):
        return None
    layouts = (tuple(style.input_layouts), tuple(style.output_layouts))
    if isinstance(style, VocabParallelEmbedding) and type(module) is nn.Embedding and style.use_local_output:
        whole_table = module.max_norm is not None or module.scale_grad_by_freq or module.sparse
        return "embedding" if layouts == ((Replicate(),), (Replicate(),)) and not whole_table else None
    if type(style) is ColwiseParallel and type(module) is nn.Linear and not style.use_local_output:
        return "head" if layouts == ((Replicate(),), (Shard(-1),)) else None
    return None


def _first_row(rows: int, mesh: DeviceMesh) -> int:
    """This rank's first of `rows` vocabulary rows split over `mesh` (torch.chunk's split: ceil(V / tp) per rank)."""
    return _row_start(rows, mesh.get_local_rank(), mesh.size())


def _row_start(rows: int, rank: int, ranks: int) -> int:
    return min(rank * -(-rows // ranks), rows)


def localize_vocab(module: nn.Module, side: str, mesh: DeviceMesh, before: tuple[set[int], set[int]],
                   leaves: LocalLeaves) -> None:
    """Drop the style's input/output hooks and compute `module` (see `vocab_side`) on local tensors, its
    parameters read through `leaves`."""
    drop_style_hooks(module, before)
    owned = owned_params(module)
    group, rank, ranks = mesh.get_group(0), mesh.get_local_rank(), mesh.size()  # fixed when the mesh is made
    alone = ranks == 1
    if side == "embedding":
        def forward(self, ids):
            ids = ids.to_local() if isinstance(ids, DTensor) else ids
            start, weight = _row_start(self.weight.shape[0], rank, ranks), leaves.params(self, owned)["weight"]
            local = ids - start
            inside = (local >= 0) & (local < weight.shape[0])
            pad = self.padding_idx
            pad = pad - start if pad is not None and 0 <= pad - start < weight.shape[0] else None
            out = F.embedding(torch.where(inside, local, 0), weight, pad).masked_fill(~inside.unsqueeze(-1), 0.0)
            return out if alone else g(out, group)  # a new tensor either way: it may be updated in place (CTRL)
    else:
        specs: dict = {}  # (local shape, dtype) → the logits' DTensorSpec, made once by DTensor.from_local

        def forward(self, x):
            params = leaves.params(self, owned)
            y = F.linear(colwise_input(x, group), params["weight"], params.get("bias"))
            out = _as_shards(y, self.weight.shape[0], mesh, specs)
            if not torch.compiler.is_compiling():  # an attribute set in a traced region would break the graph
                out._dtp_head_local = (y, y._version, out._version, out.grad_fn)
            return out
    bind_forward(module, forward)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, step = [], 1
    for n in reversed(shape):
        stride.append(step)
        step *= max(n, 1)
    return tuple(reversed(stride))


SPECS_KEPT = 16  # logits shapes whose spec a head keeps (sequence lengths vary in evaluation)


def _as_shards(y: torch.Tensor, vocab: int, mesh: DeviceMesh, specs: dict) -> DTensor:
    """This rank's logits `y` (..., V/tp) as the `Shard(-1)` DTensor of global width `vocab`: DTensor.from_local
    the first time for a shape, then the DTensor constructor on the spec that call made (from_local's checks
    and spec building, run after the head's GEMM on every step, cost as much as the rest of the head's Python)."""
    key = (y.shape, y.dtype)
    spec = specs.get(key)
    if spec is None:
        shape = (*y.shape[:-1], vocab)
        out = DTensor.from_local(y, mesh, [Shard(y.ndim - 1)], run_check=False, shape=shape,
                                 stride=_contiguous_stride(shape))
        if len(specs) >= SPECS_KEPT:
            specs.clear()
        specs[key] = out._spec
        return out
    return _FromLocalShards.apply(y, spec)


class _FromLocalShards(torch.autograd.Function):
    """DTensor.from_local on a spec already made: the local tensor's gradient is the DTensor gradient's shard
    (redistributed to the forward's placements first, as from_local's backward does)."""

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


def _head_local(logits: DTensor) -> torch.Tensor:
    """The local logits `logits` holds. When `logits` is the head's own output, untouched (no in-place change to
    it, whose version counter DTensor's in-place ops bump, or to its local tensor, a view sharing the head
    tensor's counter), still the output of the head's own autograd node (reentrant checkpointing returns the
    DTensor from a node of its own, around a head run without gradients) and unobserved (no hook, no retained
    gradient, which a shortcut past it would starve), that is the head's tensor itself, whose gradient is the
    same; else DTensor's to_local."""
    made = getattr(logits, "_dtp_head_local", None)
    if (made is not None and made[0]._version == made[1] and logits._version == made[2] and logits.grad_fn is made[3]
            and not logits._backward_hooks and not logits.retains_grad):
        return made[0]
    return logits.to_local()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits (N, V/tp) split by vocabulary; targets (N,) are global ids."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, mesh: DeviceMesh) -> torch.Tensor:
        group = mesh.get_group(0)
        row_max = all_reduce(logits.detach().amax(dim=-1, keepdim=True), group, "max")
        shifted = logits - row_max
        exp = shifted.exp()
        sum_exp = all_reduce(exp.sum(dim=-1, keepdim=True), group)
        valid = targets != IGNORE_INDEX
        local = targets - start
        inside = valid & (local >= 0) & (local < logits.shape[-1])
        local = torch.where(inside, local, 0).unsqueeze(-1)
        picked = all_reduce(shifted.gather(-1, local).masked_fill_(~inside.unsqueeze(-1), 0.0), group)
        count = valid.sum()
        loss = (sum_exp.log() - picked).squeeze(-1).masked_fill(~valid, 0.0).sum() / count
        ctx.save_for_backward(exp.div_(sum_exp), local, inside, valid, count)
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, local, inside, valid, count = ctx.saved_tensors
        scale = (grad / count).to(softmax.dtype)
        out = softmax * scale
        out.scatter_add_(-1, local, (inside.to(softmax.dtype) * -scale).unsqueeze(-1))  # − the target's one-hot
        return out.masked_fill_(~valid.unsqueeze(-1), 0.0), None, None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean token cross-entropy of logits (..., V) against `targets` (...), ignoring IGNORE_INDEX.

    Logits split by vocabulary (a `Shard(-1)` DTensor on a 1-D mesh, the vocabulary-parallel head's output)
    go through the local vocabulary-parallel loss; the loss is a plain tensor, equal on every rank. Other logits
    take F.cross_entropy. Half-precision logits are read in float32, as autocast and loss_parallel compute it."""
    if not isinstance(logits, DTensor):
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten())
    if logits.device_mesh.ndim != 1 or logits.placements not in ((Shard(-1),), (Shard(logits.ndim - 1),)):
        raise ValueError(f"vocabulary-parallel logits must be Shard(-1) on a 1-D mesh, got {logits.placements}")
    mesh = logits.device_mesh
    local = _head_local(logits)
    if local.dtype in (torch.float16, torch.bfloat16):
        local = local.float()
    start = _first_row(logits.shape[-1], mesh)
    return _VocabParallelCrossEntropy.apply(local.flatten(0, -2), targets.flatten(), start, mesh)
