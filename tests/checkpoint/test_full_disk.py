"""A full disk during a save or an export: one line saying what failed, about how many bytes it
needed and how many were free where; the previous checkpoint (or export) as it was and still
loading; no DIR.tmp-*, staging directory or lock left behind; a SIGTERM mid-read is a stop, not a
corrupt checkpoint.

Injected: ENOSPC at DCP's lowest write on one rank of two. Real: small tmpfs mounts in a private
mount namespace (`unshare -rm`; this machine runs as root), where `dtp train` runs out of room at
its second save and `dtp export` at its second export.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from ckpt_ranks import REPO, TINY_TRAIN, full_state, mesh_of, setup, step
from conftest import dtp_cli
from torch.distributed.checkpoint.filesystem import FileSystem

from dtp.checkpoint import files
from dtp.checkpoint.dcp import load_checkpoint, save_checkpoint
from dtp.checkpoint.export import export
from dtp.checkpoint.files import NoSpaceError, no_space
from dtp.checkpoint.untrusted import SafeReader
from dtp.errors import Terminated
from dtp.runtime.ranks import on_ranks
from dtp.train.resume import saved_state

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
ROOM = 64 << 10  # what the injected disk has left: a data file fails part-way
# gpt2-tiny's checkpoint is 1.6 MiB: one fits on a 2 MiB tmpfs, two do not; its Hugging Face export
# is 0.5 MiB: one fits on 800 KiB, two do not
DISK, SMALL = "2m", "800k"
TRAIN = [*TINY_TRAIN, "--steps", "4"]
SPACE = r"needs about [\d.]+ [KMG]iB, [\d.]+ (B|[KMGT]iB) free on "


class _FullDisk(io.FileIO):
    """A file on a disk with ROOM bytes left: a write past them writes what fits, then fails with
    ENOSPC, as the kernel does."""

    room = ROOM

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if data.nbytes and not self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self.name)
        n = super().write(data[: self.room])
        self.room -= n
        return n


@contextlib.contextmanager
def _full_stream(fs, path, mode):
    """FileSystem.create_stream onto a full disk: the stream DCP writes every file through."""
    with io.BufferedWriter(_FullDisk(str(path), "wb")) as stream:
        yield stream


def _told(write) -> str:
    """The message of the NoSpaceError `write()` raises ("no error" when it raises none)."""
    try:
        write()
    except NoSpaceError as err:
        return str(err)
    return "no error"


def _save_then_fill(rank, world, root):
    """Save after one step, then fail three saves after the next: ENOSPC in rank 1's data file only,
    in dtp.json (rank 0, after every rank's data), and before writing (too little free space); load
    what is left."""
    run = setup("gpt", mesh_of(world), seed=0)
    step(run, 0)

    def save(at: int):
        return lambda: save_checkpoint(
            f"{root}/ck",
            run.model,
            run.opt,
            mesh=run.mesh,
            plan_text=run.plan_text,
            extra={"at": at},
        )

    save(1)()
    saved = full_state(run)
    step(run, 1)
    out: dict = {}
    full = mock.patch.object(FileSystem, "create_stream", _full_stream)
    with full if rank == 1 else contextlib.nullcontext():
        out["data"] = _told(save(2))
    with mock.patch.object(files, "_write_synced", side_effect=ENOSPC):
        out["meta"] = _told(save(2))
    opened = mock.Mock(wraps=FileSystem.create_stream)
    with (
        mock.patch.object(files, "free_space", return_value=(1000, "/full")),
        mock.patch.object(FileSystem, "create_stream", opened),
    ):
        out["before"] = _told(save(2))
    out["written"] = opened.call_count
    fresh = setup("gpt", mesh_of(world), seed=1)
    extra = load_checkpoint(
        f"{root}/ck", fresh.model, fresh.opt, mesh=fresh.mesh, plan_text=fresh.plan_text
    )
    loaded = full_state(fresh)
    out["extra"] = extra
    out["same"] = sorted(loaded) == sorted(saved) and all(
        (loaded[k] == saved[k]).all().item() for k in saved
    )
    return out


def test_a_full_disk_on_one_rank_fails_every_rank_alike_and_keeps_the_checkpoint(tmp_path):
    ranks = on_ranks(_save_then_fill, 2, str(tmp_path), timeout=240)
    ck = re.escape(str(tmp_path / "ck"))
    failed = rf"saving checkpoint {ck} failed: no space left on device \("
    for key in ("data", "meta"):
        assert ranks[0][key] == ranks[1][key]  # every rank raised the same error: none hangs
        assert re.fullmatch(rf"{failed}{SPACE}/\S*\); {ck} is as it was", ranks[0][key])
    assert ranks[0]["before"] == ranks[1]["before"]
    before = rf"{failed}needs about 1\.\d MiB, 1000 B free on /full\); {ck} is as it was"
    assert re.fullmatch(before, ranks[0]["before"])
    assert ranks[0]["written"] == ranks[1]["written"] == 0  # refused before any file was opened
    for r in ranks:  # the step-1 checkpoint loads with the tensors it was saved with
        assert r["same"] and r["extra"]["at"] == 1
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no ck.tmp-*, no ck.lock


def test_a_full_disk_is_told_from_each_way_it_is_reported():
    assert no_space(ENOSPC) == "no space left on device"
    assert no_space(OSError(errno.EDQUOT, "quota")) == "disk quota exceeded"
    try:  # torch.save: a RuntimeError ("unexpected pos") whose context is the OSError
        try:
            raise ENOSPC
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
    except RuntimeError as err:
        assert no_space(err) == "no space left on device"
    # safetensors keeps only the text
    assert no_space(Exception("I/O error: No space left on device (os error 28)"))
    assert no_space(OSError(errno.EACCES, "Permission denied")) is None
    assert no_space(RuntimeError("unexpected pos 704 vs 598")) is None


def _hashes(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file()
    }


def _run(*args) -> dict:
    result = dtp_cli(*map(str, args), timeout=120)
    return {"rc": result.returncode, "out": result.stdout, "err": result.stderr}


def _save_into_full(rank, world, disk):
    """A save that finds the disk full while writing (the check before writing is bypassed)."""
    run = setup("gpt", mesh_of(world), seed=0)
    with mock.patch("dtp.checkpoint.lock.check_room"):
        return _told(
            lambda: save_checkpoint(
                f"{disk}/ck", run.model, run.opt, mesh=run.mesh, plan_text=run.plan_text, extra={}
            )
        )


def _mount(where: Path, size: str) -> None:
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", where], check=True)


def _train_session(root: Path) -> dict:
    """`dtp train` whose second save does not fit, then a resume from what it left."""
    disk = root / "disk"
    _mount(disk, DISK)
    ck = disk / "ck"
    first = _run("train", *TRAIN, "--save-every", "2", "--checkpoint", ck, "--out", root / "first")
    left = sorted(os.listdir(disk))
    shutil.copytree(ck, root / "ck")  # for the tests outside the namespace
    resumed = _run("train", *TRAIN, "--resume", ck, "--out", root / "resumed")
    return {"first": first, "left": left, "resumed": resumed}


def _fill_session(root: Path) -> dict:
    """A DCP write and exports that find the disk full (`ck`: the train session's checkpoint)."""
    disk, small = root / "full", root / "small"  # "disk", the train session's, is its mount point
    _mount(disk, DISK)
    _mount(small, SMALL)
    ck, hf = disk / "ck", small / "hf"
    shutil.copytree(root / "ck", ck)
    report: dict = {"dcp": on_ranks(_save_into_full, 1, str(disk), timeout=120)[0]}
    report["dcp_left"] = sorted(os.listdir(disk))
    report["dcp_unchanged"] = _hashes(ck) == _hashes(root / "ck")
    export(str(ck), None, None, str(hf))  # fits
    exported = _hashes(hf)
    report["export"] = _run("export", ck, "--hf-dir", hf)  # does not
    report["export_unchanged"] = _hashes(hf) == exported
    report["export_left"] = sorted(os.listdir(small))
    writes = {
        "hf_write": lambda: export(str(ck), None, None, str(hf)),  # safetensors
        "o_write": lambda: export(str(ck), "torch", str(small / "x.pt"), None),
    }
    with mock.patch("dtp.checkpoint.export.check_room"):  # the write itself finds the disk full
        report.update({key: _told(write) for key, write in writes.items()})
    report["write_unchanged"] = _hashes(hf) == exported
    report["write_left"] = sorted(os.listdir(small))
    return report


SESSIONS = {"train": _train_session, "fill": _fill_session}


def in_namespace(root: str, session: str) -> None:
    """Run in a private mount namespace (`unshare -rm`): a session that mounts small tmpfs under
    ROOT and fills them; what happened goes to ROOT/SESSION.json."""
    report = SESSIONS[session](Path(root))
    Path(root, f"{session}.json").write_text(json.dumps(report))


def _unshared(root: Path, session: str) -> dict:
    """What `in_namespace(root, session)` found, run under `unshare -rm`: a failure to get there
    fails the test, with the reason."""
    if shutil.which("unshare") is None:
        pytest.fail("these tests mount a tmpfs with `unshare -rm` (util-linux), which is missing")
    code = (
        f"import sys; sys.path[:0] = [{str(REPO / 'tests')!r}, {str(Path(__file__).parent)!r}]; "
        f"import test_full_disk; test_full_disk.in_namespace({str(root)!r}, {session!r})"
    )
    result = subprocess.run(
        ["unshare", "-rm", sys.executable, "-c", code],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    if result.returncode != 0 or not (root / f"{session}.json").is_file():
        pytest.fail(
            "the full-disk session did not run in a private mount namespace (`unshare -rm`, then "
            f"mount -t tmpfs): exit {result.returncode}\n{result.stderr[-3000:]}"
        )
    return json.loads((root / f"{session}.json").read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The train session's directory (`ck`: the checkpoint it left, copied out) and report."""
    root = tmp_path_factory.mktemp("full")
    return root, _unshared(root, "train")


@pytest.fixture(scope="module")
def filled(trained):
    """The fill session's report, in the train session's directory."""
    root, _ = trained
    return root, _unshared(root, "fill")


def _losses(out: Path) -> dict[int, float]:
    rows = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {m["step"]: m["loss"] for m in rows}


def test_train_out_of_room_at_a_save_stops_in_one_line_and_resumes(trained):
    root, report = trained
    first, resumed = report["first"], report["resumed"]
    ck = re.escape(str(root / "disk" / "ck"))
    assert first["rc"] == 1, first["err"][-2000:]
    assert re.fullmatch(
        rf"error: the run failed on rank 0 in the checkpoint save: saving step 4 to "
        rf"{ck} failed: no space left on device \({SPACE}{re.escape(str(root / 'disk'))}\); the "
        rf"checkpoint of step 2 in {ck} is unchanged and resumes \(the metrics so far are in "
        r"\S+/metrics.jsonl\)",
        first["err"].strip(),
    ), first["err"]
    assert report["left"] == ["ck"]  # no ck.tmp-*, no ck.lock
    assert resumed["rc"] == 0, resumed["err"][-2000:]
    assert f"resumed from {root / 'disk' / 'ck'} at step 2" in resumed["out"]
    first_losses, again = _losses(root / "first"), _losses(root / "resumed")
    assert list(first_losses) == [1, 2, 3]  # step 4's row: its save failed
    assert list(again) == [3, 4] and again[3] == first_losses[3]  # continued from step 2's save


def test_a_real_enospc_while_dcp_writes_keeps_the_checkpoint(filled):
    root, report = filled
    ck, disk = root / "full" / "ck", re.escape(str(root / "full"))
    assert re.fullmatch(
        rf"saving checkpoint {re.escape(str(ck))} failed: no space left on device \({SPACE}{disk}\);"
        rf" {re.escape(str(ck))} is as it was",
        report["dcp"],
    ), report["dcp"]
    assert report["dcp_left"] == ["ck"] and report["dcp_unchanged"]


def test_export_out_of_room_is_one_line_and_leaves_the_directory(filled):
    root, report = filled
    small, hf = root / "small", root / "small" / "hf"
    second = report["export"]
    assert second["rc"] == 2
    told = rf"failed: no space left on device \({SPACE}{re.escape(str(small))}\); "
    assert re.fullmatch(
        rf"error: writing --hf-dir {re.escape(str(hf))} {told}{re.escape(str(hf))} is as it was",
        second["err"].strip(),
    ), second["err"]
    assert report["export_unchanged"] and report["export_left"] == ["hf"]
    # the write itself out of room: safetensors' error and torch.save's
    assert re.fullmatch(
        rf"writing --hf-dir {re.escape(str(hf))} {told}{re.escape(str(hf))} is as it was",
        report["hf_write"],
    ), report["hf_write"]
    x = re.escape(str(small / "x.pt"))
    assert re.fullmatch(rf"writing {x} {told}{x} is as it was", report["o_write"])
    assert report["write_unchanged"] and report["write_left"] == ["hf"]


def test_a_sigterm_while_reading_a_checkpoint_is_a_stop_not_corruption(trained, tmp_path):
    root, _ = trained
    with mock.patch.object(SafeReader, "read_data", side_effect=Terminated()):
        with pytest.raises(Terminated):
            export(str(root / "ck"), None, str(tmp_path / "x.pt"), None)
        with pytest.raises(Terminated):
            saved_state(root / "ck")
    assert not list(tmp_path.iterdir())
