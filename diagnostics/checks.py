"""The checks of each state of the troubleshooting flowchart. Each is a pure function of a ``Run`` (and the
probe results, when --probe ran) returning a ``Finding``: pass / warn / fail / unknown / skipped, what was
found, the evidence (file and field or line), the phase the failure happened in, at most one remedy, and the
culprit rank when one is known.

States, in the order the doctor walks them (the first failing one is the verdict; when none fails, the first
``unknown``):
INIT (did every rank start, join and run; does the driver live: ``diagnostics.init_checks``), SHARDS (shard
plan, coverage, sampler), CONVERGENCE (do trials agree; nondeterminism flags), COMM (timeouts, stalls told
apart by heartbeats, stragglers, mismatched collectives), RESULT (outlier ranks, implausible values).
"""
from __future__ import annotations

import json

import math
import re
import statistics
import time
from typing import Callable

from disteval.common.liveness import beat_lag, stale_after
from disteval.common.ranges import batch_aligned_bounds, shard_bounds
from disteval.metrics.robust import OUTLIER_Z, rank_outliers
from disteval.job.records import is_network_error, recorded_progress
from launchers.culprit import is_consequence

from diagnostics.compare import compare_runs, summary
from diagnostics.evidence import Evidence, Run
from diagnostics.findings import STATUSES, Finding, culprit as _culprit, error_ev as _error_ev, errors as _errors
from diagnostics.findings import status_ev as _status_ev, what_was_found
from diagnostics.init_checks import (STALL as _STALL, drill_remedy, driver_view, init_config_agree, init_joined, init_launch,
                                     init_ranks_ran, init_scheduler, init_started)
from diagnostics.hardware import convergence_hardware
from diagnostics.links import comm_links, peer_gone, slow_link, sync_timeout
from diagnostics.liveness import examine
from diagnostics.mesh_checks import comm_mesh_hang, comm_tp_peers, mesh_of, shards_mesh
from diagnostics.phases import rank_phase
from diagnostics.remedies import Remedy

STATES = ("INIT", "SHARDS", "CONVERGENCE", "COMM", "RESULT")
_MISMATCH = re.compile(r"mismatch", re.I)

__all__ = ["CHECKS", "STATES", "STATUSES", "Finding"]


