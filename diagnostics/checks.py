"""The checks of each state of the troubleshooting flowchart. Each is a pure function of a ``Run`` (and the
probe results, when --probe ran) returning a ``Finding``: pass / warn / fail / skipped, what was found, the
evidence (file and field or line), at most one remedy, and the culprit rank when one is known.

States, in the order the doctor walks them (the first failing one is the verdict):
INIT (did every rank start, join and run), SHARDS (shard plan, coverage, sampler), CONVERGENCE (do trials
agree; nondeterminism flags), COMM (timeouts, stragglers, mismatched collectives), RESULT (outlier ranks,
implausible values).
"""
from __future__ import annotations

import math
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

from omegaconf import OmegaConf

from disteval.common.ranges import batch_aligned_bounds, shard_bounds
from disteval.metrics.robust import OUTLIER_Z, rank_outliers
from disteval.records import INTERRUPT_TYPES, is_network_error, recorded_progress
from launchers.culprit import culprit_from_records

from diagnostics.compare import compare_runs, summary
from diagnostics.evidence import Evidence, Run, traceback_frame
from diagnostics.remedies import Remedy

STATES = ("INIT", "SHARDS", "CONVERGENCE", "COMM", "RESULT")
STATUSES = ("pass", "warn", "fail", "skipped", "crashed")


@dataclass
class Finding:
    """The outcome of one check. ``status``: pass | warn | fail | skipped | crashed (the check itself raised)."""

    state: str
    check: str
    status: str
    finding: str
    evidence: list[Evidence] = field(default_factory=list)
    remedy: Remedy | None = None
    culprit: int | None = None

    def as_dict(self) -> dict:
        return {"state": self.state, "check": self.check, "status": self.status, "finding": self.finding,
                "evidence": [e.as_dict() for e in self.evidence],
                "remedy": self.remedy.as_dict() if self.remedy else None, "culprit_rank": self.culprit}


# ----------------------------------------------------------------------------------------------- helpers
def _status_ev(run: Run, r: int, fld: str) -> Evidence:
    s = run.statuses.get(r) or {}
    value = s
    for part in fld.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return Evidence(f"ranks/rank{r}/status.json", repr(value)[:300], field=fld)


def _error_ev(run: Run, r: int) -> list[Evidence]:
    """The rank's error message, and the innermost traceback frame (file and line) when it has one."""
    err = (run.statuses.get(r) or {}).get("error") or {}
    out = [Evidence(f"ranks/rank{r}/status.json", f"{err.get('type')}: {str(err.get('message'))[:300]}",
                    field="error.message")]
    frame = traceback_frame(err.get("traceback", ""))
    if frame:
        out.append(Evidence(frame[0], "raised here", line=frame[1]))
    return out


def _errors(run: Run) -> dict[int, dict]:
    return {r: s["error"] for r, s in run.statuses.items() if s and s.get("error")}


def _interrupted(run: Run) -> bool:
    """The ranks were interrupted from outside (Ctrl-C, the driver killed): every recorded error is an interrupt."""
    if (run.launch or {}).get("outcome") == "interrupted":
        return True
    errs = list(_errors(run).values())
    return bool(errs) and all(e.get("type") in INTERRUPT_TYPES for e in errs) and \
        (run.launch or {}).get("outcome") in (None, "running")


def _culprit(run: Run):
    """The culprit rank by the launchers' rule, from the records the doctor read (computed once per run)."""
    if "culprit" not in run.derived:
        failed = run.failed and run.world_size and not _interrupted(run)
        run.derived["culprit"] = culprit_from_records(
            {r: run.statuses.get(r) for r in range(run.world_size)}, run.deaths()) if failed else None
    return run.derived["culprit"]


_STALL = re.compile(r"stalled|never wrote a status record|timed out|timeout|deadline", re.I)
_INIT_PORT_IN_USE = re.compile(r"EADDRINUSE|address already in use|already in use", re.I)
_INIT_RESOLVE = re.compile(r"gaierror|Name or service not known|Temporary failure in name resolution|"
                           r"nodename nor servname|cannot resolve|unknown host", re.I)
_MISMATCH = re.compile(r"mismatch", re.I)


