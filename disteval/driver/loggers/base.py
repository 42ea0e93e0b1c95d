"""What every tracker shares: the package check (a configuration error naming the extra), one job's records read
from its run directory (``JobView``), the scalars and per-class values of results.json, the resolved config as
dotted params, and the bookkeeping of where each tracker logged (results.json ``trackers``) or why it could not
(results.json ``tracker_warnings``, written atomically like results.json itself)."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from disteval.errors import ConfigError
from disteval.job.records import atomic_write_json

# logger name -> (modules of which one must import, the pip extra that installs it)
EXTRAS = {"csv": ((), ""), "mlflow": (("mlflow",), "mlflow"), "tensorboard": (("tensorboardX", "tensorboard"), "tensorboard"),
          "wandb": (("wandb",), "wandb")}
SWEEP_RECORD = "trackers.json"  # SWEEP_DIR/trackers.json: the sweep-level locations and warnings
_locations: dict[str, str] = {}  # tracker name -> where it last logged (this process)
_warnings: list[str] = []


def locations() -> dict[str, str]:
    """{tracker name: location} of what this process's trackers logged last: after a job's end the job's tracker
    runs (an MLflow run's folder or UI address, a TensorBoard log dir, a W&B offline run dir, a CSV file), after a
    sweep's end the sweep-level ones (the MLflow parent run, the TensorBoard sweep series, SWEEP_DIR/metrics.csv)."""
    return dict(_locations)


def tracker_warnings() -> list[str]:
    """The warnings of this process's trackers that failed (one line each, also printed and recorded)."""
    return list(_warnings)


def tracker_locations(run_dir: str | Path) -> dict[str, str]:
    """{tracker name: location} recorded for RUN_DIR (results.json ``trackers``) or for a sweep directory
    (SWEEP_DIR/trackers.json ``trackers``); {} when none was recorded."""
    run_dir = Path(run_dir)
    for path in (run_dir / "results.json", run_dir / SWEEP_RECORD):
        if path.is_file():
            try:
                return dict(json.loads(path.read_text()).get("trackers") or {})
            except (OSError, ValueError):
                return {}
    return {}


def trackers_line(where: dict[str, str]) -> str:
    """One console line naming where each tracker logged, e.g. ``trackers: mlflow file:///... | csv /x/metrics.csv``;
    "" when ``where`` is empty."""
    return "trackers: " + " | ".join(f"{name} {loc}" for name, loc in where.items()) if where else ""


def require(name: str) -> None:
    """Raise ConfigError("logger", "logger=NAME needs `pip install disteval[EXTRA]`") when none of the logger's
    packages can be imported (checked with importlib, without importing them: that happens at the job's end)."""
    modules, extra = EXTRAS[name]
    missing = []
    for module in modules:
        try:
            if importlib.util.find_spec(module) is not None:
                return
        except (ImportError, ValueError) as exc:
            missing.append(f"{module}: {exc}")
            continue
        missing.append(f"no module named {module!r}")
    if modules:
        raise ConfigError("logger", f"logger={name} needs `pip install disteval[{extra}]` ({'; '.join(missing)})")


@dataclass
class JobView:
    """One job as its run directory records it. ``results``: results.json (None when the job failed before
    writing it), ``params``: the resolved job config as {dotted key: str}, ``sweep_dir``: the sweep directory of a
    multirun job (None for a single run), ``num``: the job's number in the sweep."""

    run_dir: Path
    results: dict | None
    params: dict[str, str] = field(default_factory=dict)
    sweep_dir: Path | None = None
    num: int | None = None

    @property
    def ok(self) -> bool:
        """True when the job wrote results.json."""
        return self.results is not None

    @property
    def world_size(self) -> int | None:
        """results.json ``world_size``, else the config's ``dist.world_size``."""
        if self.results is not None:
            return int(self.results["world_size"])
        value = self.params.get("dist.world_size")
        return int(value) if value not in (None, "None") else None

    @property
    def name(self) -> str:
        """The tracker run's name: ``job N world_size=W`` in a sweep, the run directory's name otherwise."""
        if self.sweep_dir is not None:
            return f"job {self.num} world_size={self.world_size}"
        return self.run_dir.name

    @property
    def base_dir(self) -> Path:
        """Where a tracker's default store goes: the sweep directory of a sweep job, else the run directory."""
        return self.sweep_dir if self.sweep_dir is not None else self.run_dir

    def tags(self) -> dict[str, str]:
        """mode, world_size, task, fingerprint (the ranks' kernel fingerprint digests), experiment, model, dataset
        and config_digest where results.json has them, plus the run and sweep directories."""
        res = self.results or {}
        out = {"disteval.run_dir": str(self.run_dir), "status": "completed" if self.ok else "failed"}
        if self.sweep_dir is not None:
            out.update({"disteval.sweep_dir": str(self.sweep_dir), "disteval.job": str(self.num)})
        digests = [c.get("digest") for c in res.get("numeric_classes") or [] if c.get("digest")]
        pairs = (("mode", res.get("mode")), ("world_size", self.world_size),
                 ("task", (res.get("task") or {}).get("name")), ("fingerprint", ",".join(digests) or None),
                 ("experiment", res.get("experiment")), ("model", (res.get("model") or {}).get("name")),
                 ("dataset", (res.get("dataset") or {}).get("name")), ("config_digest", res.get("config_digest")))
        out.update({k: str(v) for k, v in pairs if v is not None})
        return out


def load_job(run_dir: str | Path, sweep_dir: str | Path | None = None, num: int | None = None) -> JobView:
    """The ``JobView`` of RUN_DIR: its results.json (None when missing or unreadable) and .hydra/config.yaml
    flattened to dotted keys (resolved where its interpolations resolve)."""
    run_dir = Path(run_dir)
    results = None
    if (run_dir / "results.json").is_file():
        try:
            results = json.loads((run_dir / "results.json").read_text())
        except ValueError:
            results = None
    params: dict[str, str] = {}
    config = run_dir / ".hydra" / "config.yaml"
    if config.is_file():
        cfg = OmegaConf.load(config)
        try:
            container = OmegaConf.to_container(cfg, resolve=True)
        except Exception:  # noqa: BLE001 - an interpolation that only resolves inside the job: keep it as written
            container = OmegaConf.to_container(cfg, resolve=False)
        params = {k: v if isinstance(v, str) else json.dumps(v) for k, v in flatten(container).items()}
    return JobView(run_dir, results, params, Path(sweep_dir) if sweep_dir is not None else None, num)


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as {dotted key: leaf}; lists are leaves."""
    if not isinstance(value, dict):
        return {prefix: value} if prefix else {}
    out: dict[str, Any] = {}
    for key, sub in value.items():
        out.update(flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def scalar_metrics(results: dict) -> dict[str, float]:
    """The scalars of results.json: every number in ``metrics`` (nested keys dotted, e.g. ``top1``), plus
    ``timings.evaluation_s``, ``timings.process_wall_s`` and ``throughput.images_per_s`` where present."""
    out = {k: float(v) for k, v in flatten(results.get("metrics") or {}).items() if _number(v)}
    extra = {"timings.evaluation_s": (results.get("timings") or {}).get("evaluation_s"),
             "timings.process_wall_s": (results.get("timings") or {}).get("process_wall_s"),
             "throughput.images_per_s": (results.get("throughput") or {}).get("images_per_s")}
    out.update({k: float(v) for k, v in extra.items() if _number(v)})
    return out


def per_class(results: dict) -> dict[str, list]:
    """The per-class values of results.json ``metrics`` (e.g. ``per_class_accuracy``), by dotted key: the lists of
    numbers with one entry per class (``dataset.num_classes``; every list of numbers when that is unknown).
    Other lists (a confusion matrix, reliability bins) stay in the results.json artifact."""
    classes = (results.get("dataset") or {}).get("num_classes")
    return {k: v for k, v in flatten(results.get("metrics") or {}).items()
            if isinstance(v, list) and v and all(_number(x) or x is None for x in v)
            and (classes is None or len(v) == classes)}


def per_class_csv(table: dict[str, list]) -> str:
    """``per_class`` as CSV text: a ``class`` column (the index) and one column per list of the longest length."""
    import csv
    import io

    if not table:
        return ""
    length = max(len(v) for v in table.values())
    cols = [k for k, v in table.items() if len(v) == length]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(["class", *cols])
    for i in range(length):
        writer.writerow([i, *("" if table[c][i] is None else repr(table[c][i]) for c in cols)])
    return buf.getvalue()


def record(path: Path, name: str, location: str | None = None, warning: str | None = None) -> None:
    """Add ``trackers[name] = location`` and/or a ``tracker_warnings`` line to the JSON record at ``path``
    (results.json, or SWEEP_DIR/trackers.json, created when missing), rewritten atomically."""
    if path.name == "results.json" and not path.is_file():
        return
    rec = json.loads(path.read_text()) if path.is_file() else {}
    if location is not None:
        rec.setdefault("trackers", {})[name] = location
    if warning is not None:
        rec.setdefault("tracker_warnings", []).append(warning)
    atomic_write_json(path, rec)


def _warn(message: str) -> None:
    from rich.console import Console
    from rich.markup import escape

    Console(stderr=True).print(f"[yellow]disteval: warning[/] {escape(message)}", soft_wrap=True, highlight=False)


def _leads(config: DictConfig) -> bool:
    """True in the process that owns the job's records: not a rank 1..W-1 of an external launcher (a scheduler's
    tasks run the job once per rank), not a node other than the rendezvous host, and not the driver of a run that
    its launcher runs elsewhere (``Launcher.hands_over_run_mode``: that job logs itself)."""
    from disteval.job.rundir import external_rank, leads_nodes
    from launchers.registry import launcher_for

    launcher = str(OmegaConf.select(config, "hydra.runtime.choices.hydra/launcher", default="") or "")
    if config.hydra.mode == RunMode.RUN and launcher_for(launcher).hands_over_run_mode:
        return False
    return external_rank() in (None, 0) and leads_nodes(config)


class TrackerCallback(Callback):
    """Base class of the trackers: checks the logger's package when Hydra instantiates the callback (before any
    rank starts; a missing one exits 2 with a one-line configuration error naming the extra), then calls
    ``log_job(JobView)`` after each job and ``log_sweep(sweep_dir, [JobView])`` after a sweep. Either returns
    where it logged (recorded, see ``locations``); an exception becomes a warning (printed, recorded in
    results.json ``tracker_warnings`` or SWEEP_DIR/trackers.json), never a lost result or a failed exit code."""

    name = ""

    def __init__(self) -> None:
        try:
            require(self.name)
        except ConfigError as exc:
            from disteval.job.rundir import _refuse

            _refuse(exc)

    def log_job(self, job: JobView) -> str | None:
        """Log one job; returns where (None: nothing logged)."""
        raise NotImplementedError

    def log_sweep(self, sweep_dir: Path, jobs: list[JobView]) -> str | None:
        """Log a finished sweep (its jobs in job order); returns where (None: nothing at the sweep level)."""
        return None

    def on_job_end(self, config: DictConfig, job_return: Any = None, **kwargs: Any) -> None:
        """Log the job that just ended (its run directory: ``hydra.runtime.output_dir``)."""
        if not _leads(config):
            return
        run_dir = Path(str(config.hydra.runtime.output_dir))
        sweep = Path(str(config.hydra.sweep.dir)) if config.hydra.mode == RunMode.MULTIRUN else None
        if sweep is not None and sweep.resolve() == run_dir.resolve():  # a launcher's one-job sweep of a single run
            sweep = None
        num = int(config.hydra.job.num) if sweep is not None else None
        self._guarded(run_dir / "results.json", lambda: self.log_job(load_job(run_dir, sweep, num)))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Log the sweep (``hydra.sweep.dir`` and its numbered job directories)."""
        if not _leads(config):
            return
        sweep = Path(str(config.hydra.sweep.dir))
        if not sweep.is_dir() or (sweep / "results.json").is_file():  # a single run submitted as a one-job sweep
            return
        jobs = sorted((d for d in sweep.iterdir() if d.is_dir() and d.name.isdigit()), key=lambda d: int(d.name))
        views = [load_job(d, sweep, int(d.name)) for d in jobs]
        self._guarded(sweep / SWEEP_RECORD, lambda: self.log_sweep(sweep, views))

    def _guarded(self, record_path: Path, action) -> None:
        """Run ``action``; record where it logged, or warn (console, ``record_path``) when it failed."""
        try:
            where = action()
        except Exception as exc:  # noqa: BLE001 - a tracker must never cost the run its results or exit code
            message = f"logger={self.name} could not log: {type(exc).__name__}: {' '.join(str(exc).split())[:500]}"
            _warnings.append(message)
            _warn(message + f" (the results are intact; recorded in {record_path})")
            try:
                record(record_path, self.name, warning=message)
            except Exception as exc2:  # noqa: BLE001
                _warn(f"logger={self.name}: could not record the warning in {record_path}: {exc2}")
            return
        if where is None:
            return
        _locations[self.name] = str(where)
        try:
            record(record_path, self.name, location=str(where))
        except Exception as exc:  # noqa: BLE001
            _warn(f"logger={self.name}: logged to {where} but could not record it in {record_path}: {exc}")
