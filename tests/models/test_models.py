"""The MODEL argument: the zoo, YAML configs and `package.module:factory`."""

from __future__ import annotations

import dataclasses
import sys
import uuid
from pathlib import Path

import pytest
import torch.nn as nn
import yaml

from dtp import cli, models
from dtp.errors import UsageError
from dtp.layout.attention import Heads, config_heads
from dtp.models.gpt import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "dtp" / "models" / "configs"
GPT_ZOO = [
    "gpt2",
    "gpt2-large",
    "gpt2-medium",
    "gpt2-tiny",
    "gpt2-xl",
    "megatron-1.2b",
    "megatron-2.5b",
    "megatron-4.2b",
    "megatron-8.3b",
]
ZOO = sorted(p.stem for p in CONFIGS.glob("*.yaml"))  # every shipped config, whatever its family
KNOWN_KEYS = "n_layer, n_head, n_embd, vocab_size, block_size, dropout, bias, tie_embeddings"


def n_params(cfg: GPTConfig) -> int:
    """GPT-2's parameter count with tied embeddings, written out."""
    C = cfg.n_embd
    return cfg.vocab_size * C + cfg.block_size * C + cfg.n_layer * (12 * C * C + 13 * C) + 2 * C


# ---- the zoo -------------------------------------------------------------------------------------------


def test_zoo_names_are_the_shipped_configs():
    assert models.zoo_names() == ZOO
    assert set(GPT_ZOO) <= set(ZOO)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_loads_with_its_yaml_values(name):
    source = models.resolve(name)
    written = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text(encoding="utf-8"))
    family = written.pop("family", "gpt")
    assert (source.name, source.family, source.factory) == (name, family, None)
    assert {k: getattr(source.config, k) for k in written} == written
    model = models.build(source, device="meta")
    assert type(model) is models.FAMILIES[family][1]
    assert all(p.is_meta for p in model.parameters())
    if family == "gpt":
        assert isinstance(model, GPT)
        assert sum(p.numel() for p in model.parameters()) == n_params(source.config)
    else:
        assert name not in GPT_ZOO


def test_gpt2_small_has_gpt2_parameter_count():
    model = models.build("gpt2")
    assert sum(p.numel() for p in model.parameters()) == 124_439_808


def test_module_names_are_gpt2s():
    model = models.build("gpt2-tiny")
    block = [
        "",
        ".ln_1",
        ".attn",
        ".attn.c_attn",
        ".attn.c_proj",
        ".attn.resid_dropout",
        ".ln_2",
        ".mlp",
        ".mlp.c_fc",
        ".mlp.gelu",
        ".mlp.c_proj",
        ".mlp.dropout",
    ]
    expected = (
        [
            "",
            "transformer",
            "transformer.wte",
            "transformer.wpe",
            "transformer.drop",
            "transformer.h",
        ]
        + [f"transformer.h.{i}{s}" for i in range(2) for s in block]
        + ["transformer.ln_f", "lm_head"]
    )
    assert [n for n, _ in model.named_modules()] == expected
    kinds = {n: type(m).__name__ for n, m in model.named_modules()}
    assert (
        kinds["transformer.wte"],
        kinds["transformer.h.1.attn.c_attn"],
        kinds["transformer.h.0.ln_2"],
        kinds["transformer.ln_f"],
        kinds["lm_head"],
    ) == ("Embedding", "Linear", "LayerNorm", "LayerNorm", "Linear")
    c_attn = model.transformer.h[0].attn.c_attn
    assert (c_attn.in_features, c_attn.out_features) == (64, 192)
    assert model.transformer.h[0].attn.head_dim == 16


def test_lm_head_is_tied_to_wte_by_default():
    model = models.build("gpt2-tiny")
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.lm_head.bias is None
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "lm_head.weight" in names and "lm_head.weight" not in dict(model.named_parameters())


def test_untied_config(tmp_path):
    path = tmp_path / "untied.yaml"
    path.write_text(
        "n_layer: 1\nn_head: 2\nn_embd: 8\nvocab_size: 16\nblock_size: 4\ntie_embeddings: false\n"
    )
    model = models.build(str(path))
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert sum(p.numel() for p in model.parameters()) == n_params(model.config) + 16 * 8


def test_vocab_and_heads_helpers():
    model = models.build("gpt2-tiny")
    assert models.vocab_size(model) == 256
    assert config_heads(model) == Heads(4, 4, 16, "config.n_head", "config.n_head")
    assert models.vocab_size(nn.Sequential(nn.Embedding(7, 2), nn.Embedding(9, 2))) == 9
    assert config_heads(nn.Linear(2, 2)) is None


# ---- YAML configs ----------------------------------------------------------------------------------------


def test_yaml_missing_keys_take_gpt2_defaults(tmp_path):
    path = tmp_path / "small.yaml"
    path.write_text("# just one layer\nn_layer: 1\n")
    family, cfg = models.read_config(path)
    assert family == "gpt"
    assert cfg == GPTConfig(
        n_layer=1,
        n_head=12,
        n_embd=768,
        vocab_size=50257,
        block_size=1024,
        dropout=0.0,
        bias=True,
        tie_embeddings=True,
    )
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert models.read_config(empty) == ("gpt", GPTConfig())
    assert models.resolve(str(empty)).config == GPTConfig()


