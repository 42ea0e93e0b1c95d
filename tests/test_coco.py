"""COCO detection mAP: identical to pycocotools (the published values of the real 100-image val2014 files,
bbox and segm, at W = 1..4 with real ranks; seeded random sets with crowds, empty images, score ties,
degenerate boxes, many categories and more than 100 detections per image), uneven shards and an empty
rank, and errors that name the file and the entry."""
import contextlib
import io
import json

import numpy as np
import pytest

from conftest import SHARED, load_results
from disteval.data.coco import load_detections, load_ground_truth
from disteval.errors import DataError
from disteval.metrics.coco_eval import STAT_NAMES
from disteval.metrics.detection import CocoDetectionMetric

COCO = SHARED / "data" / "coco" / "fce_cocoapi"
GT = COCO / "instances_val2014_100.json"
RESULTS = {"bbox": COCO / "instances_val2014_fakebbox100_results.json",
           "segm": COCO / "instances_val2014_fakesegm100_results.json"}
needs_coco = pytest.mark.skipif(not GT.is_file(), reason=f"{COCO} absent (the shared reference data)")

# published in ../shared/data/coco/fce_cocoapi/README.md (pycocotools 2.0.11 and faster-coco-eval 1.8.0)
PUBLISHED = {
    "bbox": [0.5045806987249628, 0.6969727247299577, 0.5729816669904824, 0.5856257209410443, 0.5193996948036719,
             0.5013978986347466, 0.38681277964578054, 0.5936795762842003, 0.595352982877607, 0.6398109626113442,
             0.5664205978994309, 0.5642905982905982],
    "segm": [0.3195452758576433, 0.5622883972521636, 0.29892653412086784, 0.3873740315997838, 0.31018272403369485,
             0.3269339071005138, 0.2682297225711534, 0.41544868114906375, 0.4168394992198818, 0.4694498622754236,
             0.37675922666197265, 0.3814715099715099],
}


def pycocotools_stats(gt_path, dt_path, iou_type, num_images=None):
    """The independent reference: pycocotools' COCOeval (optionally on the first num_images image ids)."""
    from pycocotools.coco import COCO as PyCOCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = PyCOCO(str(gt_path))
        dt = gt.loadRes(str(dt_path))
        ev = COCOeval(gt, dt, iou_type)
        if num_images is not None:
            ev.params.imgIds = sorted(gt.getImgIds())[:num_images]
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return list(ev.stats), ev


def _stats(metrics):
    return [metrics[k] for k in STAT_NAMES]


def shards_in_process(gt_path, dt_path, iou_type, world_size, num_images=None):
    """Each shard matched by its own metric instance, merged as ranks would be (merge_state)."""
    gt = load_ground_truth(gt_path)
    dets = load_detections(dt_path, gt, iou_type)
    n = num_images or gt.num_images
    metrics = []
    for part in np.array_split(np.arange(n), world_size):
        m = CocoDetectionMetric(gt, iou_type)
        m.add_detections(part, dets.select(part))
        metrics.append(m)
    metrics[0].merge_state(metrics[1:])
    return metrics[0].compute()


@pytest.fixture(scope="module", params=[1, 2, 3, 4])
def ranks_outcome(request, tmp_path_factory):
    """One group of W real ranks runs every case of its W."""
    from dist_workers import coco_worker
    from launchers.local import launch

    if not GT.is_file():
        pytest.skip(f"{COCO} absent (the shared reference data)")
    w = request.param
    out = tmp_path_factory.mktemp(f"coco{w}")
    cases = [{"name": t, "annotations": str(GT), "predictions": str(RESULTS[t]), "iou_type": t} for t in RESULTS]
    cases += [{"name": "first3", "annotations": str(GT), "predictions": str(RESULTS["bbox"]), "iou_type": "bbox",
               "limit": 3},  # at W = 4 rank 3 holds no image
              {"name": "first7", "annotations": str(GT), "predictions": str(RESULTS["bbox"]), "iou_type": "bbox",
               "limit": 7}]  # uneven shards
    launch(coco_worker, (str(out), cases), w, str(out))
    return w, {c["name"]: json.loads((out / f"{c['name']}.json").read_text()) for c in cases}


