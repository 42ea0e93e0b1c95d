"""Chaos drills: random real faults in real runs of ``python -m disteval``, each checked against invariants.

    python scripts/chaos.py --seed 7 --rounds 50 [--workdir DIR] [--json PATH] [--kinds kill,stop] [--round N]

Every round draws (``random.Random(seed)``) one fault kind, a world size, the rank it hits and the batch after
which it fires, runs a real ``python -m disteval`` (digits CNN, batch 16, communication.timeout_s=5) into a fresh
run directory under --workdir, injects the fault and then checks, from evidence of its own (the pids in the
ranks' status records and /proc, the bytes on disk, a clean reference run, the doctor's JSON), that:

- ``timeout``: no process outlives its timeout: the driver ends within a bound after the fault (3 x timeout + 5 s
  for a rank that died, stopped, stalled or failed), every rank pid recorded in ranks/rank*/status.json and every
  process of the driver's session is gone within a few seconds after the driver ends (timeout + 5 s after a
  killed driver);
- ``no_results``: a run that failed leaves no results.json;
- ``results_kept``: a finished run's metrics are the bits of a clean reference run at the same world size, and a
  finished run's records are never lost or altered (not by the doctor, not by a second run into the directory,
  which must be refused);
- ``doctor_exit``, ``doctor_state``, ``doctor_culprit``: ``python -m diagnostics doctor RUN --json`` exits 1 for a
  failed run (0 for a healthy one), its verdict is the state/check the injected fault must produce, and its
  culprit rank is the injected rank (None where no rank is at fault);
- ``outcome``: the run ended as the fault implies (exit 0, 1, 2 or killed).

Kinds (rows of the table): kill, stop (SIGSTOP after a batch or at the synchronisation), delay_past (a rank
sleeps past the timeout), delay_within (it sleeps less: the run succeeds), late_sync (a rank, alive, reaches the
final synchronisation after its peers' ``communication.sync_timeout_s`` ran out: the doctor must name it, not
the peer that waited, and raise that key), error (RuntimeError), diskfull
(ENOSPC on every record write), bad_record (a finished run's results.json or a rank's status.json truncated or
overwritten with garbage: the doctor must say so), driver_kill (SIGKILL of ``python -m disteval`` while its ranks
evaluate) and concurrent (a second run into the same run directory while the first runs: refused with exit 2
naming the holder; the first finishes with its results intact). The rounds deal the kinds like cards: every
block of 10 rounds holds each kind once, in a seeded random order. The in-rank kinds (kill, stop, delay_past, error,
diskfull) draw loader workers too (``data.num_workers`` 0 or 2): a rank's worker processes outlive it for a
while and hold its pipes, which once hid a killed rank from the launcher. They, delay_within and bad_record
also draw their data (from a
random.Random of their own, so the kinds dealt by a seed stay as they were): the digits CNN, an ImageFolder tree
of generated JPEGs through a small randomly initialised ViT (``+experiment=imagenet_vit``, decoded by the loader)
or a generated COCO results file replayed against its annotation file (``+experiment=coco_replay``); each data
has clean reference runs of its own. The inputs are generated once under ``--workdir``/inputs.

Network kinds (scripts/chaos_net.py; only when ``--kinds`` names them: they need the network lab, root and
namespaces): net_partition_start, net_partition_sync, net_slow_link, net_freeze_node, net_kill_node, each on 2
lab nodes with the fault on node n2, the same invariants checked on both nodes (a culprit "a rank of n2" where the
node, not one rank, is at fault; none for a slow link). ``--kinds net_partition_start,...`` alone for a network run.

Prints a table of kinds x (rounds, violations per invariant, outcomes), writes a JSON summary with every round
(--json), keeps every run directory under --workdir and exits 1 when any invariant was violated (2 when a clean
reference run fails). ``--round N`` replays round N of the seeded sequence alone (to reproduce a violation).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from disteval.common.ranges import batch_aligned_bounds  # noqa: E402  (the checkout, also when not installed)
from disteval.data.coco_synthetic import make_synthetic_coco  # noqa: E402
import chaos_net  # noqa: E402  (scripts/chaos_net.py: the network kinds)

TIMEOUT_S = 5.0
SYNC_TIMEOUT_S = 3.0  # late_sync's communication.sync_timeout_s: shorter than TIMEOUT_S, so only that key can fire
QUICK = ("eval.progress=false", f"communication.timeout_s={TIMEOUT_S:g}")
# data -> (samples, batch size, overrides; {inputs} is the folder of generated inputs)
DATA = {"digits": (540, 16, ()),  # the default digits job: 540 held-out images
        "imagefolder": (240, 8, ("+experiment=imagenet_vit", "data.root={inputs}/imagefolder", "model.name=vit_tiny",
                                 "model.weights=null", "model.num_classes=4", "data.resize_size=32",
                                 "data.crop_size=32", "eval.classification.topk=[1,2]")),
        "coco": (240, 8, ("+experiment=coco_replay", "data.annotations={inputs}/coco/instances_synthetic.json",
                          "data.predictions={inputs}/coco/results_synthetic.json"))}
STALL_BOUND_S = 3 * TIMEOUT_S + 5     # a failed rank -> the driver has ended (detection, the launcher's grace)
GONE_S = 5.0                          # the driver has ended -> no process of the run is left
DRIVER_KILL_GONE_S = TIMEOUT_S + 5.0  # a killed driver -> its ranks have stopped themselves
RECHECK_S = 11.0                      # the doctor's heartbeats are stale after 10 s
RUN_LIMIT_S = 300.0                   # a run still going after this long hangs (generous: 2 shared cores)
KINDS = ("kill", "stop", "delay_past", "delay_within", "error", "diskfull", "bad_record", "driver_kill",
         "concurrent", "late_sync")
ALL_KINDS = KINDS + chaos_net.NET_KINDS  # the network kinds run only when --kinds names them (they need the lab)
INVARIANTS = ("timeout", "no_results", "results_kept", "doctor_exit", "doctor_state", "doctor_culprit", "outcome")
OUTCOMES = ("ok", "failed", "refused", "killed", "hung", "other")
SIZES = {"kill": (1, 2, 3), "stop": (2, 3), "delay_past": (2, 3), "delay_within": (1, 2, 3), "error": (1, 2, 3),
         "diskfull": (1, 2, 3), "bad_record": (1, 2, 3), "driver_kill": (1, 2, 3), "concurrent": (1, 2, 3), "late_sync": (2, 3)}
WORKER_KINDS = ("kill", "stop", "delay_past", "error", "diskfull")
DATA_KINDS = (*WORKER_KINDS, "delay_within", "bad_record")  # the kinds that draw their data
BAD_RECORDS = ("results:truncate", "results:garbage", "status:truncate", "status:garbage")


@dataclass
class Drill:
    """One round's fault: ``kind``, ``world_size``, the ``rank`` it hits (None: no rank), the 1-based ``batch``
    after which it fires, ``seconds`` (delays) and ``variant`` (stop: batch|sync; bad_record: FILE:HOW)."""

    index: int
    kind: str
    world_size: int
    rank: int | None = None
    batch: int | None = None
    seconds: float | None = None
    variant: str = ""
    workers: int = 0  # data.num_workers: loader worker processes in every rank (in-rank kinds draw 0 or 2)
    data: str = "digits"  # a key of DATA (in-rank kinds draw it)

    def faults(self) -> str | None:
        """The DISTEVAL_FAULTS value of the run (None: no in-rank fault)."""
        r, k, s, kind = self.rank, self.batch, self.seconds, self.kind
        if kind in chaos_net.NET_KINDS:
            return chaos_net.faults(self)
        if kind in ("kill", "error", "diskfull"):
            return f"{kind}@{r}:batch={k}"
        if kind == "stop":
            return f"stop@{r}:sync=1" if self.variant == "sync" else f"stop@{r}:batch={k}"
        if kind in ("delay_past", "delay_within"):
            return f"delay@{r}:batch={k},seconds={s:g}"
        if kind == "late_sync":  # alive, but late to the final synchronisation
            return f"delay@{r}:sync=1,seconds={s:g}"
        if kind == "driver_kill":  # every rank sleeps: the driver is killed while they evaluate
            return f"delay@*:batch={k},seconds=60"
        if kind == "concurrent":  # short sleeps, each within the timeout: the run lasts long enough to be joined
            return ";".join(f"delay@*:batch={b},seconds={s:g}" for b in range(k, k + 5))
        return None

    def describe(self) -> str:
        extra = f" then {self.variant}" if self.kind == "bad_record" else ""
        workers = f" data.num_workers={self.workers}" if self.workers else ""
        data = f" data={self.data}" if self.data != "digits" else ""
        return (f"round {self.index}: {self.kind} W={self.world_size}{data}{workers} "
                f"DISTEVAL_FAULTS={self.faults()!r}{extra}")

    def overrides(self, inputs: Path) -> tuple[str, ...]:
        """The run's extra overrides: its data (``inputs``: the folder of generated inputs) and loader workers."""
        samples, batch, args = DATA[self.data]
        return (f"data.batch_size={batch}", *(a.format(inputs=inputs) for a in args),
                *((f"data.num_workers={self.workers}",) if self.workers else ()),
                *((f"communication.sync_timeout_s={SYNC_TIMEOUT_S:g}",) if self.kind == "late_sync" else ()))


