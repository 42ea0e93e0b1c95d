"""COCO keypoint AP/AR (OKS) as a mergeable metric, with the semantics of pycocotools' COCOeval for
``iouType="keypoints"`` (computeOks, evaluateImg, accumulate, summarize) reproduced bit for bit.

Parameters as pycocotools' ``setKpParams``: OKS thresholds .50:.05:.95, 101 recall thresholds, maxDets 20, area
ranges all [0, 1e10], medium [32^2, 96^2], large [96^2, 1e10]; per-keypoint sigmas of the 17 COCO person
keypoints (``SIGMAS``; other keypoint counts need ``sigmas``).

OKS (computeOks): for a ground truth with k1 > 0 labelled keypoints, e_i = (dx_i^2 + dy_i^2) / (2 sigma_i)^2 /
(area + eps) / 2 over its labelled keypoints; without labelled keypoints, dx and dy are the distances outside the
box grown by its size on each side. OKS = sum(exp(-e)) / len(e). Each rank matches the images it evaluated
(per image and category: the detections by descending score, truncated to 20, greedily as evaluateImg) into the
27-byte records of ``coco_eval`` (tp/fp bits per threshold and area range); rank 0 gathers them and runs
``coco_eval.accumulate``. Source: pycocotools/cocoeval.py (cocodataset/cocoapi).
"""
from __future__ import annotations

import numpy as np
import torch

from disteval.errors import DataError
from disteval.metrics.base import Metric
from disteval.metrics.meaning import Meaning
from disteval.metrics.coco_eval import IOU_THRS, T, accumulate, record_dtype

SIGMAS = np.array([.26, .25, .25, .35, .35, .79, .79, .72, .72, .62, .62, 1.07, 1.07, .87, .87, .89, .89]) / 10.0
AREA_RNG = ((0 ** 2, 1e5 ** 2), (32 ** 2, 96 ** 2), (96 ** 2, 1e5 ** 2))
AREA_LBL = ("all", "medium", "large")
MAX_DETS = (20,)
STAT_NAMES = ("AP", "AP50", "AP75", "APm", "APl", "AR", "AR50", "AR75", "ARm", "ARl")
RECORD = record_dtype(len(AREA_RNG))


def oks(dts: np.ndarray, gts: np.ndarray, gt_area: np.ndarray, gt_bbox: np.ndarray, sigmas: np.ndarray) -> np.ndarray:
    """float64 [D, G]: pycocotools' computeOks between detections ``dts`` [D, P, 3] and ground truths ``gts``
    [G, P, 3] (their ``gt_area`` [G] and ``gt_bbox`` [G, 4] xywh), with the same float operations."""
    out = np.zeros((len(dts), len(gts)))
    var = (sigmas * 2) ** 2
    k = len(sigmas)
    for j, g in enumerate(gts):
        xg, yg, vg = g[:, 0], g[:, 1], g[:, 2]
        k1 = np.count_nonzero(vg > 0)
        bb = gt_bbox[j]
        x0, x1, y0, y1 = bb[0] - bb[2], bb[0] + bb[2] * 2, bb[1] - bb[3], bb[1] + bb[3] * 2
        for i, d in enumerate(dts):
            xd, yd = d[:, 0], d[:, 1]
            if k1 > 0:
                dx, dy = xd - xg, yd - yg
            else:
                z = np.zeros(k)
                dx = np.max((z, x0 - xd), axis=0) + np.max((z, xd - x1), axis=0)
                dy = np.max((z, y0 - yd), axis=0) + np.max((z, yd - y1), axis=0)
            e = (dx ** 2 + dy ** 2) / var / (gt_area[j] + np.spacing(1)) / 2
            if k1 > 0:
                e = e[vg > 0]
            out[i, j] = np.sum(np.exp(-e)) / e.shape[0]
    return out


