"""Hugging Face `tp_plan` ⇄ `.tp` plans: `dtp plan --from-hf MODEL [-o FILE]`, `dtp plan --to-hf
PLAN`.

Import prefers the shipped `plans/hf/<config.model_type>.tp`; otherwise it maps the model's
`_tp_plan` (its `base_model_tp_plan` with the base model's prefix, plus the head's entries). Keys
are module paths whose numeric segments HF writes as `*`; dtp's `*` matches any one segment, which
is the same set for these paths. Every current and legacy HF style string is mapped or named as
lossy (a `# lossy:` comment in the plan and a warning on stderr).
"""

from __future__ import annotations

import re

import torch.nn as nn

from dtp import models
from dtp.checks.checker import check
from dtp.errors import PlanError, UsageError, clip
from dtp.files import shipped
from dtp.lang import conditions, ir
from dtp.lang.parse import parse, parser
from dtp.layout.experts import experts_layout
from dtp.layout.resolve import matches

PLANS = shipped("plans/hf")  # plans/hf in a checkout; dtp/plans/hf inside a wheel

# HF style string → dtp style text (None: not expressible; the rule is dropped with a warning)
IMPORT: dict[str, str | None] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise(output=replicate)",
    "colwise_rep": "colwise(output=replicate)",
    "rowwise_split_input": "rowwise(input=replicate)",
    "rowwise_rep": "rowwise(input=replicate)",
    "embedding_rowwise": "vocab_parallel",
    "packed_colwise": "colwise(packed=2)",
    "sequence_parallel": "sequence_parallel",
    "replicate": "replicate",
    "replicated_with_grad_allreduce": "replicate(reduce_grad=true)",
    # the same maths without DTensor (lossy: local)
    "local_colwise": "colwise",
    "local_rowwise": "rowwise",
    # whole heads (transformers 5.25); lossy: replicas
    "unit_colwise": "colwise",
    "unit_rowwise": "rowwise",
    "packed_rowwise": None,
    "local_packed_rowwise": None,
    "local": None,
    "gather": None,
    "all_reduce": None,
    "mla_kv_a_proj": None,
    "grouped_gemm": None,
    "ep_router": None,
    "ep_dispatch_experts": None,
    "moe_identity_expert": None,
    "megamoe_router": None,
    "megamoe_experts": None,
    "moe_tp_experts": "experts",
    # hidden-dim embedding; a module's own per-head parameters
    "embedding_colwise": None,
    "local_params": None,
}
LOSSY = {
    "local_colwise": "runs on local tensors in HF; dtp uses DTensor (same layout)",
    "local_rowwise": "runs on local tensors in HF; dtp uses DTensor (same layout)",
    "unit_colwise": "keeps whole heads, replicated where tp does not divide them; dtp's colwise splits them "
    "evenly (check refuses another tp, and names colwise(packed=[repeat(kv)]) for k/v heads)",
    "unit_rowwise": "reads whole heads, replicated where tp does not divide them; dtp's rowwise splits them "
    "evenly",
}


def hf_plan_of(model: nn.Module) -> dict[str, str]:
    """The model's full HF tp_plan (keys from the model root)."""
    own = getattr(model, "_tp_plan", None)
    plan = dict(own) if isinstance(own, dict) else {}  # a config's data: anything else is no plan
    if not plan:
        config = getattr(model, "config", None)
        base = getattr(config, "base_model_tp_plan", None)
        prefix = getattr(model, "base_model_prefix", "model")
        plan = {f"{prefix}.{k}": v for k, v in base.items()} if isinstance(base, dict) else {}
    return plan


def import_plan(
    plan: dict[str, str], name: str = "imported", model: nn.Module | None = None
) -> tuple[str, list[str]]:
    """(.tp text, warnings) for an HF tp_plan dict; with `model`, keys that match none of its
    modules are comments (HF skips them: Qwen3-MoE's plan names the dense MLP of `mlp_only_layers` a
    model may lack)."""

    warnings: list[str] = []
    plan = _valid_entries(plan, warnings)
    experts = {k for k, v in plan.items() if v == "moe_tp_experts"}
    paths = [path for path, _ in model.named_modules() if path] if model is not None else None
    lines = [
        "# imported from a Hugging Face tp_plan by `dtp plan --from-hf`",
        "dtp 1",
        f"plan {name} version 1",
        "",
    ]
    for key, style in plan.items():
        if any(key.startswith(e + ".") for e in experts):
            continue  # gate_up_proj / down_proj of an `experts` module: covered by its rule
        if paths is not None and not any(
            matches(ir.Pattern(tuple(key.split("."))), path) for path in paths
        ):
            lines.append(f"# not in this model (HF skips it): {key}: {style}")
            continue
        if style not in IMPORT:
            warnings.append(f"{key}: unknown Hugging Face style '{style}'; rule dropped")
            lines.append(f"# lossy: {key}: unknown style '{style}' dropped")
            continue
        mapped = IMPORT[style]
        if mapped is None:
            warnings.append(
                f"{key}: '{style}' has no dtp equivalent; rule dropped (module stays replicated)"
            )
            lines.append(f"# lossy: {key}: '{style}' has no dtp equivalent; left replicated")
            continue
        if style in LOSSY:
            warnings.append(f"{key}: '{style}' {LOSSY[style]}")
            lines.append(f"# lossy: '{style}' {LOSSY[style]}")
        lines.append(f"{key}: {mapped}")
    return "\n".join(lines) + "\n", warnings


