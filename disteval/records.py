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
{load, forward}, images_per_s}], timings {load, forward, sync, total} (seconds, rank 0's clock; forward =
slowest rank), throughput {images_per_s}, comm {collectives, bytes, by_op, chunked, compression, backend,
profile}, precision {model_dtype, tf32, deterministic, cudnn_benchmark}, compute {mode, threads,
deterministic, cudnn_benchmark}, device, versions, config_digest, created; plus sampler, exact, trials,
outliers, exclusion. Schema 2 (this version) added mode, compute, task, model.class and dataset.batch_size.

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
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

SCHEMA_VERSION = 2
PHASES = ("init", "data", "forward", "sync", "done", "failed")

# Messages that a rank sees when a *peer* died or stalled; such a rank is a victim, not the culprit.
_NETWORK_PATTERNS = re.compile(
    r"connection closed|connection reset|connection refused|broken pipe|timed out|timeout|"
    r"recv|send|socket|gloo|nccl|peer|DistNetworkError|DistBackendError|DistStoreError|"
    r"SIGTERM|terminated by signal",
    re.IGNORECASE,
)
_NETWORK_TYPES = {"DistNetworkError", "DistBackendError", "DistStoreError", "PeerFailedError",
                  "ConnectionError", "ConnectionResetError", "BrokenPipeError", "TimeoutError",
                  "SignalException", "KeyboardInterrupt"}  # interrupts come from outside the rank
INTERRUPT_TYPES = {"SignalException", "KeyboardInterrupt"}