def rank_batches(world_size: int, rank: int, data: str = "digits") -> int:
    """How many batches ``rank`` evaluates (batch-aligned shards of ``data``'s job)."""
    samples, batch, _ = DATA[data]
    start, end = batch_aligned_bounds(samples, batch, world_size, rank)
    return -(-(end - start) // batch)


def draw_drill(rng: random.Random, index: int, kind: str, data_rng: random.Random | None = None) -> Drill:
    """The parameters of round ``index`` of ``kind``: a world size, a rank, a batch that rank reaches (and, for
    the in-rank kinds, the data from ``data_rng``)."""
    if kind in chaos_net.NET_KINDS:
        drill = Drill(index, kind, 2)
        chaos_net.draw(rng, drill)
        return drill
    w = rng.choice(SIZES[kind])
    rank = rng.randrange(w)
    data = data_rng.choice(sorted(DATA)) if data_rng is not None and kind in DATA_KINDS else "digits"
    last = min(rank_batches(w, r, data) for r in range(w))
    drill = Drill(index, kind, w, rank, rng.randint(1, max(1, last - 6)), data=data)
    if kind == "stop":
        drill.variant = rng.choice(("batch", "sync"))
        drill.batch = None if drill.variant == "sync" else drill.batch
    elif kind == "delay_past":
        drill.seconds = float(rng.choice((12, 15)))
    elif kind == "delay_within":
        drill.seconds = float(rng.choice((1, 2)))
    elif kind == "late_sync":
        drill.seconds, drill.batch = float(rng.choice((10, 12))), None
    elif kind == "concurrent":
        drill.seconds, drill.batch, drill.rank = 2.5, rng.randint(1, 2), None
    elif kind == "bad_record":  # rank: whose status.json is corrupted (None for results.json)
        drill.variant, drill.batch = rng.choice(BAD_RECORDS), None
        drill.rank = rank if drill.variant.startswith("status:") else None
    elif kind == "driver_kill":
        drill.rank = None
    if kind in WORKER_KINDS:  # a rank with loader workers dies, stops or fails differently (its children live on)
        drill.workers = rng.choice((0, 2))
    return drill


def draw_drills(seed: int, rounds: int, kinds: tuple[str, ...]) -> list[Drill]:
    """``rounds`` drills from ``random.Random(seed)``: kinds dealt in shuffled blocks, so every block of
    len(kinds) rounds holds each kind once."""
    rng, data_rng = random.Random(seed), random.Random(f"data:{seed}")
    drills, deck = [], []
    for i in range(rounds):
        if not deck:
            deck = list(kinds)
            rng.shuffle(deck)
        drills.append(draw_drill(rng, i, deck.pop(), data_rng))
    return drills


# --------------------------------------------------------------------------------------------- processes
def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, session id) of a live process from /proc, None when gone (a zombie counts as gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[3]))


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (the driver is started as a session leader: its ranks stay in it)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = proc_state(int(entry))
            if st and st[1] == sid:
                found.append(int(entry))
    return found