# every HF style name; anything else is not echoed into the plan
_STYLE = re.compile(r"[a-z_]{1,64}")
MAX_KEY = 512
MAX_ENTRIES = 4096  # each entry is parsed on its own


def _valid_entries(plan: dict, warnings: list[str]) -> dict[str, str]:
    """The entries whose key is one PATTERN of the plan language and whose style is a style name: a
    newline or other control character in either would write a line of its own into the plan (an
    injected rule). The others are dropped here, named (escaped) in a warning and never written to
    the plan, not even as comments."""
    if len(plan) > MAX_ENTRIES:
        raise UsageError(
            f"the tp_plan has {len(plan)} entries; a model's plan has at most {MAX_ENTRIES}"
        )
    pattern = re.compile(parser().get_terminal("PATTERN").pattern.to_regexp())
    kept: dict[str, str] = {}
    for key, style in plan.items():
        if (
            not isinstance(key, str)
            or len(key) > MAX_KEY
            or not pattern.fullmatch(key)
            or "[" in key
            or not _parses(f"{key}: replicate")
        ):  # a keyword (`plan`, `set`) is no pattern
            warnings.append(
                f"{clip(ascii(key), 120)}: not a module path the plan language can hold "
                "(dotted names and `*` only); entry dropped"
            )
        elif not isinstance(style, str) or not _STYLE.fullmatch(style):
            warnings.append(
                f"{key}: {clip(ascii(style), 120)} is not a Hugging Face style name; entry dropped"
            )
        else:
            kept[key] = style
    return kept


def _parses(rule: str) -> bool:
    try:
        parse(f"dtp 1\n{rule}\n", "<tp_plan entry>")
    except PlanError:
        return False
    return True


def _hf_key(pattern: ir.Pattern) -> str | None:
    segs = []
    for seg in pattern.segments:
        if (
            isinstance(seg, ir.IndexRange)
            or seg == "**"
            or (seg != "*" and ("*" in seg or "?" in seg))
        ):
            return None
        segs.append(seg)
    return ".".join(segs)


def export_plan(
    plan: ir.Plan, model: nn.Module | None = None, choose=None
) -> tuple[dict[str, str], list[str]]:
    """(HF tp_plan dict, warnings) for a dtp plan; what HF cannot express is left out and named.

    `choose` picks `when` branches (`conditions.chooser`); without it every branch is exported."""
    out, warnings, _, sets = _export(plan, model, choose)
    return out, [_set_left_out(s, NO_HF_EQUIVALENT) for s in sets] + warnings


def _export(
    plan: ir.Plan, model: nn.Module | None, choose
) -> tuple[dict[str, str], list[str], list[str], list]:
    """(tp_plan, the rules' warnings, the rules HF never sees, the `set`s): the third are warnings
    of the second."""
    rules, sets, _ = ir.flatten(plan, choose)
    out: dict[str, str] = {}
    warnings: list[str] = []
    left_out: list[str] = []
    for rule in rules:
        key, style = _hf_key(rule.pattern), rule.style
        where = f"line {rule.pos.line} ({rule.pattern}: {style.name})"
        if key is None:
            message = f"{where}: HF keys allow `*` only for whole segments; rule left out"
            warnings.append(message)
            left_out.append(message)
            continue
        before = len(warnings)
        text = _export_style(style, key, _module(model, rule.pattern), warnings, where)
        if text is None:
            left_out += warnings[before:]
        elif isinstance(text, dict):
            out.update(text)
        else:
            out[key] = text
    return out, warnings, left_out, sets


NO_HF_EQUIVALENT = "has no Hugging Face equivalent"


def _set_left_out(s, why: str) -> str:
    return f"line {s.pos.line}: `set {s.pattern}.{s.attr}` {why}"


