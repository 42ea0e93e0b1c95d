"""The experiment trackers (``logger=...``, disteval/driver/loggers/, docs/loggers.md) on real ``python -m disteval`` jobs:
one W=1 job with all four trackers, one 2-job sweep (world sizes 1 and 2) with mlflow and tensorboard, one job
whose trackers fail at the end (a closed localhost port, a log dir under a regular file), and one job refused
because mlflow cannot be imported. Everything is read back with the trackers' own readers (MlflowClient,
TensorBoard's EventAccumulator, ``wandb leet inspect``) and compared with results.json read here."""
from __future__ import annotations

import csv
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO

pytestmark = pytest.mark.slow
JOB = ("data.limit=64", "eval.progress=false")
REPORT = "<html><body>report stand-in</body></html>\n"


def _env(tmp: Path) -> dict:
    """The environment of a user without tracker settings: no WANDB_* / MLFLOW_* variables (offline defaults),
    W&B's config and cache folders under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(PYTHONUNBUFFERED="1", COLUMNS="200", WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
               WANDB_CACHE_DIR=str(tmp / "wandb-cache"), WANDB_DATA_DIR=str(tmp / "wandb-data"))
    return env


def _disteval(tmp: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disteval", *args], cwd=tmp, env=env or _env(tmp),
                          capture_output=True, text=True, timeout=300)


def _leaves(metrics: dict) -> dict:
    """results.json ``metrics`` with nested dicts as dotted keys (``reliability.count``)."""
    out = {}
    for key, value in metrics.items():
        out.update({f"{key}.{k}": v for k, v in _leaves(value).items()} if isinstance(value, dict) else {key: value})
    return out


def expected_per_class(results: dict) -> dict[str, list]:
    """The per-class lists of results.json ``metrics``: lists of numbers with one entry per class."""
    classes = results["dataset"]["num_classes"]
    return {k: v for k, v in _leaves(results["metrics"]).items()
            if isinstance(v, list) and len(v) == classes and all(isinstance(x, (int, float)) for x in v)}


def expected_scalars(results: dict) -> dict[str, float]:
    """The scalars a tracker must log, from results.json: the numbers of ``metrics`` (not bools), the evaluation
    and whole-run times and the forward throughput."""
    out = {k: float(v) for k, v in _leaves(results["metrics"]).items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    out["timings.evaluation_s"] = float(results["timings"]["evaluation_s"])
    out["timings.process_wall_s"] = float(results["timings"]["process_wall_s"])
    out["throughput.images_per_s"] = float(results["throughput"]["images_per_s"])
    return out


def _results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def mlflow_env():
    """MLflow 3 reads local file stores only with MLFLOW_ALLOW_FILE_STORE=true (set for this module)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        yield


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One W=1 job with logger=[csv,mlflow,tensorboard,wandb] and a RUN_DIR/report.html already there."""
    tmp = tmp_path_factory.mktemp("single")
    run_dir = tmp / "run"
    run_dir.mkdir()
    (run_dir / "report.html").write_text(REPORT)
    proc = _disteval(tmp, f"hydra.run.dir={run_dir}", "dist.world_size=1", *JOB,
                     "logger=[csv,mlflow,tensorboard,wandb]")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir, _results(run_dir)


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A multirun of two jobs (world sizes 1 and 2) with logger=[mlflow,tensorboard]."""
    tmp = tmp_path_factory.mktemp("sweep")
    sweep_dir = tmp / "sweep"
    proc = _disteval(tmp, "-m", f"hydra.sweep.dir={sweep_dir}", *JOB, "logger=[mlflow,tensorboard]",
                     "dist.world_size=1,2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, sweep_dir, {int(d.name): _results(d) for d in sweep_dir.iterdir() if d.name.isdigit()}


@pytest.fixture(scope="module")
def failing(tmp_path_factory):
    """A W=1 job whose mlflow server does not answer (a closed localhost port) and whose tensorboard log dir
    lies under a regular file; csv still works."""
    tmp = tmp_path_factory.mktemp("failing")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again when the job runs: connections are refused
    (tmp / "a-file").write_text("not a folder\n")
    run_dir = tmp / "run"
    proc = _disteval(tmp, f"hydra.run.dir={run_dir}", "dist.world_size=1", *JOB, "logger=[csv,mlflow,tensorboard]",
                     f"hydra.callbacks.mlflow.tracking_uri=http://127.0.0.1:{port}",
                     "hydra.callbacks.mlflow.http_retries=0", f"hydra.callbacks.tensorboard.log_dir={tmp / 'a-file'}/tb")
    return proc, run_dir, port


def _scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _f32(value: float) -> float:
    return float(np.float32(value))


# --- one job, four trackers ---------------------------------------------------------------------------------------

def test_results_name_where_each_tracker_logged(single):
    _, run_dir, results = single
    assert set(results["trackers"]) == {"csv", "mlflow", "tensorboard", "wandb"}
    assert "tracker_warnings" not in results
    for where in results["trackers"].values():  # a folder or file, or MLflow's sqlite:///<run dir>/mlflow.db#<run id>
        path = where.removeprefix("sqlite:///").partition("#")[0]
        assert Path(path).exists() and str(run_dir) in where
    from disteval.driver.loggers import tracker_locations, trackers_line

    assert tracker_locations(run_dir) == results["trackers"]
    line = trackers_line(results["trackers"])
    assert line.startswith("trackers: ") and all(w in line for w in results["trackers"].values())


def test_the_last_console_line_names_the_report_and_every_tracker(single, sweep):
    """Issue 30 point 4: a run's and a sweep's last console line holds the path of its report.html and where each
    tracker logged (read back from results.json / SWEEP_DIR/trackers.json), after every tracker ran."""
    for proc, directory in ((single[0], single[1]), (sweep[0], sweep[1])):
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"disteval: report: {directory / 'report.html'}; trackers: "), last
        assert (directory / "report.html").is_file()
        recorded = json.loads(((directory / "results.json") if (directory / "results.json").is_file()
                               else directory / "trackers.json").read_text())["trackers"]
        assert set(recorded) >= {"mlflow", "tensorboard"} and all(f"{k} {v}" in last for k, v in recorded.items())


