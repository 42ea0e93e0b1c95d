"""Sharded exact top-k and embedding evaluation with real gloo ranks.

Top-k: the shipped Fashion-MNIST CNN's penultimate features (first 2,000 training images as gallery, first
300 test images as queries) and a constructed integer set with exact ties at the k-th neighbour, at
W in {2, 3, 4} (one process group per W, every case inside it) and chunk sizes {1, 7, 1000}: scores and ids
equal the single-process search bit for bit; that search equals scikit-learn's brute-force NearestNeighbors
and faiss IndexFlatIP/L2 (ids), a numpy lexsort on exact integer scores (ties), and scikit-learn's
KNeighborsClassifier (weighted and majority kNN top-1).
Engine: EmbeddingTask through RankRun (loop, Task.after_loop's sharded search, synchronisation, results.json)
inside the W=3 group: kNN with mAP@R against scikit-learn's KNeighborsClassifier, faiss and numpy votes, and
with an open_clip model built with random weights (no download) on generated image-text pairs, recall@k both
ways and zero-shot top-1/top-5 against single-process dense computations."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from sklearn.neighbors import KNeighborsClassifier, NearestNeighbors

from bitwise_workers import load_metrics
from embedding_workers import topk_worker
from disteval.common.ranges import batch_aligned_bounds
from disteval.common.topk import SearchSpec, exact_search
from disteval.data.datasets import build_dataset
from disteval.data.pairs import COLOURS, ImageTextPairs
from disteval.metrics.knn import knn_class_ranking
from disteval.models import build_model
from disteval.models.clip import build_open_clip
from disteval.tasks.embedding import LayerEmbedder
from launchers.local import launch

faiss = pytest.importorskip("faiss")
pytest.importorskip("open_clip")

FASHION = "/usr/share/datasets/fashion-mnist"
N_GALLERY, N_QUERIES, K = 2000, 300, 20
TILES = {"tile_queries": 16, "tile_gallery": 256}
WORLD_SIZES = (2, 3, 4)


def _fashion(split: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = OmegaConf.create({"name": "fashion_mnist", "root": FASHION, "split": split, "limit": n,
                            "download": False, "sampler": "exact"})
    ds, _ = build_dataset(cfg)
    x, y = ds.base.tensors
    return x[:n], y[:n].long()


def _fashion_features(x: torch.Tensor, batch: int = 100) -> torch.Tensor:
    """Penultimate-layer features, L2-normalised, in batches of ``batch`` on one thread."""
    model_cfg = OmegaConf.create({"name": "fashion_cnn", "weights": "shipped", "checkpoint": None,
                                  "num_classes": 10, "kwargs": {}})
    net = LayerEmbedder(build_model(model_cfg, 10), "classifier.3").eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            out = torch.cat([net.encode_image(x[i:i + batch]) for i in range(0, x.shape[0], batch)])
    finally:
        torch.set_num_threads(threads)
    return torch.nn.functional.normalize(out, dim=-1)


def _ties(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Integer vectors (exact float32 dot products and squared distances): 400 gallery rows in {-1,0,1}^6
    (many exact duplicates and equal scores) and 50 queries."""
    rng = np.random.default_rng(seed)
    return (rng.integers(-1, 2, (400, 6)).astype(np.float32), rng.integers(-1, 2, (50, 6)).astype(np.float32))


CASES = {}
for chunk, nq in ((1, 40), (7, N_QUERIES), (1000, N_QUERIES)):
    CASES[f"fashion_ip_c{chunk}"] = dict(gallery="fg", queries="fq", n_queries=nq, k=K, similarity="ip", chunk=chunk, **TILES)
    CASES[f"ties_ip_c{chunk}"] = dict(gallery="tg", queries="tq", n_queries=50, k=10, similarity="ip", chunk=chunk,
                                      tile_queries=8, tile_gallery=64)
CASES["fashion_l2_c7"] = dict(gallery="fg", queries="fq", n_queries=N_QUERIES, k=K, similarity="l2", chunk=7, **TILES)
CASES["ties_l2_c7"] = dict(gallery="tg", queries="tq", n_queries=50, k=10, similarity="l2", chunk=7,
                           tile_queries=8, tile_gallery=64)


# whole-engine cases, run inside the W=3 group after the top-k cases
ENGINE_W = 3
NG, NQ, KS = 1000, 200, [10, 20]
CLIP = {"name": "open_clip:ViT-B-32", "weights": None, "checkpoint": None,
        "kwargs": {"embed_dim": 32, "vision_cfg": {"image_size": 32, "patch_size": 8, "width": 32, "layers": 1,
                                                  "head_width": 16},
                   "text_cfg": {"context_length": 20, "width": 32, "heads": 2, "layers": 1}}}