# ---------------------------------------------------------------------------------------------- SHARDS
def shards_plan(run: Run, probes: dict | None) -> Finding:
    """Shard sizes from N, W, the batch size and the sampler; a padded or dropping sampler is a failure."""
    size = run.world_size
    n = (run.results or {}).get("dataset", {}).get("num_samples")
    sampler = (run.results or {}).get("sampler") or run.cfg("data.sampler", "exact")
    bs = run.cfg("data.batch_size")
    mesh = mesh_of(run)  # under a device mesh the data is split over the data-parallel ranks only
    tp = mesh["tp"] if mesh else 1
    if n is None or not size:
        planned = [s.get("samples_planned") for s in run.statuses.values() if s]
        if sampler == "exact" and planned and all(p is not None for p in planned) and len(planned) == size:
            # one rank per data-parallel group: its TP peers plan the same samples
            n = sum(s.get("samples_planned") for r, s in run.statuses.items() if s and r % tp == 0)
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
                       culprit=first if sampler == "padded" else None, phase="data")
    aligned = run.cfg("eval.mode", "bitwise") == "bitwise" and bs  # whole global batches per rank (v2 default)
    size = size // tp
    sizes = [batch_aligned_bounds(n, bs, size, r) if aligned else shard_bounds(n, size, r) for r in range(size)]
    sizes = [e - s for s, e in sizes]
    ev = [Evidence("results.json" if run.results else "ranks/*/status.json", str(n), field="dataset.num_samples")]
    bad = [r for r, s in run.statuses.items()
           if s and s.get("samples_planned") not in (None, sizes[r // tp] if r // tp < size else None)]
    if bad:
        r = bad[0]
        return Finding("SHARDS", "plan", "fail", f"rank {r} planned {run.statuses[r]['samples_planned']} samples but its "
                       f"exact shard of N={n}, W={size}{', batch ' + str(bs) if aligned else ''} holds {sizes[r]}: "
                       "the ranks disagree on the dataset",
                       ev + [_status_ev(run, r, "samples_planned")], culprit=r, phase="data")
    batches = [math.ceil(s / bs) if bs else None for s in sizes]
    text = (f"{'batch-aligned ' if aligned else ''}exact shards of N={n} over W={size}: "
            f"{min(sizes)}..{max(sizes)} samples")
    if bs:
        text += f", {min(batches)}..{max(batches)} batches of {bs}"
    empty = [r for r, s in enumerate(sizes) if s == 0]
    if empty:  # fewer ranks: as many as hold samples (whole global batches when aligned), times the TP degree
        units = f"the {math.ceil(n / bs)} global batch(es) of {bs}" if aligned else f"the {n} sample(s)"
        return Finding("SHARDS", "plan", "warn", text + f"; rank(s) {empty[:8]} hold no sample (W > {units})", ev,
                       Remedy([f"dist.world_size={max(1, size - len(empty)) * tp}"],
                              f"no more data-parallel ranks than {units}"))
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
                       _error_ev(run, r), remedy, culprit=None, phase="results")
    if cov is None:
        return Finding("SHARDS", "coverage", "skipped", "no results.json (the run did not reach the coverage check)")
    ev = [Evidence("results.json", f"missing={cov.get('missing')} duplicated={cov.get('duplicated')} "
                   f"out_of_range={cov.get('out_of_range')}", field="coverage")]
    if not cov.get("ok", True):
        return Finding("SHARDS", "coverage", "fail", f"{cov.get('duplicated')} sample id(s) counted twice and "
                       f"{cov.get('missing')} missing of N={cov.get('num_samples')}: the metrics are biased", ev, remedy,
                       phase="results")
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
                       Remedy(["precision.deterministic=true"], "deterministic algorithms, cuDNN benchmark and TF32 off"),
                       phase="forward")
    why = "deterministic algorithms were on" if deterministic else f"the forward on {device or 'this device'} is " \
        "deterministic without precision.deterministic"
    return Finding("CONVERGENCE", "trials", "fail", finding + f"; {why}, so the model or the data pipeline draws random "
                   "numbers (dropout left in train mode, random augmentation, unseeded noise): fix the model; meanwhile "
                   "more trials narrow the robust estimate", ev, phase="forward")


def convergence_flags(run: Run, probes: dict | None) -> Finding:
    """Settings that make results vary between runs: TF32, cuDNN benchmark, deterministic algorithms off; and
    the fast path's settings that change the last bits against an eager run (compile, channels_last)."""
    prec = (run.results or {}).get("precision") or {}
    compute = (run.results or {}).get("compute") or {}
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
    if compute.get("compile", run.cfg("eval.compile", False)):
        flags.append("eval.compile=true (compiled kernels: other last bits than eager)")
    if compute.get("channels_last", run.cfg("model.channels_last", False)):
        flags.append("model.channels_last=true (other convolution kernels)")
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
                   f"B = the reference): {summary(cmp)}", ev, remedy, culprit,
                   phase="forward" if fwd["identical"] is False else "sync")


# ------------------------------------------------------------------------------------------------ COMM
def _waited_for_a_stall(run: Run, err: dict) -> bool:
    """A rank's error says it waited for a peer that stalled or a collective that timed out; not a victim whose
    blamed peer recorded an error of its own (that peer failed, it did not stall: INIT/ranks_ran's verdict)."""
    if err.get("blames") is None:
        return bool(_STALL.search(str(err.get("message", ""))))
    own = (run.statuses.get(int(err["blames"])) or {}).get("error")
    return not own or is_consequence(own)


