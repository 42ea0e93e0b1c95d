"""When is a process silent, and which timeout says so: the one liveness rule of disteval, used by every
rank's watchdog (``disteval.rank.watchdog``), rank 0's peer watch (``disteval.rank.peers``), the launchers' culprit
rule (``launchers.culprit``) and the doctor (``diagnostics``).

Three timeouts, one meaning each:

- ``dist.heartbeat_timeout_s`` (null: ``communication.timeout_s``): a process whose heartbeat has not changed
  for that long is silent (stopped, frozen, dead). A live peer's watchdog judges it on its own monotonic clock
  (``heartbeat_timeout``); ranks beat every ``beat_interval`` seconds.
- ``data.loader_timeout_s``: a rank waiting that long for one batch from its loader workers raises a
  ``DataError`` naming the batch. A rank that waits for its loader says so in its record (``t_data_wait``),
  and rank 0 leaves such a peer to its own loader timeout (``progress_limit``), so a stalled loader gives the
  same error on rank 0 and on any other rank.
- ``communication.timeout_s``: one collective; and rank 0's wait for a peer that is alive but makes no
  progress outside its loader (a step slower than a collective may take).

Heartbeats compared with each other (two records of one run: the culprit rule, a peer's message) count as
stopped when one lags by more than ``beat_lag``: three beats, at least ``LAG_FLOOR_S`` (a loaded machine
delays a beat by a second or so). A reader that judges a record later against its own clock (the doctor,
possibly on another host, minutes after the run) calls it stale after ``stale_after``: three beats, at
least ``STALE_FLOOR_S`` (a doctor started while the run still beats must not call it dead because its own
start-up took a few seconds).
"""
from __future__ import annotations

import os
from pathlib import Path

BEATS = 3                  # missed beats that make a heartbeat stopped or stale
LAG_FLOOR_S = 2.0          # the least lag between two records' heartbeats that counts as stopped
STALE_FLOOR_S = 10.0       # the least age of a heartbeat that a later reader calls stale
RANK_HEARTBEAT_S = 1.0     # a rank's beat period when its record does not say
DRIVER_HEARTBEAT_S = 2.0   # launch.json's beat period when the record does not say
LAUNCHER_PID_ENV = "DISTEVAL_LAUNCHER_PID"  # the driver's pid, for ranks it forked through a fork server (their
                                           # parent is that server, not the driver: ``launchers.local.fork_server``)
WORKER_STOP_S = 5.0        # torch's MP_STATUS_CHECK_INTERVAL: a rank whose loader timed out waits this long for its
                           # stuck worker to stop before its DataError propagates and is recorded


def heartbeat_timeout(heartbeat_timeout_s: float | None, collective_timeout_s: float) -> float:
    """Seconds without a heartbeat that make a peer silent: ``dist.heartbeat_timeout_s``, or when that is null
    ``communication.timeout_s`` (a silent process is noticed no later than a collective would time out)."""
    return float(collective_timeout_s if heartbeat_timeout_s is None else heartbeat_timeout_s)


def heartbeat_timeout_key(heartbeat_timeout_s: float | None) -> str:
    """The config key that set the heartbeat timeout (for messages): ``dist.heartbeat_timeout_s`` or, when it
    is null, ``communication.timeout_s``."""
    return "communication.timeout_s" if heartbeat_timeout_s is None else "dist.heartbeat_timeout_s"


def beat_interval(timeout_s: float, status_interval_s: float) -> float:
    """Seconds between heartbeats: at most the status interval and a fifth of the heartbeat timeout, at
    least 0.1."""
    return max(0.1, min(float(status_interval_s), float(timeout_s) / 5.0))


def beat_lag(heartbeat_s: float | None) -> float:
    """Seconds by which a heartbeat must lag another record's sign of life to count as stopped:
    ``BEATS`` beats of ``heartbeat_s`` (``RANK_HEARTBEAT_S`` when unrecorded), at least ``LAG_FLOOR_S``."""
    return max(BEATS * float(heartbeat_s or RANK_HEARTBEAT_S), LAG_FLOOR_S)


def stale_after(heartbeat_s: float | None, default_s: float = RANK_HEARTBEAT_S) -> float:
    """Seconds after which a later reader calls a heartbeat stale: ``BEATS`` beats of ``heartbeat_s``
    (``default_s`` when unrecorded), at least ``STALE_FLOOR_S``."""
    return max(BEATS * float(heartbeat_s or default_s), STALE_FLOOR_S)


def progress_limit(record: dict, collective_timeout_s: float, loader_timeout_s: float | None) -> tuple[float, str]:
    """(seconds, the config key behind them) that rank 0 lets a live peer go without progress. A peer waiting
    for its loader workers (``t_data_wait`` set, workers with a ``data.loader_timeout_s``) gets its own loader
    timeout, the time torch takes to stop its stuck worker (``WORKER_STOP_S``) and one collective timeout for
    its DataError to arrive; any other stall, one ``communication.timeout_s``."""
    if record.get("t_data_wait") is not None and loader_timeout_s is not None:
        return (float(loader_timeout_s) + WORKER_STOP_S + float(collective_timeout_s),
                f"data.loader_timeout_s + {WORKER_STOP_S:g} s + communication.timeout_s")
    return float(collective_timeout_s), "communication.timeout_s"


def process_state(pid: int) -> str | None:
    """The state letter of process ``pid`` on this machine (R, S, D, T stopped, Z zombie, ...), "?" when it
    exists but /proc cannot say, None when there is no such process."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    except (OverflowError, ValueError):
        return None
    try:
        return Path(f"/proc/{int(pid)}/stat").read_text().rsplit(") ", 1)[1][:1]
    except (OSError, IndexError):
        return "?"
