"""Embedding evaluation without processes: the int64 score/id keys and their total order, the metric
formulas against direct implementations of their definitions, rank-local states, config and preflight
errors, and an open_clip model built with random weights while the network is refused."""
from __future__ import annotations

import socket
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from bitwise_workers import job
from disteval.common import topk
from disteval.common.topk import EMPTY, SearchSpec, decode_keys, exact_search, merge_keys, score_keys
from disteval.errors import ConfigError
from disteval.metrics.knn import (EmbeddingMetrics, EmbeddingSpec, average_precision_at_r, first_hit_rank,
                                  knn_class_ranking, recall_hits)
from disteval.tasks import resolve_task


def test_keys_order_by_score_then_smaller_id_and_round_trip():
    scores = torch.tensor([[0.5, -0.0, 0.0, -1.5, 0.5, float("inf"), -float("inf"), 1e-40]])
    pos = torch.arange(8)[None, :] * 1000 + 7
    keys = score_keys(scores, pos)
    order = torch.topk(keys, 8, dim=1).indices[0].tolist()
    assert order == [5, 0, 4, 7, 1, 2, 3, 6]  # inf, 0.5 (id 7), 0.5 (id 4007), denormal, 0 (-0 == +0 by id), ...
    s, p = decode_keys(keys)
    assert torch.equal(p, pos) and torch.equal(s, scores + 0.0)
    s, p = decode_keys(torch.tensor([[EMPTY]]))
    assert p.item() == -1 and torch.isnan(s).item()


def test_merge_of_any_split_equals_the_whole():
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (5, 60), generator=g).float()  # many exact ties
    keys = score_keys(scores, torch.arange(60)[None, :])
    whole = merge_keys([keys], 9)
    for cuts in ([0, 60], [0, 13, 60], [0, 1, 2, 30, 59, 60]):
        parts = [merge_keys([keys[:, a:b]], min(9, b - a)) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(merge_keys(parts, 9), whole)
    want = np.stack([np.lexsort((np.arange(60), -row))[:9] for row in scores.numpy()])
    assert np.array_equal(decode_keys(whole)[1].numpy(), want)


@pytest.mark.parametrize("k,tile,run", [(1, 64, True), (3, 512, True), (5, 128, True), (20, 192, True),
                                         (7, 100, False)])
def test_pruned_search_equals_a_top_k_over_every_pair(k, tile, run, monkeypatch):
    """``exact_search`` (threshold pruning of ``_merge_block``, or its fallback when the tile is not a multiple
    of the pruning run) == a top-k over the keys of every (query, item) pair, numpy's lexsort order: small
    integer embeddings make every score exact whatever the GEMM, with ties everywhere, zero items and a query
    count that leaves padding rows in the last query tile (non-finite embeddings never reach a search:
    ``EmbeddingMetrics`` refuses them)."""
    g = torch.Generator().manual_seed(k)
    gallery = torch.randint(-2, 3, (1000, 6), generator=g).float()
    queries = torch.randint(-2, 3, (45, 6), generator=g).float()
    gallery[400:410] = 0.0
    spec = SearchSpec(k=k, chunk=17, tile_queries=8, tile_gallery=tile)
    monkeypatch.setattr(topk, "BLOCK_ELEMENTS", 1)  # one gallery tile per block: the pruning sees many blocks
    dense_blocks = []
    monkeypatch.setattr(topk, "_block_topk", lambda *a, f=topk._block_topk: dense_blocks.append(1) or f(*a))
    scores, ids = exact_search(queries, gallery, spec)
    blocks = -(-45 // 17) * -(-1000 // tile)
    assert len(dense_blocks) < blocks / 2 if run else len(dense_blocks) == blocks  # pruned, or its fallback
    dense = queries @ gallery.t()  # exact: integer products and sums
    want = torch.topk(score_keys(dense, torch.arange(1000)[None, :]), k, dim=1).values
    want_scores, want_ids = decode_keys(want)
    assert torch.equal(ids, want_ids) and torch.equal(scores, want_scores)
    order = np.stack([np.lexsort((np.arange(1000), -row))[:k] for row in dense.numpy()])
    assert np.array_equal(ids.numpy(), order)


def test_exact_search_refuses_k_above_gallery_and_bad_spec():
    with pytest.raises(ValueError, match="exceeds the gallery size 3"):
        exact_search(torch.zeros(2, 4), torch.zeros(3, 4), SearchSpec(k=4))
    with pytest.raises(ValueError, match="similarity"):
        SearchSpec(k=1, similarity="cos")
    with pytest.raises(ValueError, match="chunk"):
        SearchSpec(k=1, chunk=0)
    assert [SearchSpec(k=1, chunk=c).step for c in (1000, 7, 128, 255)] == [896, 7, 128, 128]  # whole tiles


def test_knn_vote_ties_go_to_the_smaller_class_and_weights_follow_dino():
    scores = torch.tensor([[0.9, 0.8, 0.1, 0.1]])
    labels = torch.tensor([[3, 1, 1, 3]])
    assert knn_class_ranking(scores, labels, 4, 4, None)[0, :2].tolist() == [1, 3]  # 2 votes each: smaller id
    w = np.exp(np.array([0.9, 0.8, 0.1, 0.1]) / 0.07)
    want = 3 if w[0] + w[3] > w[1] + w[2] else 1
    assert knn_class_ranking(scores, labels, 4, 4, 0.07)[0, 0].item() == want


def test_first_hit_rank_recall_and_ap_at_r_follow_their_definitions():
    groups = torch.tensor([[4, 2, 2, 1], [0, 0, 0, 0], [1, 3, 1, 3]])
    targets = torch.tensor([2, 5, 3])
    ranks = first_hit_rank(groups, targets)
    assert ranks.tolist() == [1, 4, 1]
    assert recall_hits(ranks, [1, 2, 4]).tolist() == [0, 2, 2]  # k <= K neighbours searched
    labels = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 1, 1]])
    targets, relevant = torch.tensor([1, 0]), torch.tensor([3, 4])
    # query 0, R=3: rel = 1,0,1 -> (1/1 + 2/3) / 3; query 1, R=4: rel = 1,1,1,0 -> (1 + 1 + 1) / 4
    assert average_precision_at_r(labels, targets, relevant).tolist() == [(1 + 2 / 3) / 3, 3 / 4]
    with pytest.raises(ValueError, match="R=6"):
        average_precision_at_r(labels, targets, torch.tensor([6, 1]))


