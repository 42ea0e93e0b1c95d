"""INIT: did the driver launch the ranks, did every rank start, join the process group and run without an
error of its own, and does the driver (or, under an external launcher, each rank) still live?

Every verdict here rests on a record (launch.json, job.json, .hydra/, a status.json field or traceback frame,
or this machine's /proc for a recorded pid) and names the phase it happened in (``diagnostics.phases``): an
error raised while the model or dataset was built is a data/model problem even when its message speaks of
names and addresses; only one raised inside the process-group start is a rendezvous failure. Where the
records do not decide, the finding says ``unknown`` and lists what they hold.
"""
from __future__ import annotations

import re
import time

from omegaconf import OmegaConf

from disteval.faults import parse as parse_faults
from disteval.common.liveness import DRIVER_HEARTBEAT_S
from disteval.job.records import is_network_error, recorded_progress
from launchers.culprit import CONSEQUENCE_TYPES, is_consequence
from launchers.protocol import SchedulerNote
from launchers.registry import launcher_for, launcher_of_job

from diagnostics.evidence import Evidence, Run
from diagnostics.findings import (Finding, culprit as _culprit, disk_full, error_ev, errors, interrupted,
                                  status_ev, what_was_found)
from diagnostics.liveness import ProcessView, almost_full, disk_free, examine, heartbeat
from diagnostics.phases import describe, fetch_failure, rank_phase, url_in, weights_url
from diagnostics.remedies import Remedy, launcher_choice

STALL = re.compile(r"stalled|never wrote a status record|timed out|timeout|deadline", re.I)
_PORT_IN_USE = re.compile(r"EADDRINUSE|address already in use|already in use", re.I)
_RESOLVE = re.compile(r"gaierror|Name or service not known|Temporary failure in name resolution|"
                      r"nodename nor servname|cannot resolve|unknown host", re.I)
_FETCH_REASON = re.compile(r"Name or service not known|Temporary failure in name resolution|nodename nor servname[^)>]*|"
                           r"HTTP Error \d{3}[^)>]*|Network is unreachable|No route to host|Connection refused|"
                           r"timed out", re.I)


# a dead process's kernel closes its sockets (a peer reads EOF or a reset); a node cut off from the network says nothing
_PEER_CLOSED = re.compile(r"Connection (closed|reset) by peer|ECONNRESET|Broken pipe", re.I)


def _port_ok(port, allow_zero: bool = True) -> bool:
    return isinstance(port, int) and not isinstance(port, bool) and (0 if allow_zero else 1) <= port <= 65535


# ------------------------------------------------------------------------------------------- shared
def disk_full_finding(run: Run, err: dict, source: str, culprit: int | None, phase: str | None) -> Finding:
    """A recorded full disk (ENOSPC / EDQUOT): the file, the bytes it needed, the free space; no automatic
    rerun (``--apply`` would write into the same filesystem, under RUN_DIR/doctor/)."""
    prefix = "error." if source == "launch.json" or source.startswith("ranks/") else ""
    ev = [Evidence(source, f"{err.get('type')}: {str(err.get('message'))[:200]}", field=f"{prefix}message")]
    for key in ("errno", "path", "bytes_needed", "free_bytes"):
        if err.get(key) is not None:
            ev.append(Evidence(source, str(err[key]), field=f"{prefix}{key}"))
    need = f"{int(err['bytes_needed']):,} bytes" if isinstance(err.get("bytes_needed"), int) else "an unknown size"
    free = f"; {int(err['free_bytes']):,} bytes were free" if isinstance(err.get("free_bytes"), int) else ""
    drill = drill_remedy(run, culprit, ("diskfull",))
    return Finding("INIT", "launch" if source == "launch.json" else "ranks_ran", "fail",
                   f"the disk is full ({err.get('errno') or 'ENOSPC'}): writing {err.get('path') or 'a record'} needed "
                   f"{need}{free}" + (f" (rank {culprit})" if culprit is not None else "")
                   + (" - injected by a fault drill (launch.json faults), not a real full disk" if drill else ""), ev,
                   drill or
                   Remedy([], "free space on that filesystem, or rerun with hydra.run.dir on another one; an automatic "
                          "rerun would write into the same full disk", changes_cause=False),
                   culprit=culprit, phase=phase)


def fetch_finding(run: Run, err: dict, where: str, phase: str | None, ev: list[Evidence],
                  culprit: int | None = None) -> Finding:
    """A download that failed (offline, DNS, HTTP): name the URL and host (from the message or traceback, else
    torchvision's table for the configured weights). A model/data problem, not a rendezvous one."""
    url, host = url_in(err.get("message"), err.get("traceback"))
    if url is None:
        url = weights_url(run.cfg("model.name"), run.cfg("model.weights"))
        url, host = url_in(url)
        if url:
            ev = ev + [Evidence(".hydra/config.yaml", f"{run.cfg('model.name')} {run.cfg('model.weights')}: {url}",
                                field="model.weights")]
    reason = _FETCH_REASON.search(f"{err.get('message')} {err.get('traceback', '')}")
    what = f"{url} (host {host})" if url else "a file from the network (no URL is recorded)"
    finding = (f"{where} could not download {what} {describe(phase)}"
               + (f": {reason.group(0)}" if reason else f": {err.get('type')}") + "; this machine cannot reach it "
               "(offline, DNS or a proxy). A model/data problem: the rendezvous was not involved")
    return Finding("INIT", "launch" if phase == "preflight" else "ranks_ran", "fail", finding, ev,
                   Remedy([], f"provide the file locally: model.checkpoint=PATH to a copy of {url or 'the weights'} "
                          "(or put it into $TORCH_HOME/hub/checkpoints), or model.weights=null to evaluate random "
                          "weights (another evaluation); a rerun as it is downloads again and fails the same way",
                          changes_cause=False), culprit=culprit, phase=phase)


