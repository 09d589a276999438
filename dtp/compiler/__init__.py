"""Checked plan → ParallelStyles: dtp's Megatron layers where the layout is Megatron's (column/row
pairs, the vocabulary-parallel ends and loss), torch's own elsewhere, and dtp's where torch has none
(packed and placed parts, Conv1D, experts, per-head slices, sharded norms, shared inputs, per-rank
attribute rewrites).

Input: a `Checked` plan, the model and a mesh. Output: `Compiled` (the `parallelize_module` plan).
Imports `checks`, `layout`, `lang`.
"""

from dtp.compiler.compiler import Compiled, compile_plan, tp_mesh

__all__ = ["Compiled", "compile_plan", "tp_mesh"]
