"""Hugging Face families: every shipped plans/hf/<model_type>.tp reaches parity on the real
transformers class at tp 2 (tp 4 where the tiny config divides) with measured == analytic
collectives, several families per rank launch; tp_plan import/export round trips; check rules and
explain rows of the new layouts (Conv1D, packed part lists, replicate(reduce_grad), experts)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")

from conftest import dtp_cli

from dtp import models
from dtp.checks.checker import check
from dtp.cost.explain import explain
from dtp.errors import PlanError, UsageError
from dtp.hf.plan import IMPORT, export_for, export_plan, hf_plan_of, import_plan
from dtp.hf.verify import PLANS, checked_cases, verify_on_rank
from dtp.lang.parse import load, parse
from dtp.layout.forward_source import forward_facts
from dtp.models import hf
from dtp.runtime.ranks import on_ranks

# Variants run the shipped plan of their model type, whose `when config.…` blocks pick their layout.
TP2 = [
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma2",
    "gpt_neox",
    "gptj",
    "gpt_bigcode",
    "falcon",
    "phi",
    "opt",
    "olmo2",
    "mixtral",
    "qwen2_moe",
    "bloom",
    "phi3",
    "gemma",  # one key/value head (Gemma-2B): repeat(kv) keeps it whole on both ranks
    "llama_mqa",  # the same branch of llama.tp
    "falcon_40b",  # new_decoder_architecture: grouped query_key_value, in-place residual
    "gpt_bigcode_mha",  # multi_query false: per-head interleaved c_attn
    "phi3_mha",  # no grouped-query attention, partial rotary, sliding window, tied embeddings
    "olmo2_mha",  # no grouped-query attention, biases, tied embeddings
    # ALiBi (falcon-rw-1b), eager and sdpa: bias and 4-D mask cut per head
    "falcon_rw",
    "falcon_rw_sdpa",
    "falcon_rw_mqa",  # ALiBi with the multi-query query_key_value
    "stablelm",
    "gpt_neo",  # no HF tp_plan: `set` the head counts their attention views with
    # StableLM 2 12B: one LayerNorm per head in a ModuleList; attention stays whole
    "stablelm_qk",
    "apertus",  # xIELU's learnt scalars read sharded features: replicate(reduce_grad)
    "qwen3_moe",
    "hunyuan_v1_dense",  # per-head q/k norms (and experts)
    # slice_params: each rank its heads' sinks; transposed, interleaved experts with biases
    "gpt_oss",
]
# 4 heads (and one replicated k/v head) divide by 4
TP4 = [
    "gpt2",
    "gpt_bigcode",
    "falcon",
    "bloom",
    # 1 and 2 key/value heads < tp: repeat(kv), each rank the head it reads
    "gemma",
    "llama",
    "qwen2",
    "phi3",
    "olmo2",  # the same inside Phi-3's fused qkv_proj, and for OLMo2's k_norm
    # one head per rank: slice_input keeps one plane of bias and mask
    "falcon_rw",
    "falcon_rw_sdpa",
    "stablelm",  # 2 key/value heads < 4: repeat(kv) with the head counts set
    # 2 key/value heads < 4: repeat(kv); an FFN of 128 per expert: 32 gate/up pairs a rank
    "gpt_oss",
]
# At tp 4 the repeated k/v rows add one gradient all-reduce per projection (and per bias: qwen2).
EXPECTED_TP4 = {
    "gemma": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    "llama": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    "qwen2": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 13}},
    # one qkv_proj weight
    "phi3": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},
    # + k_proj, v_proj, k_norm repeated rows and 2 × (q_norm, k_norm) sums of squares, per layer
    "olmo2": {"forward": {"all_reduce": 12}, "backward": {"all_reduce": 15}},
    # slicing: none
    "falcon_rw": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}},
    "falcon_rw_sdpa": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}},
    # + k_proj, v_proj weight and bias repeated rows, per layer
    "gpt_oss": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 15}},
}

# Collectives per step of the 2-layer tiny models, forward and backward (3 of the forward
# all-reduces are the vocabulary-parallel loss's). Written out so a change in either measurement or
# schedule shows.
EXPECTED = {
    # + 2 × (q_norm, k_norm) gradients
    "qwen3": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    # + 2 × (weight, bias) k/v rows
    "gpt_bigcode": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    # + 2 × weight k/v rows
    "falcon": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},
    # + q_norm, k_norm: the sum of squares all-reduced forward, its gradient backward, per layer
    "olmo2": {"forward": {"all_reduce": 12}, "backward": {"all_reduce": 9}},
    "olmo2_mha": {"forward": {"all_reduce": 12}, "backward": {"all_reduce": 9}},
    # + 2 × routing weights (f)
    "mixtral": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},
    "qwen2_moe": {"forward": {"all_reduce": 10}, "backward": {"all_reduce": 9}},  # + shared expert
    # + 2 × k, v weight gradients
    "llama_mqa": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    # + 2 × k, v weight gradients
    "gemma": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    # Megatron's: slice_input adds none
    "falcon_rw": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}},
    "falcon_rw_sdpa": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}},
    # + 2 × (weight, bias) k/v rows
    "falcon_rw_mqa": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    # attention whole: MLP's only
    "stablelm_qk": {"forward": {"all_reduce": 6}, "backward": {"all_reduce": 3}},
    # + 2 × (q_norm, k_norm weights, xIELU's alpha_p and alpha_n) gradients
    "apertus": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 13}},
    # + q_norm, k_norm, routing
    "qwen3_moe": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 11}},
    # + query/key norms
    "hunyuan_v1_dense": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 9}},
    # as Mixtral: + 2 × routing weights
    "gpt_oss": {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 7}},
}
MEGATRON = {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}}  # 4 × 2 layers + 1 + 1 + 3


def _assert_families(results: list[list[dict]], families: list[str]) -> None:
    for rank_results in results:
        assert [r["family"] for r in rank_results] == [
            f[0] if isinstance(f, tuple) else f for f in families
        ]
        for r in rank_results:
            assert "error" not in r, f"{r['family']}: {r.get('error')}"
            assert r["ok"], (
                f"{r['family']}: parity failed, worst {r['worst']} {r['errors']} {r['problems']}"
            )
            assert r["errors"]["logits"] < 1e-5 and r["errors"]["loss"] < 1e-5, r
            assert r["measured"] == r["analytic"], (
                f"{r['family']}: measured {r['measured']} != {r['analytic']}"
            )


def test_every_family_at_tp2():
    results = on_ranks(verify_on_rank, 2, checked_cases(TP2, 2), timeout=600)
    _assert_families(results, TP2)
    for r in results[0]:
        counts = {k: v for k, v in r["measured"].items() if k != "bytes"}
        assert counts == EXPECTED.get(r["family"], MEGATRON), r["family"]


def test_families_at_tp4():
    results = on_ranks(verify_on_rank, 4, checked_cases(TP4, 4), timeout=600)
    _assert_families(results, TP4)
    counts = {
        r["family"]: {k: v for k, v in r["measured"].items() if k != "bytes"} for r in results[0]
    }
    assert {f: counts[f] for f in EXPECTED_TP4} == EXPECTED_TP4


def test_a_plan_exists_for_every_listed_model_type():
    listed = {
        "gpt2",
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma",
        "gemma2",
        "gpt_neox",
        "gptj",
        "gpt_bigcode",
        "falcon",
        "phi",
        "opt",
        "olmo2",
        "mixtral",
        "qwen2_moe",
        "bloom",
        "phi3",
    }
    assert listed <= {p.stem for p in PLANS.glob("*.tp")}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma", "mixtral", "qwen2_moe"])
def test_hf_tp_plan_round_trip(family):
    model = hf.build(family)
    original = hf_plan_of(model)
    text, warnings = import_plan(original)
    assert warnings == []
    plan = parse(text, "<imported>")
    # its plan also names dense-MLP layers (mlp_only_layers) this model lacks
    if family != "qwen2_moe":
        # the tiny Gemma has one key/value head: HF's plan, like dtp's, needs tp=1 there
        check(plan, model)
    exported, _ = export_plan(plan, model)
    assert exported == original


def test_import_skips_keys_that_match_no_module_of_the_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[],
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # its plan names the dense MLP it lacks
    text, warnings = import_plan(hf_plan_of(model), "q", model)
    assert warnings == []
    assert "# not in this model (HF skips it): model.layers.*.mlp.gate_proj: colwise" in text
    check(parse(text, "<imported>"), model, 2)  # without the skip: 3 "matches no module" errors


def test_import_knows_every_style_transformers_registers():
    import transformers.distributed.expert_parallel  # noqa: F401 - registers the expert-parallel styles
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    # else "unknown Hugging Face style", dropped
    assert sorted(set(ALL_PARALLEL_STYLES.keys()) - set(IMPORT)) == []


def test_import_of_unit_styles_splits_whole_heads_as_colwise():
    # transformers 5.25's unit_colwise / unit_rowwise keep whole heads: colwise / rowwise where tp
    # divides them
    text, warnings = import_plan(
        {
            "model.layers.*.self_attn.k_proj": "unit_colwise",
            "model.layers.*.self_attn.o_proj": "unit_rowwise",
            "model.layers.*.self_attn": "local_params",
        }
    )
    assert (
        "model.layers.*.self_attn.k_proj: colwise\n" in text
        and "model.layers.*.self_attn.o_proj: rowwise\n" in text
    )
    assert warnings == [
        "model.layers.*.self_attn.k_proj: 'unit_colwise' keeps whole heads, replicated where tp "
        "does not divide "
        "them; dtp's colwise splits them evenly (check refuses another tp, and names "
        "colwise(packed=[repeat(kv)]) "
        "for k/v heads)",
        "model.layers.*.self_attn.o_proj: 'unit_rowwise' reads whole heads, replicated where tp "
        "does not divide "
        "them; dtp's rowwise splits them evenly",
        "model.layers.*.self_attn: 'local_params' has no dtp equivalent; rule dropped (module stays "
        "replicated)",
    ]


def test_unit_colwise_k_v_of_minicpm5_moe_import_as_colwise_checked_per_tp():
    # (`dtp apply` of this import at tp 2: parity, 11 collectives measured == analytic)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "minicpm5_moe",
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert hf_plan_of(model)["model.layers.*.self_attn.k_proj"] == "unit_colwise"
    text, warnings = import_plan(hf_plan_of(model), "m", model)
    # k_proj, v_proj: lossy
    assert "model.layers.*.self_attn.k_proj: colwise\n" in text and len(warnings) == 2
    plan = parse(text, "<imported>")
    check(plan, model, 2)  # 2 key/value heads: one a rank, as HF's unit mesh gives
    with pytest.raises(
        PlanError, match=r"2 key/value heads .* do not divide by tp=4.*colwise\(packed=\[repeat"
    ):
        check(plan, model, 4)  # HF replicates each over 2 ranks; dtp names repeat(kv)


def test_import_names_what_is_lossy():
    text, warnings = import_plan(
        {
            "model.layers.*.mlp.gate_proj": "local_colwise",
            "model.layers.*.x": "gather",
            "model.layers.*.y": "no_such_style",
        }
    )
    assert "model.layers.*.mlp.gate_proj: colwise" in text
    assert text.count("# lossy:") == 3 and len(warnings) == 3
    assert (
        "'gather' has no dtp equivalent" in warnings[1]
        and "unknown Hugging Face style" in warnings[2]
    )


def test_export_names_what_hf_cannot_express():
    plan = parse(
        "dtp 1\nh.[0..1].attn.c_attn: colwise(packed=3)\nh.*.mlp.c_fc: colwise\nset h.*.attn.n = n "
        "/ tp\n",
        "<p>",
    )
    out, warnings = export_plan(plan)
    assert out == {"h.*.mlp.c_fc": "colwise"}
    assert (
        len(warnings) == 2 and "`set h.*.attn.n`" in warnings[0] and "whole segments" in warnings[1]
    )


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "mistral", "qwen3", "gemma2", "mixtral", "phi", "gpt_neox", "gptj"]
)
def test_shipped_plans_export_to_the_tp_plan_hf_ships(family):
    model = hf.build(family)
    plan = load(PLANS / f"{model.config.model_type}.tp")
    if (
        family == "gptj"
        and "num_attention_heads" in forward_facts(model.transformer.h[0].attn).shape_attrs
    ):
        # transformers before 5.2x shapes GPT-J's heads with the head count, which only a `set`
        # rewrites
        with pytest.raises(
            UsageError, match=r"line \d+: `set transformer.h.\*.attn.num_attention_heads` has no"
        ):
            export_for(plan, model, 2)
        return
    out, warnings = export_for(plan, model, 2)
    ships = hf_plan_of(model)
    # transformers before 5.2x splits the input embedding only when it is tied
    if len(out) == len(ships) + 1:
        embedding = next(
            path for path, m in model.named_modules() if m is model.get_input_embeddings()
        )
        assert out.pop(embedding) == "embedding_rowwise"
    experts = "model.layers.*.mlp.experts"
    # transformers 5.25 leaves them to its ep_plan: whole under TP
    if family == "mixtral" and experts not in ships:
        assert {
            k: out.pop(k) for k in (f"{experts}.gate_up_proj", f"{experts}.down_proj", experts)
        } == {
            f"{experts}.gate_up_proj": "packed_colwise",
            f"{experts}.down_proj": "rowwise",
            experts: "moe_tp_experts",
        }
    assert out == ships
    if family == "mixtral":
        assert (
            f"line 20 ({experts}: experts): exported as moe_tp_experts, which transformers 5.25 "
            "deprecates "
            "(removal announced for 5.28; its MoE models now leave experts to the ep_plan)"
        ) in warnings
    # the head (no loss_parallel), GPT-J's head count where its attention views heads as -1
    # (transformers 5.2x), Mixtral's experts
    assert warnings == [
        w
        for w in warnings
        if "exported as colwise_gather_output" in w
        or "`set transformer.h.*.attn.num_attention_heads` left out: this model does not shape" in w
        or "exported as moe_tp_experts" in w
    ]


@pytest.mark.parametrize(
    "family, tp, left_out",
    [
        (
            "olmo2",
            2,
            [
                "line 12 (model.layers.*.self_attn.q_norm: sharded_norm)",
                "line 21 (model.layers.*.self_attn.k_norm: sharded_norm)",
            ],
        ),
        (
            "gpt2",
            2,
            [
                "line 15: `set transformer.h.*.attn.split_size`",
                "line 9 (transformer.h.*.attn.c_attn: colwise): packed=3",
            ],
        ),
        # one kv head: repeat(kv)
        (
            "gemma",
            2,
            [
                "line 13: `set model.layers.*.self_attn.num_key_value_groups`",
                "line 11 (model.layers.*.self_attn.k_proj: colwise): packed=[repeat(kv)]",
            ],
        ),
        # 2 kv heads < 4
        ("llama", 4, ["line 11 (model.layers.*.self_attn.k_proj: colwise): packed=[repeat(kv)]"]),
    ],
)
def test_export_refuses_a_tp_plan_hf_would_run_differently(family, tp, left_out):
    model = hf.build(family)
    with pytest.raises(UsageError) as info:
        export_for(load(PLANS / f"{model.config.model_type}.tp"), model, tp)
    message = str(info.value)
    assert message.startswith(
        f"no Hugging Face tp_plan computes what this plan does for the model at tp {tp}: "
    )
    assert all(item in message for item in left_out), message


def test_heads_with_one_module_each_in_a_list_are_not_split():
    # StableLM 2 12B: q_layernorm.norms[i] normalises head i; the model zips them with whatever
    # heads it holds
    text = (
        "dtp 1\nmodel.layers.* {\n    self_attn.q_proj: colwise\n    self_attn.k_proj: colwise\n"
        "    self_attn.v_proj: colwise\n    self_attn.o_proj: rowwise\n}\n"
    )
    model = hf.build("stablelm_qk")
    with pytest.raises(PlanError) as info:
        check(parse(text, "n.tp"), model, 2)
    assert str(info.value).splitlines()[0] == (
        "n.tp:3:23: model.layers.0.self_attn.q_proj (and 1 more module): "
        "self_attn.q_layernorm.norms holds one "
        "LayerNorm per head (4), and the model pairs a rank's local heads with the list's first "
        "entries: split heads "
        "would run with other heads' weights; keep this attention whole (no colwise or rowwise in "
        "it)"
    )
    check(parse(text, "n.tp"), model, 1)  # nothing is split at tp 1
    # without the per-head norms the plan is fine once the head counts StableLM views with are set
    # per rank
    fixed = text.replace(
        "}\n",
        "    set self_attn.num_heads = num_heads / tp\n"
        "    set self_attn.num_key_value_heads = num_key_value_heads / tp\n}\n",
    )
    check(parse(fixed, "n.tp"), hf.build("stablelm"), 2)


def test_parameters_on_sharded_features_without_a_rule_are_refused():
    # Apertus's xIELU learns two scalars from up_proj's sharded output: HF's own tp_plan forgets
    # them
    text = (
        PLANS.joinpath("apertus.tp")
        .read_text()
        .replace("    mlp.act_fn: replicate(reduce_grad=true)", "")
    )
    with pytest.raises(PlanError) as info:
        check(parse(text, "a.tp"), hf.build("apertus"), 2)
    assert str(info.value).splitlines()[0] == (
        "a.tp:23:18: model.layers.0.mlp.act_fn (and 1 more module): act_fn (XIELUActivation) holds "
        "parameters "
        "(alpha_p (1,), alpha_n (1,)) no rule names, beside up_proj, whose colwise output stays "
        "sharded: if they act "
        "on the features each rank holds, each rank's gradient is a partial sum and the ranks drift "
        "apart; add "
        "`model.layers.*.mlp.act_fn: replicate(reduce_grad=true)`, or `model.layers.*.mlp.act_fn: "
        "replicate` if it "
        "reads full activations only"
    )
    # Qwen3's per-head norms under Llama's plan (parity fails on their gradients otherwise)
    with pytest.raises(
        PlanError,
        match=r"llama.tp:9:23: model.layers.0.self_attn.q_norm \(and 1 more module\): "
        r"q_norm \(Qwen3RMSNorm\) holds parameters \(weight \(16,\)\)",
    ):
        check(load(PLANS / "llama.tp"), hf.build("qwen3"), 2)
    # "I know"
    check(parse(text + "model.layers.*.mlp.act_fn: replicate\n", "a.tp"), hf.build("apertus"), 2)
    check(parse(text, "a.tp"), hf.build("apertus"), 1)  # nothing is sharded at tp 1


def test_export_of_a_plan_that_does_not_hold_together_is_refused():
    # no colwise q/k/v before it
    plan = parse("dtp 1\nmodel.layers.*.self_attn.o_proj: rowwise\n", "<p>")
    with pytest.raises(
        UsageError,
        match=r"^the plan does not hold for the model at tp 2, so there is nothing to "
        r"export: <p>:2:34: model.layers.0.self_attn.o_proj .*rowwise",
    ):
        export_for(plan, hf.build("llama"), 2)
    # A tp the model does not divide by is that error, not a list of what HF cannot express at that
    # tp.
    with pytest.raises(
        UsageError,
        match=r"^the plan does not hold for the model at tp 3, .*llama.tp:9:23: "
        r"model.layers.0.self_attn.q_proj .* over tp=3, which does not divide it",
    ):
        export_for(load(PLANS / "llama.tp"), hf.build("llama"), 3)


def test_export_cli_checks_against_the_model(repo):
    refused = dtp_cli("plan", "--to-hf", "plans/hf/olmo2.tp", "dtp.models.hf:olmo2")
    assert (refused.returncode, refused.stdout) == (2, "")
    assert (
        refused.stderr.startswith("error: no Hugging Face tp_plan computes")
        and refused.stderr.count("\n") == 1
    )
    lossy = dtp_cli("plan", "--to-hf", "plans/hf/olmo2.tp", "dtp.models.hf:olmo2", "--lossy")
    assert lossy.returncode == 0 and "model.layers.*.self_attn.q_norm" not in json.loads(
        lossy.stdout
    )
    assert "no HF style for sharded_norm" in lossy.stderr
    at_tp1 = dtp_cli("plan", "--to-hf", "plans/hf/gemma.tp", "dtp.models.hf:gemma", "--tp", "1")
    # the repeat(kv) branch is not taken: HF's own layout
    assert at_tp1.returncode == 0, at_tp1.stderr
    assert json.loads(at_tp1.stdout)["model.layers.*.self_attn.k_proj"] == "colwise"
    bad_tp = dtp_cli("plan", "--to-hf", "plans/hf/llama.tp", "dtp.models.hf:llama", "--tp", "0")
    assert bad_tp.returncode == 2 and "expected a positive integer, got 0" in bad_tp.stderr
    assert "Traceback" not in bad_tp.stderr
    unchecked = dtp_cli("plan", "--to-hf", "plans/hf/olmo2.tp")
    assert unchecked.returncode == 0 and "warning: not checked against a model" in unchecked.stderr


def _errors(text: str, family: str, tp: int) -> list[str]:
    with pytest.raises(PlanError) as err:
        check(parse(text, "p.tp"), models.build(f"dtp.models.hf:{family}"), tp)
    return [f"{d.pos.line}:{d.pos.column}: {d.message}" for d in err.value.diagnostics]


def test_part_list_checks():
    rule = "dtp 1\ntransformer.h.*.attn.c_attn: colwise(packed={})\ntransformer.h.*.attn.c_proj: rowwise\n"
    assert _errors(rule.format("[q, q, q]"), "gpt_bigcode", 2) == [
        "2:45: transformer.h.0.attn.c_attn (and 1 more module): packed parts [q, q, q] add up to 64 "
        "+ 64 + 64 "
        "= 192, not the 96 output features"
    ]
    assert _errors(rule.format("[q, head, head]"), "gpt_bigcode", 2)[0].endswith(
        "packed part 2 (head, 16 features) holds 1 heads (head size 16), which do not divide by "
        "tp=2; each rank "
        "must hold whole heads; tp values that work: 1; keep it whole with replicate(head)"
    )
    assert _errors(rule.format("[q, replicate(hed), 16]"), "gpt_bigcode", 2)[0].endswith(
        "unknown part 'hed'; a part is q, kv, head, an integer, or replicate(PART)"
    )
    assert _errors(rule.format("true"), "gpt_bigcode", 2) == [
        "2:45: option 'packed' takes a positive integer or a part list such as [q, kv, kv], not "
        "'true'"
    ]


def test_style_module_checks():
    assert _errors("dtp 1\nmodel.layers.*.mlp.gate: experts\n", "mixtral", 2) == [
        "2:26: model.layers.0.mlp.gate (and 1 more module): experts applies to a module with 3-D "
        "expert parameters "
        "gate_up_proj (E, 2·I, H) and down_proj (E, H, I), or transposed (E, H, 2·I) and (E, I, H), "
        "optionally "
        "gate_up_proj_bias (E, 2·I) and down_proj_bias (E, H), and no other parameters of its own; "
        "this module is "
        "MixtralTopKRouter"
    ]
    assert _errors("dtp 1\ntransformer.h.*.attn.c_attn: colwise(packed=5)\n", "gpt2", 2)[
        0
    ].endswith(
        # read from the attention
        "out_features=192 holds 3 equal parts (q, k and v of 64), not 5; use packed=3"
    )


def test_slice_input_checks():
    assert _errors("dtp 1\ntransformer.h.*.self_attention: slice_input\n", "bloom", 2) == [
        "2:33: transformer.h.0.self_attention (and 1 more module): slice_input needs the keyword "
        "input to cut, "
        "e.g. slice_input(name=alibi)"
    ]
    assert _errors(
        "dtp 1\ntransformer.h.*.self_attention: slice_input(name=alibi)\n", "bloom", 3
    ) == [
        "2:33: transformer.h.0.self_attention (and 1 more module): slice_input cuts 4 attention "
        "heads "
        "(config.n_head) into whole heads per rank, which tp=3 does not divide; tp values that "
        "work: 1, 2, 4"
    ]


def test_slice_input_checks_the_names_against_forward():
    rule = "dtp 1\ntransformer.h.*.self_attention: slice_input({})\n"
    assert _errors(rule.format("name=[alibi, atention_mask], dim=1"), "falcon_rw", 2) == [
        "2:50: transformer.h.0.self_attention (and 1 more module): FalconAttention.forward takes no "
        "input "
        "'atention_mask'; did you mean 'attention_mask'?"
    ]
    assert _errors(rule.format("name=[alibi, 3]"), "bloom", 2) == [
        "2:50: transformer.h.0.self_attention (and 1 more module): slice_input's name takes an "
        "input name or a "
        "list of distinct names, not '[alibi, 3]'; e.g. slice_input(name=alibi) or "
        "slice_input(name=[alibi, attention_mask], dim=1)"
    ]
    assert _errors(rule.format("name=alibi, dim=true"), "bloom", 2) == [
        "2:61: option 'dim' takes a dimension index (0, 1, …), not 'true'"
    ]
    # a forward without **kwargs: any unknown name is named
    from dtp.checks.slices import check_slice_input

    class Attention(torch.nn.Module):
        def forward(self, x, bias=None):
            return x

    from dtp.checks.messages import Reporter as _Reporter

    rep = _Reporter()
    style = parse(rule.format("name=[bias, position_bias]"), "p.tp").body[0].style
    check_slice_input("attn", style, Attention(), models.build("dtp.models.hf:bloom"), 2, rep, [])
    assert [d.message for d in rep.diagnostics()] == [
        "attn: Attention.forward takes no input 'position_bias'; its inputs are x, bias"
    ]


def test_cut_heads_layouts():
    from dtp.compiler.head_slices import cut_heads

    heads, tp = 4, 2
    # Bloom: (batch · heads, 1, keys)
    folded = torch.arange(2 * heads * 3.0).reshape(2 * heads, 1, 3)
    assert torch.equal(
        cut_heads(folded, heads, 0, 1, tp), folded.view(2, heads, 1, 3)[:, 2:].reshape(4, 1, 3)
    )
    # Falcon's mask: (batch, heads, q, k)
    per_head = torch.arange(2 * heads * 5 * 3.0).reshape(2, heads, 5, 3)
    assert torch.equal(cut_heads(per_head, heads, 1, 0, tp), per_head[:, :2])
    assert torch.equal(cut_heads(per_head, heads, 1, 1, 4), per_head[:, 1:2])
    broadcast = torch.zeros(2, 1, 5, 3)  # one mask for every head: kept whole
    assert cut_heads(broadcast, heads, 1, 1, tp) is broadcast
    with pytest.raises(ValueError, match=r"dimension 1 \(3\) holds neither the 4 heads"):
        cut_heads(torch.zeros(2, 3, 5), heads, 1, 0, tp)
    with pytest.raises(
        ValueError, match=r"dimension 0 \(2\) holds neither .*; dimension 1 holds 4: dim=1\?"
    ):
        # Falcon's layout read as Bloom's: the message points at dim 1
        cut_heads(per_head, heads, 0, 0, tp)
    with pytest.raises(ValueError, match="no dimension 3"):
        cut_heads(torch.zeros(2, 4, 5), heads, 3, 0, tp)
    with pytest.raises(ValueError, match="requires a gradient"):
        cut_heads(torch.zeros(2, 4, requires_grad=True), heads, 1, 0, tp)


def test_slice_heads_input_finds_inputs_by_keyword_or_position():
    from dtp.compiler.head_slices import SliceHeadsInput

    class Attention(torch.nn.Module):
        def forward(self, x, bias, mask=None):
            return bias, mask

    class Rank1Of2:  # the mesh as SliceHeadsInput reads it; the cut itself communicates nothing
        def size(self):
            return 2

        def get_local_rank(self):
            return 1

    attn = SliceHeadsInput(("bias", "mask"), heads=4, dim=1)._apply(Attention(), Rank1Of2())
    bias, mask = torch.randn(2, 4, 1, 3), torch.randn(2, 4, 3, 3)
    got_bias, got_mask = attn(torch.zeros(1), bias, mask=mask)  # bias by position, mask by keyword
    assert torch.equal(got_bias, bias[:, 2:]) and torch.equal(got_mask, mask[:, 2:])
    assert attn(torch.zeros(1), bias=bias)[1] is None  # an input left out stays out


def test_explain_names_the_inputs_slice_input_cuts():
    model = models.build("dtp.models.hf:falcon_rw")
    ex = explain(
        check(parse((PLANS / "falcon.tp").read_text(), "falcon.tp"), model, 2),
        model,
        "falcon_rw",
        2,
        batch=2,
        seq=8,
    )
    assert ex.sliced_inputs == (
        "transformer.h.*.self_attention: alibi, attention_mask at dim 1 (×2)",
    )
    assert summarize_ops(ex) == {"forward": {"all_reduce": 8}, "backward": {"all_reduce": 5}}


def summarize_ops(ex) -> dict:
    """Collective counts per phase of an explanation's analytic schedule."""
    return {
        phase: dict(Counter(c.op for c in ex.schedule if c.phase == phase))
        for phase in ("forward", "backward")
    }


