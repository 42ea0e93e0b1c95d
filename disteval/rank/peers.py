"""Rank 0 watching its peers through their status records, with no collective: a failed, stalled or
missing peer is named (as the culprit) within one timeout, while rank 0 evaluates and while it waits for
the others to reach the synchronisation."""
from __future__ import annotations

import time

from disteval.common.liveness import beat_lag, progress_limit
from disteval.errors import DistevalError
from disteval.job.records import read_status, recorded_progress, relay_records


class PeerFailedError(DistevalError):
    """Rank 0, waiting for its peers before the synchronisation, saw a peer fail or stall. A victim's error:
    ``blames`` is the peer's rank (the culprit)."""

    def __init__(self, blames: int, message: str, evidence: dict | None = None):
        self.blames, self.evidence = blames, evidence
        super().__init__(message)


class PeerWatch:
    """Rank 0's view of its peers through their status records (no collective): feeds the progress display
    and raises PeerFailedError when a peer's record says ``failed`` (quoting its error), has not changed for
    ``timeout_s`` seconds (``communication.timeout_s``: hung on I/O, deadlocked, one step slower than a
    collective may wait), or never appeared, so that a stalled rank is named within one timeout, while rank 0
    is still evaluating as well as while it waits to synchronise. A peer that waits for its loader workers is
    left to its own ``loader_timeout_s`` (``disteval.common.liveness.progress_limit``; None: the loader has no
    timeout, with data.num_workers=0), so that its DataError names the batch as rank 0's own would."""

    def __init__(self, run_dir: str, world_size: int, timeout_s: float, progress, started: float,
                 every_s: float = 0.5):
        self.run_dir, self.world_size, self.timeout_s = run_dir, world_size, timeout_s
        self.loader_timeout_s: float | None = None
        self.progress, self.started, self.every_s = progress, started, every_s
        self._last = 0.0
        self.read = lambda r: read_status(self.run_dir, r)  # RankContext.read_peer for launched ranks
        self.relay_to: tuple[str, str] | None = None  # (run_dir, this node's id): copy other nodes' records here

    def check(self) -> list[dict | None]:
        """Read every record, refresh the display, raise on a failed, stalled or missing peer."""
        records = [self.read(r) for r in range(self.world_size)]
        if self.relay_to is not None:
            relay_records(self.relay_to[0], records, self.relay_to[1])
        now = time.time()
        for r, s in enumerate(records):
            if s and s.get("phase") == "failed":
                err = s.get("error") or {}
                raise PeerFailedError(r, f"rank {r} failed before the synchronisation: {err.get('type')}: "
                                         f"{err.get('message')}")
            if s and s.get("phase") not in ("sync", "done"):
                self._check_progress(r, s, now)
        missing = [r for r, s in enumerate(records) if s is None]
        if missing and now - self.started > self.timeout_s:
            raise PeerFailedError(missing[0], f"rank {missing[0]} never wrote a status record")
        if self.progress:
            self.progress.refresh_from(records)
        return records

    def _check_progress(self, r: int, s: dict, now: float) -> None:
        """Raise PeerFailedError when peer ``r`` (record ``s``) made no progress for longer than its limit."""
        limit, key = progress_limit(s, self.timeout_s, self.loader_timeout_s)
        if now - float(s.get("t_progress", s.get("t_update", now))) <= limit:
            return
        beat_age = now - float(s.get("t_heartbeat") or now)
        waiting = " waiting for its data loader" if s.get("t_data_wait") is not None else ""
        alive = ("its heartbeat is fresh: the process is alive but stuck (a hung data loader, a deadlock, or one "
                 "step slower than the timeout)" if beat_age < beat_lag(s.get("heartbeat_s")) else
                 "its heartbeat stopped too: the process was stopped, froze or died silently")
        raise PeerFailedError(r, f"rank {r} stopped making progress: its progress has not changed for {limit:g} s "
                                 f"({key}){waiting} in {recorded_progress(s)}; {alive}",
                              {"rank": r, "phase": s.get("phase"), "t_progress": s.get("t_progress"),
                               "t_heartbeat": s.get("t_heartbeat"), "heartbeat_age_s": round(beat_age, 1),
                               "t_data_wait": s.get("t_data_wait")})

    def maybe_check(self) -> None:
        """``check()`` at most every ``every_s`` seconds (called after each of rank 0's batches)."""
        if time.monotonic() - self._last >= self.every_s:
            self._last = time.monotonic()
            self.check()

    def wait_all_in_sync(self) -> None:
        """Poll until every rank reached ``sync`` (or raise as ``check`` does). The poll interval starts at
        5 ms and doubles up to 0.2 s, so that rank 0 loses at most about the time it already waited (a fixed
        0.2 s cost a W=2 pass of a few seconds up to 10 %, benchmarks/throughput.py) while a long wait reads
        the W records five times a second."""
        delay = 0.005
        while not all(s and s.get("phase") in ("sync", "done") for s in self.check()):
            time.sleep(delay)
            delay = min(2 * delay, 0.2)