_UMASK = os.umask(0)
os.umask(_UMASK)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temp file in the same folder, fsync, rename), with the
    permissions of an ordinary new file (0666 less the umask; mkstemp alone would give 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
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


def recorded_progress(status: dict) -> str:
    """``"phase 'forward', last recorded progress 64/270 samples"``: status records are written every
    ``eval.status_interval_s`` seconds, so the count is a lower bound of what the rank had done."""
    return (f"phase {status.get('phase')!r}, last recorded progress {status.get('samples_done')}/"
            f"{status.get('samples_planned')} samples")


def is_network_error(error: dict | None) -> bool:
    """True when an ``error`` record ({type, message}) looks like a consequence of a peer's failure
    (connection closed, timeout, backend error) rather than a rank's own fault."""
    if not error:
        return False
    if error.get("type") in _NETWORK_TYPES:
        return True
    return bool(_NETWORK_PATTERNS.search(str(error.get("message", ""))[:500])) and error.get("type") in (
        "RuntimeError", "DistError", None, "")


@dataclass
class StatusWriter:
    """Writes ``RUN_DIR/ranks/rank{r}/status.json`` for one rank.

    ``update(...)`` rewrites the file when the phase changes, when ``force`` is set, or when at least
    ``interval_s`` seconds passed since the last write. Fields follow DESIGN.md's schema.
    """

    run_dir: str
    rank: int
    world_size: int
    interval_s: float = 1.0
    record: dict = field(default_factory=dict)
    _last_write: float = 0.0

    def __post_init__(self) -> None:
        now = time.time()
        self.record = {
            "schema_version": SCHEMA_VERSION,
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "phase": "init",
            "t_start": now,
            "t_update": now,
            "samples_done": 0,
            "samples_planned": None,
            "batches_done": 0,
            "last_collective": None,
            "error": None,
        }
        self._write()

    def update(self, force: bool = False, **fields: Any) -> None:
        """Merge ``fields`` into the record; write it if the phase changed, ``force``, or the interval passed."""
        phase_changed = "phase" in fields and fields["phase"] != self.record["phase"]
        self.record.update(fields)
        if force or phase_changed or time.time() - self._last_write >= self.interval_s:
            self._write()

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` (type, message, traceback) and phase ``failed``."""
        self.record["error"] = {
            "type": type(exc).__name__,
            "message": str(exc),
            "traceback": "".join(traceback.format_exception(exc)),
            "time": time.time(),
        }
        if getattr(exc, "blames", None) is not None:  # a victim that knows the culprit (e.g. a stalled peer)
            self.record["error"]["blames"] = int(exc.blames)
        self.update(force=True, phase="failed")

    def _write(self) -> None:
        self.record["t_update"] = time.time()
        atomic_write_json(status_path(self.run_dir, self.rank), self.record)
        self._last_write = time.time()


LAUNCH_RECORD = "launch.json"


class LaunchRecord:
    """The driver's record of one ``python -m disteval`` invocation, ``RUN_DIR/launch.json`` (atomic):
    schema_version, argv (a command that reruns it), cwd, overrides (Hydra's task overrides), hydra_launcher,
    world_size, master_addr, master_port, faults (DISTEVAL_FAULTS, if set), host, pid, t_start, and at the end outcome (running | ok |
    config_error | failed | interrupted), exit_code, t_end and error {type, message, key (config errors), rank
    (the culprit), deaths {rank: how the launcher saw it end}}. It is what diagnostics reads when no rank ever
    started (a port in use, a bad config) and how it reruns the job."""

    def __init__(self, run_dir: str | os.PathLike, **fields: Any):
        self.path = Path(run_dir) / LAUNCH_RECORD
        self.record = {"schema_version": SCHEMA_VERSION, "host": socket.gethostname(), "pid": os.getpid(),
                       "t_start": time.time(), "outcome": "running", **fields}

    def write(self) -> None:
        try:
            atomic_write_json(self.path, json_safe(self.record))
        except OSError:  # the records are for diagnosis; never turn a run's outcome into an I/O error
            pass

    def finish(self, outcome: str, exit_code: int, error: BaseException | None = None) -> None:
        """Record the outcome; ``error``'s type and message (and ``key``, ``rank``, ``deaths`` when it has them)."""
        self.record.update(outcome=outcome, exit_code=exit_code, t_end=time.time())
        if error is not None:
            err = {"type": type(error).__name__, "message": str(error)}
            for attr in ("key", "rank", "deaths"):
                if getattr(error, attr, None) is not None:
                    value = getattr(error, attr)
                    err[attr] = {str(k): v for k, v in value.items()} if isinstance(value, dict) else value
            self.record["error"] = err
        self.write()


def json_safe(value: Any) -> Any:
    """Replace float NaN/inf by None recursively, so results are valid JSON (undefined metric = null)."""
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def archive_previous_records(run_dir: str | os.PathLike) -> Path | None:
    """Before a run reuses ``run_dir`` (an explicit hydra.run.dir), move an earlier run's results.json and
    ranks/ into ``run_dir/previous/<time>/`` so that nothing is lost and no stale record (another world
    size's rank folders, an old results.json) is mistaken for this run's. Returns the archive folder."""
    run_dir = Path(run_dir)
    old = [p for p in (run_dir / "results.json", run_dir / "ranks", run_dir / LAUNCH_RECORD) if p.exists()]
    if not old:
        return None
    dest = run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S") / str(os.getpid())
    dest.mkdir(parents=True)
    for p in old:
        os.replace(p, dest / p.name)
    return dest


def config_digest(cfg: Any) -> str:
    """sha256 of the resolved job config (canonical JSON), identifying what was evaluated."""
    container = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    return "sha256:" + hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()


def versions() -> dict:
    """Versions of the libraries that shape the numbers (python, torch, torchvision, numpy, hydra, disteval)."""
    import hydra
    import numpy
    import torchvision

    from disteval import __version__

    return {"disteval": __version__, "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "hydra": hydra.__version__, "numpy": numpy.__version__}


def per_rank_record(row: dict, host: str | None) -> dict:
    """One ``per_rank`` entry of results.json from a rank's synchronised row (named fields: rank, start, end,
    samples, batches, seconds_load, seconds_forward, local {metric: value})."""
    fwd = row["seconds_forward"]
    return {"rank": int(row["rank"]), "host": host, "shard": [int(row["start"]), int(row["end"])],
            "samples": int(row["samples"]), "batches": int(row["batches"]),
            "metrics": dict(row.get("local") or {}),
            "seconds": {"load": row["seconds_load"], "forward": fwd},
            "images_per_s": row["samples"] / fwd if fwd and fwd > 0 else None}


def build_results(cfg: Any, run: dict, rows: list[dict], metrics: dict, extra: dict | None = None) -> dict:
    """Assemble the results.json record (see module docstring).

    ``run``: facts of the run: run_dir, world_size, num_samples, dataset (task's extra dataset fields, e.g.
    num_classes), task {name, class}, model_class (the evaluated module's class name, None for replays), coverage (CoverageReport), comm (Communicator.stats()), backend, device, timings
    {load, total}, compute {mode, threads, deterministic, cudnn_benchmark}. ``rows``: every rank's row as
    synchronised. ``extra`` adds top-level fields (sampler, exact, trials, outliers, exclusion).
    Float NaN/inf become null."""
    per_rank = [per_rank_record(row, (read_status(run["run_dir"], int(row["rank"])) or {}).get("host"))
                for row in rows]
    slowest = max((p["seconds"]["forward"] or 0.0 for p in per_rank), default=0.0)
    num_samples = run["num_samples"]
    experiment = cfg.get("experiment_name") if hasattr(cfg, "get") else None
    return json_safe({
        "schema_version": SCHEMA_VERSION,
        "experiment": experiment or "default",
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
        "throughput": {"images_per_s": num_samples / slowest if slowest > 0 else None},
        "comm": dict(run["comm"], backend=run["backend"], profile=_plain(cfg.get("communication_profile"))),
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


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def write_results(run_dir: str, results: dict) -> Path:
    """Write RUN_DIR/results.json atomically; returns its path."""
    path = Path(run_dir) / "results.json"
    atomic_write_json(path, results)
    return path