def comm_timeout(run: Run, probes: dict | None) -> Finding:
    """A rank stalled or a collective timed out: the culprit, where it stopped, and whether it was slow (its
    heartbeat kept beating: a timeout that fits) or stopped (its heartbeat stopped too: no timeout helps)."""
    culprit = _culprit(run)
    errs = _errors(run)
    # victims that waited for a peer after the process group existed (a rendezvous that timed out is INIT's)
    timed = {r: e for r, e in errs.items() if _waited_for_a_stall(run, e) and (run.statuses.get(r) or {}).get("joined")}
    cerr = ((run.statuses.get(culprit.rank) or {}).get("error") if culprit and culprit.rank is not None else None)
    if culprit is not None and not timed and cerr and is_network_error(cerr) \
            and (run.statuses.get(culprit.rank) or {}).get("joined"):
        return Finding("COMM", "timeout", "fail", f"rank {culprit.rank} failed with a network error and no rank recorded "
                       "an error of its own: a connection or a peer process went away", _error_ev(run, culprit.rank),
                       Remedy([], "nothing recorded says why the connection went away: probe the ranks (--probe) and "
                              "check the network between hosts before rerunning", changes_cause=False),
                       culprit=culprit.rank, phase=rank_phase(run.statuses.get(culprit.rank), culprit.rank)[0])
    if culprit is None or not timed:
        return Finding("COMM", "timeout", "pass" if run.statuses else "skipped",
                       "no collective timed out and no rank stalled" if run.statuses else "no status records")
    r0 = sorted(timed)[0]
    r = culprit.rank if culprit.rank is not None else r0
    s = run.statuses.get(r) or {}
    phase = s.get("phase") if s.get("phase") != "failed" else rank_phase(s, r)[0]
    kind, kind_ev, gap = _stall_kind(run, r, timed)
    ev = _error_ev(run, r0)[:1] + kind_ev + [_status_ev(run, r, "phase"), _status_ev(run, r, "samples_done"),
                                             _status_ev(run, r, "last_collective")]
    if kind == "stopped":
        drill = (run.launch or {}).get("faults") or ""
        remedy = Remedy([], f"the run was a fault drill (DISTEVAL_FAULTS={drill}): unset it", unset=["DISTEVAL_FAULTS"]) \
            if "stop" in drill else Remedy([], f"a longer timeout cannot help a process that stopped: look at rank {r}'s "
                                           "host (a debugger, SIGSTOP, a frozen node, dmesg) before rerunning",
                                           changes_cause=False)
        unseen = (f", or node {s.get('host')} was cut off from this one (its records here are copies relayed "
                  f"through the rendezvous store; {s.get('host')}'s own records say which)") if s.get("relayed") else ""
        waited, waited_ev = peer_gone(run, r, timed)
        return Finding("COMM", "timeout", "fail", f"rank {r} stopped: its heartbeat stopped {gap:.0f} s before its peers "
                       f"gave up waiting, in {recorded_progress(s)}: the process was stopped (SIGSTOP, a debugger), froze "
                       f"or died{unseen}, so it was not slow{waited}", ev + waited_ev, remedy, culprit=r, phase=phase)
    link = _link_failed(run, timed, kind) or slow_link(run, timed, phase)
    if link is not None:
        return link
    return _slow_rank(run, r, ev, probes, kind == "alive", phase)


LINK_FLOOR_BPS = 1e6 / 8  # 1 Mbit/s: a payload that would cross even such a link within half the timeout