def describe_pid(pid: int) -> str:
    """``pid`` with its state, parent and command line from /proc (what a leftover process was)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return f"{pid} (gone)"
    return f"{pid} (state {fields[0]}, parent {fields[1]}: {cmd[:160]})"


def wait_gone(pids: set[int], sid: int, bound: float) -> tuple[float | None, list[str]]:
    """Wait up to ``bound`` s for ``pids`` and session ``sid`` to end. Returns (seconds it took or None, the pids
    still alive at the bound, described: these are then SIGKILLed, as cleanup)."""
    t0 = time.monotonic()
    while True:
        alive = sorted(p for p in pids | set(session_pids(sid)) if proc_state(p))
        took = time.monotonic() - t0
        if not alive:
            return took, []
        if took > bound:
            described = [describe_pid(p) for p in alive]
            for p in alive:
                try:
                    os.kill(p, signal.SIGCONT)
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            return None, described
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------------- runs
def write_image_tree(root: Path, classes: int, per_class: int, size: int = 40) -> None:
    """An ImageFolder tree of random JPEGs: ``classes`` folders of ``per_class`` images (written atomically: a
    folder next to ``root`` renamed into place)."""
    rng = np.random.default_rng(0)
    tmp = root.with_name(root.name + ".tmp")
    for c in range(classes):
        (tmp / f"c{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, size=(size, size + 7, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp / f"c{c}" / f"{i:03d}.jpg")
    tmp.rename(root)


@dataclass
class Launched:
    """A ``python -m disteval`` started in the background; ``log`` holds its stdout and stderr."""

    proc: subprocess.Popen
    run_dir: Path
    log: Path
    t0: float


def start_run(run_dir: Path, world_size: int, faults: str | None, extra: tuple[str, ...] = ()) -> Launched:
    """Start ``python -m disteval`` into ``run_dir`` as a session leader (its ranks stay in its session)."""
    env = {k: v for k, v in os.environ.items() if k != "DISTEVAL_FAULTS"}
    env.update(PYTHONUNBUFFERED="1", COLUMNS="120", **({"DISTEVAL_FAULTS": faults} if faults else {}))
    log = run_dir.parent / f"{run_dir.name}.{len(list(run_dir.parent.glob(run_dir.name + '.*.log')))}.log"
    argv = [sys.executable, "-m", "disteval", f"hydra.run.dir={run_dir}", *QUICK, f"dist.world_size={world_size}",
            *extra]
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=run_dir.parent, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return Launched(proc, run_dir, log, time.monotonic())


def finish(run: Launched, limit: float = RUN_LIMIT_S) -> tuple[int | None, float]:
    """Wait for the driver; (exit code or None when it hung past ``limit`` and was killed, its wall seconds)."""
    try:
        code = run.proc.wait(timeout=max(1.0, limit - (time.monotonic() - run.t0)))
    except subprocess.TimeoutExpired:
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait()
        code = None
    return code, time.monotonic() - run.t0


def statuses(run_dir: Path, world_size: int) -> dict[int, dict | None]:
    """Each rank's status record (None: missing or unreadable)."""
    out = {}
    for r in range(world_size):
        try:
            out[r] = json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())
        except (OSError, ValueError):
            out[r] = None
    return out