def test_embeddings_are_rank_local_states():
    m = EmbeddingMetrics(EmbeddingSpec(dim=2, knn_k=[1]))
    m.update(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1]), torch.tensor([7, 3]))
    specs = m.specs()
    assert specs["embeddings"].reduction == "local" and specs["ids"].reduction == "local"
    emb, pos, lab = m.rows(0, 5)
    assert pos.tolist() == [3] and lab.tolist() == [1] and emb.tolist() == [[0.0, 1.0]]
    m.update(torch.tensor([[float("nan"), 0.0]]), torch.tensor([0]), torch.tensor([9]))
    with pytest.raises(Exception, match="sample id 9"):
        m.rows(0, 10)


@pytest.mark.parametrize("key,value,match", [("protocol", "dense", "eval.embedding.protocol"),
                                             ("similarity", "cos", "eval.embedding.similarity"),
                                             ("votes", ["plurality"], "eval.embedding.votes"),
                                             ("templates", ["no slot"], "eval.embedding.templates"),
                                             ("chunk_size", 0, "eval.embedding.chunk_size")])
def test_config_errors_name_the_key(key, value, match):
    from disteval.config import validated

    with pytest.raises(ConfigError, match=match):
        validated(job({"eval": {"embedding": {key: value}}}))


def _merge(base: dict, extra: dict) -> dict:
    return OmegaConf.to_container(OmegaConf.merge(base, extra))


