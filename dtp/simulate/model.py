"""One training iteration, predicted: compute op by op (`kernels.py`), tensor-parallel collectives
from dtp's analytic schedule (their exact bytes; full recompute re-runs the forward collectives of
every checkpointed block, as Megatron's CheckpointFunction does), data parallelism as DDP's gradient
all-reduce (after backward, or bucketed and overlapped with it) or as FSDP's per-unit all-gathers
and reduce-scatters behind the blocks' compute (`comm.py`), and the optimizer step as a memory-bound
pass over the rank's parameters. Collectives cost α-β ring time: 2(n−1)α + sent/busBW.

Ranks are laid out tensor-parallel innermost (a tp group inside a node, as in the paper's Fig. 8); a
data-parallel group spanning nodes shares each node's NICs with the other groups that have members
there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dtp.cost.fsdp import unit_bytes
from dtp.cost.schedule import Collective, recomputed, schedule, sent_bytes
from dtp.layout.lower import lower
from dtp.simulate import comm
from dtp.simulate.comm import ring_time
from dtp.simulate.flops import RECOMPUTE, SHARDING_STYLES, Flops, block_paths
from dtp.simulate.kernels import ELEM, compute_parts, kernel_time  # noqa: F401 - kernel_time: part of the API
from dtp.simulate.memory import GiB, Memory, Shape, activation_bytes, loss_bytes, memory
from dtp.simulate.profile import Profile

DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ATTENTION = ("flash", "fused", "unfused")


@dataclass(frozen=True)
class Run:
    """What is simulated: mesh, batch, precision, recompute policy, data parallelism and kernels."""

    tp: int
    dp: int
    micro_batch: int
    global_batch: int
    seq: int
    precision: str = "fp16"
    recompute: str = "full"  # none | full | selective | op
    optimizer: str = "adam"
    dp_overlap: bool = False  # DDP: bucketed all-reduce during backward (FSDP always overlaps)
    fsdp: bool = False  # ZeRO-3 / FSDP2 over dp: weights, gradients, optimizer state sharded
    compile: bool = False  # torch.compile: fused elementwise ops
    # flash | fused (Megatron 2020–22 softmax) | unfused (2019): see kernels.py
    attention: str = "flash"
    # backward input-gradient collectives run during the weight-gradient GEMMs
    tp_overlap: bool = False

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(
                f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}"
            )
        if self.attention not in ATTENTION:
            raise ValueError(
                f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}"
            )
        if self.precision not in ELEM:
            raise ValueError(f"precision must be one of {', '.join(ELEM)}, got {self.precision!r}")

    @property
    def microbatches(self) -> int:
        """Micro-batches each data-parallel rank runs per iteration (gradient accumulation)."""
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def gpus(self) -> int:
        """Accelerators in the job."""
        return self.tp * self.dp


@dataclass(frozen=True)
class Workload:
    """The model side of a simulation, computed once per model and tp (meta device)."""

    flops: Flops
    params_per_rank: float  # at this tp
    params_total: float
    shape: Shape
    sequence_parallel: bool
    collectives: tuple[Collective, ...]  # one micro-batch's forward + backward at this tp
    block_paths: tuple[str, ...]
    # FSDP: tp-local parameters of each block unit, the root last
    unit_params: tuple[float, ...] = ()
    param_tensors: int = 0  # parameter tensors per rank: an unfused optimizer dispatches per tensor
    # of them, those the plan shards (DTensors at tp > 1: DTensor's dispatch per op)
    sharded_tensors: int = 0


@dataclass(frozen=True)
class Result:
    """A predicted iteration, per rank (times in seconds)."""

    run: Run
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float  # the exposed part (DDP all-reduce or FSDP all-gathers + reduce-scatters)
    dp_comm_total_s: float
    optimizer_s: float
    flops_per_iteration: float  # hardware FLOPs of the whole job (recompute included)
    model_flops_per_iteration: float
    tp_collectives: int  # per rank per iteration
    tp_sent_bytes: float
    dp_sent_bytes: float
    memory: Memory

    @property
    def iteration_s(self) -> float:
        """Predicted iteration time (nothing overlaps but what dp_overlap/FSDP prefetch hides)."""
        return self.compute_s + self.tp_comm_s + self.dp_comm_s + self.optimizer_s

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware FLOP/s per accelerator (Narayanan et al.'s eq. 3 counts the recompute too), in
        TFLOP/s."""
        return self.flops_per_iteration / self.run.gpus / self.iteration_s / 1e12

    @property
    def aggregate_pflops(self) -> float:
        """Hardware FLOP/s of the whole job in PFLOP/s."""
        return self.flops_per_iteration / self.iteration_s / 1e15

    @property
    def tokens_per_s_per_gpu(self) -> float:
        """Training tokens per second per accelerator (torchtitan's TPS/GPU)."""
        return self.run.global_batch * self.run.seq / self.iteration_s / self.run.gpus

    @property
    def memory_gib(self) -> float:
        """Predicted memory per GPU in GiB."""
        return self.memory.total / GiB

    @property
    def fits(self) -> bool:
        """Whether the predicted memory fits the accelerator."""
        return self.memory.fits

    def to_json(self) -> dict:
        """Everything, with the derived figures."""
        out = {
            "run": asdict(self.run),
            **{k: v for k, v in asdict(self).items() if k not in ("run", "memory")},
        }
        m = self.memory
        out.update(
            iteration_s=self.iteration_s,
            tflops_per_gpu=self.tflops_per_gpu,
            aggregate_pflops=self.aggregate_pflops,
            tokens_per_s_per_gpu=self.tokens_per_s_per_gpu,
            memory_gib=self.memory_gib,
            fits=self.fits,
            memory={
                "params_per_rank": m.params,
                "weights_bytes": m.weights,
                "grads_bytes": m.grads,
                "optimizer_bytes": m.optimizer,
                "activation_bytes": m.activations,
                "buffers_bytes": m.buffers,
                "total_bytes": m.total,
                "capacity_bytes": m.capacity,
                "fits": m.fits,
            },
        )
        return out


