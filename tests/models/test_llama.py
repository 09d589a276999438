"""The Llama family: Hugging Face's module names and numerics, zoo sizes, checks, and parity on gloo
ranks."""

from __future__ import annotations

import time

import pytest
import torch

from dtp import cli, models
from dtp.layout.attention import config_heads
from dtp.models.llama import Llama, LlamaConfig
from dtp.verify.apply import launch_apply
from dtp.verify.rank import RunConfig

transformers = pytest.importorskip(
    "transformers", reason="tests install transformers via the test extras"
)


def hf_llama(cfg: LlamaConfig) -> torch.nn.Module:
    """transformers' LlamaForCausalLM with the same hyper-parameters as `cfg`."""
    config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        max_position_embeddings=cfg.block_size,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def n_params(cfg: LlamaConfig) -> int:
    """Llama's parameter count with untied embeddings, written out."""
    C, I, V = cfg.n_embd, cfg.intermediate_size, cfg.vocab_size
    kv = cfg.n_kv_head * (C // cfg.n_head)  # width of k_proj and v_proj
    attn = C * C + 2 * C * kv + C * C  # q, k, v, o; no biases
    mlp = 3 * C * I  # gate, up, down
    # embed, layers (2 RMSNorms), norm, lm_head
    return V * C + cfg.n_layer * (attn + mlp + 2 * C) + C + V * C


# ---- the model -----------------------------------------------------------------------------------------


def test_module_names_are_hugging_faces():
    source = models.resolve("llama-tiny")
    assert source.family == "llama"
    ours = models.build(source)
    with torch.device("meta"):
        theirs = hf_llama(source.config)
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in theirs.named_modules()]
    assert {n: p.shape for n, p in ours.named_parameters()} == {
        n: p.shape for n, p in theirs.named_parameters()
    }


@pytest.mark.parametrize("name", ["llama-tiny", "llama-tiny-packed"])
def test_output_equals_hugging_face_llama(name):
    cfg = models.resolve(name).config
    torch.manual_seed(0)
    ours = Llama(cfg).eval()
    theirs = hf_llama(cfg).eval()
    state = ours.state_dict()
    if cfg.packed_gate_up:  # one Linear's rows are [gate; up]
        for key in [k for k in state if k.endswith("gate_up_proj.weight")]:
            gate, up = state.pop(key).chunk(2)
            (
                state[key.replace("gate_up_proj", "gate_proj")],
                state[key.replace("gate_up_proj", "up_proj")],
            ) = gate, up
    theirs.load_state_dict(state)  # strict: the same names hold the same weights
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    with torch.no_grad():
        got, want = ours(ids), theirs(ids).logits
    assert got.shape == (2, cfg.block_size, cfg.vocab_size)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_init_is_deterministic():
    cfg = models.resolve("llama-tiny").config
    torch.manual_seed(0)
    a = Llama(cfg).state_dict()
    torch.manual_seed(0)
    b = Llama(cfg).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(n_head=5), "n_embd=64 is not a multiple of n_head=5"),
        (dict(n_kv_head=3), "n_head=4 is not a multiple of n_kv_head=3"),
        (dict(n_layer=0), "n_layer must be a positive integer, got 0"),
        (
            dict(norm_eps="1e-5"),
            "norm_eps must be a positive number, got '1e-5' (YAML reads 1e-5 as text: write "
            "1.0e-5)",
        ),
        (dict(dropout=0.1), "dropout must be 0 (Llama has no dropout), got 0.1"),
    ],
)
def test_config_validation(bad, message):
    base = dict(
        n_layer=2,
        n_head=4,
        n_kv_head=2,
        n_embd=64,
        intermediate_size=128,
        vocab_size=256,
        block_size=64,
    )
    with pytest.raises(ValueError) as err:
        LlamaConfig(**{**base, **bad})
    assert str(err.value) == message


