"""Hardware profiles: YAML data (never code), strict keys, bounded values.

A profile describes one node type: its accelerators' peak and achieved GEMM rate, memory, and the
links collectives run over (α-β: latency per ring step, bus bandwidth × an efficiency). Shipped
profiles live in `profiles/` (inside the wheel as `dtp/profiles/`); any other path is read as a
file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from dtp import files
from dtp.errors import UsageError, clip, shorten

MAX_BYTES = 64 * 1024
PRECISIONS = ("fp16", "bf16", "fp32")


@dataclass(frozen=True)
class Link:
    """A network that collectives run over: bus bandwidth (GB/s, nccl-tests' busBW) × efficiency,
    and a latency per ring step (µs)."""

    busbw_GBps: float
    latency_us: float
    efficiency: float = 1.0

    @property
    def bytes_per_s(self) -> float:
        """Effective bus bandwidth in bytes per second."""
        return self.busbw_GBps * 1e9 * self.efficiency


@dataclass(frozen=True)
class Profile:
    """One node type. `inter.busbw_GBps` is the node's total inter-node bandwidth (all NICs, one
    direction); `intra` is per GPU. `compute_slots`: how many ranks compute at full rate at once
    (GPUs: all of them; a CPU: its cores)."""

    name: str
    description: str
    gpu_name: str
    peak_tflops: dict[str, float]
    achieved_fraction: float
    memory_GiB: float
    hbm_GBps: float
    gpus_per_node: int
    compute_slots: int
    intra: Link
    inter: Link
    dp_overlap: bool
    calibrated: str
    # (GFLOP of one op, fraction of the rate), sorted
    gemm_efficiency: tuple[tuple[float, float], ...] = ()
    op_overhead_us: float = 0.0  # fixed cost of every op: dispatch + kernel launch
    # GPUs queue kernels: an op costs max(overhead, work); a CPU rank adds them
    async_ops: bool = True
    # Measured per machine by `--calibrate` (a CPU rank); a GPU profile leaves them at the defaults:
    # dx = dy·W and dW = dyᵀ·x (else the forward's)
    gemm_backward_efficiency: tuple[tuple[float, float], ...] = ()
    attention_efficiency: float = 1.0  # the fused attention kernel's FLOP rate ÷ the GEMM rate
    attention_backward: float = 0.0  # its backward ÷ its forward (0: 2.5 for flash, 2 otherwise)
    # fixed cost of one op's backward (negative: twice op_overhead_us)
    backward_overhead_us: float = -1.0
    # the optimizer step's fixed cost per parameter tensor (torch's per-tensor loop)
    optimizer_tensor_us: float = 0.0
    # the same for a sharded (DTensor) parameter: DTensor dispatches each op
    optimizer_dtensor_us: float = 0.0
    # aten op → its forward bandwidth over the traffic ops.py counts
    op_GBps: tuple[tuple[str, float], ...] = ()
    op_backward: tuple[tuple[str, float], ...] = ()  # aten op → its backward ÷ its forward (else 2)
    # n concurrent ranks → each one's rate over one alone
    rank_share: tuple[tuple[float, float], ...] = ()
    # group size → its own α-β (gloo ranks time-sharing cores)
    worlds: tuple[tuple[int, Link], ...] = ()

    def flops_per_s(self, precision: str) -> float:
        """Achieved dense GEMM FLOP/s of one accelerator at `precision`."""
        if precision not in self.peak_tflops:
            raise UsageError(
                f"profile {self.name} has no peak_tflops for {precision} "
                f"(it has: {', '.join(self.peak_tflops)})"
            )
        return self.peak_tflops[precision] * 1e12 * self.achieved_fraction

    def gemm_fraction(self, flops: float) -> float:
        """Fraction of `flops_per_s` one GEMM of `flops` reaches: the table, log-linear between its
        points, flat beyond its ends (1.0 without a table)."""
        table = self.gemm_efficiency
        if not table:
            return 1.0
        x = math.log(max(flops, 1.0) / 1e9)
        points = [(math.log(g), f) for g, f in table]
        if x <= points[0][0]:
            return points[0][1]
        for (x0, f0), (x1, f1) in zip(points, points[1:]):
            if x <= x1:
                return f0 + (f1 - f0) * (x - x0) / (x1 - x0)
        return points[-1][1]

    def gemm_backward_fraction(self, flops: float) -> float:
        """As `gemm_fraction`, for the two backward GEMMs of a forward one (the forward's table if
        none)."""
        if not self.gemm_backward_efficiency:
            return self.gemm_fraction(flops)
        return replace(self, gemm_efficiency=self.gemm_backward_efficiency).gemm_fraction(flops)

    def share(self, ranks: int) -> float:
        """The fraction of its rate each of `ranks` concurrent ranks on one node gets: measured
        (rank_share, nearest measured count at or above), else compute_slots ÷ ranks, at most 1."""
        measured = [f for n, f in self.rank_share if n >= ranks]
        if measured:
            return measured[0]
        return min(1.0, self.compute_slots / max(ranks, 1))

    def link_for(self, ranks: int, default: Link) -> Link:
        """The link a group of `ranks` runs its collectives over: its own measured fit, else
        `default`."""
        return dict(self.worlds).get(ranks, default)

    def bandwidth(self, op: str) -> float:
        """Bytes per second of memory-bound aten op `op` (its calibrated figure, else `hbm_GBps`)."""
        return dict(self.op_GBps).get(op, self.hbm_GBps) * 1e9

    def has(self, op: str) -> bool:
        """Whether the profile has a measured bandwidth for `op`."""
        return op in dict(self.op_GBps)

    def backward_ratio(self, op: str) -> float:
        """The backward of memory-bound op `op` ÷ its forward: calibrated, else 2 (read and write
        twice)."""
        return dict(self.op_backward).get(op, 2.0)


# key → (type, lower bound, upper bound); nested dicts are sections.
_LINK = {
    "busbw_GBps": (float, 1e-6, 1e6),
    "latency_us": (float, 0.0, 1e7),
    "efficiency": (float, 1e-3, 1.0),
}
_SCHEMA = {
    "name": (str, 1, 100),
    "description": (str, 0, 2000),
    "calibrated": (str, 0, 2000),
    "gpu": {
        "name": (str, 1, 100),
        "peak_tflops": {p: (float, 1e-6, 1e5) for p in PRECISIONS},
        "achieved_fraction": (float, 1e-3, 1.0),
        "memory_GiB": (float, 1e-3, 1e5),
        "hbm_GBps": (float, 1e-3, 1e6),
        "gemm_efficiency": "table",
        "op_overhead_us": (float, 0.0, 1e6),
        "async_ops": (bool, None, None),
        "gemm_backward_efficiency": "table",
        "attention_efficiency": (float, 1e-3, 1.0),
        "attention_backward": (float, 0.5, 20.0),
        "backward_overhead_us": (float, 0.0, 1e6),
        "optimizer_tensor_us": (float, 0.0, 1e6),
        "optimizer_dtensor_us": (float, 0.0, 1e6),
        "op_GBps": "named",
        "op_backward": "named",
    },
    "node": {
        "gpus": (int, 1, 4096),
        "compute_slots": (int, 1, 4096),
        "intra": _LINK,
        "inter": _LINK,
        "rank_share": "table",
        "worlds": "links",
    },
    "dp_overlap": (bool, None, None),
}
_REQUIRED = {
    "name",
    "gpu",
    "gpu.name",
    "gpu.peak_tflops",
    "gpu.achieved_fraction",
    "gpu.memory_GiB",
    "gpu.hbm_GBps",
    "node",
    "node.gpus",
    "node.intra",
    "node.inter",
    "node.intra.busbw_GBps",
    "node.intra.latency_us",
    "node.inter.busbw_GBps",
    "node.inter.latency_us",
}


def profile_names() -> list[str]:
    """Names of the profiles that ship with dtp (dtp/profiles in a wheel, profiles/ in a checkout)."""
    return sorted(
        p.name[:-5] for p in files.shipped("profiles").iterdir() if p.name.endswith(".yaml")
    )


def load(spec: str) -> Profile:
    """A shipped profile by name, or a YAML file by path; every problem is a UsageError (exit 2)."""
    folder = files.shipped("profiles")
    candidate = folder / f"{spec}.yaml"
    if "/" not in spec and not spec.endswith((".yaml", ".yml")) and candidate.is_file():
        return parse(candidate.read_text(encoding="utf-8"), spec)
    path = Path(spec)
    if not path.exists():
        raise UsageError(
            f"profile '{clip(spec, 200)}' is neither a file nor a shipped profile "
            f"(shipped: {', '.join(profile_names())})"
        )
    return _parsed(files.load_yaml(path, "profile", MAX_BYTES), spec)


def parse(text: str, where: str) -> Profile:
    """Validate profile YAML text (the bounded loader of dtp/files.py; unknown keys, wrong types,
    out-of-range values are errors)."""
    if len(text) > MAX_BYTES:
        raise UsageError(
            f"profile {where} is {len(text)} characters; a profile is at most {MAX_BYTES // 1024} "
            "KiB"
        )
    return _parsed(files.parse_yaml(text, "profile", where), where)


def _parsed(data: object, where: str) -> Profile:
    """The Profile of loaded YAML data, every key and value checked."""
    where = clip(where, 200)
    if not isinstance(data, dict):
        raise UsageError(f"{where}: a profile is a mapping of keys (see profiles/dgx2h-v100.yaml)")
    _validate(data, _SCHEMA, "", where)
    missing = sorted(k for k in _REQUIRED if _get(data, k) is None)
    if missing:
        raise UsageError(
            f"{where}: missing key{'s' if len(missing) > 1 else ''} {', '.join(missing)}"
        )
    gpu, node = data["gpu"], data["node"]
    if not gpu["peak_tflops"]:
        raise UsageError(f"{where}: gpu.peak_tflops needs at least one of {', '.join(PRECISIONS)}")
    return Profile(
        name=data["name"],
        description=data.get("description", ""),
        gpu_name=gpu["name"],
        peak_tflops={k: float(v) for k, v in gpu["peak_tflops"].items()},
        achieved_fraction=float(gpu["achieved_fraction"]),
        memory_GiB=float(gpu["memory_GiB"]),
        hbm_GBps=float(gpu["hbm_GBps"]),
        gpus_per_node=node["gpus"],
        compute_slots=node.get("compute_slots", node["gpus"]),
        intra=Link(**{k: float(v) for k, v in node["intra"].items()}),
        inter=Link(**{k: float(v) for k, v in node["inter"].items()}),
        dp_overlap=bool(data.get("dp_overlap", False)),
        calibrated=data.get("calibrated", ""),
        gemm_efficiency=tuple(
            sorted((float(g), float(f)) for g, f in gpu.get("gemm_efficiency", {}).items())
        ),
        op_overhead_us=float(gpu.get("op_overhead_us", 0.0)),
        async_ops=bool(gpu.get("async_ops", True)),
        gemm_backward_efficiency=tuple(
            sorted((float(g), float(f)) for g, f in gpu.get("gemm_backward_efficiency", {}).items())
        ),
        attention_efficiency=float(gpu.get("attention_efficiency", 1.0)),
        attention_backward=float(gpu.get("attention_backward", 0.0)),
        backward_overhead_us=float(gpu.get("backward_overhead_us", -1.0)),
        optimizer_tensor_us=float(gpu.get("optimizer_tensor_us", 0.0)),
        optimizer_dtensor_us=float(gpu.get("optimizer_dtensor_us", 0.0)),
        op_GBps=tuple(sorted((k, float(v)) for k, v in gpu.get("op_GBps", {}).items())),
        op_backward=tuple(sorted((k, float(v)) for k, v in gpu.get("op_backward", {}).items())),
        rank_share=tuple(
            sorted((float(n), float(f)) for n, f in node.get("rank_share", {}).items())
        ),
        worlds=tuple(
            sorted(
                (int(n), Link(**{k: float(v) for k, v in link.items()}))
                for n, link in node.get("worlds", {}).items()
            )
        ),
    )


def _get(data: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _validate(data: dict, schema: dict, prefix: str, where: str) -> None:
    for key, value in data.items():
        name = clip(f"{prefix}{key}", 80)
        if not isinstance(key, str) or key not in schema:
            allowed = ", ".join(schema)
            raise UsageError(f"{where}: unknown key '{name}' (allowed here: {allowed})")
        rule = schema[key]
        if rule == "table":
            _check_table(value, name, where)
            continue
        if rule == "named":
            _check_named(value, name, where)
            continue
        if rule == "links":
            _check_links(value, name, where)
            continue
        if isinstance(rule, dict):
            if not isinstance(value, dict):
                raise UsageError(f"{where}: '{name}' must be a mapping")
            _validate(value, rule, name + ".", where)
            continue
        kind, low, high = rule
        _check_value(value, kind, low, high, name, where)


def _check_table(value, name: str, where: str) -> None:
    # GFLOP of one GEMM → the fraction of the achieved rate it reaches
    if not isinstance(value, dict) or not 1 <= len(value) <= 32:
        raise UsageError(
            f"{where}: '{name}' must be a mapping of 1–32 entries, GFLOP per op: fraction"
        )
    for gflop, frac in value.items():
        _check_value(gflop, float, 1e-9, 1e9, f"{name} key", where)
        _check_value(frac, float, 1e-3, 1.0, f"{name}[{gflop}]", where)


def _check_links(value, name: str, where: str) -> None:
    # group size → a link (busbw_GBps, latency_us, efficiency)
    if not isinstance(value, dict) or not 1 <= len(value) <= 16:
        raise UsageError(f"{where}: '{name}' must be a mapping of 1–16 entries, group size: link")
    for size, link in value.items():
        _check_value(size, int, 2, 4096, f"{name} key", where)
        if not isinstance(link, dict):
            raise UsageError(
                f"{where}: '{name}[{size}]' must be a mapping (busbw_GBps, latency_us)"
            )
        _validate(link, _LINK, f"{name}[{size}].", where)
        if "busbw_GBps" not in link or "latency_us" not in link:
            raise UsageError(f"{where}: '{name}[{size}]' needs busbw_GBps and latency_us")


def _check_named(value, name: str, where: str) -> None:
    # aten op name → a positive figure (a bandwidth in GB/s, or a backward ÷ forward ratio)
    if not isinstance(value, dict) or not 1 <= len(value) <= 64:
        raise UsageError(
            f"{where}: '{name}' must be a mapping of 1–64 entries, aten op name: number"
        )
    for op, figure in value.items():
        _check_value(op, str, 1, 80, f"{name} key", where)
        _check_value(figure, float, 1e-6, 1e6, f"{name}[{clip(str(op), 40)}]", where)


def _check_value(value, kind: type, low, high, name: str, where: str) -> None:
    if kind is bool:
        if not isinstance(value, bool):
            raise UsageError(f"{where}: '{name}' must be true or false, got {shorten(value)}")
        return
    if kind is str:
        if not isinstance(value, str) or not low <= len(value) <= high:
            raise UsageError(f"{where}: '{name}' must be a string of {low}–{high} characters")
        return
    numeric = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        raise UsageError(
            f"{where}: '{name}' must be {'an integer' if kind is int else 'a number'}, got "
            f"{shorten(value)}"
        )
    if not low <= value <= high:  # NaN fails both comparisons
        raise UsageError(
            f"{where}: '{name}' = {clip(str(value), 60)} is out of range [{low}, {high}]"
        )
