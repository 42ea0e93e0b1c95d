"""``python -m disteval +experiment=fashion_mnist_shards`` (data=webdataset) end to end: the shipped Fashion-MNIST
CNN on tar shards written by scripts/make_shards.py gives the same metrics (==, every float) as
``+experiment=fashion_mnist`` (map-style) on the same images, at W=1 and W=5 with 3 loader workers (real gloo
ranks; 10 global batches: every rank holds 2, so one worker of each rank idles); a corrupt sample with
data.on_decode_error=skip is counted, listed by (shard, key) in results.json and the metrics table ("N of M
samples"), and the coverage still proves every id exactly once; without data.index the driver builds the
index first."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_results, run_disteval

ROOT = "/usr/share/datasets/fashion-mnist"
LIMIT = 1200

pytestmark = pytest.mark.skipif(not Path(ROOT).is_dir(), reason="Debian's dataset-fashion-mnist is not installed")


def _make_shards():
    spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("fm-shards")
    assert _make_shards().main(["--root", ROOT, "--out", str(out), "--samples-per-shard", "500",
                                "--limit", str(LIMIT), "--index"]) == 0
    return out


def _stream_args(out: Path, index: str | None, *extra: str) -> list[str]:
    """``+experiment=fashion_mnist_shards`` (the shipped CNN, data=webdataset, l8 images) on the shards in OUT."""
    return ["+experiment=fashion_mnist_shards", f"data.urls='{out}/fashion-mnist-test-{{000000..000002}}.tar'",
            f"data.index={index or 'null'}", "data.batch_size=128", *extra]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The map-style run on the same images at W = 1: results.json."""
    run_dir = tmp_path_factory.mktemp("fm-ref") / "run"
    proc = run_disteval("+experiment=fashion_mnist", f"data.root={ROOT}", f"data.limit={LIMIT}", "data.batch_size=128",
                        "dist.world_size=1", run_dir=run_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return load_results(run_dir)


def test_same_metrics_as_map_style(cli, shards, ref):
    for extra in (["dist.world_size=1"], ["dist.world_size=5", "data.num_workers=3"]):
        proc, run_dir = cli(*_stream_args(shards, f"{shards}/index.json", *extra))
        assert proc.returncode == 0, proc.stderr[-2000:]
        got = load_results(run_dir)
        assert got["metrics"] == ref["metrics"] and got["exact"] is True
        assert got["dataset"]["num_samples"] == LIMIT
        assert got["decode_errors"]["skipped"] == 0


def test_corrupt_sample_skipped_and_listed(cli, shards, tmp_path):
    import webdataset as wds

    out = tmp_path / "corrupt"
    out.mkdir()
    for name in ("fashion-mnist-test-000000.tar", "fashion-mnist-test-000002.tar"):
        os.symlink(shards / name, out / name)
    with wds.TarWriter(str(out / "fashion-mnist-test-000001.tar")) as sink:  # shard 1 with sample 600 broken
        for sample in wds.WebDataset(str(shards / "fashion-mnist-test-000001.tar"), shardshuffle=False):
            if sample["__key__"] == "test-00000600":
                sample["png"] = b"\x89PNG broken"
            sink.write({k: v for k, v in sample.items() if k in ("__key__", "png", "cls")})
    proc, run_dir = cli(*_stream_args(out, None, "dist.world_size=2", "data.on_decode_error=skip"),
                        env={"DISTEVAL_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "indexing 3 shards" in proc.stderr + proc.stdout  # no data.index: the driver built one
    assert "1 of 1200 samples did not decode" in proc.stderr + proc.stdout
    assert "1199 of 1200 samples, world size 2" in proc.stdout  # the metrics table's caption
    res = load_results(run_dir)
    assert res["decode_errors"] == {"policy": "skip", "skipped": 1, "evaluated": LIMIT - 1,
                                    "samples": f"{LIMIT - 1} of {LIMIT} samples",
                                    "ids": [[f"{out}/fashion-mnist-test-000001.tar", "test-00000600"]]}
    assert res["exact"] is True and res["metrics"]["num_samples"] == LIMIT - 1
    # the doctor calls this documented policy healthy (it once failed it: "num_samples=1199 but the dataset has 1200")
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(run_dir), "--json"], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    sanity = next(c for c in json.loads(doctor.stdout)["runs"][0]["checks"] if c["check"] == "sanity")
    assert doctor.returncode == 0 and sanity["status"] == "pass", sanity
    assert "but the 1 that did not decode" in sanity["finding"], sanity
    # killed after its 7th batch (the skipped sample is in global batch 4, recorded) and resumed at W = 2:
    # the recorded window carries the skipped id, so the resumed run lists it and counts it once
    env = {"DISTEVAL_CACHE_DIR": str(tmp_path / "cache")}
    journal = ("data.on_decode_error=skip", "eval.journal.every_batches=1")
    proc, killed = cli(*_stream_args(out, None, "dist.world_size=1", *journal),
                       env={**env, "DISTEVAL_FAULTS": "kill@0:batch=8"})
    assert proc.returncode != 0 and (killed / "ranks" / "rank0" / "journal" / "000000000512-000000000640.pt").is_file()
    proc, resumed = cli(*_stream_args(out, None, "dist.world_size=2", *journal, f"eval.resume={killed}"), env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = load_results(resumed)
    assert got["decode_errors"] == res["decode_errors"] and got["metrics"] == res["metrics"]
    assert got["coverage"]["ok"] and got["journal"]["samples_resumed"] == 7 * 128
    proc, _ = cli(*_stream_args(out, None, "dist.world_size=2"), env={"DISTEVAL_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode != 0
    assert "key 'test-00000600': field 'png' does not decode" in proc.stderr + proc.stdout


def test_rgb_images_for_a_one_channel_model_name_data_image_mode(cli, shards):
    """data.image_mode=rgb8 for the one-channel Fashion-MNIST CNN: refused before any rank starts (exit 2), the
    error naming data.image_mode and the channels each side has (it once named data.crop_size)."""
    proc, run_dir = cli(*_stream_args(shards, f"{shards}/index.json", "data.image_mode=rgb8"))
    text = " ".join((proc.stderr + proc.stdout).split())
    assert proc.returncode == 2, text[-2000:]
    assert "data.image_mode" in text and "takes 1-channel inputs but the data gives 3 channels" in text, text[-2000:]
    assert "data.crop_size" not in text
    assert json.loads((run_dir / "launch.json").read_text())["error"]["key"] == "data.image_mode"


def test_a_killed_streamed_run_resumes_at_another_world_size_and_worker_count(cli, shards, ref):
    """eval.journal on streamed shards: W = 3 with 2 loader workers, rank 1 killed after its 2nd batch; resumed at
    W = 2 with 3 workers, whose workers read only the batches no record covers (dealt round-robin, so they still
    arrive in order): metrics == the map-style run's, every sample once, the recorded samples not read again."""
    job = _stream_args(shards, f"{shards}/index.json", "eval.journal.every_batches=1")
    proc, killed = cli(*job, "dist.world_size=3", "data.num_workers=2", env={"DISTEVAL_FAULTS": "kill@1:batch=3"})
    assert proc.returncode != 0 and not (killed / "results.json").exists()
    assert len(list(killed.glob("ranks/rank1/journal/*.pt"))) == 2
    proc, run = cli(*job, "dist.world_size=2", "data.num_workers=3", f"eval.resume={killed}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_results(run)
    assert got["metrics"] == ref["metrics"] and got["coverage"]["ok"] and got["exact"]
    j = got["journal"]
    assert j["samples_resumed"] >= 256 and j["samples_resumed"] + j["samples_evaluated"] == LIMIT, j
