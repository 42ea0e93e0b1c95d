"""The doctor on a healthy run of every experiment (issue 31, point 3): every ``conf/experiment/*.yaml`` runs on
small generated or shipped inputs (random weights where the experiment's would be a download) and the doctor
finds it healthy (exit 0, no verdict), its main metric named by the task in results.json ``task.main_metric``.
Five experiments run with ``--probe`` in tests/test_doctor.py::test_probes_and_sanity_on_every_task_family
(``PROBED``); the others run here, one rank each where no peer is needed, the doctor in this process. A new
experiment without a job in either place fails ``test_every_experiment_has_a_healthy_run``."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import REPO, load_results, run_disteval
from diagnostics.evidence import load_run
from diagnostics.machine import diagnose
from seg_reference import write_voc
from test_coco import _generated_images
from test_imagenet import _tree

PROBED = {"coco_replay", "coco_keypoints_replay", "fashion_mnist_knn", "coco_semseg_replay", "fashion_mnist_shards"}
SMALL_VIT = ("model.name=vit_tiny", "model.weights=null", "model.num_classes=3", "data.resize_size=32",
             "data.crop_size=32", "data.batch_size=4", "eval.classification.topk=[1,2]")


def _jobs(tmp: Path) -> dict[str, tuple[str, ...]]:
    tree = _tree(tmp / "val", per_class=2)
    (tmp / "coco").mkdir()
    coco_root, coco_ann = _generated_images(tmp / "coco")
    rng = np.random.default_rng(3)
    sizes = [(40, 56), (48, 48), (33, 47)]
    write_voc(tmp / "voc", [rng.integers(0, 256, (*s, 3), dtype=np.uint8) for s in sizes],
              [rng.integers(0, 5, s).astype(np.uint8) for s in sizes])
    return {
        "digits": ("+experiment=digits", "data.limit=64"),
        "fashion_mnist": ("+experiment=fashion_mnist", "data.limit=64"),
        "imagenet_vit": ("+experiment=imagenet_vit", f"data.root={tree}", *SMALL_VIT),
        "imagenet_vit_tp": ("+experiment=imagenet_vit_tp", f"data.root={tree}", *SMALL_VIT, "dist.world_size=2"),
        "pairs_retrieval": ("+experiment=pairs_retrieval", "eval.embedding.generated_images=120"),
        "coco_fasterrcnn": ("+experiment=coco_fasterrcnn", "model.name=fasterrcnn_mobilenet_v3_large_320_fpn",
                            "model.weights=null", "+model.kwargs.min_size=64", "+model.kwargs.max_size=96",
                            f"data.root={coco_root}", f"data.annotations={coco_ann}", "data.batch_size=2"),
        "voc_deeplabv3": ("+experiment=voc_deeplabv3", "model.name=lraspp_mobilenet_v3_large", "model.weights=null",
                          "model.num_classes=5", "data.num_classes=5", f"data.root={tmp / 'voc'}",
                          "data.resize_size=32", "data.batch_size=2"),
    }


def assert_report(run: Path, stderr: str) -> None:
    """Every experiment writes its report.html (issue 48 item 3: one experiment's failed to render): the page is
    there, the run said nothing of a report it could not write, and the main metric read from results.json is
    on the page as the report formats it (4 decimals)."""
    results = load_results(run)
    main = results["task"]["main_metric"]
    assert "could not write" not in stderr, stderr[-2000:]
    html = (run / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and f"{results['metrics'][main]:.4f}" in html, (main, results["metrics"][main])


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, tuple[str, ...]]:
    return _jobs(tmp_path_factory.mktemp("experiments"))


def test_every_experiment_has_a_healthy_run(jobs):
    experiments = {p.stem for p in (REPO / "conf" / "experiment").glob("*.yaml")}
    assert experiments == PROBED | set(jobs), sorted(experiments ^ (PROBED | set(jobs)))


@pytest.mark.parametrize("name", ["digits", "fashion_mnist", "imagenet_vit", "imagenet_vit_tp", "pairs_retrieval",
                                  "coco_fasterrcnn", "voc_deeplabv3"])
def test_doctor_finds_a_healthy_run_of_the_experiment(jobs, name, tmp_path):
    run = tmp_path / name
    world = () if any(j.startswith("dist.world_size=") for j in jobs[name]) else ("dist.world_size=1",)
    proc = run_disteval(*jobs[name], *world, "eval.progress=false", run_dir=run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = load_results(run)
    assert results["task"]["main_metric"] in results["metrics"]
    assert_report(run, proc.stderr)
    diagnosis = diagnose(load_run(run))
    assert diagnosis.verdict is None, [f.as_dict() for f in diagnosis.findings if f.status == "fail"]
