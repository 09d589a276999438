"""`dtp apply`: K training steps of the sharded model beside unsharded references (float64 and the
run's dtype), the parity verdict, and the report (communication, memory, speed).

Input: a plan and a model spec. Output: the report (rank 0). Imports `runtime` and everything below
it.
"""

from dtp.verify.apply import apply_command, launch_apply
from dtp.verify.rank import RunConfig

__all__ = ["apply_command", "launch_apply", "RunConfig"]