def driver_view(run: Run) -> ProcessView:
    """Whether the driver of a run whose launch.json says "running" lives (computed once per run): its pid on
    this machine, its heartbeat, the ranks' heartbeats and any rank's DriverDiedError."""
    if "driver" in run.derived:
        return run.derived["driver"]
    view = examine(run.launch or {}, "launch.json", DRIVER_HEARTBEAT_S)
    died = {r: e for r, e in errors(run).items() if e.get("type") in CONSEQUENCE_TYPES}
    fresh = []
    for r, s in sorted(run.statuses.items()):
        if s and s.get("phase") not in ("done", "failed"):
            age, is_fresh, ev = heartbeat(s, f"ranks/rank{r}/status.json", time.time(), 1.0)
            view.evidence += ev
            if is_fresh:
                fresh.append(f"rank {r}'s heartbeat is {age:.0f} s old")
    if died:
        r = min(died)
        view = ProcessView("dead", f"rank {r} recorded that its launcher died ({died[r].get('type')}); {view.why}",
                           view.evidence + [Evidence(f"ranks/rank{r}/status.json",
                                                     f"{died[r].get('type')}: {str(died[r].get('message'))[:200]}",
                                                     field="error.message")], view.heartbeat_age, view.fresh)
    elif view.state == "dead" and (view.fresh or fresh):
        hints = (["launch.json's heartbeat is fresh"] if view.fresh else []) + fresh
        view = ProcessView("undecided", f"{view.why}, but {', '.join(hints)}: it may have died moments ago (run the "
                           "doctor again in a few seconds) or its pid is not visible from here", view.evidence,
                           view.heartbeat_age, view.fresh)
    run.derived["driver"] = view
    return view


def _hydra_launcher(run: Run) -> tuple[str, str]:
    if run.hydra is None:
        return "", ""
    choices = OmegaConf.select(run.hydra, "hydra.runtime.choices", default=None)
    launcher = str((OmegaConf.to_container(choices) if choices is not None else {}).get("hydra/launcher") or "")
    return launcher, str(OmegaConf.select(run.hydra, "hydra.mode", default="") or "")


# ------------------------------------------------------------------------------------------- launch
def init_launch(run: Run, probes: dict | None) -> Finding:
    """The driver's record: a configuration error before any rank started (its key decides what it is), a
    full disk, an interrupted run, a driver that died without recording an outcome, or one that failed before
    any rank wrote a record."""
    launch = run.launch
    if launch is None:
        return _no_launch_record(run)
    err = launch.get("error") or {}
    ev = [Evidence("launch.json", str(launch.get("outcome")), field="outcome")]
    if disk_full(err):
        rank = err.get("rank") if isinstance(err.get("rank"), int) else None
        phase = "preflight" if launch.get("outcome") == "config_error" else "launch" if not any(run.statuses.values()) \
            else (rank_phase(run.statuses.get(rank), rank)[0] if rank is not None else None) or "running"
        return disk_full_finding(run, err, "launch.json", rank, phase)
    if launch.get("outcome") == "config_error":
        return _config_error(run, launch, ev)
    if interrupted(run):
        return Finding("INIT", "launch", "fail", "the run was interrupted from outside (Ctrl-C, SIGTERM, or the driver "
                       "was killed): every rank was stopped; no rank is to blame", ev + [
                           Evidence(f"ranks/rank{r}/status.json", e.get("type"), field="error.type")
                           for r, e in sorted(errors(run).items())][:4],
                       Remedy([], "rerun: the interrupt came from outside the run"), phase="running")
    if launch.get("outcome") == "running":
        return _driver_running(run, ev)
    if err.get("type") == "RendezvousError":
        return _rendezvous_failed(run, err, ev)
    if launch.get("outcome") == "failed" and not any(run.statuses.values()):
        return _driver_failed_first(launch, ev)
    if launch.get("outcome") == "failed":
        return Finding("INIT", "launch", "pass", f"the driver launched {run.world_size} rank(s); the run failed: "
                       f"{_clip(str(err.get('message')), 200)} (the checks below say why)", ev)
    return Finding("INIT", "launch", "pass", f"the driver launched {run.world_size} rank(s)", ev)