def test_csv_holds_the_scalars_of_results_json(single):
    _, run_dir, results = single
    with open(run_dir / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["metric", "value"]
    assert {k: float(v) for k, v in rows[1:]} == expected_scalars(results)
    assert results["trackers"]["csv"] == str(run_dir / "metrics.csv")


def test_mlflow_run_has_metrics_params_tags_and_artifacts(single, tmp_path):
    from mlflow import MlflowClient

    _, run_dir, results = single
    # the default store is MLflow's recommended local one, read as it is (no MLFLOW_ALLOW_FILE_STORE needed)
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("disteval")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert results["trackers"]["mlflow"] == f"sqlite:///{run_dir / 'mlflow.db'}#{run.info.run_id}"
    assert run.info.artifact_uri.startswith(f"file://{run_dir / 'mlartifacts'}")
    assert run.data.metrics == expected_scalars(results)
    params = run.data.params
    assert params["dist.world_size"] == "1" and params["data.limit"] == "64"
    assert params["model.name"] == results["model"]["name"] and params["seed"] == "0"
    tags = run.data.tags
    assert tags["mode"] == results["mode"] and tags["world_size"] == "1"
    assert tags["task"] == results["task"]["name"]
    assert tags["fingerprint"] == ",".join(c["digest"] for c in results["numeric_classes"])
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"results.json", "per_class.json", "per_class.csv", "report.html"} <= names
    got = Path(client.download_artifacts(run.info.run_id, "results.json", str(tmp_path)))
    logged = json.loads(got.read_text())  # as it was before the trackers recorded themselves in it
    assert {k: v for k, v in logged.items() if k not in ("trackers", "tracker_warnings")} == \
        {k: v for k, v in results.items() if k not in ("trackers", "tracker_warnings")}
    table = json.loads(Path(client.download_artifacts(run.info.run_id, "per_class.json", str(tmp_path))).read_text())
    assert table == expected_per_class(results) and "per_class_accuracy" in table
    report = Path(client.download_artifacts(run.info.run_id, "report.html", str(tmp_path)))
    assert report.read_text() == (run_dir / "report.html").read_text()


