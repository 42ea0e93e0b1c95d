"""Streamed WebDataset shards with real gloo ranks and the real engine (``RankRun``: task, shipped Fashion-MNIST
CNN, loop, DataLoader workers, sync, coverage, results.json), one process group per W in 1..5 running every
case of that W (``wds_workers.stream_cases_worker``), on a generated shard set of 28x28 images with uneven
shard sizes 0..37 (empty shards first and in the middle):

- num_workers 0..3: metrics == the map-style run (``data=fashion_mnist`` over IDX files of the same images)
  at W=1, coverage exact, at every W;
- one corrupt sample with ``data.on_decode_error=skip``: the same "79 of 80 samples", the skipped (shard, key)
  and metrics == W=1 at every (W, workers), counts equal to an independent reference without that sample;
- a shard cut after indexing: exactly the ranks whose planned ranges reach the cut raise a DataError naming
  the shard, the others count all their samples; the group goes on (no hang);
- a preemption drill (``DISTEVAL_FAULTS=preempt@*:batch=3`` inside a SLURM-like job): every rank saves its
  checkpoint mid-shard, the requeued job resumes from it and results.json equals the uninterrupted run."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import REPO
from disteval.data.index import build_index, write_index
from disteval.data.stream_plan import locate, plan_rank, shard_starts
from disteval.models.reference_cnn import FashionCNN
from launchers.local import launch
from reference import reference_metrics
from wds_workers import stream_cases_worker

SIZES = [0, 37, 5, 1, 12, 0, 23, 2]  # N = 80; uneven, empty shards first and in the middle
N = sum(SIZES)
B = 4  # 20 global batches: every rank of W <= 5 holds at least 4
WORLD_SIZES = [1, 2, 3, 4, 5]
WORKERS = [0, 1, 2, 3]
CORRUPT = 7  # position (shard 1) whose PNG is garbage in the corrupt copy
CUT_SHARD, CUT_SAMPLE = 6, 10  # shard 6 (positions 55..77) cut inside its sample 10 (position 65)
PREEMPT_AFTER = 3  # batches: mid-shard on every rank (checked below)
MODEL = {"name": "fashion_cnn", "weights": "shipped"}

_spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
make_shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_shards)


def _write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (the MNIST format: magic 0x0000 0x08 ndim, big-endian dims, uint8 data)."""
    path.write_bytes(bytes([0, 0, 8, array.ndim]) + b"".join(d.to_bytes(4, "big") for d in array.shape)
                     + array.astype(np.uint8).tobytes())


def _stream_data(paths: list[str], index: Path, k: int, **extra) -> dict:
    return {"model": MODEL, "data": {"name": "webdataset", "urls": paths, "index": str(index), "image_mode": "l8",
                                     "num_classes": 10, "batch_size": B, "num_workers": k, **extra}}


@pytest.fixture(scope="module")
def shard_sets(tmp_path_factory):
    """Clean, corrupt and cut shard sets of the same 80 generated images, their indexes, and the map-style copy."""
    import webdataset as wds

    root = tmp_path_factory.mktemp("wds-dist")
    rng = np.random.default_rng(5)
    images, labels = rng.integers(0, 256, size=(N, 28, 28), dtype=np.uint8), rng.integers(0, 10, size=N)
    (root / "map").mkdir()
    _write_idx(root / "map" / "t10k-images-idx3-ubyte", images)
    _write_idx(root / "map" / "t10k-labels-idx1-ubyte", labels)
    sets = {}
    for name in ("clean", "corrupt", "cut"):
        paths = make_shards.write_shards(root / name, images, labels, SIZES)
        sets[name] = paths
    with wds.TarWriter(sets["corrupt"][1]) as sink:  # shard 1 rewritten with position 7's PNG broken
        for p in range(SIZES[1]):
            sink.write({"__key__": f"s-{p:08d}", "cls": int(labels[p]),
                        "png": b"\x89PNG broken" if p == CORRUPT else images[p]})
    for name in ("clean", "corrupt"):
        write_index(build_index(sets[name]), str(root / name / "index.json"))
    # the cut set: indexed whole, then shard 6 is cut inside sample 10's first member; the index's size and
    # mtime are made to agree with the cut file, as when a shard is cut after the driver validated the index
    # (a copy still being written, a remote shard without a size)
    shards = build_index(sets["cut"])
    cut = Path(sets["cut"][CUT_SHARD])
    data = cut.read_bytes()
    cut.write_bytes(data[:shards[CUT_SHARD].offsets[CUT_SAMPLE] + 700])
    st = os.stat(cut)
    shards[CUT_SHARD] = dataclasses.replace(shards[CUT_SHARD], size=st.st_size, mtime_ns=st.st_mtime_ns)
    write_index(shards, str(root / "cut" / "index.json"))
    return root, sets, images, labels


def _drill_workers(w: int) -> int:
    return (w + 1) % 4


@pytest.fixture(scope="module")
def outcomes(shard_sets, tmp_path_factory):
    root, sets, _, _ = shard_sets
    out = {}
    for w in WORLD_SIZES:
        cases = {} if w > 1 else {  # (map-style across W: tests/test_bitwise_dist.py)
            "map": {"model": MODEL, "data": {"name": "fashion_mnist", "root": str(root / "map"), "batch_size": B}}}
        for k in WORKERS:
            cases[f"clean_k{k}"] = _stream_data(sets["clean"], root / "clean" / "index.json", k)
            cases[f"skip_k{k}"] = _stream_data(sets["corrupt"], root / "corrupt" / "index.json", k,
                                               on_decode_error="skip")
        cut = {f"cut_k{k}": {"index": str(root / "cut" / "index.json"), "urls": sets["cut"], "batch_size": B,
                             "num_workers": k} for k in WORKERS}
        # the drill: case skip_k{K} (its uninterrupted run) with K = 2, 3, 0, 1, 2 loader workers at W = 1..5
        drills = {"drill": {"overrides": cases[f"skip_k{_drill_workers(w)}"], "batch": PREEMPT_AFTER}}
        d = tmp_path_factory.mktemp(f"w{w}")
        launch(stream_cases_worker, (str(d), cases, cut, drills), w, str(d))
        out[w] = d
    return out


