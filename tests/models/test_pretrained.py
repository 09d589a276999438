"""A save_pretrained directory as MODEL: `check` from its config, `apply` from its weights, `train`
at tp 2 from its own weights (each rank reading its slices; first-step loss equal to the unsharded
model's) and `export --hf-dir` back bit-exact; a directory that ships code or misses a tensor is
exit 2 before any rank starts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtp.cli import main
from dtp.models import pretrained
from dtp.train import data

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

TINY = dict(vocab_size=256, max_position_embeddings=64)


def _save(tmp_path: Path, family: str) -> Path:
    """A tiny pretrained model of `family` (llama: GQA, untied; llama_tied: the head is the
    embedding, absent from the file; gpt2: packed Conv1D qkv sharded on dim 1, tied head)."""
    torch.manual_seed(0)
    if family.startswith("llama"):
        config = transformers.LlamaConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=family == "llama_tied",
            **TINY,
        )
    else:
        config = transformers.GPT2Config(
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            vocab_size=256,
            # the reference: eval
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / family, safe_serialization=True)
    return tmp_path / family


@pytest.fixture
def tokens(tmp_path) -> Path:
    path = tmp_path / "tokens.bin"
    (np.arange(8192) * 7 % 251).astype(np.uint16).tofile(path)
    return path


def test_check_and_apply_read_a_pretrained_directory(repo, tmp_path):
    model = str(_save(tmp_path, "llama"))
    assert main(["check", "plans/hf/llama.tp", model, "--tp", "2"]) == 0
    # parity OK
    assert main(["apply", "plans/hf/llama.tp", model, "--tp", "2", "--steps", "1"]) == 0


# gpt2: a packed Conv1D c_attn, sharded on its dim 1, stored as (in, 3, out/3)
@pytest.mark.parametrize("family,export", [("llama", True), ("llama_tied", True), ("gpt2", True)])
def test_train_at_tp_2_starts_from_the_files_and_exports_back_bit_exact(
    repo, tmp_path, tokens, family, export
):
    model = _save(tmp_path, family)
    out, ckpt, back = tmp_path / "out", tmp_path / "ckpt", tmp_path / "back"
    # a shipped plan's name: the ranks must find its file too
    plan = f"hf/{family.removesuffix('_tied')}"
    # lr 1e-30 moves no float32 weight (far below half an ulp): the checkpoint holds the initial
    # weights
    assert (
        main(
            [
                "train",
                plan,
                str(model),
                "--tp",
                "2",
                "--steps",
                "1",
                "--batch",
                "2",
                "--seq",
                "16",
                "--warmup",
                "0",
                "--lr",
                "1e-30",
                "--min-lr",
                "0",
                "--data",
                str(tokens),
                "--out",
                str(out),
                *(["--checkpoint", str(ckpt)] if export else []),
            ]
        )
        == 0
    )
    loss = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]

    reference = transformers.AutoModelForCausalLM.from_pretrained(model)  # transformers' own loader
    corpus = data.prepare(str(tokens), tmp_path / "cache", model_vocab=256)
    inputs, targets = data.train_batch(corpus, corpus.tokens(), 0, 0, 2, 16, 1, 0)
    with torch.no_grad():
        expected = F.cross_entropy(reference(inputs).logits.flatten(0, 1), targets.flatten()).item()
    assert loss == pytest.approx(expected, rel=1e-6, abs=1e-6)
    if not export:
        return
    assert main(["export", str(ckpt), "--hf-dir", str(back)]) == 0
    original, exported = (
        load_file(model / "model.safetensors"),
        load_file(back / "model.safetensors"),
    )
    assert original.keys() <= exported.keys()  # a tied head is written under both names
    # a weight of 0 (GPT-2's biases) moves by lr itself: 1e-30, no more
    for name, value in original.items():
        got, zero = exported[name], value == 0
        assert torch.equal(got[~zero], value[~zero]) and bool((got[zero].abs() <= 1e-29).all()), (
            name
        )
    assert (
        type(transformers.AutoModelForCausalLM.from_pretrained(back)).__name__
        == type(reference).__name__
    )


def test_a_directory_that_ships_code_is_refused(repo, tmp_path, capsys):
    model = _save(tmp_path, "llama")
    capsys.readouterr()  # save_pretrained's progress bar
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    assert main(["check", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "auto_map" in err and "never runs" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"text_config": {"auto_map": {"AutoConfig": "evil.EvilConfig"}}},
            "config.json sets text_config.auto_map: the model's classes are code shipped",
        ),
        ({"num_hidden_layers": 1000000}, "num_hidden_layers is 1000000; a model has 1 to 4096"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers is '2'; a model has 1 to 4096"),
        ({"num_attention_heads": 0}, "num_attention_heads is 0; a size is an integer from 1"),
        ({"hidden_size": -4}, "hidden_size is -4; a size is an integer from 1"),
        ({"vocab_size": "128"}, "vocab_size is '128'; a size is an integer from 1"),
        ({"intermediate_size": float("nan")}, "intermediate_size is nan; a size is an integer"),
    ],
)
def test_code_at_any_depth_and_impossible_sizes_are_refused(repo, tmp_path, capsys, edit, message):
    model = _save(tmp_path, "llama")
    capsys.readouterr()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **edit}))
    start = time.monotonic()
    assert main(["check", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 2
    assert time.monotonic() - start < 20  # refused from the file, not after building the model
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_an_index_naming_a_file_with_a_nul_byte_is_refused(repo, tmp_path, capsys):
    model = _save(tmp_path, "llama")
    capsys.readouterr()
    weights = load_file(model / "model.safetensors")
    (model / "model.safetensors").unlink()
    index = {"weight_map": {name: "a\x00b.safetensors" for name in weights}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main(["apply", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "as a safetensors shard: only file names inside the model directory are read" in err
    assert len(err.strip().splitlines()) == 1, err


def test_a_linked_config_is_refused(repo, tmp_path, capsys):
    model = _save(tmp_path, "llama")
    capsys.readouterr()
    target = tmp_path / "elsewhere.json"
    (model / "config.json").rename(target)
    (model / "config.json").symlink_to(target)
    assert main(["check", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "config.json is not a regular file (links, FIFOs and devices are not read)" in err, err


def test_a_config_with_fewer_layers_than_its_weights_is_refused(repo, tmp_path, capsys):
    model = _save(tmp_path, "llama")  # 2 layers
    capsys.readouterr()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    # the pre-flight of a command that reads the weights refuses it before any rank starts
    assert main(["apply", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "holds tensors of modules the model built from its config.json does not have " in err
    assert "(model.layers.1." in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "choice",
    [
        {"attn_implementation": "flash_attention_2"},
        {"_attn_implementation": "kernels-community/flash-attn"},  # a Hub kernel
        {"experts_implementation": "kernels-community/megablocks"},
    ],
)
def test_a_directory_cannot_choose_the_kernels(repo, tmp_path, capsys, monkeypatch, choice):
    # nothing a directory says may import a kernel package or reach the network
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = _save(tmp_path, "llama")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **choice}))
    assert main(["check", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 0
    built = pretrained.build_model(str(model), weights=False)
    assert built.config._attn_implementation in ("eager", "sdpa")


def test_pickled_weights_are_never_read(repo, tmp_path, tokens, capsys):
    model = _save(tmp_path, "llama")
    (model / "model.safetensors").rename(model / "pytorch_model.bin")
    assert main(["apply", "plans/hf/llama.tp", str(model), "--tp", "2", "--steps", "1"]) == 2
    assert "pickle" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["apply", "train"])
def test_a_missing_tensor_is_exit_2_before_any_rank(repo, tmp_path, tokens, capsys, command):
    model = _save(tmp_path, "llama")
    state = load_file(model / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()  # save_pretrained's progress bar
    extra = ["--data", str(tokens), "--out", str(tmp_path / "out")] if command == "train" else []
    assert (
        main([command, "plans/hf/llama.tp", str(model), "--tp", "2", "--steps", "1", *extra]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "model.layers.1.mlp.up_proj.weight" in err and len(err.splitlines()) == 1
    # check reads the config alone: it still plans the model
    assert main(["check", "plans/hf/llama.tp", str(model), "--tp", "2"]) == 0
