"""Start-up as a newcomer sees it: the driver's progress lines and start time, the two labelled wall times of
the console table and its title width, and the start-up cuts (no torchvision, torch._dynamo or scikit-learn
in a rank of the default job). Timing targets live in benchmarks/startup.py, not here."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from omegaconf import OmegaConf
from rich.console import Console

from conftest import REPO
from disteval.common import startup


def test_job_start_is_the_process_start_once_then_now(monkeypatch):
    monkeypatch.setattr(startup, "_process_start", None)
    monkeypatch.delenv(startup.ENV, raising=False)
    t0 = startup.mark_process_start(1000.0)
    assert t0 == 1000.0 and startup.run_start() == 1000.0  # exported for the ranks
    assert startup.job_start() == 1000.0  # the first job counts from the process start (imports included)
    later = startup.job_start()  # a later job of a multirun in the same process: its own start
    assert later > 1000.0 and startup.run_start() == later


def test_progress_line_names_the_time_and_only_rank_0_speaks(monkeypatch, capsys):
    monkeypatch.setenv(startup.ENV, "0")
    monkeypatch.delenv("RANK", raising=False)
    startup.progress("composing the config")
    err = capsys.readouterr().err
    assert err.startswith("disteval: [") and err.rstrip().endswith("s] composing the config")
    monkeypatch.setenv("RANK", "1")
    startup.progress("not from rank 1")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(startup.ENV, "garbage")
    assert startup.line("x") == "disteval: x"


@pytest.mark.parametrize("argv,info", [(["--cfg", "job"], True), (["-c", "job"], True), (["--help"], True),
                                       (["--info=config"], True), (["data.limit=5"], False), ([], False)])
def test_info_requests_print_no_progress(argv, info):
    assert startup.info_request(argv) is info


def _results(model="fasterrcnn_mobilenet_v3_large_320_fpn", dataset="coco", process_wall=12.5) -> dict:
    return {"metrics": {"top1": 0.5}, "mode": "bitwise", "task": {"name": "classification"},
            "model": {"name": model, "class": "FasterRCNNWithAVeryLongClassNameIndeed"},
            "dataset": {"name": dataset, "num_samples": 10_000}, "world_size": 8,
            "timings": {"load": 1.0, "sync": 0.002, "total": 3.25, "evaluation_s": 3.25, "process_wall_s": process_wall,
                        "forward": 2.0},
            "throughput": {"images_per_s": 5000.0}, "comm": {"collectives": 2, "bytes": 100},
            "compute": {"threads": 1}, "per_rank": [], "run_dir": "/tmp/run"}


def test_table_title_fits_80_columns_and_both_wall_times_are_labelled():
    from disteval.job import report

    out = io.StringIO()
    report.print_metrics(_results(), console=Console(file=out, width=80, color_system=None))
    lines = out.getvalue().splitlines()
    title = [line for line in lines if "disteval classification:" in line]
    assert len(title) == 1 and "fasterrcnn_mobilenet_v3_large_320_fpn on coco" in title[0]
    assert len(title[0].rstrip()) <= 80
    text = out.getvalue()
    assert "wall time: evaluation (s)" in text and "3.25" in text
    assert "wall time: whole run (s)" in text and "12.50" in text
    assert "forward-only throughput (images/s)" in text
    old = _results(process_wall=None)  # a record without the whole run's time shows the evaluation's alone
    out = io.StringIO()
    report.print_metrics(old, console=Console(file=out, width=80, color_system=None))
    assert "wall time: evaluation (s)" in out.getvalue() and "whole run" not in out.getvalue()


def test_cfg_job_prints_the_config_and_no_progress(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "disteval", "--cfg", "job"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "model:" in proc.stdout
    assert "disteval: [" not in proc.stderr and "disteval: [" not in proc.stdout


def test_a_rank_of_the_default_job_loads_neither_torchvision_nor_dynamo_nor_sklearn(tmp_path):
    """What a rank of ``python -m disteval`` imports and runs before its first batch (engine, compute switches
    in bitwise mode, the digits data from a warm cache, the shipped CNN) and the driver's shape check: none
    pulls torchvision (~1.5-2 s), torch._dynamo (~1.5 s) or, with the digits cache warm, scikit-learn (~1 s)."""
    code = textwrap.dedent("""
        import json, sys
        import disteval.rank.engine, disteval.job.preflight, launchers.local
        import torch
        from omegaconf import OmegaConf
        from disteval import precision
        from disteval.data.datasets import _digits
        from disteval.models import build_model, preflight_model
        _digits("test")  # warms the cache
        for m in [m for m in sys.modules if m.startswith("sklearn")]:
            del sys.modules[m]
        precision.apply_global_switches(OmegaConf.create({"tf32": False, "deterministic": False,
                                                          "model_dtype": "fp32"}), torch.device("cpu"), bitwise=True)
        model = OmegaConf.create({"name": "digits_cnn", "weights": "shipped", "checkpoint": None,
                                  "num_classes": None, "kwargs": {}})
        preflight_model(model, 10, (1, 8, 8))
        build_model(model, 10)
        assert len(_digits("test")) == 540
        print(json.dumps({m: m in sys.modules for m in ("torchvision", "torch._dynamo", "sklearn")}
                         | {"deterministic": torch.are_deterministic_algorithms_enabled()}))
    """)
    env = dict(os.environ, DISTEVAL_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == {"torchvision": False, "torch._dynamo": False,
                                                        "sklearn": False, "deterministic": True}


def test_digits_cache_holds_exactly_sklearns_split(tmp_path, monkeypatch):
    from disteval.data import datasets

    monkeypatch.setenv("DISTEVAL_CACHE_DIR", str(tmp_path))
    first = datasets._digits("test")
    path = datasets._digits_cache("test")
    assert path is not None and path.is_file() and path.parent == tmp_path
    x, y = datasets._digits_split("test")
    with np.load(path) as cached:
        assert cached["x"].dtype == x.dtype and np.array_equal(cached["x"], x) and np.array_equal(cached["y"], y)
    again = datasets._digits("test")
    assert all((a == b).all() for a, b in zip(first.tensors, again.tensors))
    path.write_bytes(b"not an npz")  # a broken cache is rebuilt, never trusted
    rebuilt = datasets._digits("test")
    assert all((a == b).all() for a, b in zip(first.tensors, rebuilt.tensors))
    with np.load(path) as cached:
        assert np.array_equal(cached["y"], y)


def test_small_model_shape_check_on_cpu_still_refuses_a_wrong_input():
    from disteval.errors import ConfigError
    from disteval.models import preflight_model
    from disteval.models.builders import CPU_CHECK_MAX_PARAMS

    model = OmegaConf.create({"name": "fashion_cnn", "weights": None, "checkpoint": None, "num_classes": None,
                              "kwargs": {}})
    assert CPU_CHECK_MAX_PARAMS >= 200_000  # fashion_cnn takes the CPU path
    preflight_model(model, 10, (1, 28, 28))
    with pytest.raises(ConfigError, match="fashion_cnn cannot take the data's inputs of shape"):
        preflight_model(model, 10, (1, 8, 8))
