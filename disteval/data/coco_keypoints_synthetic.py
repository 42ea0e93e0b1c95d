"""Generated COCO keypoint annotation and results files (no download): people with 17 keypoints of mixed
visibility, crowds, people without labelled keypoints, images without people, and predictions perturbed from the
ground truth plus false positives, with tied scores, so every branch of OKS matching is exercised."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PARTS = 17


def _person(rng: np.random.Generator, width: int, height: int) -> tuple[list, np.ndarray]:
    w, h = rng.uniform(10, width / 2), rng.uniform(10, height / 2)
    x, y = rng.uniform(0, width - w), rng.uniform(0, height - h)
    kps = np.zeros((PARTS, 3))
    vis = rng.choice([0, 1, 2], size=PARTS, p=[0.2, 0.2, 0.6])
    kps[:, 0] = np.where(vis > 0, np.round(x + rng.uniform(0, w, PARTS), 2), 0)
    kps[:, 1] = np.where(vis > 0, np.round(y + rng.uniform(0, h, PARTS), 2), 0)
    kps[:, 2] = vis
    return [round(x, 2), round(y, 2), round(w, 2), round(h, 2)], kps


def make_synthetic_keypoints(out_dir: str | Path, num_images: int = 40, seed: int = 0) -> tuple[Path, Path]:
    """Write ``person_keypoints_synthetic.json`` and ``keypoints_results_synthetic.json`` into ``out_dir``;
    returns their paths. Deterministic for a ``seed``."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    images, anns, dets = [], [], []
    for i in range(num_images):
        width, height = int(rng.integers(200, 640)), int(rng.integers(200, 480))
        image_id = int(1000 + 7 * i)
        images.append({"id": image_id, "width": width, "height": height, "file_name": f"{image_id}.jpg"})
        for _ in range(int(rng.integers(0, 5))):
            bbox, kps = _person(rng, width, height)
            if rng.random() < 0.1:
                kps[:] = 0  # a person without labelled keypoints
            anns.append({"id": len(anns) + 1, "image_id": image_id, "category_id": 1, "bbox": bbox,
                         "area": round(bbox[2] * bbox[3] * rng.uniform(0.4, 1.0), 2), "iscrowd": int(rng.random() < 0.05),
                         "num_keypoints": int((kps[:, 2] > 0).sum()), "keypoints": kps.reshape(-1).tolist()})
            if rng.random() < 0.85:  # detected: the keypoints moved by noise scaled to the person's size
                noise = rng.normal(0, rng.uniform(0.01, 0.3) * np.sqrt(bbox[2] * bbox[3]) / 10, (PARTS, 2))
                pred = np.where(kps[:, :2] > 0, kps[:, :2], rng.uniform(0, min(width, height), (PARTS, 2))) + noise
                dets.append(_det(image_id, pred, rng))
        for _ in range(int(rng.integers(0, 3))):  # false positives
            _, kps = _person(rng, width, height)
            dets.append(_det(image_id, kps[:, :2] + rng.uniform(1, 50, (PARTS, 2)), rng))
    doc = {"images": images, "annotations": anns, "categories": [
        {"id": 1, "name": "person", "supercategory": "person", "keypoints": [f"k{j}" for j in range(PARTS)],
         "skeleton": []}]}
    gt_path, dt_path = out / "person_keypoints_synthetic.json", out / "keypoints_results_synthetic.json"
    gt_path.write_text(json.dumps(doc))
    dt_path.write_text(json.dumps(dets))
    return gt_path, dt_path


def _det(image_id: int, xy: np.ndarray, rng: np.random.Generator) -> dict:
    kps = np.concatenate([np.round(xy, 2), np.ones((PARTS, 1))], axis=1)
    return {"image_id": image_id, "category_id": 1, "keypoints": kps.reshape(-1).tolist(),
            "score": float(np.round(rng.uniform(0.05, 1.0), 1))}  # rounded: ties
