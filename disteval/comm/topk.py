"""Sharded exact top-k search: every rank keeps its gallery shard; queries travel, the gallery never does.

For each chunk of ``spec.step`` global query positions (``spec.chunk`` rounded down to whole query tiles; the
same chunks on every rank):

1. one ``all_gather`` of the chunk's query embeddings (each rank sends the ones it embedded, with their
   positions; the per-rank counts of every chunk were exchanged once up front);
2. every rank scores the chunk against its shard (``disteval.common.topk.local_topk``: fixed-shape,
   globally aligned GEMM tiles, so scores are bit-identical to a single-process search) and keeps its local
   top-k as int64 keys (score, then smaller global gallery position);
3. one ``all_gather`` of the [chunk, k] keys; the top-k of their union is the exact global top-k.

Collectives: 1 + 2 x ceil(num_queries / step), each under the process group's timeout (``Communicator``).
Bytes this rank sends (before the ring's forwarding): its own queries (n_q,r x (D + 1) x 4) plus
num_queries x k x 8 of candidate keys; the gallery (N x D x 4) never moves.
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
        got = torch.cat(comm.all_gather_sized(payload, rows))
        pos = got[:, dim].to(torch.int64)
        if not torch.equal(torch.sort(pos).values, torch.arange(lo, hi)):
            raise ValueError(f"query positions [{lo}, {hi}) are not covered exactly once")
        keys = local_topk(got[:, :dim].contiguous().view(torch.float32), pos, tiles)  # [hi - lo] in `got` order
        by_pos = torch.empty_like(keys)
        by_pos[pos - lo] = keys
        merged = merge_keys(comm.all_gather_sized(by_pos, [hi - lo] * comm.world_size), spec.k)
        out[start:start + mine] = merged[qpos_sorted[start:start + mine] - lo]
        start += mine
    result = torch.empty_like(out)
    result[order] = out
    return decode_keys(result)
