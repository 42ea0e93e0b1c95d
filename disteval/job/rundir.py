"""One run per run directory: an exclusive lock held by the driver, and what becomes of an earlier run's records.

A run directory belongs to one live run at a time. ``claim_run_dir`` takes an exclusive ``flock`` on
RUN_DIR/.disteval.lock (released by the kernel when the process ends, however it ends) and writes the
holder into it: pid, host, boot id, start time and command. A second run into the same directory (the same
``hydra.run.dir``, two sweep jobs resolving to one directory) is refused with ``RunDirBusy`` naming the
directory and the holder, before Hydra writes anything there and before any rank starts. A lock file whose
recorded holder is not marked released but whose flock is free was left by a process that died (kill -9, a
crash, a lost node): it is taken over with a message naming the dead holder.

Records of an earlier run in the directory are moved to RUN_DIR/previous/<time>-<pid>/ (results.json,
launch.json, job.json, ranks/, .hydra/, disteval.log, doctor/, predictions/, checkpoints/): nothing is lost and no stale record is mistaken
for the new run's. The results of a finished run (results.json) are only moved when the new run asks for it
with ``eval.overwrite=true``; otherwise the new run is refused with ``RunDirOccupied``.

The Hydra callback ``RunDirGuard`` (conf/config.yaml ``hydra.callbacks.run_dir_guard``) claims the directory in
``on_run_start``, i.e. before Hydra writes .hydra/ and opens disteval.log, so that the earlier run's config is
archived with its results instead of being overwritten; for a multirun it checks the sweep directory's jobs
in ``on_multirun_start``. ``python -m disteval`` claims the job's directory again (a no-op when already held)
for jobs that the callback did not see.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from disteval.errors import DiskFullError, DistevalError
from disteval.common import netif
from disteval.job.records import FULL_ERRNOS, boot_id, free_bytes

LOCK = ".disteval.lock"
PREVIOUS = "previous"
RECORDS = ("results.json", "launch.json", "job.json", "ranks", ".hydra", "disteval.log", "doctor",
           ".disteval-reserve", "predictions", "checkpoints", "report.html", "metrics.csv", "journal.json")
# what a claim from inside the job function may move: Hydra has written this job's .hydra/ and log by then
JOB_RECORDS = tuple(r for r in RECORDS if r not in (".hydra", "disteval.log"))
# under an external launcher the ranks share the directory and a requeued job keeps its checkpoints in ranks/;
# rank 0 moves these before any rank writes one
SHARED_RECORDS = ("results.json", "predictions", "checkpoints", "report.html", "metrics.csv")

GRACE_S = 2.0  # how long a claim waits out a probe of the lock, and a probe a holder still writing its record
_held: dict[str, int] = {}  # resolved run dir -> fd holding its flock (this process)


class RunDirBusy(DistevalError):
    """The run directory is locked by a live run. ``holder``: its lock record (pid, host, t_start, argv)."""

    def __init__(self, run_dir: str, holder: dict):
        self.run_dir, self.holder = run_dir, holder
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["t_start"])) if holder.get("t_start") else "?"
        super().__init__(f"run directory {run_dir} is in use by another run: pid {holder.get('pid')} on host "
                         f"{holder.get('host')}, started {since} ({' '.join(holder.get('argv') or [])[:200]}); "
                         "choose another hydra.run.dir, or wait for that run to end")


class RunDirOccupied(DistevalError):
    """The run directory holds the results of a finished run and ``eval.overwrite`` is false. ``key``: the
    setting that chooses the directory (hydra.run.dir, or hydra.sweep.dir for a sweep)."""

    def __init__(self, run_dir: str, results: Path, key: str = "hydra.run.dir"):
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(results.stat().st_mtime))
        where = run_dir if key == "hydra.run.dir" else str(Path(run_dir).parent)
        super().__init__(f"run directory {run_dir} holds the results of a finished run ({results.name}, written "
                         f"{created}); refusing to overwrite them: choose another {key}, or add "
                         f"eval.overwrite=true to move the old records to {where}/{PREVIOUS}/ first")


def _read_holder(fd: int) -> dict:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        value = json.loads(os.read(fd, 1 << 16).decode() or "{}")
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_holder(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps(holder) + "\n").encode())
    os.fsync(fd)


def lock_run_dir(run_dir: str | os.PathLike) -> str | None:
    """Take RUN_DIR's exclusive lock for this process (idempotent). Returns a message when a stale lock of a
    dead process was taken over, else None. Raises RunDirBusy when a live run holds it."""
    path = Path(run_dir).resolve()
    if str(path) in _held:
        return None
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:  # perhaps another rank's probe (is_locked), which holds it an instant
                time.sleep(0.02)
                continue
            holder = _read_holder(fd)
            os.close(fd)
            raise RunDirBusy(str(path), holder) from None
    old = _read_holder(fd)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot_id(), "t_start": time.time(),
              "argv": list(sys.argv), "run_id": os.environ.get("TORCHELASTIC_RUN_ID"), "released": False}
    try:
        _write_holder(fd, holder)
    except OSError as exc:
        os.close(fd)
        if exc.errno in FULL_ERRNOS:
            raise DiskFullError(str(path / LOCK), len(json.dumps(holder)) + 1, free_bytes(path),
                                FULL_ERRNOS[exc.errno]) from exc
        raise
    _held[str(path)] = fd
    if old.get("pid") and not old.get("released"):
        return (f"took over the lock of {path} from pid {old.get('pid')} on host {old.get('host')} (started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(old.get('t_start') or 0))}), which is no "
                "longer running: it died without releasing it")
    return None


def release_run_dir(run_dir: str | os.PathLike) -> None:
    """Mark RUN_DIR's lock released and drop it (the kernel drops it anyway when the process ends)."""
    fd = _held.pop(str(Path(run_dir).resolve()), None)
    if fd is None:
        return
    try:
        holder = _read_holder(fd)
        _write_holder(fd, dict(holder, released=True, t_end=time.time()))
    except OSError:
        pass
    os.close(fd)


