"""Fuzz cases and the hypothesis strategies that draw them: meshes, zoo models, plans, shapes.

Plans are drawn as Megatron-correct layouts (which layers are sharded, packed or not,
vocabulary-parallel or not, sequence-parallel or not) and written with varied but equivalent syntax:
wildcard blocks with `replicate` overrides, per-layer rules, index ranges, `**`, explicit default
options. Models are drawn so that head counts and vocabularies sometimes divide the tp size and
sometimes do not; `check` must reject the ones that cannot work.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

from hypothesis import strategies as st


@dataclass(frozen=True)
class Case:
    """One self-contained fuzz example."""

    plan: str  # .tp text
    model: dict | str  # a zoo config (with `family`) or a MODEL spec
    tp: int
    dp: int = 1
    batch: int = 2
    seq: int = 8
    seed: int = 0
    dtype: str = "float32"
    # what the strategy chose, for the report
    meta: dict = field(default_factory=dict, compare=False)

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Case:
        """Inverse of `to_json` (unknown keys, such as a saved error, are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def describe(self) -> str:
        """One line for progress output."""
        model = (
            self.model if isinstance(self.model, str) else json.dumps(self.model, sort_keys=True)
        )
        return f"tp={self.tp} dp={self.dp} batch={self.batch} seq={self.seq} seed={self.seed} model={model}"


# ---- models -----------------------------------------------------------------------------------------


@st.composite
def gpt_configs(draw) -> dict:
    """A small GPT whose head count and vocabulary divide some tp sizes and not others."""
    n_head = draw(st.sampled_from([1, 2, 3, 4, 6]))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    return {
        "family": "gpt",
        "n_layer": draw(st.integers(1, 3)),
        "n_head": n_head,
        "n_embd": n_head * head_dim,
        "vocab_size": draw(st.integers(8, 80)),
        "block_size": 16,
        "bias": draw(st.booleans()),
        "tie_embeddings": draw(st.booleans()),
    }


@st.composite
def llama_configs(draw) -> dict:
    """A small Llama with grouped-query attention, sometimes with a packed gate/up projection."""
    n_kv = draw(st.sampled_from([1, 2, 3, 4]))
    n_head = n_kv * draw(st.sampled_from([1, 2]))
    head_dim = draw(st.sampled_from([2, 4]))
    return {
        "family": "llama",
        "n_layer": draw(st.integers(1, 2)),
        "n_head": n_head,
        "n_kv_head": n_kv,
        "n_embd": n_head * head_dim,
        "intermediate_size": draw(st.sampled_from([8, 12, 16, 24])),
        "vocab_size": draw(st.integers(8, 64)),
        "block_size": 16,
        "tie_embeddings": draw(st.booleans()),
        "packed_gate_up": draw(st.booleans()),
    }


# ---- plans ------------------------------------------------------------------------------------------

# Per family: the names of the pieces a Megatron plan shards.
_GPT = dict(
    layers="transformer.h",
    emb="transformer.wte",
    head="lm_head",
    final_norm="transformer.ln_f",
    attn=[("attn.c_attn", "colwise(packed=3)"), ("attn.c_proj", "rowwise")],
    mlp=[("mlp.c_fc", "colwise"), ("mlp.c_proj", "rowwise")],
    norms=["ln_1", "ln_2"],
)
_LLAMA = dict(
    layers="model.layers",
    emb="model.embed_tokens",
    head="lm_head",
    final_norm="model.norm",
    attn=[
        ("self_attn.q_proj", "colwise"),
        ("self_attn.k_proj", "colwise"),
        ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"),
    ],
    mlp=[("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"), ("mlp.down_proj", "rowwise")],
    norms=["input_layernorm", "post_attention_layernorm"],
)
_LLAMA_PACKED_MLP = [("mlp.gate_up_proj", "colwise(packed=2)"), ("mlp.down_proj", "rowwise")]


def _explicit(style: str, draw, sp: bool) -> str:
    """Sometimes spell out a default option (same meaning, different text)."""
    if "(" in style or not draw(st.booleans()):
        return style
    if sp:
        return {
            "colwise": "colwise(input=shard(1))",
            "rowwise": "rowwise(output=shard(1), local=false)",
        }[style]
    return {
        "colwise": "colwise(input=replicate)",
        "rowwise": "rowwise(output=replicate, local=true)",
    }[style]


@st.composite
def plans(draw, model: dict) -> tuple[str, dict]:
    """A Megatron-correct plan for `model`, written in one of several equivalent ways, and what it
    chose."""
    names = dict(_GPT if model["family"] == "gpt" else _LLAMA)
    if model.get("packed_gate_up"):
        names["mlp"] = _LLAMA_PACKED_MLP
    n = model["n_layer"]
    sp = draw(st.booleans())
    head = sp or draw(st.booleans())  # sequence parallelism needs the head to take DTensor input
    emb = head if model["tie_embeddings"] and draw(st.integers(0, 9)) else draw(st.booleans())
    if sp and model["family"] == "llama":
        # Llama's residual starts at the embedding output: it must be a sequence-sharded DTensor
        emb = True
    groups = {
        g: (set(range(n)) if sp else set(draw(st.sets(st.integers(0, n - 1)))))
        for g in ("attn", "mlp")
    }
    lines = ["dtp 1", f"plan fuzz version {draw(st.integers(1, 9))}", ""]
    if emb:
        emb_style = (
            "vocab_parallel(output=replicate, local=true)"
            if sp and model["family"] == "gpt"
            else "vocab_parallel"
        )
        lines.append(f"{names['emb']}: {emb_style}")
    if sp and model["family"] == "gpt":
        lines.append("transformer.drop: sequence_parallel")
    layers = names["layers"]
    for g in ("attn", "mlp"):
        chosen = groups[g]
        if not chosen:
            continue
        form = draw(st.sampled_from(["block", "rules", "range"]))
        if form == "block" or (
            form == "range" and chosen != set(range(min(chosen), max(chosen) + 1))
        ):
            lines.append(f"{layers}.* {{")
            lines += [f"    {mod}: {_explicit(style, draw, sp)}" for mod, style in names[g]]
            lines.append("}")
            for i in sorted(set(range(n)) - chosen):  # overrides: a literal index beats `*`
                lines += [f"{layers}.{i}.{mod}: replicate" for mod, _ in names[g]]
        elif form == "range":
            lo, hi = min(chosen), max(chosen)
            lines += [
                f"{layers}.[{lo}..{hi}].{mod}: {_explicit(style, draw, sp)}"
                for mod, style in names[g]
            ]
        else:
            lines += [
                f"{layers}.{i}.{mod}: {_explicit(style, draw, sp)}"
                for i in sorted(chosen)
                for mod, style in names[g]
            ]
    if sp:
        for norm in names["norms"]:
            lines.append(
                f"{'**' if draw(st.booleans()) else layers + '.*'}.{norm}: sequence_parallel"
            )
        lines.append(f"{names['final_norm']}: sequence_parallel")
    if head:
        lines.append(f"{names['head']}: vocab_parallel")
    chose = {
        "sp": sp,
        "emb": emb,
        "head": head,
        "attn": sorted(groups["attn"]),
        "mlp": sorted(groups["mlp"]),
    }
    return "\n".join(lines) + "\n", chose


MESHES = [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2)]  # (tp, dp)
# float64 now and then: its tolerance (1e-10) sharpens the check where float32's rounding could hide
# a slip
_DTYPES = st.sampled_from(["float32", "float32", "float64"])


