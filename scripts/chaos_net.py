"""The network kinds of scripts/chaos.py: real faults on real links of the network lab (``disteval.testing.netlab``).

Every round runs ``python -m disteval`` on 2 lab nodes (n1 holds rank 0 and the rendezvous, 1 or 2 ranks per node,
disteval's own multi-node launcher, a shared run directory), injects a fault on node n2 and records how the run
ended, on both nodes; scripts/chaos.py then checks the same invariants as for the in-rank kinds (the doctor's
verdict = the injected truth, no results.json from a failed run, nothing of the run left on either node):

- ``net_partition_start``: n2 cut off from n1 before the launch (a ``prohibit`` route: refused at once, or a
  silent ``blackhole``): INIT/launch, "never reached the rendezvous", no culprit rank;
- ``net_partition_sync``: rank 0 held back at the synchronisation (a delay drill) while the others wait in its
  all_reduce, then n2 cut off silently: COMM/timeout naming the partition, culprit a rank of n2;
- ``net_slow_link``: n2's link shaped to 1 Mbit/s while the Fashion-MNIST AUROC scores are gathered under a 1.5 s
  sync timeout (400-600 kB through a rank's link: 3-5 s): COMM/timeout, "a slow link, not a dead peer", no culprit
  rank (the link is the cause);
- ``net_freeze_node``: every process of n2 SIGSTOPped mid-forward: COMM/timeout, "heartbeat stopped", culprit a
  rank of n2 (thawed once n1's driver ended);
- ``net_kill_node``: every process of n2 SIGKILLed mid-forward: "node n2 died or was killed", culprit a rank of n2.

This module knows nothing of chaos.py's records beyond the round it is handed (``drill``, ``expected``, ``code``,
``outcome``, ``wall_s``, ``facts``, ``violate``); chaos.py imports it, never the reverse.
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from disteval.testing.netlab import NetLab  # noqa: E402

NET_KINDS = ("net_partition_start", "net_partition_sync", "net_slow_link", "net_freeze_node", "net_kill_node")
TIMEOUT_S = 10.0  # communication.timeout_s: also the rendezvous' (2 shared cores start 2 nodes' drivers at once)
END_BOUND_S = 3 * TIMEOUT_S + 15  # the fault -> n1's driver has ended
GONE_S = TIMEOUT_S + 15  # n1's driver ended (and n2 healed / thawed) -> nothing of the run left on either node
RUN_LIMIT_S = 240.0
FASHION = Path("/usr/share/datasets/fashion-mnist")
SLOW_JOB = ("+experiment=fashion_mnist", "eval.metrics=[classification,ranking]", "communication.sync_timeout_s=1.5")


def draw(rng, drill) -> None:
    """The network kinds' parameters on ``drill`` (a chaos.Drill): ranks per node (world size 2 or 4), the batch
    after which n2 is frozen or killed, the partition's form."""
    per_node = rng.choice((1, 2))
    drill.world_size = 2 * per_node
    drill.rank = per_node  # n2's first rank: the rank the doctor must name (one of n2's)
    drill.batch = rng.randint(1, 3) if drill.kind in ("net_freeze_node", "net_kill_node") else None
    drill.variant = rng.choice(("prohibit", "blackhole")) if drill.kind == "net_partition_start" else ""
    if drill.kind == "net_slow_link":
        drill.variant = "1mbit"


def faults(drill) -> str | None:
    """DISTEVAL_FAULTS of a network round: rank 0 held at the sync (partition in sync), every rank held after
    ``batch`` so the node is hit mid-forward (freeze, kill)."""
    if drill.kind == "net_partition_sync":
        return "delay@0:sync=1,seconds=4"
    if drill.kind in ("net_freeze_node", "net_kill_node"):
        return f"delay@*:batch={drill.batch},seconds=8"
    return None


