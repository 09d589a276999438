"""`dtp bench`: scaling with interleaved arms next to a Megatron-style baseline, fuzz throughput, profiles,
and the GPU check (`dtp bench --device cuda`). Timings live here, never in a pass/fail test.

Imports every library package below `cli`.
"""
from dtp.bench.run import main

__all__ = ["main"]