def test_explain_rows_of_the_new_layouts():
    cases = {
        "gpt2": ("transformer.h.0.attn.c_attn.weight", "Shard(1) packed×3", (64, 192), (64, 96)),
        "gpt_bigcode": (
            "transformer.h.0.attn.c_attn.weight",
            "Shard(0) parts[64,16r,16r]",
            (96, 64),
            (64, 64),
        ),
        "mixtral": ("model.layers.0.mlp.experts.down_proj", "Shard(2)", (4, 64, 128), (4, 64, 64)),
        "gpt_oss": (
            "model.layers.0.mlp.experts.gate_up_proj",
            "Shard(2)",
            (4, 64, 256),
            (4, 64, 128),
        ),
        "qwen3": ("model.layers.0.self_attn.q_norm.weight", "Replicate()", (16,), (16,)),
    }
    for family, (name, placement, shape, local) in cases.items():
        model = models.build(f"dtp.models.hf:{family}")
        plan = parse((PLANS / f"{family}.tp").read_text(), f"{family}.tp")
        ex = explain(check(plan, model, 2), model, family, 2, batch=2, seq=8)
        row = next(r for r in ex.rows if r.name == name)
        assert (row.placement, row.shape, row.local_shape) == (placement, shape, local), family
        assert ex.bytes_per_rank == sum(r.bytes_per_rank for r in ex.rows)


