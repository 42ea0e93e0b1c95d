"""Inputs that used to be accepted silently or to fail with a raw error, each now a named error (or a warning in
results.json where the run still means something), on real runs (``python -m disteval``, real ranks, real files):
embeddings that are all zero (a kNN at chance with exit 0), a shard set without samples (every metric null with
exit 0), webdataset images of different sizes in one batch (torch's "stack expects each tensor to be equal
size"), a corrupt dataset cache file (``BadZipFile`` naming no file)."""
from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO, load_results
from disteval.models.reference_cnn import DigitsCNN

pytestmark = pytest.mark.slow
CKPT = REPO / "disteval" / "models" / "checkpoints"
KNN = ("eval.task=embedding", "eval.embedding.protocol=knn", "eval.embedding.knn_k=[5]")

_spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
make_shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_shards)


def _text(proc) -> str:
    return " ".join((proc.stderr + proc.stdout).split())


# -- 1. all-zero embeddings --------------------------------------------------------------------------------------

def test_all_zero_embeddings_are_an_error_naming_ranks_and_ids(cli, tmp_path):
    """A digits CNN whose weights are all zero embeds every image as the zero vector: cosine similarity is
    undefined, every score 0, the kNN vote at chance. Each rank names the count and the first sample ids."""
    torch.save({k: torch.zeros_like(v) for k, v in DigitsCNN().state_dict().items()}, tmp_path / "zero.pt")
    proc, run_dir = cli(*KNN, "eval.embedding.layer=classifier.2", f"model.checkpoint={tmp_path / 'zero.pt'}")
    text = _text(proc)
    assert proc.returncode == 1, text[-3000:]
    assert "DataError: every gallery embedding is zero (1257 of 1257" in text, text[-3000:]
    assert ("(1257 of 1257: rank 0 has 960, sample ids 0, 1, 2, 3, 4, ...; rank 1 has 297, sample ids 960, 961, 962, "
            "963, 964, ...)") in text
    assert "eval.embedding.layer" in text and "model.checkpoint" in text
    assert not (run_dir / "results.json").exists()


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_a_few_zero_embeddings_are_a_warning_in_results(cli, tmp_path):
    """Fashion-MNIST-shaped files with three black images, the shipped CNN with every bias zero and identity
    batch norms (a black image then gives exactly zero features): the run completes, and results.json
    ``warnings`` names the three sample ids, the count and the ranks holding them."""
    root = tmp_path / "fm"
    root.mkdir()
    rng = np.random.default_rng(0)
    train, test = rng.integers(0, 256, (40, 28, 28)), rng.integers(0, 256, (16, 28, 28))
    train[[3, 37]] = 0  # batches of 8 at W=2: rank 0 holds sample ids 0..31, rank 1 ids 32..55
    test[2] = 0
    for split, x in (("train", train), ("t10k", test)):
        _write_idx(root / f"{split}-images-idx3-ubyte", x)
        _write_idx(root / f"{split}-labels-idx1-ubyte", np.arange(len(x)) % 10)
    state = torch.load(CKPT / "fashion_cnn.pt", weights_only=True)
    for name, t in state.items():
        if name.endswith(("bias", "running_mean")):
            t.zero_()
        elif name.endswith(("running_var", ".1.weight", ".5.weight", ".9.weight")) and t.ndim == 1:
            t.fill_(1.0)
    torch.save(state, tmp_path / "nobias.pt")
    proc, run_dir = cli(*KNN, "data=fashion_mnist", f"data.root={root}", "data.batch_size=8", "model=fashion_cnn",
                        "eval.embedding.layer=classifier.3", f"model.checkpoint={tmp_path / 'nobias.pt'}")
    assert proc.returncode == 0, _text(proc)[-3000:]
    warnings = load_results(run_dir)["warnings"]
    zero = [w for w in warnings if "embeddings are zero" in w]
    assert len(zero) == 1, warnings
    assert zero[0].startswith("3 of 56 embeddings are zero (gallery 2 of 40 (rank 0 has 1, sample ids 3; rank 1 "
                              "has 1, sample ids 37), query 1 of 16 (rank 1 has 1, sample ids 42)): "), zero[0]
    assert "eval.embedding.layer=classifier.3" in zero[0]
    assert "warning: 3 of 56 embeddings are zero" in _text(proc)


