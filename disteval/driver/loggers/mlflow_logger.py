"""``logger=mlflow`` (``pip install disteval[mlflow]``: the mlflow-skinny client): one MLflow run per job with
params (the resolved config as dotted keys), metrics (results.json's scalars), tags (mode, world_size, task,
fingerprint, ...) and artifacts (results.json, per_class.json and per_class.csv, RUN_DIR/report.html when it
exists). A sweep is a parent run (tagged ``disteval.sweep_dir``, found again by that tag from every job, whichever
process runs it) with one child run per job; at the sweep's end the parent gets the forward throughput, the
evaluation time and the main metric per world size as step series (step = world size) and summary.csv/png.

The tracking URI is ``hydra.callbacks.mlflow.tracking_uri``, else $MLFLOW_TRACKING_URI, else MLflow's recommended
local store, a SQLite database ``sqlite:///<run dir>/mlflow.db`` (``<sweep dir>/mlflow.db`` for a sweep; artifacts
in ``<run dir>/mlartifacts``) that works offline and that ``mlflow ui --backend-store-uri sqlite:///...`` and
``MlflowClient`` read as they are. A file store (``file:...`` or a plain path) still works when asked for: MLflow 3
has put it in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE=true, which is set for this process.
The URI is checked when Hydra builds the callback, before any rank starts (``check_tracking_uri``)."""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path
from urllib.parse import urlparse

from disteval.errors import ConfigError
from disteval.driver.loggers.base import JobView, TrackerCallback, per_class, per_class_csv, scalar_metrics
from disteval.job.sweep import main_metric_of

MAX_PARAM = 6000  # characters of a param value MLflow stores (the longest are cut)


