"""The test suite's in-process runs (``tests/inline_run.py``) are the command: the same results, exit codes and
messages as ``python -m disteval`` in a process of its own, what the ranks write included, and nothing of the run
left behind in the test's process."""
from __future__ import annotations

import json
import logging
import os
import signal

import pytest
import torch

from conftest import run_disteval
from dist_workers import say
from inline_run import _fds_captured, inline_ok
from launchers.local import launch

QUICK = ("dist.world_size=1", "data.limit=96", "data.batch_size=32", "eval.progress=false")


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)  # elastic's agent sets these four


@pytest.mark.parametrize("world_size", [1, 2])
def test_inline_and_process_runs_agree(tmp_path, world_size):
    quick = (f"dist.world_size={world_size}", *QUICK[1:])
    def state():
        return (torch.get_num_threads(), list(logging.getLogger().handlers), dict(os.environ),
                [signal.getsignal(s) for s in SIGNALS])

    before = state()
    inline = run_disteval(*quick, run_dir=tmp_path / "inline")
    assert state() == before
    process = run_disteval(*quick, run_dir=tmp_path / "process", inline=False)
    assert (inline.returncode, process.returncode) == (0, 0), inline.stderr + process.stderr
    results = [json.loads((tmp_path / name / "results.json").read_text()) for name in ("inline", "process")]
    assert results[0]["metrics"] == results[1]["metrics"] and results[0]["config_digest"] == results[1]["config_digest"]
    bad = [run_disteval(*quick, "eval.trials=0", run_dir=tmp_path / f"bad{i}", inline=i == 0) for i in range(2)]
    assert [b.returncode for b in bad] == [2, 2]
    said = [[line for line in b.stderr.splitlines() if "eval.trials" in line] for b in bad]
    assert said[0] and said[0] == said[1]  # the same message naming the key


def test_what_ranks_write_is_caught_run_by_run(tmp_path):
    """Ranks are forks of a fork server that outlives a run and keeps the fds 1 and 2 it was started with: what
    the ranks of each run write to them is that run's output, not an earlier or later one's."""
    for run in range(2):
        with _fds_captured() as (written, _):
            launch(say, (f"run {run}",), 2, str(tmp_path / f"run{run}"))
        for fd, stream in ((1, "stdout"), (2, "stderr")):
            assert sorted(written[fd].splitlines()) == [f"run {run}: rank {r} to {stream}" for r in range(2)]


def test_what_runs_inline():
    assert inline_ok(("dist.world_size=1",), None, None)
    assert inline_ok(("dist.world_size=2",), None, None) and inline_ok((), None, None)
    assert not inline_ok(("dist.world_size=1",), {"DISTEVAL_FAULTS": "kill@0:batch=1"}, None)  # a drill kills its process
    assert not inline_ok(("dist.world_size=1", "dist.allocator=jemalloc"), None, None)  # a process of its own
    assert not inline_ok(("-m", "dist.world_size=1"), None, None)
    assert not inline_ok(("dist.world_size=1", "hydra/launcher=submitit_slurm"), None, None)
