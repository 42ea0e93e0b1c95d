"""The local launcher's fork server (``launchers.local.fork_server``): the ranks of a launch are forks of one
server, which a later launch of the same process reuses while the entry module and the environment are the
same, and which is replaced (the old one ending) when the environment changed, so ranks always see the
environment of the launch that started them; the job's start time (DISTEVAL_T0), new for every job, and its fault
drills (DISTEVAL_FAULTS) are handed to each launch's ranks without a new server."""
from __future__ import annotations

import os

from dist_workers import parent_and_faults, parent_and_mark

from disteval.job.records import pid_alive
from launchers.local import launch


def _parents(run_dir, t0: str = "1.5") -> tuple[set[int], set[str | None]]:
    os.environ["DISTEVAL_T0"] = t0  # what the driver sets for each job (disteval.common.startup.job_start)
    got = launch(parent_and_mark, (), 2, str(run_dir))
    assert sorted(got) == [0, 1] and {seen for _, _, seen in got.values()} == {t0}
    return {parent for parent, _, _ in got.values()}, {mark for _, mark, _ in got.values()}


def test_one_server_per_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("DISTEVAL_TEST_MARK", raising=False)
    monkeypatch.setenv("DISTEVAL_T0", "0")
    first, marks = _parents(tmp_path / "a", t0="1.5")
    assert len(first) == 1 and first != {os.getpid()} and marks == {None}  # both ranks: forks of one server
    again, _ = _parents(tmp_path / "b", t0="2.5")  # the next job: its own start time, handed to its ranks
    assert again == first  # the same environment: the same server, torch not imported again
    monkeypatch.setenv("DISTEVAL_TEST_MARK", "changed")
    changed, marks = _parents(tmp_path / "c")
    assert changed != first and len(changed) == 1 and marks == {"changed"}  # a new server with the new variable
    assert not pid_alive(first.pop())  # the old server was stopped, not left behind
    monkeypatch.delenv("DISTEVAL_TEST_MARK")
    back, marks = _parents(tmp_path / "d")
    assert back != changed and marks == {None}


def test_fault_drills_are_handed_to_each_launch(tmp_path, monkeypatch):
    """DISTEVAL_FAULTS set for one launch and unset for the next: one server serves both, and the second launch's
    ranks do not see the first one's drills."""
    monkeypatch.setenv("DISTEVAL_T0", "1.0")
    drill = "delay@5:batch=99,seconds=1"  # names no rank of these launches
    monkeypatch.setenv("DISTEVAL_FAULTS", drill)
    first = launch(parent_and_faults, (), 2, str(tmp_path / "a"))
    monkeypatch.delenv("DISTEVAL_FAULTS")
    second = launch(parent_and_faults, (), 2, str(tmp_path / "b"))
    assert sorted(first) == sorted(second) == [0, 1]
    assert {seen for _, seen in first.values()} == {drill} and {seen for _, seen in second.values()} == {None}
    assert len({parent for parent, _ in first.values()} | {parent for parent, _ in second.values()}) == 1
