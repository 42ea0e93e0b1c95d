"""Bootstrap intervals of the COCO statistics over images (``eval.ci.resamples`` on detection data): a resample's
statistics are pycocotools' on the dataset that holds each drawn image as often as it was drawn; the intervals
are ``==`` at W = 1, 2, 3 with real ranks and hold the run's own AP."""
import copy
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import load_results, run_disteval
from disteval.data.coco import load_detections, load_ground_truth
from disteval.data.coco_datasets import ReplayImages, collate_images
from disteval.metrics.coco_bootstrap import ImageResampler, image_npig
from disteval.metrics.coco_eval import RECORD_DTYPE, STAT_NAMES
from disteval.metrics.detection import CocoDetectionMetric


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    from disteval.data.coco_synthetic import make_synthetic_coco

    return make_synthetic_coco(tmp_path_factory.mktemp("coco"), num_images=30, num_categories=4, dets_per_image=12,
                               seed=9)


def _duplicated(gt_json: dict, dt_json: list, image_ids: list[int]) -> tuple[dict, list]:
    """The annotation and results files of the image multiset ``image_ids``: copy j of an image gets image id
    j + 1, its annotations new ids (non-zero) and its detections the new image id."""
    anns, dets = {}, {}
    for a in gt_json["annotations"]:
        anns.setdefault(a["image_id"], []).append(a)
    for d in dt_json:
        dets.setdefault(d["image_id"], []).append(d)
    images = {im["id"]: im for im in gt_json["images"]}
    gt = dict(gt_json, images=[], annotations=[])
    dt, next_ann = [], 1
    for j, old in enumerate(image_ids, start=1):
        gt["images"].append(dict(images[old], id=j))
        for a in anns.get(old, []):
            gt["annotations"].append(dict(copy.deepcopy(a), id=next_ann, image_id=j))
            next_ann += 1
        dt += [dict(d, image_id=j) for d in dets.get(old, [])]
    return gt, dt


def test_a_resample_is_pycocotools_on_the_duplicated_images(synthetic, tmp_path):
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt_path, dt_path = synthetic
    gt = load_ground_truth(str(gt_path))
    data = ReplayImages(gt, load_detections(str(dt_path), gt, "bbox"))
    metric = CocoDetectionMetric(gt, "bbox")
    for start in range(0, len(data), 7):  # batches of 7 images
        outputs, targets, ids = collate_images([data[i] for i in range(start, min(start + 7, len(data)))])
        metric.update(outputs, targets, ids)
    whole = metric.compute()
    images = np.unique(metric.states()["images"][0].numpy())
    rec = metric.states()["records"][0].numpy().copy().view(RECORD_DTYPE).reshape(-1)
    resampler = ImageResampler(rec, images, image_npig(gt.shard(images, "bbox"), images, gt.num_categories),
                               gt.num_categories)
    assert resampler(np.arange(len(images))).tolist() == [whole[k] for k in STAT_NAMES]
    gt_json, dt_json = json.loads(gt_path.read_text()), json.loads(dt_path.read_text())
    rng = np.random.default_rng(4)
    for _ in range(3):
        idx = np.sort(rng.integers(0, len(images), len(images)))
        dup_gt, dup_dt = _duplicated(gt_json, dt_json, [int(gt.image_ids[images[i]]) for i in idx])
        (tmp_path / "gt.json").write_text(json.dumps(dup_gt))
        coco = COCO(str(tmp_path / "gt.json"))
        ev = COCOeval(coco, coco.loadRes(dup_dt), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
        assert resampler(idx).tolist() == ev.stats.tolist()


def test_intervals_identical_at_every_world_size(synthetic, tmp_path):
    gt_path, dt_path = synthetic
    got = {}
    for w in (1, 2, 3):
        proc = run_disteval("+experiment=coco_replay", f"data.annotations={gt_path}", f"data.predictions={dt_path}",
                            "data.batch_size=4", "eval.ci.resamples=60", "eval.ci.seed=2", f"dist.world_size={w}",
                            "eval.progress=false", run_dir=tmp_path / f"w{w}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = load_results(tmp_path / f"w{w}")
        got[w], metrics = res["confidence_intervals"], res["metrics"]
        assert got[w].pop("seconds") > 0
    assert got[1] == got[2] == got[3]
    ci = got[1]
    assert (ci["samples"], ci["unit"], ci["resamples"], ci["seed"]) == (30, "images", 60, 2)
    for name in ("AP", "AP50", "AP75", "AR100"):
        assert ci[name]["low"] <= metrics[name] <= ci[name]["high"] and ci[name]["low"] < ci[name]["high"], name
    assert "bootstrap intervals over the 30 images" in " ".join(proc.stdout.split())


SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


@pytest.mark.skipif(not (SHARED / "data" / "coco").is_dir(), reason="../shared/data/coco (the shared COCO files) "
                    "not present")
def test_segmentation_intervals_over_images(tmp_path):
    """The COCO semantic-segmentation replay: intervals of mIoU, mean Dice, mIoU_per_image `==` at W = 1 and 2;
    the statistic of a resample equals mIoU / Dice computed with numpy from the images' confusion counts in the
    prediction store, each drawn image counted as often as drawn; the intervals hold the run's values."""
    import pyarrow.parquet as pq

    from disteval.metrics.bootstrap import SegmentationResampler, vector_intervals

    got = {}
    for w in (1, 2):
        proc = run_disteval("+experiment=coco_semseg_replay", f"dist.world_size={w}", "eval.ci.resamples=80",
                            "eval.save_predictions=true", "eval.progress=false", run_dir=tmp_path / f"w{w}",
                            env={"DISTEVAL_SHARED": str(SHARED)})
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = load_results(tmp_path / f"w{w}")
        got[w] = res["confidence_intervals"]
        assert got[w].pop("seconds") > 0
    assert got[1] == got[2]
    metrics = res["metrics"]
    for name in ("mIoU", "mean_dice", "mIoU_per_image"):
        assert got[1][name]["low"] <= metrics[name] <= got[1][name]["high"], name
    table = pq.read_table(tmp_path / "w2" / "predictions").sort_by("sample_id")
    c = metrics["num_classes"]
    conf = np.stack(table.column("confusion").to_numpy(zero_copy_only=False)).reshape(-1, c, c).astype(np.int64)
    tp = np.diagonal(conf, axis1=1, axis2=2)
    union = conf.sum(2) + conf.sum(1) - tp
    rows = np.concatenate([np.arange(len(conf))[:, None], tp, union], axis=1)
    resampler = SegmentationResampler(rows, c)
    idx = np.random.default_rng(1).integers(0, len(conf), len(conf))
    total = conf[idx].sum(0)
    t, u = np.diag(total).astype(np.float64), total.sum(0) + total.sum(1) - np.diag(total)
    want = [np.mean(t[u > 0] / u[u > 0]), np.mean(2 * t[u > 0] / (total.sum(0) + total.sum(1))[u > 0])]
    assert resampler(idx)[:2].tolist() == pytest.approx(want, rel=1e-12)
    assert resampler(np.arange(len(conf))).tolist() == pytest.approx(
        [metrics["mIoU"], metrics["mean_dice"], metrics["mIoU_per_image"]], rel=1e-12)
    again = vector_intervals(resampler, resampler.names, len(conf), (80, 0.95, 0), "images")
    assert all(again[k] == got[1][k] for k in resampler.names)  # the store's counts give the run's intervals
