"""The pixel cache of streamed tar shards (issue 42 point 2: ``data=webdataset data.cache=pixels``, keyed by sample):
Fashion-MNIST shards written by scripts/make_shards.py, one sample broken (``on_decode_error=skip``). The run that
builds the cache (W = 3, 2 loader workers) and the runs that read it (W = 1 and 2, 0 and 2 workers) give the
streamed run's metrics and skipped samples (==); the parts record each sample's target, the skipped position and
the xxh3-64 of the image and label bytes it came from (checked against the tar here; the skipped sample's too);
a reading run with ``on_decode_error=raise`` names the undecodable sample; a shard changed in place (same size,
another image byte, or another label) is refused before any rank starts, naming the shard and the sample."""
from __future__ import annotations

import importlib.util
import json
import tarfile
from pathlib import Path

import pytest

from conftest import REPO, load_results

ROOT = "/usr/share/datasets/fashion-mnist"
LIMIT = 1200

pytestmark = pytest.mark.skipif(not Path(ROOT).is_dir(), reason="Debian's dataset-fashion-mnist is not installed")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """3 shards of 500, 500, 200 samples; shard 1's sample test-00000600 has a PNG that does not decode."""
    import webdataset as wds

    spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    src, out = tmp_path_factory.mktemp("fm-src"), tmp_path_factory.mktemp("fm-shards")
    assert module.main(["--root", ROOT, "--out", str(src), "--samples-per-shard", "500", "--limit", str(LIMIT)]) == 0
    for shard in sorted(src.glob("*.tar")):
        with wds.TarWriter(str(out / shard.name)) as sink:
            for sample in wds.WebDataset(str(shard), shardshuffle=False):
                if sample["__key__"] == "test-00000600":
                    sample["png"] = b"\x89PNG broken"
                sink.write({k: v for k, v in sample.items() if k in ("__key__", "png", "cls")})
    return out


def _args(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["+experiment=fashion_mnist_shards", f"data.urls='{out}/fashion-mnist-test-{{000000..000002}}.tar'",
            "data.index=null", "data.batch_size=128", "data.on_decode_error=skip", f"data.cache_dir={cache}", *extra]


def _ok(proc, run_dir) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return load_results(run_dir)


def _member(shard: Path, name: str) -> tarfile.TarInfo:
    with tarfile.open(shard) as tar:
        return tar.getmember(name)


def test_stream_cache_equals_streaming_and_a_changed_shard_is_refused(cli, shards, tmp_path):
    import xxhash

    env = {"DISTEVAL_CACHE_DIR": str(tmp_path / "index-cache")}
    cache = tmp_path / "pixels"
    ref = _ok(*cli(*_args(shards, cache, "dist.world_size=1"), env=env))
    assert ref["decode_errors"]["skipped"] == 1 and not cache.exists()

    proc, run_dir = cli(*_args(shards, cache, "data.cache=pixels", "dist.world_size=3", "data.num_workers=2"), env=env)
    built = _ok(proc, run_dir)
    assert "builds the pixel cache" in proc.stderr, proc.stderr[-2000:]
    assert built["metrics"] == ref["metrics"] and built["decode_errors"] == ref["decode_errors"]
    [folder] = list(cache.iterdir())
    records = {json.loads(p.read_text())["start"]: json.loads(p.read_text()) for p in (folder / "parts").glob("*.json")}
    assert sorted(records) == [0, 512, 896]  # one part per rank: 10 batches of 128 dealt 4, 3, 3
    rec = records[512]  # positions 512 .. 895: sample 600 was skipped, the rest carry targets and source digests
    assert rec["end"] == 896 and rec["skipped"] == [600]
    with tarfile.open(shards / "fashion-mnist-test-000001.tar") as tar:
        got = {n: tar.extractfile(f"test-00000{n}").read() for n in ("600.png", "600.cls", "601.png", "601.cls")}
    assert rec["sources"][600 - 512] == xxhash.xxh3_64(got["600.png"] + b"\0" + got["600.cls"]).hexdigest()
    assert rec["sources"][601 - 512] == xxhash.xxh3_64(got["601.png"] + b"\0" + got["601.cls"]).hexdigest()
    assert rec["targets"][601 - 512] == int(got["601.cls"])

    for w, workers in ((1, 0), (2, 2)):
        proc, run_dir = cli(*_args(shards, cache, "data.cache=pixels", f"dist.world_size={w}",
                                   f"data.num_workers={workers}"), env=env)
        got = _ok(proc, run_dir)
        assert "reading the pixels of 1200 samples of the shards" in proc.stderr, proc.stderr[-2000:]
        assert got["metrics"] == ref["metrics"] and got["decode_errors"] == ref["decode_errors"], (w, workers)

    proc, _ = cli(*_args(shards, cache, "data.cache=pixels", "data.on_decode_error=raise"), env=env)
    said = " ".join((proc.stderr + proc.stdout).split())
    assert proc.returncode != 0 and "key 'test-00000600': did not decode when the pixel cache" in said, said[-2000:]

    # shard 2 changed in place: one byte of a PNG, the same size (the index is rebuilt for its new mtime)
    shard = shards / "fashion-mnist-test-000002.tar"
    at = _member(shard, "test-00001100.png").offset_data + 40
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x55
    shard.write_bytes(bytes(data))
    proc, run_dir = cli(*_args(shards, cache, "data.cache=pixels"), env=env)
    said = " ".join((proc.stderr + proc.stdout).split())
    assert proc.returncode == 2, said[-3000:]
    assert f"file {shard} (sample 1100): xxh3-64 " in said and "same size, changed content" in said, said[-3000:]

    # shard 0 relabelled in place: sample 5's .cls holds another digit (the image bytes are as they were)
    shard = shards / "fashion-mnist-test-000000.tar"
    member = _member(shard, "test-00000005.cls")
    data = bytearray(shard.read_bytes())
    data[member.offset_data] = ord("0") + (data[member.offset_data] - ord("0") + 1) % 10
    shard.write_bytes(bytes(data))
    proc, _ = cli(*_args(shards, cache, "data.cache=pixels"), env=env)
    said = " ".join((proc.stderr + proc.stdout).split())
    assert proc.returncode == 2 and f"file {shard} (sample 5): xxh3-64 " in said, said[-3000:]
