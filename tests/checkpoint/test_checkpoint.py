"""Checkpoints reshard: 3 AdamW steps at tp 4, save; load at tp 4, dp 2 × tp 2, tp 2 and tp 1; every
parameter and optimizer tensor is bit-equal to the saved state, and training continues (bit-exactly
at the same layout)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_ranks import REPO, batch, full_state, logits_of, mesh_of, setup, step, tied_once
from torch.distributed.checkpoint import FileSystemWriter

from dtp.checkpoint.dcp import load_checkpoint, save_checkpoint
from dtp.checkpoint.files import CheckpointError, seal
from dtp.checkpoint.untrusted import SafeReader
from dtp.compiler.placed import pack_parts
from dtp.lang.parse import parser
from dtp.layout.parts import equal_parts
from dtp.runtime.ranks import on_ranks

RTOL = 1e-4  # float32 parity tolerance (README): resuming at another tp reorders sums
NAMES = ("gpt", "llama", "hfgpt2")


@pytest.fixture(scope="module", autouse=True)
def _warm_parser():
    """Build the plan parser once here: the forked ranks inherit it instead of each building its
    own."""
    parser()


def _save_at_tp4(rank, world, root):
    out = {}
    for name in NAMES:
        run = setup(name, mesh_of(4), seed=0)
        losses = [step(run, s) for s in range(3)]
        rng = torch.get_rng_state()
        stats = save_checkpoint(
            f"{root}/{name}",
            run.model,
            run.opt,
            mesh=run.mesh,
            plan_text=run.plan_text,
            extra={"step": 3, "rng": rng, "rank": rank},
        )
        saved = full_state(run)
        losses += [step(run, s) for s in range(3, 5)]  # the uninterrupted run
        res = {"losses": losses, "saved": saved, "stats": stats, "rng": rng}
        for label, mesh in (("tp4", mesh_of(4)), ("dp2tp2", mesh_of(2, dp=2))):
            fresh = setup(name, mesh, seed=1)
            load_stats: dict = {}
            extra = load_checkpoint(
                f"{root}/{name}",
                fresh.model,
                fresh.opt,
                mesh=mesh,
                plan_text=fresh.plan_text,
                stats=load_stats,
            )
            res[label] = {
                "state": full_state(fresh),
                "extra": extra,
                "load": load_stats,
                "tied": tied_once(fresh),
            }
            if label == "dp2tp2" and name == "gpt":  # and back: saved under FSDP2, loaded at tp 4
                save_checkpoint(
                    f"{root}/gpt-dp",
                    fresh.model,
                    fresh.opt,
                    mesh=mesh,
                    plan_text=fresh.plan_text,
                    extra=extra,
                )
                back = setup(name, mesh_of(4), seed=2)
                load_checkpoint(
                    f"{root}/gpt-dp", back.model, back.opt, mesh=back.mesh, plan_text=back.plan_text
                )
                res["back"] = full_state(back)
            res[label]["losses"] = [step(fresh, s) for s in range(extra["step"], 5)]
        out[name] = res
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def at_tp4(tmp_path_factory):
    """Checkpoints of both models after 3 steps at tp 4, and what loading them at tp 4 and dp 2 × tp
    2 gave."""
    root = tmp_path_factory.mktemp("ckpt")
    return root, on_ranks(_save_at_tp4, 4, str(root), timeout=300)[0]


def _assert_same_state(got: dict, saved: dict) -> None:
    assert sorted(got) == sorted(saved)
    unequal = [k for k in saved if not torch.equal(got[k], saved[k])]
    assert unequal == []


@pytest.mark.parametrize("name", NAMES)
def test_load_at_tp4_and_dp2_tp2_is_bit_exact(at_tp4, name):
    _, res = at_tp4
    res = res[name]
    params = [k for k in res["saved"] if "/" not in k]
    assert len(res["saved"]) == 4 * len(params)  # each parameter: itself, exp_avg, exp_avg_sq, step
    if name == "gpt":
        # tied to transformer.wte.weight: one tensor, one state
        assert "lm_head.weight" not in res["saved"]
    for label in ("tp4", "dp2tp2"):
        _assert_same_state(res[label]["state"], res["saved"])
        assert res[label]["tied"]
    # Same layout: each rank gets its own `extra` back and training continues bit for bit.
    if name == "gpt":  # saved at dp 2 × tp 2, loaded at tp 4
        _assert_same_state(res["back"], res["saved"])
    assert res["tp4"]["extra"]["step"] == 3 and res["tp4"]["extra"]["rank"] == 0
    assert torch.equal(res["tp4"]["extra"]["rng"], res["rng"])
    assert res["tp4"]["losses"] == res["losses"][3:]
    assert res["dp2tp2"]["losses"] == pytest.approx(res["losses"][3:], rel=RTOL)
    assert res["stats"]["bytes"] > 0 and res["stats"]["seconds"] > 0
    assert res["tp4"]["load"]["bytes"] == res["stats"]["bytes"]


def _load_at(rank, world, root, tp):
    out = {}
    for name in NAMES:
        run = setup(name, mesh_of(tp), seed=1)
        extra = load_checkpoint(
            f"{root}/{name}", run.model, run.opt, mesh=run.mesh, plan_text=run.plan_text
        )
        out[name] = {
            "state": full_state(run),
            "tied": tied_once(run),
            "losses": [step(run, s) for s in range(extra["step"], 5)],
        }
    if tp == 2:  # a Hugging Face Llama, for `dtp export --hf-dir`
        run = setup("hf", mesh_of(tp), seed=0)
        for s in range(3):
            step(run, s)
        save_checkpoint(
            f"{root}/hf",
            run.model,
            run.opt,
            mesh=run.mesh,
            plan_text=run.plan_text,
            extra={"step": 3},
        )
        out["hf"] = {
            "state": full_state(run),
            "logits": logits_of(run, batch(99, run.vocab)[:, :-1]).full_tensor(),
        }
    return out if rank == 0 else None


@pytest.fixture(scope="module")
def at_tp2(at_tp4):
    """Both checkpoints loaded at tp 2, and a Hugging Face Llama trained and saved at tp 2."""
    root, _ = at_tp4
    return on_ranks(_load_at, 2, str(root), 2, timeout=300)[0]


def _assert_resumed(res: dict, saved: dict) -> None:
    for name in NAMES:
        _assert_same_state(res[name]["state"], saved[name]["saved"])
        assert res[name]["tied"]
        assert res[name]["losses"] == pytest.approx(saved[name]["losses"][3:], rel=RTOL)
        # resumed, not restarted
        assert res[name]["losses"] != pytest.approx(saved[name]["losses"][:2], rel=RTOL)


def test_load_at_tp2_is_bit_exact_and_resumes(at_tp4, at_tp2):
    _assert_resumed(at_tp2, at_tp4[1])


def _flip(path, key: str) -> None:
    """Flip one byte in the middle of the stored bytes of tensor `key` (the files keep their sizes)."""
    md = SafeReader(path).read_metadata()
    info = next(v for k, v in md.storage_data.items() if k.fqn == key)
    with (path / info.relative_path).open("r+b") as f:
        f.seek(info.offset + info.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _scramble(src, dst) -> None:
    """Rewrite a checkpoint with gpt's c_attn rows in tp 4's packed order (what a naive DCP save
    stores), keeping shapes and metadata and resealing it: only the content is wrong."""
    reader = SafeReader(src)
    md = reader.read_metadata()
    state = {
        k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in md.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=reader, no_dist=True)
    key = "model/transformer.h.0.attn.c_attn.weight"
    w = state[key]
    state[key] = (
        pack_parts(w.flatten(0, 1), equal_parts(w.shape[0] * w.shape[1], 3), 4).view_as(w).clone()
    )
    dst.mkdir()
    dcp.save(state, storage_writer=FileSystemWriter(dst), no_dist=True)
    shutil.copy(src / "dtp.json", dst / "dtp.json")
    seal(dst)


def _refusals(rank, world, root):
    out = _load_at(rank, world, root, 1)
    run = setup("gpt", mesh_of(1), seed=1)
    for case in ("scrambled", "flipped"):
        try:
            load_checkpoint(
                f"{root}/{case}", run.model, run.opt, mesh=run.mesh, plan_text=run.plan_text
            )
        except CheckpointError as err:
            out[case] = str(err)
    other = run.plan_text.replace(
        "plan gpt2-megatron version 1", "plan gpt2-unpacked version 2"
    ).replace("colwise(packed=3)", "colwise")
    run = setup("gpt", mesh_of(1), seed=1, plan_text=other)
    try:
        load_checkpoint(f"{root}/gpt", run.model, run.opt, mesh=run.mesh, plan_text=other)
    except CheckpointError as err:
        out["plan"] = str(err)
    load_checkpoint(f"{root}/gpt", run.model, run.opt, mesh=run.mesh, plan_text=other, convert=True)
    out["converted"] = full_state(run)
    return out


@pytest.fixture(scope="module")
def at_tp1(at_tp4):
    """Both checkpoints loaded at tp 1; a scrambled, a corrupt and another plan's load attempted."""
    root, _ = at_tp4
    _scramble(root / "gpt", root / "scrambled")
    shutil.copytree(root / "gpt", root / "flipped")
    _flip(root / "flipped", "model/transformer.wte.weight")
    return on_ranks(_refusals, 1, str(root), timeout=300)[0]


