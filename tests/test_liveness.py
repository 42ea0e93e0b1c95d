"""One liveness module with named timeouts (disteval/common/liveness.py): a loader that stalls is judged by
``data.loader_timeout_s`` on every rank alike, not by rank 0's ``communication.timeout_s``; the heartbeat rule
is written once."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from recorded_runs import diagnostics_cli

REPO = Path(__file__).resolve().parent.parent
# communication.timeout_s (2 s) shorter than the loader's 4 s: rank 0's watch of a stalled peer must wait for the
# peer's own loader timeout; the final synchronisation's own timeout long enough for rank 0's DataError to arrive
STALL = ("eval.progress=false", "data.batch_size=16", "data.num_workers=1", "data.loader_timeout_s=4",
         "communication.timeout_s=2", "communication.sync_timeout_s=60", "dist.world_size=2")


def _run(run_dir: Path, faults: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DISTEVAL_FAULTS=faults, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", *STALL], cwd=run_dir.parent,
                          env=env, capture_output=True, text=True, timeout=300)


def _status(run_dir: Path, r: int) -> dict:
    return json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())


@pytest.mark.parametrize("stalled", [1, 0])
def test_stalled_loader_gives_the_same_data_error_on_every_rank(tmp_path, stalled):
    """``stall@R:batch=2``: rank R's loader worker never delivers R's 3rd batch. On rank 1 as on rank 0 the
    run fails with R's DataError naming the global batch after which nothing came (R's first global batch + 1:
    batch-aligned shards, rank 0's shard holds rank 1's first global batch index times 16 samples), and the
    console names rank R and that error. Before this rule rank 0 failed a stalled rank 1 after
    communication.timeout_s with "stopped making progress", and rank 1's DataError never came."""
    run_dir = tmp_path / f"stall{stalled}"
    proc = _run(run_dir, f"stall@{stalled}:batch=2")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    err = _status(run_dir, stalled)["error"]
    first = 0 if stalled == 0 else _status(run_dir, 0)["samples_planned"] // 16
    assert err["type"] == "DataError", err
    assert f"no batch from the loader workers after global batch {first + 1} within data.loader_timeout_s" \
        in err["message"], err
    assert re.search(rf"run failed.*rank {stalled}\b", out, re.S) and "DataError" in out, out
    doctor = diagnostics_cli(["doctor", str(run_dir), "--json"], cwd=run_dir.parent)
    verdict = json.loads(doctor.stdout)["runs"][0]
    assert verdict["verdict"]["culprit_rank"] == stalled, verdict["verdict"]
    assert verdict["remedy"]["unset"] == ["DISTEVAL_FAULTS"], verdict["remedy"]  # the drill's, not a longer timeout
    other = _status(run_dir, 1 - stalled)
    assert other["phase"] in ("failed", "sync", "done", "forward"), other
    if other.get("error"):  # the peer's error is a consequence that quotes or follows R's, never its own stall
        assert "stopped making progress" not in other["error"]["message"], other["error"]


def test_one_heartbeat_rule():
    """The heartbeat-freshness rule (three beats with a floor) is written once, in disteval/common/liveness.py:
    no other module computes it from a record's heartbeat_s."""
    rule = re.compile(r"heartbeat_s\"\)\s*or\s*[0-9.]+\)|3(\.0)?\s*\*\s*float\([^)]*heartbeat")
    found = [f"{p.relative_to(REPO)}:{i}" for pkg in ("disteval", "launchers", "diagnostics", "scripts")
             for p in (REPO / pkg).rglob("*.py") if p.name != "liveness.py" or "common" not in p.parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if rule.search(line)]
    assert not found, found


def test_a_relayed_record_is_replaced_only_by_a_newer_one(tmp_path):
    """Several ranks of a node relay the other nodes' records, each from its own read of the rendezvous store: an
    older read (rank 2 still in 'forward') must not replace the copy of its 'failed' record that another rank
    relayed first, and a rank's own file is never replaced."""
    from disteval.job.records import read_status, relay_records, status_path

    failed = {"rank": 2, "node": "n2", "phase": "failed", "t_update": 20.0, "error": {"type": "RuntimeError"}}
    older = {"rank": 2, "node": "n2", "phase": "forward", "t_update": 10.0}
    assert relay_records(tmp_path, [None, None, failed], "n1") == [2]
    assert relay_records(tmp_path, [None, None, older], "n1") == []
    kept = read_status(tmp_path, 2)
    assert (kept["phase"], kept["relayed"]) == ("failed", True)
    newer = dict(failed, t_update=30.0)
    assert relay_records(tmp_path, [None, None, newer], "n1") == [2]
    assert read_status(tmp_path, 2)["t_update"] == 30.0
    status_path(tmp_path, 0).parent.mkdir(parents=True)
    status_path(tmp_path, 0).write_text('{"rank": 0, "node": "n1", "phase": "forward", "t_update": 1.0}')
    assert relay_records(tmp_path, [dict(older, rank=0, node="n2", t_update=99.0)], "n1") == []
    assert read_status(tmp_path, 0)["t_update"] == 1.0