# ------------------------------------------------------------------------------------------------ INIT
def init_launch(run: Run, probes: dict | None) -> Finding:
    """The driver's record: a configuration error before any rank started (port in use, bad address, a bad
    key) or an interrupted run."""
    launch = run.launch
    if launch is None and _interrupted(run):
        return Finding("INIT", "launch", "fail", "the ranks were interrupted from outside (Ctrl-C or SIGTERM): no rank "
                       "is to blame", [Evidence(f"ranks/rank{r}/status.json", e.get("type"), field="error.type")
                                       for r, e in sorted(_errors(run).items())][:4], Remedy([], "rerun"))
    if launch is None:
        return Finding("INIT", "launch", "skipped", "no launch.json: the ranks were started by an external launcher "
                       "(torchrun, SLURM) or by an older disteval")
    err = launch.get("error") or {}
    ev = [Evidence("launch.json", str(launch.get("outcome")), field="outcome")]
    if launch.get("outcome") == "config_error":
        key, message = err.get("key"), str(err.get("message"))
        ev.append(Evidence("launch.json", message[:300], field="error.message"))
        if key == "dist.master_port" or _INIT_PORT_IN_USE.search(message):
            port = launch.get("master_port")
            return Finding("INIT", "launch", "fail", f"port {port} on {launch.get('master_addr')} is already in use by "
                           "another program, so the rendezvous could not be hosted; no rank started", ev,
                           Remedy(["dist.master_port=0"], "let the rendezvous pick a free port"))
        if key == "dist.master_addr" or _INIT_RESOLVE.search(message):
            return Finding("INIT", "launch", "fail", f"the rendezvous address {launch.get('master_addr')!r} is not an "
                           "address of this machine or cannot be resolved; no rank started", ev,
                           Remedy(["dist.master_addr=127.0.0.1"], "host the rendezvous on this machine's loopback "
                                  "address (single-node runs)"))
        return Finding("INIT", "launch", "fail", f"configuration error before any rank started at {key or 'config'}: "
                       f"{message[:200]}", ev)
    if _interrupted(run):
        return Finding("INIT", "launch", "fail", "the run was interrupted from outside (Ctrl-C, SIGTERM, or the driver "
                       "was killed): every rank was stopped; no rank is to blame", ev + [
                           Evidence(f"ranks/rank{r}/status.json", e.get("type"), field="error.type")
                           for r, e in sorted(_errors(run).items())][:4], Remedy([], "rerun"))
    if launch.get("outcome") == "running":
        return Finding("INIT", "launch", "warn", "launch.json says running: the driver is still running or was killed "
                       "before it could record an outcome", ev)
    if launch.get("outcome") == "failed":
        return Finding("INIT", "launch", "pass", f"the driver launched {run.world_size} rank(s); the run failed: "
                       f"{str(err.get('message'))[:200]} (the checks below say why)", ev)
    return Finding("INIT", "launch", "pass", f"the driver launched {run.world_size} rank(s)", ev)


def init_scheduler(run: Run, probes: dict | None) -> Finding:
    """The scheduler's view of a submitit/SLURM job (RUN_DIR/job.json, written for jobs that did not complete)."""
    job = run.job
    if job is None:
        return Finding("INIT", "scheduler", "skipped", "no job.json (not a failed submitit job)")
    state = str(job.get("state", "")).upper()
    ev = [Evidence("job.json", state, field="state"), Evidence("job.json", str(job.get("error"))[:300], field="error")]
    if state.startswith("TIMEOUT"):
        limit = OmegaConf.select(run.hydra, "hydra.launcher.timeout_min", default=None) if run.hydra is not None else None
        return Finding("INIT", "scheduler", "fail", f"SLURM job {job.get('job_id')} hit its time limit", ev,
                       Remedy([f"hydra.launcher.timeout_min={2 * int(limit)}"] if limit else [],
                              "a longer time limit (checkpoints resume the work already done)"))
    if state.startswith(("CANCELLED", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "OUT_OF_MEMORY")):
        return Finding("INIT", "scheduler", "fail", f"SLURM job {job.get('job_id')} ended {state}: "
                       f"{str(job.get('error'))[:200]}", ev, Remedy([], "rerun; the scheduler stopped the job"))
    return Finding("INIT", "scheduler", "pass", f"SLURM job {job.get('job_id')} state {state} (rank errors below)", ev)


def init_started(run: Run, probes: dict | None) -> Finding:
    """Every rank 0..W-1 wrote a status record."""
    if run.launch and run.launch.get("outcome") == "config_error":
        return Finding("INIT", "started", "skipped", "no rank was launched (configuration error)")
    size = run.world_size
    if not size:
        return Finding("INIT", "started", "skipped", "the world size is unknown (no launch, job, config or status record)")
    missing = [r for r in range(size) if run.statuses.get(r) is None
               and not (run.path / "ranks" / f"rank{r}" / "status.json").exists()]  # unreadable: see INIT/records
    if missing:
        return Finding("INIT", "started", "fail", f"rank(s) {missing} of {size} never started: no status record",
                       [Evidence(f"ranks/rank{r}/status.json", "missing") for r in missing],
                       Remedy([], "rerun unchanged: a task that never started is usually a scheduler or node problem"),
                       culprit=missing[0])
    return Finding("INIT", "started", "pass", f"all {size} ranks started")


