"""The checkpoint lock's file handling: a checkpoint's name is a name, never a glob pattern, and the
lock file is read as every small file is (regular, capped, never blocking)."""

from __future__ import annotations

import json
import os
import time

from dtp.checkpoint.lock import _owner, lock_path, remove_partial


def test_a_name_with_pattern_characters_cleans_up_only_its_own_saves(tmp_path):
    ours, other = tmp_path / "ck[ab]", tmp_path / "cka"
    (tmp_path / "ck[ab].tmp-1").mkdir()  # ours: an interrupted save
    (tmp_path / "cka.tmp-2").mkdir()  # another checkpoint's save in progress
    (tmp_path / "cka.old-3").mkdir()  # another checkpoint's previous copy
    other.mkdir()
    remove_partial(ours)
    assert not (tmp_path / "ck[ab].tmp-1").exists()
    assert (tmp_path / "cka.tmp-2").is_dir() and (tmp_path / "cka.old-3").is_dir()
    assert not ours.exists()  # another checkpoint's previous copy was not put back as ours


def test_a_lock_that_is_not_a_small_regular_file_is_no_owner(tmp_path):
    ck = tmp_path / "ck"
    lock = lock_path(ck)
    lock.write_text(json.dumps({"pid": 1, "host": "h"}))
    assert _owner(lock) == {"pid": 1, "host": "h"}
    lock.unlink()
    os.symlink("/dev/zero", lock)  # read unbounded, this grows to gigabytes in seconds
    start = time.monotonic()
    assert _owner(lock) is None
    lock.unlink()
    os.mkfifo(lock)  # opened blocking, this waits for a writer forever
    assert _owner(lock) is None
    lock.unlink()
    lock.write_text(json.dumps({"pid": 1, "host": "h", "pad": "x" * 2000}))  # over 1 KiB
    assert _owner(lock) is None
    assert time.monotonic() - start < 5
