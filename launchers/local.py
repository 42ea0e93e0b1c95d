"""Local launcher: ``dist.world_size`` ranks on this machine through torch.distributed.elastic's launch API
(torchrun's engine, c10d rendezvous on a free port). When a rank raises or dies the agent stops every rank;
the driver then names the culprit from the status records (see launchers.culprit) and raises
RankFailedError. No rank outlives ``launch_local`` (the idle fork server the ranks were forked from stays for
the process's next launch: ``fork_server``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from disteval.common.allocator import AllocatorChoice
from disteval.common.liveness import LAUNCHER_PID_ENV
from disteval.common import drills, netif, startup
from disteval.common.netif import node_id
from disteval.errors import DistevalError, RankFailedError, RunInterrupted
from disteval.errors import RendezvousError as RendezvousFailure
from disteval.job.records import pid_alive, read_status, zombie_exit
from launchers.culprit import find_culprit
from launchers.protocol import Launcher, ProbeRequest


def _death(failure) -> str:
    code = getattr(failure, "exitcode", None)
    try:
        name = failure.signal_name()
    except Exception:  # noqa: BLE001 - defensive across torch versions
        name = None
    if code is not None and code < 0 and name and name != "<N/A>":
        return f"was killed by {name}"
    message = getattr(failure, "message", "") or ""
    if isinstance(message, dict):  # torch's error file: {"message": "Type: text", "extraInfo": {...}}
        message = message.get("message") or ""
    message = str(message)
    if message and not message.startswith(("<", "To enable traceback")):
        return f"exited with code {code} ({message.strip().splitlines()[-1][:300]})"
    return f"exited with code {code}"


_DISK_FULL = re.compile(r"DiskFullError: .*?\((ENOSPC|EDQUOT)\) writing (.+?): it needed ([\d,]+) bytes")


def disk_full_from_message(message: str) -> dict:
    """The fields of a DiskFullError (``disteval.errors``) from its message, as a rank that could not write any
    record reported it to the launcher; {} when the message is not one."""
    m = _DISK_FULL.search(message or "")
    if not m:
        return {}
    return {"type": "DiskFullError", "errno": m.group(1), "path": m.group(2),
            "bytes_needed": int(m.group(3).replace(",", "")), "free_bytes": None}


class Reaper:
    """Bounds how long a failed run takes to stop. When a rank fails, torch's elastic agent sends SIGTERM to
    the others and waits up to 30 s before SIGKILL (its ``_stop_workers`` does not use
    ``LaunchConfig.shutdown_timeout``); a rank that is stopped (SIGSTOP) or frozen never acts on SIGTERM. This
    thread reads the ranks' status records every ``poll_s`` seconds and, ``grace_s`` seconds after the first
    rank recorded a failure or died, sends SIGKILL to the ranks of this run that are still alive (pids from
    their status records, this host only)."""

    def __init__(self, run_dir: str, world_size: int, grace_s: float = 3.0, poll_s: float = 0.25):
        self.run_dir, self.world_size, self.grace_s, self.poll_s = run_dir, world_size, grace_s, poll_s
        self.killed: list[int] = []
        self.dead: dict[int, str] = {}  # ranks whose process ended without a record saying done or failed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disteval-reaper", daemon=True)

    def __enter__(self) -> "Reaper":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        failed_at = None
        host, node = socket.gethostname(), node_id()
        while not self._stop.wait(self.poll_s):
            records = [read_status(self.run_dir, r) for r in range(self.world_size)]
            # this node's ranks only: a pid means nothing on another node (nodes in namespaces share one kernel
            # and hostname-less records of older versions match on the host)
            mine = [s for s in records if s and s.get("pid") and not s.get("relayed")
                    and (s.get("node") == node if s.get("node") else s.get("host") == host)]
            ended = any(s.get("phase") == "failed" or (s.get("phase") != "done" and not pid_alive(s["pid"]))
                        for s in mine)
            self._note_dead(mine)
            if ended and failed_at is None:
                failed_at = time.monotonic()
            if failed_at is not None and time.monotonic() - failed_at >= self.grace_s:
                for s in mine:
                    if s.get("phase") not in ("done",) and pid_alive(s["pid"]) and s["pid"] != os.getpid():
                        try:
                            os.kill(int(s["pid"]), signal.SIGKILL)
                            self.killed.append(int(s["rank"]))
                        except OSError:
                            pass
                return


    def _note_dead(self, mine: list[dict]) -> None:
        """Remember how each rank that ended silently (no done/failed record) ended, while its process is still a
        zombie: elastic reports the first rank whose process it sees end, and a rank with loader workers is seen
        only once its workers have exited too (they hold its sentinel pipe), after the others were stopped."""
        for s in mine:
            rank = int(s["rank"])
            if s.get("phase") not in ("done", "failed") and rank not in self.dead and not pid_alive(s["pid"]):
                self.dead[rank] = zombie_exit(int(s["pid"])) or "ended"


class AgentDeadline:
    """Bounds a multi-node driver's exit. When every rank of this node has ended (its record says done or
    failed, or its process is gone) and torch's agent still has not returned ``grace_s`` seconds later (its
    rendezvous shutdown retries against a store that a partition cut off), ``on_stuck`` is called with the
    culprit found in this node's records; it records the outcome and ends the process."""

    def __init__(self, run_dir: str, world_size: int, grace_s: float, on_stuck: Callable[[BaseException], None],
                 poll_s: float = 0.5):
        self.run_dir, self.world_size, self.grace_s, self.poll_s = run_dir, world_size, grace_s, poll_s
        self.on_stuck = on_stuck
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disteval-agent-deadline", daemon=True)

    def __enter__(self) -> "AgentDeadline":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()

    def _loop(self) -> None:
        ended_at, node = None, node_id()
        while not self._stop.wait(self.poll_s):
            mine = {r: s for r in range(self.world_size) if (s := read_status(self.run_dir, r)) and
                    s.get("node") == node and not s.get("relayed")}
            over = bool(mine) and all(s.get("phase") in ("done", "failed") or not pid_alive(s.get("pid"))
                                      for s in mine.values())
            if not over:
                ended_at = None
                continue
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at >= self.grace_s and not self._stop.is_set():
                culprit = find_culprit(self.run_dir, self.world_size, {})
                self.on_stuck(RankFailedError(culprit.rank, f"{culprit.message} (this node's launcher could not "
                                              f"leave the rendezvous within {self.grace_s:.0f} s after its ranks "
                                              "ended: the other node or the network is gone)", {}))
                return


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of a multi-node launch meet (``dist.nnodes``, ``dist.node_rank``, ``dist.rdzv_endpoint``,
    ``dist.local_addr``, ``communication.timeout_s``). ``node_rank`` None: torch's c10d rendezvous (the node
    owning the endpoint's address hosts the store; node order chosen by the rendezvous); an int: the static
    rendezvous of ``torchrun --node-rank`` (node 0 hosts the store at the endpoint). The run id, which every
    node must share, is derived from the endpoint."""

    nnodes: int = 1
    endpoint: str | None = None
    node_rank: int | None = None
    local_addr: str | None = None
    timeout_s: float = 300.0
    # called (from a thread) with the culprit's RankFailedError when this node's ranks have all ended but
    # torch's agent has not returned within timeout_s + 10 s (it cannot leave a rendezvous whose store is cut
    # off): it must record the outcome and end the process (``python -m disteval`` does, exit code 1)
    on_agent_stuck: Callable[[BaseException], None] | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, dist_cfg: Any, timeout_s: float,
                    on_agent_stuck: Callable[[BaseException], None] | None = None) -> "Rendezvous":
        return cls(int(dist_cfg.nnodes), dist_cfg.rdzv_endpoint, dist_cfg.node_rank, dist_cfg.local_addr,
                   float(timeout_s), on_agent_stuck)

    @property
    def run_id(self) -> str:
        return "disteval-" + re.sub(r"[^A-Za-z0-9]+", "-", str(self.endpoint)).strip("-")

    def launch_config(self, world_size: int) -> dict:
        """The LaunchConfig fields of a multi-node launch (``world_size`` = ranks over all nodes)."""
        static = self.node_rank is not None
        configs = {"join_timeout": int(self.timeout_s), "timeout": int(self.timeout_s),
                   "read_timeout": int(self.timeout_s),  # also bounds connecting to the store (a silent partition)
                   **({"rank": int(self.node_rank)} if static else {})}
        if not static:  # torch guesses from the hostname's addresses and misses a second interface's address
            host = str(self.endpoint).rpartition(":")[0]
            configs["is_host"] = netif.resolve(host) in set(netif.interface_addresses().values())
        return dict(min_nodes=self.nnodes, max_nodes=self.nnodes, nproc_per_node=world_size // self.nnodes,
                    run_id=self.run_id, rdzv_backend="static" if static else "c10d", rdzv_endpoint=self.endpoint,
                    rdzv_configs=configs, local_addr=self.local_addr)


@dataclass
class Placement:
    """Where and how ``launch`` starts the ranks: the single-node rendezvous endpoint (``master_addr``,
    ``master_port``; 0 picks a free port), the ranks' malloc (``allocator``) and, for a multi-node launch,
    ``rendezvous`` (this node's share of the ranks)."""

    master_addr: str = "127.0.0.1"
    master_port: int = 0
    allocator: AllocatorChoice | None = None
    rendezvous: Rendezvous | None = None


def launch(entry: Callable[..., Any], args: tuple, world_size: int, run_dir: str,
           placement: Placement | None = None) -> dict[int, Any]:
    """Run ``entry(*args)`` in ``world_size`` local ranks (env:// variables set) and wait for all of them; with
    a multi-node ``placement.rendezvous`` (nnodes > 1), ``world_size`` is the total and this node runs its share.

    ``entry`` must be importable (each rank is a fork of a server that imported its module: ``fork_server``)
    and should record its errors in RUN_DIR/ranks/rank{r}/status.json (as ``disteval.rank.engine.run_rank`` does).
    Returns {rank: return value}.
    Raises RankFailedError naming the culprit rank and its own error when any rank fails.

    ``placement.allocator``: the ranks' malloc (``disteval.common.allocator``). LD_PRELOAD and GLIBC_TUNABLES act only
    when a process is exec'd, and elastic applies its per-worker ``envs`` inside the child after the
    interpreter started (``torch.distributed.elastic.multiprocessing.api._wrap``): too late. The fork server is
    exec'd with this process's environment when the first rank starts (``multiprocessing.util.spawnv_passfds``,
    no env argument) and the ranks are its forks, so the variables are put into ``os.environ`` while the agent
    runs (the ranks are started inside it) and restored afterwards, also on errors. This
    process's own allocator does not change (the loader read its variables when it started). The
    multiprocessing resource tracker, a helper of this process started on first use, is started before.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_torch_loggers()
    where = placement or Placement()
    rendezvous, allocator = where.rendezvous, where.allocator
    if rendezvous is not None and rendezvous.nnodes > 1:
        shape = rendezvous.launch_config(world_size)
    else:
        shape = dict(min_nodes=1, max_nodes=1, nproc_per_node=world_size, run_id=f"disteval-{uuid.uuid4().hex[:12]}",
                     rdzv_backend="c10d", rdzv_endpoint=f"{where.master_addr}:{where.master_port}")
    # SIGTERM, then SIGKILL after 3 s (a stopped rank ignores SIGTERM); torch < 2.14 has no such field (30 s)
    stop = {"shutdown_timeout": 3} if "shutdown_timeout" in {f.name for f in fields(LaunchConfig)} else {}
    config = LaunchConfig(**shape, max_restarts=0, monitor_interval=0.1, start_method="forkserver", **stop)
    reaper = Reaper(run_dir, world_size)
    if allocator is not None and allocator.changes_env:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()  # the driver's helper: started with the driver's own environment
    t_start = time.monotonic()
    deadline = (AgentDeadline(run_dir, world_size, rendezvous.timeout_s + 10, rendezvous.on_agent_stuck)
                if rendezvous is not None and rendezvous.nnodes > 1 and rendezvous.on_agent_stuck else
                contextlib.nullcontext())
    try:
        with reaper, deadline, (allocator.applied() if allocator is not None else contextlib.nullcontext()), \
                fork_server(entry.__module__):
            return elastic_launch(config, _rank_main)(entry, handed_to_ranks(), *args)
    except ChildFailedError as exc:
        raise _rank_failure(exc, reaper, run_dir, world_size) from None
    except RendezvousError as exc:  # a multi-node launch whose nodes never met
        raise _rendezvous_failure(exc, rendezvous, time.monotonic() - t_start) from None
    except SignalException as exc:  # the agent stopped every worker before re-raising
        raise RunInterrupted(getattr(exc.sigval, "name", str(exc.sigval))) from None


def _quiet_torch_loggers() -> None:
    """torch's elastic agent and launcher say nothing below CRITICAL: disteval says what happened itself. torch
    gives some of its loggers a level of their own (the agent's "Received 2 death signal" warning on Ctrl-C is
    one): each is set, not only the parents."""
    quiet = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    for name in [*quiet, *(n for n in list(logging.root.manager.loggerDict) if n.startswith(quiet))]:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def _rank_failure(exc: Any, reaper: "Reaper", run_dir: str, world_size: int) -> RankFailedError:
    """The RankFailedError of a launch whose ranks failed (elastic's ChildFailedError ``exc``): the culprit by
    ``find_culprit`` from the deaths (ranks the reaper killed after another rank failed are consequences, not
    deaths of their own) and, for a full disk, its recorded type and details (for launch.json)."""
    deaths = {int(rank): _death(f) for rank, f in exc.failures.items() if int(rank) not in reaper.killed}
    if not deaths:  # elastic saw only ranks the reaper stopped: the reaper's own account of who ended first
        deaths = {r: how for r, how in reaper.dead.items() if r not in reaper.killed}
    culprit = find_culprit(run_dir, world_size, deaths)
    error = RankFailedError(culprit.rank, culprit.message, deaths)
    recorded = ((read_status(run_dir, culprit.rank) or {}).get("error") or {}) if culprit.rank is not None else {}
    if not recorded and culprit.rank is not None:  # no record of its own (the disk was full from the start)
        recorded = disk_full_from_message(deaths.get(culprit.rank, ""))
    if recorded.get("errno"):
        error.error_type = recorded.get("type")
        error.error_details = {k: recorded.get(k) for k in ("errno", "path", "bytes_needed", "free_bytes")}
    return error


_server_made_for: tuple | None = None  # (module, environment) the current fork server was asked for
ELASTIC_SETS = "TORCHELASTIC_"  # variables elastic's launch sets itself, the same each time (not a new environment)
# set anew for each job (its start time, its fault drills); each launch hands them to its ranks (``_rank_main``)
HANDED_TO_RANKS = (startup.ENV, drills.ENV)


def handed_to_ranks() -> dict[str, str | None]:
    """This process's values of ``HANDED_TO_RANKS`` for the ranks of this launch (None: not set)."""
    return {name: os.environ.get(name) for name in HANDED_TO_RANKS}


def _rank_main(entry: Callable[..., Any], variables: dict[str, str | None], *args: Any) -> Any:
    """A rank's first step: this launch's ``variables`` (``handed_to_ranks``) into the environment, replacing the
    fork server's values from the launch it was started for (None: removed), then ``entry(*args)``."""
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    return entry(*args)


def _quiet_abandoned_start(kind, value, tb) -> None:
    """``sys.excepthook`` of the fork server's children: a rank whose launch was abandoned while it was being forked
    (Ctrl-C in the driver: the launch's semaphores are gone, so unpickling the process fails with FileNotFoundError)
    ends silently, the driver having said what happened in one line; any other start-up error is one line."""
    import sys

    if issubclass(kind, FileNotFoundError) and tb is not None and "SemLock" in traceback_text(tb):
        return
    print(f"disteval: a rank process could not start: {kind.__name__}: {value}", file=sys.stderr, flush=True)


def traceback_text(tb) -> str:
    import traceback

    return "".join(traceback.format_tb(tb))


def _in_fork_server() -> bool:
    """Whether this process is multiprocessing's fork server (it imports this module as a preload)."""
    import sys

    return any("multiprocessing.forkserver import main" in a for a in getattr(sys, "orig_argv", []))


if _in_fork_server():
    import sys as _sys

    _sys.excepthook = _quiet_abandoned_start


@contextlib.contextmanager
def fork_server(module: str):
    """The multiprocessing fork server the ranks are forked from, with ``module`` (the ranks' entry point, which
    imports torch) imported once in it: each rank is then a fork of that process instead of a new interpreter
    that imports torch again (measured on 2 cores: 8.1 -> 6.3 CPU seconds for a world-size-2 digits run, 12.9 ->
    8.2 at world size 4). The server is exec'd with this process's environment when the first rank starts, i.e.
    inside the allocator's ``applied()`` (its LD_PRELOAD reaches every rank). A later launch of this process
    reuses it when the module and this process's whole environment are what they were then (the jobs of a sweep:
    one import of torch for all of them; the TORCHELASTIC_* variables elastic sets and ``HANDED_TO_RANKS``, which
    each launch gives its ranks itself, aside); otherwise the old server is stopped and a new one starts. The server
    imports only (no thread, no CUDA) and ends when this process does (CPython: its liveness pipe from this
    process closes) once its ranks have ended; ranks hold that pipe too, so they are told this process's pid
    (``DISTEVAL_LAUNCHER_PID``) and their watchdog (``disteval.rank.watchdog.launcher_gone``) ends them when it is
    gone.

    ``ForkServer._stop`` is CPython's own way to stop the server (Lib/multiprocessing/forkserver.py, "used by
    unit tests"); without it a launch with another environment would reuse the first one's."""
    global _server_made_for
    import multiprocessing
    from multiprocessing import forkserver

    before = os.environ.get(LAUNCHER_PID_ENV)
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the ranks watch this process, not the server (their parent)
    try:
        wanted = (module, tuple(sorted((k, v) for k, v in os.environ.items()
                                       if not k.startswith(ELASTIC_SETS) and k not in HANDED_TO_RANKS)))
        if wanted != _server_made_for:
            forkserver._forkserver._stop()
            multiprocessing.set_forkserver_preload([module, __name__])  # __name__: _rank_main
            _server_made_for = wanted
        yield
    finally:
        if before is None:
            os.environ.pop(LAUNCHER_PID_ENV, None)
        else:
            os.environ[LAUNCHER_PID_ENV] = before


def _rendezvous_failure(exc: BaseException, rendezvous: "Rendezvous | None", waited: float) -> DistevalError:
    """torch's rendezvous error as a ``disteval.errors.RendezvousError`` naming this node, the endpoint, what
    happened and the error seen (the innermost cause's text)."""
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousTimeoutError

    cause: BaseException = exc
    while cause.__cause__ is not None:
        cause = cause.__cause__
    text = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}".rstrip(": ")
    reason = ("timeout" if isinstance(exc, RendezvousTimeoutError) else
              "closed" if isinstance(exc, RendezvousClosedError) else "unreachable")
    r = rendezvous or Rendezvous()
    return RendezvousFailure(socket.gethostname(), str(r.endpoint), reason, waited, text, r.nnodes)


def run_single(entry: Callable[..., Any], args: tuple) -> Any:
    """Run ``entry(*args)`` in this process (world size 1, no launcher) with a launch's signal semantics:
    SIGTERM and SIGINT (Ctrl-C) raise RunInterrupted naming the signal, which the rank records as an
    interrupt and ``python -m disteval`` turns into exit code 143 / 130. Main thread only."""
    def on_term(signum, frame):
        raise RunInterrupted(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return entry(*args)
    except KeyboardInterrupt:
        raise RunInterrupted("SIGINT") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def launch_local(cfg_container: dict, run_dir: str, world_size: int, placement: Placement | None = None) -> None:
    """Start ``world_size`` ranks of ``python -m disteval``'s job (``disteval.rank.engine.worker_entry``) and wait;
    ``placement``: see ``launch`` (a multi-node rendezvous: this node's share of the ranks; the ranks agree on
    rank 0's run directory).

    Raises RankFailedError naming the first failing rank and its own error when any rank fails.
    """
    from disteval.rank.engine import worker_entry

    launch(worker_entry, (cfg_container, run_dir), world_size, run_dir, placement)


class LocalLauncher(Launcher):
    """Local rank processes (torch.distributed.elastic): the ranks of one node, or this node's share of a
    torchrun-style multi-node rendezvous (``dist.nnodes``, ``dist.rdzv_endpoint``); a world size of 1 runs in
    this process. Hydra's ``basic`` launcher (the default)."""

    name = "local"
    hydra_choices = ("basic",)

    def start_ranks(self, cfg: Any, job: Any, container: dict, run_dir: str, choice: Any,
                    on_agent_stuck: Callable[[BaseException], None] | None = None) -> None:
        """See ``Launcher.start_ranks``; ``on_agent_stuck``: see ``launchers.local.Rendezvous``."""
        from disteval.rank.engine import run_rank

        if cfg.dist.world_size == 1 and (not choice.changes_env or choice.requested == "auto"):
            # in this process, with its own allocator: `auto` does not start a second process at W=1 (measured:
            # 2.5-4.7 s more start-up, a second import of torch); an allocator asked for by name does
            try:
                run_single(run_rank, (job, run_dir, None))
            except DistevalError as exc:  # the driver ran rank 0 itself: launch.json names it as the culprit
                if not isinstance(exc, RunInterrupted) and getattr(exc, "rank", None) is None:
                    exc.rank = 0
                raise
            except Exception as exc:  # one line, as for a rank of a launch (the traceback is in its status.json)
                failed = DistevalError(f"rank 0 failed: {type(exc).__name__}: {exc}")
                failed.rank = 0
                raise failed from exc
        elif int(cfg.dist.nnodes) > 1:  # this node's share, meeting the others at dist.rdzv_endpoint
            rendezvous = Rendezvous.from_config(cfg.dist, float(cfg.communication.timeout_s), on_agent_stuck)
            launch_local(container, run_dir, cfg.dist.world_size, Placement(allocator=choice, rendezvous=rendezvous))
        else:
            alone = cfg.dist.world_size == 1  # a rank process for the allocator only: no peer needs the rendezvous
            launch_local(container, run_dir, cfg.dist.world_size,
                         Placement("127.0.0.1" if alone else cfg.dist.master_addr, 0 if alone else cfg.dist.master_port,
                                   allocator=choice))

    def run_probe(self, request: ProbeRequest) -> None:
        """The probe ranks as local processes meeting at the run's ``dist.master_addr`` on a free port."""
        launch(request.entry, (request.container, str(request.out_dir), request.payload_bytes), request.world_size,
               str(request.out_dir), Placement(str(request.container["dist"].get("master_addr", "127.0.0.1")), 0))