def _clip(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters at a word, with an ellipsis when cut."""
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


def _node_saw(err: dict) -> str:
    endpoint = err.get("endpoint")
    return {"timeout": f"waited {float(err.get('seconds') or 0):.0f} s at {endpoint} for {err.get('nnodes')} nodes "
                       "and the other node(s) never joined",
            "unreachable": f"could not reach the rendezvous store at {endpoint} ({err.get('cause')})",
            "closed": f"saw the rendezvous at {endpoint} closed by another node"}.get(err.get("reason"),
                                                                                 str(err.get("message")))


def _rendezvous_failed(run: Run, err: dict, ev: list[Evidence]) -> Finding:
    """A multi-node launch whose nodes never met (``disteval.errors.RendezvousError`` in launch.json): what
    each node saw (this directory's launch.json and the other nodes' ``nodes/<host>/launch.json`` where a
    shared folder holds them), and which node never joined. Nothing in the config changes it: ``--apply``
    does not rerun."""
    node, endpoint = err.get("node"), err.get("endpoint")
    ev = ev + [Evidence("launch.json", str(v), field=f"error.{k}") for k, v in
               (("node", node), ("endpoint", endpoint), ("reason", err.get("reason")), ("cause", err.get("cause")))
               if v]
    sides = [f"node {node} {_node_saw(err)}"]
    never = []
    for host, rec in sorted(run.node_launches.items()):
        other = rec.get("error") or {}
        src = f"nodes/{host}/launch.json"
        if other.get("type") == "RendezvousError":
            sides.append(f"node {host} {_node_saw(other)}")
            ev.append(Evidence(src, str(other.get("cause") or other.get("reason")), field="error.cause"))
            if other.get("reason") == "unreachable":
                never.append(host)
        else:
            sides.append(f"node {host}: {rec.get('outcome')} ({str(other.get('message'))[:120]})" if other else
                         f"node {host}: {rec.get('outcome')}")
            ev.append(Evidence(src, str(rec.get("outcome")), field="outcome"))
    who = f"node(s) {', '.join(never)} never reached the rendezvous; " if never else ""
    return Finding("INIT", "launch", "fail", f"not all nodes started: {who}{'; '.join(sides)}", ev,
                   Remedy([], f"check the network connection between the nodes: can every node reach {endpoint} "
                          "(routes, firewall on the port)? does every node run the same command (dist.nnodes, "
                          "dist.rdzv_endpoint)? then restart the job on every node", changes_cause=False),
                   phase="rendezvous")


def _no_launch_record(run: Run) -> Finding:
    if interrupted(run):
        return Finding("INIT", "launch", "fail", "the ranks were interrupted from outside (Ctrl-C or SIGTERM): no rank "
                       "is to blame", [Evidence(f"ranks/rank{r}/status.json", e.get("type"), field="error.type")
                                       for r, e in sorted(errors(run).items())][:4],
                       Remedy([], "rerun: the interrupt came from outside the run"), phase="running")
    launcher, mode = _hydra_launcher(run)
    if launcher_for(launcher).hands_over_run_mode and mode == "RUN" and not any(run.statuses.values()) and run.job is None:
        return Finding("INIT", "launch", "fail", f"hydra/launcher={launcher} was chosen without -m (hydra.mode=RUN): "
                       f"the {launcher} launcher submits jobs only in multirun mode, so python -m disteval refused the job "
                       "before any rank started or anything was submitted",
                       [Evidence(".hydra/hydra.yaml", launcher, field="hydra.runtime.choices.hydra/launcher"),
                        Evidence(".hydra/hydra.yaml", mode, field="hydra.mode"), Evidence("launch.json", "missing")],
                       Remedy([], f"add -m: python -m disteval -m hydra/launcher={launcher} ...; a rerun without -m is "
                              "refused the same way", changes_cause=False), phase="preflight")
    return Finding("INIT", "launch", "skipped", "no launch.json: the ranks were started by an external launcher "
                   "(torchrun, srun) or by an older disteval")


def _config_error(run: Run, launch: dict, ev: list[Evidence]) -> Finding:
    """A configuration error found by the driver before any rank started: ``error.key`` says which setting."""
    err = launch.get("error") or {}
    key, message = err.get("key"), str(err.get("message"))
    ev = ev + [Evidence("launch.json", message[:300], field="error.message")] + \
        ([Evidence("launch.json", str(key), field="error.key")] if key else [])
    port, addr = launch.get("master_port"), launch.get("master_addr")
    if key == "dist.master_port" and not _port_ok(port):
        return Finding("INIT", "launch", "fail", f"dist.master_port={port} is not a TCP port (1..65535, or 0 to pick "
                       "a free one): refused before any rank started", ev + [Evidence("launch.json", str(port),
                                                                                      field="master_port")],
                       Remedy(["dist.master_port=0"], "let the rendezvous pick a free port"), phase="preflight")
    if key == "dist.master_port" and _PORT_IN_USE.search(message):
        return Finding("INIT", "launch", "fail", f"port {port} on {addr} is already in use by another program, so the "
                       "rendezvous could not be hosted; no rank started", ev,
                       Remedy(["dist.master_port=0"], "let the rendezvous pick a free port"), phase="preflight")
    if key == "dist.master_addr":
        return Finding("INIT", "launch", "fail", f"the rendezvous address {addr!r} is not an address of this machine "
                       "or cannot be resolved; no rank started", ev,
                       Remedy(["dist.master_addr=127.0.0.1"], "host the rendezvous on this machine's loopback "
                              "address (single-node runs)"), phase="preflight")
    if str(key or "").startswith("model.") and fetch_failure(err):
        return fetch_finding(run, err, "python -m disteval", "preflight", ev)
    said = message[len(f"{key}: "):] if key and message.startswith(f"{key}: ") else message  # the key once
    return Finding("INIT", "launch", "fail", f"configuration error before any rank started at {key or 'config'}: "
                   f"{said[:200]}", ev, phase="preflight")


def _driver_running(run: Run, ev: list[Evidence]) -> Finding:
    """launch.json still says "running": is the driver alive, stopped, dead (and of a full disk?) or unknown."""
    view = driver_view(run)
    ev = ev + view.evidence
    launch = run.launch or {}
    who = f"the driver (pid {launch.get('pid')} on {launch.get('host')})"
    phases = ", ".join(f"rank {r}: {s.get('phase')}" for r, s in sorted(run.statuses.items()) if s) or "no rank record"
    if view.state == "alive":
        return Finding("INIT", "launch", "warn", f"launch.json says running and {who} is alive: {view.why} ({phases})", ev)
    if view.state == "stopped":
        return Finding("INIT", "launch", "fail", f"{who} is stopped: {view.why}; the run cannot finish until it is "
                       f"continued (kill -CONT) or ended ({phases})", ev,
                       Remedy([], "continue it (kill -CONT) or end it; nothing in the run's settings stopped it",
                              changes_cause=False), phase="running")
    if view.state == "undecided":
        found, more = what_was_found(run)
        return Finding("INIT", "launch", "unknown", f"launch.json says running but the records do not tell whether {who} "
                       f"still runs: {view.why}. Found: {found}", ev + more, phase="running")
    usage = disk_free(run.path)
    if almost_full(usage):
        return Finding("INIT", "launch", "fail", f"{who} died without recording an outcome ({view.why}), most likely of "
                       f"a full disk: the run directory's filesystem has {usage[0]:,} of {usage[1]:,} bytes free "
                       f"({phases})", ev + [Evidence(str(run.path), f"{usage[0]:,} bytes free of {usage[1]:,}",
                                                     field="shutil.disk_usage.free")],
                       Remedy([], "free space on that filesystem, or rerun with hydra.run.dir on another one; an "
                              "automatic rerun would write into the same full disk", changes_cause=False), phase="running")
    inline = [r for r, st in sorted(run.statuses.items()) if st and st.get("pid") == launch.get("pid")]
    if inline:  # world size 1: the driver ran rank 0 in its own process, so the rank died with it
        r = inline[0]
        drill = launch.get("faults") or ""
        # the rank is to blame only when the records say it killed itself (a kill drill aimed at it); a kill of the
        # process from outside is the driver's death, as at any world size
        own = any(f.kind == "kill" and f.hits(r) for f in _drill_faults(drill))
        return Finding("INIT", "launch", "fail", f"{who} died (SIGKILL or a crash) without recording an outcome while "
                       f"it ran rank {r} itself (world size 1): {view.why}"
                       + (f"; rank {r} killed itself (launch.json faults={drill})" if own else "") + f" ({phases})",
                       ev + [Evidence(f"ranks/rank{r}/status.json", str(launch.get("pid")), field="pid")],
                       Remedy([], f"the run was a fault drill (DISTEVAL_FAULTS={drill}): unset it" if drill else
                              "nothing recorded says why the process died (dmesg tells whether the out-of-memory killer "
                              "chose it): rerun once that is known", changes_cause=False),
                       culprit=r if own else None, phase="running")
    return Finding("INIT", "launch", "fail", f"{who} died (SIGKILL or a crash) without recording an outcome: {view.why}; "
                   f"no rank is to blame ({phases})", ev,
                   Remedy([], "nothing recorded says why the driver died (dmesg tells whether the out-of-memory killer "
                          "chose it; a person may have killed it): rerun once that is known", changes_cause=False),
                   phase="running")


def _driver_failed_first(launch: dict, ev: list[Evidence]) -> Finding:
    """The driver failed and no rank wrote a record: its own error (launch.json) is the cause."""
    err = launch.get("error") or {}
    ev = ev + [Evidence("launch.json", f"{err.get('type')}: {str(err.get('message'))[:300]}", field="error.message")]
    port = launch.get("master_port")
    if not _port_ok(port):
        return Finding("INIT", "launch", "fail", f"dist.master_port={port} is not a TCP port (1..65535, or 0 to pick a "
                       f"free one): the driver failed starting the ranks ({err.get('type')}) before any rank wrote a "
                       "record", ev + [Evidence("launch.json", str(port), field="master_port")],
                       Remedy(["dist.master_port=0"], "let the rendezvous pick a free port"), phase="launch")
    return Finding("INIT", "launch", "fail", f"the driver failed before any rank wrote a record: {err.get('type')}: "
                   f"{str(err.get('message'))[:240]}", ev, phase="launch")


# -------------------------------------------------------------------------------------------- scheduler
def init_scheduler(run: Run, probes: dict | None) -> Finding:
    """The scheduler's view of a job that did not complete (RUN_DIR/job.json, written by a scheduling launcher),
    read by the run's launcher (``launchers.protocol.Launcher.scheduler_view``)."""
    job = run.job
    if job is None:
        return Finding("INIT", "scheduler", "skipped", "no job.json (not a failed job of a scheduler)")
    state = str(job.get("state", "")).upper()
    ev = [Evidence("job.json", state, field="state"), Evidence("job.json", str(job.get("error"))[:300], field="error")]
    launcher = launcher_of_job(job, launcher_choice(run))
    note = launcher.scheduler_view(run.path, job, run.hydra)
    if note is not None:
        return _scheduler_finding(run, note, ev)
    if not any(s and s.get("error") for s in run.statuses.values()):
        return _job_own_error(run, state, ev, launcher)
    return Finding("INIT", "scheduler", "pass", f"{launcher.scheduler or launcher.name} job {job.get('job_id')} "
                   f"state {state} (rank errors below)", ev)


def _scheduler_finding(run: Run, note: SchedulerNote, ev: list[Evidence]) -> Finding:
    """A finding from what the launcher read in the scheduler's records; the batch size (out of memory) and the
    nodes that died whole (a node failure) come from the ranks' records."""
    if note.kind == "task_start":
        return Finding("INIT", "scheduler", "fail", note.message, [Evidence(src, value, line=line)
                                                                   for src, line, value in note.evidence],
                       Remedy([], note.advice, changes_cause=False), phase="scheduler", nodes=list(note.nodes))
    if note.kind == "out_of_memory":
        bs = int(run.cfg("data.batch_size", 0) or 0)
        return Finding("INIT", "scheduler", "fail", note.message, ev,
                       Remedy([f"data.batch_size={bs // 2}"] if bs > 1 else [], "a smaller batch needs less memory"
                              if bs > 1 else note.advice, changes_cause=bs > 1), phase="scheduler")
    if note.kind == "node_fail":
        hosts, ranks = _silent_nodes(run)
        named = (f": node(s) {', '.join(hosts)} failed (their ranks {ranks} stopped at once without recording an "
                 "error, before the other ranks failed waiting for them)") if hosts else ""
        return Finding("INIT", "scheduler", "fail", note.message + named,
                       ev + [status_ev(run, r, "t_heartbeat") for r in ranks[:2]],
                       Remedy([], note.advice + (f"; look at {', '.join(hosts)} {note.node_hint} before it returns".replace(
                           "  ", " ") if hosts else "")),
                       culprit=ranks[0] if ranks else None, phase="scheduler")
    return Finding("INIT", "scheduler", "fail", note.message, ev,
                   Remedy(list(note.overrides), note.advice, changes_cause=bool(note.overrides) or note.kind != "time_limit"),
                   phase="scheduler")


def _job_own_error(run: Run, state: str, ev: list[Evidence], launcher) -> Finding:
    """A scheduled job that failed (or was refused before submission) with no rank error on record: the
    launcher's own account of it in job.json is the cause (an error raised in the job before its ranks wrote
    anything, or a configuration the launcher refused)."""
    job = run.job or {}
    error = str(job.get("error") or "no error recorded")
    if state == "REFUSED":
        return Finding("INIT", "scheduler", "fail", error[:400] if "not submitted" in error else
                       f"the job was not submitted: {error[:300]}", ev,
                       Remedy([], "fix the configuration the error names, then rerun", changes_cause=False),
                       phase="scheduler")
    return Finding("INIT", "scheduler", "fail", f"{launcher.scheduler or launcher.name} job "
                   f"{job.get('job_id') or ''} ended {state or 'FAILED'} before any rank recorded an error: "
                   f"{error[:300]}", ev,
                   Remedy([], f"the error above is the job's own (from the {launcher.name} launcher); fix what it "
                          "names, then rerun", changes_cause=False), phase="scheduler")


def _silent_nodes(run: Run) -> tuple[list[str], list[int]]:
    """(hosts, their ranks) of the nodes whose every rank recorded no error and stopped beating before the first
    rank elsewhere recorded its failure: nodes that died whole."""
    by_host: dict[str, list[int]] = {}
    for r, s in sorted(run.statuses.items()):
        if s and s.get("host"):
            by_host.setdefault(str(s["host"]), []).append(r)
    errs = errors(run)
    hosts, ranks = [], []
    for host, mine in sorted(by_host.items()):
        if any((run.statuses[r] or {}).get("error") for r in mine):
            continue
        others = [float(e["time"]) for q, e in errs.items() if q not in mine and isinstance(e.get("time"), (int, float))]
        beats = [float((run.statuses[r] or {}).get("t_heartbeat") or 0) for r in mine]
        if others and max(beats) <= min(others):
            hosts.append(host)
            ranks += mine
    return hosts, ranks


# ---------------------------------------------------------------------------------------------- started
def init_started(run: Run, probes: dict | None) -> Finding:
    """Every rank 0..W-1 wrote a status record."""
    launch = run.launch or {}
    if launch.get("outcome") == "config_error":
        return Finding("INIT", "started", "skipped", "no rank was launched (configuration error)")
    size = run.world_size
    if not size:
        return Finding("INIT", "started", "skipped", "the world size is unknown (no launch, job, config or status record)")
    missing = [r for r in range(size) if run.statuses.get(r) is None
               and not (run.path / "ranks" / f"rank{r}" / "status.json").exists()]  # unreadable: see INIT/records
    if not missing:
        return Finding("INIT", "started", "pass", f"all {size} ranks started")
    present = [r for r in range(size) if run.statuses.get(r)]
    if any((run.statuses[r] or {}).get("filesystem") == "node-local" for r in present):
        return Finding("INIT", "started", "skipped", f"rank(s) {missing} have no record here: the run directories "
                       "were node-local, so their records are on their own nodes")
    if launch.get("outcome") == "running" and driver_view(run).state == "alive":
        return Finding("INIT", "started", "warn", f"rank(s) {missing} of {size} have not written a status record yet "
                       "(the driver is alive)")
    if run.launch is not None and not present:
        return Finding("INIT", "started", "skipped", "no rank wrote a record: the driver's record says why (INIT/launch)")
    logged = _driver_log_error(run)
    if not present and logged and "configuration error" in logged[1]:
        return Finding("INIT", "started", "fail", "no rank wrote a status record: the driver log says the job stopped "
                       f"with a configuration error before any rank started ({logged[1][:200]}); the error itself went "
                       "to the console of the process that found it (launch.json is written only by python -m "
                       "disteval's own launcher)", [Evidence("disteval.log", logged[1][:300], line=logged[0]),
                                                    Evidence("ranks/", "no status.json")], phase="preflight")
    if not present:
        found, ev = what_was_found(run)
        return Finding("INIT", "started", "unknown", f"no rank wrote a status record and there is no launch.json: an "
                       "external launcher (torchrun, srun) started the ranks and they stopped before opening their "
                       "records (a configuration error is printed only on their consoles), or they never started. "
                       f"Found: {found}", ev, phase="never_started")
    deaths = run.deaths()
    ev = [Evidence(f"ranks/rank{r}/status.json", "missing") for r in missing]
    ev += [Evidence("launch.json", deaths[r], field=f"error.deaths.{r}") for r in missing if r in deaths]
    waited = [r for r in present if (run.statuses[r].get("error") or {})]
    ev += [e for r in waited[:1] for e in error_ev(run, r)[:1]]
    seen = "; ".join(f"the launcher saw rank {r} end: {deaths[r]}" for r in missing if r in deaths)
    return Finding("INIT", "started", "fail", f"rank(s) {missing} of {size} never wrote a status record"
                   + (f" ({seen})" if seen else "") + (f" while rank(s) {waited} failed waiting" if waited else "")
                   + ": the records do not say why it did not start", ev, culprit=missing[0], phase="never_started")


def _driver_log_error(run: Run) -> tuple[int, str] | None:
    """(line number, text) of the last ERROR line of RUN_DIR/disteval.log (the driver's log), or None."""
    try:
        lines = (run.path / "disteval.log").read_text(errors="replace").splitlines()
    except OSError:
        return None
    hits = [(n, line) for n, line in enumerate(lines, 1) if "[ERROR]" in line]
    return hits[-1] if hits else None


# ----------------------------------------------------------------------------------------------- joined
def init_joined(run: Run, probes: dict | None) -> Finding:
    """Ranks that stopped inside the process-group start (by their traceback, or a ``rendezvous`` record
    without ``joined``): port in use or out of range, unresolvable address, a rank pointed at another port
    than rank 0's store, or a rank that never arrived. Ranks that failed before or after it are not
    rendezvous failures (INIT/ranks_ran)."""
    records = {r: s for r, s in run.statuses.items() if s}
    if not records:
        return Finding("INIT", "joined", "skipped", "no status records")
    rdv = {r: s.get("rendezvous") or {} for r, s in records.items()}
    ports = {r: v.get("master_port") for r, v in rdv.items() if v.get("master_port") is not None}
    addrs = {r: v.get("master_addr") for r, v in rdv.items() if v.get("master_addr")}
    for fld, var, seen in (("master_port", "MASTER_PORT", ports), ("master_addr", "MASTER_ADDR", addrs)):
        odd = sorted(r for r, v in seen.items() if v != seen[0]) if 0 in seen else []
        if odd:  # rank 0 hosts the store: a rank that looked elsewhere is the culprit
            r = odd[0]
            return Finding("INIT", "joined", "fail", f"rank {r} looked for the rendezvous at {var}={seen[r]}, but rank 0 "
                           f"hosts it at {var}={seen[0]}: the ranks were launched with different {var} values",
                           [status_ev(run, 0, f"rendezvous.{fld}"), status_ev(run, r, f"rendezvous.{fld}")]
                           + (error_ev(run, r) if records[r].get("error") else []),
                           Remedy([], f"start every rank with {var}={seen[0]} (the value rank 0 used)",
                                  env={var: str(seen[0])}), culprit=r, phase="rendezvous")
    in_start = sorted(r for r, s in records.items() if not s.get("joined") and rank_phase(s, r)[0] == "rendezvous")
    waiting = sorted(r for r, s in records.items() if not s.get("joined") and not s.get("error")
                     and s.get("phase") == "init" and s.get("rendezvous"))
    if not in_start and not waiting:
        before = sorted(r for r, s in records.items() if not s.get("joined") and s.get("error"))
        return Finding("INIT", "joined", "pass", f"all {len(records)} ranks joined the process group" if not before else
                       f"no rank failed inside the process-group start (rank(s) {before} failed {describe('init')} or "
                       "while building the dataset or model: see INIT/ranks_ran)")
    for r in in_start:
        found = _rendezvous_error(run, r, ports.get(r), addrs.get(r))
        if found is not None:
            return found
    never = [r for r in waiting if r not in in_start]
    culprit = never[0] if never else in_start[0]
    stuck = sorted(set(in_start) | set(waiting))
    return Finding("INIT", "joined", "fail", f"rank(s) {stuck} never joined the process group",
                   [status_ev(run, r, "rendezvous") for r in stuck] + [status_ev(run, r, "joined") for r in stuck[:1]]
                   + (error_ev(run, culprit) if records[culprit].get("error") else []),
                   culprit=culprit, phase="rendezvous")


def _rendezvous_error(run: Run, r: int, port, addr) -> Finding | None:
    """The finding for rank ``r``'s error raised inside the process-group start, when its record names the
    setting; None for a rank that only waited (a timeout: another rank is the culprit)."""
    s = run.statuses[r]
    err = s.get("error") or {}
    msg = str(err.get("message", ""))
    ev = error_ev(run, r) + [ev for ev in [rank_phase(s, r)[1]] if ev is not None]
    if port is not None and not _port_ok(port, allow_zero=False):
        return Finding("INIT", "joined", "fail", f"rank {r} was started with MASTER_PORT={port}, which is not a TCP "
                       f"port (1..65535): its process-group start failed ({err.get('type')})",
                       [status_ev(run, r, "rendezvous.master_port")] + ev,
                       Remedy([], "start every rank with one MASTER_PORT in 1..65535 (the external launcher's setting; "
                              "python -m disteval picks a free one with dist.master_port=0)", changes_cause=False),
                       culprit=r, phase="rendezvous")
    if _PORT_IN_USE.search(msg):
        return Finding("INIT", "joined", "fail", f"rank {r} could not host the rendezvous store: port {port} is already "
                       "in use", ev, Remedy([], "start the ranks with a free MASTER_PORT", changes_cause=False),
                       culprit=r, phase="rendezvous")
    if _RESOLVE.search(msg):
        return Finding("INIT", "joined", "fail", f"rank {r} cannot resolve the rendezvous address {addr!r}", ev,
                       Remedy(["dist.master_addr=127.0.0.1"], "use an address every node can resolve"), culprit=r,
                       phase="rendezvous")
    if not is_network_error(err):
        return Finding("INIT", "joined", "fail", f"rank {r} failed inside the process-group start: {err.get('type')}: "
                       f"{msg[:240]}", ev, culprit=r, phase="rendezvous")
    return None


# -------------------------------------------------------------------------------------------- ranks_ran
def init_ranks_ran(run: Run, probes: dict | None) -> Finding:
    """No rank died or raised an error of its own (the culprit by ``launchers.culprit``'s rule); an error is
    judged by the phase it was raised in."""
    culprit = _culprit(run)
    if culprit is None:
        return Finding("INIT", "ranks_ran", "pass" if run.statuses else "skipped",
                       "no rank failed" if run.statuses else "no status records")
    if culprit.rank is None:
        if errors(run) and all(e.get("type") in CONSEQUENCE_TYPES for e in errors(run).values()):
            return Finding("INIT", "ranks_ran", "pass", "every rank stopped itself because its driver died (see "
                           "INIT/launch)")
        found, ev = what_was_found(run)
        return Finding("INIT", "ranks_ran", "unknown", f"the run failed but no rank recorded why: "
                       f"{culprit.message[:240]}. Found: {found}", ev, phase=None)
    s = run.statuses.get(culprit.rank) or {}
    err = s.get("error") or {}
    node = None if err else _node_died(run, culprit.rank)
    if node is not None:  # before "see COMM": a whole node gone at once is not a rank that stalled
        return node
    if any(e.get("blames") == culprit.rank for e in errors(run).values()) and \
            ((err and is_network_error(err)) or (not err and run.launch is not None)):
        return Finding("INIT", "ranks_ran", "pass", f"no rank died or raised an error of its own (rank {culprit.rank} "
                       "stalled while a peer waited: see COMM)")
    if err and not is_consequence(err):
        return _own_error(run, culprit.rank)
    return _died_or_stalled(run, culprit)


def _own_error(run: Run, r: int) -> Finding:
    """Rank ``r`` raised an error of its own: where (phase) decides what it is."""
    s = run.statuses.get(r) or {}
    err = s.get("error") or {}
    phase, phase_ev = rank_phase(s, r)
    ev = error_ev(run, r) + ([phase_ev] if phase_ev is not None else [])
    if err.get("type") == "CoverageError":
        return Finding("INIT", "ranks_ran", "pass", f"rank {r}'s coverage error is a shard problem (see SHARDS)")
    if err.get("type") == "NumericDriftError":
        return Finding("INIT", "ranks_ran", "pass", f"rank {r} stopped before the loop because the ranks compute "
                       "different bits (see CONVERGENCE/hardware)")
    if disk_full(err):
        return disk_full_finding(run, err, f"ranks/rank{r}/status.json", r, phase)
    if phase == "rendezvous":
        return Finding("INIT", "ranks_ran", "pass", f"rank {r}'s error was raised inside the process-group start "
                       "(see INIT/joined)")
    if phase in ("data", "init", None) and fetch_failure(err):
        joined = "after" if s.get("joined") else "before"
        return fetch_finding(run, err, f"rank {r} ({joined} the process group existed)", phase or "data", ev, r)
    return Finding("INIT", "ranks_ran", "fail", f"rank {r} raised {err.get('type')} {describe(phase)}: "
                   f"{str(err.get('message'))[:240]}", ev, drill_remedy(run, r, ("error", "stall")), culprit=r,
                   phase=phase)


def _died_or_stalled(run: Run, culprit) -> Finding:
    """The culprit recorded no error of its own: it died (the launcher saw how), stalled, or its failure is a
    communication problem (COMM)."""
    r = culprit.rank
    s = run.statuses.get(r) or {}
    err = s.get("error") or {}
    death = run.deaths().get(r)
    victims = {q: e for q, e in errors(run).items() if q != r}
    peers_timed_out = any(STALL.search(str(e.get("message", ""))) or e.get("blames") == r for e in victims.values())
    outside = bool(death) and not any(sig in death for sig in ("SIGKILL", "SIGSTOP", "SIGSEGV", "SIGABRT", "SIGBUS", "exit"))
    phase, _ = rank_phase(s, r) if s else ("never_started", None)
    if not err and peers_timed_out and (outside or (not death and run.launch is not None)):
        # its peers timed out waiting while it showed no error and our launcher saw no crash: slow, hung or
        # stopped, which its heartbeat tells apart (COMM/timeout)
        return Finding("INIT", "ranks_ran", "pass", f"no rank died or raised an error of its own (rank {r} stopped "
                       "progressing while its peers timed out: see COMM)")
    if death and not err:
        ev = [Evidence("launch.json", death, field=f"error.deaths.{r}"), status_ev(run, r, "phase"),
              status_ev(run, r, "samples_done")]
        return Finding("INIT", "ranks_ran", "fail", f"rank {r} {death} without recording an error, in "
                       f"{recorded_progress(s, True)}", ev, _death_remedy(run, death, r), culprit=r, phase=phase)
    if not err and s.get("phase") in ("init", "data", "forward"):
        first = sorted(errors(run))
        return Finding("INIT", "ranks_ran", "fail", f"rank {r} stopped without recording an error in "
                       f"{recorded_progress(s)}: its process died or hung (no launcher record says how), and its peers "
                       "failed waiting for it", [status_ev(run, r, "phase"), status_ev(run, r, "t_update")]
                       + [status_ev(run, r, "t_heartbeat")] * bool(s.get("t_heartbeat"))
                       + (error_ev(run, first[0])[:1] if first else []),
                       Remedy([], "nothing recorded says why it stopped: look at that rank's host (dmesg, the "
                              "scheduler's log) before rerunning", changes_cause=False), culprit=r, phase=phase)
    if err and is_network_error(err):
        return Finding("INIT", "ranks_ran", "pass", f"no rank raised an error of its own (rank {r}'s failure is "
                       "a communication problem, see COMM)")
    return Finding("INIT", "ranks_ran", "pass", "no rank died or raised an error of its own (the checks below say "
                   "what ended the run)")


def _node_died(run: Run, r: int) -> Finding | None:
    """Rank ``r`` recorded no error, and neither did any rank of its node, whose launcher's record
    (``nodes/<host>/launch.json``, a multi-node launch) stayed "running" while its heartbeat stopped: the whole
    node died or was killed at once (power, OOM killer of a node, a crashed VM). With node-local run directories
    (only the ranks' relayed records are here) a peer must also have seen its connections to that node closed: a
    node cut off from the network stops its relayed records the same way. None otherwise."""
    host = (run.statuses.get(r) or {}).get("host")
    launch = run.node_launches.get(str(host)) if host else None
    mine = [q for q, s in run.statuses.items() if s and s.get("host") == host]
    # node-local run directories: that node's launch.json is on its own disk, but its ranks' records were relayed
    # through the rendezvous store; two or more of them stopping at once, none with an error, while a peer saw its
    # connections to them closed, is the node (without that, a node cut off from this one looks the same)
    relayed = (launch is None and len(mine) >= 2 and all((run.statuses[q] or {}).get("relayed") for q in mine)
               and host != (run.statuses.get(0) or {}).get("host"))
    if not relayed and (not launch or launch.get("outcome") != "running"):
        return None
    if any((run.statuses[q] or {}).get("error") for q in mine):
        return None
    beats = [float(run.statuses[q].get("t_heartbeat") or 0) for q in mine]
    beats += [] if relayed else [float(launch.get("t_heartbeat") or 0)]
    victims = [float(e["time"]) for q, e in errors(run).items() if q not in mine and isinstance(e.get("time"), (int, float))]
    if not victims or max(beats) > min(victims):
        return None  # something of that node still beat after its peers failed: not a node that died at once
    if relayed and not any(_PEER_CLOSED.search(str(e.get("message"))) for q, e in errors(run).items() if q not in mine):
        return None  # no peer saw its connections close: a node cut off from this one looks the same from here
    src = f"nodes/{host}/launch.json"
    ev = [] if relayed else [Evidence(src, "running", field="outcome"),
                             Evidence(src, str(launch.get("t_heartbeat")), field="t_heartbeat")]
    ev += [status_ev(run, q, "t_heartbeat") for q in mine[:2]]
    ev += [e for q in sorted(errors(run))[:1] for e in error_ev(run, q)[:1]]
    who = (f"its rank(s) {mine} (their records relayed through the rendezvous store; its launcher's record is on its "
           "own disk)" if relayed else f"its launcher and its rank(s) {mine}")
    return Finding("INIT", "ranks_ran", "fail", f"node {host} died or was killed: {who} "
                   f"stopped at once without recording an error (their heartbeats ended before the other nodes' "
                   "ranks failed waiting for them), in "
                   f"{recorded_progress(run.statuses.get(r) or {})}", ev,
                   Remedy([], f"look at node {host} (is it up? dmesg, the OOM killer, the scheduler's log) before "
                          "rerunning", changes_cause=False), culprit=r, phase=rank_phase(run.statuses.get(r), r)[0])


# the signal each drill kind ends a rank with (disteval.faults): a death by it under that drill is the drill's
DRILL_SIGNALS = {"kill": ("SIGKILL",), "stop": ("SIGSTOP",), "preempt": ("SIGUSR2", "SIGUSR1", "SIGTERM")}


def _death_remedy(run: Run, death: str, r: int | None = None) -> Remedy:
    drill = (run.launch or {}).get("faults") or ""
    kinds = tuple(k for k, signals in DRILL_SIGNALS.items() if any(sig in death for sig in signals))
    if kinds and (drill_remedy(run, r, kinds) if r is not None else any(k in drill for k in kinds)):
        return Remedy([], f"the run was a fault drill (DISTEVAL_FAULTS={drill}): unset it", unset=["DISTEVAL_FAULTS"])
    if "SIGKILL" in death:
        bs = int(run.cfg("data.batch_size", 0) or 0)
        if bs > 1:
            return Remedy([f"data.batch_size={max(1, bs // 2)}"], "a SIGKILL that nobody sent by hand is most often "
                          "the kernel's out-of-memory killer (dmesg says so); if it was, a smaller batch needs less memory")
        return Remedy([], "check dmesg for the out-of-memory killer: with batch size 1 nothing in the settings can "
                      "make the rank smaller", changes_cause=False)
    return Remedy([], "rerun unchanged: the rank was stopped from outside")


def init_config_agree(run: Run, probes: dict | None) -> Finding:
    """Every rank ran the same resolved configuration (sha256 digest in its status record)."""
    digests = {r: s.get("config_digest") for r, s in run.statuses.items() if s and s.get("config_digest")}
    if len(digests) < 2:
        return Finding("INIT", "config_agree", "skipped", "fewer than two ranks recorded a config digest")
    ref = digests.get(0, next(iter(digests.values())))
    odd = sorted(r for r, d in digests.items() if d != ref)
    if odd:
        return Finding("INIT", "config_agree", "fail", f"rank(s) {odd} ran another configuration than rank 0 (different "
                       "overrides per rank)", [status_ev(run, 0, "config_digest")] + [status_ev(run, r, "config_digest")
                                                                                   for r in odd],
                       culprit=odd[0], phase="init")
    return Finding("INIT", "config_agree", "pass", f"all {len(digests)} ranks ran the same configuration")


def drill_remedy(run: Run, r: int | None, kinds: tuple[str, ...]) -> Remedy | None:
    """"Unset the fault drill" when launch.json's DISTEVAL_FAULTS holds a fault of ``kinds`` aimed at rank ``r``
    (the failure is the drill's: no setting fixes it); None otherwise."""
    drill = (run.launch or {}).get("faults") or ""
    if r is not None and any(f.kind in kinds and f.hits(r) for f in _drill_faults(drill)):
        return Remedy([], f"the run was a fault drill (DISTEVAL_FAULTS={drill}): unset it", unset=["DISTEVAL_FAULTS"])
    return None


def _drill_faults(text: str) -> list:
    """The faults of launch.json's ``faults`` (DISTEVAL_FAULTS as the driver saw it); [] when unparsable."""
    try:
        return parse_faults(text)
    except ValueError:
        return []

