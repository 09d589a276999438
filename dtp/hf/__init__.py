"""Hugging Face models: shipped plans (`plans/hf`), tp_plan import and export (`dtp plan`), the
family sweep (`python -m dtp.hf.variants`) and its one-variant verifier.

Imports `verify`, `checkpoint`, `runtime` and everything below them.
"""

from dtp.hf.plan import PLANS, export_for, export_plan, from_hf, import_plan

__all__ = ["PLANS", "export_for", "export_plan", "from_hf", "import_plan"]