def test_zero_rows_rule_and_non_finite_rows_named():
    """The rule without processes: a whole zero part is an error whatever the similarity; some zero rows are a
    warning with cosine / inner product and nothing with ``similarity=l2`` unnormalised (a zero vector is then an
    ordinary point); non-finite rows name the count and the first sample ids."""
    from disteval.errors import DataError
    from disteval.metrics.knn import EmbeddingMetrics, EmbeddingSpec
    from disteval.tasks.embedding_checks import check_zero_embeddings

    some = {"gallery": [(6, 1, [2]), (4, 0, [])], "query": [(3, 0, []), (2, 0, [])]}
    assert check_zero_embeddings(some, False, "X") is None
    assert check_zero_embeddings(some, True, "X").startswith("1 of 15 embeddings are zero (gallery 1 of 10 (rank 0 "
                                                             "has 1, sample ids 2)): ")
    whole = {"gallery": some["gallery"], "query": [(3, 3, [10, 11, 12]), (2, 2, [13, 14])]}
    for degenerate in (False, True):
        with pytest.raises(DataError, match=r"every query embedding is zero \(5 of 5: rank 0 has 3, sample ids 10, "
                                            r"11, 12; rank 1 has 2, sample ids 13, 14\): .*check X"):
            check_zero_embeddings(whole, degenerate, "X")
    metric = EmbeddingMetrics(EmbeddingSpec(dim=2))
    emb = torch.ones(9, 2)
    emb[[1, 4, 5, 6, 7, 8], 0] = float("nan")
    metric.update(emb, torch.zeros(9, dtype=torch.int64), torch.arange(100, 109))
    with pytest.raises(DataError, match=r"sample id 101: non-finite embedding \(nan or inf\) for 6 sample\(s\) on "
                                        r"this rank \(sample ids 101, 104, 105, 106, 107, \.\.\.\)"):
        metric.rows(0, 200)


# -- 2. a shard set without samples --------------------------------------------------------------------------------

def test_shards_without_samples_fail_before_ranks_naming_data_urls(cli, tmp_path):
    """Two empty tar shards (the index counts 0 samples): a configuration error naming data.urls and each shard,
    exit code 2, before any rank starts (it used to run and exit 0 with every metric null)."""
    for i in range(2):
        tarfile.open(tmp_path / f"empty-{i}.tar", "w").close()
    urls = f"{tmp_path}/empty-{{0..1}}.tar"
    proc, run_dir = cli("+experiment=fashion_mnist_shards", f"data.urls='{urls}'", "data.index=null",
                        env={"DISTEVAL_CACHE_DIR": str(tmp_path / "cache")})
    text = _text(proc)
    assert proc.returncode == 2, text[-3000:]
    assert f"data.urls: the 2 shards of {urls} hold no samples" in text, text[-3000:]
    assert f"{tmp_path}/empty-0.tar: 0" in text
    assert not (run_dir / "ranks").exists() and not (run_dir / "results.json").exists()


# -- 3. images of different sizes in one webdataset batch ---------------------------------------------------------

def test_images_of_different_sizes_name_shard_keys_and_shapes(cli, tmp_path):
    """Shard a holds three 28x28 images, shard b one 32x32, shard c four 28x28: global batch 0 (4 samples, on
    rank 0, read by a loader worker) spans a and b; rank 1's batch 1 (shard c) fits the model and waits. The
    error names both shapes, how many samples have each, the first one's shard and key, and what to do."""
    rng = np.random.default_rng(0)
    for name, n, size in (("a", 3, 28), ("b", 1, 32), ("c", 4, 28)):
        make_shards.write_shards(tmp_path, rng.integers(0, 256, (n, size, size), dtype=np.uint8), np.arange(n), [n],
                                 prefix=name, key_prefix=name)
    urls = f"[{tmp_path}/a-000000.tar,{tmp_path}/b-000000.tar,{tmp_path}/c-000000.tar]"
    proc, run_dir = cli("+experiment=fashion_mnist_shards", f"data.urls={urls}", "data.index=null", "data.batch_size=4",
                        "data.num_workers=1",
                        env={"DISTEVAL_CACHE_DIR": str(tmp_path / "cache")})
    text = _text(proc)
    assert proc.returncode == 1, text[-3000:]
    assert "stack expects" not in text
    assert (f"rank 0 failed: DataError: global batch 0: images of different shapes cannot be stacked into one "
            f"batch: (1, 28, 28) for 3 samples (first: shard {tmp_path}/a-000000.tar, key 'a-00000000'), (1, 32, 32) "
            f"for 1 sample (first: shard {tmp_path}/b-000000.tar, key 'b-00000000')") in text, text[-3000:]
    assert "resize" in text
    assert not (run_dir / "results.json").exists()