def tp_collectives(work: Workload, run: Run) -> list[Collective]:
    """One micro-batch's tensor-parallel collectives, with the recomputed forward ones: full
    recompute re-runs every forward collective of a block (Megatron's CheckpointFunction, the model
    `explain` and `train` use); selective recomputes the attention core, which has none; the per-op
    policy re-runs those whose outputs backward needs and does not keep: not reduce-scatters
    (torchtitan's save list holds them) and not a block's last collective (its output is the next
    block's saved input)."""
    out = list(work.collectives)
    if run.recompute == "full":
        out += recomputed(out, list(work.block_paths))
    elif run.recompute == "op":
        again = recomputed(out, list(work.block_paths))
        last = {_block_of(c.module, work.block_paths): i for i, c in enumerate(again)}
        out += [
            c
            for i, c in enumerate(again)
            if c.op != "reduce_scatter" and last[_block_of(c.module, work.block_paths)] != i
        ]
    return out


def _block_of(module: str, blocks: tuple[str, ...]) -> str:
    return next((b for b in blocks if module == b or module.startswith(b + ".")), "")


def simulate(work: Workload, run: Run, prof: Profile) -> Result:
    """Predict one iteration of `run` on `prof`."""
    elem = ELEM[run.precision]
    per_node = min(run.gpus, prof.gpus_per_node)
    share = prof.share(per_node)
    rate = prof.flops_per_s(run.precision) * share
    m = run.microbatches
    rank_flops = m * work.flops.iteration(run.micro_batch, run.recompute, run.tp)
    if work.flops.ops:
        parts = compute_parts(
            work.flops, run, prof, share, shape=work.shape, sequence_parallel=work.sequence_parallel
        )
        compute, backward = m * parts.total, parts.block_backward + parts.other_backward
    else:
        compute = rank_flops / rate
        backward, parts = 2 / 3 * compute / m, None

    tp_link = prof.intra if run.tp <= prof.gpus_per_node else comm.per_gpu_inter(prof)
    tp_link = prof.link_for(run.tp, tp_link)
    colls = tp_collectives(work, run)
    tp_time = m * sum(ring_time(c.op, c.buffer_bytes, run.tp, tp_link) for c in colls)
    # Megatron's async input-gradient all-reduce (K22 §6.2)
    if run.tp_overlap and parts is not None:
        hidden = sum(
            ring_time(c.op, c.buffer_bytes, run.tp, tp_link) for c in colls if _beside_wgrad(c)
        )
        tp_time -= m * min(hidden, parts.block_gemm_forward)
    tp_sent = m * sum(sent_bytes(c.op, c.buffer_bytes, run.tp) for c in colls)

    shard = run.dp if run.fsdp else 1
    if run.fsdp and run.dp > 1 and work.unit_params and parts is not None:
        exposed, total, sent = comm.fsdp(
            work.unit_params, elem, run.tp, run.dp, prof, parts.block_forward, parts.block_backward
        )
        dp_exposed, dp_total, dp_sent = m * exposed, m * total, m * sent
    else:
        grad_bytes = work.params_per_rank * elem
        dp_exposed, dp_total = comm.ddp(grad_bytes, run.tp, run.dp, prof, run.dp_overlap, backward)
        dp_sent = sent_bytes("all_reduce", int(grad_bytes), run.dp)

    # Optimizer step: read the gradient, read and write the fp32 weights and each fp32 state tensor,
    # write the low-precision copy (FSDP: on the rank's shard only).
    states = 2 if run.optimizer == "adam" else 1
    traffic = elem + 8 + 8 * states + (elem if elem < 4 else 0)
    optimizer = work.params_per_rank / shard * traffic / (prof.bandwidth("optimizer") * share)
    dtensors = work.sharded_tensors if run.tp > 1 and prof.optimizer_dtensor_us else 0
    per_tensor = (
        work.param_tensors - dtensors
    ) * prof.optimizer_tensor_us + dtensors * prof.optimizer_dtensor_us
    optimizer += per_tensor * 1e-6 / (1.0 if prof.async_ops else share)

    acts = activation_bytes(
        work.shape,
        run.micro_batch,
        run.seq,
        run.tp,
        elem=elem,
        recompute=run.recompute,
        sequence_parallel=work.sequence_parallel,
        dropout=work.shape.dropout,
        flash=run.attention == "flash",
    )
    unit = max(work.unit_params[:-1], default=0.0) if run.fsdp else 0.0
    loss = loss_bytes(work.shape, run.micro_batch, run.seq, run.tp, elem)
    mem = memory(
        work.params_per_rank,
        elem,
        run.optimizer,
        acts,
        prof.memory_GiB,
        fsdp_dp=shard,
        unit_params=unit,
        transient=loss,
    )
    total_flops = run.dp * run.tp * rank_flops
    model_flops = run.global_batch * 3 * work.flops.forward(1)
    return Result(
        run,
        compute,
        tp_time,
        dp_exposed,
        dp_total,
        optimizer,
        total_flops,
        model_flops,
        m * len(colls) if run.tp > 1 else 0,
        tp_sent,
        dp_sent,
        mem,
    )