def wait_for_forward(run_dir: Path, world_size: int, limit: float = 180.0) -> bool:
    """True once every rank's status says phase forward (False after ``limit`` s)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if all(s and s.get("phase") == "forward" for s in statuses(run_dir, world_size).values()):
            return True
        time.sleep(0.2)
    return False


def outcome_of(code: int | None) -> str:
    """The table's outcome for a driver exit code."""
    return {0: "ok", 1: "failed", 2: "refused", -9: "killed", None: "hung"}.get(code, "other")


def doctor(run_dir: Path) -> dict:
    """``python -m diagnostics doctor RUN_DIR --json``: {code, state ("STATE/check" or None), status, culprit,
    finding}."""
    proc = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(run_dir), "--json"], capture_output=True,
                          text=True, timeout=300, cwd=run_dir.parent, env={**os.environ, "COLUMNS": "120"})
    try:
        entry = json.loads(proc.stdout)["runs"][0]
    except (ValueError, KeyError, IndexError):
        return {"code": proc.returncode, "state": "unreadable", "status": None, "culprit": None,
                "finding": proc.stderr[-500:]}
    v = entry["verdict"] or {}
    return {"code": proc.returncode, "state": f"{v['state']}/{v['check']}" if v else None, "status": v.get("status"),
            "culprit": entry["culprit_rank"], "finding": v.get("finding")}


def ask_doctor(run_dir: Path) -> dict:
    """The doctor's diagnosis; asked once more RECHECK_S later when it says the records do not decide yet and
    asks to be run again in a few seconds (a driver that died moments ago: its heartbeats are still fresh)."""
    first = doctor(run_dir)
    if first["status"] == "unknown" and "run the doctor again" in (first["finding"] or ""):
        time.sleep(RECHECK_S)
        return {**doctor(run_dir), "first": first}
    return first


# ------------------------------------------------------------------------------------------- invariants
def expect(drill: Drill) -> dict:
    """The injected truth: how the run must end (outcome), the doctor's verdict ("STATE/check", None =
    healthy), its culprit rank (None: no rank is at fault) and a phrase its finding must contain."""
    k, w, r = drill.kind, drill.world_size, drill.rank
    if k in chaos_net.NET_KINDS:
        return chaos_net.expect(drill)
    if k in ("delay_within", "concurrent"):
        return {"outcome": "ok", "state": None, "culprit": None, "finding": None}
    if k == "bad_record":  # the doctor must name the unreadable record and never call the run healthy
        path = "results.json" if drill.variant.startswith("results") else f"ranks/rank{r}/status.json"
        return {"outcome": "ok", "state": "INIT/records", "culprit": None, "finding": path}
    if k == "driver_kill":
        return {"outcome": "killed", "state": "INIT/launch", "culprit": None, "finding": "died"}
    if k == "kill" and w == 1:  # the only rank runs in the driver's process: the driver dies with it
        return {"outcome": "killed", "state": "INIT/launch", "culprit": 0, "finding": "SIGKILL"}
    if k == "stop":  # its peers time out waiting; its heartbeat stopped: no timeout would help
        return {"outcome": "failed", "state": "COMM/timeout", "culprit": r, "finding": "heartbeat stopped"}
    if k == "late_sync":  # alive, late to the synchronisation: the late rank and the timeout that fired are named
        return {"outcome": "failed", "state": "COMM/timeout", "culprit": r, "finding": "communication.sync_timeout_s"}
    if k == "delay_past":  # alive but slower than the timeout: a longer timeout is the remedy
        return {"outcome": "failed", "state": "COMM/timeout", "culprit": r, "finding": "heartbeat kept beating"}
    if k == "diskfull":  # the driver records the rank's DiskFullError: INIT/launch names file, bytes and rank
        return {"outcome": "failed", "state": "INIT/launch", "culprit": r, "finding": "ENOSPC"}
    if k == "error":
        return {"outcome": "failed", "state": "INIT/ranks_ran", "culprit": r,
                "finding": f"injected error after batch {drill.batch} on rank {r}"}
    return {"outcome": "failed", "state": "INIT/ranks_ran", "culprit": r, "finding": "SIGKILL"}  # kill, W >= 2