def init_joined(run: Run, probes: dict | None) -> Finding:
    """Every rank joined the process group; for those that did not: port in use, unresolvable address, a rank
    pointed at another port than rank 0's store, or a rank that never arrived."""
    records = {r: s for r, s in run.statuses.items() if s}
    if not records:
        return Finding("INIT", "joined", "skipped", "no status records")
    stuck = sorted(r for r, s in records.items() if not s.get("joined") and s.get("phase") in ("init", "failed")
                   and (s.get("phase") == "init" or not s.get("samples_planned")))
    rdv = {r: s.get("rendezvous") or {} for r, s in records.items()}
    ports = {r: v.get("master_port") for r, v in rdv.items() if v.get("master_port") is not None}
    addrs = {r: v.get("master_addr") for r, v in rdv.items() if v.get("master_addr")}
    for fld, var, seen in (("master_port", "MASTER_PORT", ports), ("master_addr", "MASTER_ADDR", addrs)):
        odd = sorted(r for r, v in seen.items() if v != seen[0]) if 0 in seen else []
        if odd:  # rank 0 hosts the store: a rank that looked elsewhere is the culprit
            r = odd[0]
            return Finding("INIT", "joined", "fail", f"rank {r} looked for the rendezvous at {var}={seen[r]}, but rank 0 "
                           f"hosts it at {var}={seen[0]}: the ranks were launched with different {var} values",
                           [_status_ev(run, 0, f"rendezvous.{fld}"), _status_ev(run, r, f"rendezvous.{fld}")]
                           + (_error_ev(run, r) if records[r].get("error") else []),
                           Remedy([], f"start every rank with {var}={seen[0]} (the value rank 0 used)",
                                  env={var: str(seen[0])}), culprit=r)
    if not stuck:
        return Finding("INIT", "joined", "pass", f"all {len(records)} ranks joined the process group")
    for r in stuck:
        msg = str((records[r].get("error") or {}).get("message", ""))
        if _INIT_PORT_IN_USE.search(msg):
            return Finding("INIT", "joined", "fail", f"rank {r} could not host the rendezvous store: port "
                           f"{ports.get(r)} is already in use", _error_ev(run, r),
                           Remedy([], "start the ranks with a free MASTER_PORT"), culprit=r)
        if _INIT_RESOLVE.search(msg):
            return Finding("INIT", "joined", "fail", f"rank {r} cannot resolve the rendezvous address "
                           f"{addrs.get(r)!r}", _error_ev(run, r),
                           Remedy(["dist.master_addr=127.0.0.1"], "use an address every node can resolve"), culprit=r)
    never = [r for r in stuck if not records[r].get("error")]
    culprit = never[0] if never else stuck[0]
    return Finding("INIT", "joined", "fail", f"rank(s) {stuck} never joined the process group",
                   [_status_ev(run, r, "phase") for r in stuck] + (_error_ev(run, culprit) if records[culprit].get("error") else []),
                   culprit=culprit)


def init_ranks_ran(run: Run, probes: dict | None) -> Finding:
    """No rank died or raised an error of its own (the culprit by the earliest non-network error rule)."""
    culprit = _culprit(run)
    if culprit is None:
        return Finding("INIT", "ranks_ran", "pass" if run.statuses else "skipped",
                       "no rank failed" if run.statuses else "no status records")
    if culprit.rank is None:
        return Finding("INIT", "ranks_ran", "fail", f"the run is recorded as failed but no rank recorded why: "
                       f"{culprit.message[:300]}", [Evidence("launch.json", str((run.launch or {}).get("outcome")),
                                                             field="outcome")])
    s = run.statuses.get(culprit.rank) or {}
    err = s.get("error") or {}
    death = run.deaths().get(culprit.rank)
    # a rank blamed for stalling is a communication problem if it was alive: it recorded an error later (it woke up
    # to find its peers gone) or our own launcher stopped it; one that never recorded anything under an external
    # launcher died (or still hangs): see below
    if any(e.get("blames") == culprit.rank for e in _errors(run).values()) and \
            ((err and is_network_error(err)) or (not err and run.launch is not None)):
        return Finding("INIT", "ranks_ran", "pass", f"no rank died or raised an error of its own (rank {culprit.rank} "
                       "stalled while a peer waited: see COMM)")
    if err and not is_network_error(err) and err.get("blames") is None:
        if err.get("type") == "CoverageError":
            return Finding("INIT", "ranks_ran", "pass", f"rank {culprit.rank}'s coverage error is a shard problem (see SHARDS)")
        return Finding("INIT", "ranks_ran", "fail", f"rank {culprit.rank} raised {err.get('type')}: "
                       f"{str(err.get('message'))[:240]}", _error_ev(run, culprit.rank), culprit=culprit.rank)
    peers_timed_out = any(_STALL.search(str(e.get("message", ""))) for r, e in _errors(run).items() if r != culprit.rank)
    outside = bool(death) and not any(sig in death for sig in ("SIGKILL", "SIGSEGV", "SIGABRT", "SIGBUS", "exit"))
    if not err and peers_timed_out and (outside or (not death and run.launch is not None)):
        # its peers timed out waiting while it showed no error and our launcher saw no crash (it stopped the rank
        # itself, or by SIGTERM): slow or hung, which a longer timeout tells apart. Under an external launcher a
        # slow rank records an error once it wakes, so one that recorded nothing died (or still hangs).
        return Finding("INIT", "ranks_ran", "pass", f"no rank died or raised an error of its own (rank {culprit.rank} "
                       "stopped progressing while its peers timed out: see COMM)")
    if death and not err:
        ev = [Evidence("launch.json", death, field=f"error.deaths.{culprit.rank}"),
              _status_ev(run, culprit.rank, "phase"), _status_ev(run, culprit.rank, "samples_done")]
        drill = (run.launch or {}).get("faults") or ""
        if "SIGKILL" in death and "kill" in drill:
            remedy = Remedy([], f"the run was a fault drill (DISTEVAL_FAULTS={drill}): unset it", unset=["DISTEVAL_FAULTS"])
        elif "SIGKILL" in death:
            bs = int(run.cfg("data.batch_size", 0) or 0)
            remedy = Remedy([f"data.batch_size={max(1, bs // 2)}"] if bs > 1 else [],
                            "a SIGKILL that nobody sent by hand is most often the kernel's out-of-memory killer (dmesg "
                            "says so); if it was, a smaller batch needs less memory" if bs > 1 else
                            "rerun; check dmesg for the out-of-memory killer")
        else:
            remedy = Remedy([], "rerun unchanged: the rank was stopped from outside")
        return Finding("INIT", "ranks_ran", "fail", f"rank {culprit.rank} {death} without recording an error, in "
                       f"{recorded_progress(s)}", ev, remedy,
                       culprit=culprit.rank)
    if not err and s.get("phase") in ("init", "data", "forward"):
        return Finding("INIT", "ranks_ran", "fail", f"rank {culprit.rank} stopped without recording an error in "
                       f"{recorded_progress(s)}: its process died or hung (no launcher record says how), and its peers "
                       "failed waiting for it", [_status_ev(run, culprit.rank, "phase"),
                                                 _status_ev(run, culprit.rank, "t_update")]
                       + _error_ev(run, sorted(_errors(run))[0])[:1],
                       Remedy([], "rerun; if it happens again, look at that rank's host (dmesg, the scheduler's log)"),
                       culprit=culprit.rank)
    return Finding("INIT", "ranks_ran", "pass", f"no rank raised an error of its own (rank {culprit.rank}'s failure is "
                   "a communication problem, see COMM)")