@needs_coco
def test_published_values_at_every_world_size(ranks_outcome):
    w, out = ranks_outcome
    for iou_type, want in PUBLISHED.items():
        got = _stats(out[iou_type]["metrics"])
        assert np.abs(np.array(got) - np.array(want)).max() <= 1e-10, (w, iou_type, got)
        assert out[iou_type]["coverage_ok"] and out[iou_type]["metrics"]["num_images"] == 100
    assert out["bbox"]["by_op"].get("gather", 0) >= 2  # records and image ids to rank 0, not all_gather


@needs_coco
def test_uneven_shards_and_an_empty_rank(ranks_outcome):
    w, out = ranks_outcome
    for name, n in (("first3", 3), ("first7", 7)):
        want, _ = pycocotools_stats(GT, RESULTS["bbox"], "bbox", num_images=n)
        assert _stats(out[name]["metrics"]) == want, (w, name)
        assert out[name]["metrics"]["num_images"] == n


@needs_coco
@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_per_category_ap_equals_pycocotools(iou_type):
    _, ev = pycocotools_stats(GT, RESULTS[iou_type], iou_type)
    got = shards_in_process(GT, RESULTS[iou_type], iou_type, 3)
    p = ev.eval["precision"][:, :, :, 0, -1]
    names = [c["name"] for c in ev.cocoGt.loadCats(ev.params.catIds)]
    for k, name in enumerate(names):
        s = p[:, :, k]
        want = float(np.mean(s[s > -1])) if (s > -1).any() else None
        assert got["per_category_ap"][name] == want, name


def test_image_evaluated_twice_is_named(tmp_path):
    gt_path, dt_path = _tiny_set(tmp_path)
    gt = load_ground_truth(gt_path)
    dets = load_detections(dt_path, gt, "bbox")
    a, b = CocoDetectionMetric(gt), CocoDetectionMetric(gt)
    a.add_detections(np.array([0, 1]), dets.select(np.array([0, 1])))
    b.add_detections(np.array([1]), dets.select(np.array([1])))
    a.merge_state([b])
    with pytest.raises(DataError, match=r"image ids \[8\] were evaluated more than once"):
        a.compute()


def _tiny_set(tmp_path, dets=None, anns=None):
    gt = {"images": [{"id": 5, "width": 100, "height": 80}, {"id": 8, "width": 100, "height": 80}],
          "categories": [{"id": 1, "name": "a"}, {"id": 3, "name": "b"}],
          "annotations": anns if anns is not None else [
              {"id": 1, "image_id": 5, "category_id": 1, "bbox": [10, 10, 20, 20], "area": 400, "iscrowd": 0},
              {"id": 2, "image_id": 8, "category_id": 3, "bbox": [0, 0, 50, 40], "area": 2000, "iscrowd": 0}]}
    dets = dets if dets is not None else [{"image_id": 5, "category_id": 1, "bbox": [11, 10, 20, 20], "score": .9},
                                          {"image_id": 8, "category_id": 3, "bbox": [0, 0, 40, 40], "score": .5}]
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dt.json").write_text(json.dumps(dets))
    return tmp_path / "gt.json", tmp_path / "dt.json"


