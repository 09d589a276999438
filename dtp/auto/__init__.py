"""`dtp plan --auto` and `dtp search`: a plan written from a model's structure, and the best layout
for a cluster.

Stages: `structure` finds the embedding, the head, the blocks and, inside each block, the modules
whose linear layers form a colwise → rowwise pair (from the forward's data flow); `attention` and
`ffn` write the rules of one such module; `planner` writes the plan, has `dtp check` judge it at
every tp it claims, and leaves whatever the checker refuses replicated with the checker's reason;
`search` prices layouts with `dtp simulate`.

Imports `simulate`, `checks`, `layout`, `lang`, `models` and everything below them.
"""

from dtp.auto.planner import AutoPlan, auto_plan

__all__ = ["AutoPlan", "auto_plan"]
