"""Semantic segmentation (``disteval.metrics.segmentation``, ``disteval.tasks.segmentation``): the int64
confusion matrix and every metric against scikit-learn / numpy on maps rasterised independently with pycocotools'
COCO API from the shared val2014 files; ``mIoU_per_image`` against torchmetrics' MeanIoU; more than 2^24 pixels in
one cell (int64 exact where float32 is not); then real gloo ranks through the whole engine at W = 1..4 (COCO
replay, the >2^24 set, and a random-init lraspp_mobilenet_v3_large on generated images of several sizes at
W = 1..3, equal to its own saved predictions replayed). One process group per W runs every case of that W."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitwise_workers import engine_cases_worker, job, load_metrics
from disteval.errors import ConfigError, DataError
from disteval.metrics.segmentation import SegmentationMetrics, code_dtype, first_argmax
from disteval.tasks.segmentation import SegmentationReplayTask
from launchers.local import launch
from seg_reference import (COCO_GT, COCO_SEGM, IGNORE, coco_maps, metrics_from_confusion, numpy_confusion,
                           sklearn_confusion, write_voc)

KEYS = ("mIoU", "mean_accuracy", "mean_dice", "pixel_accuracy", "num_pixels", "fwIoU", "per_class_IoU",
        "per_class_accuracy", "per_class_dice", "per_class_support", "per_class_predicted")
BIG = [(2048, 2048)] * 4 + [(1, 7)]  # 2^24 + 7 labelled pixels of class 1
BIG_RANKS = BIG[:4] + [(40, 40)]  # 2^24 + 1,600 pixels, 15 of them ignored
LIVE_SIZES = [(40, 56), (48, 48), (40, 56), (64, 40), (33, 47), (48, 48), (50, 30)]


def _replay_cfg(**data):
    return job({"model": {"name": "replay"}, "eval": {"metrics": ["segmentation"]},
                "data": {"name": "semseg_replay", "split": "val", "batch_size": 8, **data}})


def _run(metric: SegmentationMetrics, dataset, batch: int) -> dict:
    for start in range(0, len(dataset), batch):
        items = [dataset[i] for i in range(start, min(start + batch, len(dataset)))]
        metric.update([p for p, _, _ in items], [lab for _, lab, _ in items], torch.tensor([i for _, _, i in items]))
    return metric.compute()


@pytest.fixture(scope="module")
def coco():
    if not COCO_GT.is_file() or not COCO_SEGM.is_file():
        pytest.skip(f"the shared COCO files are missing ({COCO_GT.parent}: ../shared/data beside the checkout)")
    labels, preds, c = coco_maps()
    return labels, preds, c, metrics_from_confusion(sklearn_confusion(labels, preds, c))


def test_coco_maps_equal_pycocotools(coco):
    """The task's rasterised label and predicted maps equal pycocotools' annToMask ones pixel for pixel (the
    metrics on them are compared with scikit-learn through real ranks below)."""
    labels, preds, c, want = coco
    task = SegmentationReplayTask(_replay_cfg(annotations=str(COCO_GT), predictions=str(COCO_SEGM)))
    task.preflight([])
    ds = task.dataset()
    assert task.num_classes == c == 81 and len(ds) == 100
    crowded = [i for i, lab in enumerate(labels) if (lab == IGNORE).any()]
    for i in [0, 17, 99, *crowded[:2]]:
        pred, lab, sid = ds[i]
        assert sid == i and np.array_equal(lab.numpy(), labels[i]) and np.array_equal(pred.numpy(), preds[i])
    assert crowded  # the crowds are there
    assert want["mIoU"] is not None and sum(v is not None for v in want["per_class_IoU"]) < c  # absent -> null


def test_generated_logits_resized_bilinearly_merge_and_slices():
    """Float logits of another size are resized bilinearly to the label (labels never), argmax, then counted:
    equal to scikit-learn on an independent resize; merge_state of three parts and the reduce-scatter per-slice
    path give the very same results."""
    g, c = torch.Generator().manual_seed(3), 6
    parts = [SegmentationMetrics(c) for _ in range(3)]
    whole = SegmentationMetrics(c)
    labels, preds = [], []
    for i, (h, w) in enumerate([(13, 17), (20, 9), (8, 8), (31, 22), (5, 40)]):
        lab = torch.randint(0, c - 1, (h, w), generator=g)  # class c-1 never labelled
        lab[torch.rand(h, w, generator=g) < 0.1] = IGNORE
        logits = torch.randn(c, (h + 1) // 2, (w + 3) // 3, generator=g)
        if i == 2:  # same size as the label, rounded: ties between classes go to the lowest index (numpy's argmax)
            logits = (torch.randn(c, h, w, generator=g) * 2).round()
        for m in (whole, parts[i % 3]):
            m.update([logits], [lab.to(torch.uint8)], torch.tensor([i]))
        preds.append(np.argmax(F.interpolate(logits[None], size=(h, w), mode="bilinear", align_corners=False)[0].numpy(), 0))
        labels.append(lab.numpy())
    want = metrics_from_confusion(sklearn_confusion(labels, preds, c))
    got = whole.compute()
    assert {k: got[k] for k in KEYS} == {k: want[k] for k in KEYS}
    parts[0].merge_state(parts[1:])
    assert parts[0].compute() == got
    cm = whole.states()["confusion"][0]
    sliced = SegmentationMetrics(c)
    sliced.load_synced({"per_image": whole.states()["per_image"][0]})
    rows = [sliced.finish_slice("confusion", cm[a:b], a, b, sliced.slice_partials("confusion", cm, 0, c)[a:b])
            for a, b in [(0, 2), (2, 5), (5, 6)]]
    sliced.load_finished("confusion", torch.cat(rows))
    assert sliced.compute() == got


def test_absent_classes_are_null_and_left_out_of_means():
    m = SegmentationMetrics(4)
    lab = torch.tensor([[0, 0, 1, 1]])
    m.update([torch.tensor([[0, 1, 1, 1]])], [lab], torch.tensor([0]))
    got = m.compute()
    assert got["per_class_IoU"] == [0.5, 2 / 3, None, None] and got["mIoU"] == (0.5 + 2 / 3) / 2
    assert got["per_class_accuracy"] == [0.5, 1.0, None, None] and got["classes_present"] == 2


def _tm_states(preds, labels, c, ignore_mask=None):
    """torchmetrics MeanIoU (index input). Ignored pixels go to an extra class c in both maps, and the result is
    read from its states without that class: sum of per-image IoUs / number of (image, class) pairs present."""
    from torchmetrics.segmentation import MeanIoU

    tm = MeanIoU(num_classes=c + 1, input_format="index", per_class=True)
    for p, lab in zip(preds, labels):
        p, lab = torch.as_tensor(p).long().clone(), torch.as_tensor(lab).long().clone()
        p[lab == IGNORE] = c
        lab[lab == IGNORE] = c
        tm.update(p[None], lab[None])
    score, n = tm.score.double()[:c], tm.num_batches.double()[:c]
    return float(score.sum() / n.sum()), [None if k == 0 else float(s / k) for s, k in zip(score, n)], tm


def _assert_per_class_close(got: list, want: list) -> None:
    """Absent classes (None) in the same places, present ones within 1e-6 relative (torchmetrics sums in float32).
    pytest.approx is not used on the whole list: from pytest 9.2 it raises TypeError on a None element."""
    assert [v is None for v in got] == [v is None for v in want]
    assert [v for v in got if v is not None] == pytest.approx([v for v in want if v is not None], rel=1e-6, abs=0)


def test_miou_per_image_is_torchmetrics_mean_iou(coco):
    """mIoU_per_image equals torchmetrics' MeanIoU (per_class=False) on maps without ignored pixels, and its
    states' definition (per-image IoU summed over present (image, class) pairs) with ignored pixels; the
    per-class variant equals per_class=True. torchmetrics sums in float32: compared to 1e-6."""
    from torchmetrics.segmentation import MeanIoU

    g, c = torch.Generator().manual_seed(5), 5
    labels = [torch.randint(0, 4, (h, w), generator=g) for h, w in [(9, 11), (16, 16), (7, 30)]]
    preds = [torch.randint(0, 5, lab.shape, generator=g) for lab in labels]
    labels[1][:] = 2  # an image with a single class
    m = SegmentationMetrics(c)
    tm = MeanIoU(num_classes=c, input_format="index")
    for i, (p, lab) in enumerate(zip(preds, labels)):
        m.update([p], [lab], torch.tensor([i]))
        tm.update(p[None], lab[None])
    got = m.compute()
    assert got["mIoU_per_image"] == pytest.approx(float(tm.compute()), rel=1e-6)
    assert got["mIoU_per_image"] != got["mIoU"]  # two definitions, two names
    want_mean, want_per_class, _ = _tm_states(preds, labels, c)
    assert got["mIoU_per_image"] == pytest.approx(want_mean, rel=1e-6)
    _assert_per_class_close(got["per_class_IoU_per_image"], want_per_class)
    labels_c, preds_c, cc, _ = coco
    sub = [i for i, lab in enumerate(labels_c) if (lab == IGNORE).any()][:2]  # two COCO images with crowd pixels
    m = SegmentationMetrics(cc)
    for i in sub:
        m.update([torch.from_numpy(preds_c[i])], [torch.from_numpy(labels_c[i])], torch.tensor([i]))
    want_mean, want_per_class, _ = _tm_states([preds_c[i] for i in sub], [labels_c[i] for i in sub], cc)
    got = m.compute()
    assert got["mIoU_per_image"] == pytest.approx(want_mean, rel=1e-6)
    _assert_per_class_close(got["per_class_IoU_per_image"], want_per_class)


def test_int64_cell_beyond_2_24_where_float32_rounds():
    """2^24 + 7 pixels of class 1 predicted as 1: the int64 cell holds 16,777,223; torch.histc (float32 counts,
    mmsegmentation's IoUMetric) reports 16,777,224 for the same pixels."""
    m = SegmentationMetrics(3)
    n = 0
    for i, (h, w) in enumerate(BIG):
        lab = torch.ones((h, w), dtype=torch.uint8)
        m.update([lab.long()], [lab], torch.tensor([i]))
        n += h * w
    assert n == 2 ** 24 + 7 and m.states()["confusion"][0][1, 1].item() == n
    codes = torch.cat([torch.full((h * w,), 1 * 3 + 1, dtype=torch.float32) for h, w in BIG])
    assert torch.histc(codes, bins=9, min=0, max=8)[4].item() == 16_777_224 != n


@pytest.mark.parametrize("c", [1, 2, 21, 255, 256, 300])
def test_first_argmax_is_torch_argmax_with_ties_zeros_and_nan(c):
    """``first_argmax`` == ``torch.argmax(0)`` (== numpy's) on rounded logits full of ties, +0.0 against -0.0 at
    the max, and NaN pixels counted; dtypes uint8 (C < 256) and int16."""
    g = torch.Generator().manual_seed(c)
    x = torch.randint(-2, 3, (c, 23, 17), generator=g).float()  # five values: ties everywhere
    x[:, 0, :] = 0.0
    x[::2, 0, :] = -0.0  # signed zeros tie at the max of row 0
    x[-1, 1, 2] = float("nan")
    x[0, 2, 3] = float("nan")
    pred, nan = first_argmax(x, torch.empty(x.shape, dtype=torch.bool))
    assert pred.dtype == (torch.uint8 if c < 256 else torch.int16) and int(nan) == 2
    keep = ~torch.isnan(x).any(0)
    want = torch.from_numpy(np.argmax(x.numpy(), 0))
    assert torch.equal(pred.long()[keep], want[keep]) and torch.equal(pred.long()[keep], x.argmax(0)[keep])


def test_codes_in_narrow_dtypes_count_as_int64():
    """Codes label * C + pred are built in int16 / int32 when they fit (``code_dtype``); counts equal numpy's on
    int64 labels with ignore and a C whose codes need int32 ((C + 2) * C > 2^15)."""
    assert [code_dtype(n) for n in (1 << 15, (1 << 15) + 1, 1 << 31, (1 << 31) + 1)] == [
        torch.int16, torch.int32, torch.int32, torch.int64]
    for c, dtype in ((7, torch.uint8), (7, torch.int64), (200, torch.int64), (200, torch.uint8)):
        g = torch.Generator().manual_seed(c)
        lab = torch.randint(0, c, (31, 29), generator=g)
        lab[torch.rand(lab.shape, generator=g) < 0.1] = 255
        pred = torch.randint(0, c, (31, 29), generator=g)
        m = SegmentationMetrics(c)
        m.update([pred], [lab.to(dtype)], torch.tensor([0]))
        keep = lab != 255
        want = np.zeros((c, c), np.int64)
        np.add.at(want, (lab[keep].numpy(), pred[keep].numpy()), 1)
        assert np.array_equal(m.states()["confusion"][0].numpy(), want)


def test_bad_input_names_the_sample():
    m = SegmentationMetrics(5)
    with pytest.raises(DataError, match="sample id 12: 1 label pixels outside"):
        m.update([torch.zeros(2, 2, dtype=torch.long)], [torch.tensor([[0, 7], [255, 1]])], torch.tensor([12]))
    with pytest.raises(DataError, match=r"sample id 3: predicted map of shape \(2, 3\)"):
        m.update([torch.zeros(2, 3, dtype=torch.long)], [torch.zeros(2, 2, dtype=torch.long)], torch.tensor([3]))
    nan = torch.zeros(5, 2, 2)
    nan[3, 1, 1] = float("nan")
    with pytest.raises(DataError, match=r"sample id 8: 1 predicted pixels .*NaN"):
        m.update([nan], [torch.zeros(2, 2, dtype=torch.long)], torch.tensor([8]))
    with pytest.raises(DataError, match="sample id 4: logits of shape"):
        m.update([torch.zeros(4, 2, 2)], [torch.zeros(2, 2, dtype=torch.long)], torch.tensor([4]))


def test_voc_experiment_refused_before_ranks_without_its_folder(tmp_path):
    from hydra import compose, initialize_config_dir

    from disteval.config import conf_dir, register_schemas
    from disteval.job.preflight import preflight

    register_schemas()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+experiment=voc_deeplabv3", "model.weights=null"])
        missing = compose(config_name="config", overrides=["+experiment=voc_deeplabv3", "model.weights=null",
                                                           f"data.root={tmp_path / 'nope'}"])
        gt = tmp_path / "gt.json"  # an annotation file of its own: the test runs without ../shared too
        gt.write_text(json.dumps({"images": [{"id": 1, "width": 4, "height": 4}], "annotations": [],
                                  "categories": [{"id": 1, "name": "a"}]}))
        replay = compose(config_name="config", overrides=["+experiment=coco_semseg_replay",
                                                          f"data.annotations={gt}", "data.predictions=null"])
    with pytest.raises(ConfigError, match="data.root.*VOC-format folder"):
        preflight(cfg)
    with pytest.raises(ConfigError, match="does not exist"):
        preflight(missing)
    with pytest.raises(ConfigError, match="data.predictions"):
        preflight(replay)


@pytest.mark.gpu
def test_cuda_update_counts_on_the_device_without_host_sync():
    """On a CUDA device update() issues no host synchronisation (torch's sync debug mode raises on one) and
    counts exactly what the CPU path counts; a bad label is raised after the loop (raise_deferred), naming
    the sample. Marked gpu: deselected without CUDA (tests/conftest.py)."""
    g, c, dev = torch.Generator().manual_seed(9), 7, torch.device("cuda")
    batches = []
    for k, (h, w) in enumerate([(33, 41), (64, 64), (17, 90)]):
        lab = torch.randint(0, c, (h, w), generator=g, dtype=torch.uint8)
        lab[:2] = IGNORE
        batches.append(([torch.randn(c, h // 2, w // 2, generator=g)], [lab], torch.tensor([k])))
    cpu, gpu = SegmentationMetrics(c), SegmentationMetrics(c)
    for outs, labs, ids in batches:
        cpu.update(outs, labs, ids)
    pinned = [([o.to(dev) for o in outs], [lab.pin_memory() for lab in labs], ids) for outs, labs, ids in batches]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for outs, labs, ids in pinned:
            gpu.update(outs, labs, ids)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert gpu.states()["confusion"][0].device.type == "cuda"
    assert torch.equal(gpu.states()["confusion"][0].cpu(), cpu.states()["confusion"][0])
    bad = SegmentationMetrics(c)
    bad.update([torch.zeros(c, 2, 2, device=dev)], [torch.tensor([[0, 9], [1, 1]], device=dev)], torch.tensor([5]))
    with pytest.raises(DataError, match="sample id 5"):
        bad.raise_deferred()


# ------------------------------------------------------------------------------------------ real ranks
@pytest.fixture(scope="module")
def ranks(tmp_path_factory, coco):
    root = tmp_path_factory.mktemp("seg")
    big_labels = [np.ones(s, np.uint8) for s in BIG_RANKS]
    big_preds = [lab.copy() for lab in big_labels]
    big_labels[0][:3, :5], big_preds[1][7:9, :] = IGNORE, 2  # ignored pixels, and misses into class 2
    write_voc(root / "big", None, big_labels, predictions=big_preds)
    rng = np.random.default_rng(11)
    live_labels = [rng.integers(0, 5, s).astype(np.uint8) for s in LIVE_SIZES]
    live_labels[2][:4] = IGNORE
    write_voc(root / "live", [rng.integers(0, 256, (*s, 3), dtype=np.uint8) for s in LIVE_SIZES], live_labels)
    replay = {"model": {"name": "replay"}, "eval": {"metrics": ["segmentation"], "record_batches": False}}
    coco_data = {"name": "semseg_replay", "annotations": str(COCO_GT), "predictions": str(COCO_SEGM)}
    cases = {"coco_b7": {**replay, "data": {**coco_data, "batch_size": 7}},
             "coco_b16_rs": {**replay, "data": {**coco_data, "batch_size": 16},
                             "communication": {"reduce_scatter_min_bytes": 0}},  # confusion reduce-scattered
             "big": {**replay, "data": {"name": "semseg_replay", "split": "val", "root": str(root / "big"), "num_classes": 3,
                                        "predictions": str(root / "big" / "pred"), "batch_size": 2}}}
    live = {"live": {"model": {"name": "lraspp_mobilenet_v3_large", "weights": None, "num_classes": 5},
                     "data": {"name": "voc", "split": "val", "root": str(root / "live"), "batch_size": 3, "num_workers": 0,
                              "num_classes": 5, "resize_size": 32},  # logits 32 px short side, labels larger
                     "eval": {"metrics": ["segmentation"], "save_predictions": True}}}
    out = {}
    for w in (1, 2, 3, 4):
        d = tmp_path_factory.mktemp(f"w{w}")
        todo = {name: case for name, case in {**cases, **live}.items()
                if not (name == "live" and w == 4) and not (name == "coco_b16_rs" and w != 3)}
        launch(engine_cases_worker, (str(d), todo), w, str(d))
        out[w] = {name: load_metrics(d, name) for name in todo}
        if w <= 3:
            out[w]["live_predictions"] = [e for r in range(w) for e in
                                          json.loads((d / "live" / "ranks" / f"rank{r}" / "predictions.json").read_text())]
            import pyarrow.parquet as pq  # the Parquet store: each image's confusion counts, at the label's size

            table = pq.read_table(d / "live" / "predictions")
            out[w]["live_store"] = np.stack(table.column("confusion").to_numpy(zero_copy_only=False)).sum(0).reshape(5, 5)
    return root, out, [big_labels, big_preds]


def test_coco_replay_equals_sklearn_at_every_world_size(ranks, coco):
    _, out, _ = ranks
    want = coco[3]
    for w in (1, 2, 3, 4):
        for name in [n for n in ("coco_b7", "coco_b16_rs") if n in out[w]]:
            res = out[w][name]
            assert res["world_size"] == w and res["coverage"]["ok"]
            if name == "coco_b16_rs":
                assert res["comm"]["by_op"].get("reduce_scatter", 0) >= 2, res["comm"]
            for key in KEYS:
                assert res["metrics"][key] == want[key], (w, name, key)
            assert res["metrics"] == out[1]["coco_b7"]["metrics"], (w, name)  # bit for bit, every key
    print("COCO semseg replay mIoU", out[1]["coco_b7"]["metrics"]["mIoU"])


def test_cell_beyond_2_24_through_ranks(ranks):
    _, out, (labels, preds) = ranks
    want = metrics_from_confusion(numpy_confusion(labels, preds, 3))
    assert want["per_class_support"][1] > 2 ** 24
    for w in (1, 2, 3, 4):
        got = out[w]["big"]["metrics"]
        assert {k: got[k] for k in KEYS} == {k: want[k] for k in KEYS}, w


def test_live_lraspp_bit_identical_and_equal_to_its_saved_predictions(ranks, tmp_path):
    root, out, _ = ranks
    base = out[1]["live"]["metrics"]
    assert base["num_images"] == len(LIVE_SIZES) and base["num_pixels"] > 0
    for w in (2, 3):
        assert out[w]["live"]["metrics"] == base, w
        assert sorted(map(json.dumps, out[w]["live_predictions"])) == sorted(map(json.dumps, out[1]["live_predictions"]))
        assert np.array_equal(out[w]["live_store"], out[1]["live_store"])
    store = out[1]["live_store"]  # rows: labels, columns: predictions (logits resized to the labels as the metric does)
    assert store.sum(1).tolist() == base["per_class_support"] and store.sum(0).tolist() == base["per_class_predicted"]
    saved = tmp_path / "predictions.json"
    saved.write_text(json.dumps(out[1]["live_predictions"]))
    cfg = _replay_cfg(root=str(root / "live"), predictions=str(saved), num_classes=5, batch_size=3)
    task = SegmentationReplayTask(cfg)
    task.preflight([])
    assert _run(task.metric(), task.dataset(), 3) == base
    assert cfg.eval.segmentation.ignore_index == IGNORE
