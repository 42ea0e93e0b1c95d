"""Run records: per-rank status.json and the run's results.json (the contract with diagnostics).

Layout (see DESIGN.md)::

    RUN_DIR/results.json                 rank 0, atomic
    RUN_DIR/ranks/rank{r}/status.json    atomic, every ``eval.status_interval_s`` seconds and at phase changes
    RUN_DIR/ranks/rank{r}/log.txt        that rank's log

All writes are atomic: write a temporary file in the same directory, fsync, rename.

results.json fields (schema_version 2, see DESIGN.md): schema_version, experiment, run_dir, world_size, mode
(bitwise | fast), dataset {name, split, root, num_samples, batch_size, num_classes}, task {name, class},
model {name, weights, checkpoint, class}, metrics {...}, coverage {num_samples, missing, duplicated, out_of_range, ok}, per_rank [{rank,
host, shard [start, end), samples, batches, metrics {the task's local summary, e.g. accuracy, nll}, seconds
{load, forward, warmup}, images_per_s (after the warm-up), fingerprint (``disteval.common.fingerprint``: what
selects the rank's kernels)}], numeric_classes [{digest, ranks, fingerprint, differs}] (ranks grouped by
fingerprint; more than one: the ranks ran different kernels, and a warning says so), timings {load, forward, sync, after_loop, total,
evaluation_s, process_wall_s} (seconds, rank 0's clock; forward = slowest rank; after_loop = the task's work
between the loop and the sync, e.g. an embedding task's sharded search, 0 for most tasks; evaluation_s = total =
rank 0's bootstrap, load, forward and sync; process_wall_s = from the driver's start, imports and rank start-up
included, to results.json written, null when unknown), throughput {images_per_s (forward only; with eval.compile
the first batch of each rank, which compiles, is left out), warmup_s (that first batch, slowest rank; null
without eval.compile)}, comm {collectives, bytes, by_op, chunked, compression, compression_mode, backend,
profile}, precision {model_dtype, tf32, deterministic, cudnn_benchmark}, compute {mode, threads,
deterministic, cudnn_benchmark, tf32, model_dtype, channels_last, compile, compile_mode, inference_mode}, device,
versions, config_digest, created; plus sampler, exact, trials,
outliers, exclusion, allocator {requested, applied, in_force, library, glibc_tunables, malloc_conf, ranks_agree,
per_rank when the ranks differ} (``disteval.common.allocator.summarize``); under a device mesh (``dist.parallel``)
parallel {dp_replicate, dp_shard, tp, dp_size, mesh_dim_names, batches_per_dp_rank, dummy_steps_per_dp_rank,
metric_sync, tp_check, comm} and per_rank entries (the data-parallel ranks of TP rank 0) with dp_rank, tp_rank,
dummy_steps, dummy_steps_planned. Schema 2 (this version) added mode, compute, task, model.class and dataset.batch_size.

RUN_DIR/ranks/rank{r}/batches.json (``eval.record_batches``): per global batch [index, first sample id, size],
one output digest per sample and the batch's float partials: what ``python -m diagnostics compare`` reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import socket
import errno
import shutil
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from disteval.common.liveness import DRIVER_HEARTBEAT_S, process_state
from disteval.common.netif import node_id
from disteval.common import pipeline
from disteval.common.plain import plain
from disteval.common.drills import disk_simulated_full, free_simulated_disk
from disteval.errors import CollectiveTimeout, DiskFullError

SCHEMA_VERSION = 2
PHASES = ("init", "data", "forward", "sync", "done", "failed")

# Messages that a rank sees when a *peer* died or stalled; such a rank is a victim, not the culprit.
_NETWORK_PATTERNS = re.compile(
    r"connection closed|connection reset|connection refused|broken pipe|timed out|timeout|"
    r"recv|send|socket|gloo|nccl|peer|DistNetworkError|DistBackendError|DistStoreError|"
    r"SIGTERM|terminated by signal",
    re.IGNORECASE,
)
_NETWORK_TYPES = {"DistNetworkError", "DistBackendError", "DistStoreError", "PeerFailedError", "CollectiveTimeout",
                  "ConnectionError", "ConnectionResetError", "BrokenPipeError", "TimeoutError",
                  "SignalException", "KeyboardInterrupt", "RunInterrupted"}  # interrupts come from outside
INTERRUPT_TYPES = {"SignalException", "KeyboardInterrupt", "RunInterrupted"}


_UMASK = os.umask(0)
os.umask(_UMASK)


FULL_ERRNOS = {errno.ENOSPC: "ENOSPC", errno.EDQUOT: "EDQUOT"}  # errno -> name of a full filesystem


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes free for unprivileged users on the filesystem holding ``path`` (or its nearest existing parent)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, fsync, rename), with the
    permissions of an ordinary new file (0666 less the umask; mkstemp alone would give 0600). Nothing is
    left behind on failure. Raises DiskFullError (an OSError) naming the file and the bytes it needed when
    the filesystem is full (ENOSPC) or the quota is exhausted (EDQUOT)."""
    path = Path(path)
    data = text.encode("utf-8")
    tmp = None
    try:
        if disk_simulated_full():  # a fault drill
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError) and not isinstance(exc, DiskFullError) and exc.errno in FULL_ERRNOS:
            raise DiskFullError(str(path), len(data), free_bytes(path.parent), FULL_ERRNOS[exc.errno]) from exc
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically. NaN/inf are refused (written as null by callers)."""
    atomic_write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def rank_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    """``RUN_DIR/ranks/rank{rank}``."""
    return Path(run_dir) / "ranks" / f"rank{rank}"


def status_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return rank_dir(run_dir, rank) / "status.json"


def read_status(run_dir: str | os.PathLike, rank: int) -> dict | None:
    """The last status record of ``rank``, or None when it has none (never started) or it is unreadable."""
    try:
        return json.loads(status_path(run_dir, rank).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def relay_records(run_dir: str | os.PathLike, records: list[dict | None], my_node: str) -> list[int]:
    """Copy the records of ranks on other nodes (as read from the rendezvous store) into this node's run
    directory as ``ranks/rank{r}/status.json`` with ``relayed: true``, so that the launcher, the doctor and a
    person on this node see every rank without a shared filesystem. A rank's own file is never overwritten;
    a relayed copy is rewritten only by a newer record (``t_update``: several ranks of a node relay, each from
    its own, possibly older, read of the store). Returns the ranks written. Never raises OSError (the relay is
    evidence, not the run's work)."""
    written = []
    for r, s in enumerate(records):
        if not s or s.get("node") == my_node:
            continue
        path = status_path(run_dir, r)
        try:
            old = json.loads(path.read_text()) if path.exists() else None
        except (OSError, ValueError):
            old = None
        if old is not None and (not old.get("relayed") or
                                float(old.get("t_update") or 0.0) >= float(s.get("t_update") or 0.0)):
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(path, dict(s, relayed=True, relayed_at=time.time()))
            written.append(r)
        except OSError:
            pass
    return written


def recorded_progress(status: dict, died: bool = False) -> str:
    """``"phase 'forward', last recorded progress 64/270 samples"``: status records are written every
    ``eval.status_interval_s`` seconds, so the count is a lower bound of what the rank had done; ``died``: say so
    (a rank killed within a second of its last write had done more than its record shows)."""
    text = (f"phase {status.get('phase')!r}, last recorded progress {status.get('samples_done')}/"
            f"{status.get('samples_planned')} samples")
    if died and status.get("phase") not in ("done", "failed"):
        text += " (a lower bound: its record is rewritten about once a second, so it may have done more before it died)"
    return text


def is_network_error(error: dict | None) -> bool:
    """True when an ``error`` record ({type, message}) looks like a consequence of a peer's failure
    (connection closed, timeout, backend error) rather than a rank's own fault."""
    if not error:
        return False
    if error.get("type") in _NETWORK_TYPES:
        return True
    return bool(_NETWORK_PATTERNS.search(str(error.get("message", ""))[:500])) and error.get("type") in (
        "RuntimeError", "DistError", None, "")


def boot_id() -> str | None:
    """This machine's boot id (Linux ``/proc/sys/kernel/random/boot_id``): a pid is only meaningful together
    with the host and the boot it ran in. None where the file does not exist."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def zombie_exit(pid: int) -> str | None:
    """How process ``pid`` ended while it is still a zombie (a child its parent has not reaped yet): "was killed
    by SIGKILL" or "exited with code N", from the exit_code field of /proc/PID/stat (its wait status; proc(5),
    Linux >= 3.5). None when it is not a zombie or /proc cannot say."""
    import signal

    try:
        fields = Path(f"/proc/{int(pid)}/stat").read_text().rpartition(") ")[2].split()
    except (OSError, ValueError):
        return None
    if len(fields) < 50 or fields[0] != "Z":
        return None
    status = int(fields[49])  # field 52 of the line; the list starts at field 3 (the state)
    if status & 0x7F:
        try:
            return f"was killed by {signal.Signals(status & 0x7F).name}"
        except ValueError:
            return f"was killed by signal {status & 0x7F}"
    return f"exited with code {status >> 8}"


def pid_alive(pid: int | None) -> bool | None:
    """Whether process ``pid`` exists on this machine (a zombie counts as gone); None when ``pid`` is None."""
    if not pid:
        return None
    return process_state(pid) not in (None, "Z")


RESERVE = ".disteval-reserve"
RESERVE_BYTES = 1 << 20


def make_reserve(run_dir: str | os.PathLike) -> None:
    """Hold ``RESERVE_BYTES`` of real blocks in RUN_DIR/.disteval-reserve, released (``release_reserve``)
    when a disk turns out full, so that the failure itself can still be recorded. Raises DiskFullError when
    even the reserve does not fit."""
    path = Path(run_dir) / RESERVE
    try:
        with open(path, "wb") as f:
            f.write(b"\0" * RESERVE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        path.unlink(missing_ok=True)
        if exc.errno in FULL_ERRNOS:
            raise DiskFullError(str(path), RESERVE_BYTES, free_bytes(run_dir), FULL_ERRNOS[exc.errno]) from exc
        raise


def release_reserve(run_dir: str | os.PathLike) -> bool:
    """Delete RUN_DIR/.disteval-reserve; True when there was one."""
    free_simulated_disk()
    try:
        (Path(run_dir) / RESERVE).unlink()
        return True
    except OSError:
        return False


def write_record_or_reserve(path: Path, obj: Any, run_dir: str | os.PathLike) -> bool:
    """Write a small JSON record atomically; on a full disk release the run's reserve and try once more.
    Returns whether it was written (never raises OSError: records serve diagnosis)."""
    for attempt in range(2):
        try:
            atomic_write_json(path, obj)
            return True
        except DiskFullError:
            if attempt or not release_reserve(run_dir):
                return False
        except OSError:
            return False
    return False


def error_record(exc: BaseException) -> dict:
    """{type, message, traceback, time} of an exception, plus ``blames`` (a victim naming the culprit),
    ``evidence``, the details of a DiskFullError (errno, path, bytes_needed, free_bytes) and of a
    CollectiveTimeout (op, timeout_s, timeout_key)."""
    err = {"type": type(exc).__name__, "message": str(exc), "traceback": "".join(traceback.format_exception(exc)),
           "time": time.time()}
    if getattr(exc, "blames", None) is not None:
        err["blames"] = int(exc.blames)
    if getattr(exc, "evidence", None):
        err["evidence"] = exc.evidence
    if isinstance(exc, DiskFullError):
        err.update(exc.details())
    if isinstance(exc, CollectiveTimeout):  # which timeout fired (the doctor's remedy changes that key)
        err.update(op=exc.op, timeout_s=exc.timeout_s, timeout_key=exc.key)
    return err


@dataclass
class StatusWriter:
    """Writes ``RUN_DIR/ranks/rank{r}/status.json`` for one rank (thread-safe).

    ``update(...)`` rewrites the file when the phase changes, when ``force`` is set, or when at least
    ``interval_s`` seconds passed since the last write, and stamps ``t_progress`` (the main thread did
    something). ``beat()`` (a background thread, ``disteval.rank.watchdog``) rewrites it with a new
    ``t_heartbeat`` only: a process that is stopped or dead stops beating, one that waits in a collective
    keeps beating. Fields follow DESIGN.md's schema plus ``t_heartbeat``, ``heartbeat_s``, ``t_progress``,
    ``boot_id``, ``in_collective`` ({op, since} while the rank waits in a blocking collective) and ``t_data_wait``
    (since when the loop waits for its next batch from the loader; null while it computes).
    """

    run_dir: str
    rank: int
    world_size: int
    interval_s: float = 1.0
    record: dict = field(default_factory=dict)
    _last_write: float = 0.0

    def __post_init__(self) -> None:
        now = time.time()
        self._lock = threading.RLock()
        self.record = {
            "schema_version": SCHEMA_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "boot_id": boot_id(),
            "node": node_id(),
            "phase": "init",
            "t_start": now,
            "t_update": now,
            "t_progress": now,
            "t_heartbeat": now,
            "heartbeat_s": None,
            "samples_done": 0,
            "samples_planned": None,
            "batches_done": 0,
            "last_collective": None,
            "in_collective": None,
            "t_data_wait": None,
            "error": None,
        }
        self._write()

    def update(self, force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the record; write it if the phase changed, ``force``, or the interval passed."""
        with self._lock:
            phase_changed = "phase" in fields and fields["phase"] != self.record["phase"]
            self.record.update(fields)
            self.record["t_progress"] = time.time()
            if force or phase_changed or time.time() - self._last_write >= self.interval_s:
                self._write()

    def note(self, **fields: Any) -> None:
        """Merge ``fields`` and write, from a helper thread: unlike ``update`` it does not stamp ``t_progress``
        (the main thread did nothing); also after a failure (evidence added to the final record). A write error
        is left to the main thread."""
        with self._lock:
            if self.record["phase"] == "done":
                return
            self.record.update(fields)
            try:
                self._write()
            except OSError:
                pass

    def mark(self, **fields: Any) -> None:
        """Merge ``fields`` into the record without writing it (the next beat or update writes them): cheap
        enough for every batch (``t_data_wait`` while the loop waits for its loader)."""
        with self._lock:
            self.record.update(fields)

    def beat(self) -> None:
        """Write a fresh ``t_heartbeat`` (from the watchdog thread); a write error is left to the main thread."""
        with self._lock:
            if self.record["phase"] in ("done", "failed"):
                return
            self.record["t_heartbeat"] = time.time()
            try:
                self._write()
            except OSError:
                pass

    def done(self) -> None:
        """Record phase ``done`` (the rank's work, and on rank 0 results.json, is written). Never raises OSError:
        a disk that fills after the results were written must not turn a finished run into a failed one that
        leaves results behind; the run's reserve is released for this record if needed."""
        with self._lock:
            self.record.update(phase="done", t_progress=time.time(), t_update=time.time())
            if write_record_or_reserve(status_path(self.run_dir, self.rank), self.record, self.run_dir):
                self._last_write = time.time()
            self._publish()

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` (``error_record``) and phase ``failed``. Never raises OSError: on a full disk the run's
        reserve is released for this record."""
        with self._lock:
            if self.record.get("error") and self.record["phase"] == "failed":
                return  # the first error stands (a watchdog may have recorded it already)
            self.record["error"] = error_record(exc)
            self.record.update(phase="failed", t_update=time.time())
            if write_record_or_reserve(status_path(self.run_dir, self.rank), self.record, self.run_dir):
                self._last_write = time.time()
            self._publish()

    def _write(self) -> None:
        self.record["t_update"] = time.time()
        atomic_write_json(status_path(self.run_dir, self.rank), self.record)
        self._last_write = time.time()
        self._publish()

    def _publish(self) -> None:
        """Hand the record to ``mirror`` (``disteval.comm.board.StoreBoard.publish``: the rendezvous store), so
        that peers on other nodes see it without a shared filesystem. A failing mirror never fails the rank."""
        mirror = getattr(self, "mirror", None)
        if mirror is not None:
            try:
                mirror(dict(self.record))
            except Exception:  # noqa: BLE001 - the store is gone or slow: the file record stands
                pass


LAUNCH_RECORD = "launch.json"


class LaunchRecord:
    """The driver's record of one ``python -m disteval`` invocation, ``RUN_DIR/launch.json`` (atomic):
    schema_version, argv (a command that reruns it), cwd, overrides (Hydra's task overrides), hydra_launcher,
    world_size, master_addr, master_port, faults (DISTEVAL_FAULTS, if set), host, pid, boot_id, t_start,
    t_heartbeat (rewritten every ``HEARTBEAT_S`` seconds while the driver lives: a "running" record with a
    stale heartbeat and a dead pid is a driver that died), and at the end outcome (running | ok | config_error |
    failed | interrupted), exit_code, t_end and error {type, message, key (config errors), rank (the culprit),
    deaths {rank: how the launcher saw it end}, and for a full disk errno, path, bytes_needed, free_bytes}.
    It is what diagnostics reads when no rank ever started (a port in use, a bad config) and how it reruns
    the job. While it runs, RUN_DIR/.disteval-reserve holds 1 MiB so that the final record can be written
    even on a disk that filled up during the run."""

    HEARTBEAT_S = DRIVER_HEARTBEAT_S

    def __init__(self, run_dir: str | os.PathLike, **fields: Any):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LAUNCH_RECORD
        self.record = {"schema_version": SCHEMA_VERSION, "host": socket.gethostname(), "pid": os.getpid(),
                       "boot_id": boot_id(), "t_start": time.time(), "t_heartbeat": time.time(),
                       "outcome": "running", **fields}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def write(self) -> bool:
        """Write the record (never raises OSError: the records are for diagnosis; a full disk releases the
        run's reserve first). Returns whether it was written."""
        with self._lock:
            return write_record_or_reserve(self.path, json_safe(self.record), self.run_dir)

    def start(self) -> None:
        """Write the record, hold the disk reserve and start the heartbeat thread. Raises DiskFullError when
        the run directory's filesystem cannot even hold the reserve."""
        make_reserve(self.run_dir)
        self.write()
        self._thread = threading.Thread(target=self._beat, name="disteval-launch-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.HEARTBEAT_S):
            self.record["t_heartbeat"] = time.time()
            with self._lock:
                try:
                    atomic_write_json(self.path, json_safe(self.record))
                except OSError:
                    pass

    def finish(self, outcome: str, exit_code: int, error: BaseException | None = None) -> None:
        """Record the outcome; ``error``'s type and message (and ``key``, ``rank``, ``deaths`` and a full disk's
        details when it has them); stop the heartbeat; release the reserve."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.record.update(outcome=outcome, exit_code=exit_code, t_end=time.time(), t_heartbeat=time.time())
        if error is not None:
            err = {"type": type(error).__name__, "message": str(error)}
            for attr in ("key", "rank", "deaths"):
                if getattr(error, attr, None) is not None:
                    value = getattr(error, attr)
                    err[attr] = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
            details = error.details() if hasattr(error, "details") else getattr(error, "error_details", None)
            if details:
                err.update(details)
                err["type"] = getattr(error, "error_type", None) or err["type"]
            self.record["error"] = err
        self.write()
        release_reserve(self.run_dir)


def json_safe(value: Any) -> Any:
    """Replace float NaN/inf by None recursively, so results are valid JSON (undefined metric = null)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def config_digest(cfg: Any) -> str:
    """sha256 of the resolved job config (canonical JSON), identifying what was evaluated."""
    return "sha256:" + hashlib.sha256(json.dumps(plain(cfg), sort_keys=True, default=str).encode()).hexdigest()


def versions() -> dict:
    """Versions of the libraries that shape the numbers (python, torch, torchvision, numpy, hydra, disteval)."""
    import hydra
    import numpy

    from disteval import __version__

    return {"disteval": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": _torchvision_version(), "hydra": hydra.__version__, "numpy": numpy.__version__}


def _torchvision_version() -> str:
    """``torchvision.__version__`` (e.g. 0.29.1+cu130, the CUDA build included, unlike the distribution's
    metadata), read from its version.py when torchvision is not imported: importing it costs seconds."""
    import importlib.util
    import sys

    if "torchvision" not in sys.modules:
        spec = importlib.util.find_spec("torchvision")
        for folder in (spec.submodule_search_locations or []) if spec else []:
            try:
                found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]",
                                  (Path(folder) / "version.py").read_text(encoding="utf-8"), re.MULTILINE)
            except OSError:
                continue
            if found:
                return found.group(1)
    import torchvision

    return torchvision.__version__


# under a device mesh (dist.parallel) each per_rank entry also holds these (``disteval.rank.parallel.MeshRun.row``)
MESH_ROW_FIELDS = ("dp_rank", "tp_rank", "dummy_steps", "dummy_steps_planned")


def per_rank_record(row: dict, net: dict | None) -> dict:
    """One ``per_rank`` entry of results.json from a rank's synchronised row (named fields: rank, start, end,
    samples, batches, seconds_load, seconds_forward, local {metric: value}; under a device mesh also
    ``MESH_ROW_FIELDS``) and the rank's ``net`` record (host, node, node_rank, interface, address, ifname_source:
    ``disteval.rank.bootstrap``), {} or None when unknown."""
    net = net or {}
    host = net.get("host")
    fwd = row["seconds_forward"]
    warm, warm_samples = float(row.get("seconds_warmup") or 0.0), int(row.get("samples_warmup") or 0)
    steady = fwd - warm if fwd else 0.0
    return {"rank": int(row["rank"]), "host": host, "shard": [int(row["start"]), int(row["end"])],
            "samples": int(row["samples"]), "batches": int(row["batches"]),
            "metrics": dict(row.get("local") or {}),
            "seconds": {"load": row["seconds_load"], "forward": fwd, "warmup": warm},
            "images_per_s": (row["samples"] - warm_samples - resumed_samples(row)) / steady if steady > 0 else None,
            "node": net.get("node"), "node_rank": net.get("node_rank"), "interface": net.get("interface"),
            "address": net.get("address"), "ifname_source": net.get("ifname_source"),
            "fingerprint": row.get("fingerprint"),
            "pipeline": row.get("pipeline"),
            **{k: int(row[k]) for k in MESH_ROW_FIELDS if k in row}}


def resumed_samples(row: dict) -> int:
    """Samples a rank's row counts that it added from recorded windows (``eval.resume``), not forwarded."""
    return int(((row.get("journal") or {}).get("replayed") or {}).get("samples", 0))


def build_results(cfg: Any, run: dict, rows: list[dict], metrics: dict, extra: dict | None = None) -> dict:
    """Assemble the results.json record (see module docstring).

    ``run``: facts of the run: run_dir, world_size, num_samples, dataset (task's extra dataset fields, e.g.
    num_classes), task {name, class}, model_class (the evaluated module's class name, None for replays), coverage
    (CoverageReport), comm (Communicator.stats()), backend, device, timings
    {load, total}, compute {mode, threads, deterministic, cudnn_benchmark}. ``rows``: every rank's row as
    synchronised. ``extra`` adds top-level fields (sampler, exact, trials, outliers, exclusion).
    Float NaN/inf become null."""
    nets = run.get("net") or {}
    per_rank = [per_rank_record(row, nets.get(int(row["rank"])) or
                                {"host": (read_status(run["run_dir"], int(row["rank"])) or {}).get("host")})
                for row in rows]
    slowest = max((p["seconds"]["forward"] or 0.0 for p in per_rank), default=0.0)
    num_samples = run["num_samples"]
    # eval.compile: the first batch of each rank (compilation) is timed apart and left out of the images/s
    warmup = max((p["seconds"]["warmup"] for p in per_rank), default=0.0)
    steady = max(((p["seconds"]["forward"] or 0.0) - p["seconds"]["warmup"] for p in per_rank), default=0.0)
    # forwarded samples only: a resumed run's samples added from records (eval.resume) took no forward
    steady_samples = num_samples - sum(int(r.get("samples_warmup") or 0) + resumed_samples(r) for r in rows)
    return json_safe({
        "schema_version": SCHEMA_VERSION,
        "experiment": cfg.experiment_name,
        "run_dir": str(run["run_dir"]),
        "world_size": run["world_size"],
        "mode": run["compute"]["mode"],
        "dataset": {"name": cfg.data.name, "split": cfg.data.split, "root": cfg.data.root,
                    "num_samples": num_samples, "batch_size": int(cfg.data.batch_size), **run.get("dataset", {})},
        "task": run.get("task"),
        "model": {"name": cfg.model.name, "weights": cfg.model.weights, "checkpoint": cfg.model.checkpoint,
                  "class": run.get("model_class")},
        "metrics": metrics,
        "coverage": run["coverage"].as_dict(),
        "per_rank": per_rank,
        "timings": dict(run["timings"], forward=slowest),
        "throughput": {"images_per_s": steady_samples / steady if steady > 0 else None,
                       "warmup_s": warmup if warmup > 0 else None},
        "pipeline": _pipeline(cfg, per_rank),
        "comm": dict(run["comm"], backend=run["backend"], profile=plain(cfg.communication_profile),
                     compression_mode=str(cfg.communication.compression)),
        "precision": {"model_dtype": str(cfg.precision.model_dtype), "tf32": bool(cfg.precision.tf32),
                      "deterministic": bool(run["compute"]["deterministic"]),
                      "cudnn_benchmark": bool(run["compute"]["cudnn_benchmark"])},
        "compute": run["compute"],
        "device": run["device"],
        "versions": versions(),
        "config_digest": config_digest(cfg),
        "created": time.time(),
        **(extra or {}),
    })



def _pipeline(cfg: Any, per_rank: list[dict]) -> dict | None:
    """The job's input pipeline (``disteval.common.pipeline.summarize``) with the remedies that fit an input-bound
    run; None when no rank recorded one."""
    summary = pipeline.summarize([p.get("pipeline") for p in per_rank], len(os.sched_getaffinity(0)))
    if summary is None:
        return None
    return dict(summary, remedies=pipeline.remedies(summary, cfg.data))


def write_results(run_dir: str, results: dict) -> Path:
    """Write RUN_DIR/results.json atomically; returns its path."""
    path = Path(run_dir) / "results.json"
    atomic_write_json(path, results)
    return path