def archive_previous_run(run_dir: str | os.PathLike, overwrite: bool, names: tuple[str, ...] = RECORDS) -> Path | None:
    """Move an earlier run's records (``names``) to RUN_DIR/previous/<time>-<pid>/; returns that folder, or
    None when there was nothing to move. Raises RunDirOccupied when results.json exists and not ``overwrite``."""
    run_dir = Path(run_dir)
    if (run_dir / "results.json").exists() and not overwrite:
        raise RunDirOccupied(str(run_dir), run_dir / "results.json")
    (run_dir / ".disteval-reserve").unlink(missing_ok=True)  # a dead driver's disk reserve: space, not a record
    old = [run_dir / name for name in names if (run_dir / name).exists()]
    if not old:
        return None
    dest = run_dir / PREVIOUS / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    dest.mkdir(parents=True)
    for p in old:
        os.replace(p, dest / p.name)
    return dest


def claim_run_dir(run_dir: str | os.PathLike, overwrite: bool, names: tuple[str, ...] = RECORDS) -> list[str]:
    """Lock RUN_DIR for this run and move an earlier run's records (``names``) aside (see the module
    docstring). Returns notes for the console (a stale lock taken over, records moved). Idempotent within one
    process. Raises RunDirBusy or RunDirOccupied (the lock is then released again).

    ``names``: ``RECORDS`` before Hydra writes into the directory (``RunDirGuard``); ``JOB_RECORDS`` from the job
    function (this job's .hydra/ and log are already there); ``SHARED_RECORDS`` for rank 0 under an external
    launcher (torchrun, a scheduler's tasks): the other ranks have written into the shared directory, and a requeued
    job's checkpoints in ranks/ must stay, so only a finished run's results.json is refused or moved aside."""
    key = str(Path(run_dir).resolve())
    if key in _held:
        return []
    notes = [m for m in [lock_run_dir(run_dir)] if m]
    try:
        moved = archive_previous_run(run_dir, overwrite, names)
    except BaseException:
        release_run_dir(run_dir)
        raise
    if moved is not None:
        notes.append(f"the records of an earlier run in {run_dir} were moved to {moved}")
    return notes


def is_locked(run_dir: str | os.PathLike) -> dict | None:
    """The holder record when a live process holds RUN_DIR's lock, else None (no lock, released, or stale)."""
    path = Path(run_dir) / LOCK
    if not path.exists() or str(Path(run_dir).resolve()) in _held:
        return None
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd) or {"pid": None}
    finally:
        os.close(fd)  # closing drops a lock this probe took
    return None


def _refuse(exc: BaseException) -> None:
    """Print a refusal the way ``python -m disteval`` prints configuration errors and exit (2; 1 for a full
    disk), before Hydra writes anything into the directory."""
    from rich.console import Console
    from rich.markup import escape

    full = isinstance(exc, OSError) and (isinstance(exc, DiskFullError) or not isinstance(exc, DistevalError))
    head = "run failed[/] cannot claim the run directory:" if full else "configuration error[/]"
    Console(stderr=True).print(f"[bold red]disteval: {head} {escape(str(exc))}", soft_wrap=True, highlight=False)
    global refused_with
    refused_with = 1 if full else 2
    raise SystemExit(refused_with)


refused_with: int | None = None  # the exit code of a refusal by RunDirGuard (python -m disteval keeps it)


def external_rank() -> int | None:
    """This process's rank under an external launcher (env:// variables set), else None. Under one, rank 0
    claims the directory that all ranks share (without archiving) and the other ranks do not claim."""
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return int(os.environ["RANK"])
    return None


