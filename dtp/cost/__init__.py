"""What a checked plan costs, per rank and per training step, with no process group: the collective
schedule (exact counts and bytes), parameter bytes per rank, FSDP units, and `dtp explain`'s table.

Input: a `Checked` plan and its model. Output: `Collective` schedules, byte counts, an
`Explanation`. Imports `checks`, `layout`, `lang`, `models`, `errors`.
"""

from dtp.cost.explain import Explanation, human_bytes
from dtp.cost.param_bytes import param_bytes_per_rank
from dtp.cost.schedule import Collective, NotModeled, summarize

__all__ = [
    "Collective",
    "Explanation",
    "NotModeled",
    "human_bytes",
    "param_bytes_per_rank",
    "summarize",
]
