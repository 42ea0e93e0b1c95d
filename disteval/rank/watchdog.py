"""Every rank's background watchdog: a heartbeat in its status record, the peers' heartbeats, the driver.

A rank's main thread can block for a long time in a collective (the final synchronisation waits for the
slowest rank). From outside, a rank that waits there and a rank that was stopped (SIGSTOP, a debugger, a
frozen node) look the same in their progress fields. The heartbeat tells them apart: a daemon thread
rewrites ``t_heartbeat`` in the rank's status.json every ``beat_s`` seconds in every phase, which a
waiting rank keeps doing and a stopped or dead one does not. The same thread

- watches its peers' heartbeats (rank 0 watches every rank, the others watch rank 0, so every stall is seen
  by some live rank with W reads per beat at most): a peer whose heartbeat has not changed for
  ``dist.heartbeat_timeout_s`` seconds (``disteval.common.liveness``) (measured on this rank's own monotonic clock,
  so clocks of other hosts do not
  matter) is the culprit of a stall. This rank records a ``PeerFailedError`` that ``blames`` it, with the
  evidence (its phase, the collective it was in, how stale), and exits, so that the launcher stops the run
  within about one timeout instead of the final synchronisation's longer one;
- watches the driver (``python -m disteval``'s process, or torchrun's agent): when it is gone (its process
  ended, or the rank was re-parented: ``launcher_gone``), the rank records a ``DriverDiedError`` and exits, so
  no rank outlives a killed driver.

Exiting from a thread uses ``os._exit`` after the record is written: the main thread may be blocked inside a
collective that nothing else can interrupt.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Callable

from disteval.common.liveness import LAUNCHER_PID_ENV
from disteval.errors import DistevalError
from disteval.rank.peers import PeerFailedError
from disteval.job.records import StatusWriter, pid_alive, read_status

log = logging.getLogger("disteval.rank")


class DriverDiedError(DistevalError):
    """The process that launched this rank is gone (killed or crashed); the rank stopped itself."""


class StalledPeerError(DistevalError):
    """A peer's heartbeat stopped (it was stopped, froze or died silently). ``blames`` is that peer's rank;
    ``evidence`` {rank, phase, in_collective, stale_s, t_heartbeat} what it rests on. Recorded under the type
    name ``PeerFailedError`` by ``Watchdog`` (a victim's error, see ``disteval.rank.peers``)."""

    def __init__(self, blames: int, message: str, evidence: dict):
        self.blames, self.evidence = blames, evidence
        super().__init__(message)


class Watchdog:
    """The thread described in the module docstring. ``status``: a callable returning this rank's current
    StatusWriter (it may be replaced when external launchers agree on a run directory); ``run_dir``: a callable
    returning the current run directory; ``rank``/``world_size``; ``timeout_s`` (seconds without a heartbeat
    that make a peer stalled); ``beat_s`` (seconds between beats); ``parent_pid``: the launcher's pid to watch
    (None: none); ``timeout_key``: the config key that set ``timeout_s``, named in the error. ``on_fatal(exc)``
    records the error and ends the process (default: ``status().fail`` then
    ``os._exit(1)``)."""

    def __init__(self, status: Callable[[], StatusWriter], run_dir: Callable[[], str], rank: int, world_size: int,
                 timing: tuple[float, float], parent_pid: int | None = None):
        self.status, self.run_dir, self.rank, self.world_size = status, run_dir, rank, world_size
        self.timeout_s, self.beat_s = timing
        self.parent_pid = parent_pid
        self.timeout_key = "dist.heartbeat_timeout_s"
        self.on_fatal: Callable[[BaseException], None] = self._die
        # a peer's record: its status.json by default; RankContext.read_peer (the rendezvous store when the run
        # directory is node-local) for launched ranks
        self.read: Callable[[int], dict | None] = lambda r: read_status(self.run_dir(), r)
        self._seen: dict[int, tuple[float, float]] = {}  # peer -> (last heartbeat value, monotonic time it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"disteval-watchdog-rank{rank}", daemon=True)

    def start(self) -> "Watchdog":
        self.status().update(heartbeat_s=self.beat_s, force=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.beat_s):
            self.status().beat()
            try:
                self.check()
            except (DriverDiedError, StalledPeerError) as exc:
                if not self._stop.is_set():
                    self.on_fatal(exc)
                return

    def peers(self) -> list[int]:
        """The ranks this rank watches: all others on rank 0, rank 0 elsewhere."""
        return [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]

    def check(self) -> None:
        """Raise DriverDiedError or StalledPeerError (see the module docstring)."""
        if self.parent_pid and launcher_gone(self.parent_pid):
            raise DriverDiedError(f"the process that launched rank {self.rank} (pid {self.parent_pid}) is gone "
                                  f"(killed or crashed): rank {self.rank} stops itself; no results are written")
        now = time.monotonic()
        for r in self.peers():
            s = self.read(r)
            if not s or s.get("phase") in ("done", "failed") or s.get("t_heartbeat") is None:
                continue
            beat = float(s["t_heartbeat"])
            last = self._seen.get(r)
            if last is None or last[0] != beat:
                self._seen[r] = (beat, now)
                continue
            if now - last[1] > self.timeout_s:
                raise self._stalled(r, s, now - last[1])

    def _stalled(self, r: int, s: dict, stale: float) -> StalledPeerError:
        coll = s.get("in_collective") or {}
        where = f" waiting in {coll.get('op')}" if coll else ""
        mine = self.status().record
        evidence = {"rank": r, "phase": s.get("phase"), "in_collective": coll or None, "stale_s": round(stale, 1),
                    "t_heartbeat": s.get("t_heartbeat"), "samples_done": s.get("samples_done"),
                    "samples_planned": s.get("samples_planned")}
        return StalledPeerError(r, f"rank {r} stopped making progress: its heartbeat has not changed for {stale:.0f} s "
                                f"({self.timeout_key}={self.timeout_s:g}) in phase {s.get('phase')!r}{where}, "
                                f"after {s.get('samples_done')}/{s.get('samples_planned')} samples last recorded; the process was "
                                f"stopped, froze or died silently (rank {self.rank}, in phase {mine.get('phase')!r}, "
                                "was waiting for it)", evidence)

    def _die(self, exc: BaseException) -> None:
        recorded = PeerFailedError(exc.blames, str(exc), exc.evidence) if isinstance(exc, StalledPeerError) else exc
        self.status().fail(recorded)
        log.error("%s: %s", type(recorded).__name__, exc)
        for handler in log.handlers:
            handler.flush()
        os._exit(1)


def parent_to_watch(launched: bool) -> int | None:
    """The launcher process to watch for a rank started by one (``launched``): ``python -m disteval``'s driver
    (named by ``DISTEVAL_LAUNCHER_PID``: its ranks are forks of its fork server), else the rank's parent, i.e.
    torchrun's agent or srun's step daemon. None for a single process without a launcher, or when the parent is
    already init (the launcher died before)."""
    if not launched:
        return None
    named = os.environ.get(LAUNCHER_PID_ENV, "")
    if named.isdigit() and int(named) not in (os.getpid(), 0):
        return int(named)
    ppid = os.getppid()
    return ppid if ppid > 1 else None


def launcher_gone(pid: int) -> bool:
    """Whether the launcher ``pid`` (from ``parent_to_watch``) is gone: its process ended (a zombie counts), or,
    when it was this rank's parent, this rank was re-parented (the pid may already belong to another process)."""
    named = os.environ.get(LAUNCHER_PID_ENV) == str(pid)
    return not pid_alive(pid) or (not named and os.getppid() != pid)


def record_driver_death(parent_pid: int | None) -> None:
    """Make SIGINT raise DriverDiedError when this rank's launcher is gone. torch's process start asks the kernel
    to send a rank SIGINT when its parent dies (PR_SET_PDEATHSIG), so a killed torchrun agent reaches the rank
    as an interrupt (a disteval driver's ranks are children of its fork server, which outlives the driver: their
    watchdog notices instead); it is then recorded as what it is, and later SIGINTs are ignored (the kernel sends one per exiting
    thread of the launcher). A SIGINT with the launcher alive stays a KeyboardInterrupt. Main thread only."""
    if not parent_pid:
        return

    def handler(signum, frame):
        deadline = time.monotonic() + 0.5  # the signal can arrive before the kernel re-parents this rank
        while not launcher_gone(parent_pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        if launcher_gone(parent_pid):
            # The kernel sends PDEATHSIG each time this rank is re-parented, i.e. once per exiting thread of the
            # dying launcher: a second SIGINT milliseconds later would raise again inside the except block that
            # records this error, and the rank would die with no record. One is enough.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            raise DriverDiedError(f"the process that launched this rank (pid {parent_pid}) is gone (killed or "
                                  "crashed): the rank stops itself; no results are written")
        signal.default_int_handler(signum, frame)

    signal.signal(signal.SIGINT, handler)