N_IMAGES, CPI, BATCH = 48, 3, 16
EMB = {"chunk_size": 7, "tile_queries": 8, "tile_gallery": 32, "generated_images": N_IMAGES,
       "captions_per_image": CPI, "image_size": 32}
ENGINE_CASES = {
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
def data(tmp_path_factory):
    xg, yg = _fashion("train", N_GALLERY)
    xq, yq = _fashion("test", N_QUERIES)
    tg, tq = _ties()
    arrays = {"fg": _fashion_features(xg).numpy(), "fq": _fashion_features(xq).numpy(), "tg": tg, "tq": tq,
              "yg": yg.numpy(), "yq": yq.numpy()}
    path = tmp_path_factory.mktemp("emb") / "data.npz"
    np.savez(path, **arrays)
    return path, arrays


@pytest.fixture(scope="module")
def sharded(data, tmp_path_factory):
    """{W: {case: (scores [n, k], ids [n, k], bytes sent per rank, collectives per rank)}} assembled by query
    position, from real ranks; "engine_dir": where the W=3 group wrote the engine cases' results."""
    path, _ = data
    out = {}
    for w in WORLD_SIZES:
        d = tmp_path_factory.mktemp(f"topk_w{w}")
        launch(topk_worker, (str(d), str(path), CASES, ENGINE_CASES if w == ENGINE_W else {}), w, str(d))
        if w == ENGINE_W:
            out["engine_dir"] = d
        out[w] = {}
        for name, c in CASES.items():
            parts = [np.load(d / f"{name}.rank{r}.npz") for r in range(w)]
            scores = np.zeros((c["n_queries"], c["k"]), np.float32)
            ids = np.zeros((c["n_queries"], c["k"]), np.int64)
            for p in parts:
                scores[p["positions"]], ids[p["positions"]] = p["scores"], p["ids"]
            out[w][name] = (scores, ids, [int(p["bytes"]) for p in parts], [int(p["collectives"]) for p in parts])
    return out


def _reference(arrays: dict, c: dict) -> tuple[np.ndarray, np.ndarray]:
    spec = SearchSpec(c["k"], c["similarity"], c["chunk"], c["tile_queries"], c["tile_gallery"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank (the engine fixes one thread per rank in bitwise mode)
    try:
        s, i = exact_search(torch.from_numpy(arrays[c["queries"]][:c["n_queries"]]), torch.from_numpy(arrays[c["gallery"]]), spec)
    finally:
        torch.set_num_threads(threads)
    return s.numpy(), i.numpy()


@pytest.mark.parametrize("w", WORLD_SIZES)
def test_sharded_topk_is_bit_identical_to_single_process(data, sharded, w):
    _, arrays = data
    for name, c in CASES.items():
        ref_s, ref_i = _reference(arrays, c)
        s, i, _, _ = sharded[w][name]
        assert np.array_equal(s.view(np.int32), ref_s.view(np.int32)), (w, name)
        assert np.array_equal(i, ref_i), (w, name)


def test_single_process_search_is_independent_of_chunk(data):
    _, arrays = data
    for base in ("fashion_ip", "ties_ip"):
        ref = _reference(arrays, CASES[f"{base}_c1000"])
        for chunk in (1, 7):
            s, i = _reference(arrays, dict(CASES[f"{base}_c1000"], chunk=chunk))
            assert np.array_equal(s.view(np.int32), ref[0].view(np.int32)) and np.array_equal(i, ref[1])


def assert_same_neighbours_up_to_float32_ties(ids: np.ndarray, other: np.ndarray, q: np.ndarray, g: np.ndarray,
                                              sim: str, who: str) -> int:
    """``ids`` (disteval's exact float32 search) equal ``other`` (faiss', scikit-learn's) wherever the two lists'
    items are distinguishable in float32: at a position where they differ, the two items' exact (float64)
    scores for that query must differ by less than the float32 rounding bound of a d-term dot product
    (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5: |error| <= gamma_d sum|q_i g_i|,
    gamma_d = d u / (1 - d u), u = 2^-24), doubled for the two scores compared. Returns the number of such ties.

    Why: two float32 evaluations of the same similarity may round differently (torch's vectorised and default
    CPU kernels, faiss' own kernels); at a near-tie below float32 resolution the order is each tool's rounding,
    not a property of the data. Measured with ATEN_CPU_CAPABILITY=default: Fashion query 116, gallery 1030 and
    1524 have exact cosines 0.97510763 and 0.97510764 (1e-8 apart, float32's spacing there is 6e-8); torch's
    default kernel rounds the second down by 1.5 ulps, faiss and float64 order them the other way."""
    d, u = q.shape[1], 2.0 ** -24
    gamma = d * u / (1 - d * u)
    q64, g64 = q.astype(np.float64), g.astype(np.float64)
    ties = 0
    for r in np.where((ids != other).any(1))[0]:
        for j in np.where(ids[r] != other[r])[0]:
            a, b = int(ids[r, j]), int(other[r, j])
            if sim == "ip":
                sa, sb = q64[r] @ g64[a], q64[r] @ g64[b]
                bound = 2 * gamma * max(np.abs(q64[r] * g64[a]).sum(), np.abs(q64[r] * g64[b]).sum())
            else:  # squared L2 as ||q||^2 + ||g||^2 - 2 q.g: each term's rounding
                sa, sb = ((q64[r] - g64[a]) ** 2).sum(), ((q64[r] - g64[b]) ** 2).sum()
                bound = 2 * gamma * max(((np.abs(q64[r]) + np.abs(g64[x])) ** 2).sum() for x in (a, b))
            assert abs(sa - sb) <= bound, (who, sim, r, j, a, b, sa, sb, bound)
            ties += 1
    return ties


def test_fashion_neighbours_equal_sklearn_and_faiss(data):
    _, a = data
    g, q = a["fg"], a["fq"]
    for sim in ("ip", "l2"):
        s, ids = _reference(a, CASES[f"fashion_{sim}_c7"])
        index = faiss.IndexFlatIP(g.shape[1]) if sim == "ip" else faiss.IndexFlatL2(g.shape[1])
        index.add(g)
        fd, fi = index.search(q, K)
        ties = assert_same_neighbours_up_to_float32_ties(ids, fi, q, g, sim, "faiss")
        assert ties <= 4, (sim, ties)  # a handful of near-ties at most, not a different search
        np.testing.assert_allclose(s if sim == "ip" else -s, fd, rtol=0, atol=1e-5)
        nn = NearestNeighbors(n_neighbors=K, algorithm="brute", metric="cosine" if sim == "ip" else "euclidean")
        _, si = nn.fit(g.astype(np.float64)).kneighbors(q.astype(np.float64))
        ties = assert_same_neighbours_up_to_float32_ties(ids, si, q, g, sim, "scikit-learn")
        assert ties <= 4, (sim, ties)


def test_constructed_ties_follow_smaller_gallery_id(data, sharded):
    _, a = data
    g, q = a["tg"].astype(np.int64), a["tq"].astype(np.int64)
    for sim in ("ip", "l2"):
        exact = q @ g.T if sim == "ip" else -((q * q).sum(1)[:, None] + (g * g).sum(1)[None, :] - 2 * q @ g.T)
        order = np.stack([np.lexsort((np.arange(g.shape[0]), -row)) for row in exact])[:, :10]
        kth, nxt = np.take_along_axis(exact, order[:, 9:10], 1), np.take_along_axis(
            exact, np.stack([np.lexsort((np.arange(g.shape[0]), -row)) for row in exact])[:, 10:11], 1)
        assert (kth == nxt).sum() >= 40  # the k-th neighbour ties with the next one for most queries
        for w in (1, *WORLD_SIZES):
            for name in [n for n in CASES if n.startswith(f"ties_{sim}")]:
                s, i = _reference(a, CASES[name]) if w == 1 else sharded[w][name][:2]
                assert np.array_equal(i, order), (w, name)
                assert np.array_equal(s.astype(np.int64), np.take_along_axis(exact, order, 1)), (w, name)


def test_knn_top1_equals_sklearn_classifier(data):
    _, a = data
    _, ids = _reference(a, CASES["fashion_ip_c7"])
    s, _ = _reference(a, CASES["fashion_ip_c7"])
    labels = torch.from_numpy(a["yg"])[torch.from_numpy(ids)]
    for temperature, weights in ((0.07, lambda d: np.exp((1.0 - d) / 0.07)), (None, "uniform")):
        ours = knn_class_ranking(torch.from_numpy(s), labels, 10, K, temperature)[:, 0].numpy()
        clf = KNeighborsClassifier(n_neighbors=K, algorithm="brute", metric="cosine", weights=weights)
        theirs = clf.fit(a["fg"].astype(np.float64), a["yg"]).predict(a["fq"].astype(np.float64))
        assert np.array_equal(ours, theirs), temperature
        assert (ours == a["yq"]).sum() == (theirs == a["yq"]).sum()


def test_bytes_moved_are_far_below_the_gallery(sharded):
    """Sent per rank: the chunk counts, its share of the queries with positions (exact: broadcasts, no padding,
    when the shares differ), and k candidate keys (int64) per query; the gallery (N x D x 4 bytes) never
    moves. Collectives: the counts, then per chunk one broadcast per rank holding queries (one all_gather
    when all hold as many) and one gather per holding rank (one all_gather when all hold some)."""
    gallery_bytes = N_GALLERY * 128 * 4
    for w in WORLD_SIZES:
        _, _, sent, collectives = sharded[w]["fashion_ip_c1000"]
        share = -(-N_QUERIES // 16 // w) * 16  # the largest rank's queries (whole batches of 16)
        assert max(sent) <= 8 * 3 + share * 129 * 4 + N_QUERIES * K * 8, (w, sent)
        assert max(sent) < gallery_bytes / 5, (w, sent)
        rows = [int(np.diff(batch_aligned_bounds(N_QUERIES, 16, w, r))[0]) for r in range(w)]  # one chunk: all queries
        holders = sum(1 for n in rows if n)
        queries = 1 if len(set(rows)) == 1 else holders
        candidates = 1 if holders == w else holders
        assert set(collectives) == {1 + queries + candidates}, (w, rows, collectives)
        assert list(sent) == [8 * 3 + n * 129 * 4 + N_QUERIES * K * 8 for n in rows], (w, rows, sent)  # no padding


@pytest.fixture(scope="module")
def runs(sharded):
    return {name: load_metrics(sharded["engine_dir"], name) for name in ENGINE_CASES}


@pytest.fixture(scope="module")
def clip_embeddings():
    return _clip_embeddings()


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
    assert res["world_size"] == ENGINE_W and res["coverage"]["ok"]
    assert res["dataset"]["parts"] == {"gallery": [0, NG], "query": [NG, NG + NQ]}
    # the sharded search is timed on its own; queries held by one rank per round travel by broadcast
    assert res["timings"]["after_loop"] > 0 and res["comm"]["by_op"]["broadcast"] >= 1
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
    kmax = int(counts.max())
    sims, fids = index.search(q, kmax)
    # the ranking the metrics are defined on: disteval's exact float32 search in this process (single-process
    # reference; ties by smaller gallery id), which faiss confirms up to float32 near-ties (see
    # assert_same_neighbours_up_to_float32_ties: with faiss' order instead, map_at_r moved by 5e-7 under
    # ATEN_CPU_CAPABILITY=default because of one such tie)
    spec = SearchSpec(kmax, "ip", 7, 16, 256)  # the engine case's chunk and tile
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _, ids = exact_search(torch.from_numpy(q), torch.from_numpy(g), spec)
    finally:
        torch.set_num_threads(threads)
    ids = ids.numpy()
    assert_same_neighbours_up_to_float32_ties(ids, fids, q, g, "ip", "faiss")
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


def test_retrieval_recall_matches_dense(runs, clip_embeddings):
    m = runs["retrieval"]["metrics"]
    _, img, txt, _ = clip_embeddings
    sims = img.astype(np.float64) @ txt.astype(np.float64).T  # [images, captions]
    owner = np.arange(N_IMAGES * CPI) // CPI
    i2t = _first_hit(sims, owner[None, :] == np.arange(N_IMAGES)[:, None])
    t2i = _first_hit(sims.T, np.arange(N_IMAGES)[None, :] == owner[:, None])
    assert m["image_to_text_queries"] == N_IMAGES and m["text_to_image_queries"] == N_IMAGES * CPI
    for k in (1, 5, 10):
        assert m[f"image_to_text_recall@{k}"] == (i2t < k).sum() / N_IMAGES, k
        assert m[f"text_to_image_recall@{k}"] == (t2i < k).sum() / (N_IMAGES * CPI), k


def test_zero_shot_matches_dense(runs, clip_embeddings):
    m = runs["zero_shot"]["metrics"]
    pairs, img, _, cls = clip_embeddings
    logits = img.astype(np.float64) @ cls.astype(np.float64).T
    y = np.array([pairs.image_class(i) for i in range(N_IMAGES)])
    order = np.argsort(-logits, axis=1, kind="stable")
    assert m["top1"] == (order[:, 0] == y).sum() / N_IMAGES
    assert m["top5"] == (order[:, :5] == y[:, None]).any(1).sum() / N_IMAGES
