"""Rank functions for tests/test_comm_dist.py."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
from disteval.metrics.evaluator import Evaluator
from disteval.rank.sync import SyncPolicy, synchronise
from disteval.metrics import MetricCollection, RankingMetrics

SCORE_ROWS = (700, 0, 451)  # ranking samples per rank (rank 1 holds none)
SCORE_CLASSES = 6


def rank_floats(r: int, rows: int, cols: int = 3) -> torch.Tensor:
    """float64 [rows, cols] of rank r, values spanning many binades (deterministic)."""
    g = torch.Generator().manual_seed(100 + r)
    return torch.randn(rows, cols, generator=g, dtype=torch.float64) * torch.exp(
        4 * torch.randn(rows, cols, generator=g, dtype=torch.float64))


def rank_logits(r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits float64 [SCORE_ROWS[r], 6] (rounded to 0.25: ties) and labels of rank r's ranking shard."""
    g = torch.Generator().manual_seed(7 + r)
    n = SCORE_ROWS[r]
    logits = torch.round(torch.randn(n, SCORE_CLASSES, generator=g, dtype=torch.float64) * 8) / 4
    return logits, torch.randint(0, SCORE_CLASSES, (n,), generator=g)


def _bits(t: torch.Tensor) -> list:
    """Exact bit pattern as a JSON list (floats bit-cast to int64)."""
    return t.view(torch.int64).tolist() if t.dtype == torch.float64 else t.tolist()


def _policy_cases(r: int, res: dict) -> None:
    """Chunked async path vs one-call path, reduce_scatter, compression: each rank records what it got."""
    plain = Communicator(async_threshold_bytes=None)
    chunked = Communicator(async_threshold_bytes=100, chunk_bytes=64, max_in_flight=2)
    rows = (37, 5, 0)[r]  # uneven, one rank empty
    x = rank_floats(r, rows)
    a, b = plain.all_gather_variable(x), chunked.all_gather_variable(x)
    res["chunked_all_gather_equal"] = all(torch.equal(p.view(torch.int64), q.view(torch.int64)) for p, q in zip(a, b))
    res["chunked_all_gather"] = [_bits(t) for t in b]
    a, b = plain.gather_variable(x, dst=2), chunked.gather_variable(x, dst=2)
    res["chunked_gather_equal"] = (a is None and b is None) if r != 2 else all(
        torch.equal(p.view(torch.int64), q.view(torch.int64)) for p, q in zip(a, b))
    y = rank_floats(r, 50, 4)
    n_chunked = chunked.chunked
    s1, s2 = plain.all_reduce_(y.clone()), chunked.all_reduce_(y.clone())
    res["float_all_reduce_not_chunked"] = chunked.chunked == n_chunked and torch.equal(s1.view(torch.int64),
                                                                                        s2.view(torch.int64))
    res["all_reduce"] = _bits(s2)
    counts = torch.arange(200, dtype=torch.int64) * (r + 1) + 10 ** 15  # exact in any order: chunked
    s1, s2 = plain.all_reduce_(counts.clone()), chunked.all_reduce_(counts.clone())
    res["chunked_all_reduce_equal"] = torch.equal(s1, s2) and chunked.chunked == n_chunked + 1
    res["int_all_reduce"] = s2.tolist()
    res["reduce_scatter"] = {}
    for shape in ((7, 3), (2, 5), (0, 4)):  # uneven rows, fewer rows than ranks, no rows
        t = torch.arange(shape[0] * shape[1], dtype=torch.int64).reshape(shape) * (r + 1) + r
        (p, a0, b0), (q, a1, b1) = plain.reduce_scatter_rows(t), chunked.reduce_scatter_rows(t)
        res["reduce_scatter"][str(shape)] = {"block": q.tolist(), "bounds": [a1, b1],
                                             "equal": torch.equal(p, q) and (a0, b0) == (a1, b1)}
    f = rank_floats(r, 11, 5)  # float rows: summed in rank order on every path, so chunking keeps the bits
    (p, _, _), (q, _, _) = plain.reduce_scatter_rows(f), chunked.reduce_scatter_rows(f)
    res["float_reduce_scatter_equal"] = torch.equal(p.view(torch.int64), q.view(torch.int64))
    res["float_reduce_scatter"] = _bits(q)
    res["chunked_count"], res["plain_chunked_count"] = chunked.chunked, plain.chunked
    # progress pieces (communication.progress_bytes): 8 pieces, each reported, the same bits as one call
    pieces = Communicator(async_threshold_bytes=None)
    pieces.progress_bytes = 64
    seen, announced = [], []
    pieces.on_progress = lambda op, done, total: seen.append((op, done, total))
    pieces.on_collective = lambda op, nbytes, info: announced.append((op, nbytes, info))
    big = rank_floats(r, 40)
    a, b = plain.all_gather_variable(big), pieces.all_gather_variable(big, name="scores", compressible=True)
    res["progress_equal"] = all(torch.equal(p.view(torch.int64), q.view(torch.int64)) for p, q in zip(a, b))
    res["progress_seen"] = seen
    res["progress_announced"] = [(op, n, info) for op, n, info in announced if op == "all_gather"]
    res["chunked_by_op"] = dict(chunked.by_op)
    # lossless: exact round trips, smaller wire
    g = torch.Generator().manual_seed(r)
    payloads = {"labels_0_999": torch.randint(0, 1000, ((4, 9, 0)[r],), generator=g),
                "ids_offset": torch.randint(0, 200, ((5, 0, 3)[r], 2), generator=g) - 5 + 10 ** 12,
                "huge_span": torch.tensor([[(-2) ** 40 * (r + 1)]] * (r + 1), dtype=torch.int64),
                "flags": torch.rand(((11, 3, 0)[r], 5), generator=g) > 0.5,
                "f32_exact": torch.rand((3, 2), generator=g).double(),
                "f64": torch.rand((3, 2), generator=g, dtype=torch.float64)}
    lossless = Communicator()
    res["lossless"] = {}
    for name, t in payloads.items():
        got = lossless.all_gather_variable(t, compression="lossless", name=name)
        want = plain.all_gather_variable(t)
        res["lossless"][name] = {"exact": all(torch.equal(p, q) and p.dtype == q.dtype for p, q in zip(got, want)),
                                 **lossless.compression[name]}
    # lossy: only for compressible payloads; reported error = measured on the real payload
    res["lossy"] = {}
    for mode in ("fp16", "bf16"):
        comm = Communicator()
        got = comm.all_gather_variable(x, compression=mode, compressible=True, name="x")
        exact = comm.all_gather_variable(x, compression=mode, compressible=False, name="exact")
        res["lossy"][mode] = {"gathered": [t.tolist() for t in got], "stats": comm.compression["x"],
                              "exact_stats": comm.compression["exact"],
                              "exact_unchanged": all(torch.equal(p.view(torch.int64), q.view(torch.int64))
                                                     for p, q in zip(exact, plain.all_gather_variable(x)))}
    # AUROC/AP through the engine's synchronise with fp16 scores (opt-in) and exactly
    res["auroc"] = {}
    for mode in ("none", "fp16"):
        logits, labels = rank_logits(r)
        metric = MetricCollection({"ranking": RankingMetrics(SCORE_CLASSES)})
        metric.update(logits, labels, torch.arange(labels.numel()))
        comm = Communicator()
        synchronise(Evaluator(metric), comm, {}, SyncPolicy(compression=mode))
        out = metric.compute()
        scores = metric.metrics["ranking"]._states["scores"]
        res["auroc"][mode] = {"auroc_macro": out["auroc_macro"], "ap_macro": out["ap_macro"],
                              "scores": scores.tolist(), "comm": comm.compression}