def expect(drill) -> dict:
    """The injected truth: outcome, the doctor's "STATE/check", the acceptable culprit ranks (a tuple: any rank
    of n2; None: no rank at fault) and a phrase of the finding."""
    n2 = tuple(range(drill.world_size // 2, drill.world_size))
    if drill.kind == "net_partition_start":
        return {"outcome": "failed", "state": "INIT/launch", "culprit": None, "finding": "never reached the rendezvous"}
    if drill.kind == "net_partition_sync":
        return {"outcome": "failed", "state": "COMM/timeout", "culprit": n2, "finding": "n2"}
    if drill.kind == "net_slow_link":
        return {"outcome": "failed", "state": "COMM/timeout", "culprit": None, "finding": "a slow link, not a dead peer"}
    if drill.kind == "net_freeze_node":
        return {"outcome": "failed", "state": "COMM/timeout", "culprit": n2, "finding": "heartbeat stopped"}
    return {"outcome": "failed", "state": "INIT/ranks_ran", "culprit": n2, "finding": "node n2 died or was killed"}


def _status(run_dir: Path, rank: int) -> dict:
    try:
        return json.loads((run_dir / "ranks" / f"rank{rank}" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class NetDrills:
    """One lab (2 nodes, name "chaos") for every network round, started at the first and stopped by ``close``."""

    def __init__(self):
        self.lab: NetLab | None = None
        self._ports = itertools.count(29811)

    @staticmethod
    def unavailable(kinds) -> str | None:
        """Why network kinds cannot run here (no root or namespaces, no Fashion-MNIST for the slow link)."""
        if not any(k in NET_KINDS for k in kinds):
            return None
        reason = NetLab.available()
        if reason:
            return f"network kinds need the lab: {reason}"
        if "net_slow_link" in kinds and not any(FASHION.glob("t10k-*")):
            return f"net_slow_link needs Fashion-MNIST at {FASHION} (apt-get install dataset-fashion-mnist)"
        return None

    def run_dir(self, name: str) -> Path:
        """A run directory every node sees (the lab's shared folder)."""
        if self.lab is None:
            self.lab = NetLab(nodes=2, name="chaos").start()
        return self.lab.shared / name

    def close(self) -> None:
        if self.lab is not None:
            self.lab.stop()
            self.lab = None

    def play(self, rnd, run_dir: Path) -> None:
        """Run the round's drill on the lab: launch both nodes, inject, wait for n1's driver (rank 0's node decides
        the outcome), undo the fault, check that nothing of the run is left on either node."""
        lab, drill = self.lab, rnd.drill
        per_node = drill.world_size // 2
        cmd = [sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", "eval.progress=false",
               f"communication.timeout_s={TIMEOUT_S:g}", f"dist.world_size={drill.world_size}", "dist.nnodes=2",
               f"dist.rdzv_endpoint=198.18.0.1:{next(self._ports)}"]
        cmd += list(SLOW_JOB) if drill.kind == "net_slow_link" else ["data.batch_size=16"]
        env = {k: v for k, v in os.environ.items() if k != "DISTEVAL_FAULTS"}
        if faults(drill):
            env["DISTEVAL_FAULTS"] = faults(drill)
        if drill.kind == "net_partition_start":
            lab.partition("n2", how=drill.variant)
        elif drill.kind == "net_slow_link":
            lab.rate("n2", 1)
        logs = {n: open(run_dir.parent / f"{run_dir.name}.{n}.log", "w") for n in ("n1", "n2")}
        t0 = time.monotonic()
        procs = {n: lab.popen(n, cmd, cwd=REPO, env=env, stdout=logs[n], stderr=subprocess.STDOUT) for n in logs}
        t_fault = time.monotonic()
        try:
            t_fault = self._inject(rnd, run_dir, per_node, lambda: procs["n1"].poll() is None) or t_fault
            try:
                rnd.code = procs["n1"].wait(timeout=RUN_LIMIT_S)
            except subprocess.TimeoutExpired:
                rnd.code = None
                rnd.violate("timeout", f"n1's driver was still running after {RUN_LIMIT_S:g} s")
            t_end = time.monotonic()
        finally:
            lab.thaw("n2")
            lab.heal("n2")
            lab.unrate("n2")
            for f in logs.values():
                f.close()
        rnd.wall_s = t_end - t0
        rnd.outcome = {0: "ok", 1: "failed", 2: "refused", -9: "killed", None: "hung"}.get(rnd.code, "other")
        rnd.facts["fault_after_launch_s"] = round(t_fault - t0, 2)  # when the fault struck or bit
        rnd.facts["end_after_fault_s"] = round(t_end - t_fault, 2)
        if t_end - t_fault > END_BOUND_S:
            rnd.violate("timeout", f"n1's driver ended {t_end - t_fault:.1f} s after the fault (bound {END_BOUND_S:g} s)")
        self._check_gone(rnd, procs)

    def _inject(self, rnd, run_dir: Path, per_node: int, running) -> float | None:
        """Wait for the moment the drill needs, then strike n2; the time of the fault: for the faults set before
        the launch, the moment they bite (net_partition_start: n1's driver starts its ranks, which then wait for
        n2 at the rendezvous; net_slow_link: a rank enters the final synchronisation, whose gather crosses the
        slow link), so that imports, the rendezvous and the evaluation on a loaded machine do not count against
        END_BOUND_S. None (the launch): the moment never came while n1's driver ran (``running``)."""
        lab, kind = self.lab, rnd.drill.kind
        if kind == "net_partition_start":
            log = run_dir.parent / f"{run_dir.name}.n1.log"
            if self._wait(lambda: log.exists() and "checks passed" in log.read_text(errors="replace"), running=running):
                return time.monotonic()
        elif kind == "net_slow_link":
            ranks = range(rnd.drill.world_size)
            if self._wait(lambda: any(_status(run_dir, r).get("phase") == "sync" for r in ranks), running=running):
                return time.monotonic()
        elif kind == "net_partition_sync":
            rank = per_node  # n2's first rank waits in the sync's all_reduce while rank 0 is held
            if self._wait(lambda: (_status(run_dir, rank).get("in_flight") or {}).get("op") == "all_reduce",
                          running=running):
                lab.partition("n2", how="blackhole")
                return time.monotonic()
            rnd.violate("outcome", f"rank {rank} never waited in the synchronisation's all_reduce")
        elif kind in ("net_freeze_node", "net_kill_node"):
            n2 = range(per_node, 2 * per_node)
            if self._wait(lambda: all(_status(run_dir, r).get("batches_done", 0) >= rnd.drill.batch for r in n2),
                          running=running):
                (lab.freeze if kind == "net_freeze_node" else lab.kill)("n2")
                return time.monotonic()
            rnd.violate("outcome", f"n2's ranks never finished batch {rnd.drill.batch}")
        return None

    @staticmethod
    def _wait(predicate, limit: float = 120.0, running=None) -> bool:
        """Poll ``predicate`` every 0.1 s until it holds (True), ``limit`` s pass or ``running()`` turns False."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if predicate():
                return True
            if running is not None and not running():
                return predicate()
            time.sleep(0.05)
        return False

    def _check_gone(self, rnd, procs: dict) -> None:
        """``timeout``: n2's driver ends too, and no process of the run is left on either node, within GONE_S of
        n1's driver's end (n2 healed and thawed by then)."""
        deadline = time.monotonic() + GONE_S
        left: dict[str, list[int]] = {}
        while True:
            left = {n: [p for p in self.lab.pids(n) if b"disteval" in _cmdline(p)] for n in ("n1", "n2")}
            if not any(left.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        try:  # its processes are gone: give the driver's own exit (a launcher wrapping it) the rest of the bound
            procs["n2"].wait(timeout=max(0.0, deadline - time.monotonic()) + 5.0)
        except subprocess.TimeoutExpired:
            pass
        rnd.facts["n2_exit"] = procs["n2"].poll()  # None: n2's driver had not ended by itself
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        if any(left.values()):
            rnd.violate("timeout", f"processes of the run still alive {GONE_S:g} s after n1's driver ended: {left}")
            for pids in left.values():
                for pid in pids:
                    try:
                        os.kill(pid, 9)
                    except OSError:
                        pass