def _link_failed(run: Run, timed: dict[int, dict], kind: str | None) -> Finding | None:
    """A network partition rather than a slow rank: every rank that timed out was alive and inside a
    collective whose payload would have crossed even a 1 Mbit/s link within half the timeout, and the ranks of
    some node(s) recorded that they could not reach the rendezvous store (``store_error``): those nodes were
    cut off. None when the records do not show that."""
    if kind == "stopped":
        return None
    statuses = {r: s for r, s in run.statuses.items() if s}
    cut = {r: s["store_error"] for r, s in statuses.items() if s.get("store_error")}
    flights = {r: s.get("in_flight") for r, s in statuses.items() if s.get("in_flight")}
    if not cut or not flights:
        return None
    first_victim = min((float(e["time"]) for e in timed.values() if isinstance(e.get("time"), (int, float))),
                       default=None)
    if first_victim is not None and min(float(e.get("since") or 0) for e in cut.values()) > first_victim:
        return None  # cut off from the store only after the run had failed: a consequence, not the cause
    timeout = float(run.cfg("communication.timeout_s", 300.0) or 300.0)
    largest = max(int(f.get("bytes") or 0) for f in flights.values())
    if largest / LINK_FLOOR_BPS > timeout / 2:  # a payload that size may just be slow: the slow-link check's case
        return None
    hosts = sorted({str(statuses[r].get("host")) for r in cut})
    ranks = sorted(cut)
    first = ranks[0]
    ops = sorted({str(f.get("op")) for f in flights.values()})
    err = cut[first]
    ev = [Evidence(f"ranks/rank{first}/status.json", f"{err.get('error')} (since {err.get('since')})",
                   field="store_error"),
          Evidence(f"ranks/rank{first}/status.json", json.dumps(flights.get(first) or {}), field="in_flight")]
    ev += [Evidence(f"ranks/rank{r}/status.json", str(e.get("message"))[:200], field="error.message")
           for r, e in sorted(timed.items())[:2]]
    others = sorted({str(s.get("host")) for r, s in statuses.items() if r not in cut})
    return Finding("COMM", "timeout", "fail", f"the network between node(s) {', '.join(hosts)} and "
                   f"{', '.join(others) or 'the other nodes'} failed (a partition): rank(s) {ranks} on "
                   f"{', '.join(hosts)} could not reach the rendezvous store at {err.get('endpoint')} ({err.get('error')}), "
                   f"and the ranks waited in {', '.join(ops)} of at most {largest:,} bytes, which would cross even a "
                   f"1 Mbit/s link in {largest / LINK_FLOOR_BPS:.2f} s, for {timeout:g} s: not a slow rank; no "
                   "longer timeout helps", ev,
                   Remedy([], f"check the network connection between {', '.join(hosts)} and "
                          f"{', '.join(others) or 'the other nodes'} (link, routes, firewall), then rerun",
                          changes_cause=False), culprit=first, phase="sync")


def _stall_kind(run: Run, r: int, timed: dict[int, dict]) -> tuple[str | None, list[Evidence], float]:
    """("stopped" | "alive" | None, evidence, seconds): whether rank ``r``'s heartbeat stopped (by more than three
    beats) before the first peer that gave up waiting recorded its error; None for records without heartbeats."""
    s = run.statuses.get(r) or {}
    beat = s.get("t_heartbeat")
    blamers = {q: e for q, e in timed.items() if e.get("blames") == r} or timed
    times = {q: float(e["time"]) for q, e in blamers.items() if isinstance(e.get("time"), (int, float))}
    if not isinstance(beat, (int, float)) or not times:
        return None, [], 0.0
    q = min(times, key=times.get)
    gap = times[q] - float(beat)
    ev = [_status_ev(run, r, "t_heartbeat"), _status_ev(run, q, "error.time")]
    seen = blamers[q].get("evidence") or {}
    stale = seen.get("stale_s", seen.get("heartbeat_age_s"))
    if stale is not None:
        ev.append(_status_ev(run, q, "error.evidence.stale_s" if "stale_s" in seen else "error.evidence.heartbeat_age_s"))
    limit = beat_lag(s.get("heartbeat_s"))
    if stale is not None and float(stale) > limit:  # what the peer saw when it gave up (a frozen rank may beat again
        return "stopped", ev, max(gap, float(stale))  # after a thaw, rewriting t_heartbeat)
    return ("stopped" if gap > limit else "alive"), ev, gap