def test_load_at_tp1_is_bit_exact_and_resumes(at_tp4, at_tp1):
    _assert_resumed(at_tp1, at_tp4[1])


def test_scrambled_corrupt_and_other_plan_checkpoints_are_refused(at_tp4, at_tp1):
    root, saved = at_tp4
    res = at_tp1
    assert "model/transformer.h.0.attn.c_attn.weight" in res["scrambled"]
    assert "do not match the fingerprints recorded at save" in res["scrambled"]
    assert res["flipped"].startswith(
        f"checkpoint {root}/flipped: model/transformer.wte.weight do not match the "
        "fingerprints recorded at save"
    )
    text = (REPO / "plans/gpt2.tp").read_text()
    other = text.replace("plan gpt2-megatron version 1", "plan gpt2-unpacked version 2").replace(
        "colwise(packed=3)", "colwise"
    )
    digest = [hashlib.sha256(t.encode()).hexdigest()[:12] for t in (text, other)]
    assert res["plan"] == (
        f"checkpoint {root}/gpt was written by plan 'gpt2-megatron' version 1 (sha256 {digest[0]}), "
        ""
        f"not by plan 'gpt2-unpacked' version 2 (sha256 {digest[1]}); load it with convert=True "
        "to re-cut its tensors for this plan"
    )
    # packed=3 → unpacked: the same elements in the model's order, re-cut; bit-equal.
    _assert_same_state(res["converted"], saved["gpt"]["saved"])


