"""`dtp simulate`: a training iteration at scale, predicted from FLOPs, the analytic communication
schedule and a hardware profile (no process group, meta device only); the paper's sweep; calibrating
this machine.

Imports `cost`, `checks`, `layout`, `runtime` (calibration's ranks) and below.
"""

from dtp.simulate.model import Run, simulate
from dtp.simulate.session import simulate_command

__all__ = ["Run", "simulate", "simulate_command"]
