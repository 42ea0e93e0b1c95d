"""Naming the rank that caused a failed run, from every rank's status.json (not a peer's network error).

Rule (DESIGN.md): the culprit is the rank with the earliest error of its own (not a consequence: a network
error, an error that ``blames`` a peer, or a ``DriverDiedError``); else the rank a victim blamed (a peer
names a rank whose heartbeat or progress stopped, or whose status said failed) unless that rank's own record
shows it was itself a victim before it was blamed (a network error recorded earlier) or that it was waiting
in a blocking collective (``in_collective``) while its heartbeat stayed fresh (alive and waiting, not
stalled); else the rank whose heartbeat stopped first, clearly before every other rank's last sign of life
(stopped, frozen or dead); else, when every error is a ``DriverDiedError``, no rank (the driver died); else a
rank that died (killed by a signal, non-zero exit) without recording any error, the one whose heartbeat
stopped first; else a rank that stopped in init/data/forward/sync without recording an error while its peers
failed, the one whose progress stopped first, never one waiting in a collective with a fresh heartbeat:
late (its heartbeat was fresh when the first peer timed out; the message names the timeout that fired) or
died silently or hung; else a rank that never started; else, when every rank recorded a consequence, the
rank that had not finished its shard while others had (the slow one they waited for); else the earliest
network error. A rank that recorded an interrupt (SIGINT/SIGTERM) while its peers did not is the culprit after
the blamed rank (a signal sent to it alone). Records without heartbeat fields (older runs) skip the heartbeat parts of the rule.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from disteval.common.liveness import beat_lag
from disteval.job.records import INTERRUPT_TYPES, is_network_error, read_status, recorded_progress


@dataclass
class Culprit:
    """The failing rank and a one-line explanation (its own error type and message, or how it died)."""

    rank: int | None
    message: str
    traceback: str = ""


def find_culprit(run_dir: str, world_size: int, deaths: dict[int, str] | None = None) -> Culprit:
    """Choose the culprit from RUN_DIR's status records. ``deaths`` maps rank -> how the launcher saw it end
    (e.g. "killed by SIGKILL")."""
    return culprit_from_records({r: read_status(run_dir, r) for r in range(world_size)}, deaths)


def culprit_from_records(records: dict[int, dict | None], deaths: dict[int, str] | None = None) -> Culprit:
    """The rule of the module docstring on status records already read ({rank: record or None} for every rank
    0..W-1; None = no readable record)."""
    deaths = deaths or {}
    errors = [(s["error"].get("time", s.get("t_update", 0.0)), r, s) for r, s in records.items()
              if s and s.get("error")]
    own = sorted(e for e in errors if not is_consequence(e[2]["error"]))
    if own:
        _, r, s = own[0]
        err = s["error"]
        return Culprit(r, f"rank {r} failed: {err['type']}: {err['message']}", err.get("traceback", ""))
    blamed = _blamed(records, errors)
    if blamed is not None:
        r, err = blamed
        return Culprit(r, err["message"], err.get("traceback", ""))
    interrupted = sorted(e for e in errors if e[2]["error"].get("type") in INTERRUPT_TYPES)
    if interrupted and len(interrupted) < len(records):  # a signal sent to some ranks, not Ctrl-C on the whole run
        _, r, s = interrupted[0]
        err = s["error"]
        return Culprit(r, f"rank {r} was interrupted from outside ({err['type']}: {str(err['message'])[:200]}): a "
                          "signal (SIGINT/SIGTERM) reached that rank's process alone, not the run", err.get("traceback", ""))
    first = heartbeat_stopped_first(records)
    if first is not None:
        r, gap = first
        if deaths.get(r):  # the launcher saw how it ended: say that, not only that it fell silent
            return Culprit(r, f"rank {r} {deaths[r]} without recording an error, in {recorded_progress(records[r], True)} "
                              f"(its heartbeat stopped {gap:.0f} s before any other rank's last sign of life)")
        return Culprit(r, f"rank {r}'s heartbeat stopped first, {gap:.0f} s before any other rank's last sign of "
                          f"life, in {recorded_progress(records[r])}: the process was stopped, froze or died")
    if errors and all(e[2]["error"].get("type") in CONSEQUENCE_TYPES for e in errors) and not deaths:
        return Culprit(None, "the driver died: every rank that recorded an error stopped itself "
                             f"({errors[0][2]['error']['type']}: {str(errors[0][2]['error']['message'])[:200]})")
    silent = sorted((r for r in deaths if not (records.get(r) or {}).get("error")), key=lambda r: _stop_key(records, r))
    if silent:
        r = silent[0]
        s = records.get(r)
        where = f"in {recorded_progress(s, True)}" if s else "before writing any status record"
        return Culprit(r, f"rank {r} {deaths[r]} without recording an error, {where}")
    never = [r for r, s in records.items() if s is None]
    if never:
        return Culprit(never[0], f"rank {never[0]} never started (no status record)")
    latest = max((_last_sign(s) for s in records.values() if s), default=0.0)
    stalled = sorted((r for r, s in records.items() if s and not s.get("error")
                      and s.get("phase") in STALL_PHASES and not waiting_in_collective(s, latest)),
                     key=lambda r: (float(records[r].get("t_progress") or records[r].get("t_update") or 0.0), r))
    if errors and stalled:
        first = sorted(errors)[0][2]["error"]
        if _PEER_CLOSED.search(str(first.get("message"))):
            # a peer's connection was closed: a process died (a timeout is what a late rank causes); of the ranks
            # without an error, the one whose last sign of life (heartbeat or progress, whichever came later)
            # ended first died first: its node-mates lived on until their launcher stopped them. (Heartbeats alone,
            # one a second, order two deaths a few milliseconds apart by chance.)
            stalled.sort(key=lambda r: (_last_sign(records[r]), r))
        r = stalled[0]
        s = records[r]
        if late_not_stalled(s, first) and not _PEER_CLOSED.search(str(first.get("message"))):
            return Culprit(r, late_message(r, s, sorted(errors)[0][1], first))
        return Culprit(r, f"rank {r} stopped making progress without recording an error ({recorded_progress(s)}): "
                          f"it died or hung, and its peers failed waiting for it "
                          f"({first['message'][:200]})")
    return _slowest_or_first(records, errors, deaths)


def _slowest_or_first(records: dict[int, dict | None], errors: list, deaths: dict[int, str]) -> Culprit:
    """The last rules: every rank recorded a consequence; the one that had not finished its shard while others
    had (they waited for it in the synchronisation and timed out) is the slow one; else the first error."""
    lag = sorted((float(s.get("samples_done") or 0) / max(1, int(s.get("samples_planned") or 1)), r)
                 for _, r, s in errors if s.get("samples_planned") and (s.get("samples_done") or 0) < s["samples_planned"])
    finished = [r for _, r, s in errors if s.get("samples_planned") and (s.get("samples_done") or 0) >= s["samples_planned"]]
    if lag and finished:
        r = lag[0][1]
        return Culprit(r, f"rank {r} was the slowest: it had not finished its shard ({recorded_progress(records[r])}) "
                          f"while rank(s) {finished} had and failed waiting for it "
                          f"({records[finished[0]]['error']['message'][:200]})")
    if errors:
        _, r, s = sorted(errors)[0]
        err = s["error"]
        return Culprit(r, f"rank {r} failed: {err['type']}: {err['message']}", err.get("traceback", ""))
    return Culprit(None, "the run failed but no rank recorded an error: " + "; ".join(
        f"rank {r} {how}" for r, how in sorted(deaths.items())) if deaths else "the run failed")


_PEER_CLOSED = re.compile(r"Connection (closed|reset) by peer|ECONNRESET|Broken pipe", re.I)
STALL_PHASES = ("init", "data", "forward", "sync")  # where a rank without an error can keep its peers waiting


def late_not_stalled(record: dict, peer_error: dict) -> bool:
    """The rank (no error of its own) was alive when its peer's timeout fired: its heartbeat was fresh at the
    peer's error (``peer_error['time']``). A late rank, not a stopped one."""
    beat, when = record.get("t_heartbeat"), peer_error.get("time")
    return isinstance(beat, (int, float)) and isinstance(when, (int, float)) and float(beat) >= float(when) - _beat_gap(record)


