"""Check rules for each claimed module: the style fits the module, packed parts split, tp divides
what the style shards (vocabulary rows may be uneven), and, in attention, whole heads per rank
(dtp/checks/heads.py)."""

from __future__ import annotations

import torch.nn as nn

from dtp.checks import heads, norms, parts, slices
from dtp.checks.messages import MAX_TP_SHOWN, Reporter, working_tp
from dtp.lang import ir, vocabulary
from dtp.layout import attention
from dtp.layout.modules import features, is_experts, is_linear
from dtp.layout.norms import is_norm
from dtp.layout.resolve import Resolution
from dtp.layout.styles import SPECS, Style
from dtp.models import vocab_size


def module_fits(style: str, module: nn.Module, vocab: int | None) -> str | None:
    """None when `style` can apply to `module`, else what the style needs."""
    if style in (Style.COLWISE, Style.ROWWISE):
        return (
            None if is_linear(module) else f"{style} applies to nn.Linear or transformers' Conv1D"
        )
    if style == Style.EXPERTS:
        return (
            None
            if is_experts(module)
            else (
                "experts applies to a module with 3-D expert parameters gate_up_proj (E, 2·I, H) "
                "and down_proj "
                "(E, H, I), or transposed (E, H, 2·I) and (E, I, H), optionally gate_up_proj_bias "
                "(E, 2·I) and "
                "down_proj_bias (E, H), and no other parameters of its own"
            )
        )
    if style == Style.VOCAB_PARALLEL:
        if isinstance(module, nn.Embedding):
            return None
        if isinstance(module, nn.Linear):
            if vocab is None or module.out_features == vocab:
                return None
            return (
                "vocab_parallel on an nn.Linear applies to the output projection (out_features == "
                "vocab "
                f"size {vocab}), not one with out_features={module.out_features}"
            )
        return "vocab_parallel applies to nn.Embedding or the output nn.Linear"
    if style == Style.SEQUENCE_PARALLEL:
        if is_norm(module) or isinstance(module, nn.Dropout):
            return None
        return "sequence_parallel applies to LayerNorm, RMSNorm or Dropout"
    if style == Style.SHARDED_NORM:
        weight = getattr(module, "weight", None)
        if is_norm(module) and isinstance(weight, nn.Parameter) and weight.dim() == 1:
            return None
        return "sharded_norm applies to an RMS norm with a 1-D weight"
    return None


def _attention_of(res: Resolution, path: str) -> tuple[str, nn.Module] | None:
    """The attention-like module that owns Linear `path` (its parent), if any."""
    parent = path.rpartition(".")[0]
    module = res.modules.get(parent) if "." in path else None
    return (parent, module) if module is not None and attention.attention_like(module) else None


def _check_vocab(
    style: ir.Style, path: str, what: str, size: int, tp: int | None, rep: Reporter
) -> None:
    """Uneven vocabulary shards are fine (torch.chunk's layout), shards that leave the last ranks
    empty are not."""
    if tp and -(-size // tp) * (tp - 1) >= size:
        good = [t for t in range(1, min(size, MAX_TP_SHOWN) + 1) if -(-size // t) * (t - 1) < size]
        rep.add(
            style.pos,
            len(style.name),
            path,
            f"vocab_parallel shards {what} over tp={tp}, which leaves the "
            f"last ranks without rows (torch.chunk layout); tp values up to {good[-1]} work",
        )


def check_modules(
    res: Resolution, model: nn.Module, tp: int | None, rep: Reporter, sizes: list[int]
) -> bool:
    """Style fits, packed parts, divisibility and heads of every claimed module; False when a style
    does not fit. `sizes` collects every size tp must divide (the admissible tp values)."""
    vocab = vocab_size(model)
    fits = True
    for path, rule in res.claims.items():
        module, style = res.modules[path], rule.style
        if style.name not in SPECS:
            continue
        length = len(style.name)
        problem = module_fits(style.name, module, vocab)
        if problem:
            rep.add(style.pos, length, path, f"{problem}; this module is {type(module).__name__}")
            fits = False
            continue
        if style.name == Style.SLICE_INPUT:
            slices.check_slice_input(path, style, module, res.modules[""], tp, rep, sizes)
            continue
        if style.name == Style.SLICE_PARAMS:
            slices.check_slice_params(path, style, module, res, tp, rep)
            continue
        # an RMS norm over colwise-sharded features (dtp/checks/norms.py)
        if style.name == Style.SHARDED_NORM:
            before = len(rep.groups)
            norms.check_sharded_norm(res, path, style, rep)
            if len(rep.groups) != before:
                fits = False
                continue
        # unequal or replicated parts (dtp/layout/parts.py)
        if isinstance(style.option("packed"), ir.PartList):
            before = len(rep.groups)
            parts.check_parts(path, module, style, res.modules[""], tp, rep, sizes)
            # parts that do not fit give no layout to follow
            fits = fits and len(rep.groups) == before
            continue
        packed = vocabulary.packed(style)
        fan_in, fan_out = features(module) if is_linear(module) else (0, 0)
        owner = _attention_of(res, path) if style.name in (Style.COLWISE, Style.ROWWISE) else None
        info = attention.heads(model, *owner) if owner else None
        if (
            info
            and style.name == Style.COLWISE
            and not heads.check_fused_parts(path, style, owner[1], module, info, rep, tp)
        ):
            continue
        if packed > 1 and fan_out % packed:
            rep.add(
                style.pos,
                length,
                path,
                f"packed={packed} needs out_features={fan_out} to split into {packed} equal parts",
            )
            continue
        for what, size in SPECS[style.name].sizes(module, packed):
            if style.name == Style.VOCAB_PARALLEL:
                _check_vocab(style, path, what, size, tp, rep)
                continue
            sizes.append(size)
            if tp and size % tp:
                rep.add(
                    style.pos,
                    length,
                    path,
                    f"{style.name} shards {what} over tp={tp}, which does not divide it; "
                    f"tp values that work: {working_tp(size)}",
                )
        if info:
            width = fan_out // packed if style.name == Style.COLWISE else fan_in
            heads.check_whole_heads(path, style, info, width, packed, tp, rep, sizes, owner[1])
    return fits