def _catch(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the message is the result under test
        return f"{exc}"


@record
def comm_worker(out_dir: str) -> None:
    env = RankEnv.from_env()
    init_process_group("gloo", 2.0, env)
    comm, r = Communicator(), env.rank
    res = {}
    rows = torch.tensor([[10 * r + i, -i] for i in range(2 - r)], dtype=torch.int64).reshape(-1, 2)
    res["all_gather"] = [t.tolist() for t in comm.all_gather_variable(rows)]
    got = comm.gather_variable(rows, dst=1)
    res["gather_to_1"] = None if got is None else [t.tolist() for t in got]
    res["float_rows"] = [t.tolist() for t in comm.all_gather_variable(torch.full((3 * (r + 1),), 0.5))]
    bad_dtype = rows.float() if r == 1 else rows
    res["dtype_mismatch"] = _catch(lambda: comm.all_gather_variable(bad_dtype))
    bad_shape = torch.zeros((1, 3 if r == 1 else 2), dtype=torch.int64)
    res["shape_mismatch"] = _catch(lambda: comm.all_gather_variable(bad_shape))
    comm.set_timeout(60)  # the policy cases compute between collectives; 2 s is for the timeout cases below
    _policy_cases(r, res)
    comm.set_timeout(2)
    res["meta"] = comm.broadcast_json({"run_id": "run-from-rank0", "seed": 1234, "t": time.time()}
                                      if r == 0 else None)
    comm.set_timeout(30)
    if r == 2:
        time.sleep(4)
    t = torch.ones(1)
    dist.all_reduce(t)
    res["slow_with_sync_timeout"] = int(t.item())
    comm.set_timeout(2)
    if r == 2:
        time.sleep(4)
    res["slow_without"] = _catch(lambda: dist.all_reduce(torch.ones(1)))
    Path(out_dir, f"rank{r}.json").write_text(json.dumps(res))
    destroy_process_group()