def fired_timeout(run: Run, phase: str | None, record: dict) -> tuple[float, str]:
    """(seconds, config key) of the timeout its peers ran out of waiting for a rank: what a peer's
    CollectiveTimeout recorded (``timeout_s``, ``timeout_key``), else the key in force in ``phase``
    (``diagnostics.links.sync_timeout``: communication.sync_timeout_s in the final synchronisation when set)."""
    for _, s in sorted(run.statuses.items()):
        err = (s or {}).get("error") or {}
        if err.get("timeout_key") and isinstance(err.get("timeout_s"), (int, float)):
            return float(err["timeout_s"]), str(err["timeout_key"])
    if phase is None and record.get("rendezvous"):
        return float(run.cfg("communication.timeout_s", record["rendezvous"].get("timeout_s", 300.0)) or 300.0), \
            "communication.timeout_s"
    return sync_timeout(run, phase)


def _slow_rank(run: Run, r: int, ev: list[Evidence], probes: dict | None, beating: bool, phase: str | None) -> Finding:
    """Rank ``r`` made no progress while its heartbeat kept beating (or the records predate heartbeats): slow,
    so a timeout that fits is the remedy."""
    s = run.statuses.get(r) or {}
    timeout, key = fired_timeout(run, phase, s)
    suggested = max(4 * timeout, 60.0)
    alive = "was alive (its heartbeat kept beating)" if beating else "was presumably alive (its records predate heartbeats)"
    why = f"rank {r} {alive} but slower than the {timeout:g} s timeout ({key}); allow {suggested:g} s"
    if probes and probes.get("latency", {}).get("suggested_timeout_s"):
        suggested = max(suggested, float(probes["latency"]["suggested_timeout_s"]))
        why += f" (the latency probe suggests at least {probes['latency']['suggested_timeout_s']:g} s)"
    overrides = [f"{key}={suggested:g}"]
    last = s.get("last_collective") or {}
    compressible = "ranking" in (run.cfg("eval.metrics", []) or [])
    if s.get("phase") == "sync" and int(last.get("bytes") or 0) > 64 * 1024 * 1024 and compressible \
            and run.cfg("communication.compression", "none") == "none":
        overrides.append("communication.compression=fp16")
        why += "; fp16 halves the gathered scores"
    # a stalled loader drill sleeps an hour: no timeout that fits; a delay drill's finite sleep does fit one
    what = (f"rank {r} was late to the final synchronisation ({recorded_progress(s)}): its peers timed out after "
            f"{timeout:g} s ({key}) waiting for it" if s.get("phase") == "sync" else
            f"rank {r} stopped making progress ({recorded_progress(s)}) and its peers timed out after {timeout:g} s ({key})")
    return Finding("COMM", "timeout", "fail", f"{what}; it {alive}", ev,
                   drill_remedy(run, r, ("stall",)) or Remedy(overrides, why), culprit=r, phase=phase)


