"""Exceptions of disteval. Each names what the user must look at: a config key, a file, a rank, a sample id."""
from __future__ import annotations


class DistevalError(Exception):
    """Base class: an error with a message meant for the user (printed without a traceback by the CLI)."""


class ConfigError(DistevalError):
    """A configuration value is invalid. ``key`` is the dotted config key (e.g. ``data.root``)."""

    def __init__(self, key: str, message: str):
        self.key = key
        super().__init__(f"{key}: {message}")


class PreflightProblems(ConfigError):
    """Several independent problems found before any rank started (``disteval.common.problems.Problems``), reported
    together so that one try shows them all. ``problems``: the DistevalErrors in the order found; ``key``: the
    first one's config key (a DataError or CheckpointError without one: ``config``)."""

    def __init__(self, problems: list[DistevalError]):
        self.problems = list(problems)
        listed = " ".join(f"({i}) {p}" for i, p in enumerate(self.problems, 1))
        self.key = getattr(self.problems[0], "key", None) or "config"
        DistevalError.__init__(self, f"{len(self.problems)} problems, found before any rank started: {listed}")


class DataError(DistevalError):
    """Bad input data: a label out of range, non-finite logits, an unreadable file. Names the sample id
    (also as the attribute ``sample_id`` where one sample is at fault, else None)."""

    def __init__(self, *args: object, sample_id: int | None = None):
        super().__init__(*args)
        self.sample_id = sample_id


class CheckpointError(DistevalError):
    """A checkpoint is unreadable, not a plain state dict, or does not fit the model. Names file and parameter."""


class CoverageError(DistevalError):
    """After synchronisation some sample ids in [0, N) were not counted exactly once."""


class RankFailedError(DistevalError):
    """A rank of a distributed run failed. ``rank`` is the culprit (earliest non-network error)."""

    def __init__(self, rank: int | None, message: str, deaths: dict[int, str] | None = None):
        self.rank = rank
        self.deaths = deaths or {}  # rank -> how the launcher saw it end ("was killed by SIGKILL")
        super().__init__(message)


class RankDiedError(DistevalError):
    """A rank's process ended without recording an error (killed, crashed). Recorded on its behalf, in the
    rendezvous store, by a rank on the same node that saw its process gone (``RankContext.share_failure``), so
    that the other nodes of a run without a shared run directory can name it."""


class RunInterrupted(DistevalError):
    """The driver received SIGINT/SIGTERM/SIGHUP; every rank was stopped. ``signal_name`` e.g. "SIGINT"."""

    def __init__(self, signal_name: str):
        self.signal_name = signal_name
        super().__init__(f"interrupted by {signal_name}: all ranks were stopped, no results were written")


class DiskFullError(DistevalError, OSError):
    """A record could not be written: no space left on the device (ENOSPC) or the disk quota is exhausted
    (EDQUOT). ``path`` is the file being written, ``bytes_needed`` the size of what was being written (bytes),
    ``free_bytes`` the space the filesystem reported free afterwards (bytes; None when unknown)."""

    def __init__(self, path: str, bytes_needed: int, free_bytes: int | None, errno_name: str = "ENOSPC"):
        self.path, self.bytes_needed, self.free_bytes, self.errno_name = str(path), int(bytes_needed), free_bytes, errno_name
        what = "no space left on device" if errno_name == "ENOSPC" else "disk quota exceeded"
        free = f", {free_bytes:,} bytes free on that filesystem" if free_bytes is not None else ""
        super().__init__(f"{what} ({errno_name}) writing {path}: it needed {bytes_needed:,} bytes{free}; free space "
                         "there or choose another hydra.run.dir")

    def details(self) -> dict:
        """The fields recorded beside the message in status.json / launch.json."""
        return {"errno": self.errno_name, "path": self.path, "bytes_needed": self.bytes_needed,
                "free_bytes": self.free_bytes}


