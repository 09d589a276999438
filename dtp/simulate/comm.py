"""Collective times: α-β ring time on a link, the data-parallel collectives of every dp group at
once (tp innermost: a dp group spanning nodes shares each node's NICs with the other groups that
have members there), DDP's bucketed all-reduce overlapped with backward, and FSDP's per-unit
all-gathers and reduce-scatters with prefetch.

FSDP (ZeRO-3 / FSDP2, one unit per block plus the root): per micro-batch, forward all-gathers each
unit's parameters in the training precision, the next unit's while the current one computes
(prefetch), so a unit's exposed time is max(0, all-gather − one block's forward); backward
all-gathers each unit again (reshard after forward) and reduce-scatters its gradient in fp32
(FSDP2's usual reduce dtype), both behind the block's backward. The root's all-gather before the
first block and its reduce-scatter after the last are exposed, as is the first block's all-gather.
"""

from __future__ import annotations

from dtp.cost.schedule import sent_bytes
from dtp.simulate.profile import Link, Profile

# torch DDP's default bucket_cap_mb: the last bucket cannot overlap
DDP_BUCKET_BYTES = 25 * 1024**2
FSDP_REDUCE_ELEM = 4  # fp32 gradient reduce-scatter


def ring_time(op: str, nbytes: float, n: int, link: Link) -> float:
    """α-β time of one ring collective of an `nbytes` buffer over n ranks."""
    if n <= 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * link.latency_us * 1e-6 + sent_bytes(op, int(nbytes), n) / link.bytes_per_s


def per_gpu_inter(prof: Profile) -> Link:
    """The inter-node link as one GPU sees it when every GPU of the node uses the NICs at once."""
    i = prof.inter
    return Link(i.busbw_GBps / prof.gpus_per_node, i.latency_us, i.efficiency)


def dp_collective(op: str, nbytes: float, tp: int, dp: int, prof: Profile) -> float:
    """One collective of one data-parallel group, all groups running at once."""
    if dp <= 1:
        return 0.0
    members = max(1, min(dp, prof.gpus_per_node // tp))  # of one dp group inside one node
    nodes = -(-dp // members)
    intra = ring_time(op, nbytes, dp, prof.intra)
    if nodes == 1:
        return intra
    groups = min(tp, prof.gpus_per_node)  # dp groups with members in each node share its NICs
    steps = 2 * (dp - 1) if op == "all_reduce" else dp - 1
    inter = (
        steps * prof.inter.latency_us * 1e-6
        + groups * sent_bytes(op, int(nbytes), dp) / prof.inter.bytes_per_s
    )
    return max(intra, inter)


def ddp(
    grad_bytes: float, tp: int, dp: int, prof: Profile, overlap: bool, backward_s: float
) -> tuple[float, float]:
    """(exposed, total) seconds of DDP's gradient all-reduce: after backward, or in buckets during
    the last micro-batch's backward, where only what outlasts the backward, and at least the last
    bucket, shows."""
    total = dp_collective("all_reduce", grad_bytes, tp, dp, prof)
    if not overlap:
        return total, total
    last = dp_collective("all_reduce", min(grad_bytes, DDP_BUCKET_BYTES), tp, dp, prof)
    return min(total, max(total - backward_s, last)), total


def fsdp(
    units: tuple[float, ...],
    elem: int,
    tp: int,
    dp: int,
    prof: Profile,
    block_forward_s: float,
    block_backward_s: float,
) -> tuple[float, float, float]:
    """(exposed, total seconds, bytes sent) of one micro-batch's FSDP collectives per rank; `units`
    are the tp-local parameter counts of each block unit, the root last; times are per block."""
    *blocks, root = units
    gather = [dp_collective("all_gather", p * elem, tp, dp, prof) for p in blocks]
    scatter = [dp_collective("reduce_scatter", p * FSDP_REDUCE_ELEM, tp, dp, prof) for p in blocks]
    root_ag = dp_collective("all_gather", root * elem, tp, dp, prof)
    root_rs = dp_collective("reduce_scatter", root * FSDP_REDUCE_ELEM, tp, dp, prof)
    fwd = block_forward_s / max(1, len(blocks))
    bwd = block_backward_s / max(1, len(blocks))
    exposed = root_ag + root_rs + (gather[0] if gather else 0.0)
    exposed += sum(max(0.0, g - fwd) for g in gather[1:])
    exposed += sum(max(0.0, g + s - bwd) for g, s in zip(gather, scatter))
    total = root_ag + root_rs + 2 * sum(gather) + sum(scatter)
    sent = (
        sent_bytes("all_gather", int(root * elem), dp)
        + sent_bytes("reduce_scatter", int(root * FSDP_REDUCE_ELEM), dp)
        + sum(
            2 * sent_bytes("all_gather", int(p * elem), dp)
            + sent_bytes("reduce_scatter", int(p * FSDP_REDUCE_ELEM), dp)
            for p in blocks
        )
    )
    return exposed, total, float(sent)