def init_config_agree(run: Run, probes: dict | None) -> Finding:
    """Every rank ran the same resolved configuration (sha256 digest in its status record)."""
    digests = {r: s.get("config_digest") for r, s in run.statuses.items() if s and s.get("config_digest")}
    if len(digests) < 2:
        return Finding("INIT", "config_agree", "skipped", "fewer than two ranks recorded a config digest")
    ref = digests.get(0, next(iter(digests.values())))
    odd = sorted(r for r, d in digests.items() if d != ref)
    if odd:
        return Finding("INIT", "config_agree", "fail", f"rank(s) {odd} ran another configuration than rank 0 (different "
                       "overrides per rank)", [_status_ev(run, 0, "config_digest")] + [_status_ev(run, r, "config_digest")
                                                                                    for r in odd], culprit=odd[0])
    return Finding("INIT", "config_agree", "pass", f"all {len(digests)} ranks ran the same configuration")


# ---------------------------------------------------------------------------------------------- SHARDS
def shards_plan(run: Run, probes: dict | None) -> Finding:
    """Shard sizes from N, W, the batch size and the sampler; a padded or dropping sampler is a failure."""
    size = run.world_size
    n = (run.results or {}).get("dataset", {}).get("num_samples")
    sampler = (run.results or {}).get("sampler") or run.cfg("data.sampler", "exact")
    bs = run.cfg("data.batch_size")
    if n is None or not size:
        planned = [s.get("samples_planned") for s in run.statuses.values() if s]
        if sampler == "exact" and planned and all(p is not None for p in planned) and len(planned) == size:
            n = sum(planned)
        else:
            return Finding("SHARDS", "plan", "skipped", "the dataset length is unknown (no results.json and not every "
                           "rank recorded its shard)")
    if sampler in ("padded", "drop_last"):
        per = math.ceil(n / size) if sampler == "padded" else n // size
        delta = per * size - n
        # DistributedSampler pads the index list with its first items and deals it out round-robin, so the
        # repeats land on ranks N % W .. W-1; drop_last cuts the last N % W positions
        first = n % size if delta else None
        if not delta:
            what = f"gives every rank {per} samples without repeats or drops here"
        elif sampler == "padded":
            what = f"repeats {delta} sample(s) so that every rank has {per} (ranks {first}..{size - 1} count one twice)"
        else:
            what = f"drops {-delta} sample(s) so that every rank has {per}"
        return Finding("SHARDS", "plan", "fail" if delta else "warn",
                       f"data.sampler={sampler} (torch's DistributedSampler) {what}: N={n}, W={size}"
                       + ("" if delta else " (N is a multiple of W here, but not in general)"),
                       [Evidence(".hydra/config.yaml", sampler, field="data.sampler")],
                       Remedy(["data.sampler=exact"], "exact unpadded shards count every sample once"),
                       culprit=first if sampler == "padded" else None)
    aligned = run.cfg("eval.mode", "bitwise") == "bitwise" and bs  # whole global batches per rank (v2 default)
    sizes = [batch_aligned_bounds(n, bs, size, r) if aligned else shard_bounds(n, size, r) for r in range(size)]
    sizes = [e - s for s, e in sizes]
    ev = [Evidence("results.json" if run.results else "ranks/*/status.json", str(n), field="dataset.num_samples")]
    bad = [r for r, s in run.statuses.items() if s and s.get("samples_planned") not in (None, sizes[r] if r < size else None)]
    if bad:
        r = bad[0]
        return Finding("SHARDS", "plan", "fail", f"rank {r} planned {run.statuses[r]['samples_planned']} samples but its "
                       f"exact shard of N={n}, W={size}{', batch ' + str(bs) if aligned else ''} holds {sizes[r]}: "
                       "the ranks disagree on the dataset",
                       ev + [_status_ev(run, r, "samples_planned")], culprit=r)
    batches = [math.ceil(s / bs) if bs else None for s in sizes]
    text = (f"{'batch-aligned ' if aligned else ''}exact shards of N={n} over W={size}: "
            f"{min(sizes)}..{max(sizes)} samples")
    if bs:
        text += f", {min(batches)}..{max(batches)} batches of {bs}"
    empty = [r for r, s in enumerate(sizes) if s == 0]
    if empty:
        return Finding("SHARDS", "plan", "warn", text + f"; rank(s) {empty[:8]} hold no sample (W > N)", ev,
                       Remedy([f"dist.world_size={max(1, n)}"], "no more ranks than samples"))
    return Finding("SHARDS", "plan", "pass", text, ev)