def late_message(rank: int, record: dict, victim: int, peer_error: dict) -> str:
    """Why a live rank is the culprit of its peers' timeout: it had not reached the collective they waited in,
    and which timeout (config key and seconds) ran out."""
    limit = (f"{peer_error['timeout_key']} = {peer_error['timeout_s']:g} s" if peer_error.get("timeout_key")
             else "the collective timeout")
    op = peer_error.get("op") or "a collective"
    return (f"rank {rank} was late: alive (its heartbeat was fresh) but still in {recorded_progress(record)} when rank "
            f"{victim} gave up waiting for it in {op} after {limit}; "
            f"rank {victim}'s error: {peer_error['type']}: {str(peer_error['message'])[:200]}")


def _blamed(records: dict[int, dict | None], errors: list[tuple]) -> tuple[int, dict] | None:
    """(rank, the blaming error) of the earliest blame that stands: the blamed rank's record shows neither that
    it was itself a victim before (a network error recorded earlier) nor that it waited in a collective with a
    fresh heartbeat when it was blamed."""
    def victim_before(blamed_rank: int, when: float) -> bool:
        err = (records.get(blamed_rank) or {}).get("error")
        return bool(err) and is_network_error(err) and float(err.get("time", when)) <= when

    blames = sorted((when, int(s["error"]["blames"]), r) for when, r, s in errors
                    if s["error"].get("blames") is not None)
    for when, blamed_rank, r in blames:
        if not victim_before(blamed_rank, when) and not waiting_in_collective(records.get(blamed_rank), when):
            return blamed_rank, records[r]["error"]
    return None