def _save_then_die(rank, world, root, where):
    run = setup("gpt", mesh_of(1), seed=0)
    step(run, 0)
    save_checkpoint(
        f"{root}/ck", run.model, run.opt, mesh=run.mesh, plan_text=run.plan_text, extra={"step": 1}
    )
    torch.save(full_state(run), f"{root}/state-1.pt")
    step(run, 1)
    import dtp.checkpoint.dcp
    import dtp.checkpoint.files

    def die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    # DCP has written every file; dtp.json and COMPLETE are not there
    if where == "before the marker":
        dtp.checkpoint.dcp.finalize = die
    else:  # the old checkpoint moved aside, the new one not yet renamed into place
        real = os.rename

        # DCP renames its own files too: die at the rename of the new checkpoint only
        def rename(a, b):
            return die() if os.path.basename(a).startswith("ck.tmp-") else real(a, b)

        dtp.checkpoint.files.os.rename = rename
    save_checkpoint(
        f"{root}/ck", run.model, run.opt, mesh=run.mesh, plan_text=run.plan_text, extra={"step": 2}
    )


@pytest.mark.parametrize("where", ["before the marker", "between the renames"])
def test_a_save_killed_midway_never_leaves_a_checkpoint_that_loads_as_complete(tmp_path, where):
    from dtp.checkpoint.export import read_model

    with pytest.raises(Exception):
        on_ranks(_save_then_die, 1, str(tmp_path), where, timeout=120)
    left = sorted(p.name for p in tmp_path.iterdir())
    tmp = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(tmp) == 1
    if where == "before the marker":
        with pytest.raises(
            CheckpointError, match="is not a complete dtp checkpoint: it has no COMPLETE marker"
        ):
            read_model(tmp[0])
        assert left == ["ck", "ck.lock", tmp[0].name, "state-1.pt"]  # the lock of a dead pid: stale
        previous = tmp_path / "ck"
    else:
        with pytest.raises(
            CheckpointError, match=r"no checkpoint at .*/ck; an interrupted save left ck\.old-"
        ):
            read_model(tmp_path / "ck")
        previous = next(p for p in tmp_path.iterdir() if ".old-" in p.name)
    _, state = read_model(previous)  # the checkpoint of step 1, complete and intact
    before = torch.load(tmp_path / "state-1.pt")
    params = [k for k in before if "/" not in k]
    assert params and all(torch.equal(state[k], before[k]) for k in params)


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_the_unsharded_state_dict(at_tp4, name, tmp_path):
    from ckpt_ranks import _factory
    from safetensors.torch import load_file

    from dtp import cli

    root, saved = at_tp4
    params = {k: v for k, v in saved[name]["saved"].items() if "/" not in k}
    assert cli.main(["export", str(root / name), "-o", str(tmp_path / "m.pt")]) == 0
    assert (
        cli.main(
            ["export", str(root / name), "--format", "safetensors", "-o", str(tmp_path / "m.st")]
        )
        == 0
    )
    for state in (torch.load(tmp_path / "m.pt"), load_file(tmp_path / "m.st")):
        model = _factory(name)
        model.load_state_dict(state, strict=True)  # every name the model has, tied ones included
        assert all(torch.equal(state[k], v) for k, v in params.items())
        if name == "gpt":
            assert torch.equal(state["lm_head.weight"], params["transformer.wte.weight"])