@pytest.mark.parametrize("dets,anns,needle", [
    ([{"image_id": 99, "category_id": 1, "bbox": [0, 0, 1, 1], "score": .5}], None, "entry 0: image_id 99"),
    ([{"image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": .5},
      {"image_id": 5, "category_id": 7, "bbox": [0, 0, 1, 1], "score": .5}], None, "entry 1: category_id 7"),
    ([{"image_id": 5, "category_id": 1, "bbox": [0, 0, -1, 1], "score": .5}], None, "entry 0: negative box size"),
    ([{"image_id": 5, "category_id": 1, "score": .5}], None, "entry 0: needs keys"),
    ([], [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [0, 0, 3, -2]}], "annotation entry 0 (id 1): negative"),
    ([], [{"id": 1, "image_id": 6, "category_id": 1, "bbox": [0, 0, 3, 2]}], "annotations entry 0: image_id 6"),
    ([{"image_id": 5.5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": .5}], None,
     "entry 0: image_id must be an integer, got 5.5"),
    ([{"image_id": "5", "category_id": 1, "bbox": [0, 0, 1, 1], "score": .5}], None, "image_id must be an integer"),
    ([{"image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": True}], None,
     "entry 0: score must be a finite number, got True"),
    ([], [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [0, 0, 3, 2], "area": None}],
     "entry 0: area must be a finite number, got None"),
])
def test_bad_entries_name_file_and_entry(tmp_path, dets, anns, needle):
    gt_path, dt_path = _tiny_set(tmp_path, dets, anns)
    with pytest.raises(DataError) as info:
        load_detections(dt_path, load_ground_truth(gt_path), "bbox")
    assert needle in str(info.value)
    assert str(dt_path if anns is None else gt_path) in str(info.value)


def test_malformed_json_names_the_file_and_position(tmp_path):
    gt_path, dt_path = _tiny_set(tmp_path)
    dt_path.write_text('[{"image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": .5}')
    with pytest.raises(DataError, match=r"dt.json is not valid JSON: .* line 1 column"):
        load_detections(dt_path, load_ground_truth(gt_path), "bbox")


def test_cli_refuses_bad_predictions_before_ranks(cli, tmp_path):
    gt_path, dt_path = _tiny_set(tmp_path, [{"image_id": 5, "category_id": 4, "bbox": [0, 0, 1, 1], "score": .5}])
    proc, run_dir = cli("+experiment=coco_replay", f"data.annotations={gt_path}", f"data.predictions={dt_path}")
    assert proc.returncode == 2, proc.stderr
    assert "category_id 4" in proc.stderr and "dt.json" in proc.stderr and not (run_dir / "ranks").exists()


@needs_coco
def test_cli_replay_results_json(cli):
    proc, run_dir = cli("+experiment=coco_replay", f"data.annotations={GT}", f"data.predictions={RESULTS['segm']}",
                        "eval.detection.iou_type=segm", "dist.world_size=3")
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    assert np.abs(np.array(_stats(res["metrics"])) - np.array(PUBLISHED["segm"])).max() <= 1e-10
    assert len(res["metrics"]["per_category_ap"]) == 80 and res["coverage"]["ok"]
    assert "AP @[IoU=0.50:0.95 | area=all | maxDets=100]" in proc.stdout
    # the results file was parsed once, on rank 0, and its detections broadcast to ranks 1 and 2
    logs = [(run_dir / "ranks" / f"rank{r}" / "log.txt").read_text() for r in range(3)]
    n = len(json.loads(open(RESULTS["segm"]).read()))
    assert f"data.predictions: {n} detections (parsed here)" in logs[0]
    assert all(f"data.predictions: {n} detections (received from rank 0)" in log for log in logs[1:])