def test_tensorboard_events_hold_the_scalars(single):
    _, run_dir, results = single
    where = Path(results["trackers"]["tensorboard"])
    assert where == run_dir / "tensorboard"
    scalars = _scalars(where)
    assert scalars == {k: [(0, _f32(v))] for k, v in expected_scalars(results).items()}


def test_wandb_offline_run_holds_summary_config_and_files(single):
    _, run_dir, results = single
    where = Path(results["trackers"]["wandb"])
    assert where.parent == run_dir / "wandb" and where.name.startswith("offline-run-")
    (log,) = where.glob("*.wandb")
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(log)],
                          capture_output=True, text=True, timeout=120, env=_env(run_dir.parent))
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout)
    assert run["state"] == "finished" and run["project"] == "disteval"
    summary = {k: v for k, v in run["summary"].items() if not k.startswith("_")}
    assert summary == {**expected_scalars(results), **expected_per_class(results)}
    assert run["config"]["model.name"] == results["model"]["name"] and run["config"]["dist.world_size"] == "1"
    assert f"mode={results['mode']}" in run["tags"] and "world_size=1" in run["tags"]
    saved = json.loads((where / "files" / "results.json").read_text())
    assert saved["metrics"] == results["metrics"]


# --- a sweep: parent and child runs, series over the world size ---------------------------------------------------

