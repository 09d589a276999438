"""The zoo's GPT and Llama export as Hugging Face classes (GPT2LMHeadModel, LlamaForCausalLM) that
compute what the zoo model computes: logits equal to float32 rounding on the same tokens, and the
whole CLI round trip (train → checkpoint → `dtp export --hf-dir` → `from_pretrained`)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from conftest import dtp_cli

from dtp import models
from dtp.checkpoint.zoo_hf import to_hf_state, zoo_hf_config

transformers = pytest.importorskip("transformers")


def _hf(config: dict) -> torch.nn.Module:
    rest = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **rest)
    return getattr(transformers, config["architectures"][0])(hf_config).eval()


@pytest.mark.parametrize(
    "spec, extra",
    [
        ("gpt2-tiny", {}),
        ("gpt2-tiny", {"bias": False, "tie_embeddings": False}),
        ("llama-tiny", {}),
        ("llama-tiny-packed", {"tie_embeddings": True}),
    ],
)
def test_the_exported_class_computes_what_the_zoo_model_does(spec, extra):
    source = models.resolve(spec)
    if extra:
        source = models.ModelSource(
            spec, source.family, type(source.config)(**{**vars(source.config), **extra})
        )
    torch.manual_seed(0)
    zoo = models.build(source, device="cpu").eval()
    config = zoo_hf_config(zoo)
    hf = _hf(config)
    missing, unexpected = hf.load_state_dict(
        to_hf_state(type(zoo).__name__, config, zoo.state_dict()), strict=False
    )
    assert unexpected == [] and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    ids = torch.randint(
        0, config["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        want, got = zoo(ids), hf(ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_train_checkpoint_export_from_pretrained(tmp_path, repo):
    ck, out = tmp_path / "ck", tmp_path / "hf"
    proc = dtp_cli(
        "train",
        "plans/gpt2.tp",
        "gpt2-tiny",
        "--tp",
        "2",
        "--steps",
        "2",
        "--checkpoint",
        str(ck),
        "--out",
        str(tmp_path / "run"),
    )
    assert proc.returncode == 0, proc.stderr[-800:]
    assert dtp_cli("export", str(ck), "--hf-dir", str(out)).returncode == 0
    assert dtp_cli("export", str(ck), "-o", str(tmp_path / "plain.pt")).returncode == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    zoo = models.build("gpt2-tiny", device="cpu").eval()
    # the trained weights, dtp's layout
    zoo.load_state_dict(torch.load(tmp_path / "plain.pt", weights_only=True))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got = zoo(ids), hf(ids).logits
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def test_export_into_a_used_directory_replaces_links_and_old_weights(tmp_path, repo):
    ck = tmp_path / "ck"
    args = ["--tp", "2", "--steps", "1", "--checkpoint", str(ck), "--out", str(tmp_path / "run")]
    assert dtp_cli("train", "plans/gpt2.tp", "gpt2-tiny", *args).returncode == 0
    # a Hugging Face cache snapshot: its files are links to blobs other revisions share; and an old
    # sharded model whose index would shadow the new single file
    blobs, out = tmp_path / "blobs", tmp_path / "snapshot"
    blobs.mkdir()
    out.mkdir()
    for name in ("config.json", "model.safetensors"):
        (blobs / name).write_text("shared blob")
        (out / name).symlink_to(blobs / name)
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "model-00001-of-00002.safetensors").write_text("old shard")
    (out / "tokenizer.json").write_text("{}")  # not the model's weights: kept
    assert dtp_cli("export", str(ck), "--hf-dir", str(out)).returncode == 0
    assert all(
        (blobs / n).read_text() == "shared blob" for n in ("config.json", "model.safetensors")
    )
    assert not any((out / n).is_symlink() for n in ("config.json", "model.safetensors"))
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert not list(tmp_path.glob(".snapshot.tmp-*"))  # the staging directory is gone
    transformers.GPT2LMHeadModel.from_pretrained(out)
    # a checkpoint whose saved config was edited to ask for code of its own is not exported
    # (the completion marker is not a signature: the editor updates its size and hash too)
    meta = json.loads((ck / "dtp.json").read_text())
    meta["hf_config"]["auto_map"] = {"AutoModelForCausalLM": "evil--repo--modeling.Evil"}
    edited = json.dumps(meta).encode()
    (ck / "dtp.json").write_bytes(edited)
    marker = json.loads((ck / "COMPLETE").read_text())
    marker["files"]["dtp.json"] = len(edited)
    marker["sha256"]["dtp.json"] = hashlib.sha256(edited).hexdigest()
    (ck / "COMPLETE").write_text(json.dumps(marker, indent=1, sort_keys=True) + "\n")
    proc = dtp_cli("export", str(ck), "--hf-dir", str(tmp_path / "evil"))
    assert proc.returncode == 2 and "auto_map" in proc.stderr, proc.stderr
    assert not (tmp_path / "evil" / "config.json").exists()