def test_yaml_unknown_key_names_file_and_key(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("n_layers: 2\n")
    with pytest.raises(UsageError) as info:
        models.resolve(str(path))
    assert (
        str(info.value) == f"model config {path}: unknown key 'n_layers'; known keys: {KNOWN_KEYS}"
    )


@pytest.mark.parametrize(
    "text, message",
    [
        ("family: mamba\n", "unknown family 'mamba'; known: {families}"),
        ("n_head: 5\n", "n_embd=768 is not a multiple of n_head=5"),
        ("n_layer: 0\n", "n_layer must be a positive integer, got 0"),
        ("n_layer: two\n", "n_layer must be a positive integer, got 'two'"),
        ("vocab_size: true\n", "vocab_size must be a positive integer, got True"),
        ("dropout: 1.5\n", "dropout must be in [0, 1), got 1.5"),
    ],
)
def test_yaml_bad_values(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as info:
        models.resolve(str(path))
    families = ", ".join(sorted(models.FAMILIES))
    assert "gpt" in models.FAMILIES
    assert str(info.value) == f"model config {path}: {message.format(families=families)}"


def test_yaml_not_a_mapping_or_not_yaml(tmp_path):
    listed = tmp_path / "list.yaml"
    listed.write_text("- 1\n- 2\n")
    with pytest.raises(UsageError) as info:
        models.resolve(str(listed))
    assert str(info.value) == f"model config {listed} must be a mapping of keys to values"
    broken = tmp_path / "broken.yml"
    broken.write_text("n_layer: [1\n")
    with pytest.raises(UsageError) as info:
        models.resolve(str(broken))
    assert str(info.value).startswith(f"model config {broken} is not valid YAML: ")
    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"n_layer: 1 # caf\xe9\n")
    with pytest.raises(UsageError) as info:
        models.resolve(str(latin))
    assert str(info.value).startswith(f"cannot read model config {latin}: ")


def test_unknown_model_spec(tmp_path):
    with pytest.raises(UsageError) as info:
        models.resolve("gpt3")
    assert str(info.value) == (
        f"unknown model 'gpt3': give a zoo name ({', '.join(ZOO)}), a path to a model YAML "
        "file, package.module:factory, or a Hugging Face model directory (config.json + "
        "safetensors)"
    )
    with pytest.raises(UsageError) as info:
        models.resolve(str(tmp_path / "absent.yaml"))
    assert str(info.value) == f"model config {tmp_path / 'absent.yaml'} does not exist"
    with pytest.raises(UsageError, match="^unknown model 'pkg:not-an-identifier'"):
        models.resolve("pkg:not-an-identifier")


# ---- factories -----------------------------------------------------------------------------------------------

FACTORY_SOURCE = """
import torch.nn as nn

CONST = 3
calls = []

class ns:
    @staticmethod
    def make():
        return nn.Linear(4, 8)

def good():
    calls.append(1)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

def boom():
    raise RuntimeError("kaboom")

def notmodule():
    return {"a": 1}
"""


@pytest.fixture
def factory_module(tmp_path, monkeypatch):
    """A factory module in a fresh working directory, under a name unique to the test."""
    name = f"dtp_test_factories_{uuid.uuid4().hex[:12]}"
    (tmp_path / f"{name}.py").write_text(FACTORY_SOURCE)
    monkeypatch.chdir(tmp_path)
    # `build` puts the working directory on sys.path
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield name
    sys.modules.pop(name, None)


def test_factory_builds_on_meta(factory_module):
    source = models.resolve(f"{factory_module}:good")
    assert (source.factory, source.family, source.config) == (f"{factory_module}:good", None, None)
    model = models.build(source, device="meta")
    assert [type(m).__name__ for m in model] == ["Linear", "ReLU", "Linear"]
    assert all(p.is_meta for p in model.parameters())
    assert sys.modules[factory_module].calls == [1]
    nested = models.build(f"{factory_module}:ns.make")
    assert isinstance(nested, nn.Linear) and nested.weight.is_meta


@pytest.mark.parametrize(
    "func, message",
    [
        ("nothere", "model factory {m}:nothere: module '{m}' has no attribute 'nothere'"),
        ("ns.nothere", "model factory {m}:ns.nothere: module '{m}' has no attribute 'ns.nothere'"),
        ("CONST", "model factory {m}:CONST is not callable"),
        ("boom", "model factory {m}:boom raised RuntimeError: kaboom"),
        ("notmodule", "model factory {m}:notmodule returned dict, not an nn.Module"),
    ],
    ids=["missing", "missing-nested", "not-callable", "raises", "not-a-module"],
)
def test_factory_errors_are_usage_errors(factory_module, func, message):
    with pytest.raises(UsageError) as info:
        models.build(f"{factory_module}:{func}")
    assert str(info.value) == message.format(m=factory_module)


def test_factory_bad_module(factory_module):
    with pytest.raises(UsageError) as info:
        models.build("dtp_no_such_module_xyz:make")
    assert str(info.value) == (
        "cannot import 'dtp_no_such_module_xyz' for model factory dtp_no_such_module_xyz:make: "
        "No module named 'dtp_no_such_module_xyz'"
    )
    with pytest.raises(UsageError) as info:
        models.build("dtp.no_such_sub:make")
    assert str(info.value) == (
        "cannot import 'dtp.no_such_sub' for model factory dtp.no_such_sub:make: "
        "No module named 'dtp.no_such_sub'"
    )


def test_factory_errors_through_the_cli(factory_module, capsys):
    plan = str(ROOT / "plans" / "gpt2.tp")
    assert cli.main(["check", plan, f"{factory_module}:boom", "--tp", "2"]) == 2
    assert capsys.readouterr() == (
        "",
        f"error: model factory {factory_module}:boom raised RuntimeError: kaboom\n",
    )
    assert cli.main(["check", plan, f"{factory_module}:good"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{plan}:8:1: error: pattern 'transformer.wte' matches no module")


def test_config_dataclass_fields_are_the_documented_keys():
    assert ", ".join(f.name for f in dataclasses.fields(GPTConfig)) == KNOWN_KEYS