def comm_heartbeats(run: Run, probes: dict | None) -> Finding:
    """While a run has no outcome yet (no results.json, no recorded failure, its driver alive or external): a
    rank whose process is stopped or gone (this machine's /proc), or whose heartbeat stopped while a rank on
    the same host beats on, is not healthy, whatever its progress fields say."""
    records = {r: s for r, s in run.statuses.items() if s}
    if run.results or run.failed or (run.launch or {}).get("outcome") not in (None, "running"):
        return Finding("COMM", "heartbeats", "skipped", "the run ended (the other checks judge it)")
    if (run.launch or {}).get("outcome") == "running" and driver_view(run).state != "alive":
        return Finding("COMM", "heartbeats", "skipped", "the driver is not known to be alive (see INIT/launch)")
    now = time.time()
    open_ = {r: s for r, s in records.items() if s.get("phase") not in ("done", "failed")}
    views = {r: examine(s, f"ranks/rank{r}/status.json", 1.0, now) for r, s in open_.items()}
    for r, s in open_.items():  # another host: compare with the ranks on the same host (one clock)
        beat, v = s.get("t_heartbeat"), views[r]
        same = [float(q["t_heartbeat"]) for k, q in open_.items() if k != r and q.get("host") == s.get("host")
                and isinstance(q.get("t_heartbeat"), (int, float))]
        if v.state == "undecided" and isinstance(beat, (int, float)) and same and \
                max(same) - float(beat) > stale_after(s.get("heartbeat_s")):
            v.state, v.why = "stopped", f"{v.why}, {max(same) - float(beat):.0f} s behind a rank on the same host"
    bad = sorted((r for r, v in views.items() if v.state in ("dead", "stopped")),
                 key=lambda r: (float(open_[r].get("t_heartbeat") or 0.0), r))
    if bad:
        r = bad[0]
        ev = views[r].evidence + [_status_ev(run, r, "phase"), _status_ev(run, r, "in_collective")]
        drill = (run.launch or {}).get("faults") or ""
        remedy = Remedy([], f"the run is a fault drill (DISTEVAL_FAULTS={drill}): unset it", unset=["DISTEVAL_FAULTS"]) \
            if any(k in drill for k in ("stop", "kill")) else Remedy([], f"look at rank {r}'s host (a debugger, SIGSTOP, a "
                                                                    "frozen node, dmesg)", changes_cause=False)
        return Finding("COMM", "heartbeats", "fail", f"rank {r} is {views[r].state} in {recorded_progress(open_[r])}: "
                       f"{views[r].why}; the run cannot finish" + (f" (also rank(s) {bad[1:]})" if bad[1:] else ""),
                       ev, remedy, culprit=r, phase=open_[r].get("phase"))
    unsure = [r for r, v in views.items() if v.state == "undecided"]
    if unsure:
        r = unsure[0]
        return Finding("COMM", "heartbeats", "unknown", f"the records do not tell whether rank(s) {unsure} still run: "
                       f"rank {r}: {views[r].why}", views[r].evidence, phase=open_[r].get("phase"))
    if not views:
        return Finding("COMM", "heartbeats", "skipped", "no unfinished rank")
    return Finding("COMM", "heartbeats", "pass", f"every unfinished rank is alive ({len(views)} checked by pid or "
                   "heartbeat)", [e for v in list(views.values())[:2] for e in v.evidence[:3]])


def comm_mismatch(run: Run, probes: dict | None) -> Finding:
    """Ranks that issued different collectives (gloo/nccl report a mismatch)."""
    hits = {r: e for r, e in _errors(run).items() if _MISMATCH.search(str(e.get("message", "")))}
    if not hits:
        return Finding("COMM", "mismatch", "pass" if run.statuses else "skipped", "no mismatched collectives reported")
    r = sorted(hits)[0]
    return Finding("COMM", "mismatch", "fail", f"rank {r} reported mismatched collectives", _error_ev(run, r),
                   Remedy([], "rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL to name both calls (diagnostic reruns only: ~10x "
                          "latency on small collectives)", env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, changes_cause=False),
                   culprit=r, phase=rank_phase(run.statuses.get(r), r)[0] or "sync")


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