def export_for(plan: ir.Plan, model: nn.Module, tp: int) -> tuple[dict[str, str], list[str]]:
    """(HF tp_plan, warnings) that computes what `plan` computes for `model` at `tp`; UsageError if
    none does.

    HF applies a tp_plan as it is: a `set`, a per-head slice or a norm over sharded features that
    the export leaves out would make HF run the model with the wrong shapes or the wrong maths. So
    the `when` branches are taken for this model and tp, nothing they select may be left out, and
    the exported plan, read back, must pass dtp's own check at tp; a `set` is left out only when the
    plan holds without it there (the model does not shape with the attribute it rewrites)."""

    try:  # a plan that does not hold at tp says so first, whatever HF could express of it
        check(plan, model, tp)
    except PlanError as err:
        first = " ".join(str(err).split())
        raise UsageError(
            f"the plan does not hold for the model at tp {tp}, so there is nothing to export: "
            f"{first[:600]}"
        ) from None
    diags: list = []
    out, warnings, left_out, sets = _export(plan, model, conditions.chooser(model, diags, tp))
    if diags:
        raise UsageError(
            f"cannot pick the plan's `when` branches for this model at tp {tp}: "
            + "; ".join(f"line {d.pos.line}: {d.message}" for d in diags)
        )
    unset = [_set_left_out(s, NO_HF_EQUIVALENT) for s in sets]
    if left_out:
        _refuse(unset + left_out, tp)
    try:
        check(parse(import_plan(out)[0], "<exported tp_plan>"), model, tp)
    except PlanError as err:
        # the model reads what a `set` rewrites: HF, which has no `set`, would compute something
        # else
        if unset:
            _refuse(unset, tp)
        first = " ".join(str(err).split())
        raise UsageError(
            f"the exported tp_plan does not hold together for the model at tp {tp}: {first[:600]} "
            "(pass --lossy to print it anyway)"
        ) from None
    # GPT-J's head count on transformers that views heads as -1: the plan holds without the `set`,
    # as HF runs it
    kept = "left out: this model does not shape with it (the plan holds without it)"
    return out, [_set_left_out(s, kept) for s in sets] + warnings


def _refuse(left_out: list[str], tp: int) -> None:
    raise UsageError(
        f"no Hugging Face tp_plan computes what this plan does for the model at tp {tp}: "
        + "; ".join(left_out)
        + ". HF would run the rest with the unsharded module's shapes "
        "(pass --lossy to print what can be expressed anyway)"
    )


def _export_style(
    style: ir.Style, key: str, module: nn.Module | None, warnings: list[str], where: str
):
    name, opts = style.name, {o.key: o.value for o in style.options}
    out_layout, in_layout, packed = opts.get("output"), opts.get("input"), opts.get("packed", 1)
    if name == "colwise":
        if packed == 2:
            return "packed_colwise"
        if packed != 1:
            warnings.append(
                f"{where}: packed={packed} has no HF style (HF packs 2 parts); rule left out"
            )
            return None
        return "colwise_gather_output" if out_layout == ir.Layout("replicate") else "colwise"
    if name == "rowwise":
        return "rowwise_split_input" if in_layout == ir.Layout("replicate") else "rowwise"
    if name == "vocab_parallel":
        if isinstance(module, nn.Embedding) or (module is None and key != "lm_head"):
            return "embedding_rowwise"
        warnings.append(
            f"{where}: vocab_parallel output projection exported as colwise_gather_output "
            "(HF gathers the logits; no vocabulary-parallel loss)"
        )
        return "colwise_gather_output"
    if name == "replicate":
        return "replicated_with_grad_allreduce" if opts.get("reduce_grad") is True else "replicate"
    if name == "sequence_parallel":
        return "sequence_parallel"
    if name == "experts":
        layout = experts_layout(module) if module is not None else None
        if layout is not None and (
            layout.transposed or not layout.concatenated or hasattr(module, "down_proj_bias")
        ):
            warnings.append(
                f"{where}: HF's moe_tp_experts splits [gate; up] experts without biases; these are "
                f"{layout.describe()}"
                + (", with biases" if hasattr(module, "down_proj_bias") else "")
                + "; rule left out"
            )
            return None
        warnings.append(
            f"{where}: exported as moe_tp_experts, which transformers 5.25 deprecates (removal "
            "announced for 5.28; its MoE models now leave experts to the ep_plan)"
        )
        return {
            f"{key}.gate_up_proj": "packed_colwise",
            f"{key}.down_proj": "rowwise",
            key: "moe_tp_experts",
        }
    warnings.append(f"{where}: no HF style for {name}; rule left out")
    return None


def _module(model: nn.Module | None, pattern: ir.Pattern) -> nn.Module | None:
    """The first module `pattern` matches (to tell an embedding from an output projection)."""
    if model is None:
        return None
    return next((m for path, m in model.named_modules() if path and matches(pattern, path)), None)


def from_hf(spec: str) -> tuple[str, list[str]]:
    """The .tp text for MODEL: the shipped plan of its model type, else its imported tp_plan."""
    model = models.build(models.resolve(spec), device="meta")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not model_type:
        raise UsageError(f"{spec} is not a Hugging Face model (no config.model_type)")
    own = PLANS / f"{model_type}.tp"
    if own.is_file():
        return own.read_text(encoding="utf-8"), []
    plan = hf_plan_of(model)
    if not plan:
        raise UsageError(
            f"no shipped plan for model type '{model_type}' and the model has no tp_plan"
        )
    return import_plan(plan, f"hf-{model_type}-imported", model)
