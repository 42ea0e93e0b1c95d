"""Sharded exact kNN search: disteval's ``Communicator.sharded_topk`` (gallery stays sharded, queries and k
candidates travel) against a DINOv2-style search (every rank all_gathers the whole gallery, then searches its
own queries) and faiss IndexFlatIP on one process, all measured in one run.

    python benchmarks/knn.py [--world-sizes 2 4] [--gallery 1000000] [--queries 1000] [--dim 256] [--k 20]
                             [--chunk 1000] [--no-fashion] [--smoke]

Data: the shipped Fashion-MNIST CNN's penultimate features (gallery = 60,000 training images, queries = the
10,000 test images, 128-d, L2-normalised; computed once in the driver) and a generated gallery (``--gallery``
x ``--dim``, unit vectors; each rank generates only its own rows, block by block from fixed seeds, so no
process ever holds the whole gallery unless the method gathers it).

Per world size, one group of real ranks (gloo) runs both distributed methods on the same shards (gallery:
contiguous blocks; queries: contiguous blocks) and reports the slowest rank's time, its peak RSS increase over
the call (sampled every 1 ms) and the bytes each rank sent (the Communicator's accounting: every collective's
payload of this rank). faiss runs in the driver on the whole data.

Targets (issue 16): peak memory per rank <= 1/W of the all_gather approach plus the chunk; bytes moved << the
gallery; time not worse than the all_gather approach.

Checks (exit 1 naming the mismatch, never on a time): the sharded search's neighbour ids equal faiss's except
where faiss's own scores of the two candidates differ by <= 1e-6 (float rounding of near-ties; counted and
printed), and equal the all_gather method's ids likewise.

``--smoke``: W = 2, a generated 4,000 x 32 gallery with 200 queries, no Fashion-MNIST (seconds).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

import _summary  # noqa: E402

BLOCK = 65536  # rows per generation block (seeded by block index)


def _rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class PeakRSS:
    """Peak RSS above the level at entry (MiB), sampled every 1 ms in a thread."""

    def __enter__(self):
        self.start = self.peak = _rss_mib()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_mib())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_mib())
        self.mib = self.peak - self.start


def generated_rows(lo: int, hi: int, dim: int, seed: int) -> torch.Tensor:
    """Rows [lo, hi) of the generated unit-vector matrix (float32 [hi - lo, dim]); equal whoever builds them."""
    out = torch.empty((hi - lo, dim), dtype=torch.float32)
    for b in range(lo // BLOCK, -(-hi // BLOCK)):
        a, z = max(lo, b * BLOCK), min(hi, (b + 1) * BLOCK)
        g = torch.Generator().manual_seed(seed * 1_000_003 + b)
        block = torch.randn((BLOCK, dim), generator=g)
        out[a - lo:z - lo] = torch.nn.functional.normalize(block[a - b * BLOCK:z - b * BLOCK], dim=1)
    return out


def bounds(n: int, w: int, r: int) -> tuple[int, int]:
    return n * r // w, n * (r + 1) // w


def _allgather_search(comm, shard, queries, n, k, chunk):
    """DINOv2-style: the whole gallery on every rank (one all_gather), then this rank's queries against it."""
    w = comm.world_size
    full = torch.cat(comm.all_gather_sized(shard, [bounds(n, w, r)[1] - bounds(n, w, r)[0] for r in range(w)]))
    ids = []
    for s in range(0, queries.shape[0], chunk):
        ids.append(torch.topk(queries[s:s + chunk] @ full.t(), k, dim=1).indices)
    return torch.cat(ids) if ids else torch.empty((0, k), dtype=torch.int64)


