"""Naming the rank that caused a failed run, from every rank's status.json (not a peer's network error).

Rule (DESIGN.md): the culprit is the rank with the earliest non-network error; else the rank a victim
blamed (rank 0 names a peer whose status stopped updating or said failed) unless that rank's own record
shows it was itself a victim before it was blamed (a network error recorded earlier); else a rank that died
(killed by a signal, non-zero exit) without recording any error; else a rank that stopped in
init/data/forward without recording an error while its peers failed (died silently or hung); else a rank
that never started; else, when every rank recorded a consequence, the rank that had not finished its shard
while others had (the slow one they waited for); else the earliest network error.
"""
from __future__ import annotations

from dataclasses import dataclass

from disteval.records import is_network_error, read_status, recorded_progress


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
    own = sorted(e for e in errors if not is_network_error(e[2]["error"]))
    if own:
        _, r, s = own[0]
        err = s["error"]
        return Culprit(r, f"rank {r} failed: {err['type']}: {err['message']}", err.get("traceback", ""))
    def _victim_before(blamed_rank: int, when: float) -> bool:
        err = (records.get(blamed_rank) or {}).get("error")
        return bool(err) and is_network_error(err) and float(err.get("time", when)) <= when

    blamed = sorted((e[0], e[2]["error"]["blames"], e[2]) for e in errors if e[2]["error"].get("blames") is not None
                    and not _victim_before(int(e[2]["error"]["blames"]), e[0]))
    if blamed:
        _, r, s = blamed[0]
        return Culprit(r, s["error"]["message"], s["error"].get("traceback", ""))
    silent = [r for r in sorted(deaths) if not (records.get(r) or {}).get("error")]
    if silent:
        r = silent[0]
        s = records.get(r)
        where = f"in {recorded_progress(s)}" if s else "before writing any status record"
        return Culprit(r, f"rank {r} {deaths[r]} without recording an error, {where}")
    never = [r for r, s in records.items() if s is None]
    if never:
        return Culprit(never[0], f"rank {never[0]} never started (no status record)")
    stalled = [r for r, s in records.items() if s and not s.get("error") and s.get("phase") in ("init", "data", "forward")]
    if errors and stalled:
        r = stalled[0]
        s = records[r]
        return Culprit(r, f"rank {r} stopped making progress without recording an error ({recorded_progress(s)}): "
                          f"it died or hung, and its peers failed waiting for it "
                          f"({sorted(errors)[0][2]['error']['message'][:200]})")
    # every rank recorded a consequence: the one that had not finished its shard while others had (they waited
    # for it in the synchronisation and timed out) is the slow one
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
