"""Zero embeddings, counted on every rank after the loop and before any search (``EmbeddingTask.after_loop``).

A zero vector has no direction: it cannot be L2-normalised (``F.normalize`` leaves it zero), its cosine
similarity (and inner product) with every item is 0, so a zero query's neighbours are arbitrary and a zero
gallery item ranks by id alone. Every embedding of a part (the gallery, the queries; the images, the captions)
zero: no search means anything (a kNN at chance) -> DataError naming the count and each rank's first sample
ids, raised on every rank (all of them see the same census). Some zero: the run still measures the others ->
a warning for results.json when the similarity is cosine or inner product (with ``similarity=l2`` and
``normalize=false`` a zero vector is an ordinary point, and only a whole zero part is refused)."""
from __future__ import annotations

from typing import Any

import torch

from disteval.errors import DataError
from disteval.metrics.knn import FEW, few_ids

LABELS = {"gallery": "gallery", "query": "query", "images": "image", "texts": "caption"}
RankZeros = tuple[int, int, list[int]]  # one rank's (samples of the part, zero embeddings, first FEW zero ids)


def zero_census(metric: Any, parts: dict[str, tuple[int, int]], comm: Any) -> dict[str, list[RankZeros]]:
    """``{part: [RankZeros of rank 0, rank 1, ...]}`` for the id ranges ``parts`` of ``metric`` (an
    ``EmbeddingMetrics``): one all_gather of int64 [len(parts) * (2 + FEW)] per rank. A collective: every rank
    calls it, ranks without samples too."""
    names, local = list(parts), []
    for name in names:
        n, zero = metric.zero_rows(*parts[name])
        first = zero[:FEW].tolist()
        local += [n, int(zero.numel()), *first, *[-1] * (FEW - len(first))]
    head = torch.tensor(local, dtype=torch.int64)
    table = torch.stack(comm.all_gather_sized(head, [head.numel()] * comm.world_size))
    table = table.reshape(comm.world_size, len(names), 2 + FEW)
    return {name: [(int(t[0]), int(t[1]), [int(i) for i in t[2:] if i >= 0]) for t in table[:, p]]
            for p, name in enumerate(names)}


def _by_rank(ranks: list[RankZeros]) -> str:
    return "; ".join(f"rank {r} has {z}, sample ids {few_ids(ids, z)}" for r, (_, z, ids) in enumerate(ranks) if z)


def check_zero_embeddings(census: dict[str, list[RankZeros]], degenerate: bool, source: str) -> str | None:
    """Raises DataError when every embedding of a part is zero; else the warning text when some are and
    ``degenerate`` (cosine or inner-product similarity), else None. ``source`` says where the embeddings come
    from (the config keys to check)."""
    counts = {name: (sum(r[0] for r in ranks), sum(r[1] for r in ranks)) for name, ranks in census.items()}
    for name, (n, z) in counts.items():
        if n and z == n:
            raise DataError(f"every {LABELS.get(name, name)} embedding is zero ({z} of {n}: {_by_rank(census[name])}): "
                            "a zero vector has no direction, its similarity to every item is 0 (cosine is "
                            "undefined), so the neighbours are arbitrary and the metrics at chance; check "
                            f"{source}")
    zero = sum(z for _, z in counts.values())
    if not zero or not degenerate:
        return None
    where = ", ".join(f"{name} {z} of {n} ({_by_rank(census[name])})" for name, (n, z) in counts.items() if z)
    return (f"{zero} of {sum(n for n, _ in counts.values())} embeddings are zero ({where}): a zero vector has no "
            "direction, its similarity to every item is 0, so these queries' neighbours are arbitrary and these "
            f"gallery items rank by id alone; the metrics include them as they are; check {source}")
