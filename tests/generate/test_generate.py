"""`dtp generate`: greedy decoding of the sharded model through its own KV cache, compared token by
token with the unsharded model; the tokens of Hugging Face directories equal transformers' own
`generate` on the unsharded model, and a model wrong only in its cache path fails."""

from __future__ import annotations

import json

import pytest
import torch

from dtp.cli import main
from dtp.errors import UsageError
from dtp.generate.prompts import Tokens
from tests.fixtures.decode_paths import PLAN as DECODE_PLAN

PADDED = "5 6 7;8 9 10 11 12 13"  # two prompts of different lengths: the first is left-padded
DECODE = "tests.fixtures.decode_paths"


def _saved(tmp_path, family: str) -> str:
    """A tiny float64 Hugging Face model of `family` written by save_pretrained."""
    from transformers import AutoModelForCausalLM

    from dtp.models import hf

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf.config(family)).to(torch.float64)
    directory = tmp_path / family
    model.save_pretrained(directory)
    return str(directory)


def _transformers_tokens(directory: str, new: int) -> list[list[int]]:
    """What transformers' own `generate` gives on the unsharded model for PADDED, greedily."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    prompts = [[int(i) for i in p.split()] for p in PADDED.split(";")]
    width = max(map(len, prompts))
    pad = model.generation_config.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False)
    return out[:, width:].tolist()


@pytest.mark.parametrize(
    ("family", "plan", "tp"),
    [
        ("llama", "plans/hf/llama.tp", 2),  # grouped-query: 2 key/value heads
        ("qwen2", "plans/hf/qwen2.tp", 2),
        ("gpt2", "plans/hf/gpt2.tp", 2),
        ("gpt2", "plans/hf/gpt2.tp", 4),
    ],
)
def test_tokens_are_transformers_own_on_the_unsharded_model(repo, tmp_path, family, plan, tp):
    directory = _saved(tmp_path, family)
    out = tmp_path / "report.json"
    argv = ["generate", plan, directory, "--tp", str(tp), "--dtype", "float64"]
    assert main([*argv, "--prompt-ids", PADDED, "--max-new-tokens", "6", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["tokens"] == _transformers_tokens(directory, 6)
    assert report["ok"] and report["matches_unsharded"] and report["decoded_with_cache"]
    per_rank, whole = report["kv_cache_bytes_per_rank"], report["kv_cache_bytes_unsharded"]
    assert len(per_rank) == tp and max(per_rank) <= whole / tp  # each rank: its heads' cache
    # Megatron's 2 all-reduces per layer, the embedding's, and the vocabulary-parallel logits
    # gathered for the greedy choice
    assert report["collectives_per_token"] == {"all_reduce": 5, "all_gather": 1}
    assert report["prefill_ms"] > 0 and report["tokens_per_s"] > 0
    # each rank holds its shards and what the plan keeps whole: more than 1/tp of the model's
    # bytes, less than all of them, the same on every rank; the bandwidth is those bytes and the
    # cache over the median step
    weights, whole_weights = report["weight_bytes_per_rank"], _model_bytes(directory)
    assert len(set(weights)) == 1 and whole_weights / tp < weights[0] < whole_weights
    read = (weights[0] + per_rank[0]) / (report["ms_per_token"] / 1e3) / 1e9
    assert report["memory_gb_per_s"] == pytest.approx(read, rel=1e-9)


def _model_bytes(directory: str) -> int:
    """The bytes of the unsharded model's parameters and buffers, as transformers loads it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def test_a_model_wrong_only_in_its_cache_path_fails_at_the_first_decode_step(
    repo, tmp_path, capsys
):
    plan = tmp_path / "plan.tp"
    plan.write_text(DECODE_PLAN)
    argv = ["generate", str(plan), "--prompt-ids", PADDED, "--max-new-tokens", "4"]
    assert main([*argv[:2], f"{DECODE}:cache_wrong", *argv[2:]]) == 1
    out = capsys.readouterr().out
    assert "token-exact: FAILED — from step 2 (decode step 1) the logits leave the unsharded" in out
    assert (
        main([*argv[:2], f"{DECODE}:decodes", "--json", str(tmp_path / "r.json"), *argv[2:]]) == 0
    )
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["collectives_per_token"] == {"all_reduce": 2}  # one per layer's rowwise wo
    assert report["parity"]["logits"]["compared"] == 4 and report["parity"]["logits"]["margin"] < 1


def test_a_model_without_a_cache_decodes_the_whole_sequence_and_says_so(repo, tmp_path, capsys):
    argv = ["generate", "plans/gpt2.tp", "gpt2-tiny", "--prompt", "def f(x):", "--prompt", "a"]
    assert main([*argv, "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "no KV cache: its forward takes no cache (`cache` or `past_key_values`)" in out
    assert "token-exact: OK" in out and "prompt 1: " in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--prompt-ids", "1 2;3 x"],
            "--prompt-ids: prompt 2 has 'x'; ids are integers from 0 to 127",
        ),
        (["--prompt-ids", "1 2;;3"], "--prompt-ids: prompt 2 is empty"),
        (
            ["--prompt-ids", "1 200"],
            "--prompt-ids: prompt 1 has '200'; ids are integers from 0 to 127",
        ),
        (["--prompt", "hi"], "--prompt needs a tokenizer: the model has no tokenizer.json"),
        (
            ["--prompt-ids", " ".join(["1"] * 60), "--max-new-tokens", "10"],
            "the longest prompt (60 tokens) + --max-new-tokens 10 = 70 is beyond the model's 64 "
            "positions",
        ),
    ],
)
def test_bad_prompts_are_usage_errors(repo, tmp_path, capsys, argv, message):
    plan = tmp_path / "plan.tp"
    plan.write_text(DECODE_PLAN)
    assert main(["generate", str(plan), f"{DECODE}:decodes", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("kind", ["link", "directory", "huge"])
def test_a_tokenizer_json_that_is_not_a_bounded_file_is_refused(tmp_path, kind):
    # a link (to anything), a directory in its place, a 129 MiB file (sparse: nothing is written):
    # one line each, before a byte of it is parsed
    target = tmp_path / "tokenizer.json"
    if kind == "link":
        (tmp_path / "elsewhere.json").write_text("{}")
        target.symlink_to(tmp_path / "elsewhere.json")
        message = "is a symbolic link; dtp reads a model's files only as files"
    elif kind == "directory":
        target.mkdir()
        message = "is not a regular file"
    else:
        with open(target, "wb") as f:
            f.truncate(129 << 20)
        message = f"is {129 << 20} bytes; a tokenizer is at most 131072 KiB"
    with pytest.raises(UsageError) as info:
        Tokens(tmp_path, 1000)
    assert message in str(info.value) and "\n" not in str(info.value)