@dataclass
class Round:
    """What one round did and found: the drill, its expectation, how the run ended, the doctor's answer, the
    facts measured and the violations (invariant -> what was seen)."""

    drill: Drill
    expected: dict
    outcome: str = "other"
    code: int | None = None
    wall_s: float = 0.0
    doctor: dict = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    violations: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()  # the run's extra overrides (its data, loader workers)

    def violate(self, invariant: str, what: str) -> None:
        self.violations[invariant] = (self.violations.get(invariant, "") + "; " + what).lstrip("; ")


def check_gone(rnd: Round, run: Launched, sts: dict, bound: float) -> None:
    """``timeout``: the ranks' recorded pids and the driver's session end within ``bound`` s."""
    pids = {int(s["pid"]) for s in sts.values() if s and s.get("pid")}
    took, left = wait_gone(pids, run.proc.pid, bound)
    rnd.facts["rank_pids"] = sorted(pids)
    rnd.facts["gone_s"] = None if took is None else round(took, 2)
    if left:
        rnd.violate("timeout", f"pid(s) {left} still alive {bound:g} s after the driver ended")


def check_fault_bound(rnd: Round, sts: dict, t_end: float) -> None:
    """``timeout``: a rank that died, stopped, stalled or failed ends the run within STALL_BOUND_S of its last
    recorded progress."""
    s = sts.get(rnd.drill.rank) if rnd.drill.rank is not None else None
    if rnd.expected["culprit"] is None or rnd.drill.world_size == 1 or not s:
        return
    since = t_end - float(s.get("t_progress") or s.get("t_update") or t_end)
    rnd.facts["end_after_fault_s"] = round(since, 2)
    if since > STALL_BOUND_S:
        rnd.violate("timeout", f"the driver ended {since:.1f} s after rank {rnd.drill.rank}'s last progress "
                    f"(bound {STALL_BOUND_S:g} s)")


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """The bytes of a run's records (results, launch, status records)."""
    files = [run_dir / "results.json", run_dir / "launch.json", *sorted(run_dir.glob("ranks/rank*/status.json"))]
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in files if p.is_file()}


def check_results(rnd: Round, run_dir: Path, reference: str | None) -> None:
    """``no_results`` (a failed run has no results.json) and ``results_kept`` (a finished run's metrics are the
    reference's bits)."""
    exists = (run_dir / "results.json").exists()
    rnd.facts["results_json"] = exists
    if rnd.outcome != "ok":
        if exists:
            rnd.violate("no_results", f"results.json exists after a run that ended {rnd.outcome} (exit {rnd.code})")
        return
    if not exists:
        rnd.violate("results_kept", "a finished run (exit 0) left no results.json")
        return
    metrics = canonical(json.loads((run_dir / "results.json").read_text())["metrics"])
    if metrics != reference:
        rnd.violate("results_kept", "results.json metrics differ from the clean reference run's at "
                    f"W={rnd.drill.world_size}")


def canonical(metrics: dict) -> str:
    """A metrics dict as canonical JSON text (floats as Python's repr: equal text means equal bits)."""
    return json.dumps(metrics, sort_keys=True)


def check_kept(rnd: Round, run_dir: Path, before: dict[str, bytes]) -> None:
    """``results_kept``: a finished run's records survive the doctor and a second run into the directory (which
    must be refused with exit 2, naming eval.overwrite)."""
    if snapshot(run_dir) != before:
        rnd.violate("results_kept", "the doctor changed the run's records")
        return
    if rnd.outcome != "ok":
        return
    again = start_run(run_dir, rnd.drill.world_size, None, rnd.args)
    code, _ = finish(again, 120)
    text = " ".join(again.log.read_text().split())
    rnd.facts["rerun_exit"] = code
    if code != 2 or "eval.overwrite=true" not in text:
        rnd.violate("results_kept", f"a second run into the finished run's directory exited {code} instead of "
                    "being refused (2, naming eval.overwrite=true)")
    elif snapshot(run_dir) != before:
        rnd.violate("results_kept", "a refused second run changed the finished run's records")


