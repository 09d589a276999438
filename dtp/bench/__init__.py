"""`dtp bench`: scaling with interleaved arms next to a Megatron-style baseline, fuzz throughput,
profiles, and the GPU check (`dtp bench --device cuda`). Timings live here, never in a pass/fail
test. One-off lab scripts are not shipped: they live in the checkout's bench/
(tests/test_repository.py holds that).

Imports every library package below `cli`.
"""

from dtp.bench.run import main

__all__ = ["main"]
