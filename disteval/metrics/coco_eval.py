"""COCO detection evaluation (bbox and segm) as pure, vectorised numpy: the semantics of pycocotools'
COCOeval (evaluate, accumulate, summarize) reproduced bit for bit, split so that matching runs per shard of
images and only compact per-detection records travel.

Reference: pycocotools/cocoeval.py (cocodataset/cocoapi, COCOeval.evaluateImg / accumulate / summarize) and
maskApi.c (bbIou). Parameters as pycocotools' defaults for iouType bbox/segm: IoU thresholds
np.linspace(.5, .95, 10), 101 recall thresholds np.linspace(0, 1, 101), maxDets (1, 10, 100), area ranges
all [0, 1e10], small [0, 32^2], medium [32^2, 96^2], large [96^2, 1e10] (both ends inclusive).

Matching (``match_shard``): per (image, category), detections sorted by descending score (stable: ties
keep their order within the image), truncated to 100; ground truths with ``ignore`` (= iscrowd) or an area
outside the range are *ignored*; each detection in score order takes, among the ground truths not yet taken
(crowds can be taken again) with IoU >= t, the *last* one of highest IoU among the non-ignored ones, and only
if there is none the last one of highest IoU among the ignored ones; a detection matched to an ignored
ground truth, or unmatched with an area outside the range, is ignored. A Python loop runs over detection
*positions* (at most 100); every step handles all images, categories, thresholds and area ranges at once.

Accumulation (``accumulate``): per category, area range and maxDets, the detections of all images (only the
first maxDets of each image) sorted by descending score, ties in image-id order then position (pycocotools'
mergesort over the concatenation in image order); precision interpolated as the running maximum from the
right; precision at the 101 recall thresholds by ``searchsorted(side="left")``; -1 where a category has no
non-ignored ground truth.
"""
from __future__ import annotations

import numpy as np

from disteval.common.coco_types import DetectionShard, GroundTruthShard

IOU_THRS = np.linspace(.5, 0.95, int(np.round((0.95 - .5) / .05)) + 1, endpoint=True)
REC_THRS = np.linspace(.0, 1.00, int(np.round((1.00 - .0) / .01)) + 1, endpoint=True)
MAX_DETS = (1, 10, 100)
AREA_RNG = ((0 ** 2, 1e5 ** 2), (0 ** 2, 32 ** 2), (32 ** 2, 96 ** 2), (96 ** 2, 1e5 ** 2))
AREA_LBL = ("all", "small", "medium", "large")
STAT_NAMES = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")
T, A = len(IOU_THRS), len(AREA_RNG)



