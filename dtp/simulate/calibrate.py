"""Measure this machine and write a profile: the single-process GEMM rate (one thread, as each `dtp apply`
rank runs) at several sizes, elementwise bandwidth, the fixed cost of one eager op, and gloo all-reduce
time at several sizes on loopback ranks, fitted to the α-β ring model 2(n−1)α + 2(n−1)/n · S/β. Nothing is fitted to a training step.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from dtp.runtime.ranks import on_ranks

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce buffers, bytes


def gemm_flops(n: int = 1024, seconds: float = 1.0) -> float:
    """Best-of-runs fp32 FLOP/s of an n × n × n matmul on one thread: the rate while the process holds a
    core (time other processes take is a CPU share, measured separately by simulate_check)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        rates, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end or len(rates) < 3:
            t0 = time.perf_counter()
            a @ b
            rates.append(2 * n ** 3 / (time.perf_counter() - t0))
        return max(rates)
    finally:
        torch.set_num_threads(threads)


def gemm_table(sizes: tuple[int, ...] = (128, 256, 512, 1024), seconds: float = 0.5) -> tuple[float, dict]:
    """(the fastest single-thread FLOP/s, GFLOP of one n³ matmul → its rate as a fraction of that)."""
    rates = {2 * n ** 3 / 1e9: gemm_flops(n, seconds) for n in sizes}
    top = max(rates.values())
    return top, {g: r / top for g, r in rates.items()}


def elementwise_bandwidth(n: int = 1 << 22, reps: int = 20) -> float:
    """Bytes per second of a single-thread elementwise add (two reads and one write per element), best of runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b, out = torch.ones(n), torch.ones(n), torch.empty(n)
        torch.add(a, b, out=out)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            torch.add(a, b, out=out)
            times.append(time.perf_counter() - t0)
        return 3 * 4 * n / min(times)
    finally:
        torch.set_num_threads(threads)


def op_overhead(reps: int = 2000) -> float:
    """Seconds of one eager op on a one-element tensor: dispatch cost with no work (median of batches)."""
    x = torch.ones(1)
    batches = []  # the median batch: a batch is long enough to be preempted, its best would be optimistic
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            x = x + 0.0
        batches.append((time.perf_counter() - t0) / reps)
    return statistics.median(batches)


def _allreduce_times(rank: int, world: int, sizes: tuple[int, ...], reps: int) -> list[float]:
    out = []
    for size in sizes:
        t = torch.ones(size // 4)
        dist.all_reduce(t)  # warm-up
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def allreduce_fit(world: int = 2, sizes: tuple[int, ...] = SIZES, reps: int = 7) -> tuple[float, float, list]:
    """(α seconds per ring step, β bus bytes per second, [(size, seconds)]) of gloo on `world` local ranks."""
    per_rank = on_ranks(_allreduce_times, world, sizes, reps)
    times = [max(ts) for ts in zip(*per_rank)]
    steps = 2 * (world - 1)
    xs = [2 * (world - 1) / world * s for s in sizes]  # bytes each rank sends
    # least squares of time = steps·α + x/β
    mx, my = statistics.fmean(xs), statistics.fmean(times)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, times)) / sum((x - mx) ** 2 for x in xs)
    alpha = max(0.0, (my - slope * mx) / steps)
    return alpha, 1.0 / max(slope, 1e-15), list(zip(sizes, times))


def profile_yaml(name: str, world: int = 2) -> tuple[str, dict]:
    """Measure and return (the profile's YAML text, the raw measurements)."""
    flops, table = gemm_table()
    bandwidth = elementwise_bandwidth()
    overhead = op_overhead()
    alpha, beta, points = allreduce_fit(world)
    cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    points_text = ", ".join(f"{s // 1024} KiB: {t * 1e3:.3f} ms" for s, t in points)
    table_text = ", ".join(f"{g:.4g}: {f:.3f}" for g, f in sorted(table.items()))
    link = f"{{busbw_GBps: {beta / 1e9:.4g}, efficiency: 1.0, latency_us: {alpha * 1e6:.4g}}}"
    text = f"""# Measured by `dtp simulate --calibrate` on {when}: {cores} cores, torch {torch.__version__}.
# gloo all-reduce on {world} loopback ranks (median of 7, slowest rank): {points_text}
name: {name}
description: this machine (CPU, gloo over loopback), measured {when}
calibrated: >-
  nothing fitted to a training step; GEMM rate ({flops / 1e9:.2f} GFLOP/s fp32, one thread, the fastest
  of 128^3-1024^3 matmuls) and each size's fraction of it (gemm_efficiency), single-thread elementwise-add bandwidth (hbm_GBps),
  the cost of one eager op on a one-element tensor (op_overhead_us) and the alpha-beta fit of gloo
  all-reduce ({world} ranks) are measurements.
gpu:
  name: cpu-rank
  peak_tflops: {{fp32: {flops / 1e12:.6g}}}
  achieved_fraction: 1.0
  memory_GiB: {mem:.1f}
  hbm_GBps: {bandwidth / 1e9:.4g}
  gemm_efficiency: {{{table_text}}}
  op_overhead_us: {overhead * 1e6:.4g}
  async_ops: false   # a CPU rank runs each op to completion: overhead and work add
node:
  gpus: 64
  compute_slots: {cores}
  intra: {link}
  inter: {link}
dp_overlap: false
"""
    return text, {"gemm_flops": flops, "gemm_efficiency": table, "elementwise_bytes_per_s": bandwidth,
                  "op_overhead_s": overhead, "alpha_s": alpha, "beta_bytes_per_s": beta,
                  "allreduce": points, "cores": cores}