def leads_nodes(cfg: DictConfig) -> bool:
    """True unless this is a multi-node launch (``dist.nnodes`` > 1) on a node other than the one that hosts the
    rendezvous (``dist.node_rank`` 0, or the node owning ``dist.rdzv_endpoint``'s address): that node claims the
    run directory and writes launch.json; the others only start their ranks (which agree on rank 0's run
    directory), so that nodes sharing a filesystem do not refuse each other's claim."""
    if cfg.dist.nnodes <= 1 or not cfg.dist.rdzv_endpoint:  # without an endpoint the job stops at its config check,
        return True                                             # recorded in the run directory's own launch.json
    if cfg.dist.node_rank is not None:
        return int(cfg.dist.node_rank) == 0
    host = str(cfg.dist.rdzv_endpoint).rpartition(":")[0]
    return netif.resolve(host) in set(netif.interface_addresses().values())


class RunDirGuard(Callback):
    """Hydra callback (conf/config.yaml ``hydra.callbacks.run_dir_guard``): claim ``hydra.run.dir`` before Hydra
    writes .hydra/ into it (``on_run_start``; under an external launcher the other ranks only check that the
    directory holds no finished run and no other run's lock, so that a refused rerun writes nothing there);
    for a multirun, lock the sweep directory for the sweep's duration, refuse it when it holds a live run, or
    finished results without ``eval.overwrite=true``, and with it move everything of the earlier sweep to
    SWEEP_DIR/previous/<time>-<pid>/ (``on_multirun_start``; released in ``on_multirun_end``)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        run_dir = str(config.hydra.run.dir)
        overwrite = bool(config.eval.overwrite)
        try:
            if external_rank() not in (None, 0):
                _check_shared(run_dir, overwrite)
                return
            if not leads_nodes(config):  # another node's driver claims it (a shared folder) or its own ranks'
                follow_leader(config)    # records go to this node's disk only
                return
            names = RECORDS if external_rank() is None else SHARED_RECORDS
            for note in claim_run_dir(run_dir, overwrite, names):
                print(f"disteval: warning: {note}", file=sys.stderr)
        except (DistevalError, OSError) as exc:
            _refuse(exc)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        overwrite = bool(config.eval.overwrite)
        try:
            note = lock_run_dir(sweep)  # a second sweep into this directory is refused while this one runs
            if note:
                print(f"disteval: warning: {note}", file=sys.stderr)
            old = sorted(p for p in sweep.iterdir() if p.name not in (PREVIOUS, LOCK))
            for job in (p for p in old if p.is_dir()):
                holder = is_locked(job)
                if holder is not None:
                    raise RunDirBusy(str(job), holder)
                if (job / "results.json").exists() and not overwrite:
                    raise RunDirOccupied(str(job), job / "results.json", "hydra.sweep.dir")
            if old:
                dest = sweep / PREVIOUS / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                dest.mkdir(parents=True)
                for p in old:
                    os.replace(p, dest / p.name)
                print(f"disteval: warning: the earlier sweep's records in {sweep} were moved to {dest}", file=sys.stderr)
        except (DistevalError, OSError) as exc:
            release_run_dir(sweep)
            _refuse(exc)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        release_run_dir(str(config.hydra.sweep.dir))


def node_dir(run_dir: str | os.PathLike) -> Path:
    """RUN_DIR/nodes/<hostname>: where a node that does not lead a multi-node launch keeps its driver's records
    (launch.json, .hydra/, disteval.log), so that nodes sharing a filesystem never write the same file."""
    return Path(run_dir) / "nodes" / socket.gethostname()


def follow_leader(config: DictConfig) -> None:
    """On a node that does not lead a multi-node launch: send this node's Hydra records (.hydra/ and the job
    log, disteval.log) to ``node_dir(hydra.run.dir)`` instead of the run directory itself. The leading node
    claims the run directory and moves an earlier run's records aside; written there, this node's fresh
    .hydra/ could be moved while Hydra writes it (a failed start, seen in a 4-node lab run), and its log would
    be the same file as the leader's."""
    from omegaconf import open_dict, read_write

    where = node_dir(str(config.hydra.run.dir))
    where.mkdir(parents=True, exist_ok=True)
    rel = where.relative_to(Path(str(config.hydra.run.dir)))
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.output_subdir = str(rel / ".hydra")
        handlers = config.hydra.job_logging.get("handlers") or {}
        if "file" in handlers and "filename" in handlers.file:
            handlers.file.filename = str(where / "${hydra.job.name}.log")


def _check_shared(run_dir: str, overwrite: bool) -> None:
    """For ranks 1..W-1 of an external launcher, before Hydra writes into the shared directory: raise
    RunDirOccupied when it holds a finished run's results (and not ``overwrite``), RunDirBusy when another run
    (another TORCHELASTIC_RUN_ID) holds its lock."""
    path = Path(run_dir)
    if (path / "results.json").exists() and not overwrite:
        raise RunDirOccupied(run_dir, path / "results.json")
    deadline = time.monotonic() + GRACE_S
    holder = is_locked(path)
    while holder is not None and holder.get("run_id") != os.environ.get("TORCHELASTIC_RUN_ID"):
        if time.monotonic() > deadline:
            raise RunDirBusy(run_dir, holder)
        time.sleep(0.05)  # rank 0 may hold the lock and not have written its record (its run id) yet
        holder = is_locked(path)