def test_unequal_parts_on_phi3_qkv():
    # qkv_proj: 4 query heads, 2 key/value heads of 16: 64/32/32
    model = models.build("dtp.models.hf:phi3")
    plan = parse((PLANS / "phi3.tp").read_text(), "phi3.tp")
    rows = {
        tp: next(
            r
            for r in explain(check(plan, model, tp), model, "phi3", tp, batch=2, seq=8).rows
            if r.name == "model.layers.0.self_attn.qkv_proj.weight"
        )
        for tp in (2, 4)
    }
    assert (rows[2].placement, rows[2].shape, rows[2].local_shape) == (
        "Shard(0) parts[64,32,32]",
        (128, 64),
        (64, 64),
    )
    # tp 4 > 2 key/value heads: each rank its query heads' k and v head (repeat(kv))
    assert (rows[4].placement, rows[4].local_shape) == ("Shard(0) parts[64,32h2,32h2]", (48, 64))


def test_pack_parts_round_trip_and_layout():
    import torch

    from dtp.compiler.placed import pack_parts, unpack_parts

    # parts of 8 (sharded), 4 (sharded), 2 (replicated)
    t = torch.arange(8.0 + 4 + 2).reshape(-1, 1)
    parts = ((8, True), (4, True), (2, False))
    packed = pack_parts(t, parts, 2)
    assert packed.flatten().tolist() == [0, 1, 2, 3, 8, 9, 12, 13, 4, 5, 6, 7, 10, 11, 12, 13]
    assert torch.equal(unpack_parts(packed, parts, 2), t)