def shards_coverage(run: Run, probes: dict | None) -> Finding:
    """Every sample id counted exactly once (results.json coverage, or a rank's CoverageError)."""
    cov = (run.results or {}).get("coverage")
    errs = {r: e for r, e in _errors(run).items() if e.get("type") == "CoverageError"}
    sampler = (run.results or {}).get("sampler") or run.cfg("data.sampler", "exact")
    remedy = Remedy(["data.sampler=exact"], "exact unpadded shards count every sample once") if sampler != "exact" else None
    if errs:
        r = sorted(errs)[0]
        return Finding("SHARDS", "coverage", "fail", f"coverage check failed on rank {r}: {errs[r]['message'][:240]}",
                       _error_ev(run, r), remedy, culprit=None)
    if cov is None:
        return Finding("SHARDS", "coverage", "skipped", "no results.json (the run did not reach the coverage check)")
    ev = [Evidence("results.json", f"missing={cov.get('missing')} duplicated={cov.get('duplicated')} "
                   f"out_of_range={cov.get('out_of_range')}", field="coverage")]
    if not cov.get("ok", True):
        return Finding("SHARDS", "coverage", "fail", f"{cov.get('duplicated')} sample id(s) counted twice and "
                       f"{cov.get('missing')} missing of N={cov.get('num_samples')}: the metrics are biased", ev, remedy)
    return Finding("SHARDS", "coverage", "pass", f"every one of the {cov.get('num_samples')} sample ids counted once", ev)


# ----------------------------------------------------------------------------------------- CONVERGENCE
def convergence_trials(run: Run, probes: dict | None) -> Finding:
    """Repeated trials (eval.trials) agree bit for bit."""
    trials = (run.results or {}).get("trials")
    if not trials:
        k = run.cfg("eval.trials", 1)
        return Finding("CONVERGENCE", "trials", "skipped", f"eval.trials={k}: no repeated trials to compare"
                       + ("" if run.results else " (no results.json)"))
    if trials["agree"]:
        return Finding("CONVERGENCE", "trials", "pass", f"all {trials['k']} trials are identical",
                       [Evidence("results.json", "true", field="trials.agree")])
    name = "top1" if "top1" in trials["disagreeing"] else trials["disagreeing"][0]
    st = trials["stats"][name]
    ev = [Evidence("results.json", str([round(v, 6) for v in trials["values"][name]]), field=f"trials.values.{name}"),
          Evidence("results.json", f"{st['spread']:.3g}", field=f"trials.stats.{name}.spread")]
    deterministic = bool(((run.results or {}).get("precision") or {}).get("deterministic",
                                                                          run.cfg("precision.deterministic", False)))
    device = str((run.results or {}).get("device", ""))
    finding = (f"{trials['k']} trials disagree on {len(trials['disagreeing'])} metric(s): {name} spans "
               f"{min(trials['values'][name]):.4f}..{max(trials['values'][name]):.4f} (std {st['std']:.2g}); the "
               f"reported value is their {trials['aggregate']}")
    if not deterministic and "cuda" in device:
        return Finding("CONVERGENCE", "trials", "fail", finding,
                       ev + [Evidence(".hydra/config.yaml", "false", field="precision.deterministic")],
                       Remedy(["precision.deterministic=true"], "deterministic algorithms, cuDNN benchmark and TF32 off"))
    why = "deterministic algorithms were on" if deterministic else f"the forward on {device or 'this device'} is " \
        "deterministic without precision.deterministic"
    return Finding("CONVERGENCE", "trials", "fail", finding + f"; {why}, so the model or the data pipeline draws random "
                   "numbers (dropout left in train mode, random augmentation, unseeded noise): fix the model; meanwhile "
                   "more trials narrow the robust estimate", ev)


def convergence_flags(run: Run, probes: dict | None) -> Finding:
    """Settings that make results vary between runs: TF32, cuDNN benchmark, deterministic algorithms off."""
    prec = (run.results or {}).get("precision") or {}
    device = str((run.results or {}).get("device") or run.cfg("dist.device", "auto"))
    if device == "auto":
        return Finding("CONVERGENCE", "flags", "skipped", "the device is not recorded (no results.json, dist.device=auto)")
    flags = []
    if prec.get("tf32", run.cfg("precision.tf32", False)):
        flags.append("precision.tf32=true")
    if prec.get("cudnn_benchmark"):
        flags.append("cudnn.benchmark on")
    if not prec.get("deterministic", run.cfg("precision.deterministic", False)):
        flags.append("precision.deterministic=false")
    ev = [Evidence("results.json" if prec else ".hydra/config.yaml", ", ".join(flags) or "none", field="precision")]
    if "cuda" in device and flags:
        return Finding("CONVERGENCE", "flags", "warn", f"on {device}: {', '.join(flags)} can change results between runs",
                       ev, Remedy(["precision.deterministic=true", "precision.tf32=false"], "bitwise reproducible forward"))
    return Finding("CONVERGENCE", "flags", "pass", "no nondeterminism flag matters on " + (device or "this device")
                   + (f" ({', '.join(flags)})" if flags else ""), ev)


