"""Embedding evaluation (``eval.task=embedding``, options ``eval.embedding.*``): kNN classification (DINO
protocol, majority vote, mAP@R), image-text retrieval recall@k and zero-shot classification.

One dataset holds both splits back to back (gallery ids first, then queries; for image-text pairs images
first, then captions), so the engine shards it exactly and batch-aligned like any other, and the global
batches do not depend on W. Each rank keeps only the embeddings it computed (rank-local metric states).
After the loop, ``after_loop`` runs each search with the comm layer's sharded exact top-k
(``Communicator.sharded_topk``: the gallery stays where it was embedded, queries and k candidates per query
travel) and turns the neighbour lists into integer counts (and per-query AP@R values) that the ordinary
synchronisation sums. Zero-shot needs no search: logits against the class-name text embeddings feed the
classification metrics."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

from disteval.data.prediction_columns import classification_schema, embedding_columns, embedding_schema
from disteval.data.prediction_store import classification_columns
from disteval.common.formatting import fmt
from disteval.common.topk import Rows, SearchSpec
from disteval.data.datasets import IndexedDataset, build_dataset, check_data_root, prepare_data
from disteval.data.pairs import COLOURS, ImageTextPairs, MixedBatch, collate_mixed
from disteval.errors import ConfigError
from disteval.metrics import ClassificationMetrics
from disteval.metrics.knn import EmbeddingMetrics, EmbeddingSpec, average_precision_at_r, first_hit_rank
from disteval.models import build_model
from disteval.models.clip import build_open_clip, is_open_clip
from disteval.tasks.base import Task, register_task
from disteval.tasks.embedding_checks import check_zero_embeddings, zero_census

KNN_DATA = ("digits", "fashion_mnist")
PAIRS = "generated_pairs"


class LayerEmbedder(torch.nn.Module):
    """``model``'s output of the submodule named ``layer`` (``model.named_modules()``), flattened to [B, D]."""

    def __init__(self, model: torch.nn.Module, layer: str):
        super().__init__()
        modules = dict(model.named_modules())
        if layer not in modules:
            raise ConfigError("eval.embedding.layer", f"{type(model).__name__} has no module {layer!r}; modules: "
                              f"{[n for n in modules if n][:40]}")
        self.model, self._out = model, None
        modules[layer].register_forward_hook(lambda m, i, o: setattr(self, "_out", o))

    def encode_image(self, x: torch.Tensor) -> torch.Tensor:
        self.model(x)
        out, self._out = self._out, None
        return out.flatten(1)


class _Images(Dataset):
    """The image items of generated pairs with their colour as the class (zero-shot)."""

    def __init__(self, pairs: ImageTextPairs):
        self.pairs = pairs

    def __len__(self) -> int:
        return self.pairs.n_images

    def __getitem__(self, i: int):
        return self.pairs.image(i), self.pairs.image_class(i), i


