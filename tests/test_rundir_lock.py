"""The run directory's lock between the ranks of an external launcher (``disteval.job.rundir``): rank 0's claim and
the other ranks' check start at the same moment, so a check may find the lock taken before its holder wrote its
record, and a check's probe holds the lock for an instant while rank 0 claims. Neither is a busy directory; a
lock that stays held by another run is (after ``GRACE_S``)."""
from __future__ import annotations

import fcntl
import json
import os
import threading
import time

import pytest

from disteval.job import rundir


def _hold(path, record: dict | None):
    """Take RUN_DIR's flock through a descriptor of our own (as another process would), writing ``record``."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / rundir.LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    if record is not None:
        os.write(fd, json.dumps(record).encode())
    return fd


def test_a_check_waits_for_the_holders_record(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    fd = _hold(tmp_path / "run", None)  # rank 0 has the lock and has not written its record yet
    later = threading.Timer(0.3, lambda: os.write(fd, json.dumps({"pid": 1, "run_id": "job-1"}).encode()))
    later.start()
    try:
        rundir._check_shared(str(tmp_path / "run"), overwrite=False)  # the same job's lock: no refusal
    finally:
        later.join()
        os.close(fd)


def test_another_runs_lock_is_refused_after_the_grace(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")
    fd = _hold(tmp_path / "run", {"pid": 1, "run_id": "job-1", "released": False})
    t0 = time.monotonic()
    try:
        with pytest.raises(rundir.RunDirBusy):
            rundir._check_shared(str(tmp_path / "run"), overwrite=False)
        assert time.monotonic() - t0 >= rundir.GRACE_S
    finally:
        os.close(fd)


def test_a_claim_waits_out_a_probe(tmp_path):
    fd = _hold(tmp_path / "run", None)  # another rank's probe, released 0.3 s later
    threading.Timer(0.3, os.close, (fd,)).start()
    try:
        assert rundir.lock_run_dir(tmp_path / "run") is None
        assert rundir.is_locked(tmp_path / "run") is None  # held by this process
    finally:
        rundir.release_run_dir(tmp_path / "run")