@st.composite
def meshes(draw, max_world: int) -> tuple[int, int]:
    """(tp, dp) with tp × dp ≤ max_world."""
    return draw(st.sampled_from([m for m in MESHES if m[0] * m[1] <= max_world]))


@st.composite
def zoo_cases(draw, max_world: int = 4) -> Case:
    """A random plan on a random zoo model on a random mesh."""
    model = draw(st.one_of(gpt_configs(), llama_configs()))
    plan, chose = draw(plans(model))
    tp, dp = draw(meshes(max_world))
    batch = dp * draw(st.integers(1, 3))
    return Case(
        plan,
        model,
        tp,
        dp,
        batch,
        draw(st.integers(1, model["block_size"])),
        draw(st.integers(0, 2**16)),
        draw(_DTYPES),
        meta=chose,
    )


@st.composite
def user_cases(draw, plan: str, model: str, max_world: int = 4, max_seq: int = 16) -> Case:
    """The user's plan and model on a random mesh, shape (sequences up to `max_seq`) and seed."""
    tp, dp = draw(meshes(max_world))
    batch = dp * draw(st.integers(1, 3))
    return Case(
        plan,
        model,
        tp,
        dp,
        batch,
        draw(st.integers(1, max_seq)),
        draw(st.integers(0, 2**16)),
        draw(_DTYPES),
    )


# ---- mutated plans -------------------------------------------------------------------------------

# What a user gets wrong. A mutation marked `wrong` cannot compute what the unsharded model does
# once tp > 1, so such a case passing parity would be a false pass.
MUTATIONS = ("partial", "colwise_replicate", "unpaired_colwise", "unpacked", "some_norms", "local")
_RULE = re.compile(r"^(\s*)(\S+): (\w+)(?:\((.*)\))?$")


def _parse_rule(line: str) -> tuple[str, str, str, dict[str, str]] | None:
    m = _RULE.match(line)
    if not m or m.group(2) in ("dtp", "plan", "mesh"):
        return None
    options = dict(o.split("=", 1) for o in m.group(4).split(", ")) if m.group(4) else {}
    return m.group(1), m.group(2), m.group(3), options


def _rule(indent: str, pattern: str, style: str, options: dict[str, str]) -> str:
    args = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"{indent}{pattern}: {style}" + (f"({args})" if args else "")