def match_image(det: dict, gt: dict, sigmas: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One (image, category) as pycocotools' evaluateImg at maxDets 20 for every area range. ``det``: keypoints
    [D, P, 3], scores [D], area [D] (in the file's order); ``gt``: keypoints, area, bbox, ignore, ann_id.
    Returns (kept detection indices in score order, tp bool [n, T, A], fp bool [n, T, A])."""
    order = np.argsort(-det["scores"], kind="mergesort")[:MAX_DETS[-1]]
    ious = oks(det["keypoints"][order], gt["keypoints"], gt["area"], gt["bbox"], sigmas) \
        if len(order) and len(gt["area"]) else np.zeros((len(order), 0))
    n, a_n = len(order), len(AREA_RNG)
    tp, fp = np.zeros((n, T, a_n), bool), np.zeros((n, T, a_n), bool)
    for a, (lo, hi) in enumerate(AREA_RNG):
        g_ig = gt["ignore"] | (gt["area"] < lo) | (gt["area"] > hi)
        gind = np.argsort(g_ig, kind="mergesort")
        g_ig_s, crowd = g_ig[gind], gt["crowd"][gind]
        iou = ious[:, gind]
        for t, thr in enumerate(IOU_THRS):
            gtm = np.zeros(len(gind), bool)
            for d in range(n):
                best, m = min(thr, 1 - 1e-10), -1
                for g in range(len(gind)):
                    if gtm[g] and not crowd[g]:
                        continue
                    if m > -1 and not g_ig_s[m] and g_ig_s[g]:
                        break
                    if iou[d, g] < best:
                        continue
                    best, m = iou[d, g], g
                if m == -1:
                    out = det["area"][order[d]] < lo or det["area"][order[d]] > hi
                    fp[d, t, a] = not out
                    continue
                gtm[m] = True
                matched = gt["ann_id"][gind[m]] != 0  # pycocotools stores the gt id: id 0 reads as unmatched
                ignored = g_ig_s[m] or (not matched and (det["area"][order[d]] < lo or det["area"][order[d]] > hi))
                tp[d, t, a], fp[d, t, a] = matched and not ignored, not matched and not ignored
    return order, tp, fp


class CocoKeypointMetric(Metric):
    """COCO keypoint AP/AR over the images of ``gt`` (``disteval.data.coco_keypoints.KeypointGroundTruth``).

    ``update(outputs, targets, sample_ids)``: outputs = per image a dict with ``keypoints`` [n, P, 3], ``scores``
    [n], ``labels`` [n] (category ids), optionally ``area`` [n] (else the keypoints' extent, as loadRes);
    targets = int64 [B] image indices. States: ``records`` (gathered), ``images`` (gathered), ``npig`` int64
    [K, 3] (summed). ``compute()``: the 10 statistics of pycocotools' ``_summarizeKps``."""

    meaning = Meaning(main=("AP",), precedence=10)

    def __init__(self, gt, sigmas: np.ndarray | None = None):
        super().__init__()
        self.gt = gt
        self.sigmas = SIGMAS if sigmas is None else np.asarray(sigmas, dtype=np.float64)
        if len(self.sigmas) != gt.num_parts:
            raise DataError(f"{gt.path}: {gt.num_parts} keypoints per instance, but {len(self.sigmas)} OKS sigmas "
                            "(the COCO person sigmas are for 17 keypoints)")
        self.add_state("records", torch.zeros((0, RECORD.itemsize), dtype=torch.uint8), "gather", root=True)
        self.add_state("images", torch.zeros(0, dtype=torch.int64), "gather", root=True)
        self.add_state("npig", torch.zeros((gt.num_categories, len(AREA_RNG)), dtype=torch.int64))
        order = np.argsort(gt.image, kind="stable")
        self._gt_order, self._gt_starts = order, np.searchsorted(gt.image[order], np.arange(gt.num_images + 1))

    def update(self, outputs, targets, sample_ids) -> None:
        """Match each image of the batch (see the class docstring)."""
        recs, npig = [], np.zeros((self.gt.num_categories, len(AREA_RNG)), dtype=np.int64)
        images = torch.as_tensor(targets).long().cpu().numpy()
        for img, out in zip(images.tolist(), outputs):
            recs.append(self._match(int(img), out, npig))
        s = self.state_tensors
        rec = np.concatenate(recs) if recs else np.zeros(0, RECORD)
        s["records"] = torch.cat([s["records"], torch.from_numpy(rec.view(np.uint8).reshape(len(rec), RECORD.itemsize).copy())])
        s["images"] = torch.cat([s["images"], torch.from_numpy(images.astype(np.int64))])
        s["npig"] = s["npig"] + torch.from_numpy(npig)

    def _match(self, img: int, out: dict, npig: np.ndarray) -> np.ndarray:
        g = self._gt_order[self._gt_starts[img]:self._gt_starts[img + 1]]
        kps = np.asarray(out["keypoints"], dtype=np.float64).reshape(-1, self.gt.num_parts, 3)
        labels = np.asarray(out["labels"]).astype(np.int64).reshape(-1)
        scores = np.asarray(out["scores"], dtype=np.float64).reshape(-1)
        area = np.asarray(out["area"], dtype=np.float64) if "area" in out else keypoint_area(kps)
        cat = np.searchsorted(self.gt.category_ids, labels)
        known = (cat < self.gt.num_categories) & (self.gt.category_ids[np.minimum(cat, self.gt.num_categories - 1)] == labels)
        parts = []
        for k in range(self.gt.num_categories):
            gk = g[self.gt.category[g] == k]
            gt = {"keypoints": self.gt.keypoints[gk], "area": self.gt.area[gk], "bbox": self.gt.bbox[gk],
                  "ignore": self.gt.ignore[gk], "crowd": self.gt.crowd[gk], "ann_id": self.gt.ann_id[gk]}
            for a, (lo, hi) in enumerate(AREA_RNG):
                npig[k, a] += int((~(gt["ignore"] | (gt["area"] < lo) | (gt["area"] > hi))).sum())
            d = np.nonzero(known & (cat == k))[0]
            if not len(d):
                continue
            order, tp, fp = match_image({"keypoints": kps[d], "scores": scores[d], "area": area[d]}, gt, self.sigmas)
            rec = np.zeros(len(order), RECORD)
            rec["score"], rec["image"], rec["category"], rec["position"] = scores[d][order], img, k, np.arange(len(order))
            rec["tp"] = np.packbits(tp.reshape(len(order), -1), axis=1)
            rec["fp"] = np.packbits(fp.reshape(len(order), -1), axis=1)
            parts.append(rec)
        return np.concatenate(parts) if parts else np.zeros(0, RECORD)

    def compute(self) -> dict:
        """``AP, AP50, AP75, APm, APl, AR, AR50, AR75, ARm, ARl`` (pycocotools' ``_summarizeKps``; -1 where
        undefined), ``num_images``, ``detections_evaluated``. Raises DataError naming images evaluated twice."""
        images = self.state_tensors["images"].numpy()
        uniq, counts = np.unique(images, return_counts=True)
        if (counts > 1).any():
            raise DataError(f"image ids {self.gt.image_ids[uniq[counts > 1]][:10].tolist()} were evaluated more than once")
        rec = self.state_tensors["records"].numpy().copy().view(RECORD).reshape(-1)
        precision, recall = accumulate(rec, self.state_tensors["npig"].numpy(), self.gt.num_categories, MAX_DETS)
        return {**summarize_keypoints(precision, recall), "num_images": int(len(uniq)),
                "detections_evaluated": int(len(rec))}


def summarize_keypoints(precision: np.ndarray, recall: np.ndarray) -> dict[str, float]:
    """The 10 statistics of pycocotools' ``_summarizeKps`` (maxDets 20; -1 where nothing is defined)."""

    def one(ap: bool, thr=None, area="all") -> float:
        a = AREA_LBL.index(area)
        s = precision if ap else recall
        if thr is not None:
            s = s[np.where(thr == IOU_THRS)[0]]
        s = s[..., a, 0]
        return -1.0 if len(s[s > -1]) == 0 else float(np.mean(s[s > -1]))

    values = [one(True), one(True, .5), one(True, .75), one(True, area="medium"), one(True, area="large"),
              one(False), one(False, .5), one(False, .75), one(False, area="medium"), one(False, area="large")]
    return dict(zip(STAT_NAMES, values))


def keypoint_area(keypoints: np.ndarray) -> np.ndarray:
    """float64 [n]: (max x - min x) * (max y - min y) over each detection's keypoints [n, P, 3], all of them,
    as pycocotools' ``loadRes`` computes a keypoint detection's area."""
    x, y = keypoints[:, :, 0], keypoints[:, :, 1]
    return (x.max(1) - x.min(1)) * (y.max(1) - y.min(1)) if len(keypoints) else np.zeros(0)