@register_task
class EmbeddingTask(Task):
    """Embedding evaluation of ``model.*`` on ``data.*`` (see the module docstring and ``EmbeddingConfig``)."""

    name = "embedding"
    data_names = (PAIRS,)

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.opt = cfg.eval.embedding
        self.protocol = str(self.opt.protocol)
        self.parts: dict[str, tuple[int, int]] = {}
        self.labels = torch.zeros(0, dtype=torch.int64)  # target of every sample id (class or pair group)
        self.num_classes = 0
        self.dim = 0
        self._tokenize = None
        self._classifier: torch.Tensor | None = None
        self.search_bytes = 0
        self.warnings: list[str] = []  # after_loop's (zero embeddings), for results.json ``warnings``

    # -- configuration checks -----------------------------------------------------------------------------
    def preflight(self, notes: list[str]) -> None:
        cfg, opt = self.cfg, self.opt
        if str(cfg.data.sampler) != "exact":
            raise ConfigError("data.sampler", "embedding evaluation needs data.sampler=exact: every gallery item and "
                              "query must be embedded exactly once")
        if self.protocol == "knn":
            if cfg.data.name not in KNN_DATA:
                raise ConfigError("data.name", f"eval.embedding.protocol=knn evaluates {list(KNN_DATA)}, not "
                                  f"{cfg.data.name!r}")
            for split in (opt.gallery_split, opt.query_split):
                check_data_root(self._split_cfg(split, None))
                prepare_data(self._split_cfg(split, None), notes)
            if is_open_clip(cfg.model.name) or not opt.layer:
                raise ConfigError("eval.embedding.layer", "kNN on a classifier needs the layer whose output is the "
                                  "embedding, e.g. classifier.3 (the fashion_cnn's penultimate layer)")
        elif cfg.data.name != PAIRS:
            raise ConfigError("data.name", f"eval.embedding.protocol={self.protocol} needs data.name={PAIRS}")
        elif not is_open_clip(cfg.model.name):
            raise ConfigError("model.name", f"protocol {self.protocol} needs an image-text model (open_clip:ARCH)")
        self.dataset()
        n_gallery = {k: hi - lo for k, (lo, hi) in self.parts.items()}
        if self.protocol == "knn" and max(opt.knn_k) > n_gallery["gallery"]:
            raise ConfigError("eval.embedding.knn_k", f"k={max(opt.knn_k)} exceeds the {n_gallery['gallery']} "
                              "gallery items")
        if self.protocol == "retrieval" and opt.recall_k and max(opt.recall_k) > n_gallery["images"]:
            raise ConfigError("eval.embedding.recall_k", f"k={max(opt.recall_k)} exceeds the "
                              f"{n_gallery['images']} images")

    def _split_cfg(self, split: str, limit: int | None) -> Any:
        return dataclasses.replace(self.cfg.data, split=str(split), limit=limit)

    # -- data and model -------------------------------------------------------------------------------------
    def dataset(self) -> Dataset:
        opt = self.opt
        if self.protocol == "knn":
            g, self.num_classes = build_dataset(self._split_cfg(opt.gallery_split, opt.gallery_limit))
            q, _ = build_dataset(self._split_cfg(opt.query_split, opt.query_limit))
            xg, yg = (t[:len(g)] for t in g.base.tensors)
            xq, yq = (t[:len(q)] for t in q.base.tensors)
            self.parts = {"gallery": (0, len(g)), "query": (len(g), len(g) + len(q))}
            self.labels = torch.cat([yg, yq]).to(torch.int64)
            return IndexedDataset(TensorDataset(torch.cat([xg, xq]), self.labels))
        pairs = ImageTextPairs(int(opt.generated_images), int(opt.captions_per_image), int(opt.image_size),
                               seed=int(self.cfg.seed))
        n = pairs.n_images
        self.num_classes = len(COLOURS)
        if self.protocol == "zero_shot":
            self.parts = {"images": (0, n)}
            self.labels = torch.tensor([pairs.image_class(i) for i in range(n)], dtype=torch.int64)
            return _Images(pairs)
        self.parts = {"images": (0, n), "texts": (n, len(pairs))}
        self.labels = torch.cat([torch.arange(n), torch.arange(n * pairs.cpi) // pairs.cpi]).to(torch.int64)
        return pairs

    def collate_fn(self):
        return collate_mixed if self.protocol == "retrieval" else None

    def model(self, device: torch.device) -> torch.nn.Module:
        cfg = self.cfg
        if is_open_clip(cfg.model.name):
            net, self._tokenize = build_open_clip(cfg.model, seed=int(cfg.seed))
            net = net.to(device)
            self.dim = int(net.encode_text(self._tokenize(["a"]).to(device)).shape[1])
            if self.protocol == "zero_shot":
                self._classifier = self.class_embeddings(net, device)
            return net
        net = LayerEmbedder(build_model(cfg.model, self.num_classes or 10, seed=int(cfg.seed)), str(self.opt.layer))
        net = net.to(device).eval()
        channels = 1 if cfg.data.name in KNN_DATA else 3
        size = {"digits": 8, "fashion_mnist": 28}.get(cfg.data.name, 32)
        with torch.inference_mode():
            self.dim = int(net.encode_image(torch.zeros(1, channels, size, size, device=device)).shape[1])
        return net

    def class_embeddings(self, net: torch.nn.Module, device: torch.device) -> torch.Tensor:
        """Zero-shot classifier float32 [C, D]: per class the L2-normalised mean of the L2-normalised text
        embeddings of its name in every template (CLIP, Radford et al. 2021, prompt ensembling)."""
        rows = []
        with torch.inference_mode():
            for name in COLOURS:
                texts = [t.format(name) for t in self.opt.templates]
                emb = F.normalize(net.encode_text(self._tokenize(texts).to(device)).float(), dim=-1)
                rows.append(F.normalize(emb.mean(0), dim=-1))
        return torch.stack(rows)

    def embed(self, model: torch.nn.Module, inputs: Any, device: torch.device) -> torch.Tensor:
        """Embeddings float32 [B, D] of a batch in item order (images and/or captions), L2-normalised when
        ``eval.embedding.normalize``."""
        if isinstance(inputs, MixedBatch):
            out = torch.empty((inputs.kinds.numel(), self.dim), dtype=torch.float32, device=device)
            if inputs.images is not None:
                out[inputs.kinds == 0] = model.encode_image(inputs.images.to(device)).float()
            if inputs.texts:
                out[inputs.kinds == 1] = model.encode_text(self._tokenize(inputs.texts).to(device)).float()
        else:
            out = model.encode_image(inputs.to(device, non_blocking=True)).float()
        return F.normalize(out, dim=-1) if self.opt.normalize else out

    def step(self, model: torch.nn.Module | None, inputs: Any, device: torch.device) -> Any:
        emb = self.embed(model, inputs, device)
        if self.protocol == "zero_shot":
            return emb @ self._classifier.t()
        return emb

    def prediction_schema(self):
        """Each sample's embedding (kNN, retrieval) or, zero-shot, the classification store's columns of its
        class scores (``disteval.data.prediction_columns``)."""
        p = self.cfg.eval.predictions
        if self.protocol == "zero_shot":
            return classification_schema(int(p.topk), bool(p.logits), self.num_classes)
        return embedding_schema(self.dim)

    def prediction_columns(self, outputs, targets, ids):
        p = self.cfg.eval.predictions
        if self.protocol == "zero_shot":
            return classification_columns(outputs, targets, ids, int(p.topk), bool(p.logits))
        return embedding_columns(outputs, targets, ids)

    def metric(self):
        if self.protocol == "zero_shot":
            topk = [k for k in self.cfg.eval.classification.topk if k <= self.num_classes]
            return ClassificationMetrics(self.num_classes, topk=topk)
        opt = self.opt
        searches = ["knn"] if self.protocol == "knn" else ["image_to_text", "text_to_image"]
        return EmbeddingMetrics(EmbeddingSpec(self.dim, searches, self.num_classes, list(opt.knn_k), list(opt.votes),
                                              float(opt.temperature), list(opt.recall_k) if self.protocol != "knn" else [],
                                              bool(opt.map_at_r) and self.protocol == "knn"))

    # -- the search phase -----------------------------------------------------------------------------------
    def search_spec(self, k: int) -> SearchSpec:
        opt = self.opt
        return SearchSpec(k, str(opt.similarity), int(opt.chunk_size), int(opt.tile_queries), int(opt.tile_gallery),
                          str(opt.precision))

    def after_loop(self, metric: Any, comm: Any) -> None:
        if not isinstance(metric, EmbeddingMetrics):
            return
        opt = self.opt
        source = (f"eval.embedding.layer={opt.layer}, whose output is zero for these inputs (a ReLU after a dead "
                  "layer?), and model.checkpoint / model.weights (all-zero weights?)" if opt.layer else
                  f"model.checkpoint / model.weights of {self.cfg.model.name} (all-zero weights?)")
        warning = check_zero_embeddings(zero_census(metric, self.parts, comm),
                                        bool(opt.normalize) or str(opt.similarity) == "ip", source)
        self.warnings = [warning] if warning else []
        before = comm.bytes
        if self.protocol == "knn":
            self._knn(metric, comm)
        else:
            self._retrieval(metric, comm)
        self.search_bytes = comm.bytes - before

    def _search(self, metric: EmbeddingMetrics, comm: Any, query: str, gallery: str, k: int):
        (glo, ghi), (qlo, qhi) = self.parts[gallery], self.parts[query]
        g_emb, g_pos, _ = metric.rows(glo, ghi)
        q_emb, q_pos, q_lab = metric.rows(qlo, qhi)
        scores, nbr = comm.sharded_topk(Rows(g_emb, g_pos), Rows(q_emb, q_pos), qhi - qlo, self.search_spec(k))
        return scores, nbr, q_lab, self.labels[glo:ghi]

    def _knn(self, metric: EmbeddingMetrics, comm: Any) -> None:
        opt = self.opt
        counts = torch.bincount(self.labels[slice(*self.parts["gallery"])], minlength=self.num_classes)
        k = max(max(opt.knn_k), int(counts.max()) if opt.map_at_r else 0)
        scores, nbr, q_lab, g_lab = self._search(metric, comm, "query", "gallery", k)
        nbr_lab = g_lab[nbr]
        kk = max(opt.knn_k)
        metric.add_knn(scores[:, :kk], nbr_lab[:, :kk], q_lab)
        metric.add_queries("knn", q_lab.numel())
        if opt.map_at_r:
            metric.add_map_at_r(average_precision_at_r(nbr_lab, q_lab, counts[q_lab]))

    def _retrieval(self, metric: EmbeddingMetrics, comm: Any) -> None:
        k = max(self.opt.recall_k) if self.opt.recall_k else 1
        for search, query, gallery in (("image_to_text", "images", "texts"), ("text_to_image", "texts", "images")):
            _, _, q_lab, g_lab = scores_nbr = self._search(metric, comm, query, gallery, k)
            metric.add_recall(search, first_hit_rank(g_lab[scores_nbr[1]], q_lab))

    # -- records --------------------------------------------------------------------------------------------
    def run_warnings(self) -> list[str]:
        """Zero embeddings found by ``after_loop`` (``disteval.tasks.embedding_checks``)."""
        return list(self.warnings)

    def describe(self) -> dict:
        return {"num_classes": self.num_classes, "protocol": self.protocol,
                "parts": {k: [lo, hi] for k, (lo, hi) in self.parts.items()}, "embedding_dim": self.dim}

    def main_metric(self, metrics: dict) -> str | None:
        """Zero-shot top-1, the first kNN top-1 (``knn_<vote>_k<k>_top1``) or the first recall@k."""
        return next((k for k in metrics if k.endswith("top1") or "recall" in k), None) or super().main_metric(metrics)

    @classmethod
    def report_figures(cls, metrics: dict) -> list:
        """Recall@k and kNN accuracy against k (``disteval.tasks.figures``)."""
        from disteval.tasks.figures import embedding_figures

        return embedding_figures(metrics)

    def console_section(self, metrics: dict):
        rows = [(k.replace("_", " "), fmt(v)) for k, v in metrics.items() if isinstance(v, (int, float)) or v is None]
        notes = [] if self.protocol == "zero_shot" else [
            f"exact sharded top-k ({self.opt.similarity}, chunk {self.opt.chunk_size}, {self.opt.precision}): "
            f"galleries stayed sharded; rank 0's searches sent {self.search_bytes:,} bytes"]
        return rows, [], notes