def record_dtype(areas: int) -> np.dtype:
    """One record per kept detection, what ``accumulate`` needs (no pickle): score, image index, category
    index, position in its image's score order, and its tp / fp bits for each (threshold, area range),
    bit-packed row-major [T, areas]."""
    return np.dtype([("score", "<f8"), ("image", "<i4"), ("category", "<i4"), ("position", "u1"),
                     ("tp", "u1", (T * areas + 7) // 8), ("fp", "u1", (T * areas + 7) // 8)])


RECORD_DTYPE = record_dtype(A)  # bbox and segm: 27 bytes


def _area_out(area: np.ndarray) -> np.ndarray:
    """bool [n, A]: area outside each range (pycocotools: area < lo or area > hi)."""
    lo = np.array([r[0] for r in AREA_RNG], dtype=np.float64)
    hi = np.array([r[1] for r in AREA_RNG], dtype=np.float64)
    return (area[:, None] < lo[None, :]) | (area[:, None] > hi[None, :])


def bbox_iou(d: np.ndarray, g: np.ndarray, crowd: np.ndarray) -> np.ndarray:
    """IoU of box pairs, element-wise, exactly as pycocotools' maskApi.c bbIou (float64 [n]).

    d, g: float64 [n, 4] boxes (x, y, w, h); crowd: bool [n] (the ground truth is a crowd: intersection over
    the detection's area). Pairs without overlap (w <= 0 or h <= 0) give 0."""
    da = d[:, 2] * d[:, 3]
    ga = g[:, 2] * g[:, 3]
    w = np.minimum(d[:, 2] + d[:, 0], g[:, 2] + g[:, 0]) - np.maximum(d[:, 0], g[:, 0])
    h = np.minimum(d[:, 3] + d[:, 1], g[:, 3] + g[:, 1]) - np.maximum(d[:, 1], g[:, 1])
    inter = w * h
    union = np.where(crowd, da, da + ga - inter)
    ok = (w > 0) & (h > 0)
    out = np.zeros(len(d), dtype=np.float64)
    np.divide(inter, union, out=out, where=ok)
    return out


def _group_starts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For sorted int64 ``keys``: (unique keys, start index, count) of each run."""
    if keys.size == 0:
        e = np.zeros(0, dtype=np.int64)
        return e, e, e
    starts = np.concatenate(([0], np.nonzero(np.diff(keys))[0] + 1))
    counts = np.diff(np.concatenate((starts, [keys.size])))
    return keys[starts], starts, counts


def _segm_iou(det: DetectionShard, gt: GroundTruthShard, d_idx: np.ndarray, g_idx: np.ndarray,
              pair_groups: list[tuple[int, int, int, int]]) -> np.ndarray:
    """IoU of the (detection, ground truth) pairs of each group with pycocotools.mask.iou (RLE)."""
    from pycocotools import mask as mask_utils

    out = np.empty(len(d_idx), dtype=np.float64)
    for start, n_d, g0, n_g in pair_groups:
        dets = [det.rle[i] for i in d_idx[start:start + n_d * n_g:n_g]]
        gts = [gt.rle[j] for j in range(g0, g0 + n_g)]
        crowd = [int(c) for c in gt.crowd[g0:g0 + n_g]]
        out[start:start + n_d * n_g] = np.asarray(mask_utils.iou(dets, gts, crowd), dtype=np.float64).reshape(-1)
    return out


def match_shard(det: DetectionShard, gt: GroundTruthShard, num_categories: int,
                iou_type: str = "bbox") -> tuple[np.ndarray, np.ndarray]:
    """Match the detections of a set of images against their ground truths (pycocotools' evaluateImg for
    every image, category and area range at maxDets 100). ``gt`` must hold *all* ground truths of the images
    that ``det`` covers, and the images evaluated elsewhere must not appear here.

    Returns ``(records, npig)``: ``records`` a RECORD_DTYPE array, one per kept detection (the first 100 by
    score per image and category) with its tp/fp bits for each (threshold, area range) bit-packed, row-major
    [T, A]; ``npig`` int64 [K, A], the number of non-ignored ground truths per category and area range.
    """
    area_out_gt = _area_out(gt.area)                                   # [G, A]
    gt_ig = gt.crowd[:, None] | area_out_gt                            # [G, A]
    npig = np.zeros((num_categories, A), dtype=np.int64)
    np.add.at(npig, gt.category, (~gt_ig).astype(np.int64))

    # detections: per (image, category) by descending score, stable in input order; keep the first 100
    key_d = det.image * num_categories + det.category
    # lexsort is stable: equal scores keep the array order, which inside an image is ``det.order``
    if len(det.order) > 1 and (np.diff(det.order)[np.diff(det.image) == 0] <= 0).any():
        raise ValueError("detections must be given in their order inside each image (DetectionShard.order)")
    sort_d = np.lexsort((-det.score, key_d))
    key_sorted = key_d[sort_d]
    groups_d, start_d, count_d = _group_starts(key_sorted)
    position = np.arange(len(sort_d)) - np.repeat(start_d, count_d)
    keep = position < MAX_DETS[-1]
    kd = sort_d[keep]                                                  # kept detections, group-contiguous
    kpos = position[keep]
    kkey = key_sorted[keep]
    n = len(kd)

    # ground truths per (image, category), file order inside a group
    key_g = gt.image * num_categories + gt.category
    sort_g = np.argsort(key_g, kind="stable")
    groups_g, start_g, count_g = _group_starts(key_g[sort_g])

    det_area_out = _area_out(det.area[kd])                             # [n, A]
    eff = np.zeros((n, T, A), dtype=bool)                              # matched (to a gt whose id != 0)
    dt_ig = np.broadcast_to(det_area_out[:, None, :], (n, T, A)).copy()  # unmatched: ignored out of range
    both, gi_d, gi_g = np.intersect1d(np.unique(kkey), groups_g, assume_unique=True, return_indices=True)
    if both.size:
        # detections of groups with ground truths
        _, kstart, kcount = _group_starts(kkey)
        g_of_kgroup = np.full(len(kstart), -1, dtype=np.int64)
        g_of_kgroup[gi_d] = gi_g
        det_group = np.repeat(np.arange(len(kstart)), kcount)          # kept-group index of each kept det
        gg = g_of_kgroup[det_group]                                    # its gt group, or -1
        with_gt = np.nonzero(gg >= 0)[0]
        n_g = count_g[gg[with_gt]]
        # (detection, ground truth) pairs, detection-major
        pair_det = np.repeat(with_gt, n_g)
        offs = np.arange(n_g.sum()) - np.repeat(np.cumsum(n_g) - n_g, n_g)
        pair_gt = np.repeat(start_g[gg[with_gt]], n_g) + offs          # position in sort_g
        gidx = sort_g[pair_gt]
        if iou_type == "bbox":
            iou = bbox_iou(det.box[kd[pair_det]], gt.box[gidx], gt.crowd[gidx])
        else:
            pair_groups, p = [], 0
            for kg in np.nonzero(g_of_kgroup >= 0)[0]:
                nd, ng = int(kcount[kg]), int(count_g[g_of_kgroup[kg]])
                pair_groups.append((p, nd, int(start_g[g_of_kgroup[kg]]), ng))
                p += nd * ng
            iou = _segm_iou(det, _sorted_gt(gt, sort_g), kd[pair_det], gidx, pair_groups)
        m = _greedy_match(iou, with_gt, n_g, kpos, det_group, gg, start_g, sort_g, gt_ig, gt.crowd)
        # one byte per ground truth: bit 0 its id is not 0 (pycocotools tests dtm, a gt id, against 0),
        # bit 1 + a: ignored in area range a
        code = ((gt.ann_id[sort_g] != 0).astype(np.uint8)
                | (gt_ig[sort_g].astype(np.uint8) << np.arange(1, A + 1, dtype=np.uint8)).sum(1, dtype=np.uint8))
        matched = m >= 0                                               # [nw, T, A]
        c = np.where(matched, code[np.maximum(m, 0)], np.uint8(0))
        e = (c & 1).astype(bool)
        eff[with_gt] = e
        ig_bit = ((c >> np.arange(1, A + 1, dtype=np.uint8)[None, None, :]) & 1).astype(bool)
        dt_ig[with_gt] = ig_bit | (~e & det_area_out[with_gt][:, None, :])
    rec = np.zeros(n, dtype=RECORD_DTYPE)
    rec["score"] = det.score[kd]
    rec["image"] = det.image[kd]
    rec["category"] = det.category[kd]
    rec["position"] = kpos
    rec["tp"] = np.packbits((eff & ~dt_ig).reshape(n, T * A), axis=1)
    rec["fp"] = np.packbits((~eff & ~dt_ig).reshape(n, T * A), axis=1)
    return rec, npig


def _sorted_gt(gt: GroundTruthShard, sort_g: np.ndarray) -> GroundTruthShard:
    return GroundTruthShard(gt.image[sort_g], gt.category[sort_g], gt.box[sort_g], gt.area[sort_g],
                            gt.crowd[sort_g], gt.ann_id[sort_g], [gt.rle[i] for i in sort_g] if gt.rle else None)


def _greedy_match(iou, with_gt, n_g, kpos, det_group, gg, start_g, sort_g, gt_ig, crowd) -> np.ndarray:
    """pycocotools' greedy matching for the kept detections ``with_gt`` (those whose image and category have
    ground truths). Returns int32 [len(with_gt), T, A]: the matched ground truth (position in ``sort_g``
    order) or -1.

    Groups with one ground truth need no loop: for a non-crowd ground truth the first detection (in score
    order) with IoU >= t takes it, for a crowd every such detection does. Larger groups go through a loop
    over detection positions (at most 100), vectorised over groups x thresholds x area ranges, in buckets of
    similar ground-truth counts so that padding stays small."""
    nw = len(with_gt)
    out = np.full((nw, T, A), -1, dtype=np.int32)
    pair_first = np.cumsum(n_g) - n_g                                  # first pair of each such detection
    single = n_g == 1
    if single.any():
        w1 = np.nonzero(single)[0]
        ge = iou[pair_first[w1]][:, None] >= IOU_THRS[None, :]         # [n1, T]
        grp = det_group[with_gt[w1]]
        cs = np.cumsum(ge, axis=0)
        new = np.concatenate(([True], grp[1:] != grp[:-1]))            # first detection of its group
        starts = np.nonzero(new)[0]
        base = (cs[starts] - ge[starts])                               # count before each group
        seen = cs - np.repeat(base, np.diff(np.concatenate((starts, [len(w1)]))), axis=0)
        g_pos = start_g[gg[with_gt[w1]]]
        hit = ge & ((seen == 1) | crowd[sort_g[g_pos]][:, None])
        out[w1] = np.where(hit, g_pos[:, None], -1)[:, :, None]
    multi = np.nonzero(~single)[0]
    if multi.size:
        bucket = np.ceil(np.log2(n_g[multi])).astype(np.int64)
        for b in np.unique(bucket):
            sel = multi[bucket == b]
            out[sel] = _greedy_loop(iou, with_gt[sel], n_g[sel], pair_first[sel], kpos, det_group, gg, start_g,
                                    sort_g, gt_ig, crowd)
    return out


def _greedy_loop(iou, dets, n_g, pair_first, kpos, det_group, gg, start_g, sort_g, gt_ig, crowd) -> np.ndarray:
    """The loop over detection positions for the detections ``dets`` (whole groups). Returns int32
    [len(dets), T, A] as ``_greedy_match``."""
    groups, local_of = np.unique(det_group[dets], return_inverse=True)
    n_groups = len(groups)
    gmax = int(n_g.max())
    gcount = np.zeros(n_groups, dtype=np.int64)
    gcount[local_of] = n_g
    gstart = np.zeros(n_groups, dtype=np.int64)
    gstart[local_of] = start_g[gg[dets]]
    lane = np.arange(gmax)
    valid = lane[None, :] < gcount[:, None]                            # [NG, Gmax]
    gpos = np.where(valid, gstart[:, None] + lane[None, :], 0)         # positions in sort_g
    g_crowd = crowd[sort_g[gpos]] & valid
    g_ig = gt_ig[sort_g[gpos]].transpose(0, 2, 1) & valid[:, None, :]  # [NG, A, Gmax]
    taken = np.zeros((n_groups, T, A, gmax), dtype=bool)
    out = np.full((len(dets), T, A), -1, dtype=np.int32)
    pos = kpos[dets]
    thr = IOU_THRS[None, :, None]
    order = np.argsort(pos, kind="stable")
    bounds = np.searchsorted(pos[order], np.arange(int(pos.max()) + 2))
    for j in range(int(pos.max()) + 1):
        at_j = order[bounds[j]:bounds[j + 1]]                          # rows of dets at position j
        if at_j.size == 0:
            continue
        lg = local_of[at_j]
        ok = valid[lg]
        rows = np.where(ok, pair_first[at_j][:, None] + lane[None, :], 0)
        ious = np.where(ok, iou[rows], -1.0)                          # [n, Gmax]
        # rank of each gt by (iou, lane): the last of the highest IoU ranks highest
        rank = np.empty(rows.shape, dtype=np.int16)
        rank[np.arange(len(at_j))[:, None], np.argsort(ious, axis=1, kind="stable")] = lane[None, :] + 1
        cand = (ious[:, None, :] >= thr)[:, :, None, :] & ~(taken[lg] & ~g_crowd[lg][:, None, None, :]) \
            & ok[:, None, None, :]                                     # [n, T, A, Gmax]
        ig = g_ig[lg][:, None, :, :]
        r = rank[:, None, None, :]
        best_nonig = np.where(cand & ~ig, r, 0).max(-1)                # rank of the choice, 0 = none
        best_ig = np.where(cand & ig, r, 0).max(-1)
        best = np.where(best_nonig > 0, best_nonig, best_ig)           # [n, T, A]
        hit = best > 0
        # lane of the chosen rank
        m = np.argmax(r == best[..., None], axis=-1)
        nn, tt, aa = np.nonzero(hit)
        taken[lg[nn], tt, aa, m[nn, tt, aa]] = True
        out[at_j] = np.where(hit, gstart[lg][:, None, None] + m, -1)
    return out


def _first_count_reaching(npig: np.ndarray) -> np.ndarray:
    """tau int64 [len(npig), R]: the smallest count x >= 0 with x / npig >= REC_THRS[i] in float64 (the
    division pycocotools uses for recall). x / n is monotone in x, so recall < thr exactly for counts < tau."""
    n = npig.astype(np.float64)[:, None]
    tau = np.ceil(REC_THRS[None, :] * n).astype(np.int64)
    for _ in range(4):  # the float product is off by at most one count; settle it with the exact test
        low = tau.astype(np.float64) / n < REC_THRS[None, :]
        tau = tau + low
        high = (tau > 0) & ((tau - 1).astype(np.float64) / n >= REC_THRS[None, :])
        tau = tau - high
    return tau


def accumulate(records: np.ndarray, npig: np.ndarray, num_categories: int,
               max_dets: tuple[int, ...] = MAX_DETS) -> tuple[np.ndarray, np.ndarray]:
    """pycocotools' accumulate from the records of every image. Returns ``(precision float64 [T, R, K, A, M],
    recall float64 [T, K, A, M])``, -1 where undefined (no non-ignored ground truth). A (area ranges) is
    ``npig``'s second dimension (4 for bbox/segm, 3 for keypoints) and M = len(``max_dets``) ((1, 10, 100);
    keypoints (20,)).

    Computed from the true positives only, with the same float operations: recall at a detection is
    tp/npig, which first reaches a threshold at the tau-th true positive (``_first_count_reaching``);
    precision tp/(fp+tp+eps) is highest, to the right of any detection, at a true positive (it only rises
    there), so pycocotools' interpolated precision at recall threshold i is the running maximum from the
    right, over true positives, taken at the tau_i-th true positive."""
    R, K, M, A = len(REC_THRS), num_categories, len(max_dets), npig.shape[1]  # noqa: N806 - pycocotools' names
    precision = -np.ones((T, R, K, A, M))
    recall = -np.ones((T, K, A, M))
    order = np.lexsort((records["position"], records["image"], -records["score"], records["category"]))
    rec = records[order]
    cats, starts, counts = _group_starts(rec["category"].astype(np.int64))
    seg = {int(c): (int(s), int(n)) for c, s, n in zip(cats, starts, counts)}
    eps = np.spacing(1)
    for k in range(K):
        s, n = seg.get(k, (0, 0))
        areas = np.nonzero(npig[k] > 0)[0]
        if areas.size == 0:
            continue
        rows = T * len(areas)                                          # row = (threshold, area range)
        tau = np.tile(_first_count_reaching(npig[k, areas]), (T, 1))   # [rows, R]
        npk = np.tile(npig[k, areas], T).astype(np.float64)           # [rows]
        r = rec[s:s + n]
        # [rows, n] contiguous: nonzero then yields (row, position) pairs in row order, fast
        tp_all = np.ascontiguousarray(
            np.unpackbits(r["tp"], axis=1, count=T * A).reshape(n, T, A)[:, :, areas].reshape(n, rows).T)
        fp_all = np.ascontiguousarray(
            np.unpackbits(r["fp"], axis=1, count=T * A).reshape(n, T, A)[:, :, areas].reshape(n, rows).T)
        for m_i, max_det in enumerate(max_dets):
            sel = r["position"] < max_det
            nd = int(sel.sum())
            tp_m, fp_m = (tp_all, fp_all) if nd == n else (tp_all[:, sel], fp_all[:, sel])
            tr, tc = np.nonzero(tp_m)                                  # true positives by (row, position)
            n_tp = np.bincount(tr, minlength=rows)
            first_tp = np.cumsum(n_tp) - n_tp
            count = (np.arange(len(tr)) - first_tp[tr] + 1).astype(np.float64)   # tp at that detection
            fp = np.cumsum(fp_m, axis=1, dtype=np.int32)[tr, tc].astype(np.float64)  # fp at that detection
            pr = count / (fp + count + eps)
            width = int(n_tp.max()) if len(tr) else 0
            env = np.full((rows, max(width, 1)), -np.inf)
            env[tr, (count - 1).astype(np.int64)] = pr
            env = np.maximum.accumulate(env[:, ::-1], axis=1)[:, ::-1]  # running max from the right
            idx = np.maximum(tau - 1, 0)
            reach = (tau <= n_tp[:, None]) & (n_tp[:, None] >= 1)
            q = np.where(reach, env[np.arange(rows)[:, None], np.minimum(idx, env.shape[1] - 1)], 0.0)
            rc_last = n_tp.astype(np.float64) / npk if nd else np.zeros(rows)
            recall[:, k, areas, m_i] = rc_last.reshape(T, -1)
            precision[:, :, k, areas, m_i] = q.reshape(T, len(areas), R).transpose(0, 2, 1)
    return precision, recall


def summarize(precision: np.ndarray, recall: np.ndarray) -> dict[str, float]:
    """The 12 statistics of COCOeval.summarize (same selections and means; -1 where nothing is defined)."""

    def one(ap: bool, iou_thr=None, area="all", max_dets=100) -> float:
        aind = [i for i, lbl in enumerate(AREA_LBL) if lbl == area]
        mind = [i for i, md in enumerate(MAX_DETS) if md == max_dets]
        if ap:
            s = precision
            if iou_thr is not None:
                s = s[np.where(iou_thr == IOU_THRS)[0]]
            s = s[:, :, :, aind, mind]
        else:
            s = recall
            if iou_thr is not None:
                s = s[np.where(iou_thr == IOU_THRS)[0]]
            s = s[:, :, aind, mind]
        return -1.0 if len(s[s > -1]) == 0 else float(np.mean(s[s > -1]))

    values = [one(True), one(True, .5), one(True, .75), one(True, area="small"), one(True, area="medium"),
              one(True, area="large"), one(False, max_dets=1), one(False, max_dets=10), one(False),
              one(False, area="small"), one(False, area="medium"), one(False, area="large")]
    return dict(zip(STAT_NAMES, values))


def pr_curves(precision: np.ndarray) -> dict:
    """The precision-recall curves of area all, maxDets 100, averaged over the categories with ground truth (as
    COCOeval's AP): ``{"recall": [R], "IoU=0.50": [R], "IoU=0.75": [R], "IoU=0.50:0.95": [R]}``, None at a
    recall point no category reaches. Small (3 x 101 floats): results.json keeps it for the run report."""
    p = precision[:, :, :, 0, -1]  # [T, R, K]
    out: dict = {"recall": np.linspace(0.0, 1.0, p.shape[1]).round(2).tolist()}
    for label, rows in (("IoU=0.50", p[:1]), ("IoU=0.75", p[5:6]), ("IoU=0.50:0.95", p)):
        valid = rows > -1
        sums, counts = np.where(valid, rows, 0.0).sum(axis=(0, 2)), valid.sum(axis=(0, 2))
        out[label] = [float(s / c) if c else None for s, c in zip(sums, counts)]
    return out


def per_category_ap(precision: np.ndarray) -> list[float | None]:
    """AP@[.5:.95] of each category (area all, maxDets 100), None where the category has no ground truth."""
    out = []
    for k in range(precision.shape[2]):
        s = precision[:, :, k, 0, -1]
        out.append(float(np.mean(s[s > -1])) if (s > -1).any() else None)
    return out
