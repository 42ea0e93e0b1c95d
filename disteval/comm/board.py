"""Status records through the rendezvous store: liveness without a shared filesystem.

Every launched rank already reaches the launcher's TCPStore (``MASTER_ADDR:MASTER_PORT``: torchrun's agent
store, shared with the ranks), so it is the side channel every rank has. Each rank publishes its status record
(``disteval.job.records.StatusWriter``: phase, progress, heartbeat, error) under
``disteval/<run id>/<restart>/status/<rank>``; peers read it from there when the run directory is not one
shared folder (``detect_shared_filesystem``). The store is reached through a client of its own (not the
process group's), with the collectives' timeout, so that a heartbeat from the watchdog thread never waits
behind the main thread.
"""
from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Callable

import torch.distributed as dist


class StoreBoard:
    """One rank's view of every rank's status record in the rendezvous store.

    ``host``/``port``: the store (MASTER_ADDR/MASTER_PORT); ``rank``; ``timeout_s``: ``communication.timeout_s``,
    the longest wait for the other ranks (one store operation may take a quarter of it, 2..10 s). Raises RuntimeError
    (torch's) when the store cannot be reached."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        self.timeout = timedelta(seconds=float(timeout_s))  # waits for every rank (``agree``)
        # one store operation: a few seconds at most, so that a rank cut off from the store records it
        # (``on_error``) well before its collectives time out
        op_timeout = timedelta(seconds=max(2.0, min(float(timeout_s) / 4, 10.0)))
        self.op_timeout_s, self.endpoint = op_timeout.total_seconds(), f"{host}:{port}"
        client = dist.TCPStore(host, int(port), is_master=False, timeout=op_timeout, wait_for_workers=False)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.store = dist.PrefixStore(f"disteval/{run}/{attempt}", client)
        self._latest: dict | None = None
        self.on_error: Callable[[str], None] | None = None  # a publish failed: the store is unreachable
        self.on_recovered: Callable[[], None] | None = None
        self._wake = threading.Condition()
        self._sending_since: float | None = None  # monotonic start of the send in progress
        self._thread = threading.Thread(target=self._send_loop, name=f"disteval-board-rank{rank}", daemon=True)
        self._thread.start()
        # a TCPStore operation into a silent partition never returns (its timeout covers waits, not a lost
        # connection): a second thread notices a send that takes longer than the operation timeout
        self._monitor = threading.Thread(target=self._watch_sends, name=f"disteval-board-watch-rank{rank}",
                                         daemon=True)
        self._monitor.start()
        # peers' records are read by a thread of its own into a cache, for the same reason: a reader (the
        # watchdog, rank 0's peer watch in the main thread) must never block on a cut-off store
        self.watched: list[int] = list(range(world_size))
        self.poll_s = 0.25
        self._cache: dict[int, dict] = {}
        self._reader = threading.Thread(target=self._read_loop, name=f"disteval-board-read-rank{rank}", daemon=True)
        self._reader.start()

    @classmethod
    def from_env(cls, rank: int, world_size: int, timeout_s: float) -> "StoreBoard":
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank, world_size, timeout_s)

    def publish(self, record: dict) -> None:
        """Hand this rank's record (a JSON-able dict) to the sending thread, which puts the latest one in the
        store: the caller (the main thread, before a collective) never waits on the network, and a record
        superseded before it was sent is skipped."""
        with self._wake:
            self._latest = record
            self._wake.notify()

    def publish_now(self, record: dict, rank: int | None = None) -> None:
        """Put ``record`` in the store from this thread and wait for the store's answer (a ``set`` alone is
        not acknowledged: into a silent partition it would seem to succeed). Raises torch's error after the
        store's operation timeout. ``rank``: whose record it is (default this rank's; another's when a rank
        reports a dead neighbour on its node)."""
        key = f"status/{self.rank if rank is None else int(rank)}"
        self.store.set(key, json.dumps(record, default=str))
        self.store.check([key])

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                while self._latest is None:
                    self._wake.wait()
                record, self._latest = self._latest, None
            self._sending_since = time.monotonic()
            try:
                self.publish_now(record)
            except Exception as exc:  # noqa: BLE001 - the store is gone or slow: peers see this rank go stale
                if self.on_error is not None:
                    self.on_error(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
                continue
            finally:
                self._sending_since = None
            if self.on_recovered is not None:
                self.on_recovered()

    def _watch_sends(self) -> None:
        reported = False
        while True:
            time.sleep(min(1.0, self.op_timeout_s / 2))
            since = self._sending_since
            stuck = since is not None and time.monotonic() - since > self.op_timeout_s
            if stuck and not reported and self.on_error is not None:
                self.on_error(f"no answer from the rendezvous store at {self.endpoint} for "
                              f"{time.monotonic() - since:.0f} s (operation timeout {self.op_timeout_s:g} s)")
            reported = stuck

    def read_now(self, rank: int) -> dict | None:
        """Rank ``rank``'s last published record, from the store now (None when it has published none or the
        store answered with an error; may block while the store does not answer)."""
        key = f"status/{rank}"
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except (RuntimeError, ValueError):
            return None

    def read(self, rank: int) -> dict | None:
        """Rank ``rank``'s record as last read by the reading thread (every ``poll_s`` seconds, the ranks in
        ``watched``); never blocks. None until it was read once. A store that stops answering leaves the
        records as they were: the peers' heartbeats then look stale, and this rank's ``store_error`` says why."""
        return self._cache.get(rank)

    def _read_loop(self) -> None:
        while True:
            for r in list(self.watched):
                record = self.read_now(r)
                if record is not None:
                    self._cache[r] = record
            time.sleep(self.poll_s)

    def agree(self, name: str, value: str) -> list[str]:
        """Every rank's ``value`` for ``name`` (each rank sets its own, then waits for all; the store's timeout
        bounds the wait). A store round trip per rank, no collective of the process group."""
        self.store.set(f"{name}/{self.rank}", value)
        keys = [f"{name}/{r}" for r in range(self.world_size)]
        self.store.wait(keys, self.timeout)
        return [self.store.get(k).decode() for k in keys]


def detect_shared_filesystem(board: StoreBoard, read_file: Callable[[int], dict | None]) -> bool:
    """True when every rank sees every rank's own status.json in the run directory (one shared folder); False
    when some rank's records are on another node's disk (node-local run directories). Every rank gets the same
    answer (agreed through the store). ``read_file(rank)``: that rank's status.json as this rank sees it. Each
    rank must have put its record in the store first (``publish_now``)."""
    board.agree("published", "1")  # every rank's record is in the store
    mine = True
    for r in range(board.world_size):
        theirs, seen = board.read_now(r), read_file(r)
        if not theirs or not seen or (seen.get("pid"), seen.get("node")) != (theirs.get("pid"), theirs.get("node")):
            mine = False
            break
    return all(v == "1" for v in board.agree("sees_all", "1" if mine else "0"))
