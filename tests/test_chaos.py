"""``scripts/chaos.py``: a small seeded chaos run (real runs, real faults, the real doctor) passes every invariant,
and its table and JSON summary add up."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def test_seeded_chaos_rounds_keep_every_invariant(tmp_path):
    summary = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chaos.py"), "--seed", "1", "--rounds", "3",
                           "--kinds", "late_sync,stop,concurrent",
                           "--workdir", str(tmp_path / "work"), "--json", str(summary)],
                          capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(summary.read_text())
    # seed 1 deals rank 0 of 3 late to the synchronisation (alive, past communication.sync_timeout_s), a concurrent
    # run into one run directory and a stopped rank
    kinds = [r["drill"]["kind"] for r in report["details"]]
    assert kinds == ["late_sync", "concurrent", "stop"], kinds
    late = report["details"][0]
    assert late["drill"]["rank"] == 0 and late["doctor"]["culprit"] == 0
    driver = (tmp_path / "work" / "round000-late_sync.0.log").read_text()
    assert "run failed rank 0 was late" in driver and "communication.sync_timeout_s = 3 s" in driver, driver[-2000:]
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", late["facts"]["run_dir"], "--json"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    remedy = json.loads(doctor.stdout)["runs"][0]["remedy"]  # the key that fired, raised: not communication.timeout_s
    assert [o.split("=")[0] for o in remedy["overrides"]] == ["communication.sync_timeout_s"], remedy
    total = report["summary"]["total"]
    assert report["rounds"] == total["rounds"] == 3 and report["references_agree"]
    assert total["violations"] == {inv: 0 for inv in total["violations"]} and len(total["violations"]) == 7
    assert total["outcomes"] == {"failed": 2, "ok": 1}
    assert sum(row["rounds"] for kind, row in report["summary"].items() if kind != "total") == 3
    for rnd in report["details"]:  # the doctor named the injected rank, and nothing outlived the run
        assert rnd["doctor"]["culprit"] == rnd["expected"]["culprit"] and rnd["facts"]["gone_s"] is not None
    concurrent = report["details"][1]
    assert concurrent["facts"]["second_exit"] == 2 and concurrent["facts"]["rerun_exit"] == 2
    # the printed table: one row per kind and a total row with 3 rounds, 0 violations, 2 failed and 1 ok
    total_row = next(line for line in proc.stdout.splitlines() if line.strip("│ ").startswith("total"))
    cells = [c.strip() for c in total_row.strip("│").split("│")]
    assert cells[:9] == ["total", "3", "0", "0", "0", "0", "0", "0", "0"], cells
    assert cells[9:15] == ["1", "2", "0", "0", "0", "0"], cells
    assert "0 violation(s) in 0 round(s)" in proc.stdout


NET_KINDS = ("net_partition_start", "net_partition_sync", "net_slow_link", "net_freeze_node", "net_kill_node")


@pytest.mark.netlab
def test_seeded_network_chaos_on_the_lab(tmp_path):
    """``--kinds`` the five network kinds, 5 rounds: every kind once (dealt like cards), each on 2 lab nodes with
    the fault on n2; every invariant holds on both nodes: the doctor's verdict and culprit (a rank of n2, none for
    a slow link or a node that never joined) are the injected truth, no results.json, nothing left running."""
    from disteval.testing.netlab import NetLab

    reason = NetLab.available()
    if reason:
        pytest.skip(reason)
    summary = tmp_path / "chaos.json"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chaos.py"), "--seed", "7", "--rounds", "5",
                           "--kinds", ",".join(NET_KINDS), "--workdir", str(tmp_path / "work"), "--json", str(summary)],
                          capture_output=True, text=True, timeout=1200, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(summary.read_text())
    assert sorted(r["drill"]["kind"] for r in report["details"]) == sorted(NET_KINDS)
    total = report["summary"]["total"]
    assert total["violations"] == {inv: 0 for inv in total["violations"]} and total["outcomes"] == {"failed": 5}
    for rnd in report["details"]:
        want, got = rnd["expected"]["culprit"], rnd["doctor"]["culprit"]
        assert got in want if isinstance(want, list) else got == want, rnd
        assert rnd["facts"]["n2_exit"] is not None  # n2's driver ended too (healed or thawed first)
        # the bound runs from the fault: for faults set before the launch, from when they bite (n1 starts its
        # ranks; a rank enters the synchronisation), never from the launch (imports and start-up excluded)
        assert rnd["facts"]["fault_after_launch_s"] > 1.0, rnd
    assert "0 violation(s) in 0 round(s)" in proc.stdout