def shards_input_pipeline(run: Run, probes: dict | None) -> Finding:
    """Whether the run was input-bound (results.json ``pipeline``: the ranks waited for their loaders a quarter
    of the loop or more), naming the bound host stage and the remedy that fits (``disteval.common.pipeline``):
    the exact pixel cache, more loader workers up to the cores, device decode. A warning, never a failure: the
    numbers are right, only slower than the model allows (``doctor --apply`` measures the remedy's effect)."""
    res = run.results or {}
    pipe = res.get("pipeline")
    if not pipe or pipe.get("bound") is None:
        return Finding("SHARDS", "input_pipeline", "skipped", "no pipeline record (a run that did not finish, or one "
                       "made before results.json had one)")
    ev = [Evidence("results.json", f"{pipe['delivered_images_per_s']:,.0f} images/s", field="pipeline.delivered_images_per_s"),
          Evidence("results.json", f"{pipe['wait_share'] * 100:.0f} %", field="pipeline.wait_share")]
    fwd = (pipe.get("stages") or {}).get("forward", {}).get("images_per_s")
    if fwd:
        ev.append(Evidence("results.json", f"{fwd:,.0f} images/s", field="pipeline.stages.forward.images_per_s"))
    if pipe["bound"] != "input":
        return Finding("SHARDS", "input_pipeline", "pass", f"compute-bound: the ranks waited for data "
                       f"{pipe['wait_share'] * 100:.0f} % of their loop ({pipe['delivered_images_per_s']:,.0f} images/s)", ev)
    stage = pipe.get("bound_stage")
    share = ((pipe.get("stages") or {}).get(stage) or {}).get("share_of_worker_time") if stage else None
    where = f"; the loader workers spent {share * 100:.0f} % of their time in {stage}" if share is not None else ""
    fixes = pipe.get("remedies") or []
    remedy = Remedy([fixes[0]], {"data.cache=pixels": "decode once: later runs read the exact uint8 crops from memory",
                                 "data.decode_on_device=true": "decode on the GPU (nvJPEG); different pixels, recorded"}
                    .get(fixes[0], "more loader processes, up to the cores per rank")) if fixes else None
    return Finding("SHARDS", "input_pipeline", "warn", f"input-bound: the loader delivered "
                   f"{pipe['delivered_images_per_s']:,.0f} images/s, the forward pass could take "
                   f"{'-' if not fwd else f'{fwd:,.0f}'}; the ranks waited for data {pipe['wait_share'] * 100:.0f} % of "
                   f"their loop{where}" + (f" (also fits: {', '.join(fixes[1:])})" if len(fixes) > 1 else ""), ev,
                   remedy=remedy)


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
                       "compares their logits on one batch)", ev, culprit=None if out["high"] else out["low"][0],
                       phase="forward")
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
                   culprit=out["low"][0], phase="forward")