def test_repeat_parts_give_each_rank_its_query_heads_kv_head():
    import torch

    from dtp.compiler.placed import pack_parts, unpack_parts
    from dtp.layout.placement import ParamPlacement

    # q of 8 rows (sharded), 2 key/value heads of 2 rows (repeat)
    t = torch.arange(8.0 + 4).reshape(-1, 1)
    parts = ((8, True), (4, 2))
    # ranks 0, 1 read head 0 (rows 8, 9); ranks 2, 3 head 1 (rows 10, 11)
    packed = pack_parts(t, parts, 4)
    assert packed.flatten().tolist() == [0, 1, 8, 9, 2, 3, 8, 9, 4, 5, 10, 11, 6, 7, 10, 11]
    assert torch.equal(unpack_parts(packed, parts, 4), t)
    # tp divides: shard
    assert pack_parts(t, parts, 2).flatten().tolist() == [0, 1, 2, 3, 8, 9, 4, 5, 6, 7, 10, 11]
    placement = ParamPlacement(0, 1, parts)
    assert (
        placement.local_shape((12, 1), 4),
        placement.replicated_rows(4),
        placement.replicated_rows(2),
    ) == ((4, 1), 4, 0)
    assert _errors(
        "dtp 1\nmodel.layers.*.self_attn.k_proj: colwise(packed=[repeat(kv)])\n"
        "model.layers.*.self_attn.v_proj: colwise(packed=[repeat(kv)])\n",
        "llama",
        3,
    )[0].endswith(
        "packed part 1 (repeat(kv), 32 features) holds 2 key/value heads: tp=3 neither divides them "
        "nor is a "
        "multiple of them, so ranks cannot share whole heads"
    )