class MlflowLogger(TrackerCallback):
    """Hydra callback (conf/logger/mlflow.yaml). ``tracking_uri``: see the module docstring; ``experiment``: the
    MLflow experiment's name; ``http_retries`` / ``http_timeout_s``: how long a tracking server that does not
    answer is tried (MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT, unless already set in the environment)."""

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "disteval", http_retries: int = 2,
                 http_timeout_s: float = 20) -> None:
        super().__init__()
        self.tracking_uri, self.experiment = tracking_uri, experiment
        self.http_retries, self.http_timeout_s = int(http_retries), http_timeout_s
        try:  # before any rank starts: an unusable URI fails the run now, not after the evaluation
            check_tracking_uri(self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI"))
        except ConfigError as exc:
            from disteval.job.rundir import _refuse

            _refuse(exc)

    def client(self, base_dir: Path):
        """(MlflowClient, tracking URI, experiment id) for a job whose default store is under ``base_dir``."""
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(self.http_retries))
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(self.http_timeout_s)))
        uri = self.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        artifacts = None
        if not uri:  # MLflow's recommended local store, with the artifacts beside it
            uri = f"sqlite:///{(base_dir / 'mlflow.db').resolve()}"
            artifacts = f"file:{(base_dir / 'mlartifacts').resolve()}"
            for name in ("mlflow.store.db.utils", "alembic"):  # its schema migration's INFO lines
                logging.getLogger(name).setLevel(logging.WARNING)
        if urlparse(uri).scheme in ("", "file"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(self.experiment)
        if exp is not None:
            return client, uri, exp.experiment_id
        try:
            return client, uri, client.create_experiment(self.experiment, artifact_location=artifacts)
        except Exception:  # noqa: BLE001 - created meanwhile by another job of the sweep
            return client, uri, client.get_experiment_by_name(self.experiment).experiment_id

    def log_job(self, job: JobView) -> str | None:
        """One run (a child of the sweep's parent run in a sweep): params, metrics, tags, artifacts."""
        from mlflow.entities import Metric, Param

        client, uri, exp = self.client(job.base_dir)
        tags = {"mlflow.runName": job.name, **job.tags()}
        if job.sweep_dir is not None:
            tags["mlflow.parentRunId"] = self._parent(client, exp, job.sweep_dir)
        run = client.create_run(exp, tags=tags)
        run_id = run.info.run_id
        try:
            now = int(time.time() * 1000)
            metrics = [Metric(k, v, now, 0) for k, v in (scalar_metrics(job.results) if job.ok else {}).items()]
            params = [Param(k, v[:MAX_PARAM]) for k, v in job.params.items()]
            client.log_batch(run_id, metrics=metrics, params=params)
            if job.ok:
                self._artifacts(client, run_id, job)
        except BaseException:
            client.set_terminated(run_id, "FAILED")
            raise
        client.set_terminated(run_id, "FINISHED" if job.ok else "FAILED")
        return location(uri, exp, run_id, run.info.artifact_uri)

    @staticmethod
    def _artifacts(client, run_id: str, job: JobView) -> None:
        client.log_artifact(run_id, str(job.run_dir / "results.json"))
        if (job.run_dir / "report.html").is_file():
            client.log_artifact(run_id, str(job.run_dir / "report.html"))
        table = per_class(job.results)
        if table:
            client.log_dict(run_id, table, "per_class.json")
            client.log_text(run_id, per_class_csv(table), "per_class.csv")

    @staticmethod
    def _parent(client, exp: str, sweep_dir: Path) -> str:
        """The run id of the sweep's parent run (tag ``disteval.sweep_dir``), created by the first job to ask."""
        key = str(sweep_dir).replace("'", "\\'")
        found = client.search_runs([exp], filter_string=f"tags.`disteval.sweep_dir` = '{key}' and "
                                                        "tags.`disteval.kind` = 'sweep'", max_results=1)
        if found:
            return found[0].info.run_id
        run = client.create_run(exp, tags={"mlflow.runName": f"sweep {sweep_dir.name}", "disteval.kind": "sweep",
                                           "disteval.sweep_dir": str(sweep_dir)})
        return run.info.run_id

    def log_sweep(self, sweep_dir: Path, jobs: list[JobView]) -> str | None:
        """The parent run's series (step = world size), summary.csv/png as artifacts, its status."""
        from mlflow.entities import Metric

        client, uri, exp = self.client(sweep_dir)
        parent = self._parent(client, exp, sweep_dir)
        now, metrics = int(time.time() * 1000), []
        for job in (j for j in jobs if j.ok):
            scalars = scalar_metrics(job.results)
            main = main_metric_of(job.results)
            for key in ("throughput.images_per_s", "timings.evaluation_s", main):
                if key is not None and key in scalars:
                    metrics.append(Metric(f"sweep.{key}", scalars[key], now, job.world_size))
        client.log_batch(parent, metrics=metrics)
        for name in ("summary.csv", "summary.png"):
            if (sweep_dir / name).is_file():
                client.log_artifact(parent, str(sweep_dir / name))
        client.log_text(parent, json.dumps([{"job": j.num, "world_size": j.world_size, "ok": j.ok} for j in jobs]),
                        "jobs.json")
        client.set_terminated(parent, "FINISHED" if all(j.ok for j in jobs) else "FAILED")
        run = client.get_run(parent)
        return location(uri, exp, parent, run.info.artifact_uri)


def location(uri: str, exp: str, run_id: str, artifact_uri: str) -> str:
    """Where a run is: its folder in a local file store, ``<sqlite URI>#<run id>`` in a local database (open it
    with ``mlflow ui --backend-store-uri <sqlite URI>``), else the tracking server's UI address of the run."""
    scheme = urlparse(uri).scheme
    if urlparse(artifact_uri).scheme == "file" and scheme in ("", "file"):
        return str(Path(urlparse(artifact_uri).path).parent)
    if scheme == "sqlite":
        return f"{uri}#{run_id}"
    return f"{uri.rstrip('/')}/#/experiments/{exp}/runs/{run_id}"


STORE_SCHEMES = ("", "file", "sqlite", "postgresql", "mysql", "mssql", "http", "https", "databricks", "databricks-uc",
                 "uc")  # what MlflowClient takes as a tracking URI (MLflow's tracking store registry)


def check_tracking_uri(uri: str | None) -> None:
    """Raise ConfigError naming ``hydra.callbacks.mlflow.tracking_uri`` when ``uri`` cannot be a tracking store:
    a scheme MLflow has no store for (asked of MLflow's own registry where it answers), an http(s) URI without a
    host, a database store whose driver (SQLAlchemy) is not installed. None (the default store) passes. Nothing is
    contacted: a server that does not answer is retried at the end and becomes a warning."""
    if not uri:
        return
    key = "hydra.callbacks.mlflow.tracking_uri"
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]  # postgresql+psycopg2: the dialect before the driver
    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry

        _tracking_store_registry.get_store_builder(uri)
        known = True
    except ImportError:  # the registry moved: the schemes it had
        known = scheme in STORE_SCHEMES
    except Exception:  # noqa: BLE001 - MLflow's refusal of a scheme it has no store for
        known = False
    if not known:
        raise ConfigError(key, f"{uri!r}: MLflow has no tracking store for scheme {parsed.scheme!r}; use "
                          "sqlite:///PATH/mlflow.db, http(s)://HOST:PORT, postgresql://..., or file:PATH")
    if scheme in ("http", "https") and not parsed.hostname:
        raise ConfigError(key, f"{uri!r} names no host")
    if scheme in ("sqlite", "postgresql", "mysql", "mssql") and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(key, f"{uri!r} is a database store, which needs SQLAlchemy: pip install 'disteval[mlflow]'")