def convergence_reference(run: Run, probes: dict | None) -> Finding:
    """The metrics equal those of a reference run bit for bit (``doctor --reference RUN``, ``diagnostics.compare``);
    if not, the first differing metric, where the forward differs and the settings that differ."""
    ref = run.derived.get("reference")
    if ref is None:
        return Finding("CONVERGENCE", "reference", "skipped", "no reference run (--reference RUN compares the metrics "
                       "and per-sample outputs with one)")
    if not run.results:
        return Finding("CONVERGENCE", "reference", "skipped", f"no results.json to compare with the reference {ref}")
    cmp = compare_runs(run.path, ref)
    fwd = cmp["forward"]
    if cmp["identical"]:
        return Finding("CONVERGENCE", "reference", "pass", f"metrics identical to the reference {ref} "
                       f"({cmp['metrics_compared']} values); forward: {fwd['note']}",
                       [Evidence(f"{ref}/results.json", "identical", field="metrics")])
    m = cmp["first_metric"]
    ev = [Evidence("results.json", repr(m["a"]), field=f"metrics.{m['key']}"),
          Evidence(f"{ref}/results.json", repr(m["b"]), field=f"metrics.{m['key']}")]
    if fwd["identical"] is False:
        ev.append(Evidence(f"ranks/rank{fwd['first_batch_rank']}/batches.json", f"{fwd['count']} sample(s) differ, "
                           f"first {fwd['sample_ids']}", field="digests"))
    differ = {s["setting"]: s for s in cmp["settings_differ"]}
    remedy = None
    if cmp["reduction"] and differ.get("mode", {}).get("b") == "bitwise":  # only the reduction differs: fast mode
        threads = differ.get("compute.threads", {}).get("b")
        remedy = Remedy(["eval.mode=bitwise"] + ([f"dist.threads={threads}"] if threads else []), "the reference's "
                        "mode (and threads): bitwise mode reproduces its metrics at any world size")
    elif "dataset.batch_size" in differ:  # another batch composition: the forward may legitimately differ
        remedy = Remedy([f"data.batch_size={differ['dataset.batch_size']['b']}"], "the reference's batch size: "
                        "each sample is then forwarded in the same batch as in the reference")
    culprit = fwd["ranks"][0] if len(fwd["ranks"]) == 1 and (run.world_size or 1) > 1 else None
    return Finding("CONVERGENCE", "reference", "fail", f"the metrics differ from the reference {ref} (A = this run, "
                   f"B = the reference): {summary(cmp)}", ev, remedy, culprit)


# ------------------------------------------------------------------------------------------------ COMM
def comm_timeout(run: Run, probes: dict | None) -> Finding:
    """A rank stalled or a collective timed out: the culprit, where it stopped, and a timeout that fits."""
    culprit = _culprit(run)
    errs = _errors(run)
    # only ranks that joined the process group: a rendezvous that timed out is an INIT problem
    timed = {r: e for r, e in errs.items() if _STALL.search(str(e.get("message", "")))
             and (run.statuses.get(r) or {}).get("joined")}
    cerr = ((run.statuses.get(culprit.rank) or {}).get("error") if culprit and culprit.rank is not None else None)
    if culprit is not None and not timed and cerr and is_network_error(cerr) \
            and (run.statuses.get(culprit.rank) or {}).get("joined"):
        return Finding("COMM", "timeout", "fail", f"rank {culprit.rank} failed with a network error and no rank recorded "
                       "an error of its own: a connection or a peer process went away", _error_ev(run, culprit.rank),
                       Remedy([], "rerun; if it repeats, probe the ranks (--probe) and check the network between hosts"),
                       culprit=culprit.rank)
    if culprit is None or not timed:
        return Finding("COMM", "timeout", "pass" if run.statuses else "skipped",
                       "no collective timed out and no rank stalled" if run.statuses else "no status records")
    r0 = sorted(timed)[0]
    r = culprit.rank if culprit.rank is not None else r0
    s = run.statuses.get(r) or {}
    timeout = float(run.cfg("communication.timeout_s", (s.get("rendezvous") or {}).get("timeout_s", 300.0)) or 300.0)
    phase = s.get("phase")
    ev = _error_ev(run, r0)[:1] + [_status_ev(run, r, "phase"), _status_ev(run, r, "samples_done"),
                                   _status_ev(run, r, "last_collective")]
    suggested = max(4 * timeout, 60.0)
    why = f"rank {r} was alive but slower than the {timeout:g} s timeout; allow {suggested:g} s"
    if probes and probes.get("latency", {}).get("suggested_timeout_s"):
        suggested = max(suggested, float(probes["latency"]["suggested_timeout_s"]))
        why += f" (the latency probe suggests at least {probes['latency']['suggested_timeout_s']:g} s)"
    overrides = [f"communication.timeout_s={suggested:g}"]
    last = s.get("last_collective") or {}
    compressible = "ranking" in (run.cfg("eval.metrics", []) or [])
    if phase == "sync" and int(last.get("bytes") or 0) > 64 * 1024 * 1024 and compressible \
            and run.cfg("communication.compression", "none") == "none":
        overrides.append("communication.compression=fp16")
        why += "; fp16 halves the gathered scores"
    return Finding("COMM", "timeout", "fail", f"rank {r} stopped making progress ({recorded_progress(s)}) and its "
                   "peers timed out after "
                   f"{timeout:g} s (communication.timeout_s)", ev, Remedy(overrides, why), culprit=r)