def _results(d: Path, name: str) -> dict:
    return json.loads((d / name / "results.json").read_text())


def test_streamed_grid_bit_identical_to_map_style(outcomes):
    """W 1..5 x num_workers 0..3: metrics == the map-style run at W=1 (and so == streamed W=1), coverage exact."""
    ref = _results(outcomes[1], "map")
    assert ref["metrics"]["num_samples"] == N and ref["coverage"]["ok"]
    for w in WORLD_SIZES:
        for k in WORKERS:
            res = _results(outcomes[w], f"clean_k{k}")
            assert res["world_size"] == w and res["exact"] is True and res["coverage"]["ok"], (w, k)
            assert res["metrics"] == ref["metrics"], (w, k)  # == on every float
            assert res["decode_errors"]["skipped"] == 0
            assert sum(r["samples"] for r in res["per_rank"]) == N


def test_corrupt_sample_skipped_counted_identically(outcomes, shard_sets):
    _, sets, images, labels = shard_sets
    keep = np.arange(N) != CORRUPT
    model = FashionCNN()
    model.load_state_dict(torch.load(REPO / "disteval" / "models" / "checkpoints" / "fashion_cnn.pt", weights_only=True))
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(images[keep].astype(np.float32) / 255.0)[:, None]).numpy()
    want = reference_metrics(logits, labels[keep], 10, topk=(1, 5))
    base = _results(outcomes[1], "skip_k0")
    assert base["metrics"]["num_samples"] == N - 1
    assert base["metrics"]["top1"] * (N - 1) == pytest.approx(want["top1"] * (N - 1), abs=1e-9)  # a count
    assert base["metrics"]["top5"] * (N - 1) == pytest.approx(want["top5"] * (N - 1), abs=1e-9)
    for w in WORLD_SIZES:
        for k in WORKERS:
            res = _results(outcomes[w], f"skip_k{k}")
            assert res["decode_errors"] == {"policy": "skip", "skipped": 1, "evaluated": N - 1,
                                            "samples": f"{N - 1} of {N} samples",
                                            "ids": [[sets["corrupt"][1], f"s-{CORRUPT:08d}"]]}, (w, k)
            assert res["exact"] is True and res["coverage"]["ok"]
            assert res["metrics"] == base["metrics"], (w, k)


def test_cut_shard_is_an_error_naming_it_on_exactly_the_ranks_that_reach_it(outcomes, shard_sets):
    _, sets, _, _ = shard_sets
    starts = shard_starts(SIZES)
    cut_at = starts[CUT_SHARD] + CUT_SAMPLE  # positions >= cut_at (up to the shard's end) are gone
    raised = set()
    for w in WORLD_SIZES:
        for k in WORKERS:
            for r in range(w):
                got = json.loads((outcomes[w] / f"cut_k{k}" / f"rank{r}.json").read_text())
                plans = plan_rank(SIZES, w, r, k, B)
                reaches = any(cut_at <= p < starts[CUT_SHARD + 1] for pl in plans for a, b in pl.spans
                              for p in range(a, b))
                if reaches:
                    raised.add((w, k, r))
                    assert got["error"] and f"{sets['cut'][CUT_SHARD]} is truncated" in got["error"], (w, k, r, got)
                else:
                    assert got["error"] is None and got["samples"] == sum(len(p) for p in plans), (w, k, r, got)
    assert len(raised) >= len(WORLD_SIZES) * len(WORKERS)  # every (W, workers) has a rank that reads the cut


def test_preempted_mid_shard_then_resumed_equals_uninterrupted(outcomes):
    """Every rank received the checkpoint signal after batch 3 (inside a shard), saved its checkpoint (with the
    skipped sample's id where it had passed it) and the requeued job's results == the uninterrupted run's."""
    starts = shard_starts(SIZES)
    for w in WORLD_SIZES:
        d = outcomes[w]
        for r in range(w):
            drill = json.loads((d / "drill" / "ranks" / f"rank{r}" / "drill.json").read_text())
            start = plan_rank(SIZES, w, r, 0, B)[0].start
            done = start + PREEMPT_AFTER * B
            assert drill["preempted"] and drill["samples_done"] == PREEMPT_AFTER * B, (w, r, drill)
            assert locate(starts, done)[1] > 0, (w, r)  # the checkpoint is mid-shard
            assert drill["skipped_in_checkpoint"] == ([CORRUPT] if start <= CORRUPT < done else [])
            log = (d / "drill" / "ranks" / f"rank{r}" / "log.txt").read_text()
            assert "resuming from" in log and f"{PREEMPT_AFTER * B} of" in log
            assert not (d / "drill" / "ranks" / f"rank{r}" / "checkpoint.pt").exists()
        got, want = _results(d, "drill"), _results(d, f"skip_k{_drill_workers(w)}")
        assert got["metrics"] == want["metrics"] and got["decode_errors"] == want["decode_errors"], w
        assert got["coverage"]["ok"] and got["exact"] is True
