"""Parameters no rule names that run on the features a colwise layer shards: each rank's gradient is
then a partial sum, and the ranks drift apart from the first optimizer step.

`dtp apply`'s parity finds this after a run; `dtp train` runs no parity, so `check` refuses it
first. A module is suspect when it sits in the same container as a colwise layer whose output stays
sharded, has parameters of its own, is no Linear (the layout flow judges those) and has no parameter
as wide as the hidden size (those read the full activation: a pre-norm, a residual scale over the
model's width). Per-head norms (Qwen3's, Hunyuan's under a plan that forgot them) and learnt
activation scalars (Apertus's xIELU) are what it catches; `replicate(reduce_grad=true)` sums their
gradient, a plain `replicate` says that the module reads full activations only.
"""

from __future__ import annotations

import torch.nn as nn

from dtp.layout.attention import attention_like, heads
from dtp.layout.modules import is_linear
from dtp.layout.resolve import generic_path, sharded_colwise


def hidden_size(model: nn.Module) -> int | None:
    """The model's width: its config's, else its input embedding's (None when neither says)."""
    config = getattr(model, "config", None)
    for name in ("hidden_size", "n_embd", "d_model", "dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    return embeddings[0].embedding_dim if embeddings else None


def check_partial_grads(res, model: nn.Module, tp: int | None, rep) -> None:
    """Report each unnamed parametrised module that shares a container with a colwise layer's
    sharded output."""
    hidden = hidden_size(model)
    if tp == 1 or hidden is None:
        return
    for parent, projs in sharded_colwise(res).items():
        if parent not in res.modules:
            continue
        proj, rule = projs[0], res.claims[projs[0]]
        for sub, module in res.modules[parent].named_modules():
            path = f"{parent}.{sub}" if sub else parent
            own = [(n, p) for n, p in module.named_parameters(recurse=False) if p.requires_grad]
            if (
                not own
                or is_linear(module)
                or isinstance(module, nn.Embedding)
                or _claimed(res, path)
                or any(hidden in p.shape for _, p in own)
            ):
                continue
            names = ", ".join(f"{n} {tuple(p.shape)}" for n, p in own[:3])
            if not sub and _per_head(model, path, module, own):
                per_head = ", ".join(n for n, _ in own)
                per_head = f"[{per_head}]" if len(own) > 1 else per_head
                rep.add(
                    rule.style.pos,
                    len(rule.style.name),
                    path,
                    f"{type(module).__name__} holds per-head parameters ({names}) that no rule "
                    "slices: each "
                    "rank would apply every head's values to the heads it holds; add "
                    f"`{generic_path(path)}: slice_params(name={per_head})`, or keep this attention "
                    "whole (no "
                    "colwise or rowwise in it)",
                )
                continue
            here = sub or "the container itself"
            rep.add(
                rule.style.pos,
                len(rule.style.name),
                path,
                f"{here} ({type(module).__name__}) holds parameters ({names}) no rule names, beside "
                ""
                f"{proj.rsplit('.', 1)[-1]}, whose colwise output stays sharded: if they act on the "
                "features "
                "each rank holds, each rank's gradient is a partial sum and the ranks drift apart; "
                "add "
                f"`{generic_path(path)}: replicate(reduce_grad=true)`, or `{generic_path(path)}: "
                "replicate` if it "
                "reads full activations only",
            )


def _per_head(model: nn.Module, path: str, module: nn.Module, own: list) -> bool:
    """Whether an attention module's own parameters hold one value per head (GPT-OSS's `sinks`)."""
    info = heads(model, path, module) if attention_like(module) else None
    return info is not None and any(
        p.dim() >= 1 and p.shape[0] in (info.n_head, info.n_kv_head) for _, p in own
    )


def _claimed(res, path: str) -> bool:
    """Whether a rule names `path` or a module above it (an `experts` rule covers its children)."""
    parts = path.split(".")
    return any(".".join(parts[:i]) in res.claims for i in range(1, len(parts) + 1))
