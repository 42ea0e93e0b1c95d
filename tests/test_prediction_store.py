"""The prediction store (``eval.save_predictions=true``) and re-scoring without the model
(``python -m disteval.rescore``), with real ranks: stores written at W=1, 2, 3 re-score to metrics ``==`` the
writer's; the stored top-k agrees with the stored logits (numpy) and DuckDB reads the files as they are; a
missing or corrupt rank file is named; a store of other data is refused."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_results, run_disteval
from recorded_runs import diagnostics_cli

FASHION_ROOT = "/usr/share/datasets/fashion-mnist"
pytestmark = pytest.mark.skipif(not os.path.isdir(FASHION_ROOT), reason="Debian package dataset-fashion-mnist "
                                "not installed (.ci/run installs it)")
JOB = ("+experiment=fashion_mnist", "eval.metrics=[classification,ranking]", "eval.save_predictions=true",
       "eval.predictions.logits=true", "eval.progress=false")
N = 3000  # the first 3,000 test images (CI time; every check is the same at 10,000)


def _rescore(store: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "disteval.rescore", str(store), f"hydra.run.dir={run_dir}",
                           "eval.progress=false", *overrides], capture_output=True, text=True, timeout=300,
                          cwd=run_dir.parent)


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """Fashion-MNIST's first N images (classification + ranking) written with logits at W=1, 2, 3: {W: run_dir}."""
    base = tmp_path_factory.mktemp("stores")
    out = {}
    for w in (1, 2, 3):
        proc = run_disteval(*JOB, f"data.limit={N}", f"dist.world_size={w}", run_dir=base / f"w{w}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[w] = base / f"w{w}"
    return out


def test_stores_rescore_to_the_writers_bits_at_every_world_size(stores, tmp_path):
    want = load_results(stores[1])["metrics"]
    for w, run_dir in stores.items():
        assert load_results(run_dir)["metrics"] == want  # bitwise mode: the writers agree
        manifest = json.loads((run_dir / "predictions" / "_manifest.json").read_text())
        assert [f["rank"] for f in manifest["files"]] == list(range(w))
        assert sum(f["rows"] for f in manifest["files"]) == N == manifest["data"]["num_samples"]
        stored = load_results(run_dir)["predictions"]
        assert (stored["manifest"], stored["rows"]) == ("predictions/_manifest.json", N) and stored["seconds"] > 0
        rescore_w = {1: 3, 2: 1, 3: 2}[w]  # another world size than the writer's
        proc = _rescore(run_dir, tmp_path / f"r{w}", f"dist.world_size={rescore_w}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = load_results(tmp_path / f"r{w}")
        assert res["metrics"] == want and res["world_size"] == rescore_w and res["task"]["name"] == "prediction_replay"


def test_stored_topk_agrees_with_the_stored_logits_and_duckdb_reads_it(stores):
    import duckdb
    import pyarrow.parquet as pq

    store = stores[3] / "predictions"
    table = pq.read_table(store).sort_by("sample_id")
    logits = np.stack(table.column("logits").to_numpy(zero_copy_only=False)).astype(np.float64)
    ids = np.stack(table.column("topk_ids").to_numpy(zero_copy_only=False))
    scores = np.stack(table.column("topk_scores").to_numpy(zero_copy_only=False))
    assert np.array_equal(table.column("sample_id").to_numpy(), np.arange(N))
    order = np.argsort(-logits, axis=1, kind="stable")[:, :5]
    assert np.array_equal(ids, order)
    soft = np.exp(logits - logits.max(1, keepdims=True))
    soft /= soft.sum(1, keepdims=True)
    assert np.allclose(scores, np.take_along_axis(soft, order, 1), rtol=1e-5, atol=1e-7)
    top1 = duckdb.sql(f"SELECT avg(CAST(topk_ids[1] = target AS DOUBLE)) FROM '{store}/*.parquet'").fetchall()[0][0]
    assert top1 == load_results(stores[3])["metrics"]["top1"]


def test_damaged_stores_and_other_data_are_refused(stores, tmp_path):
    import shutil

    run_dir = tmp_path / "copy"
    shutil.copytree(stores[2], run_dir)
    other = _rescore(run_dir, tmp_path / "digits", "+experiment=digits")
    assert other.returncode == 2 and "name: the store has 'fashion_mnist', the job asks for 'digits'" in other.stderr
    same = _rescore(run_dir, tmp_path / "same", "+experiment=fashion_mnist", f"data.limit={N}", "dist.world_size=1")
    assert same.returncode == 0, same.stderr[-3000:]
    rank1 = run_dir / "predictions" / "rank1.parquet"
    data = bytearray(rank1.read_bytes())
    data[len(data) // 2] ^= 0xFF
    rank1.write_bytes(bytes(data))
    bad = _rescore(run_dir, tmp_path / "corrupt", "dist.world_size=1")
    assert bad.returncode != 0 and f"{rank1}: rank 1's prediction file does not match its manifest entry" in \
        " ".join(bad.stderr.split()), bad.stderr[-3000:]
    rank1.unlink()
    gone = _rescore(run_dir, tmp_path / "missing", "dist.world_size=1")
    assert gone.returncode != 0 and f"{rank1}: rank 1's prediction file is missing" in " ".join(gone.stderr.split())
    topk_only = run_disteval("+experiment=fashion_mnist", "eval.save_predictions=true", "data.limit=300",
                             run_dir=tmp_path / "topk")
    assert topk_only.returncode == 0, topk_only.stderr[-3000:]
    refused = _rescore(tmp_path / "topk", tmp_path / "topk_rescored")
    assert refused.returncode != 0 and "re-scoring needs the logits" in refused.stderr


def _exact_mcnemar(only_a: int, only_b: int) -> float:
    """McNemar's exact two-sided p-value from its definition: twice the binomial(n, 1/2) tail at min(b, c)."""
    from math import comb

    n = only_a + only_b
    return min(1.0, 2 * sum(comb(n, i) for i in range(min(only_a, only_b) + 1)) / 2 ** n) if n else 1.0


def test_paired_significance_between_two_checkpoints(stores, tmp_path):
    """Another checkpoint (the shipped one with noise on its weights) on the same samples: compare
    --significance counts the discordant pairs as numpy does from the stores, McNemar's p equals the exact
    binomial tail, the NLL permutation test and the intervals equal scipy's on the same numbers; a run of
    other samples is refused naming how many and which."""
    import pyarrow.parquet as pq
    import torch
    from scipy.stats import bootstrap, permutation_test

    from conftest import REPO

    state = torch.load(REPO / "disteval/models/checkpoints/fashion_cnn.pt", weights_only=True)
    gen = torch.Generator().manual_seed(3)
    torch.save({k: v + 0.02 * torch.randn(v.shape, generator=gen) if v.is_floating_point() and "running" not in k else v
                for k, v in state.items()}, tmp_path / "noisy.pt")
    proc = run_disteval(*JOB, f"data.limit={N}", "dist.world_size=2", f"model.checkpoint={tmp_path / 'noisy.pt'}",
                        run_dir=tmp_path / "b")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cmp = diagnostics_cli(["compare", str(stores[1]), str(tmp_path / "b"), "--significance", "--json", "--resamples",
                           "400", "--seed", "5"], cwd=tmp_path)
    assert cmp.returncode == 1, cmp.stderr[-3000:]
    sig = json.loads(cmp.stdout)["significance"]

    def per_sample(run):
        t = pq.read_table(run / "predictions").sort_by("sample_id")
        z = np.stack(t.column("logits").to_numpy(zero_copy_only=False)).astype(np.float64)
        y = t.column("target").to_numpy()
        m = z.max(1)
        return (z.argmax(1) == y).astype(np.float64), m + np.log(np.exp(z - m[:, None]).sum(1)) - z[np.arange(len(y)), y]

    (ca, na), (cb, nb) = per_sample(stores[1]), per_sample(tmp_path / "b")
    only_a, only_b = int(((ca == 1) & (cb == 0)).sum()), int(((ca == 0) & (cb == 1)).sum())
    top1 = sig["top1"]
    assert (top1["only_a"], top1["only_b"]) == (only_a, only_b) and only_a + only_b > 0
    assert top1["a"] == ca.mean() == load_results(stores[1])["metrics"]["top1"]
    assert top1["p_value"] == pytest.approx(_exact_mcnemar(only_a, only_b), rel=1e-9)
    diff = lambda u, v, axis: u.mean(axis) - v.mean(axis)  # noqa: E731
    ci = bootstrap((ca, cb), diff, paired=True, vectorized=True, n_resamples=400, method="percentile",
                   rng=np.random.default_rng(5))
    assert top1["interval"] == [ci.confidence_interval.low, ci.confidence_interval.high]
    perm = permutation_test((na, nb), diff, permutation_type="samples", vectorized=True, n_resamples=400,
                            rng=np.random.default_rng(5))
    assert sig["nll"]["p_value"] == perm.pvalue and sig["nll"]["difference"] == na.mean() - nb.mean()
    assert sig["samples"] == N

    short = run_disteval(*JOB, f"data.limit={N - 10}", "dist.world_size=1", run_dir=tmp_path / "short")
    assert short.returncode == 0, short.stderr[-3000:]
    refused = diagnostics_cli(["compare", str(stores[1]), str(tmp_path / "short"), "--significance"], cwd=tmp_path)
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2 and f"10 only in A (ids [{N - 10}, {N - 9}" in said, said[-2000:]


def _table(run_dir: Path):
    import pyarrow.parquet as pq

    manifest = json.loads((run_dir / "predictions" / "_manifest.json").read_text())
    table = pq.read_table(run_dir / "predictions").sort_by("sample_id")
    assert table.num_rows == sum(f["rows"] for f in manifest["files"]) == manifest["data"]["num_samples"]
    assert [c.split(":")[0] for c in manifest["columns"]] == table.schema.names
    return table


def test_detection_store_holds_each_images_detections_and_rescores(tmp_path):
    """A COCO replay at W=2: one row per image with the results file's boxes (xywh), scores and category ids,
    compared per image with the file read by json; re-scored at W=3 from the store alone its metrics are
    the writer's (==); scored against another annotation file it is refused naming data.annotations."""
    from disteval.data.coco_synthetic import make_synthetic_coco

    gt, dt = make_synthetic_coco(tmp_path, num_images=40, num_categories=5, dets_per_image=9, seed=4)
    proc = run_disteval("+experiment=coco_replay", f"data.annotations={gt}", f"data.predictions={dt}",
                        "dist.world_size=2", "data.batch_size=8", "eval.save_predictions=true", "eval.progress=false",
                        run_dir=tmp_path / "run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table(tmp_path / "run")
    images = sorted(im["id"] for im in json.loads(gt.read_text())["images"])
    assert table.column("image_id").to_pylist() == images  # sample i is the i-th image id, sorted
    want: dict[int, list] = {}
    for d in json.loads(dt.read_text()):
        want.setdefault(d["image_id"], []).append(d)
    for row in table.to_pylist():
        dets = want.get(row["image_id"], [])  # in file order, as the replay gives them
        assert row["bbox"] == [d["bbox"] for d in dets] and row["scores"] == [d["score"] for d in dets]
        assert row["labels"] == [d["category_id"] for d in dets]
        assert row["area"] == [d["bbox"][2] * d["bbox"][3] for d in dets]  # loadRes' area of a box
    rescored = _rescore(tmp_path / "run", tmp_path / "rescored", "dist.world_size=3")
    assert rescored.returncode == 0, rescored.stderr[-3000:]
    assert load_results(tmp_path / "rescored")["metrics"] == load_results(tmp_path / "run")["metrics"]
    other, _ = make_synthetic_coco(tmp_path / "other", num_images=40, num_categories=5, dets_per_image=9, seed=5)
    refused = _rescore(tmp_path / "run", tmp_path / "refused", f"data.annotations={other}")
    assert refused.returncode == 2 and "data.annotations" in refused.stderr and "not the annotation file" in \
        " ".join(refused.stderr.split()), refused.stderr[-2000:]


@pytest.mark.skipif(not (Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "coco").is_dir(),
                    reason="../shared/data/coco (the shared COCO files) not present")
def test_segmentation_store_sums_to_the_runs_confusion(tmp_path):
    """The COCO semantic-segmentation replay at W=2 with label maps: the images' confusion counts summed give
    the run's pixel accuracy (==) and mIoU (numpy, to 1e-12); each stored map has its image's size and the
    counts of its row are the map's pixels that are not ignored."""
    shared = str(Path(__file__).resolve().parent.parent.parent / "shared")
    proc = run_disteval("+experiment=coco_semseg_replay", "dist.world_size=2", "eval.save_predictions=true",
                        "eval.predictions.label_maps=true", "eval.progress=false", run_dir=tmp_path / "seg",
                        env={"DISTEVAL_SHARED": shared})
    assert proc.returncode == 0, proc.stderr[-3000:]
    table, metrics = _table(tmp_path / "seg"), load_results(tmp_path / "seg")["metrics"]
    c = metrics["num_classes"]
    conf = np.stack(table.column("confusion").to_numpy(zero_copy_only=False)).astype(np.int64)
    total = conf.sum(0).reshape(c, c)
    assert int(total.sum()) == metrics["num_pixels"]
    assert np.trace(total) / total.sum() == metrics["pixel_accuracy"]
    tp, union = np.diag(total).astype(np.float64), total.sum(0) + total.sum(1) - np.diag(total)
    assert abs(np.mean(tp[union > 0] / union[union > 0]) - metrics["mIoU"]) < 1e-12
    for row in table.slice(0, 5).to_pylist():
        assert len(row["label_map"]) == row["height"] * row["width"] >= sum(row["confusion"]) > 0
    refused = _rescore(tmp_path / "seg", tmp_path / "rescored")  # counts, not outputs: read them, not re-scored
    assert refused.returncode == 2 and "a semseg_replay store" in refused.stderr, refused.stderr[-2000:]


def test_embedding_store_is_the_same_at_every_world_size(tmp_path):
    """kNN on the Fashion-MNIST CNN's features (2,000 gallery + 300 queries): the stores written at W=1 and W=2
    are equal as tables (ids, targets, every embedding's bits), one L2-normalised 128-d row per item."""
    tables = []
    for w in (1, 2):
        proc = run_disteval("+experiment=fashion_mnist_knn", "eval.embedding.gallery_limit=2000",
                            "eval.embedding.query_limit=300", "eval.embedding.knn_k=[10]", f"dist.world_size={w}",
                            "eval.save_predictions=true", "eval.progress=false", run_dir=tmp_path / f"w{w}")
        assert proc.returncode == 0, proc.stderr[-3000:]
        tables.append(_table(tmp_path / f"w{w}"))
    assert tables[0].equals(tables[1]) and tables[0].num_rows == 2300
    emb = np.stack(tables[0].column("embedding").to_numpy(zero_copy_only=False))
    assert emb.shape == (2300, 128) and np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-6)


def test_overwrite_moves_the_earlier_store_away(tmp_path):
    """A run again into the same directory with eval.overwrite=true: the earlier store (3 rank files) moves
    into previous/ with the other records, and the new store holds only its own 2 rank files."""
    run = tmp_path / "run"
    for w, extra in ((3, ()), (2, ("eval.overwrite=true",))):
        proc = run_disteval("+experiment=fashion_mnist", "eval.save_predictions=true", "data.limit=300",
                            f"dist.world_size={w}", "eval.progress=false", *extra, run_dir=run)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in (run / "predictions").glob("*.parquet")) == ["rank0.parquet", "rank1.parquet"]
    earlier = list((run / "previous").glob("*/predictions/*.parquet"))
    assert sorted(p.name for p in earlier) == ["rank0.parquet", "rank1.parquet", "rank2.parquet"]