def test_export_hf_dir_loads_with_from_pretrained_and_gives_the_same_logits(
    at_tp4, at_tp2, tmp_path
):
    from transformers import LlamaForCausalLM

    from dtp import cli

    root, _ = at_tp4
    assert cli.main(["export", str(root / "hf"), "--hf-dir", str(tmp_path / "hf")]) == 0
    model = LlamaForCausalLM.from_pretrained(tmp_path / "hf")
    state = model.state_dict()
    params = {k: v for k, v in at_tp2["hf"]["state"].items() if "/" not in k}
    assert all(torch.equal(state[k], v) for k, v in params.items())
    with torch.no_grad():
        logits = model(batch(99, model.config.vocab_size)[:, :-1]).logits
    expected = at_tp2["hf"]["logits"]  # the sharded model's at tp 2
    assert (logits - expected).abs().max() <= 1e-6 + RTOL * expected.abs().max()


def _damage(path, how: str) -> None:
    if how == "truncated":
        data = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
        os.truncate(data, data.stat().st_size // 2)
    elif how == "no marker":
        (path / "COMPLETE").unlink()
    elif how == "no metadata":
        (path / ".metadata").unlink()
    elif how == "edited metadata":
        (path / "dtp.json").write_text(
            (path / "dtp.json").read_text().replace('"tp": 4', '"tp": 2')
        )
    elif how == "flipped":
        _flip(path, "model/transformer.wte.weight")


@pytest.mark.parametrize(
    "how, message",
    [
        ("missing", "error: no checkpoint at {ck}\n"),
        ("truncated", "error: checkpoint {ck} is corrupt: __"),
        (
            "no marker",
            "error: {ck} is not a complete dtp checkpoint: it has no COMPLETE marker (the save that "
            "wrote it "
            "did not finish, or it is not a dtp checkpoint)\n",
        ),
        ("no metadata", "error: checkpoint {ck} is incomplete: .metadata is missing\n"),
        (
            "edited metadata",
            "error: checkpoint {ck} is corrupt: dtp.json does not match its recorded hash\n",
        ),
        (
            "flipped",
            "error: checkpoint {ck}: model/transformer.wte.weight do not match the fingerprints "
            "recorded at save "
            "(corrupt data or a layout dtp did not write)\n",
        ),
    ],
)
def test_damaged_checkpoints_are_clean_errors(at_tp4, tmp_path, capsys, how, message):
    from dtp import cli

    root, _ = at_tp4
    ck = tmp_path / "ck"
    if how != "missing":
        shutil.copytree(root / "gpt", ck)
        _damage(ck, how)
    assert cli.main(["export", str(ck), "-o", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message.format(ck=ck)) and "Traceback" not in err
    assert not (tmp_path / "out.pt").exists()


def test_hf_dir_needs_a_hugging_face_model(at_tp4, tmp_path, capsys, monkeypatch):
    from dtp import cli
    from dtp.checkpoint import export

    root, _ = at_tp4
    # the zoo GPT: GPT-2
    assert cli.main(["export", str(root / "gpt"), "--hf-dir", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "GPT2LMHeadModel"
    ]
    # a model that is neither (a factory's own class): no config was saved
    read = export.read_model
    monkeypatch.setattr(
        export,
        "read_model",
        lambda d: ({**read(d)[0], "hf_config": None, "model_class": "TinyLM"}, read(d)[1]),
    )
    capsys.readouterr()
    assert cli.main(["export", str(root / "gpt"), "--hf-dir", str(tmp_path / "hf2")]) == 2
    assert capsys.readouterr().err == (
        f"error: {root / 'gpt'} holds a TinyLM model, not a Hugging Face one (no "
        "config was saved); --hf-dir needs one — use -o for a plain state dict\n"
    )
    assert not (tmp_path / "hf2").exists()
