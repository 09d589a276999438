"""Measure this machine and write a profile: the single-process GEMM rate (one thread, as each `dtp apply`
rank runs), memory bandwidth (a large copy), and gloo all-reduce time at several sizes on loopback ranks,
fitted to the α-β ring model 2(n−1)α + 2(n−1)/n · S/β. Nothing is fitted to a training step.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from dtp.ranks import on_ranks

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # all-reduce buffers, bytes


def gemm_flops(n: int = 1024, seconds: float = 1.0) -> float:
    """Best-of-runs fp32 FLOP/s of an n × n × n matmul on one thread."""
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


def memory_bandwidth(nbytes: int = 64 << 20, reps: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


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
    flops = gemm_flops()
    bandwidth = memory_bandwidth()
    alpha, beta, points = allreduce_fit(world)
    cores = os.cpu_count() or 1
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    table = ", ".join(f"{s // 1024} KiB: {t * 1e3:.3f} ms" for s, t in points)
    link = f"{{busbw_GBps: {beta / 1e9:.4g}, efficiency: 1.0, latency_us: {alpha * 1e6:.4g}}}"
    text = f"""# Measured by `dtp simulate --calibrate` on {when}: {cores} cores, torch {torch.__version__}.
# gloo all-reduce on {world} loopback ranks (median of 7, slowest rank): {table}
name: {name}
description: this machine (CPU, gloo over loopback), measured {when}
calibrated: >-
  nothing fitted to a training step; GEMM rate ({flops / 1e9:.2f} GFLOP/s fp32, one thread, 1024^3 matmul),
  copy bandwidth and the alpha-beta fit of gloo all-reduce ({world} ranks) are measurements.
gpu:
  name: cpu-rank
  peak_tflops: {{fp32: {flops / 1e12:.6g}}}
  achieved_fraction: 1.0
  memory_GiB: {mem:.1f}
  hbm_GBps: {bandwidth / 1e9:.4g}
node:
  gpus: 64
  compute_slots: {cores}
  intra: {link}
  inter: {link}
dp_overlap: false
"""
    return text, {"gemm_flops": flops, "copy_bytes_per_s": bandwidth, "alpha_s": alpha, "beta_bytes_per_s": beta,
                  "allreduce": points, "cores": cores}