CONSEQUENCE_TYPES = frozenset({"DriverDiedError"})  # a rank that stopped itself because its launcher died


def is_consequence(error: dict | None) -> bool:
    """A victim's error: a peer's failure seen through the network, an error that ``blames`` a peer, or the
    driver's death (``DriverDiedError``). Everything else is the rank's own."""
    return bool(error) and (is_network_error(error) or error.get("blames") is not None
                            or error.get("type") in CONSEQUENCE_TYPES)


def _beat_gap(record: dict) -> float:
    """Seconds by which the record's heartbeat must lag to count as stopped (``disteval.common.liveness.beat_lag``)."""
    return beat_lag(record.get("heartbeat_s"))


def _last_sign(record: dict) -> float:
    """The last time the rank is known to have been alive: its heartbeat, progress, or recorded error."""
    times = [record.get("t_heartbeat"), record.get("t_progress"), (record.get("error") or {}).get("time")]
    return max((float(t) for t in times if isinstance(t, (int, float))), default=float(record.get("t_update") or 0.0))


def _stop_key(records: dict[int, dict | None], r: int) -> tuple:
    s = records.get(r) or {}
    beat = s.get("t_heartbeat")
    return (beat is None, float(beat or 0.0), r)


def waiting_in_collective(record: dict | None, when: float) -> bool:
    """The rank was waiting in a blocking collective (``in_collective``, entered before ``when``) with its
    heartbeat still fresh at ``when``: alive and waiting for others, so not the rank that stalled."""
    if not record or not record.get("in_collective") or not isinstance(record.get("t_heartbeat"), (int, float)):
        return False
    since = (record.get("in_collective") or {}).get("since")
    if isinstance(since, (int, float)) and since > float(when):  # it entered the collective only afterwards (a
        return False                                              # frozen rank that was thawed)
    return float(record["t_heartbeat"]) >= float(when) - _beat_gap(record)


def heartbeat_stopped_first(records: dict[int, dict | None]) -> tuple[int, float] | None:
    """(rank, seconds) of the rank whose heartbeat stopped clearly before every other rank's last sign of life
    (by more than ``_beat_gap``), among ranks that recorded heartbeats, did not finish and recorded no error of
    their own; None when no rank stands out (or the records predate heartbeats)."""
    lives = {r: _last_sign(s) for r, s in records.items()
             if s and isinstance(s.get("t_heartbeat"), (int, float)) and s.get("phase") != "done"
             and (not s.get("error") or is_consequence(s["error"]))}
    if len(lives) < 2:
        return None
    order = sorted(lives, key=lambda r: (lives[r], r))
    r, nxt = order[0], order[1]
    gap = lives[nxt] - lives[r]
    s = records[r]
    if s.get("error") or gap <= _beat_gap(s):  # a rank that recorded an error was alive when it did
        return None
    return r, gap
