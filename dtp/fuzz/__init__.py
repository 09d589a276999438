"""`dtp fuzz`: property-based fuzzing of sharding correctness: hypothesis draws meshes, models,
plans and mistakes; examples run in persistent pools of gloo ranks; failures shrink and save as
replayable cases (data).

Imports `verify`, `runtime` and below.
"""

from dtp.fuzz.session import fuzz_command

__all__ = ["fuzz_command"]