def _generated_images(tmp_path, n=6, seed=0):
    """n PNG images (64-96 px) with coloured rectangles, and their COCO annotation file."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    root = tmp_path / "images"
    root.mkdir()
    images, anns = [], []
    for i in range(n):
        w, h = int(rng.integers(64, 97)), int(rng.integers(64, 97))
        pixels = rng.integers(0, 60, size=(h, w, 3), dtype=np.uint8)
        for _ in range(int(rng.integers(0, 4))):  # some images have no object
            x, y = int(rng.integers(0, w - 16)), int(rng.integers(0, h - 16))
            bw, bh = int(rng.integers(8, w - x + 1)), int(rng.integers(8, h - y + 1))
            pixels[y:y + bh, x:x + bw] = rng.integers(120, 255, size=3)
            anns.append({"id": len(anns) + 1, "image_id": 10 + 7 * i, "category_id": int(rng.choice([1, 2, 5])),
                         "bbox": [x, y, bw, bh], "area": bw * bh, "iscrowd": int(rng.random() < 0.1)})
        Image.fromarray(pixels).save(root / f"img{i}.png")
        images.append({"id": 10 + 7 * i, "file_name": f"img{i}.png", "width": w, "height": h})
    cats = [{"id": c, "name": f"shape{c}"} for c in (1, 2, 5)]
    path = tmp_path / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return root, path


def test_live_detector_equals_pycocotools_on_its_own_detections(cli, tmp_path):
    """A randomly initialised torchvision detector on generated images, W = 2: the statistics equal
    pycocotools' on the detections the ranks saw (saved with eval.save_predictions)."""
    root, ann = _generated_images(tmp_path)
    proc, run_dir = cli("+experiment=coco_fasterrcnn", "model.name=fasterrcnn_mobilenet_v3_large_320_fpn",
                        "model.weights=null", "+model.kwargs.min_size=64", "+model.kwargs.max_size=96", f"data.root={root}",
                        f"data.annotations={ann}", "data.num_workers=0", "data.batch_size=2",
                        "eval.save_predictions=true", timeout=600)
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    preds = [p for r in range(2) for p in json.loads((run_dir / "ranks" / f"rank{r}" / "predictions.json").read_text())]
    assert preds, "the random detector produced no detection: the comparison would be empty"
    (tmp_path / "preds.json").write_text(json.dumps(preds))
    want, _ = pycocotools_stats(ann, tmp_path / "preds.json", "bbox")
    assert _stats(res["metrics"]) == want
    assert res["metrics"]["num_images"] == 6 and res["coverage"]["ok"]


@pytest.mark.parametrize("seed,iou_type", [(0, "bbox"), (1, "bbox"), (2, "segm"), (3, "bbox")])
def test_random_sets_equal_pycocotools(tmp_path, seed, iou_type):
    """Seeded generated sets (crowds, empty images, score ties, degenerate boxes, categories without ground
    truth, more than 100 detections per image and category) at W = 1..4: the 12 statistics and the whole
    precision array equal pycocotools'."""
    from disteval.data.coco_synthetic import make_synthetic_coco
    from disteval.metrics.coco_eval import accumulate

    gt_path, dt_path = make_synthetic_coco(tmp_path, num_images=30 + 10 * seed, num_categories=6 + 5 * seed,
                                           dets_per_image=130, seed=seed, crowd_fraction=0.1,
                                           empty_image_fraction=0.1, tie_fraction=0.4, degenerate_fraction=0.05,
                                           missing_category_count=2, iou_type=iou_type, image_size=(160, 120))
    want, ev = pycocotools_stats(gt_path, dt_path, iou_type)
    for w in (1, 2, 3, 4):
        got = shards_in_process(gt_path, dt_path, iou_type, w)
        assert np.abs(np.array(_stats(got)) - np.array(want)).max() <= 1e-12, (w, _stats(got), want)
    # beyond the summary: every precision value, bit for bit
    gt = load_ground_truth(gt_path)
    m = CocoDetectionMetric(gt, iou_type)
    dets = load_detections(dt_path, gt, iou_type)
    m.add_detections(np.arange(gt.num_images), dets.select(np.arange(gt.num_images)))
    m.states()
    from disteval.metrics.coco_eval import RECORD_DTYPE
    rec = m._states["records"].numpy().copy().view(RECORD_DTYPE).reshape(-1)
    precision, recall = accumulate(rec, m._states["npig"].numpy(), gt.num_categories)
    assert np.array_equal(precision, ev.eval["precision"]) and np.array_equal(recall, ev.eval["recall"])


def test_cli_segm_results_with_boxes_equal_pycocotools(cli, tmp_path):
    """Mask R-CNN-style results carry bbox and segmentation: pycocotools then takes the box's w*h as the
    detection's area (area ranges), and so must the replay."""
    from disteval.data.coco_synthetic import make_synthetic_coco

    gt_path, dt_path = make_synthetic_coco(tmp_path, num_images=24, num_categories=5, dets_per_image=30, seed=7,
                                           iou_type="segm", image_size=(160, 120))
    assert "bbox" in json.loads(dt_path.read_text())[0]
    want, _ = pycocotools_stats(gt_path, dt_path, "segm")
    proc, run_dir = cli("+experiment=coco_replay", f"data.annotations={gt_path}", f"data.predictions={dt_path}",
                        "eval.detection.iou_type=segm")
    assert proc.returncode == 0, proc.stderr
    assert _stats(load_results(run_dir)["metrics"]) == want