def check_doctor(rnd: Round, run_dir: Path) -> None:
    """``doctor_exit``, ``doctor_state`` (state/check, status "fail", the expected phrase in the finding) and
    ``doctor_culprit`` against the injected truth."""
    before = snapshot(run_dir)
    rnd.doctor = ask_doctor(run_dir)
    exp, got = rnd.expected, rnd.doctor
    want_code = 0 if exp["state"] is None else 1
    if got["code"] != want_code:
        rnd.violate("doctor_exit", f"doctor exited {got['code']}, expected {want_code}")
    short = (got["finding"] or "")[:300]
    if got["state"] != exp["state"]:
        rnd.violate("doctor_state", f"verdict {got['state']}, expected {exp['state']} ({short})")
    elif exp["state"] is not None and got["status"] != "fail":
        rnd.violate("doctor_state", f"verdict status {got['status']}, expected fail ({short})")
    elif exp["finding"] and exp["finding"] not in (got["finding"] or ""):
        rnd.violate("doctor_state", f"the finding does not say {exp['finding']!r} ({short})")
    if not (got["culprit"] in exp["culprit"] if isinstance(exp["culprit"], tuple) else got["culprit"] == exp["culprit"]):
        rnd.violate("doctor_culprit", f"culprit rank {got['culprit']}, expected {exp['culprit']} ({short})")
    check_kept(rnd, run_dir, before)


def check_outcome(rnd: Round) -> None:
    """``outcome``: the run ended as the fault implies."""
    if rnd.outcome != rnd.expected["outcome"]:
        rnd.violate("outcome", f"the run ended {rnd.outcome} (exit {rnd.code}), expected {rnd.expected['outcome']}")