@record
def rank_main(out_dir: str, cases: list[dict]) -> None:
    """One rank: for each case, both methods on this rank's shards; writes OUT/<case>.rank<r>.npz + json."""
    from disteval.comm import Communicator, RankEnv, destroy_process_group, init_process_group
    from disteval.common.topk import Rows, SearchSpec

    env = RankEnv.from_env()
    init_process_group("gloo", 1800, env)
    torch.set_num_threads(1)
    try:
        for case in cases:
            w, r = env.world_size, env.rank
            g0, g1 = bounds(case["n"], w, r)
            q0, q1 = bounds(case["nq"], w, r)
            if case["kind"] == "generated":
                shard = generated_rows(g0, g1, case["dim"], 1)
                queries = generated_rows(q0, q1, case["dim"], 2)
            else:
                data = np.load(case["path"])
                shard, queries = torch.from_numpy(data["g"][g0:g1]), torch.from_numpy(data["q"][q0:q1])
            spec = SearchSpec(case["k"], "ip", case["chunk"])
            comm = Communicator()
            torch.distributed.barrier()
            with PeakRSS() as mem:
                t = time.perf_counter()
                _, ids = comm.sharded_topk(Rows(shard, torch.arange(g0, g1)), Rows(queries, torch.arange(q0, q1)),
                                           case["nq"], spec)
                secs = time.perf_counter() - t
            row = {"sharded_s": secs, "sharded_mib": mem.mib, "sharded_bytes": comm.bytes}
            base = Communicator()
            torch.distributed.barrier()
            with PeakRSS() as mem:
                t = time.perf_counter()
                ids_ag = _allgather_search(base, shard, queries, case["n"], case["k"], case["chunk"])
                secs = time.perf_counter() - t
            row.update(allgather_s=secs, allgather_mib=mem.mib, allgather_bytes=base.bytes,
                       shard_mib=shard.numel() * 4 / 2**20)
            name = f"{case['name']}_w{w}"
            np.savez(Path(out_dir) / f"{name}.rank{r}.npz", ids=ids.numpy(), ids_ag=ids_ag.numpy())
            (Path(out_dir) / f"{name}.rank{r}.json").write_text(json.dumps(row))
    finally:
        destroy_process_group()


def fashion_features(path: Path) -> None:
    """The shipped CNN's penultimate features of Fashion-MNIST train (gallery) and test (queries), saved."""
    from omegaconf import OmegaConf

    from disteval.data.datasets import build_dataset
    from disteval.models import build_model
    from disteval.tasks.embedding import LayerEmbedder

    net = LayerEmbedder(build_model(OmegaConf.create({"name": "fashion_cnn", "weights": "shipped", "checkpoint": None,
                                                       "num_classes": 10, "kwargs": {}}), 10), "classifier.3").eval()
    out = {}
    for key, split in (("g", "train"), ("q", "test")):
        ds, _ = build_dataset(OmegaConf.create({"name": "fashion_mnist", "root": "/usr/share/datasets/fashion-mnist",
                                                "split": split, "limit": None, "download": False, "sampler": "exact"}))
        x = ds.base.tensors[0]
        with torch.inference_mode():
            f = torch.cat([net.encode_image(x[i:i + 1000]) for i in range(0, x.shape[0], 1000)])
        out[key] = torch.nn.functional.normalize(f, dim=1).numpy()
    np.savez(path, **out)


def faiss_search(g: np.ndarray, q: np.ndarray, k: int) -> tuple[float, float, np.ndarray, np.ndarray]:
    import faiss

    with PeakRSS() as mem:
        t = time.perf_counter()
        index = faiss.IndexFlatIP(g.shape[1])
        index.add(g)
        scores, ids = index.search(q, k)
        secs = time.perf_counter() - t
    return secs, mem.mib, scores, ids


