"""The command line's argument types: argparse only. Nothing in the library imports this module,
and it never imports torch."""

from __future__ import annotations

import argparse
import math
import re
from typing import Callable

from dtp.runtime.job import MAX_SEED, MAX_TIMEOUT  # the limits a Job holds every command to


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, got '{text[:40]}'"
        ) from None


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text[:40]}")
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (no nan, inf, 0 or negative)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got '{text[:40]}'") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text[:40]}")
    return value


def timeout_seconds(text: str) -> float:
    """argparse type: a finite number of seconds in (0, one week]."""
    value = positive_float(text)
    if value > MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_TIMEOUT:.0f} seconds (a week), got {text[:40]}"
        )
    return value


def stall_seconds(text: str) -> float:
    """argparse type: 0 (off), or seconds in [1, one week] (the watchdog ticks a tenth of it)."""
    if text.strip() in ("0", "0.0"):
        return 0.0
    value = timeout_seconds(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected 0 (off) or at least 1 second, got {text[:40]}")
    return value


def seed_int(text: str) -> int:
    """argparse type: an integer seed in [0, 2^63 - 2^16]."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got '{text[:40]}'") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"seed must be between 0 and {MAX_SEED}, got {text[:40]}")
    return value


def tp_list(text: str) -> list[int]:
    """argparse type: two or more distinct tp sizes, `1,2,4`."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated tp sizes like 1,2,4, got '{text[:40]}'"
        ) from None
    if len(values) < 2 or any(v < 1 for v in values) or len(set(values)) != len(values):
        # one tp compared with itself would pass vacuously
        raise argparse.ArgumentTypeError(
            f"expected two or more distinct positive tp sizes, got '{text[:40]}'"
        )
    return values


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
}


MAX_MEMORY = 2**60  # bytes (an exbibyte): more is a typo, and its float would be inf


def memory_size(text: str) -> int:
    """'3000000', '1.5MiB', '2GB' → bytes (an argparse type), at most MAX_MEMORY."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and _UNITS.get(m.group(2).lower())
    if not m or unit is None or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive size like 3000000, 512KiB or 1.5GiB, got '{text[:40]}'"
        )
    value = float(m.group(1)) * unit
    if value > MAX_MEMORY:
        raise argparse.ArgumentTypeError(
            f"expected at most {MAX_MEMORY} bytes (1 EiB), got '{text[:40]}'"
        )
    return int(value)


def bounded(limit: int, low: int = 1) -> Callable[[str], int]:
    """argparse type: an integer in [`low`, `limit`] (a size whose typo must not ask for a million
    GPUs)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not low <= value <= limit:
            raise argparse.ArgumentTypeError(
                f"expected an integer in [{low}, {limit}], got {text[:40]}"
            )
        return value

    return parse
