"""Bootstrap confidence intervals of the 12 COCO statistics over images (``eval.ci.*`` on detection data).

A resample draws images with replacement (positions into the evaluated images, sorted by image index, so the
same at every world size). Its statistics are those pycocotools gives for the dataset in which each drawn image
appears as often as it was drawn, each copy a distinct image: the per-detection match records of a copy are its
image's records (matching is per image), the non-ignored ground-truth counts are summed per copy, and
``coco_eval.accumulate`` / ``summarize`` run on them (ties between copies in copy order, as pycocotools orders
ties by image id). ``scipy.stats.bootstrap`` (percentile, seeded) draws the resamples; the test checks one
resample against pycocotools on such a duplicated dataset. Source of the method: Efron & Tibshirani (1993),
ch. 13; resampling images rather than detections keeps each image's matches together.
"""
from __future__ import annotations

import numpy as np

from disteval.common.coco_types import GroundTruthShard
from disteval.metrics.bootstrap import vector_intervals
from disteval.metrics.coco_eval import A, STAT_NAMES, _area_out, accumulate, summarize


def image_npig(gt: GroundTruthShard, images: np.ndarray, num_categories: int) -> np.ndarray:
    """int64 [I, K, A]: per evaluated image (``images`` sorted image indices), category and area range, its
    non-ignored ground truths (not crowd, area inside the range), as ``match_shard`` counts them."""
    out = np.zeros((len(images), num_categories, A), dtype=np.int64)
    keep = ~(gt.crowd[:, None] | _area_out(gt.area))                  # [G, A]
    pos = np.searchsorted(images, gt.image)
    for a in range(A):
        np.add.at(out[:, :, a], (pos, gt.category), keep[:, a].astype(np.int64))
    return out


class ImageResampler:
    """``self(idx)``: the 12 statistics (float64 [12], ``STAT_NAMES`` order) of the image multiset ``idx``
    (positions into ``images``). ``records`` RECORD_DTYPE [n] of every image, ``images`` int64 [I] sorted,
    ``npig_img`` from ``image_npig``."""

    def __init__(self, records: np.ndarray, images: np.ndarray, npig_img: np.ndarray, num_categories: int):
        order = np.argsort(records["image"], kind="stable")
        self.records = records[order]
        pos = np.searchsorted(images, self.records["image"])
        self.starts = np.searchsorted(pos, np.arange(len(images) + 1))
        self.npig_img, self.num_categories = npig_img, num_categories

    def __call__(self, idx: np.ndarray) -> np.ndarray:
        idx = np.sort(np.asarray(idx, dtype=np.int64))
        counts = self.starts[idx + 1] - self.starts[idx]
        offsets = np.repeat(self.starts[idx] - (np.cumsum(counts) - counts), counts)
        rec = self.records[np.arange(int(counts.sum())) + offsets]
        rec["image"] = np.repeat(np.arange(len(idx), dtype=np.int32), counts)  # each copy a distinct image
        precision, recall = accumulate(rec, self.npig_img[idx].sum(0), self.num_categories)
        stats = summarize(precision, recall)
        return np.array([stats[k] for k in STAT_NAMES])


def coco_intervals(resampler: ImageResampler, num_images: int, resamples: int, level: float, seed: int) -> dict:
    """{statistic: {low, high}} for the 12 statistics plus {level, resamples, seed, method, samples, unit
    (images)} (``bootstrap.vector_intervals``); a statistic undefined (-1) on the whole set keeps -1."""
    return vector_intervals(resampler, list(STAT_NAMES), num_images, (resamples, level, seed), "images")
