"""One training iteration, predicted: compute from the model's FLOPs at the profile's achieved rate,
tensor-parallel collectives from dtp's analytic schedule (their exact bytes; full recompute re-runs the
forward collectives of every checkpointed block, as Megatron's CheckpointFunction does), the
data-parallel gradient all-reduce (after backward, or overlapped with it), and the optimizer step as a
memory-bound pass over the rank's parameters. Collectives cost α-β ring time: 2(n−1)α + sent/busBW.

Ranks are laid out tensor-parallel innermost (a tp group inside a node, as in the paper's Fig. 8); a
data-parallel group spanning nodes shares each node's NICs with the other groups that have members there.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from dtp.cost.schedule import Collective, recomputed, schedule, sent_bytes
from dtp.layout.lower import lower
from dtp.simulate.flops import Flops, block_paths
from dtp.simulate.memory import Memory, Shape, activation_bytes, memory
from dtp.simulate.profile import Link, Profile

ELEM = {"fp16": 2, "bf16": 2, "fp32": 4}
DTYPE = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class Run:
    """What is simulated: mesh, batch, precision and recompute."""

    tp: int
    dp: int
    micro_batch: int
    global_batch: int
    seq: int
    precision: str = "fp16"
    recompute: str = "full"
    optimizer: str = "adam"
    dp_overlap: bool = False

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


@dataclass(frozen=True)
class Result:
    """A predicted iteration, per rank (times in seconds)."""

    run: Run
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float  # the exposed part
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
        """Predicted iteration time (nothing overlaps but what dp_overlap hides)."""
        return self.compute_s + self.tp_comm_s + self.dp_comm_s + self.optimizer_s

    @property
    def tflops_per_gpu(self) -> float:
        """Hardware FLOP/s per accelerator (Narayanan et al.'s eq. 3 counts the recompute too), in TFLOP/s."""
        return self.flops_per_iteration / self.run.gpus / self.iteration_s / 1e12

    @property
    def aggregate_pflops(self) -> float:
        """Hardware FLOP/s of the whole job in PFLOP/s."""
        return self.flops_per_iteration / self.iteration_s / 1e15

    def to_json(self) -> dict:
        """Everything, with the derived figures."""
        out = {"run": asdict(self.run), **{k: v for k, v in asdict(self).items() if k not in ("run", "memory")}}
        m = self.memory
        out.update(iteration_s=self.iteration_s, tflops_per_gpu=self.tflops_per_gpu,
                   aggregate_pflops=self.aggregate_pflops,
                   memory={"params_per_rank": m.params, "weights_bytes": m.weights, "grads_bytes": m.grads,
                           "optimizer_bytes": m.optimizer, "activation_bytes": m.activations,
                           "total_bytes": m.total, "capacity_bytes": m.capacity, "fits": m.fits})
        return out


def tp_collectives(work: Workload, run: Run) -> list[Collective]:
    """One micro-batch's tensor-parallel collectives, with Megatron's recomputed forward ones."""
    out = list(work.collectives)
    if run.recompute == "full":
        out += recomputed(out, list(work.block_paths))  # the model `explain` and `train` use
    return out


def ring_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """α-β time of one ring collective of an `nbytes` buffer over n ranks."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * link.latency_us * 1e-6 + sent_bytes(op, int(nbytes), n) / link.bytes_per_s


def simulate(work: Workload, run: Run, prof: Profile) -> Result:
    """Predict one iteration of `run` on `prof`."""
    elem = ELEM[run.precision]
    per_node = min(run.gpus, prof.gpus_per_node)
    rate = prof.flops_per_s(run.precision) * min(1.0, prof.compute_slots / per_node)
    m = run.microbatches
    rank_flops = m * work.flops.iteration(run.micro_batch, run.recompute, run.tp)
    share = min(1.0, prof.compute_slots / per_node)
    compute = m * kernel_time(work.flops, run, prof, share) if work.flops.ops else rank_flops / rate

    tp_link = prof.intra if run.tp <= prof.gpus_per_node else _per_gpu_inter(prof)
    colls = tp_collectives(work, run)
    tp_time = m * sum(ring_time(c.op, c.buffer_bytes, run.tp, tp_link) for c in colls)
    tp_sent = m * sum(sent_bytes(c.op, c.buffer_bytes, run.tp) for c in colls)

    grad_bytes = work.params_per_rank * elem
    dp_total = _dp_allreduce(grad_bytes, run, prof)
    backward = run.micro_batch * (2 * work.flops.forward(run.tp) + work.flops.recomputed(run.recompute, run.tp)) / rate
    dp_exposed = max(0.0, dp_total - backward) if run.dp_overlap else dp_total

    # Optimizer step: read the gradient, read and write the fp32 weights and each fp32 state tensor,
    # write the low-precision copy.
    states = 2 if run.optimizer == "adam" else 1
    traffic = elem + 8 + 8 * states + (elem if elem < 4 else 0)
    optimizer = work.params_per_rank * traffic / (prof.hbm_GBps * 1e9)

    acts = activation_bytes(work.shape, run.micro_batch, run.seq, run.tp, elem=elem, recompute=run.recompute,
                            sequence_parallel=work.sequence_parallel)
    mem = memory(work.params_per_rank, elem, run.optimizer, acts, prof.memory_GiB)
    total_flops = run.dp * run.tp * rank_flops
    model_flops = run.global_batch * 3 * work.flops.forward(1)
    return Result(run, compute, tp_time, dp_exposed, dp_total, optimizer, total_flops, model_flops,
                  m * len(colls) if run.tp > 1 else 0, tp_sent, sent_bytes("all_reduce", int(grad_bytes), run.dp), mem)


def kernel_time(flops: Flops, run: Run, prof: Profile, share: float = 1.0) -> float:
    """One micro-batch's compute, op by op: a GEMM at the profile's rate × its size's efficiency, a
    memory-bound op's elements read and written over `hbm_GBps`, each op paying `op_overhead_us` (hidden
    behind the work when ops run asynchronously). Backward costs twice the forward (two GEMMs per GEMM;
    the gradient of an elementwise op reads and writes about twice its traffic); full recompute runs the
    forward of every block op again, selective only its attention."""
    rate = prof.flops_per_s(run.precision) * share
    bandwidth = prof.hbm_GBps * 1e9 * share
    overhead = prof.op_overhead_us * 1e-6
    b, elem, total = run.micro_batch, ELEM[run.precision], 0.0
    for op in flops.ops:
        n = run.tp if op.split else 1
        if op.kind == "memory":
            work = op.elements * b / n * elem / bandwidth
        else:
            size = op.flops * b / n
            work = size / (rate * prof.gemm_fraction(size))
        one = max(overhead, work) if prof.async_ops else work + overhead
        again = op.in_block and (run.recompute == "full" or (run.recompute == "selective" and op.kind == "attention"))
        total += op.count * one * (3 + again)
    return total


def _per_gpu_inter(prof: Profile) -> Link:
    # A tp group wider than a node: every GPU of the node uses the NICs at once.
    i = prof.inter
    return Link(i.busbw_GBps / prof.gpus_per_node, i.latency_us, i.efficiency)


def _dp_allreduce(nbytes: float, run: Run, prof: Profile) -> float:
    """The gradient all-reduce of one data-parallel group, all groups running at once."""
    d = run.dp
    if d <= 1:
        return 0.0
    members = max(1, min(d, prof.gpus_per_node // run.tp))  # of one dp group inside one node
    nodes = -(-d // members)
    intra = ring_time("all_reduce", nbytes, d, prof.intra)
    if nodes == 1:
        return intra
    groups = min(run.tp, prof.gpus_per_node)  # dp groups with members in each node share its NICs
    inter = (2 * (d - 1) * prof.inter.latency_us * 1e-6
             + groups * sent_bytes("all_reduce", int(nbytes), d) / prof.inter.bytes_per_s)
    return max(intra, inter)


def workload(checked, model, tp: int, *, seq: int, micro_batch: int, precision: str, flops: Flops,
             params_per_rank: float, shape: Shape) -> Workload:
    """The model side for one tp: the analytic schedule of one micro-batch and what memory needs."""
    low = lower(checked.resolution, tp)
    colls = schedule(checked, tp, micro_batch, seq, dtype=DTYPE[precision], lowered=low)
    total = float(sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()))
    return Workload(flops, params_per_rank, total, shape, low.sequence_parallel, tuple(colls),
                    tuple(block_paths(model)))