@pytest.mark.parametrize("extra,match", [
    ({}, "eval.embedding.knn_k"),  # k=200 > the 50 gallery items
    ({"data": {"sampler": "padded"}}, "data.sampler"),
    ({"eval": {"embedding": {"layer": None}}}, "eval.embedding.layer"),
    ({"eval": {"embedding": {"protocol": "retrieval"}}}, "data.name"),
    ({"eval": {"embedding": {"layer": "classifier.9", "knn_k": [5]}}}, "classifier.9"),
])
def test_preflight_names_the_problem(extra, match):
    base = {"model": {"name": "fashion_cnn", "weights": "shipped"},
            "data": {"name": "fashion_mnist", "root": "/usr/share/datasets/fashion-mnist"},
            "eval": {"task": "embedding", "embedding": {"layer": "classifier.3", "gallery_limit": 50, "query_limit": 5}}}
    cfg = job(_merge(base, extra))
    task = resolve_task(cfg)(cfg)
    with pytest.raises(ConfigError, match=match):
        task.preflight([])
        task.model(torch.device("cpu"))  # the layer is looked up when the model is built


def test_open_clip_random_weights_need_no_network(monkeypatch):
    pytest.importorskip("open_clip")
    from disteval.models.clip import build_open_clip

    def refuse(*args, **kwargs):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    cfg = OmegaConf.create({"name": "open_clip:ViT-B-32", "weights": None, "checkpoint": None,
                            "kwargs": {"embed_dim": 16, "vision_cfg": {"image_size": 16, "patch_size": 8, "width": 16,
                                                                       "layers": 1, "head_width": 8},
                                       "text_cfg": {"context_length": 12, "width": 16, "heads": 2, "layers": 1}}})
    net, tok = build_open_clip(cfg)
    with torch.inference_mode():
        assert net.encode_image(torch.zeros(2, 3, 16, 16)).shape == (2, 16)
        assert net.encode_text(tok(["a red square", "a blue disc"])).shape == (2, 16)
    with pytest.raises(ConfigError, match="model.weights"):
        build_open_clip(OmegaConf.merge(cfg, {"weights": "openai"}))


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_low_precision_candidates_with_float32_rerank_equal_float32(precision):
    """Clustered unit vectors (near neighbours close in score) and integer vectors with exact ties: the
    low-precision pass skips tiles, and the re-ranked top-k equals the float32 search bit for bit."""
    from disteval.common.topk import GalleryTiles, candidate_tiles, rounding_bound

    g = torch.Generator().manual_seed(3)
    centres = torch.randn(20, 48, generator=g)
    gallery = torch.nn.functional.normalize(centres[torch.randint(0, 20, (3000,), generator=g)]
                                            + 0.3 * torch.randn(3000, 48, generator=g), dim=1)
    queries = torch.nn.functional.normalize(centres[torch.randint(0, 20, (64,), generator=g)]
                                            + 0.3 * torch.randn(64, 48, generator=g), dim=1)
    ties_g = torch.randint(-1, 2, (500, 6), generator=g).float()
    ties_q = torch.randint(-1, 2, (30, 6), generator=g).float()
    for q, x, k in ((queries, gallery, 10), (ties_q, ties_g, 10)):
        exact = SearchSpec(k, "ip", chunk=7, tile_queries=8, tile_gallery=64)
        low = SearchSpec(k, "ip", chunk=7, tile_queries=8, tile_gallery=64, precision=precision)
        ref, got = exact_search(q, x, exact), exact_search(q, x, low)
        assert torch.equal(ref[0].view(torch.int32), got[0].view(torch.int32)) and torch.equal(ref[1], got[1])
    needed = candidate_tiles(queries[:1], GalleryTiles(gallery, torch.arange(3000), low))
    assert 0 < len(needed) < -(-3000 // 64)  # some tiles are re-scored in float32, not all
    # the bound holds on these data: |s_lp - s| <= c |q| |g|
    lp = (queries.to(getattr(torch, precision)) @ gallery.to(getattr(torch, precision)).t()).float()
    assert float((lp - queries @ gallery.t()).abs().max()) <= rounding_bound(precision, 48)


@pytest.mark.parametrize("name,protocol", [("fashion_mnist_knn", "knn"), ("pairs_retrieval", "retrieval")])
def test_embedding_experiments_compose(name, protocol):
    from hydra import compose, initialize_config_dir

    from disteval.config import register_schemas, validated

    register_schemas()
    conf = str(Path(__file__).resolve().parent.parent / "conf")
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={name}"])
    validated(cfg)
    assert cfg.eval.task == "embedding" and cfg.eval.embedding.protocol == protocol
    assert resolve_task(cfg).name == "embedding"