def comm_mismatch(run: Run, probes: dict | None) -> Finding:
    """Ranks that issued different collectives (gloo/nccl report a mismatch)."""
    hits = {r: e for r, e in _errors(run).items() if _MISMATCH.search(str(e.get("message", "")))}
    if not hits:
        return Finding("COMM", "mismatch", "pass" if run.statuses else "skipped", "no mismatched collectives reported")
    r = sorted(hits)[0]
    return Finding("COMM", "mismatch", "fail", f"rank {r} reported mismatched collectives", _error_ev(run, r),
                   Remedy([], "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to name both calls (diagnostic reruns only: ~10x "
                          "latency on small collectives)", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}), culprit=r)


def comm_stragglers(run: Run, probes: dict | None) -> Finding:
    """Spread of per-rank forward throughput (images/s): a rank at under half the median is a straggler. From
    results.json, or for a run that did not finish from the status records' progress (samples_done over the
    seconds since the rank joined)."""
    per = (run.results or {}).get("per_rank") or []
    rates = {p["rank"]: p.get("images_per_s") for p in per if p.get("images_per_s") and p.get("samples", 0) >= 32}
    if not per:
        return _progress_stragglers(run)
    if len(rates) < 2:
        return Finding("COMM", "stragglers", "skipped", "fewer than two ranks with a measured throughput")
    med = statistics.median(rates.values())
    slow = {r: v for r, v in rates.items() if v < 0.5 * med}
    ev = [Evidence("results.json", f"{v:,.0f} images/s", field=f"per_rank[{r}].images_per_s") for r, v in rates.items()]
    slow = {r: v for r, v in slow.items()
            if (per[[p["rank"] for p in per].index(r)].get("seconds") or {}).get("forward", 0.0) >= 1.0}
    if slow:  # a rank that took under a second is no one's bottleneck, whatever its rate
        r = min(slow, key=slow.get)
        host = next((p.get("host") for p in per if p["rank"] == r), None)
        return Finding("COMM", "stragglers", "warn", f"rank {r} on {host} ran at {slow[r]:,.0f} images/s, under half "
                       f"the median {med:,.0f}: the run waits for it", ev, culprit=r)
    return Finding("COMM", "stragglers", "pass", f"per-rank throughput within 2x of the median {med:,.0f} images/s")


def _progress_stragglers(run: Run) -> Finding:
    rates, ev = {}, []
    for r, s in run.statuses.items():
        if s and s.get("joined") and s.get("samples_planned"):
            elapsed = float(s.get("t_update") or 0) - float(s["joined"])
            if elapsed >= 1.0:
                rates[r] = float(s.get("samples_done") or 0) / elapsed
                ev.append(Evidence(f"ranks/rank{r}/status.json", f"{s.get('samples_done')} samples in {elapsed:.1f} s",
                                   field="samples_done"))
    if len(rates) < 2:
        return Finding("COMM", "stragglers", "skipped", "fewer than two ranks with recorded progress")
    med = statistics.median(rates.values())
    slow = {r: v for r, v in rates.items() if v < 0.5 * med}
    if slow:
        r = min(slow, key=slow.get)
        return Finding("COMM", "stragglers", "warn", f"rank {r} progressed at {slow[r]:,.1f} samples/s, under half the "
                       f"median {med:,.1f} (from the status records)", ev, culprit=r)
    return Finding("COMM", "stragglers", "pass", f"recorded progress within 2x of the median {med:,.1f} samples/s", ev)


# ---------------------------------------------------------------------------------------------- RESULT
def result_outliers(run: Run, probes: dict | None) -> Finding:
    """Per-rank local top-1 accuracies tested by modified z-score (``disteval.metrics.robust.rank_outliers``)."""
    per = (run.results or {}).get("per_rank") or []
    acc = [p.get("metrics", {}).get("accuracy") for p in per]
    if not per or all(a is None for a in acc):
        return Finding("RESULT", "outliers", "skipped", "no per-rank accuracies (no results.json, or detection metrics)")
    threshold = float(run.cfg("eval.outlier_z", OUTLIER_Z) or OUTLIER_Z)
    out = rank_outliers(acc, [p.get("samples", 0) for p in per], threshold)
    if out["skipped"]:
        return Finding("RESULT", "outliers", "skipped", out["skipped"])
    ev = [Evidence("results.json", f"{a:.4f} (z {z:+.1f})", field=f"per_rank[{p['rank']}].metrics.accuracy")
          for p, a, z in zip(per, acc, out["z"]) if a is not None and z is not None]
    if not out["outliers"]:
        return Finding("RESULT", "outliers", "pass", f"no outlier rank (all |z| <= {threshold:g}, median "
                       f"{out['median']:.4f})", ev)
    desc = ", ".join(f"rank {r} on {per[r].get('host')} (accuracy {acc[r]:.4f}, z {out['z'][r]:+.1f})"
                     for r in out["outliers"])
    if out["high"] or not out["excludable"]:
        side = "above" if out["high"] else "below"
        return Finding("RESULT", "outliers", "fail", f"outlier {desc} {side} the median {out['median']:.4f}: the ranks "
                       "split into groups that disagree, so most ranks may be the broken ones (other weights, data or "
                       "hardware); no rank is excluded automatically: compare the ranks' checkpoints and inputs (--probe "
                       "compares their logits on one batch)", ev, culprit=None if out["high"] else out["low"][0])
    excluded = (run.results or {}).get("exclusion")
    if excluded:
        return Finding("RESULT", "outliers", "warn", f"outlier {desc}; excluded as asked: the metrics leave out "
                       f"{excluded['samples_left_out']} samples of rank(s) {excluded['ranks']}, which still need fixing",
                       ev, culprit=out["low"][0])
    left = sum(per[r].get("samples", 0) for r in out["excludable"])
    return Finding("RESULT", "outliers", "fail", f"outlier {desc} against median {out['median']:.4f}: a rank with other "
                   "weights, data or hardware", ev,
                   Remedy(["eval.exclude_outlier_ranks=true"], f"report metrics without the outlier rank(s), stating the "
                          f"{left} samples left out (then fix that rank: its checkpoint file, data or device)"),
                   culprit=out["low"][0])


