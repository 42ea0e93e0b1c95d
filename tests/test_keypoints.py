"""COCO keypoints (OKS AP/AR), added as a task in its own files: the 10 statistics identical to pycocotools'
``iouType="keypoints"`` on generated annotations and perturbed predictions (crowds, people without labelled
keypoints, tied scores, images without people), bit-identical at W = 1, 2, 3 through
``+experiment=coco_keypoints_replay``; the live Keypoint R-CNN path (random init) agrees with itself across
world sizes."""
import contextlib
import io

import numpy as np
import pytest

from conftest import load_results, run_disteval
from disteval.data.coco_keypoints import KeypointReplay, collate_keypoints, load_keypoint_ground_truth
from disteval.data.coco_keypoints_synthetic import make_synthetic_keypoints
from disteval.metrics.coco_keypoints import STAT_NAMES, CocoKeypointMetric


def _pycocotools(gt_path, dt_path) -> list[float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(gt_path))
        ev = COCOeval(coco, coco.loadRes(str(dt_path)), "keypoints")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return ev.stats.tolist()


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_ten_statistics_equal_pycocotools(seed, tmp_path):
    gt_path, dt_path = make_synthetic_keypoints(tmp_path, num_images=40, seed=seed)
    gt = load_keypoint_ground_truth(str(gt_path))
    data = KeypointReplay(gt, str(dt_path))
    metric = CocoKeypointMetric(gt)
    for start in range(0, len(data), 6):
        metric.update(*collate_keypoints([data[i] for i in range(start, min(start + 6, len(data)))]))
    out = metric.compute()
    assert [out[k] for k in STAT_NAMES] == _pycocotools(gt_path, dt_path)
    assert out["num_images"] == 40


def test_replay_is_bit_identical_at_every_world_size(tmp_path):
    gt_path, dt_path = make_synthetic_keypoints(tmp_path, num_images=50, seed=11)
    want = _pycocotools(gt_path, dt_path)
    for w in (1, 2, 3):
        proc = run_disteval("+experiment=coco_keypoints_replay", f"data.annotations={gt_path}",
                            f"data.predictions={dt_path}", "data.batch_size=4", f"dist.world_size={w}",
                            "eval.progress=false", run_dir=tmp_path / f"w{w}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = load_results(tmp_path / f"w{w}")
        assert [res["metrics"][k] for k in STAT_NAMES] == want
        assert res["task"]["name"] == "keypoints_replay"
    assert "AP @[OKS=0.50:0.95 | area=all | maxDets=20]" in " ".join(proc.stdout.split())


def test_a_bad_results_file_is_named_before_ranks_start(tmp_path):
    gt_path, dt_path = make_synthetic_keypoints(tmp_path, num_images=5, seed=2)
    bad = tmp_path / "bad.json"
    bad.write_text('[{"image_id": 1000, "category_id": 1, "keypoints": [1, 2, 3], "score": 0.5}]')
    proc = run_disteval("+experiment=coco_keypoints_replay", f"data.annotations={gt_path}", f"data.predictions={bad}",
                        "dist.world_size=2", run_dir=tmp_path / "bad_run")
    assert proc.returncode == 2 and str(bad) in proc.stderr and "51" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "bad_run" / "ranks").exists()


def test_live_keypoint_rcnn_agrees_across_world_sizes(tmp_path):
    """Keypoint R-CNN with random weights (no download) on 4 generated images, resized to 96-112 px."""
    from PIL import Image

    gt_path, _ = make_synthetic_keypoints(tmp_path, num_images=4, seed=5)
    gt = load_keypoint_ground_truth(str(gt_path))
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for name in gt.file_names:
        Image.fromarray(rng.integers(0, 255, (90, 110, 3), dtype=np.uint8)).save(images / name, format="PNG")
    got = []
    for w in (1, 2):
        proc = run_disteval("data=coco_keypoints", "model=keypointrcnn_resnet50_fpn", "model.weights=null",
                            f"data.root={images}", f"data.annotations={gt_path}", "eval.metrics=[keypoints]",
                            "+model.kwargs.min_size=96", "+model.kwargs.max_size=112", "data.num_workers=0",
                            f"dist.world_size={w}", "eval.progress=false", run_dir=tmp_path / f"live{w}", timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got.append(load_results(tmp_path / f"live{w}"))
    assert got[0]["metrics"] == got[1]["metrics"] and got[0]["metrics"]["num_images"] == 4
    assert got[0]["task"]["name"] == "keypoints" and got[0]["model"]["class"] == "KeypointRCNN"
