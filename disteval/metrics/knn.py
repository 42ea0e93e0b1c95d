"""Embedding metrics from exact neighbour lists: kNN classification (DINO protocol and majority vote),
retrieval recall@k, mean average precision at R. Pure functions of per-query neighbour lists (scores
float32 [n, K] in descending order, gallery labels / groups int64 [n, K]) giving integer counts or float64
per-query values, plus the ``EmbeddingMetrics`` states. No torch.distributed here: the search that
produces the neighbour lists is the comm layer's (``disteval.comm.topk``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from disteval.errors import DataError
from disteval.metrics.base import Metric
from disteval.metrics.meaning import Meaning

VOTES = ("weighted", "majority")
FEW = 5  # sample ids an error or warning lists


def few_ids(ids: list[int], total: int | None = None) -> str:
    """The first ``FEW`` of ``ids`` as text, ``...`` when ``total`` (default len(ids)) holds more."""
    total = len(ids) if total is None else total
    return ", ".join(str(int(i)) for i in ids[:FEW]) + (", ..." if total > FEW else "")


def knn_class_ranking(scores: torch.Tensor, labels: torch.Tensor, num_classes: int, k: int,
                      temperature: float | None) -> torch.Tensor:
    """Classes ranked by the votes of the first ``k`` neighbours: int64 [n, num_classes], best first.

    ``temperature`` T: each neighbour votes ``exp(score / T)`` for its label (DINO's weighted kNN,
    Caron et al. 2021, ``eval_knn.py``: T = 0.07 on cosine similarities); None: one vote each (majority).
    Votes are float64 sums in neighbour order; equal votes rank the smaller class id first (stable sort)."""
    s, lab = scores[:, :k].double(), labels[:, :k]
    weights = torch.ones_like(s) if temperature is None else torch.exp(s / float(temperature))
    votes = torch.zeros((s.shape[0], num_classes), dtype=torch.float64)
    votes.scatter_add_(1, lab, weights)
    return torch.sort(votes, dim=1, descending=True, stable=True).indices


TOPK = (1, 5)


def knn_hits(scores: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor, num_classes: int, ks: list[int],
             temperature: float | None) -> torch.Tensor:
    """int64 [len(ks), 2]: queries whose ``targets`` class is among the first t classes of the k-neighbour vote
    (``knn_class_ranking``), for each k of ``ks`` and t in ``TOPK`` (top-1, top-5)."""
    out = torch.zeros((len(ks), len(TOPK)), dtype=torch.int64)
    for i, k in enumerate(ks):
        ranking = knn_class_ranking(scores, labels, num_classes, k, temperature)
        for j, t in enumerate(TOPK):
            out[i, j] = (ranking[:, :t] == targets[:, None]).any(1).sum()
    return out


def first_hit_rank(groups: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0-based rank of the first neighbour whose group equals the query's ``targets`` (e.g. the image a caption
    belongs to), K where none of the K neighbours does: int64 [n]. Recall@k = mean(rank < k): a hit is any
    correct item in the top k (COCO/Flickr30k protocol, several captions per image)."""
    match = groups == targets[:, None]
    k = groups.shape[1]
    ranks = torch.where(match, torch.arange(k)[None, :], torch.full_like(groups, k))
    return ranks.min(1).values if k else torch.zeros(groups.shape[0], dtype=torch.int64)