def test_more_categories_than_int16():
    """Category indices beyond 32767 (records hold int32)."""
    gt = {"images": [{"id": 1, "width": 50, "height": 50}, {"id": 2, "width": 50, "height": 50}],
          "categories": [{"id": c, "name": str(c)} for c in range(1, 33001)],
          "annotations": [{"id": 1, "image_id": 1, "category_id": 33000, "bbox": [1, 1, 20, 20], "area": 400,
                           "iscrowd": 0},
                          {"id": 2, "image_id": 2, "category_id": 33000, "bbox": [1, 1, 20, 20], "area": 400,
                           "iscrowd": 0}]}
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "gt.json").write_text(json.dumps(gt))
        Path(tmp, "dt.json").write_text(json.dumps([{"image_id": 1, "category_id": 33000, "bbox": [1, 1, 20, 20],
                                                     "score": 0.9}]))
        g = load_ground_truth(Path(tmp, "gt.json"))
        m = CocoDetectionMetric(g)
        m.add_detections(np.arange(2), load_detections(Path(tmp, "dt.json"), g, "bbox").select(np.arange(2)))
        out = m.compute()
    # one of two ground truths found at precision 1: 51 of the 101 recall points reach it
    assert out["AP"] == pytest.approx(51 / 101, rel=1e-12)
    assert out["AR100"] == 0.5


def _fake_share(world_size):
    """``share`` callables of W ranks in one process (``Communicator.broadcast_bytes``' contract): rank 0's
    call records the payload, the others receive it; also returns the list of payloads seen."""
    sent = []

    def share(payload):
        if payload is not None:
            sent.append(payload)
        return sent[-1]
    return share, sent


@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_results_parsed_once_and_shared(tmp_path, iou_type):
    """Rank 0 parses the results file; the other ranks rebuild the same arrays (and RLEs) from its compact
    payload, and their statistics equal pycocotools'."""
    from disteval.data.coco_synthetic import make_synthetic_coco
    from disteval.data.coco_wire import load_detections_shared

    gt_path, dt_path = make_synthetic_coco(tmp_path, num_images=20, num_categories=4, dets_per_image=40, seed=5,
                                           iou_type=iou_type, image_size=(160, 120))
    want, _ = pycocotools_stats(gt_path, dt_path, iou_type)
    gt = load_ground_truth(gt_path)
    share, sent = _fake_share(3)
    per_rank = [load_detections_shared(dt_path, gt, iou_type, r, share) for r in range(3)]
    assert len(sent) == 1 and len(sent[0]) < dt_path.stat().st_size
    for dets in per_rank[1:]:
        for f in ("image", "category", "score", "box", "area"):
            assert np.array_equal(getattr(dets, f), getattr(per_rank[0], f)), f
    metrics = []
    for r, part in enumerate(np.array_split(np.arange(gt.num_images), 3)):
        m = CocoDetectionMetric(gt, iou_type)
        m.add_detections(part, per_rank[r].select(part))
        metrics.append(m)
    metrics[0].merge_state(metrics[1:])
    assert _stats(metrics[0].compute()) == want


def test_shared_results_error_reaches_every_rank(tmp_path):
    from disteval.data.coco_wire import load_detections_shared

    gt_path, dt_path = _tiny_set(tmp_path)
    dt_path.write_text('[{"image_id": 5, "category_id": 1,\n  "bbox": [0, 0, 1, 1],\n  "score": .5}]')
    gt = load_ground_truth(gt_path)
    share, _ = _fake_share(2)
    messages = []
    for rank in (0, 1):
        with pytest.raises(DataError) as info:
            load_detections_shared(dt_path, gt, "bbox", rank, share)
        messages.append(str(info.value))
    assert messages[0] == messages[1] and "dt.json is not valid JSON" in messages[0]
    assert "line 3 column 12" in messages[0], messages[0]  # the stray '.5'