# -- 4. a corrupt cache file ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_digits_cache_is_named_and_rebuilt(cli, tmp_path, damage):
    """A cut-off cache file (it raised a raw BadZipFile naming no file) and garbage (rebuilt without a word): the
    driver's preflight names the file and rebuilds it atomically; the run's warnings say so; the metrics equal a
    run with a good cache and the rebuilt file has the same bytes."""
    cache = tmp_path / "cache"
    env = {"DISTEVAL_CACHE_DIR": str(cache)}
    proc, good_dir = cli("dist.world_size=1", env=env)
    assert proc.returncode == 0, _text(proc)[-3000:]
    (path,) = cache.glob("digits-*-test-*.npz")
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2] if damage == "truncated" else b"not an npz file")
    proc, run_dir = cli("dist.world_size=1", env=env)
    text = _text(proc)
    assert proc.returncode == 0, text[-3000:]
    notes = [w for w in load_results(run_dir)["warnings"] if str(path) in w]
    assert len(notes) == 1 and "is corrupt" in notes[0] and "rebuilt" in notes[0], load_results(run_dir)["warnings"]
    assert load_results(run_dir)["metrics"] == load_results(good_dir)["metrics"]
    assert path.read_bytes() == raw  # rebuilt: the same arrays, the same bytes
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


def test_corrupt_digits_cache_in_a_rank_is_logged_and_rebuilt(tmp_path, monkeypatch):
    """The loader itself (what a rank runs): a corrupt cache file is named in the rank's log and replaced."""
    from disteval.data.datasets import _digits_arrays, _digits_cache

    monkeypatch.setenv("DISTEVAL_CACHE_DIR", str(tmp_path))
    x, y = _digits_arrays("train")
    path = _digits_cache("train")
    raw = path.read_bytes()
    path.write_bytes(raw[:100])
    notes: list[str] = []  # where the message goes (else the rank's log, whose handlers other tests may own)
    x2, y2 = _digits_arrays("train", notes)
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    assert len(notes) == 1 and str(path) in notes[0] and "corrupt" in notes[0] and "rebuilt" in notes[0], notes
    assert path.read_bytes() == raw


# -- 6. several problems at once ------------------------------------------------------------------------------------

def test_every_preflight_problem_is_reported_in_one_try(cli, tmp_path):
    """A missing ImageFolder root, a missing checkpoint and a fault drill aimed past the world size: one try
    reports all three (exit 2, before any rank starts), each once, numbered; launch.json keeps the first key."""
    proc, run_dir = cli("+experiment=imagenet_vit", f"data.root={tmp_path}/no-such-root",
                        f"model.checkpoint={tmp_path}/no-such.pt", env={"DISTEVAL_FAULTS": "kill@5:batch=1"})
    text = _text(proc)
    assert proc.returncode == 2, text[-3000:]
    assert "3 problems, found before any rank started" in text, text[-3000:]
    for what in ("(1) DISTEVAL_FAULTS", f"(2) data.root: '{tmp_path}/no-such-root' does not exist",
                 f"(3) checkpoint '{tmp_path}/no-such.pt'"):
        assert text.count(what) == 1, (what, text[-3000:])
    assert not (run_dir / "ranks").exists()
    launch = json.loads((run_dir / "launch.json").read_text())
    assert launch["outcome"] == "config_error" and launch["error"]["key"] == "DISTEVAL_FAULTS"