def near_tie_mismatches(ids: np.ndarray, ref_ids: np.ndarray, ref_scores_of) -> tuple[int, int]:
    """(mismatching entries, of which not explained by a near-tie: |score(ours) - score(ref)| > 1e-6 under
    the reference's own scoring)."""
    bad = ids != ref_ids
    if not bad.any():
        return 0, 0
    rows, cols = np.nonzero(bad)
    diff = np.abs(ref_scores_of(rows, ids[rows, cols]) - ref_scores_of(rows, ref_ids[rows, cols]))
    return int(bad.sum()), int((diff > 1e-6).sum())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--gallery", type=int, default=1_000_000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--k", type=int, default=20)
    p.add_argument("--chunk", type=int, default=1000)
    p.add_argument("--no-fashion", action="store_true")
    p.add_argument("--smoke", action="store_true")
    a = p.parse_args()
    if a.smoke:
        a.world_sizes, a.gallery, a.queries, a.dim, a.no_fashion = [2], 4000, 200, 32, True
    from launchers.local import launch
    from rich.console import Console
    from rich.table import Table

    tmp = Path(tempfile.mkdtemp(prefix="knn_bench_"))
    cases = [{"name": "generated", "kind": "generated", "n": a.gallery, "nq": a.queries, "dim": a.dim, "k": a.k,
              "chunk": a.chunk}]
    if not a.no_fashion:
        fashion_features(tmp / "fashion.npz")
        cases.append({"name": "fashion", "kind": "file", "path": str(tmp / "fashion.npz"), "n": 60000, "nq": 10000,
                      "dim": 128, "k": a.k, "chunk": a.chunk})
    for w in a.world_sizes:
        launch(rank_main, (str(tmp), cases), w, str(tmp))
    table = Table(title=f"sharded exact kNN vs all_gather of the gallery vs faiss (k={a.k}, chunk={a.chunk})")
    for col in ("data", "W", "method", "time s", "peak RSS +MiB/rank", "sent MB/rank", "gallery MB",
                "time vs all_gather", "RSS vs all_gather"):
        table.add_column(col)
    failures, rows = [], []
    for case in cases:
        if case["kind"] == "generated":
            g = generated_rows(0, case["n"], case["dim"], 1).numpy()
            q = generated_rows(0, case["nq"], case["dim"], 2).numpy()
        else:
            d = np.load(case["path"])
            g, q = d["g"], d["q"]
        f_s, f_mib, _, f_ids = faiss_search(g, q, case["k"])
        gallery_mb = g.nbytes / 1e6
        table.add_row(case["name"], "1", "faiss IndexFlatIP", f"{f_s:.2f}", f"{f_mib:.0f}", "0", f"{gallery_mb:.0f}", "", "")
        score = lambda rows_, cols_: (q[rows_] * g[cols_]).sum(1)  # noqa: E731
        for w in a.world_sizes:
            name = f"{case['name']}_w{w}"
            stats = [json.loads((tmp / f"{name}.rank{r}.json").read_text()) for r in range(w)]
            ids = np.concatenate([np.load(tmp / f"{name}.rank{r}.npz")["ids"] for r in range(w)])
            ids_ag = np.concatenate([np.load(tmp / f"{name}.rank{r}.npz")["ids_ag"] for r in range(w)])
            for ref_name, ref in (("faiss", f_ids), ("all_gather", ids_ag)):
                n_bad, unexplained = near_tie_mismatches(ids, ref, score)
                print(f"{name}: ids differing from {ref_name}: {n_bad} of {ids.size} ({unexplained} not near-ties)")
                if unexplained:
                    failures.append(f"{name}: {unexplained} neighbour ids differ from {ref_name} beyond near-ties")
            top = {m: max(s[f"{m}_s"] for s in stats) for m in ("sharded", "allgather")}
            mib = {m: max(s[f"{m}_mib"] for s in stats) for m in ("sharded", "allgather")}
            sent = {m: max(s[f"{m}_bytes"] for s in stats) / 1e6 for m in ("sharded", "allgather")}
            table.add_row(case["name"], str(w), "disteval sharded", f"{top['sharded']:.2f}", f"{mib['sharded']:.0f}",
                          f"{sent['sharded']:.1f}", f"{gallery_mb:.0f}", f"{top['sharded'] / top['allgather']:.2f}x",
                          f"{mib['sharded'] / max(mib['allgather'], 1e-9):.2f}x")
            table.add_row(case["name"], str(w), "all_gather gallery (DINOv2)", f"{top['allgather']:.2f}",
                          f"{mib['allgather']:.0f}", f"{sent['allgather']:.1f}", f"{gallery_mb:.0f}", "", "")
            rows.append(_summary.row(f"kNN {case['name']} W={w}: time vs all_gather", f"{top['sharded']:.2f} s",
                                     f"{top['allgather']:.2f} s", top["sharded"] / top["allgather"]))
            rows.append(_summary.row(f"kNN {case['name']} W={w}: peak RSS/rank vs all_gather",
                                     f"{mib['sharded']:.0f} MiB", f"{mib['allgather']:.0f} MiB",
                                     mib["sharded"] / max(mib["allgather"], 1e-9)))
            rows.append(_summary.row(f"kNN {case['name']} W={w}: bytes sent/rank vs gallery", f"{sent['sharded']:.1f} MB",
                                     f"{gallery_mb:.0f} MB", sent["sharded"] / gallery_mb))
    table.caption = ("peak RSS +MiB: above the rank's RSS at the call, over the call alone; sent: this rank's payload "
                     "bytes over all its collectives; time: slowest rank")
    Console(width=160).print(table)
    _summary.write("knn", rows, a.smoke)
    if failures:
        print("CHECK FAILED: " + "; ".join(failures))
        return 1
    print("checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