def test_llama3_70b_on_meta_is_fast_and_has_its_parameter_count():
    start = time.perf_counter()
    model = models.build("llama3-70b")
    assert time.perf_counter() - start < 10
    assert all(p.is_meta for p in model.parameters())
    count = sum(p.numel() for p in model.parameters())
    assert count == n_params(model.config) == 70_553_706_496
    assert sum(p.numel() for p in models.build("llama3-8b").parameters()) == 8_030_261_248
    assert sum(p.numel() for p in models.build("llama2-7b").parameters()) == 6_738_415_616


def test_heads_come_from_the_config():
    info = config_heads(models.build("llama3-8b"))
    assert (info.n_head, info.n_kv_head, info.head_dim) == (32, 8, 128)


# ---- plans -----------------------------------------------------------------------------------------


def test_explain_llama3_8b_at_tp8(repo, capsys):
    assert cli.main(["explain", "plans/llama.tp", "llama3-8b", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.31.self_attn.k_proj.weight" in out
    assert "(1024, 4096)    (128, 4096)" in out  # 8 key/value heads of 128: one per rank


def test_check_names_key_value_heads(repo, capsys):
    assert cli.main(["check", "plans/llama.tp", "llama-tiny", "--tp", "4"]) == 2
    lines = capsys.readouterr().err.splitlines()
    for line, proj in ((12, "k_proj"), (13, "v_proj")):
        assert (
            f"plans/llama.tp:{line}:23: error: model.layers.0.self_attn.{proj} (and 1 more module): "
            "2 key/value "
            "heads (head size 16, config.n_kv_head) do not divide by tp=4; each rank must hold "
            "whole heads; "
            "tp values that work: 1, 2; or give each rank the key/value head its query heads read: "
            "`colwise(packed=[repeat(kv)])` on the key and value projections, which works at tp 1, "
            "2, 4; the "
            "attention repeats key/value heads by n_rep, so where tp ≥ 2 also "
            "`set model.layers.*.self_attn.n_rep = 4 / tp` (both under a `when`, as "
            "plans/hf/llama.tp does)"
        ) in lines
    assert lines[-1] == "2 errors"
    assert cli.main(["check", "plans/llama.tp", "llama-tiny", "--tp", "2"]) == 0
    assert capsys.readouterr().out == (
        "plans/llama.tp: ok on llama-tiny: 16 modules claimed by 9 rules, "
        "0 attribute rewrites; tp=2\n"
    )


@pytest.mark.parametrize(
    "plan, model",
    [("plans/llama.tp", "llama-tiny"), ("plans/llama-packed.tp", "llama-tiny-packed")],
)
def test_parity_on_two_ranks(repo, plan, model):
    report = launch_apply(RunConfig(plan=plan, model=model, tp=2, steps=2))
    parity = report.parity
    assert parity["ok"], parity
    for q in ("logits", "loss", "grads", "params"):
        assert parity[q]["max_rel"] < 1e-5, (q, parity[q])
    # Megatron, as for GPT: forward embedding 1 + o_proj and down_proj per layer + 3 vocab-parallel
    # loss; backward one input gradient per attention and per MLP (q/k/v and gate/up share it) +
    # lm_head's.
    assert report.collectives["forward"] == {"all_reduce": 1 + 2 * 2 + 3}
    assert report.collectives["backward"] == {"all_reduce": 2 * 2 + 1}


def test_the_repeat_kv_hint_is_a_plan_that_holds_at_tp_4(repo):
    # check's refusal of plans/llama.tp at tp 4 names repeat(kv) and the n_rep rewrite; written
    # down, they prove
    report = launch_apply(
        RunConfig(plan="plans/llama-repeat.tp", model="llama-tiny", tp=4, steps=2)
    )
    assert report.parity["ok"], report.parity["worst_tensor"]
    # + one all-reduce per layer for each of k_proj's and v_proj's repeated rows (the analytic
    # schedule agrees)
    assert report.collectives["by_op"] == {"all_reduce": 13 + 2 * 2}
    assert report.collectives["bytes"] == report.analytic_collectives["bytes"]