def test_typed_and_generic_reading_agree(tmp_path, monkeypatch):
    """Entries the typed decode refuses (true for iscrowd, true for a box side) go through the generic path
    and give the arrays the typed path gives for the plain spelling."""
    from disteval.data import coco

    generic = []
    for name in ("_ground_truth_generic", "_detections_generic"):
        def spy(*args, _f=getattr(coco, name), _name=name):
            generic.append(_name)
            return _f(*args)
        monkeypatch.setattr(coco, name, spy)
    plain = [{"id": 1, "image_id": 5, "category_id": 1, "bbox": [10, 10, 20, 20], "area": 400, "iscrowd": 1},
             {"id": 2, "image_id": 8, "category_id": 3, "bbox": [0, 0, 50, 40], "iscrowd": 0}]
    odd = [dict(plain[0], iscrowd=True), dict(plain[1], extra={"x": [1, None]})]
    dets = [{"image_id": 5, "category_id": 1, "bbox": [11, 10, 20, 1], "score": 1},
            {"image_id": 8, "category_id": 3, "bbox": [0, 0, 40, 40], "score": .5}]
    out = []
    for anns, d in ((plain, dets), (odd, [dict(dets[0], bbox=[11, 10, 20, True]), dets[1]])):
        sub = tmp_path / str(len(out))
        sub.mkdir()
        gt = load_ground_truth(_tiny_set(sub, d, anns)[0])
        out.append((gt, load_detections(sub / "dt.json", gt, "bbox")))
        assert generic == ([] if len(out) == 1 else ["_ground_truth_generic", "_detections_generic"])
    (a, da), (b, db) = out
    for f in ("image_ids", "heights", "widths", "category_ids", "ann_image", "ann_category", "ann_box",
              "ann_area", "ann_crowd", "ann_id"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.ann_area.tolist() == [400.0, 2000.0]
    assert np.array_equal(da.box[0], [11, 10, 20, 1]) and np.array_equal(da.box, db.box)
    assert np.array_equal(da.score, db.score)


def test_ids_beyond_int64_are_named(tmp_path):
    gt_path, dt_path = _tiny_set(tmp_path, [{"image_id": 2 ** 64, "category_id": 1, "bbox": [0, 0, 1, 1],
                                             "score": .5}])
    with pytest.raises(DataError, match=r"dt.json entry 0: image_id 18446744073709551616 does not fit"):
        load_detections(dt_path, load_ground_truth(gt_path), "bbox")


def test_numbers_beyond_float64_are_named(tmp_path):
    gt_path, dt_path = _tiny_set(tmp_path, [{"image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 0.5},
                                            {"image_id": 5, "category_id": 1, "bbox": [0, 0, 1, 1], "score": 1}])
    dt_path.write_text(dt_path.read_text().replace('"score": 1}', '"score": 1e400}'))
    with pytest.raises(DataError, match=r"dt.json entry 1: score must be a finite number, got inf"):
        load_detections(dt_path, load_ground_truth(gt_path), "bbox")


@needs_coco
@pytest.mark.parametrize("iou_type", ["bbox", "segm"])
def test_typed_reading_equals_generic_on_real_files(iou_type, monkeypatch):
    """The real val2014 files read through the typed decode and through the generic one (forced): the same
    arrays, the same RLEs."""
    from disteval.data import coco

    def read():
        gt = load_ground_truth(GT)
        return gt, load_detections(RESULTS[iou_type], gt, iou_type)

    (a, da) = read()
    monkeypatch.setattr(coco, "decode_typed", lambda data, kind: None)
    (b, db) = read()
    for f in ("image_ids", "heights", "widths", "category_ids", "ann_image", "ann_category", "ann_box",
              "ann_area", "ann_crowd", "ann_id"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.file_names == b.file_names and a.category_names == b.category_names
    for f in ("image", "category", "score", "box", "area"):
        assert np.array_equal(getattr(da, f), getattr(db, f)), f
    if iou_type == "segm":
        assert [a.rle(i) for i in range(len(a.ann_id))] == [b.rle(i) for i in range(len(b.ann_id))]
        assert da.segmentation == db.segmentation
