"""Exact top-k similarity search with a total order, shared by the comm layer (sharded search) and tests.

Two facts make the sharded search equal to a single-process search bit for bit:

1. **Every similarity is computed by the same call, whatever the shard or chunk.** Scores come from
   ``torch.mm`` of one fixed-shape query tile ``[tile_queries, D]`` by one fixed-shape gallery tile
   ``[tile_gallery, D]``; tiles are aligned to *global* positions (query position ``i`` is always row
   ``i % tile_queries`` of tile ``i // tile_queries``, gallery position ``j`` column ``j % tile_gallery``),
   rows/columns a rank does not hold are zero. A GEMM output element depends only on its own row and
   column, on the shapes and on the element's position in the tile, so the bits of ``score(i, j)`` do not
   depend on W or on the chunk size. (A plain ``queries @ shard.T`` would not guarantee this: BLAS picks
   other kernels for other shapes, e.g. a GEMV for one query, whose reduction order differs.)
2. **Ties have an order.** A score and a gallery position are packed into one int64 *key*
   ``(order-preserving int32 of the float32 score) << 32 | (2^32 - 1 - position)``: larger score first,
   equal scores by smaller global position. Keys are unique, so ``torch.topk`` over keys is fully
   determined, and merging per-shard top-k lists is a top-k over the union of their keys.

Similarities: ``ip`` (inner product; cosine when embeddings are L2-normalised) or ``l2`` (score =
``-(|q|^2 + |g|^2 - 2 q.g)``, squared norms from the same fixed-shape tiles), as faiss IndexFlatIP / L2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Similarity = Literal["ip", "l2"]
LOW_PRECISION = {"bfloat16": (torch.bfloat16, 2.0 ** -8), "float16": (torch.float16, 2.0 ** -11)}  # unit roundoff u
EMPTY = torch.iinfo(torch.int64).min  # the key of "no candidate" (below every real key)
_LOW = (1 << 32) - 1
BLOCK_ELEMENTS = 1 << 22  # scores held at once per top-k step (16 MiB float32 + 32 MiB keys)
PRUNE_RUN = 64  # columns screened by one max in the threshold pruning of ``_merge_block``


@dataclass(frozen=True)
class SearchSpec:
    """How an exact top-k search runs.

    k: neighbours per query (>= 1). similarity: ``ip`` | ``l2``. chunk: queries per round of the sharded
    search (>= 1; memory, not results, depends on it; ``step`` rounds it down to whole query tiles).
    tile_queries / tile_gallery: the fixed GEMM tile (rows of queries, rows of gallery); results are
    bit-identical for any W and chunk at a fixed tile. The default 128 x 1024 tile was measured on one CPU
    thread at D = 128 (2,000 queries x 30,000 items with the top-k: 0.37 s, against 0.51-0.57 s at
    128 x 4096 and 0.55 s for plain GEMMs + ``torch.topk``: the tile's scores stay in cache) and wastes at
    most two tiles of rows at a shard's edges.
    """

    k: int
    similarity: Similarity = "ip"
    chunk: int = 1000
    tile_queries: int = 128
    tile_gallery: int = 1024
    precision: str = "float32"

    @property
    def step(self) -> int:
        """Queries per round: ``chunk`` rounded down to whole query tiles when it holds one (a round that
        starts inside a tile computes the tile's other rows for nothing); ``chunk`` itself when smaller."""
        return self.chunk - self.chunk % self.tile_queries if self.chunk >= self.tile_queries else self.chunk

    def __post_init__(self):
        if self.similarity not in ("ip", "l2"):
            raise ValueError(f"similarity must be 'ip' or 'l2', got {self.similarity!r}")
        if self.precision not in LOW_PRECISION and self.precision != "float32":
            raise ValueError(f"precision must be float32, bfloat16 or float16, got {self.precision!r}")
        if self.precision != "float32" and self.similarity != "ip":
            raise ValueError("a low-precision candidate pass is implemented for similarity='ip' only")
        for name in ("k", "chunk", "tile_queries", "tile_gallery"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"SearchSpec.{name} must be >= 1, got {getattr(self, name)}")


def score_keys(scores: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """int64 keys of float32 ``scores`` [..., n] at gallery ``positions`` (int64, broadcastable, each in
    [0, 2^32)): larger key = larger score, equal scores -> smaller position. -0.0 counts as +0.0."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    return (ordered << 32) | (_LOW - positions.to(torch.int64))


def decode_keys(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``score_keys``: (scores float32, positions int64) of int64 ``keys``; ``EMPTY`` keys give
    position -1 and score NaN."""
    high = (keys >> 32).to(torch.int32)
    bits = torch.where(high >= 0, high, high ^ 0x7FFFFFFF)
    scores = bits.view(torch.float32).clone()
    positions = _LOW - (keys & _LOW)
    empty = keys == EMPTY
    scores[empty] = float("nan")
    positions[empty] = -1
    return scores, positions


def merge_keys(parts: list[torch.Tensor] | torch.Tensor, k: int) -> torch.Tensor:
    """The exact top-k of the union of candidate key lists ``parts`` (each int64 [n, k_i], same n):
    int64 [n, k] in descending key order (``EMPTY`` pads rows with fewer than k candidates)."""
    keys = torch.cat(list(parts), dim=1) if not isinstance(parts, torch.Tensor) else parts
    if keys.shape[1] < k:
        keys = torch.cat([keys, torch.full((keys.shape[0], k - keys.shape[1]), EMPTY, dtype=torch.int64)], 1)
    return torch.topk(keys, k, dim=1, largest=True, sorted=True).values


@dataclass(frozen=True)
class Rows:
    """A rank's rows of a set (gallery or queries): ``embeddings`` float32 [n, D] and their global
    ``positions`` int64 [n] in the set."""

    embeddings: torch.Tensor
    positions: torch.Tensor


class GalleryTiles:
    """A rank's gallery rows laid out in global tiles: tile t holds positions [t*T, (t+1)*T) (T =
    ``spec.tile_gallery``), absent positions zero and masked. ``embeddings`` float32 [n, D], ``positions``
    int64 [n] (distinct, global). Memory: (n + 2T) x D x 4 bytes when the positions are contiguous."""

    def __init__(self, embeddings: torch.Tensor, positions: torch.Tensor, spec: SearchSpec):
        t = spec.tile_gallery
        self.spec, self.dim = spec, int(embeddings.shape[1]) if embeddings.ndim == 2 else 0
        self.first_tile = int(positions.min()) // t if positions.numel() else 0
        last = int(positions.max()) // t if positions.numel() else -1
        self.num_tiles = last - self.first_tile + 1
        rows = self.num_tiles * t
        self.data = torch.zeros((rows, self.dim), dtype=torch.float32)
        self.present = torch.zeros(rows, dtype=torch.bool)
        local = positions.to(torch.int64) - self.first_tile * t
        self.data[local] = embeddings.float()
        self.present[local] = True
        self.norms = _tile_norms(self.data, t) if spec.similarity == "l2" else None

    def tile(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(embeddings [T, D], global positions [T], present mask [T], squared norms [T] or None) of the
        rank's i-th tile."""
        t = self.spec.tile_gallery
        sl = slice(i * t, (i + 1) * t)
        pos = torch.arange((self.first_tile + i) * t, (self.first_tile + i + 1) * t, dtype=torch.int64)
        return self.data[sl], pos, self.present[sl], None if self.norms is None else self.norms[sl]


def _tile_norms(data: torch.Tensor, tile: int) -> torch.Tensor:
    """Squared L2 norms of ``data`` [m*tile, D], one fixed-shape tile at a time."""
    return torch.cat([(blk * blk).sum(1) for blk in data.split(tile)]) if data.shape[0] else data.new_zeros(0)


def local_topk(queries: torch.Tensor, query_positions: torch.Tensor, gallery: GalleryTiles) -> torch.Tensor:
    """Top-k keys of ``queries`` float32 [m, D] (global query ``query_positions`` int64 [m], any order)
    against the rank's ``gallery``: int64 [m, k] in descending order, ``EMPTY`` where the rank holds fewer
    than k items. Working memory: scores and keys of max(BLOCK_ELEMENTS, m' x tile_gallery) entries (12 bytes
    each) plus m' x k x 16 bytes of running top-k, m' = m rounded out to whole query tiles."""
    spec = gallery.spec
    tq, k = spec.tile_queries, spec.k
    m = int(queries.shape[0])
    if m == 0:
        return torch.empty((0, k), dtype=torch.int64)
    first = int(query_positions.min()) // tq
    n_tiles = int(query_positions.max()) // tq - first + 1
    padded = torch.zeros((n_tiles * tq, gallery.dim), dtype=torch.float32)
    rows = query_positions.to(torch.int64) - first * tq
    padded[rows] = queries.float()
    qnorms = _tile_norms(padded, tq) if spec.similarity == "l2" else None
    best = torch.full((padded.shape[0], k), EMPTY, dtype=torch.int64)
    padding = torch.ones(padded.shape[0], dtype=torch.bool)
    padding[rows] = False
    tg = spec.tile_gallery
    group = max(1, BLOCK_ELEMENTS // (padded.shape[0] * tg))  # gallery tiles scored before one top-k
    q_tiles = padded.split(tq)
    todo = list(range(gallery.num_tiles)) if spec.precision == "float32" else candidate_tiles(padded[rows], gallery)
    buffer = None
    for g0 in range(0, len(todo), group):
        tiles = [gallery.tile(g) for g in todo[g0:g0 + group]]
        tiles = [t for t in tiles if bool(t[2].any())]
        if not tiles:
            continue
        width = len(tiles) * tg
        if buffer is None or buffer.numel() < padded.shape[0] * width:  # reused: fresh pages cost more than the GEMM
            buffer = torch.empty(padded.shape[0] * width, dtype=torch.float32)
        scores = buffer[:padded.shape[0] * width].view(padded.shape[0], width)
        for j, (g_data, _, _, _) in enumerate(tiles):
            g_t = g_data.t()
            for i, q in enumerate(q_tiles):
                torch.mm(q, g_t, out=scores[i * tq:(i + 1) * tq, j * tg:(j + 1) * tg])
        if qnorms is not None:
            g_norms = torch.cat([t[3] for t in tiles])
            scores = -((qnorms[:, None] + g_norms[None, :]) - 2.0 * scores)
        best = _merge_block(best, scores, torch.cat([t[1] for t in tiles]), torch.cat([t[2] for t in tiles]), k,
                            padding)
    return best[rows]


def _merge_block(best: torch.Tensor, scores: torch.Tensor, positions: torch.Tensor, present: torch.Tensor,
                 k: int, padding: torch.Tensor) -> torch.Tensor:
    """The top-k keys of ``best`` (int64 [R, k], descending; ``EMPTY`` where fewer) united with a score block
    (float32 [R, C] at gallery ``positions`` [C], absent columns ``~present``): the same result as a top-k over
    the whole block, except in the rows marked by ``padding`` (bool [R]: the zero rows that fill the query
    tiles, whose keys are never read), which are skipped.

    Threshold pruning: a column can enter row r only if its score is >= a lower bound t_r of the row's k-th
    best score after the merge: the score of r's k-th key when ``best`` holds k (a larger key has a score at
    least as large), else the k-th largest of the block's run maxima (k distinct columns reach it). NaN scores
    (non-finite embeddings, which ``EmbeddingMetrics`` refuses) always pass. Columns are screened by the max of
    each run of ``PRUNE_RUN`` columns (a vectorised ``amax``, about 1/15 of a top-k's cost); only runs that
    reach t_r are compared column by column and only the passing columns get keys. Falls back to a top-k of the
    whole block when C is not a multiple of the run, when a row without k keys meets a block of fewer than k
    runs, or when more than 4k runs per row pass (many ties)."""
    r, c = scores.shape
    if c % PRUNE_RUN:
        return merge_keys([best, _block_topk(scores, positions, present, k)], k)
    all_present = bool(present.all())
    if not all_present:
        scores.masked_fill_(~present[None, :], float("-inf"))
    runs = scores.view(r, c // PRUNE_RUN, PRUNE_RUN)
    run_max = runs.amax(2)
    kth = decode_keys(best[:, -1])[0]
    short = (best[:, -1] == EMPTY) & ~padding
    if bool(short.any()):
        if run_max.shape[1] < k:
            return merge_keys([best, _block_topk(scores, positions, present, k)], k)
        kth = torch.where(short, torch.topk(run_max, k, dim=1).values[:, -1], kth)
    kth.masked_fill_(padding, float("inf"))
    row, run = torch.lt(run_max, kth[:, None]).logical_not_().nonzero(as_tuple=True)
    if row.numel() == 0:
        return best
    if row.numel() > 4 * k * r:
        return merge_keys([best, _block_topk(scores, positions, present, k)], k)
    # index_select of whole runs: several times faster than advanced indexing of (row, column) pairs
    values = runs.view(-1, PRUNE_RUN).index_select(0, row * runs.shape[1] + run)  # [n, PRUNE_RUN]
    passing = torch.lt(values, kth.index_select(0, row)[:, None]).logical_not_()
    if not all_present:
        passing &= present.view(-1, PRUNE_RUN).index_select(0, run)
    i, j = passing.nonzero(as_tuple=True)
    rows, cols = row.index_select(0, i), run.index_select(0, i) * PRUNE_RUN + j
    counts = torch.bincount(rows, minlength=r)
    slot = torch.arange(rows.numel()) - (torch.cumsum(counts, 0) - counts).index_select(0, rows)
    found = torch.full((r, max(1, int(counts.max()))), EMPTY, dtype=torch.int64)
    found[rows, slot] = score_keys(values.view(-1).index_select(0, i * PRUNE_RUN + j), positions.index_select(0, cols))
    return merge_keys([best, found], k)


def rounding_bound(precision: str, dim: int) -> float:
    """c such that |s_lp - q.g| <= c |q| |g| for a low-precision inner product: q and g rounded to
    ``precision`` (unit roundoff u: |q'_d - q_d| <= u |q_d|, so |q'.g' - q.g| <= (2u + u^2) sum |q_d g_d| <=
    (2u + u^2) |q| |g| by Cauchy-Schwarz), the products summed in float32 (error <= gamma_D sum |q'_d g'_d|,
    gamma_D = D 2^-24 / (1 - D 2^-24); Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5) and the
    result rounded to ``precision`` (u |result|). Assumes float32 accumulation (oneDNN on CPU; cuBLAS with
    reduced-precision reductions disabled)."""
    u = LOW_PRECISION[precision][1]
    gamma = dim * 2.0 ** -24 / (1 - dim * 2.0 ** -24)
    inputs = 2 * u + u * u
    accumulated = inputs + gamma * (1 + u) ** 2
    return accumulated + u * (1 + accumulated)


def candidate_tiles(queries: torch.Tensor, gallery: GalleryTiles) -> list[int]:
    """The rank's gallery tiles that can hold one of the exact top-k of ``queries`` float32 [m, D], found in
    ``gallery.spec.precision``: with B_i = c |q_i| max_j |g_j| (``rounding_bound``) and t_i the k-th largest
    low-precision score of query i, every exact top-k item j has s_lp(i, j) >= t_i - 2 B_i (its exact score is
    >= the exact k-th score, which is >= t_i - B_i). Tiles where no query reaches its threshold are skipped;
    the others are re-scored in float32 (same tiles, same bits), so the top-k stays exact. Returns tile
    indices in increasing order (all tiles when a query has fewer than k items here)."""
    spec = gallery.spec
    dtype = LOW_PRECISION[spec.precision][0]
    k = spec.k
    if queries.shape[0] == 0 or gallery.num_tiles == 0:
        return []
    q_lp = queries.to(dtype)
    kth = torch.full((queries.shape[0], k), float("-inf"))
    row_max = torch.full((queries.shape[0], gallery.num_tiles), float("-inf"))
    g_max = 0.0
    for g in range(gallery.num_tiles):
        g_data, _, present, _ = gallery.tile(g)
        if not bool(present.any()):
            continue
        g_max = max(g_max, float(g_data.norm(dim=1).max()))
        lp = (q_lp @ g_data.to(dtype).t()).float()
        if not bool(torch.isfinite(lp).all()):  # out of the format's range: the bound does not hold
            return list(range(gallery.num_tiles))
        lp.masked_fill_(~present[None, :], float("-inf"))
        row_max[:, g] = lp.max(1).values
        kth = torch.topk(torch.cat([kth, lp], 1), k, dim=1).values
    margin = 2 * rounding_bound(spec.precision, gallery.dim) * queries.norm(dim=1) * g_max
    threshold = kth[:, -1] - margin  # -inf where fewer than k items: every tile
    need = (row_max >= threshold[:, None]).any(0)
    return torch.nonzero(need).flatten().tolist()


def _block_topk(scores: torch.Tensor, positions: torch.Tensor, present: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k keys of each row of a score block (float32 [R, C], columns at gallery ``positions`` [C], absent
    columns ``~present``): a float top-(k+1) finds the k-th score; where the (k+1)-th differs from it, the k
    columns found are exactly the top-k set (only their keys are built); rows with a tie at the k-th score
    get keys for the whole row. Returns int64 [R, min(k, C)] (``EMPTY`` for absent columns)."""
    if not bool(present.all()):
        scores.masked_fill_(~present[None, :], float("-inf"))
    kk = min(k, scores.shape[1])
    vals, idx = torch.topk(scores, min(kk + 1, scores.shape[1]), dim=1)
    # a tie at the k-th score: the (k+1)-th largest score equals the k-th
    tied = torch.nonzero(vals[:, kk] == vals[:, kk - 1]).flatten() if vals.shape[1] > kk else vals.new_zeros(0, dtype=torch.int64)
    vals, idx = vals[:, :kk], idx[:, :kk]
    keys = score_keys(vals, positions[idx])
    keys.masked_fill_(vals == float("-inf"), EMPTY)
    if tied.numel():
        full = score_keys(scores[tied], positions[None, :]).masked_fill_(~present[None, :], EMPTY)
        keys[tied] = torch.topk(full, kk, dim=1).values
    return keys


def exact_search(queries: torch.Tensor, gallery: torch.Tensor, spec: SearchSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-process exact top-k: for ``queries`` float32 [m, D] (positions 0..m-1) over ``gallery``
    float32 [n, D] (positions 0..n-1): (scores float32 [m, k], gallery positions int64 [m, k]) by
    descending score, ties by smaller position. The reference the sharded search must equal bit for bit.
    Raises ValueError if k > n."""
    if spec.k > gallery.shape[0]:
        raise ValueError(f"k={spec.k} exceeds the gallery size {gallery.shape[0]}")
    tiles = GalleryTiles(gallery, torch.arange(gallery.shape[0]), spec)
    keys = [local_topk(queries[s:s + spec.step], torch.arange(s, min(s + spec.step, queries.shape[0])), tiles)
            for s in range(0, queries.shape[0], spec.step)]
    return decode_keys(torch.cat(keys) if keys else torch.empty((0, spec.k), dtype=torch.int64))
