"""`check` on plausible wrong plans for real Hugging Face models: it describes only data
flow the model's forward has, points kv-head refusals at `repeat(kv)`, and names the rule that fixes
a multi-query fused qkv, an ALiBi input and an attention that views with a head-count attribute.
Exact messages and positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from dtp import cli
from dtp.checks.checker import check
from dtp.errors import PlanError
from dtp.lang.parse import parse

LLAMA_MLP = """    mlp.gate_proj: colwise
    mlp.up_proj: colwise
    mlp.down_proj: rowwise
"""


def _check(capsys, tmp_path, text: str, model: str, tp: int) -> tuple[int, str]:
    plan = tmp_path / "p.tp"
    plan.write_text(text)
    rc = cli.main(["check", str(plan), f"dtp.models.hf:{model}", "--tp", str(tp)])
    out, err = capsys.readouterr()
    return rc, (out + err).replace(str(plan), "p.tp")


def test_siblings_are_not_a_chain(capsys, tmp_path):
    # q_proj and k_proj both read the attention's input: q_proj's output never reaches k_proj
    text = (
        "dtp 1\nmodel.layers.* {\n    self_attn.q_proj: colwise\n    self_attn.v_proj: colwise\n"
        "    self_attn.o_proj: rowwise\n" + LLAMA_MLP + "}\n"
    )
    rc, out = _check(capsys, tmp_path, text, "llama", 2)
    assert rc == 2 and "reaches self_attn.k_proj" not in out
    assert out == (
        "p.tp:3:23: error: model.layers.0.self_attn.k_proj (and 1 more module): not sharded, but "
        "its output and "
        "self_attn.q_proj's are combined before self_attn.o_proj: self_attn.q_proj (colwise) hands "
        "on each rank's "
        "slice of the features (shard(-1), local), self_attn.k_proj the full activation (replicate, "
        "local), which "
        "cannot be combined; shard it as self_attn.q_proj is (`self_attn.k_proj: colwise`), or "
        "leave "
        "self_attn.q_proj whole\n        self_attn.q_proj: colwise\n                          "
        "^~~~~~~\n"
    )


def test_an_unsharded_mlp_sibling_is_named(capsys, tmp_path):
    text = (
        "dtp 1\nmodel.layers.* {\n    self_attn.q_proj: colwise\n    self_attn.k_proj: colwise\n"
        "    self_attn.v_proj: colwise\n    self_attn.o_proj: rowwise\n    mlp.gate_proj: colwise\n"
        "    mlp.down_proj: rowwise\n}\n"
    )
    rc, out = _check(capsys, tmp_path, text, "llama", 2)
    assert rc == 2
    assert out.startswith(
        "p.tp:7:20: error: model.layers.0.mlp.up_proj (and 1 more module): not sharded, but its "
        "output and "
        "mlp.gate_proj's are combined before mlp.down_proj: mlp.gate_proj (colwise) hands on each "
        "rank's slice of "
        "the features (shard(-1), local), mlp.up_proj the full activation (replicate, local), which "
        "cannot be "
        "combined; shard it as mlp.gate_proj is (`mlp.up_proj: colwise`), or leave mlp.gate_proj "
        "whole\n"
    )


def test_a_per_head_norm_under_plain_replicate_is_refused(capsys, tmp_path):
    # Qwen3's q_norm runs on each rank's heads: a plain replicate says it reads full activations
    text = (
        "dtp 1\nmodel.layers.* {\n    self_attn.q_proj: colwise\n    self_attn.k_proj: colwise\n"
        "    self_attn.v_proj: colwise\n    self_attn.o_proj: rowwise\n    self_attn.q_norm: "
        "replicate\n"
        "    self_attn.k_norm: replicate\n" + LLAMA_MLP + "}\n"
    )
    rc, out = _check(capsys, tmp_path, text, "qwen3", 2)
    assert rc == 2
    assert out.startswith(
        "p.tp:3:23: error: model.layers.0.self_attn.q_proj (and 1 more module): colwise output "
        "(each rank's slice "
        "of the features (shard(-1), local)) reaches self_attn.q_norm (Qwen3RMSNorm, not sharded, "
        "so it reads full "
        "activations only): a norm over each head takes `replicate(reduce_grad=true)` (its gradient "
        "is summed over "
        "the ranks), a norm over all features `sharded_norm`\n"
    )


def test_kv_head_refusal_names_repeat_kv(capsys, tmp_path):
    text = (
        "dtp 1\nmodel.layers.* {\n    self_attn.q_proj: colwise\n    self_attn.k_proj: colwise\n"
        "    self_attn.v_proj: colwise\n    self_attn.o_proj: rowwise\n" + LLAMA_MLP + "}\n"
    )
    rc, out = _check(capsys, tmp_path, text, "gemma", 2)  # one key/value head
    assert rc == 2
    assert out.startswith(
        "p.tp:4:23: error: model.layers.0.self_attn.k_proj (and 1 more module): 1 key/value heads "
        "(head size 16, "
        "config.num_key_value_heads) do not divide by tp=2; each rank must hold whole heads; tp "
        "values that work: 1; "
        "or give each rank the key/value head its query heads read: `colwise(packed=[repeat(kv)])` "
        "on the key and "
        "value projections, which works at tp 1, 2, 4; the attention repeats key/value heads by "
        "num_key_value_groups, so where tp ≥ 1 also `set "
        "model.layers.*.self_attn.num_key_value_groups = "
        "config.num_attention_heads / tp` (both under a `when`, as plans/hf/llama.tp does)\n"
    )
    rc, out = _check(capsys, tmp_path, text, "llama", 4)  # two key/value heads at tp 4
    assert (
        rc == 2
        and "tp values that work: 1, 2; or give each rank" in out
        and "works at tp 1, 2, 4;" in out
    )


FALCON = """dtp 1
transformer.h.* {
    self_attention.query_key_value: colwise
    self_attention.dense: rowwise
}
set transformer.h.*.self_attention.num_heads = num_heads / tp
"""


@pytest.mark.parametrize(
    ("model", "text", "col"),
    [
        ("falcon", FALCON, 37),
        (
            "gpt_bigcode",
            "dtp 1\ntransformer.h.* {\n    attn.c_attn: colwise\n    attn.c_proj: rowwise\n}\n",
            18,
        ),
    ],
)
def test_multi_query_fused_qkv_under_plain_colwise(capsys, tmp_path, model, text, col):
    rc, out = _check(capsys, tmp_path, text, model, 2)
    name = "self_attention.query_key_value" if model == "falcon" else "attn.c_attn"
    assert rc == 2
    assert out.startswith(
        f"p.tp:3:{col}: error: transformer.h.0.{name} (and 1 more module): out_features=96 holds q "
        "64 + k 16 + v 16 "
        "(multi-query: 4 query heads and one key/value head of size 16, read from the weight's "
        "shape), and a plain "
        "colwise would cut each rank's slice across q, k and v; shard q by heads and keep k and v "
        "whole: "
        "colwise(packed=[q, replicate(head), replicate(head)])\n"
    )


def test_alibi_input_without_slice_input(capsys, tmp_path):
    text = (
        "dtp 1\ntransformer.h.* {\n    self_attention.query_key_value: colwise\n"
        "    self_attention.dense: rowwise\n}\nset transformer.h.*.self_attention.num_heads = "
        "num_heads / tp\n"
    )
    rc, out = _check(capsys, tmp_path, text, "bloom", 2)
    assert (rc, out) == (
        2,
        (
            "p.tp:3:37: error: transformer.h.0.self_attention.query_key_value (and 1 more module): "
            "the heads of "
            "transformer.h.*.self_attention are split, but its forward also takes `alibi`, an ALiBi "
            "bias built for every head outside it, which "
            "each rank would add to its own heads; cut it to this rank's heads: "
            "`transformer.h.*.self_attention: slice_input(name=alibi)`\n"
            "        self_attention.query_key_value: colwise\n                                      "
            "  ^~~~~~~\n"
        ),
    )


# transformers 5.25's FalconAttention takes no `alibi`: FalconModel folds the bias into the 4-D
# attention_mask alone, one (queries, keys) plane per head, and a run without the slice fails adding
# 4 heads' mask to 2 heads' scores; `check` asks for the mask's slice as it does for an `alibi`
# input (before 5.25: both names).
def test_alibi_folded_into_the_mask_without_slice_input(capsys, tmp_path):
    rc, out = _check(capsys, tmp_path, FALCON, "falcon_rw", 2)
    assert rc == 2 and "slice_input(name=" in out and "attention_mask], dim=1)`\n" in out
    fixed = (
        FALCON
        + "transformer.h.*.self_attention: slice_input(name=[alibi, attention_mask], dim=1)\n"
    )
    # plans/hf/falcon.tp's rule, either version
    assert _check(capsys, tmp_path, fixed, "falcon_rw", 2)[0] == 0


# transformers 5.25's Falcon-7B attention repeats its one key/value head num_key_value_groups times
# (4 here, the whole model's query heads) where each rank holds 2 query heads; plans/hf/falcon.tp
# version 3 did not rewrite it, `check` passed it and the run failed (2 vs 4 heads). `check` now
# asks for the `set`.
def test_multi_query_head_repeat_without_set(capsys, tmp_path):
    from dtp.models import hf

    text = FALCON.replace("colwise\n", "colwise(packed=[q, replicate(head), replicate(head)])\n", 1)
    if not hasattr(hf.build("falcon").transformer.h[0].self_attention, "num_key_value_groups"):
        # before 5.25: broadcast, nothing to rewrite
        assert _check(capsys, tmp_path, text, "falcon", 2)[0] == 0
        return
    rc, out = _check(capsys, tmp_path, text, "falcon", 2)
    assert rc == 2 and "`set transformer.h.*.self_attention.num_key_value_groups = " in out
    fixed = text + "set transformer.h.*.self_attention.num_key_value_groups = num_heads / tp\n"
    assert _check(capsys, tmp_path, fixed, "falcon", 2)[0] == 0


def test_head_count_attribute_without_set(capsys, tmp_path):
    text = (
        "dtp 1\nmodel.decoder.layers.* {\n    self_attn.q_proj: colwise\n    self_attn.k_proj: "
        "colwise\n"
        "    self_attn.v_proj: colwise\n    self_attn.out_proj: rowwise\n}\n"
    )
    rc, out = _check(capsys, tmp_path, text, "opt", 2)
    assert (rc, out) == (
        2,
        (
            "p.tp:3:23: error: model.decoder.layers.0.self_attn.q_proj (and 1 more module): "
            "model.decoder.layers.*.self_attn's forward shapes its heads with self.num_heads (4, "
            "the query heads of the whole model), but each rank holds only its share "
            "of the heads; rewrite it: `set model.decoder.layers.*.self_attn.num_heads = num_heads "
            "/ tp`\n"
            "        self_attn.q_proj: colwise\n                          ^~~~~~~\n"
        ),
    )
    fixed = text + "set model.decoder.layers.*.self_attn.num_heads = num_heads / tp\n"
    assert _check(capsys, tmp_path, fixed, "opt", 2)[0] == 0


class _Attention(nn.Module):
    """DBRX- and MPT-like: a grouped fused Wqkv split with self.hidden_size, heads viewed with
    self.n_heads, and an ALiBi `position_bias` from outside."""

    def __init__(self, width: int = 64, n_heads: int = 4):
        super().__init__()
        self.hidden_size, self.n_heads, self.head_dim = width, n_heads, width // n_heads
        self.Wqkv = nn.Linear(width, 3 * width, bias=False)
        self.out_proj = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, position_bias: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.Wqkv(x).split([self.hidden_size] * 3, dim=-1)
        q, k, v = (y.view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for y in (q, k, v))
        scores = q @ k.transpose(-1, -2) + (position_bias if position_bias is not None else 0)
        return self.out_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        # slice_input reads the head count here
        self.config = SimpleNamespace(n_heads=4, d_model=64)
        self.layers = nn.ModuleList([_Attention() for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def test_planted_attention_names_the_slice_and_every_attribute():
    plan = parse(
        "dtp 1\nlayers.* {\n    Wqkv: colwise(packed=3)\n    out_proj: rowwise\n}\n", "p.tp"
    )
    with pytest.raises(PlanError) as err:
        check(plan, _Model(), 2)
    head = "layers.0.Wqkv (and 1 more module): "
    assert [(str(d.pos), d.message) for d in err.value.diagnostics] == [
        (
            "p.tp:3:11",
            head
            + "the heads of layers.* are split, but its forward also takes `position_bias`, an ALiBi bias "
            "built for every head outside it, which each rank would add to its own heads; cut it to "
            "this rank's heads: "
            "`layers.*: slice_input(name=position_bias)`",
        ),
        (
            "p.tp:3:11",
            head
            + "layers.*'s forward shapes its heads with self.hidden_size (64, the query features of "
            "the whole model), but each rank holds only its share of the heads; rewrite it: "
            "`set layers.*.hidden_size = hidden_size / tp`",
        ),
        (
            "p.tp:3:11",
            head
            + "layers.*'s forward shapes its heads with self.n_heads (4, the query heads of the whole "
            "model), but each rank holds only its share of the heads; rewrite it: `set "
            "layers.*.n_heads = n_heads / tp`",
        ),
    ]
    fixed = parse(
        "dtp 1\nlayers.* {\n    Wqkv: colwise(packed=3)\n    out_proj: rowwise\n}\n"
        "layers.*: slice_input(name=position_bias)\nset layers.*.hidden_size = hidden_size / tp\n"
        "set layers.*.n_heads = n_heads / tp\n",
        "p.tp",
    )
    assert check(fixed, _Model(), 2).tp == 2