def _beside_wgrad(c: Collective) -> bool:
    """A backward collective of an input gradient (Megatron's f, or its reduce-scatter under
    sequence parallelism): the layer's weight-gradient GEMM does not need it, so the two can run at
    once."""
    return (
        c.phase == "backward"
        and c.group == "tp"
        and not c.reason.startswith("recomputed")
        and (
            c.reason.endswith("gradient (f)")
            or (c.op == "reduce_scatter" and c.reason.endswith(": gradient"))
        )
    )


def workload(
    checked,
    model,
    tp: int,
    *,
    seq: int,
    micro_batch: int,
    precision: str,
    flops: Flops,
    params_per_rank: float,
    shape: Shape,
) -> Workload:
    """The model side for one tp: the analytic schedule of one micro-batch, FSDP's units and what
    memory needs."""
    low = lower(checked.resolution, tp)
    colls = schedule(
        checked, tp, micro_batch, seq, dtype=DTYPE[precision], lowered=low, plain=False
    )
    total = float(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
    units = tuple(float(n) for _, n in unit_bytes(checked, model, tp, 1, 1))

    tensors = dict(model.named_parameters())  # tied parameters once
    sharded = {
        path
        for path, rule in checked.resolution.claims.items()
        if rule.style.name in SHARDING_STYLES
    }
    on_sharded = sum(1 for name in tensors if name.rsplit(".", 1)[0] in sharded)
    return Workload(
        flops,
        params_per_rank,
        total,
        shape,
        low.sequence_parallel,
        tuple(colls),
        tuple(block_paths(model)),
        units,
        len(tensors),
        on_sharded,
    )
