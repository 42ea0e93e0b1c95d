"""EmbeddingTask through the engine (RankRun: loop, Task.after_loop's sharded search, synchronisation,
results.json) with real gloo ranks at W=3, against single-process dense computations: kNN on the shipped
Fashion-MNIST CNN's features (scikit-learn's KNeighborsClassifier, faiss, numpy votes and AP@R), and with an
open_clip model built with random weights (no download) on generated image-text pairs, text->image and
image->text recall@k and zero-shot top-1/top-5 from a dense similarity matrix."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from sklearn.neighbors import KNeighborsClassifier

from bitwise_workers import engine_cases_worker, load_metrics
from disteval.data.pairs import COLOURS, ImageTextPairs
from disteval.models.clip import build_open_clip
from launchers.local import launch
from test_embedding_dist import FASHION, _fashion, _fashion_features

faiss = pytest.importorskip("faiss")
pytest.importorskip("open_clip")

W = 3
NG, NQ, KS = 1000, 200, [10, 20]
CLIP = {"name": "open_clip:ViT-B-32", "weights": None, "checkpoint": None,
        "kwargs": {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1,
                                                  "head_width": 16},
                   "text_cfg": {"context_length": 20, "width": 32, "heads": 2, "layers": 1}}}
N_IMAGES, CPI, BATCH = 48, 3, 16
EMB = {"chunk_size": 7, "tile_queries": 8, "tile_gallery": 32, "generated_images": N_IMAGES,
       "captions_per_image": CPI, "image_size": 32}
CASES = {
    "knn": {"model": {"name": "fashion_cnn", "weights": "shipped"},
            "data": {"name": "fashion_mnist", "root": FASHION, "batch_size": 100},
            "eval": {"task": "embedding", "embedding": {"protocol": "knn", "layer": "classifier.3", "gallery_limit": NG,
                                                        "query_limit": NQ, "knn_k": KS, "map_at_r": True,
                                                        "chunk_size": 7, "tile_queries": 16, "tile_gallery": 256}}},
    "retrieval": {"model": CLIP, "data": {"name": "generated_pairs", "batch_size": BATCH},
                  "eval": {"embedding": dict(EMB, protocol="retrieval")}},
    "zero_shot": {"model": CLIP, "data": {"name": "generated_pairs", "batch_size": BATCH},
                  "eval": {"embedding": dict(EMB, protocol="zero_shot")}},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("emb_engine")
    launch(engine_cases_worker, (str(out), CASES), W, str(out))
    return {name: load_metrics(out, name) for name in CASES}


def _one_thread(fn):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return fn()
    finally:
        torch.set_num_threads(threads)


def _dino_votes(sims: np.ndarray, labels: np.ndarray, k: int, t: float | None) -> np.ndarray:
    """Classes by descending vote (ties: smaller class), numpy, float64."""
    w = np.ones_like(sims[:, :k], dtype=np.float64) if t is None else np.exp(sims[:, :k].astype(np.float64) / t)
    votes = np.zeros((sims.shape[0], 10))
    for j in range(k):
        np.add.at(votes, (np.arange(sims.shape[0]), labels[:, j]), w[:, j])
    return np.argsort(-votes, axis=1, kind="stable")


def test_knn_matches_sklearn_and_faiss(runs):
    res = runs["knn"]
    assert res["world_size"] == W and res["coverage"]["ok"] and res["dataset"]["parts"] == {"gallery": [0, NG], "query": [NG, NG + NQ]}
    m = res["metrics"]
    xg, yg = _fashion("train", NG)
    xq, yq = _fashion("test", NQ)
    feats = _fashion_features(torch.cat([xg, xq]), 100).numpy()  # the engine's global batches of 100
    g, q, yg, yq = feats[:NG], feats[NG:], yg.numpy(), yq.numpy()
    assert m["knn_queries"] == NQ
    for k in KS:
        for vote, weights in (("weighted", lambda d: np.exp((1.0 - d) / 0.07)), ("majority", "uniform")):
            clf = KNeighborsClassifier(n_neighbors=k, algorithm="brute", metric="cosine", weights=weights)
            pred = clf.fit(g.astype(np.float64), yg).predict(q.astype(np.float64))
            assert m[f"knn_{vote}_k{k}_top1"] == (pred == yq).sum() / NQ, (vote, k)
    counts = np.bincount(yg, minlength=10)
    index = faiss.IndexFlatIP(g.shape[1])
    index.add(g)
    sims, ids = index.search(q, int(counts.max()))
    labels = yg[ids]
    for k in KS:
        for vote, t in (("weighted", 0.07), ("majority", None)):
            top5 = (_dino_votes(sims, labels, k, t)[:, :5] == yq[:, None]).any(1).sum()
            assert m[f"knn_{vote}_k{k}_top5"] == top5 / NQ, (vote, k)
    aps = []
    for row, y in zip(labels, yq):
        r = counts[y]
        rel = row[:r] == y
        aps.append(sum(rel[:i + 1].sum() / (i + 1) for i in range(r) if rel[i]) / r)
    assert m["map_at_r"] == pytest.approx(math.fsum(aps) / NQ, rel=1e-12)


def _clip_embeddings():
    pairs = ImageTextPairs(N_IMAGES, CPI, 32, seed=0)
    net, tok = build_open_clip(OmegaConf.create(CLIP), seed=0)
    images = torch.stack([pairs.image(i) for i in range(N_IMAGES)])
    texts = [pairs.caption(i, j) for i in range(N_IMAGES) for j in range(CPI)]

    def run():
        img = torch.cat([net.encode_image(images[i:i + BATCH]) for i in range(0, N_IMAGES, BATCH)])
        txt = torch.cat([net.encode_text(tok(texts[i:i + BATCH])) for i in range(0, len(texts), BATCH)])
        cls = []
        for name in COLOURS:
            e = F.normalize(net.encode_text(tok([t.format(name) for t in ("a photo of a {}.", "a {} object.")])), dim=-1)
            cls.append(F.normalize(e.mean(0), dim=-1))
        return F.normalize(img, dim=-1).numpy(), F.normalize(txt, dim=-1).numpy(), torch.stack(cls).numpy()
    return pairs, *_one_thread(run)


def _first_hit(sims: np.ndarray, correct: np.ndarray) -> np.ndarray:
    """Dense: rank of the first correct item when items are ordered by descending similarity, ties by id."""
    order = np.stack([np.lexsort((np.arange(row.size), -row)) for row in sims])
    return np.argmax(np.take_along_axis(correct, order, 1), axis=1)


def test_retrieval_recall_matches_dense(runs):
    m = runs["retrieval"]["metrics"]
    _, img, txt, _ = _clip_embeddings()
    sims = img.astype(np.float64) @ txt.astype(np.float64).T  # [images, captions]
    owner = np.arange(N_IMAGES * CPI) // CPI
    i2t = _first_hit(sims, owner[None, :] == np.arange(N_IMAGES)[:, None])
    t2i = _first_hit(sims.T, np.arange(N_IMAGES)[None, :] == owner[:, None])
    assert m["image_to_text_queries"] == N_IMAGES and m["text_to_image_queries"] == N_IMAGES * CPI
    for k in (1, 5, 10):
        assert m[f"image_to_text_recall@{k}"] == (i2t < k).sum() / N_IMAGES, k
        assert m[f"text_to_image_recall@{k}"] == (t2i < k).sum() / (N_IMAGES * CPI), k


def test_zero_shot_matches_dense(runs):
    m = runs["zero_shot"]["metrics"]
    pairs, img, _, cls = _clip_embeddings()
    logits = img.astype(np.float64) @ cls.astype(np.float64).T
    y = np.array([pairs.image_class(i) for i in range(N_IMAGES)])
    order = np.argsort(-logits, axis=1, kind="stable")
    assert m["top1"] == (order[:, 0] == y).sum() / N_IMAGES
    assert m["top5"] == (order[:, :5] == y[:, None]).any(1).sum() / N_IMAGES