def _no_results(run: Run) -> Finding:
    """Without results.json a run is healthy only while it is still running."""
    records = {r: s for r, s in run.statuses.items() if s}
    if (run.launch or {}).get("outcome") == "config_error" or (not records and run.launch is None):
        return Finding("RESULT", "sanity", "skipped", "no results.json (no rank ran)")
    phases = ", ".join(f"rank {r}: {s.get('phase')}" for r, s in sorted(records.items())) or "no status records"
    ev = [Evidence("results.json", "missing or unreadable")]
    if run.failed:
        return Finding("RESULT", "sanity", "fail", f"the run failed before writing results.json ({phases})", ev)
    newest = max((float(s.get("t_update") or 0) for s in records.values()), default=0.0)
    if records and all(s.get("phase") != "done" for s in records.values()) and time.time() - newest < 60:
        return Finding("RESULT", "sanity", "warn", f"no results.json yet: the ranks updated their records "
                       f"{time.time() - newest:.0f} s ago, the run may still be running ({phases})", ev)
    return Finding("RESULT", "sanity", "fail", f"no results.json although no rank recorded a failure: the run was killed "
                   f"or hangs, or the file was removed ({phases})", ev)


def result_sanity(run: Run, probes: dict | None) -> Finding:
    """Values that cannot be right: non-finite or out-of-range metrics, a count that is not N, chance level."""
    res = run.results
    if not res:
        return _no_results(run)
    m = res.get("metrics") or {}
    problems = []
    for k in ("top1", "top5", "accuracy", "auroc_macro", "ap_macro", "AP", "AP50"):
        v = m.get(k)
        if k in m and (v is None or not 0.0 <= float(v) <= 1.0) and not (k.startswith("AP") and v == -1):
            problems.append(f"{k}={v} is not in [0, 1]")
    n = res.get("dataset", {}).get("num_samples")
    left_out = int((res.get("exclusion") or {}).get("samples_left_out") or 0)
    if n is not None and m.get("num_samples") not in (None, n - left_out):
        problems.append(f"metrics.num_samples={m.get('num_samples')} but the dataset has {n}"
                        + (f" and {left_out} were excluded" if left_out else ""))
    if not res.get("exact", True):
        problems.append(f"the run is marked inexact (data.sampler={res.get('sampler')})")
    if not any(k in m for k in ("top1", "AP", "auroc_macro", "accuracy")):
        problems.append("metrics holds no main metric (top1, AP or auroc_macro)")
    counted = sum(int(p.get("samples") or 0) for p in res.get("per_rank") or [])
    if res.get("exact", True) and (res.get("sampler") or "exact") == "exact" and n is not None and counted != n:
        problems.append(f"the ranks counted {counted} samples (per_rank[].samples) but the dataset has {n}")
    ev = [Evidence("results.json", str(m.get(k)), field=f"metrics.{k}") for k in ("top1", "AP", "auroc_macro") if k in m]
    if problems:
        return Finding("RESULT", "sanity", "fail", "; ".join(problems), ev)
    c = res.get("dataset", {}).get("num_classes") or 0
    if m.get("top1") is not None and c > 1 and float(m["top1"]) <= 1.5 / c:
        return Finding("RESULT", "sanity", "warn", f"top-1 {m['top1']:.4f} is at chance level for {c} classes: wrong "
                       "weights, a label mapping that does not match the model, or the wrong transform", ev)
    return Finding("RESULT", "sanity", "pass", "metric values are finite and in range, and count every sample"
                   + (f" but the {left_out} excluded with the outlier ranks" if left_out else ""), ev)


CHECKS: dict[str, list[Callable[[Run, dict | None], Finding]]] = {
    "INIT": [init_launch, init_scheduler, init_started, init_joined, init_config_agree, init_ranks_ran],
    "SHARDS": [shards_plan, shards_coverage],
    "CONVERGENCE": [convergence_trials, convergence_flags, convergence_reference],
    "COMM": [comm_timeout, comm_mismatch, comm_stragglers],
    "RESULT": [result_outliers, result_sanity],
}