# ----------------------------------------------------------------------------------------------- rounds
class Chaos:
    """Runs the rounds under ``workdir``: a clean reference run per world size (once), then each drill."""

    def __init__(self, workdir: Path, console: Console):
        self.workdir, self.console = workdir, console
        self.references: dict[tuple[str, int], str] = {}  # (data, world size) -> canonical metrics
        self.net = chaos_net.NetDrills()  # the network kinds' lab, started by the first such round

    def inputs(self, data: str) -> Path:
        """The folder of generated inputs, with ``data``'s files written on first use."""
        inputs = self.workdir / "inputs"
        if data == "imagefolder" and not (inputs / "imagefolder").is_dir():
            write_image_tree(inputs / "imagefolder", classes=4, per_class=DATA[data][0] // 4)
        elif data == "coco" and not (inputs / "coco").is_dir():
            make_synthetic_coco(inputs / "coco", num_images=DATA[data][0], num_categories=5, dets_per_image=20,
                                seed=11)
        return inputs

    def reference(self, world_size: int, rnd: Round) -> str:
        """The canonical metrics of a clean run of ``rnd``'s data at ``world_size`` (run once; its loader workers
        do not change them). Raises RuntimeError if it fails."""
        data = rnd.drill.data
        if (data, world_size) not in self.references:
            args = Drill(-1, "reference", world_size, data=data).overrides(self.inputs(data))
            run = start_run(self.workdir / f"reference-{data}-w{world_size}", world_size, None, args)
            code, wall = finish(run)
            if code != 0:
                raise RuntimeError(f"the clean reference run of {data} at W={world_size} failed (exit {code}); "
                                   f"see {run.log}")
            metrics = canonical(json.loads((run.run_dir / "results.json").read_text())["metrics"])
            self.references[data, world_size] = metrics
            self.console.print(f"[dim]reference {data} W={world_size}: {wall:.1f} s[/]", highlight=False)
        return self.references[data, world_size]

    def references_agree(self) -> bool:
        """Bitwise mode: each data's clean reference runs have the same bits at every world size."""
        return all(len({m for (d, _), m in self.references.items() if d == data}) <= 1 for data in DATA)

    def play(self, drill: Drill) -> Round:
        """Run one drill and check every invariant."""
        rnd = Round(drill, expect(drill))
        rnd.args = drill.overrides(self.inputs(drill.data))
        name = f"round{drill.index:03d}-{drill.kind}"
        net = drill.kind in chaos_net.NET_KINDS
        run_dir = self.net.run_dir(name) if net else self.workdir / name  # lab rounds: a folder every node sees
        rnd.facts["run_dir"] = str(run_dir)
        t0 = time.monotonic()
        action = {"driver_kill": self.driver_kill, "concurrent": self.concurrent,
                  "bad_record": self.bad_record}.get(drill.kind, self.net.play if net else self.in_rank)
        action(rnd, run_dir)
        if drill.kind != "bad_record":  # checked before the record is corrupted
            check_results(rnd, run_dir, self.reference(drill.world_size, rnd) if rnd.outcome == "ok" else None)
        check_doctor(rnd, run_dir)
        check_outcome(rnd)
        rnd.facts["round_s"] = round(time.monotonic() - t0, 1)
        return rnd

    def ended(self, rnd: Round, run: Launched, bound: float = GONE_S) -> dict:
        """Wait for the driver, record its outcome, check that nothing of the run outlives it."""
        rnd.code, rnd.wall_s = finish(run)
        t_end = time.time()
        rnd.outcome = outcome_of(rnd.code)
        if rnd.code is None:
            rnd.violate("timeout", f"the driver was still running after {RUN_LIMIT_S:g} s")
        sts = statuses(run.run_dir, rnd.drill.world_size)
        check_gone(rnd, run, sts, bound)
        check_fault_bound(rnd, sts, t_end)
        return sts

    def in_rank(self, rnd: Round, run_dir: Path) -> None:
        """kill, stop, delay, error, diskfull: DISTEVAL_FAULTS in the ranks."""
        self.ended(rnd, start_run(run_dir, rnd.drill.world_size, rnd.drill.faults(), rnd.args))

    def driver_kill(self, rnd: Round, run_dir: Path) -> None:
        """SIGKILL the driver once every rank evaluates (each sleeps 60 s after a batch): its ranks must stop
        themselves within the timeout."""
        run = start_run(run_dir, rnd.drill.world_size, rnd.drill.faults(), rnd.args)
        if not wait_for_forward(run_dir, rnd.drill.world_size):
            rnd.violate("outcome", "the ranks never reached phase forward")
        time.sleep(1.0)
        run.proc.kill()
        self.ended(rnd, run, DRIVER_KILL_GONE_S)

    def concurrent(self, rnd: Round, run_dir: Path) -> None:
        """A second run into the same directory while the first runs: refused (exit 2) naming the holder."""
        first = start_run(run_dir, rnd.drill.world_size, rnd.drill.faults(), rnd.args)
        if not wait_for_forward(run_dir, rnd.drill.world_size):
            rnd.violate("outcome", "the first run's ranks never reached phase forward")
        second = start_run(run_dir, rnd.drill.world_size, None, rnd.args)
        code, _ = finish(second, 180)
        first_alive = first.proc.poll() is None
        text = " ".join(second.log.read_text().split())
        rnd.facts.update(second_exit=code, first_alive_at_refusal=first_alive)
        busy = f"is in use by another run: pid {first.proc.pid}" in text
        if code != 2 or (first_alive and not busy):
            rnd.violate("outcome", f"the second run exited {code}" + ("" if busy else " without naming the holder "
                        f"(pid {first.proc.pid})") + f"; see {second.log}")
        self.ended(rnd, first)

    def bad_record(self, rnd: Round, run_dir: Path) -> None:
        """A clean run (its results checked), then one of its records truncated or overwritten with garbage
        (``variant``); the doctor must name it, and its bytes must stay as they are."""
        self.ended(rnd, start_run(run_dir, rnd.drill.world_size, None, rnd.args))
        check_results(rnd, run_dir, self.reference(rnd.drill.world_size, rnd) if rnd.outcome == "ok" else None)
        which, how = rnd.drill.variant.split(":")
        path = run_dir / ("results.json" if which == "results" else f"ranks/rank{rnd.drill.rank}/status.json")
        if path.exists():
            data = path.read_bytes()
            path.write_bytes(data[: len(data) // 2] if how == "truncate" else b"\x00\xffnot json\x13" * 8)
        rnd.facts["corrupted"] = str(path.relative_to(run_dir))


# ------------------------------------------------------------------------------------------------ report
def summarize(rounds: list[Round], kinds: tuple[str, ...]) -> dict:
    """Per kind and in total: rounds, violations per invariant, outcomes, wall seconds."""
    rows = {}
    for kind in (*kinds, "total"):
        mine = [r for r in rounds if kind in ("total", r.drill.kind)]
        rows[kind] = {"rounds": len(mine),
                      "violations": {inv: sum(inv in r.violations for r in mine) for inv in INVARIANTS},
                      "outcomes": dict(Counter(r.outcome for r in mine)),
                      "world_sizes": dict(Counter(str(r.drill.world_size) for r in mine)),
                      "seconds": round(sum(r.facts.get("round_s", 0.0) for r in mine), 1)}
    return rows


def print_table(rows: dict, console: Console, title: str) -> None:
    """Rows = kinds (and the total), columns = rounds, violations per invariant, outcome counts."""
    table = Table(title=title, show_lines=False)
    table.add_column("kind")
    table.add_column("rounds", justify="right")
    for inv in INVARIANTS:
        table.add_column(inv.replace("doctor_", "dr_"), justify="right")
    for out in OUTCOMES:
        table.add_column(out, justify="right", style="dim")
    table.add_column("s", justify="right")
    for kind, row in rows.items():
        cells = [f"[bold red]{n}[/]" if n else "0" for n in row["violations"].values()]
        outs = [str(row["outcomes"].get(o, 0)) for o in OUTCOMES]
        style = "bold" if kind == "total" else None
        table.add_row(kind, str(row["rounds"]), *cells, *outs, f"{row['seconds']:.0f}", style=style,
                      end_section=kind == list(rows)[-2])
    console.print(table)


def print_round(rnd: Round, console: Console) -> None:
    """One line per round as it ends (and its violations with the drill that reproduces them)."""
    d = rnd.doctor
    mark = "[bold red]VIOLATED[/]" if rnd.violations else "[green]ok[/]"
    console.print(f"{mark} {rnd.drill.describe()} -> {rnd.outcome} (exit {rnd.code}, {rnd.wall_s:.1f} s); doctor "
                  f"{d.get('code')} {d.get('state')} {d.get('status')} culprit {d.get('culprit')}", highlight=False,
                  soft_wrap=True)
    for inv, what in rnd.violations.items():
        console.print(f"    [red]{inv}[/]: {what}", highlight=False, soft_wrap=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(ALL_KINDS)} "
                        "(default: the single-host kinds; the net_* kinds need the network lab: root, namespaces)")
    parser.add_argument("--round", type=int, default=None, help="replay only this round of the seeded sequence")
    parser.add_argument("--workdir", type=Path, default=None, help="where the run directories go (default: a new "
                        "temporary directory, kept)")
    parser.add_argument("--json", type=Path, default=None, help="write the summary and every round here")
    args = parser.parse_args(argv)
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    unknown = set(args.kinds) - set(ALL_KINDS)
    if unknown or not args.kinds or args.rounds < 1:
        parser.error(f"unknown kind(s) {sorted(unknown)}; kinds: {','.join(ALL_KINDS)}" if unknown else
                     "need at least one kind and one round")
    why = chaos_net.NetDrills.unavailable(args.kinds)
    if why:
        parser.error(why)
    if args.workdir is not None and args.workdir.is_dir() and any(args.workdir.iterdir()):
        parser.error(f"--workdir {args.workdir} is not empty (every round needs a fresh run directory)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the rounds; 0 when no invariant was violated, 1 otherwise, 2 when a reference run failed."""
    args = parse_args(argv)
    console = Console(width=max(200, Console().width))
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="disteval-chaos-"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    drills = draw_drills(args.seed, args.rounds, args.kinds)
    if args.round is not None:
        drills = [d for d in drills if d.index == args.round]
    console.print(f"chaos: seed {args.seed}, {len(drills)} round(s), run directories under {workdir}", highlight=False)
    chaos, rounds, t0 = Chaos(workdir, console), [], time.monotonic()
    try:
        for drill in drills:
            rounds.append(chaos.play(drill))
            print_round(rounds[-1], console)
    except RuntimeError as exc:
        console.print(f"[bold red]chaos: {exc}[/]", highlight=False)
        return 2
    finally:
        chaos.net.close()
    refs_agree = chaos.references_agree()
    rows = summarize(rounds, args.kinds)
    wall = time.monotonic() - t0
    print_table(rows, console, f"chaos: seed {args.seed}, {len(rounds)} rounds, {wall:.0f} s")
    if not refs_agree:
        console.print("[bold red]the clean reference runs' metrics differ between world sizes[/]")
    bad = [r for r in rounds if r.violations]
    console.print(f"{sum(len(r.violations) for r in bad)} violation(s) in {len(bad)} round(s)"
                  + "".join(f"\n  {r.drill.describe()}: {r.violations}" for r in bad), highlight=False, soft_wrap=True)
    if args.json:
        args.json.write_text(json.dumps({"seed": args.seed, "rounds": len(rounds), "wall_s": round(wall, 1),
                                         "workdir": str(workdir), "references_agree": refs_agree, "summary": rows,
                                         "details": [asdict(r) for r in rounds]}, indent=2, default=str))
    return 1 if bad or not refs_agree else 0


if __name__ == "__main__":
    sys.exit(main())