class RendezvousError(DistevalError):
    """This node could not meet the other nodes of a multi-node launch (``dist.nnodes`` > 1): the rendezvous at
    ``endpoint`` (HOST:PORT) timed out, could not be reached, or was closed. ``node`` is this node's hostname,
    ``reason`` one of timeout | unreachable | closed, ``seconds`` the time waited (s), ``cause`` the error seen."""

    def __init__(self, node: str, endpoint: str, reason: str, seconds: float, cause: str, nnodes: int):
        self.node, self.endpoint, self.reason, self.seconds, self.cause, self.nnodes = (
            node, endpoint, reason, float(seconds), cause, int(nnodes))
        what = {"timeout": f"the other node(s) did not join within {seconds:.0f} s (dist.nnodes={nnodes}; "
                           "communication.timeout_s bounds the wait)",
                "unreachable": f"node {node} could not reach the rendezvous store there ({cause})",
                "closed": "the rendezvous was closed by another node (it failed or was stopped)"}[reason]
        super().__init__(f"node {node}: rendezvous at {endpoint} failed: {what}; check the network connection "
                         f"between the nodes (can every node reach {endpoint}? same dist.nnodes and rdzv_endpoint on "
                         "every node? a firewall on the port?)")

    def details(self) -> dict:
        """The fields recorded beside the message in launch.json."""
        return {"node": self.node, "endpoint": self.endpoint, "reason": self.reason, "seconds": self.seconds,
                "cause": self.cause, "nnodes": self.nnodes}


class CollectiveTimeout(DistevalError, TimeoutError):
    """A collective did not complete within its timeout. ``op``, ``nbytes`` (this rank's payload), ``done``
    (bytes of it moved; None for a collective issued as one call, which moves all or nothing), ``seconds``
    (elapsed), ``timeout_s`` and ``key`` (the config key that set it: ``communication.timeout_s``, or
    ``communication.sync_timeout_s`` in the final synchronisation). A collective sent in pieces
    (``disteval.comm.collectives``) is bounded as a whole; its message says the measured rate and the time the
    whole payload would have needed. One issued as one call (``disteval.comm.collectives.Communicator.timeout_error``
    translates the backend's "Timed out waiting Nms for recv") says that a peer did not take part in time."""

    def __init__(self, op: str, nbytes: int, done: int | None, seconds: float, timeout_s: float, key: str | None = None):
        self.op, self.nbytes, self.seconds, self.timeout_s, self.key = op, int(nbytes), seconds, timeout_s, key
        self.done = None if done is None else int(done)
        limit = f"{key} = {timeout_s:g} s" if key else f"timeout {timeout_s:g} s"
        if done is None:
            super().__init__(f"{op} of {nbytes:,} bytes timed out after {seconds:.1f} s ({limit}): a peer did not "
                             "take part in time (late, stopped or gone)")
            return
        rate = done / seconds if seconds > 0 else 0.0
        need = f"; at that rate all of it needs {nbytes / rate:.1f} s" if rate > 0 else ""
        super().__init__(f"{op} timed out after {seconds:.1f} s ({limit}) with {done:,} of "
                         f"{nbytes:,} bytes moved ({rate / 1e6:.3f} MB/s){need}")


class NumericDriftError(DistevalError):
    """The canary (``disteval.rank.canary``) found ranks computing different bits on the same probe batch and
    ``dist.heterogeneous`` is ``refuse``, or ``pin`` could not make them agree. ``record`` is the canary's record
    (numeric classes: ranks, nodes, differing settings, measured drift)."""

    def __init__(self, message: str, record: dict | None = None):
        self.record = record or {}
        super().__init__(message)


class SweepExit(SystemExit):
    """The exit code a launcher decided for a whole sweep (1: a partial sweep, 2: nothing was submitted), raised
    from inside Hydra's multirun so that its own reporting does not turn it into a traceback; the CLI passes it
    on as it is (a plain SystemExit(1) there means Hydra could not compose the config: exit 2)."""