def _no_results(run: Run) -> Finding:
    """Without results.json a run is healthy only while it is still running, which its driver's (or, under an
    external launcher, its ranks') process or heartbeat must show; a run that failed is judged by the checks
    that name why."""
    records = {r: s for r, s in run.statuses.items() if s}
    launch = run.launch or {}
    if launch.get("outcome") == "config_error" or (not records and run.launch is None):
        return Finding("RESULT", "sanity", "skipped", "no results.json (no rank ran)")
    if run.failed:
        return Finding("RESULT", "sanity", "skipped", "no results.json: the run failed before writing it (the other "
                       "checks say why)")
    phases = ", ".join(f"rank {r}: {s.get('phase')}" for r, s in sorted(records.items())) or "no status records"
    ev = [Evidence("results.json", "missing or unreadable")]
    if records and len(records) == run.world_size and all(s.get("phase") == "done" for s in records.values()):
        return Finding("RESULT", "sanity", "fail", "every rank recorded phase done but there is no results.json: it "
                       "was removed after the run or rank 0's write was lost", ev + [_status_ev(run, 0, "phase")],
                       phase="results")
    if launch.get("outcome") == "ok":
        return Finding("RESULT", "sanity", "fail", f"launch.json says ok but there is no results.json: it was removed "
                       f"after the run ({phases})", ev + [Evidence("launch.json", "ok", field="outcome")], phase="results")
    if launch.get("outcome") == "running":
        view = driver_view(run)
        if view.state == "alive":
            return Finding("RESULT", "sanity", "warn", f"no results.json yet: the driver is alive ({view.why}); the run "
                           f"is still running ({phases})", ev + view.evidence)
        return Finding("RESULT", "sanity", "skipped", "no results.json: the driver's state decides (INIT/launch)")
    views = {r: examine(s, f"ranks/rank{r}/status.json", 1.0) for r, s in records.items()
             if s.get("phase") not in ("done", "failed")}
    if views and all(v.state == "alive" for v in views.values()):
        return Finding("RESULT", "sanity", "warn", f"no results.json yet: every unfinished rank is alive; the run is "
                       f"still running ({phases})", ev + [e for v in views.values() for e in v.evidence][:6])
    gone = sorted(r for r, v in views.items() if v.state in ("dead", "stopped"))
    if gone:
        r = gone[0]
        return Finding("RESULT", "sanity", "fail", f"no results.json and rank {r} is {views[r].state}: {views[r].why} "
                       f"({phases})", ev + views[r].evidence, culprit=r, phase=records[r].get("phase"))
    found, more = what_was_found(run)
    return Finding("RESULT", "sanity", "unknown", f"no results.json, no rank recorded a failure, and the records do not "
                   f"tell whether the ranks still run. Found: {found}", ev + more, phase="running")


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
    # data.on_decode_error=skip: the samples that did not decode are left out, listed in results.json decode_errors
    skipped = int((res.get("decode_errors") or {}).get("skipped") or 0)
    if n is not None and m.get("num_samples") not in (None, n - left_out - skipped):
        problems.append(f"metrics.num_samples={m.get('num_samples')} but the dataset has {n}"
                        + (f" and {left_out} were excluded" if left_out else "")
                        + (f" and {skipped} did not decode (data.on_decode_error=skip)" if skipped else ""))
    if not res.get("exact", True):
        problems.append(f"the run is marked inexact (data.sampler={res.get('sampler')})")
    task = res.get("task") or {}
    if res.get("checkpoints"):  # a job of several checkpoints: each block is checked in its own results.json
        pass
    elif "main_metric" in task:  # the task names it (Task.main_metric)
        if task["main_metric"] not in m:
            problems.append(f"metrics holds no main metric (task {task.get('name')} names {task['main_metric']!r})")
    elif not any(k in m for k in ("top1", "AP", "auroc_macro", "accuracy")):  # records written before it was named
        problems.append("metrics holds no main metric (top1, AP or auroc_macro)")
    counted = sum(int(p.get("samples") or 0) for p in res.get("per_rank") or [])
    if res.get("exact", True) and (res.get("sampler") or "exact") == "exact" and n is not None and counted not in (n, n - skipped):
        problems.append(f"the ranks counted {counted} samples (per_rank[].samples) but the dataset has {n}")
    ev = [Evidence("results.json", str(m.get(k)), field=f"metrics.{k}") for k in ("top1", "AP", "auroc_macro") if k in m]
    if problems:
        return Finding("RESULT", "sanity", "fail", "; ".join(problems), ev or [Evidence("results.json", "present")],
                       phase="results")
    c = res.get("dataset", {}).get("num_classes") or 0
    if m.get("top1") is not None and c > 1 and float(m["top1"]) <= 1.5 / c:
        return Finding("RESULT", "sanity", "warn", f"top-1 {m['top1']:.4f} is at chance level for {c} classes: wrong "
                       "weights, a label mapping that does not match the model, or the wrong transform", ev)
    return Finding("RESULT", "sanity", "pass", "metric values are finite and in range, and count every sample"
                   + (f" but the {left_out} excluded with the outlier ranks" if left_out else "")
                   + (f" but the {skipped} that did not decode (data.on_decode_error=skip)" if skipped else ""), ev)


CHECKS: dict[str, list[Callable[[Run, dict | None], Finding]]] = {
    "INIT": [init_launch, init_scheduler, init_started, init_joined, init_config_agree, init_ranks_ran],
    "SHARDS": [shards_plan, shards_mesh, shards_coverage, shards_input_pipeline],
    "CONVERGENCE": [convergence_trials, convergence_flags, convergence_hardware, convergence_reference],
    "COMM": [comm_timeout, comm_tp_peers, comm_mesh_hang, comm_heartbeats, comm_mismatch, comm_stragglers,
             comm_links],
    "RESULT": [result_outliers, result_sanity],
}
