"""Measure this machine and write a profile: the kernels one rank runs (`calibrate_ops.py`: GEMM
rate by size and layout, attention, each memory-bound op, the optimizer step, per-op dispatch; one
thread, as each `dtp apply` rank runs here), and gloo all-reduce time at several sizes on 2 and 4
loopback ranks, fitted to the α-β ring model 2(n−1)α + 2(n−1)/n · S/β. Nothing is fitted to a
training step.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from dtp.compiler.mappings import all_reduce
from dtp.runtime.ranks import on_ranks
from dtp.simulate import calibrate_ops as ops

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce buffers, bytes


def elementwise_bandwidth(n: int = 1 << 22, reps: int = 20) -> float:
    """Bytes per second of an elementwise add (two reads and one write per element), best of runs
    (run it through `calibrate_ops.single_thread`, as a rank runs)."""
    a, b, out = torch.ones(n), torch.ones(n), torch.empty(n)
    torch.add(a, b, out=out)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 3 * 4 * n / min(times)


def _allreduce_times(rank: int, world: int, sizes: tuple[int, ...], reps: int) -> list[float]:
    """Seconds one all-reduce adds to a loop of compute segments, per size: as dtp's f and g call it
    (the process group's own, in place on a just-computed tensor, and its wait:
    dtp.compiler.mappings.all_reduce) and where (between a layer's matmuls, with no barrier: the
    ranks' drift between collectives, and the gloo threads waking on a core the other rank's compute
    holds, are part of its cost, as in a training step). Each segment is one ~3 ms Linear GEMM; the
    loop's time less the same loop without collectives, over its collectives."""
    x, w = torch.randn(1024, 512), torch.randn(512, 512)
    segments = 10

    def loop(base: torch.Tensor, collective: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(segments):
            x @ w
            # a just-computed tensor, as a layer's output is (the loop without collectives too)
            fresh = base * 1.0
            if collective:
                all_reduce(fresh, dist.group.WORLD)
        return time.perf_counter() - t0

    out = []
    for size in sizes:
        base = torch.ones(size // 4)
        loop(base, True)  # warm-up
        alone = statistics.median(loop(base, False) for _ in range(3))
        added = [(loop(base, True) - alone) / segments for _ in range(max(3, reps // 3))]
        out.append(max(statistics.median(added), 1e-6))
    return out


def _busy(rank: int, world: int, seconds: float) -> float:
    """Work units per second of one rank running a training-like mix (a Linear GEMM and an add over
    1M floats) while `world` ranks run it at once."""
    x, w, a = torch.randn(1024, 512), torch.randn(512, 512), torch.randn(1 << 20)
    dist.barrier()
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        x @ w
        a + a
        done += 1
    return done / (time.perf_counter() - t0)


def rank_shares(worlds: tuple[int, ...], seconds: float = 1.5) -> dict[int, float]:
    """n → the rate each of n concurrent one-thread ranks gets, as a fraction of one rank alone:
    more ranks than cores share them (and two vCPUs may share less than two cores' worth). Measured,
    not assumed."""
    alone = on_ranks(_busy, 1, seconds)[0]
    return {n: min(1.0, statistics.fmean(on_ranks(_busy, n, seconds)) / alone) for n in worlds}


def allreduce_fit(
    world: int = 2, sizes: tuple[int, ...] = SIZES, reps: int = 15
) -> tuple[float, float, list]:
    """(α seconds per ring step, β bus bytes per second, [(size, seconds)]) of gloo on `world` local
    ranks."""
    per_rank = on_ranks(_allreduce_times, world, sizes, reps)
    times = [max(ts) for ts in zip(*per_rank)]
    steps = 2 * (world - 1)
    xs = [2 * (world - 1) / world * s for s in sizes]  # bytes each rank sends
    # least squares of time = steps·α + x/β
    mx, my = statistics.fmean(xs), statistics.fmean(times)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, times)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(0.0, (my - slope * mx) / steps)
    return alpha, 1.0 / max(slope, 1e-15), list(zip(sizes, times))


def _num(x: float) -> str:
    """A number as YAML reads it back as one (YAML 1.1 takes '1e+06' for a string): 4 significant
    digits."""
    text = f"{x:.4g}"
    return f"{x:.1f}" if "e" in text else text


def profile_yaml(name: str, worlds: tuple[int, ...] = (2, 4)) -> tuple[str, dict]:
    """Measure and return (the profile's YAML text, the raw measurements)."""
    flops, table, backward = ops.single_thread(ops.gemm_layouts)
    attention, attention_back = ops.single_thread(lambda: ops.attention(flops))
    op_bw, op_back = ops.single_thread(ops.memory_ops)
    for world in worlds:  # the vocabulary-parallel loss at each tp (a fake group in this process)
        op_bw[f"loss.parallel{world}"], op_back[f"loss.parallel{world}"], loss_impl = (
            ops.single_thread(lambda w=world: ops.parallel_loss(w))
        )
    op_bw["optimizer"], per_tensor = ops.single_thread(ops.sgd_step)
    per_dtensor = max(on_ranks(ops.sgd_dtensor_tensor, worlds[0]))
    bandwidth = ops.single_thread(elementwise_bandwidth)
    overhead, back_overhead = ops.single_thread(ops.overheads)
    fits = {n: allreduce_fit(n) for n in worlds}
    alpha, beta = fits[worlds[0]][:2]
    shares = rank_shares(worlds)
    cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    points_text = "\n".join(
        f"#   world {n}: " + ", ".join(f"{s // 1024} KiB: {t * 1e3:.3f} ms" for s, t in f[2])
        for n, f in fits.items()
    )
    per_world = ", ".join(
        f"{n}: {{busbw_GBps: {_num(f[1] / 1e9)}, latency_us: {_num(f[0] * 1e6)}}}"
        for n, f in fits.items()
    )

    def flat(d: dict) -> str:
        return "{" + ", ".join(f"{k}: {_num(v)}" for k, v in sorted(d.items())) + "}"

    link = f"{{busbw_GBps: {_num(beta / 1e9)}, efficiency: 1.0, latency_us: {_num(alpha * 1e6)}}}"
    text = f"""# Measured by `dtp simulate --calibrate` on {when}: {cores} cores, torch {torch.__version__}, one thread per rank.
# gloo all-reduce (c10d, in place, as dtp calls it) between ~3 ms compute segments, no barrier (time added per collective, slowest rank), alpha-beta per world:
{points_text}
name: {name}
description: this machine (CPU, gloo over loopback), measured {when}
calibrated: >-
  nothing fitted to a training step; every figure is a microbenchmark (dtp/simulate/calibrate_ops.py): the
  fastest Linear-shaped fp32 GEMM ({flops / 1e9:.2f} GFLOP/s, one thread) and each size's fraction of it for the
  forward x.W^T (gemm_efficiency) and the backward dy.W, dy^T.x (gemm_backward_efficiency); SDPA's rate and
  backward ratio; each memory-bound aten op's bandwidth over the elements ops.py counts and its backward ratio;
  the SGD step's bandwidth (op_GBps.optimizer); the vocabulary-parallel loss ({loss_impl}); an eager op's
  fixed forward and backward cost; gloo all-reduce
  at worlds {", ".join(map(str, worlds))} fitted to alpha-beta per world; the rate n
  concurrent ranks each get (rank_share).
gpu:
  name: cpu-rank
  peak_tflops: {{fp32: {flops / 1e12:.6g}}}
  achieved_fraction: 1.0
  memory_GiB: {mem:.1f}
  hbm_GBps: {bandwidth / 1e9:.4g}   # an elementwise add into a preallocated output: ops without a figure below
  gemm_efficiency: {flat(table)}
  gemm_backward_efficiency: {flat(backward)}
  attention_efficiency: {attention:.3f}
  attention_backward: {attention_back:.3f}
  op_GBps: {flat(op_bw)}
  op_backward: {flat(op_back)}
  op_overhead_us: {overhead * 1e6:.4g}
  backward_overhead_us: {back_overhead * 1e6:.4g}
  optimizer_tensor_us: {per_tensor * 1e6:.4g}
  optimizer_dtensor_us: {per_dtensor * 1e6:.4g}
  async_ops: false   # a CPU rank runs each op to completion: overhead and work add
node:
  gpus: 64
  compute_slots: {cores}
  rank_share: {flat(shares)}   # measured: each of n concurrent ranks' rate over one rank alone
  intra: {link}
  inter: {link}
  worlds: {{{per_world}}}
dp_overlap: false
"""
    return text, {
        "gemm_flops": flops,
        "gemm_efficiency": table,
        "gemm_backward_efficiency": backward,
        "attention": [attention, attention_back],
        "op_GBps": op_bw,
        "op_backward": op_back,
        "elementwise_bytes_per_s": bandwidth,
        "op_overhead_s": overhead,
        "backward_overhead_s": back_overhead,
        "optimizer_tensor_s": per_tensor,
        "optimizer_dtensor_s": per_dtensor,
        "alpha_s": alpha,
        "beta_bytes_per_s": beta,
        "allreduce": {n: f[2] for n, f in fits.items()},
        "allreduce_fit": {n: f[:2] for n, f in fits.items()},
        "rank_share": shares,
        "cores": cores,
    }
