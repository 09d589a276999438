"""Hostile checkpoints are data: payloads that would `touch` a marker if loading ran code, malformed
metadata, odd paths and two runs saving into one checkpoint all end in one paragraph (exit 2, or 1
from the ranks), with no traceback and nothing run."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ckpt_ranks import TINY_TRAIN
from conftest import dtp_cli
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from dtp.checkpoint.files import DCP_META, META, CheckpointError, seal
from dtp.checkpoint.lock import held, lock_path
from dtp.checkpoint.untrusted import MetadataUnpickler
from dtp.cli import main


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A real `dtp train` checkpoint of gpt2-tiny after one step (each test tampers with its own
    copy)."""
    root = tmp_path_factory.mktemp("hostile")
    result = dtp_cli(
        "train",
        *TINY_TRAIN,
        "--steps",
        "1",
        "--checkpoint",
        str(root / "ck"),
        "--out",
        str(root / "out"),
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return root / "ck"


@pytest.fixture
def ck(saved, tmp_path) -> Path:
    copy = tmp_path / "ck"
    shutil.copytree(saved, copy)
    return copy


def _one_paragraph(err: str) -> None:
    assert err.startswith("error: ") and "Traceback" not in err
    assert "\n\n" not in err.strip() and len(err.strip().splitlines()) <= 3, err


def _refused(argv: list[str], capsys, code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    _one_paragraph(err)
    return err


class _Touch:
    """Unpickling an instance runs `touch MARKER` through `how` (the payloads an attacker would
    write)."""

    def __init__(self, how: str, marker: Path):
        self.how, self.marker = how, str(marker)

    def __reduce__(self):
        if self.how == "subprocess":
            return subprocess.call, (["touch", self.marker],)
        if self.how == "exec":
            return exec, (f"open({self.marker!r}, 'w').close()",)
        return os.system, (f"touch {self.marker}",)


def _dotted(module: str, name: str, marker: Path) -> bytes:
    """A pickle calling module.name('touch MARKER'): from protocol 4 on, pickle resolves a dotted
    name."""
    return b"\x80\x04" + f"c{module}\n{name}\n(S'touch {marker}'\ntR.".encode()


def _payloads(marker: Path) -> dict[str, bytes]:
    return {
        "os.system via metadata module": _dotted(
            "torch.distributed.checkpoint.metadata", "os.system", marker
        ),
        "torch.os.system": _dotted("torch", "os.system", marker),
        "posix.system": _dotted("posix", "system", marker),
        "subprocess.call": pickle.dumps(_Touch("subprocess", marker), protocol=2),
        "builtins.exec": pickle.dumps(_Touch("exec", marker)),
        "os.system reduce": pickle.dumps(_Touch("system", marker)),
        "torch.load": _dotted("torch", "load", marker),
    }


def test_the_payloads_do_run_code_under_a_plain_unpickler(tmp_path):
    marker = tmp_path / "MARKER"
    pickle.loads(_payloads(marker)["torch.os.system"])  # what torch's own FileSystemReader would do
    assert marker.exists()


@pytest.mark.parametrize("payload", list(_payloads(Path("m"))))
def test_a_metadata_payload_is_refused_and_never_runs(ck, tmp_path, capsys, payload):
    marker = tmp_path / "MARKER"
    (ck / DCP_META).write_bytes(_payloads(marker)[payload])
    seal(ck)  # the hashes in COMPLETE are recomputed, as an attacker would
    err = _refused(["export", str(ck), "-o", str(tmp_path / "out.pt")], capsys)
    assert "refusing" in err and not marker.exists()
    assert not (tmp_path / "out.pt").exists()


def _bytes_entry(ck: Path, marker: Path) -> None:
    """Declare extra/rank0 as a BytesStorageMetadata entry whose bytes are a torch.save'd payload."""
    with (ck / DCP_META).open("rb") as f:
        md = MetadataUnpickler(f).load()
    buf = io.BytesIO()
    torch.save(_Touch("system", marker), buf)
    (ck / "__9_0.distcp").write_bytes(buf.getvalue())
    md.state_dict_metadata["extra/rank0"] = BytesStorageMetadata()
    index = next(i for i in md.storage_data if i.fqn == "extra/rank0")
    info = md.storage_data.pop(index)
    info.relative_path, info.offset, info.length = "__9_0.distcp", 0, len(buf.getvalue())
    md.storage_data[MetadataIndex("extra/rank0")] = info
    md.storage_meta = None
    (ck / DCP_META).write_bytes(pickle.dumps(md))
    seal(ck)


def test_a_bytes_entry_is_refused_before_dcp_reads_it(ck, tmp_path, capsys):
    marker = tmp_path / "MARKER"
    _bytes_entry(ck, marker)
    err = _refused(["export", str(ck), "-o", str(tmp_path / "out.pt")], capsys)
    assert "BytesStorageMetadata" in err and not marker.exists()


def test_train_resume_refuses_payloads_before_any_rank(ck, tmp_path):
    marker = tmp_path / "MARKER"
    _bytes_entry(ck, marker)
    result = dtp_cli(
        "train", *TINY_TRAIN, "--steps", "2", "--resume", str(ck), "--out", str(tmp_path / "out")
    )
    assert result.returncode == 2 and not marker.exists()
    _one_paragraph(result.stderr)
    (ck / DCP_META).write_bytes(_payloads(marker)["torch.os.system"])
    seal(ck)
    result = dtp_cli("export", str(ck), "-o", str(tmp_path / "out.pt"))
    assert result.returncode == 2 and not marker.exists()
    _one_paragraph(result.stderr)


def test_build_cannot_rewrite_an_allowed_class():
    with pytest.raises(CheckpointError, match="sets attributes"):
        MetadataUnpickler(io.BytesIO(b"cpathlib\nPosixPath\n(N}(S'x'\nI1\nutb.")).load()
    assert not hasattr(Path("."), "x")


def _edit_metadata(ck: Path, edit) -> None:
    with (ck / DCP_META).open("rb") as f:
        md = MetadataUnpickler(f).load()
    edit(md)
    (ck / DCP_META).write_bytes(pickle.dumps(md))
    seal(ck)


def _outside(md) -> None:
    next(iter(md.storage_data.values())).relative_path = "../../../../etc/passwd"


def _shape(md) -> None:
    md.state_dict_metadata["model/transformer.wte.weight"].size = torch.Size([1 << 40, 64])


def _dtype(md) -> None:
    md.state_dict_metadata["model/transformer.wte.weight"].properties.dtype = torch.float64


@pytest.mark.parametrize("edit", [_outside, _shape, _dtype], ids=["path outside", "shape", "dtype"])
def test_metadata_that_disagrees_with_dtp_json_is_refused(ck, tmp_path, capsys, edit):
    _edit_metadata(ck, edit)
    _refused(["export", str(ck), "-o", str(tmp_path / "out.pt")], capsys)


def _deep(meta: dict) -> str:
    return "[" * 100_000 + "]" * 100_000


def _bad_shape(meta: dict) -> str:
    meta["tensors"]["model/transformer.wte.weight"]["shape"] = "abc"
    return json.dumps(meta)


def _huge(meta: dict) -> str:
    meta["tensors"]["model/transformer.wte.weight"]["shape"] = [1 << 40, 1 << 20]
    return json.dumps(meta)


def _bad_key(meta: dict) -> str:
    meta["tensors"]["optim/x"] = meta["tensors"]["model/transformer.wte.weight"]
    return json.dumps(meta)


@pytest.mark.parametrize(
    "edit", [_deep, _bad_shape, _huge, _bad_key], ids=["deep", "shape", "huge", "key"]
)
def test_a_malformed_dtp_json_is_one_paragraph(ck, tmp_path, capsys, edit):
    (ck / META).write_text(edit(json.loads((ck / META).read_text())))
    seal(ck)
    _refused(["export", str(ck), "-o", str(tmp_path / "out.pt")], capsys)


def test_odd_checkpoint_paths_are_one_paragraph(ck, tmp_path, capsys):
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    assert "symlink loop" in _refused(["export", str(tmp_path / "a")], capsys)
    os.mkfifo(tmp_path / "fifo")
    _refused(["export", str(tmp_path / "fifo")], capsys)
    (ck / META).unlink()
    os.mkfifo(ck / META)  # a FIFO where dtp.json should be: refused, not read (which would hang)
    _refused(["export", str(ck)], capsys)


def test_a_live_lock_refuses_a_second_save_and_its_work_survives(ck, tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        import socket

        lock_path(ck).write_text(json.dumps({"pid": other.pid, "host": socket.gethostname()}))
        theirs = ck.parent / "ck.tmp-theirs"
        theirs.mkdir()
        result = dtp_cli(
            "train",
            *TINY_TRAIN,
            "--steps",
            "1",
            "--checkpoint",
            str(ck),
            "--out",
            str(tmp_path / "out"),
        )
        assert result.returncode in (1, 2) and f"pid {other.pid}" in result.stderr
        assert "Traceback" not in result.stderr
        assert theirs.is_dir() and lock_path(ck).exists()
    finally:
        other.kill()
        other.wait()


def test_held_refuses_a_second_holder_and_cleans_up_after_a_kill(ck):
    with held(ck):
        (ck.parent / "ck.tmp-dead").mkdir()  # what a save killed with its ranks leaves
        data = json.loads(lock_path(ck).read_text())
        assert data["pid"] == os.getpid()
        with pytest.raises(KeyboardInterrupt), held(ck):  # this process again: not a second run
            raise KeyboardInterrupt
        assert (ck.parent / "ck.tmp-dead").exists() and lock_path(ck).exists()
    assert not (ck.parent / "ck.tmp-dead").exists() and not lock_path(ck).exists()
    # a stale lock (its process is gone) is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock_path(ck).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
    t0 = time.monotonic()
    with held(ck):
        assert json.loads(lock_path(ck).read_text())["pid"] == os.getpid()
    assert time.monotonic() - t0 < 5 and not lock_path(ck).exists()