def recall_hits(first_rank: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """int64 [len(ks)]: queries whose first correct item ranks below k (integer counts; recall = hits / n). The
    ranks must come from at least max(ks) neighbours (rank K means none of the K was correct)."""
    return torch.stack([(first_rank < k).sum() for k in ks]).to(torch.int64)


def average_precision_at_r(labels: torch.Tensor, targets: torch.Tensor, relevant: torch.Tensor) -> torch.Tensor:
    """AP@R per query, float64 [n] (Musgrave et al. 2020, "A Metric Learning Reality Check", eq. 1):
    R = ``relevant`` (gallery items of the query's class, int64 [n]); AP@R = (1/R) sum_{i<=R} P(i) rel(i).
    ``labels`` int64 [n, K] with K >= max R. Raises ValueError if K < max R."""
    if relevant.numel() and int(relevant.max()) > labels.shape[1]:
        raise ValueError(f"AP@R needs R={int(relevant.max())} neighbours, got {labels.shape[1]}")
    k = labels.shape[1]
    pos = torch.arange(1, k + 1, dtype=torch.float64)
    within = pos[None, :] <= relevant[:, None].double()
    rel = (labels == targets[:, None]) & within
    precision = torch.cumsum(rel.double(), 1) / pos[None, :]
    return (precision * rel.double()).sum(1) / relevant.double().clamp(min=1)


@dataclass
class EmbeddingSpec:
    """What ``EmbeddingMetrics`` reports. dim: embedding width D. searches: names of the query->gallery
    searches (e.g. ["knn"] or ["image_to_text", "text_to_image"]). knn_k / votes / temperature / num_classes:
    kNN classification (searches named ``knn``); recall_k: recall@k of every search; map_at_r: AP@R of
    ``knn`` queries."""

    dim: int
    searches: list[str] = field(default_factory=lambda: ["knn"])
    num_classes: int = 0
    knn_k: list[int] = field(default_factory=lambda: [10, 20, 100, 200])
    votes: list[str] = field(default_factory=lambda: list(VOTES))
    temperature: float = 0.07
    recall_k: list[int] = field(default_factory=list)
    map_at_r: bool = False


class EmbeddingMetrics(Metric):
    """Embeddings of this rank (rank-local states: never synchronised, kept in checkpoints) and the integer
    results of the searches run on them (``add_knn``, ``add_recall``, ``add_map_at_r``; sum-states).

    ``update(outputs, targets, sample_ids)``: outputs float [B, D] embeddings, targets int64 [B] labels
    (classes, or the pair group), sample_ids int64 [B]. Raises DataError naming the sample for a non-finite
    embedding."""

    meaning = Meaning(main=(r".*top1", r".*recall.*"), precedence=30)

    def __init__(self, spec: EmbeddingSpec):
        super().__init__()
        self.spec = spec
        n_s, n_k, n_v = len(spec.searches), len(spec.knn_k), len(spec.votes)
        self.add_state("embeddings", torch.zeros((0, spec.dim), dtype=torch.float32), "local")
        self.add_state("labels", torch.zeros(0, dtype=torch.int64), "local")
        self.add_state("ids", torch.zeros(0, dtype=torch.int64), "local")
        self.add_state("queries", torch.zeros(n_s, dtype=torch.int64))
        self.add_state("knn_hits", torch.zeros((n_v, n_k, 2), dtype=torch.int64))
        self.add_state("recall_hits", torch.zeros((n_s, len(spec.recall_k)), dtype=torch.int64))
        self.add_state("ap_at_r", torch.zeros(0, dtype=torch.float64), "gather", root=True)
        self._queue: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def update(self, outputs: Any, targets: torch.Tensor, sample_ids: torch.Tensor) -> None:
        self._queue.append((outputs.detach().float(), targets.detach().to(torch.int64),
                            sample_ids.detach().to(torch.int64)))

    def _flush(self) -> None:
        if not self._queue:
            return
        emb, lab, ids = (torch.cat([q[i].cpu() for q in self._queue]) for i in range(3))
        self._queue = []
        bad = ~torch.isfinite(emb).all(1)
        if bool(bad.any()):
            first = ids[bad].sort().values
            raise DataError(f"sample id {int(first[0])}: non-finite embedding (nan or inf) for {int(bad.sum())} "
                            f"sample(s) on this rank (sample ids {few_ids(first.tolist())})", sample_id=int(first[0]))
        if emb.shape[1] != self.spec.dim:
            raise DataError(f"embeddings have {emb.shape[1]} dimensions, expected {self.spec.dim}")
        st = self.state_tensors
        st["embeddings"] = torch.cat([st["embeddings"], emb])
        st["labels"] = torch.cat([st["labels"], lab])
        st["ids"] = torch.cat([st["ids"], ids])

    def rows(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (embeddings float32 [m, D], positions int64 [m] = id - lo, labels int64 [m]) of the
        samples with ids in [lo, hi), by id."""
        self._flush()
        ids = self.state_tensors["ids"]
        keep = torch.nonzero((ids >= lo) & (ids < hi)).flatten()
        keep = keep[torch.argsort(ids[keep])]
        return self.state_tensors["embeddings"][keep], ids[keep] - lo, self.state_tensors["labels"][keep]

    def zero_rows(self, lo: int, hi: int) -> tuple[int, torch.Tensor]:
        """(how many of this rank's samples have ids in [lo, hi), the ids among them whose embedding is all zero:
        int64, ascending)."""
        emb, pos, _ = self.rows(lo, hi)
        return int(pos.numel()), pos[(emb == 0).all(1)] + lo

    def add_knn(self, scores: torch.Tensor, neighbor_labels: torch.Tensor, targets: torch.Tensor) -> None:
        """Count kNN hits of these queries (scores float32 [n, K], neighbour labels int64 [n, K], query labels
        int64 [n]) for every vote kind and k."""
        s = self.state_tensors
        for v, vote in enumerate(self.spec.votes):
            temp = self.spec.temperature if vote == "weighted" else None
            s["knn_hits"][v] += knn_hits(scores, neighbor_labels, targets, self.spec.num_classes, self.spec.knn_k, temp)

    def add_recall(self, search: str, first_rank: torch.Tensor) -> None:
        """Count the queries of ``search`` and their recall@k hits (``first_hit_rank`` int64 [n])."""
        i = self.spec.searches.index(search)
        self.state_tensors["queries"][i] += first_rank.numel()
        if self.spec.recall_k:
            self.state_tensors["recall_hits"][i] += recall_hits(first_rank, self.spec.recall_k)

    def add_queries(self, search: str, n: int) -> None:
        """Count ``n`` queries of ``search`` (searches without recall)."""
        self.state_tensors["queries"][self.spec.searches.index(search)] += int(n)

    def add_map_at_r(self, ap: torch.Tensor) -> None:
        """Append per-query AP@R values (float64 [n]); their mean is summed with ``math.fsum`` (correctly
        rounded: independent of order and world size)."""
        self.state_tensors["ap_at_r"] = torch.cat([self.state_tensors["ap_at_r"], ap.double()])

    def compute(self) -> dict:
        s, spec = self.state_tensors, self.spec
        out: dict = {}
        for i, name in enumerate(spec.searches):
            n = int(s["queries"][i])
            out[f"{name}_queries"] = n
            for j, k in enumerate(spec.recall_k):
                out[f"{name}_recall@{k}"] = int(s["recall_hits"][i, j]) / n if n else None
        if "knn" in spec.searches:
            n = int(s["queries"][spec.searches.index("knn")])
            for v, vote in enumerate(spec.votes):
                for j, k in enumerate(spec.knn_k):
                    for t, top in enumerate(TOPK):
                        out[f"knn_{vote}_k{k}_top{top}"] = int(s["knn_hits"][v, j, t]) / n if n else None
            if spec.map_at_r:
                ap = s["ap_at_r"]
                out["map_at_r"] = math.fsum(ap.tolist()) / ap.numel() if ap.numel() else None
        return out
