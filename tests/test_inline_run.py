"""The test suite's in-process world-size-1 runs (``tests/inline_run.py``) are the command: the same results,
exit codes and messages as ``python -m disteval`` in a process of its own, and nothing of the run left behind in
the test's process."""
from __future__ import annotations

import json
import logging
import os

import torch

from conftest import run_disteval
from inline_run import inline_ok

QUICK = ("dist.world_size=1", "data.limit=96", "data.batch_size=32", "eval.progress=false")


def test_inline_and_process_runs_agree(tmp_path):
    threads, handlers, env = torch.get_num_threads(), list(logging.getLogger().handlers), dict(os.environ)
    inline = run_disteval(*QUICK, run_dir=tmp_path / "inline")
    assert (torch.get_num_threads(), list(logging.getLogger().handlers), dict(os.environ)) == (threads, handlers, env)
    process = run_disteval(*QUICK, run_dir=tmp_path / "process", inline=False)
    assert (inline.returncode, process.returncode) == (0, 0), inline.stderr + process.stderr
    results = [json.loads((tmp_path / name / "results.json").read_text()) for name in ("inline", "process")]
    assert results[0]["metrics"] == results[1]["metrics"] and results[0]["config_digest"] == results[1]["config_digest"]
    bad = [run_disteval(*QUICK, "eval.trials=0", run_dir=tmp_path / f"bad{i}", inline=i == 0) for i in range(2)]
    assert [b.returncode for b in bad] == [2, 2]
    said = [[line for line in b.stderr.splitlines() if "eval.trials" in line] for b in bad]
    assert said[0] and said[0] == said[1]  # the same message naming the key


def test_what_runs_inline():
    assert inline_ok(("dist.world_size=1",), None, None)
    assert not inline_ok(("dist.world_size=2",), None, None) and not inline_ok((), None, None)
    assert not inline_ok(("dist.world_size=1",), {"DISTEVAL_FAULTS": "kill@0:batch=1"}, None)  # a drill kills its process
    assert not inline_ok(("dist.world_size=1", "dist.allocator=jemalloc"), None, None)  # a process of its own
    assert not inline_ok(("-m", "dist.world_size=1"), None, None)
    assert not inline_ok(("dist.world_size=1", "hydra/launcher=submitit_slurm"), None, None)
