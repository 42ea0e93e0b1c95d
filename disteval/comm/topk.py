"""Sharded exact top-k search: every rank keeps its gallery shard; queries travel, the gallery never does.

For each chunk of ``spec.step`` global query positions (``spec.chunk`` rounded down to whole query tiles; the
same chunks on every rank):

1. the chunk's query embeddings reach every rank (each rank sends the ones it embedded, with their positions;
   the per-rank counts of every chunk were exchanged once up front): one ``all_gather`` when every rank holds
   as many, else one broadcast from each rank that holds some (``Communicator.all_gather_uneven``: no
   padding; shards are contiguous, so a chunk usually lies on one rank);
2. every rank scores the chunk against its shard (``disteval.common.topk.local_topk``: fixed-shape,
   globally aligned GEMM tiles, so scores are bit-identical to a single-process search) and keeps its local
   top-k as int64 keys (score, then smaller global gallery position);
3. each query's [k] candidate keys go to the rank that holds it (one gather per holding rank; one
   ``all_gather`` when every rank holds some), which merges them: the top-k of their union is the exact
   global top-k.

Collectives: 1 + 2 x ceil(num_queries / step) when each chunk lies on one rank, at most 1 + 2 W per chunk,
each under the process group's timeout (``Communicator``). Bytes this rank sends: its own queries
(n_q,r x (D + 1) x 4) plus num_queries x k x 8 of candidate keys; the gallery (N x D x 4) never moves.
Peak memory per rank: gallery shard in tiles ((N/W + 2 tile_gallery) x D x 4) + one chunk's queries
(chunk x (D + 1) x 4) + candidates (W x chunk x k x 8) + the scoring block of ``local_topk``.
"""
from __future__ import annotations

from typing import Any

import torch

from disteval.common.topk import GalleryTiles, Rows, SearchSpec, decode_keys, local_topk, merge_keys


def sharded_topk(comm: Any, gallery_rows: Rows, query_rows: Rows, num_queries: int,
                 spec: SearchSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k over a gallery sharded across the ranks of ``comm`` (a ``Communicator``).

    Args:
        gallery_rows: this rank's gallery rows (float32 [n_g, D]) and their global gallery positions (int64
            [n_g], distinct across ranks).
        query_rows: this rank's queries (float32 [n_q, D]) and their global query positions in
            [0, num_queries) (int64 [n_q]; each position on exactly one rank).
        num_queries: the global number of queries (equal on every rank). spec: k, similarity, chunk, tiles.

    Returns (scores float32 [n_q, k], gallery positions int64 [n_q, k]) for this rank's queries in the order
    given, by descending score with ties by smaller gallery position: bit-identical to
    ``disteval.common.topk.exact_search`` on the whole data for any world size and chunk.
    Raises ValueError (on every rank: all see the same counts) when a chunk's query positions are not
    covered exactly once, or k exceeds the gallery size."""
    gallery, gallery_positions = gallery_rows.embeddings, gallery_rows.positions
    queries, query_positions = query_rows.embeddings, query_rows.positions
    dim = int(queries.shape[1]) if queries.ndim == 2 and queries.shape[0] else int(gallery.shape[1]) if gallery.ndim == 2 else 0
    step = spec.step
    n_chunks = -(-int(num_queries) // step)
    qpos = query_positions.to(torch.int64)
    order = torch.argsort(qpos)
    qpos_sorted, q_sorted = qpos[order], queries[order].float().contiguous()
    counts = torch.bincount(qpos_sorted // step, minlength=n_chunks).to(torch.int64)[:n_chunks]
    head = torch.cat([torch.tensor([int(gallery.shape[0]), dim], dtype=torch.int64), counts])
    table = torch.stack(comm.all_gather_sized(head, [head.numel()] * comm.world_size))  # [W, 2 + n_chunks]
    n_gallery, dims = int(table[:, 0].sum()), set(int(d) for d in table[:, 1] if int(d) > 0)
    if len(dims) > 1:
        raise ValueError(f"ranks disagree on the embedding dimension: {table[:, 1].tolist()}")
    if spec.k > n_gallery:
        raise ValueError(f"k={spec.k} exceeds the gallery size {n_gallery}")
    tiles = GalleryTiles(gallery, gallery_positions, spec)
    out = torch.empty((qpos.numel(), spec.k), dtype=torch.int64)
    start = 0
    for c in range(n_chunks):
        lo, hi = c * step, min((c + 1) * step, int(num_queries))
        mine = int(counts[c])
        rows = table[:, 2 + c].tolist()
        if sum(rows) != hi - lo:
            raise ValueError(f"query positions [{lo}, {hi}) are held {sum(rows)} times in all (per rank {rows}): "
                             "each query must be on exactly one rank")
        payload = torch.cat([q_sorted[start:start + mine].view(torch.int32),
                             qpos_sorted[start:start + mine, None].to(torch.int32)], 1)
        got = torch.cat(comm.all_gather_uneven(payload, rows))
        pos = got[:, dim].to(torch.int64)
        if not torch.equal(torch.sort(pos).values, torch.arange(lo, hi)):
            raise ValueError(f"query positions [{lo}, {hi}) are not covered exactly once")
        keys = local_topk(got[:, :dim].contiguous().view(torch.float32), pos, tiles)  # [hi - lo] in `got` order
        out[start:start + mine] = _merge_at_owners(comm, keys, rows, spec.k)
        start += mine
    result = torch.empty_like(out)
    result[order] = out
    return decode_keys(result)


def _merge_at_owners(comm: Any, keys: torch.Tensor, rows: list[int], k: int) -> torch.Tensor:
    """This rank's rows of the global top-k: ``keys`` int64 [sum(rows), k] are every rank's candidates for
    the round's queries in the gathered order (rank r's queries at rows [sum(rows[:r]), sum(rows[:r + 1])),
    the same order on every rank); each query's candidates go to the rank that holds it only: one gather per
    holding rank, or one all_gather when every rank holds some. Returns int64 [rows[rank], k]."""
    offsets = [sum(rows[:r]) for r in range(len(rows) + 1)]
    me = comm.rank
    if all(rows):
        parts = comm.all_gather_sized(keys, [keys.shape[0]] * comm.world_size)
        return merge_keys([p[offsets[me]:offsets[me + 1]] for p in parts], k)
    merged = keys.new_empty((0, k))
    for owner, n in enumerate(rows):
        if n:
            parts = comm.gather_sized(keys[offsets[owner]:offsets[owner + 1]], [n] * comm.world_size, owner)
            if owner == me:
                merged = merge_keys(parts, k)
    return merged
