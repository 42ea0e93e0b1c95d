"""Shared test helpers: running ``python -m disteval`` as a user would, and where ../shared lives."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests' helper modules, also for spawned ranks
SAMPLE = SHARED / "data" / "imagenet-sample-224"  # 1000 ImageNet images, flat: <wnid>_<label>.jpg

def script(name: str):
    """``scripts/<name>.py`` imported as the module ``name`` (registered in sys.modules, so that what it hands to a
    process pool pickles by reference); its main() does not run."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_sample_tree_script = script("imagenet_sample_tree")


def sample_tree(root: Path, limit: int | None = None) -> Path:
    """The ImageFolder view ``root/<wnid>/<wnid>_<label>.jpg`` (symlinks, nothing copied) of the shipped
    sample images in ``SAMPLE``, all 1000 or the first ``limit`` in name order (one per class), made by
    ``scripts/imagenet_sample_tree.py``; returns ``root``. Raises FileNotFoundError when ``SAMPLE`` has none."""
    _sample_tree_script.make_tree(SAMPLE, root, limit)
    return root


def run_disteval(*overrides: str, run_dir: Path, timeout: float = 300, env: dict | None = None,
                 cmd: list[str] | None = None, inline: bool = True) -> subprocess.CompletedProcess:
    """``python -m disteval hydra.run.dir=RUN_DIR *overrides`` from a folder outside the checkout. A job without
    added ``env`` (or with fault drills only, at world size 2 or more) runs in this process (``inline_run``: the
    same code without a second interpreter) unless ``inline=False`` (a test of the process itself) or
    DISTEVAL_TESTS_INLINE=0."""
    from inline_run import inline_ok, run_inline

    if inline and inline_ok(overrides, env, cmd):
        return run_inline([f"hydra.run.dir={run_dir}", *overrides], run_dir.parent, timeout, env)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="120")
    full_env.update(env or {})
    args = (cmd or [sys.executable, "-m", "disteval"]) + [f"hydra.run.dir={run_dir}", *overrides]
    return subprocess.run(args, cwd=run_dir.parent, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def rank_status(run_dir: Path, rank: int) -> dict:
    """ranks/rank{rank}/status.json of ``run_dir``, {} while it is missing or being replaced."""
    try:
        return json.loads((run_dir / "ranks" / f"rank{rank}" / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def load_results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture
def cli(tmp_path):
    """Call as ``cli(*overrides)``; returns (CompletedProcess, run_dir)."""
    counter = iter(range(1000))

    def _run(*overrides: str, **kw):
        run_dir = tmp_path / f"run{next(counter)}"
        return run_disteval(*overrides, run_dir=run_dir, **kw), run_dir

    return _run


@pytest.fixture(scope="session")
def recorded_run(tmp_path_factory):
    """Call as ``recorded_run(name)``: the ``recorded_runs.Recorded`` of the scenario ``name``, a real run made
    once per session on first use and read by several tests (copy it with ``recorded_runs.copy_run`` first)."""
    from recorded_runs import RecordedRuns

    return RecordedRuns(tmp_path_factory.mktemp("recorded"))


# the one skip CI tolerates: a machine where even root may not mount a filesystem (an unprivileged container);
# the same code path is then covered by an injected failure (tests/test_hardening.py)
PRIVILEGE_SKIP = "no permission to mount"


def _installed(distribution: str) -> bool:
    """Whether the distribution (not only a module of that name: mlflow-skinny also provides ``mlflow``) is installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def slurm_unavailable() -> str | None:
    """Why the tests marked ``slurm`` cannot submit here (None: a SLURM node is up)."""
    if not shutil.which("sbatch") or not shutil.which("sinfo"):
        return "no SLURM binaries (scripts/slurm/start_cluster.sh installs and starts a local cluster)"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"sinfo failed: {exc}"
    if out.returncode != 0 or not any(s in out.stdout for s in ("idle", "mixed", "allocated")):
        return f"no SLURM node is up (sinfo: {out.stdout.strip() or out.stderr.strip()}); run scripts/slurm/start_cluster.sh"
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are deselected (reported as deselected, not skipped) on a machine without CUDA,
    so CI, which has no GPU, neither runs nor skips them; ``scripts/gpu_check.sh`` runs them on a GPU. Tests
    marked ``mlflow_server`` likewise where the full mlflow package (its tracking server) is not installed."""
    import torch

    absent = {"gpu": not torch.cuda.is_available(),  # CI has no GPU
              # the tracking server needs the full mlflow package, which the test extra does not install
              # (mlflow-skinny is the client; docs/loggers.md)
              "mlflow_server": not _installed("mlflow")}
    for marker in [m for m, missing in absent.items() if missing]:
        chosen = [item for item in items if item.get_closest_marker(marker) is not None]
        if chosen:
            config.hook.pytest_deselected(items=chosen)
            items[:] = [item for item in items if item.get_closest_marker(marker) is None]
    _group_for_workers(items)


# Under pytest-xdist (``-n 4 --dist loadgroup --no-loadscope-reorder``, pyproject's addopts) a test file is one unit
# of work, so a module's ranks started once by its fixture serve all of its cases on one worker. The tests of the
# SLURM clusters and of the network lab are four units, one after another inside each: "slurm" (the machine's
# cluster: one job's CPUs at a time), "netlab" (tests/test_netlab.py's lab), "netlab-side" (the network chaos and
# the links benchmark, each with a lab of its own name) and "slurm-lab" (the lab with its own cluster). Labs of
# different names run side by side (their namespaces,
# bridges and folders are their own; ``NetLab.start`` builds one at a time). The benchmark smokes are a unit each
# (separate processes, no shared fixture). Units start longest first (``UNIT_SECONDS``): a long unit started last
# would end alone.
EXCLUSIVE = ("slurm", "netlab")  # markers of the tests that run one after another within their unit


SPLIT = ("test_benchmarks.py",)  # files whose tests are a unit each
# wall seconds of the longest units (measured 2026-12-07 in a clean-clone .ci/run: four workers on the 2-core machine;
# the ordering is what counts: a long unit started late ends alone while the other workers idle), longest first.
# Units not named here go after them.
UNIT_SECONDS = {"netlab": 945, "slurm": 582, "slurm-lab": 473, "test_doctor.py": 460, "test_journal.py": 329,
                "test_hardening.py": 252, "netlab-side": 229, "test_heterogeneous.py": 200, "test_doctor_evidence.py": 200,
                "test_prediction_store.py": 180, "test_cli.py": 177, "test_readme_commands.py": 170,
                "test_html_report.py": 160, "test_bitwise_dist.py": 150, "test_segmentation.py": 123,
                "test_coco.py": 118, "test_wds_dist.py": 117, "test_mesh_cli.py": 110,
                "test_benchmark_smoke[checkpoints.py]": 98, "test_benchmark_smoke[heterogeneous.py]": 90,
                "test_stream_cache.py": 88, "test_webdataset_cli.py": 85, "test_allocator.py": 84,
                "test_bootstrap.py": 83, "test_exactness_dist.py": 78, "test_mesh_dist.py": 75}


def check_groups_reached_xdist(config, items) -> None:
    """On an xdist worker with ``--dist loadgroup``: every test's id must carry its group (``@unit``), else xdist
    schedules test by test and two tests of one lab run on two workers at once, each killing the other's lab (seen
    2026-12-07 with pytest 9.2, whose node ids ignore xdist's suffix: requirements/lock.txt pins 9.0.3). Raises
    pytest.UsageError saying so."""
    if not items or not hasattr(config, "workerinput") or not config.getvalue("loadgroup"):
        return
    if not any("@" in item.nodeid for item in items):
        raise pytest.UsageError(f"pytest-xdist's loadgroup did not reach the scheduler with pytest {pytest.__version__}: "
                                "tests of one unit would run on several workers (install requirements/lock.txt)")


def _unit(item) -> str:
    """The xdist group of a test: "slurm", "netlab" (tests/test_netlab.py's lab), "netlab-side" (the labs of
    the network chaos and the links benchmark, named "chaos" and "blinks") or "slurm-lab" (its EXCLUSIVE
    markers), else its name in a SPLIT file, else its file."""
    marks = [m for m in EXCLUSIVE if item.get_closest_marker(m) is not None]
    if marks == ["netlab"] and item.path.name != "test_netlab.py":
        return "netlab-side"
    if marks:
        return "-".join(marks).replace("slurm-netlab", "slurm-lab")
    return item.name if item.path.name in SPLIT else item.path.name


def _group_for_workers(items) -> None:
    """Give every test an ``xdist_group`` (``_unit``); the longest units first (``UNIT_SECONDS``; stable: files
    keep their order otherwise)."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_unit(item)))
    items.sort(key=lambda item: -UNIT_SECONDS.get(_unit(item), 0))


@pytest.hookimpl(trylast=True)  # after pytest-xdist's worker hook, which appends "@group" to each test's id
def pytest_collection_finish(session):
    check_groups_reached_xdist(session.config, session.items)


_unit_seconds: dict[str, float] = {}  # unit -> seconds of its tests' setup, call and teardown (this process's view)
_unit_span: dict[str, tuple[float, float]] = {}  # unit -> (first start, last stop), epoch seconds


def pytest_runtest_logreport(report):
    """Sum each unit's test seconds (on the controller under xdist, which sees every worker's reports)."""
    unit = report.nodeid.rpartition("@")[2] if "@" in report.nodeid else report.nodeid.split("::")[0].rpartition("/")[2]
    _unit_seconds[unit] = _unit_seconds.get(unit, 0.0) + report.duration
    start, stop = getattr(report, "start", None), getattr(report, "stop", None)
    if start is not None and stop is not None:
        first, last = _unit_span.get(unit, (start, stop))
        _unit_span[unit] = (min(first, start), max(last, stop))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The slowest units of work (a unit runs on one worker, so the longest bounds the suite's wall time); their
    seconds are what ``UNIT_SECONDS`` orders by."""
    if hasattr(config, "workerinput") or not _unit_seconds:
        return
    total = sum(_unit_seconds.values())
    terminalreporter.write_sep("=", f"slowest 25 units (seconds of their tests, one worker each; all "
                                    f"{len(_unit_seconds)} units: {total:.0f} s)")
    for unit, seconds in sorted(_unit_seconds.items(), key=lambda kv: -kv[1])[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s  {unit}")
    if _unit_span:  # the tail: units that ended last (a long unit started late ends alone while workers idle)
        t0 = min(a for a, _ in _unit_span.values())
        terminalreporter.write_sep("=", "the last 6 units to end (start and end, seconds into the suite)")
        for unit, (a, b) in sorted(_unit_span.items(), key=lambda kv: kv[1][1])[-6:]:
            terminalreporter.write_line(f"{a - t0:8.0f} {b - t0:8.0f}  {unit}")


def pytest_sessionfinish(session, exitstatus):
    """With DISTEVAL_FAIL_ON_SKIP=1 (set by .ci/run) a skipped test fails the session: CI installs every
    input the tests need, so a skip there means a missing install step (except ``PRIVILEGE_SKIP``)."""
    if os.environ.get("DISTEVAL_FAIL_ON_SKIP") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = [r for r in (reporter.stats.get("skipped", []) if reporter else [])
               if PRIVILEGE_SKIP not in str(getattr(r, "longrepr", ""))]
    if skipped:
        reporter.write_line(f"DISTEVAL_FAIL_ON_SKIP=1: {len(skipped)} test(s) skipped, failing the run", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