def test_mlflow_sweep_is_a_parent_run_with_one_child_per_job(sweep):
    from mlflow import MlflowClient

    _, sweep_dir, jobs = sweep
    client = MlflowClient(f"sqlite:///{sweep_dir / 'mlflow.db'}")
    exp = client.get_experiment_by_name("disteval").experiment_id
    runs = client.search_runs([exp])
    (parent,) = [r for r in runs if r.data.tags.get("disteval.kind") == "sweep"]
    children = [r for r in runs if r is not parent]
    assert len(children) == 2 and all(r.data.tags["mlflow.parentRunId"] == parent.info.run_id for r in children)
    for child in children:
        num = int(child.data.tags["disteval.job"])
        assert child.data.metrics == expected_scalars(jobs[num])
        assert child.data.tags["world_size"] == str(jobs[num]["world_size"])
        assert jobs[num]["trackers"]["mlflow"].endswith(f"#{child.info.run_id}")
    history = client.get_metric_history(parent.info.run_id, "sweep.throughput.images_per_s")
    by_size = {r["world_size"]: r["throughput"]["images_per_s"] for r in jobs.values()}
    assert sorted((m.step, m.value) for m in history) == sorted(by_size.items()) and set(by_size) == {1, 2}
    assert {"summary.csv", "summary.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    record = json.loads((sweep_dir / "trackers.json").read_text())
    assert record["trackers"]["mlflow"].endswith(f"#{parent.info.run_id}")


def test_tensorboard_sweep_series_has_world_size_as_step(sweep):
    _, sweep_dir, jobs = sweep
    series = _scalars(sweep_dir / "tensorboard" / "sweep")
    want = sorted((r["world_size"], _f32(r["throughput"]["images_per_s"])) for r in jobs.values())
    assert series["sweep/throughput.images_per_s"] == want
    assert series["sweep/top1"] == sorted((r["world_size"], _f32(r["metrics"]["top1"])) for r in jobs.values())
    for num, results in jobs.items():
        assert results["trackers"]["tensorboard"] == str(sweep_dir / "tensorboard" / f"job{num}")
        assert _scalars(sweep_dir / "tensorboard" / f"job{num}")["top1"] == [(0, _f32(results["metrics"]["top1"]))]


# --- failures -----------------------------------------------------------------------------------------------------

def test_a_failing_tracker_is_a_warning_and_the_results_stay(failing):
    proc, run_dir, port = failing
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = _results(run_dir)
    assert results["coverage"]["ok"] and results["metrics"]["num_samples"] == 64
    assert results["trackers"] == {"csv": str(run_dir / "metrics.csv")}
    warnings = results["tracker_warnings"]
    assert len(warnings) == 2
    assert any(w.startswith("logger=mlflow could not log") and f"127.0.0.1:{port}" in w for w in warnings)
    assert any(w.startswith("logger=tensorboard could not log") for w in warnings)
    assert "disteval: warning logger=mlflow could not log" in proc.stderr
    assert "disteval: warning logger=tensorboard could not log" in proc.stderr


def test_a_missing_tracker_package_is_a_configuration_error(tmp_path):
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(  # this interpreter cannot import mlflow, as without the extra
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'mlflow':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = _env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(shim), str(REPO), env.get("PYTHONPATH", "")])
    blocked = subprocess.run([sys.executable, "-c", "import mlflow"], env=env, capture_output=True, text=True)
    assert blocked.returncode == 1 and "No module named 'mlflow'" in blocked.stderr
    run_dir = tmp_path / "run"
    proc = _disteval(tmp_path, f"hydra.run.dir={run_dir}", "dist.world_size=1", *JOB, "logger=[csv,mlflow]", env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert errors == ["disteval: configuration error logger: logger=mlflow needs `pip install disteval[mlflow]` "
                      "(mlflow: No module named 'mlflow')"]
    assert not (run_dir / "ranks").exists() and not (run_dir / "results.json").exists()


@pytest.mark.mlflow_server
def test_mlflow_server_with_a_sqlite_backend(tmp_path):
    """A real ``mlflow server`` (sqlite backend store, artifacts served by the server) on a free localhost port; a
    W=1 job logs to it over HTTP and MlflowClient reads back the job's metrics, equal to its results.json.
    Needs the full ``mlflow`` package (the server); deselected, not skipped, where only mlflow-skinny is
    installed (tests/conftest.py), as in CI."""
    from mlflow import MlflowClient

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                               "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}",
                               "--artifacts-destination", str(tmp_path / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        uri = f"http://127.0.0.1:{port}"
        client = MlflowClient(uri)
        deadline = time.time() + 120
        while True:
            try:
                client.search_experiments()
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                assert time.time() < deadline and server.poll() is None, "mlflow server did not start"
                time.sleep(1)
        run_dir = tmp_path / "run"
        proc = _disteval(tmp_path, f"hydra.run.dir={run_dir}", "dist.world_size=1", *JOB, "logger=mlflow",
                         f"hydra.callbacks.mlflow.tracking_uri={uri}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = _results(run_dir)
        assert "tracker_warnings" not in results, results.get("tracker_warnings")
        (run,) = client.search_runs([client.get_experiment_by_name("disteval").experiment_id])
        assert run.info.status == "FINISHED" and run.data.metrics == expected_scalars(results)
        assert "results.json" in {a.path for a in client.list_artifacts(run.info.run_id)}
    finally:
        os.killpg(server.pid, 9)
        server.wait()


def test_mlflow_file_store_when_asked_for_and_a_failed_run_is_logged(tmp_path, mlflow_env):
    """A file store still works when the user names one (MLflow 3 reads it with MLFLOW_ALLOW_FILE_STORE=true), and
    a single run that fails is logged too, as a FAILED run with its params and no metrics."""
    from mlflow import MlflowClient

    run_dir = tmp_path / "run"
    env = {**_env(tmp_path), "DISTEVAL_FAULTS": "error@0:batch=1"}
    proc = _disteval(tmp_path, f"hydra.run.dir={run_dir}", "dist.world_size=1", *JOB, "logger=mlflow",
                     f"hydra.callbacks.mlflow.tracking_uri=file:{tmp_path / 'mlruns'}", env=env)
    assert proc.returncode == 1 and "injected error after batch 1" in proc.stderr, proc.stderr[-2000:]
    client = MlflowClient(f"file:{tmp_path / 'mlruns'}")
    (run,) = client.search_runs([client.get_experiment_by_name("disteval").experiment_id])
    assert run.info.status == "FAILED" and run.data.metrics == {} and run.data.params["dist.world_size"] == "1"


@pytest.mark.parametrize("uri", ["htp://localhost:5000", "http://"])
def test_an_unusable_tracking_uri_fails_before_any_rank_starts(tmp_path, uri):
    run_dir = tmp_path / "run"
    proc = _disteval(tmp_path, f"hydra.run.dir={run_dir}", "dist.world_size=1", *JOB, "logger=mlflow",
                     f"hydra.callbacks.mlflow.tracking_uri='{uri}'")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "configuration error hydra.callbacks.mlflow.tracking_uri" in text, text[-2000:]
    assert not (run_dir / "ranks").exists()