@st.composite
def mutated_plans(draw, plan: str, model: dict, sp: bool) -> tuple[str, str, bool]:
    """One mistake in a Megatron-correct plan: (new text, the mutation, whether it is wrong for tp >
    1)."""
    lines = plan.splitlines()
    rules = {i: r for i, line in enumerate(lines) if (r := _parse_rule(line))}
    by_style = {
        s: [i for i, r in rules.items() if r[2] == s]
        for s in ("colwise", "rowwise", "vocab_parallel", "sequence_parallel")
    }
    packed = [i for i in by_style["colwise"] if "packed" in rules[i][3]]
    norms = by_style["sequence_parallel"]
    kinds = [
        k for k in MUTATIONS if k not in ("partial", "unpaired_colwise") or by_style["rowwise"]
    ]
    kinds = [
        k
        for k in kinds
        if (k != "colwise_replicate" or by_style["colwise"]) and (k != "unpacked" or packed)
    ]
    if not by_style["colwise"] + by_style["rowwise"] + by_style["vocab_parallel"]:
        kinds = [k for k in kinds if k != "local"]
    kind = draw(st.sampled_from(kinds))
    wrong = False
    if kind == "partial":
        i = draw(st.sampled_from(by_style["rowwise"]))
        indent, pattern, style, opts = rules[i]
        opts = {**opts, "output": "partial"}
        if draw(st.booleans()):
            opts["local"] = draw(st.sampled_from(["true", "false"]))
        # a local partial sum joins a plain residual
        wrong = not sp and opts.get("local", "true") == "true"
        lines[i] = _rule(indent, pattern, style, opts)
    elif kind == "colwise_replicate":  # the rowwise after it reads the gathered output as its slice
        i = draw(st.sampled_from(by_style["colwise"]))
        indent, pattern, style, opts = rules[i]
        lines[i], wrong = _rule(indent, pattern, style, {**opts, "output": "replicate"}), True
    elif kind == "unpaired_colwise":  # the rowwise partner left unsharded
        i = draw(st.sampled_from(by_style["rowwise"]))
        indent, pattern, _, _ = rules[i]
        lines[i], wrong = _rule(indent, pattern, "replicate", {}), True
    elif kind == "unpacked":  # fused q/k/v or gate/up sharded as one matrix
        i = draw(st.sampled_from(packed))
        indent, pattern, style, opts = rules[i]
        lines[i], wrong = (
            _rule(indent, pattern, style, {k: v for k, v in opts.items() if k != "packed"}),
            True,
        )
    elif kind == "some_norms":
        if norms:  # one sequence-parallel norm rule dropped
            del lines[draw(st.sampled_from(norms))]
        else:  # one norm of one layer made sequence-parallel in a plan without sequence parallelism
            layers, norm = (
                ("transformer.h", "ln_1")
                if model["family"] == "gpt"
                else ("model.layers", "input_layernorm")
            )
            lines.append(f"{layers}.0.{norm}: sequence_parallel")
        wrong = True
    else:  # local: hand on the other kind of tensor
        i = draw(
            st.sampled_from(by_style["colwise"] + by_style["rowwise"] + by_style["vocab_parallel"])
        )
        indent, pattern, style, opts = rules[i]
        lines[i] = _rule(
            indent, pattern, style, {**opts, "local": draw(st.sampled_from(["true", "false"]))}
        )
    return "\n".join(lines) + "\n", kind, wrong


@st.composite
def mutated_cases(draw, max_world: int = 4) -> Case:
    """A zoo case whose Megatron-correct plan carries one mistake (see MUTATIONS)."""
    case = draw(zoo_cases(max_world))
    plan, kind, wrong = draw(mutated_plans(case.plan, case.model, case.meta["sp"]))
    return dataclasses.replace(
        case, plan=plan, meta={**case.meta, "mutation": kind, "wrong": wrong}
    )


# ---- plan text for the parser fuzz ------------------------------------------------------------------

PIECES = [
    "dtp 1",
    "\n",
    " ",
    "{",
    "}",
    ":",
    "(",
    ")",
    ",",
    "=",
    ".",
    "*",
    "**",
    "[0..2]",
    "colwise",
    "rowwise",
    "vocab_parallel",
    "packed=3",
    "shard(-1)",
    "set",
    "plan",
    "mesh",
    "version",
    "tp",
    "#",
    "/",
    "\t",
    "\x00",
    "\xff",
    "é",
    "99999999999999999999999999",
    "transformer.h.*",
    "\r",
    "\r\n",
    "\u2028",
    "\x0c",
    "'",
    '"',
    "\\",
    ";",
    "@",
    "-",
    "+",
    "..",
]


@st.composite
def mutated_texts(draw, seeds: list[str]) -> str:
    """A shipped plan with random insertions, deletions and replacements, or random pieces glued."""
    if draw(st.booleans()):
        return "".join(draw(st.lists(st.sampled_from(PIECES) | st.text(max_size=3), max_size=30)))
    text = draw(st.sampled_from(seeds))
    for _ in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["insert", "delete", "replace"]))
        piece = draw(st.sampled_from(PIECES) | st.text(max_size=4))
        if op == "insert":
            text = text[:i] + piece + text[i:]
        elif op == "delete":
            text = text[:i] + text[i + draw(st.integers(1, 10)) :]
        else:
            text = text[:i] + piece + text[i + len(piece) :]
    return text
