"""Streamed WebDataset shards on generated shard sets (uneven sizes 0..37, an empty shard, a corrupt sample, a
truncated shard): every (rank, worker) consumer of W in 1..5 x num_workers in 0..3 together yields each
sample exactly once, in the same global batches, with outputs bit-identical to the map-style run on the same
images; decode errors are named or skipped and counted; a truncated shard is an error naming it; the index
is validated; resume mid-shard equals an uninterrupted run; and webdataset's own split_by_node +
split_by_worker, measured on the same shards, duplicates samples."""
from __future__ import annotations

import importlib.util
import itertools
import os
from pathlib import Path
from collections import Counter

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import REPO
from disteval.common.ranges import batch_aligned_bounds
from disteval.data.datasets import IndexedDataset
from disteval.data.index import build_index, expand_urls, load_index, main as index_main, scan_shard, write_index
from disteval.data.stream_plan import plan_rank, shard_starts
from disteval.data.wds_stream import SampleFormat, ShardStream, read_range, sample_name
from disteval.errors import DataError

SIZES = [0, 37, 5, 1, 12, 0, 23, 2]  # uneven, empty shards (first and middle)
B = 4
FMT = SampleFormat(image_mode="l8")

_spec = importlib.util.spec_from_file_location("make_shards", REPO / "scripts" / "make_shards.py")
make_shards = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_shards)


def _images(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(n, 12, 12), dtype=np.uint8), rng.integers(0, 10, size=n)


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards")
    images, labels = _images(sum(SIZES))
    paths = make_shards.write_shards(out, images, labels, SIZES)
    write_index(build_index(paths), str(out / "index.json"))
    return out, paths, images, labels


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 10 * 10, 10)).eval()


def _map_style(images, labels, world_size: int) -> tuple[dict, set]:
    """Reference: the map-style path (IndexedDataset, batch-aligned exact shards, DataLoader batches)."""
    ds = IndexedDataset(TensorDataset(torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1),
                                      torch.from_numpy(labels.astype(np.int64))))
    model, out, batches = _model(), {}, set()
    for r in range(world_size):
        start, end = batch_aligned_bounds(len(ds), B, world_size, r)
        loader = DataLoader(torch.utils.data.Subset(ds, range(start, end)), batch_size=B)
        with torch.inference_mode():
            for x, y, ids in loader:
                logits = model(x)
                batches.add(tuple(ids.tolist()))
                out.update({int(i): (logits[j].clone(), int(y[j])) for j, i in enumerate(ids)})
    return out, batches


def _streamed(shards, world_size: int, num_workers: int, **kw) -> tuple[dict, set, list]:
    """Every consumer of every rank, simulated in this process (``iter_worker``)."""
    model, out, batches, skipped = _model(), {}, set(), []
    counts = [s.num_samples for s in shards]
    for r in range(world_size):
        ds = ShardStream(shards, plan_rank(counts, world_size, r, num_workers, B), B, SampleFormat(image_mode="l8", **kw))
        for k in range(max(1, num_workers)):
            for b in ds.iter_worker(k):
                skipped += b.skipped.tolist()
                if b.inputs is None:
                    continue
                with torch.inference_mode():
                    logits = model(b.inputs)
                batches.add(tuple(b.sample_ids.tolist()))
                for j, i in enumerate(b.sample_ids.tolist()):
                    assert i not in out, f"sample {i} twice"
                    out[i] = (logits[j].clone(), int(b.targets[j]))
    return out, batches, skipped


def test_index_counts_keys_offsets(shard_set, capsys):
    out, paths, _, _ = shard_set
    shards = load_index(str(out / "index.json"), paths)
    assert [s.num_samples for s in shards] == SIZES
    assert shards[2].keys == tuple(f"s-{p:08d}" for p in range(37, 42))
    assert all(s.offsets is not None and len(s.offsets) == s.num_samples for s in shards)
    assert index_main([str(out / "shard-{000000..000007}.tar"), "-o", str(out / "cli.json")]) == 0
    assert "[8/8]" in capsys.readouterr().err
    assert load_index(str(out / "cli.json"), paths) == shards


def test_grid_bit_identical_to_map_style_and_w1(shard_set):
    out, paths, images, labels = shard_set
    shards = load_index(str(out / "index.json"), paths)
    ref, ref_batches = _map_style(images, labels, 1)
    assert len(ref) == sum(SIZES)
    for w, k in itertools.product(range(1, 6), range(0, 4)):
        got, batches, skipped = _streamed(shards, w, k)
        assert skipped == [] and batches == ref_batches, (w, k)
        assert sorted(got) == list(range(sum(SIZES)))
        for i, (logits, y) in got.items():
            assert torch.equal(logits, ref[i][0]) and y == ref[i][1] == int(labels[i]), (w, k, i)


def test_real_dataloader_workers(shard_set):
    """Through torch's DataLoader with worker processes (W=2, 2 workers): the same ids and inputs, and each
    rank receives its global batches in increasing order."""
    out, paths, images, _ = shard_set
    shards = load_index(str(out / "index.json"), paths)
    counts = [s.num_samples for s in shards]
    seen = []
    for r in range(2):
        ds = ShardStream(shards, plan_rank(counts, 2, r, 2, B), B, FMT)
        order = []
        for b in DataLoader(ds, batch_size=None, num_workers=2):
            order.append(b.batch)
            ids = b.sample_ids
            assert torch.equal(b.inputs[:, 0], torch.from_numpy(images[ids.numpy()].astype(np.float32) / 255.0))
            seen += ids.tolist()
        assert order == sorted(order) and len(order) > 2  # global batches arrive in increasing order
    assert sorted(seen) == list(range(sum(SIZES)))


def test_bytes_read_about_once(shard_set):
    out, paths, _, _ = shard_set
    shards = load_index(str(out / "index.json"), paths)
    counts = [s.num_samples for s in shards]
    total = sum(os.path.getsize(p) for p in paths)
    for w, k in ((1, 0), (5, 3)):
        read = 0
        for r in range(w):
            ds = ShardStream(shards, plan_rank(counts, w, r, k, B), B, FMT)
            for j in range(max(1, k)):
                list(ds.iter_worker(j))
            read += ds.bytes_read[0]
        # every sample's bytes once; at most one 10 KiB tar record of look-ahead per range
        n_ranges = sum(len(p.ranges) for r in range(w) for p in plan_rank(counts, w, r, k, B))
        assert total - 10240 * len(paths) <= read <= total + 10240 * n_ranges, (w, k, read, total)


@pytest.fixture(scope="module")
def corrupt_set(tmp_path_factory):
    """Shards where sample 7's PNG is garbage."""
    import webdataset as wds

    out = tmp_path_factory.mktemp("corrupt")
    images, labels = _images(sum(SIZES))
    paths = make_shards.write_shards(out, images, labels, SIZES)
    rewritten = str(out / "shard-000001.tar")
    with wds.TarWriter(rewritten + ".new") as sink:
        for p in range(0, 37):
            png = b"not a png at all" if p == 7 else None
            sample = {"__key__": f"s-{p:08d}", "cls": int(labels[p])}
            sample["png"] = png if png is not None else images[p]
            sink.write(sample)
    os.replace(rewritten + ".new", rewritten)
    write_index(build_index(paths), str(out / "index.json"))
    return out, paths, images, labels


def test_corrupt_sample_raises_naming_shard_key_field(corrupt_set):
    out, paths, _, _ = corrupt_set
    shards = load_index(str(out / "index.json"), paths)
    with pytest.raises(DataError, match=r"shard-000001\.tar, key 's-00000007': field 'png' does not decode"):
        _streamed(shards, 2, 1)


def test_corrupt_sample_skipped_and_counted(corrupt_set):
    out, paths, images, labels = corrupt_set
    shards = load_index(str(out / "index.json"), paths)
    ref, _ = _map_style(images, labels, 1)
    for w, k in ((1, 0), (3, 2)):
        got, batches, skipped = _streamed(shards, w, k, on_decode_error="skip")
        assert skipped == [7]
        assert sample_name(shards, shard_starts([s.num_samples for s in shards]), 7) == (paths[1], "s-00000007")
        assert sorted(got) == [i for i in range(sum(SIZES)) if i != 7]
        assert (4, 5, 6) in batches  # global batch 1 without the skipped sample; batch 2 unchanged
        assert (8, 9, 10, 11) in batches
        assert all(torch.equal(got[i][0], ref[i][0]) for i in got)


def test_truncated_shard_is_an_error_naming_it(shard_set, tmp_path):
    out, paths, _, _ = shard_set
    cut = tmp_path / "cut.tar"
    data = open(paths[6], "rb").read()
    for length in (len(data) // 2, len(data) // 2 + 100, len(data) - 1024 * 10):
        cut.write_bytes(data[:length])
        with pytest.raises(DataError, match="cut.tar is truncated"):
            scan_shard(str(cut))
    # a shard cut after it was indexed: the reader names it (and does not hang)
    full = scan_shard(paths[6])
    cut.write_bytes(data[: len(data) // 2])
    info = full.__class__(str(cut), *[getattr(full, f) for f in ("size", "mtime_ns", "num_samples", "keys", "offsets")])
    from disteval.data.stream_plan import ShardRange

    with pytest.raises(DataError, match="cut.tar is truncated"):
        list(read_range(info, ShardRange(0, 3, 23, 0)))


def test_stale_or_mismatching_index(shard_set, tmp_path):
    out, paths, _, _ = shard_set
    idx = str(out / "index.json")
    with pytest.raises(DataError, match="other shards"):
        load_index(idx, paths[:-1])
    copy = tmp_path / "shard.tar"
    copy.write_bytes(open(paths[1], "rb").read())
    write_index(build_index([str(copy)]), str(tmp_path / "i.json"))
    os.utime(copy, ns=(1, 1))
    with pytest.raises(DataError, match="stale shard index .*shard.tar"):
        load_index(str(tmp_path / "i.json"), [str(copy)])


def test_pipe_urls_need_opt_in():
    with pytest.raises(DataError, match="pipe:"):
        expand_urls("pipe:cat a.tar")
    assert expand_urls("pipe:cat a.tar", allow_pipe=True) == ["pipe:cat a.tar"]
    assert expand_urls(["a-{0..2}.tar", "b.tar"]) == ["a-0.tar", "a-1.tar", "a-2.tar", "b.tar"]


def test_resume_mid_shard_equals_uninterrupted(shard_set):
    """Rank 0 of 1 with 2 workers stops after its first 3 batches (0, 1, 2: positions 0..11, inside shard 1 of
    37 samples); the resumed plan reads the rest; together they equal the uninterrupted run."""
    out, paths, _, _ = shard_set
    shards = load_index(str(out / "index.json"), paths)
    counts = [s.num_samples for s in shards]
    full, _, _ = _streamed(shards, 1, 2)
    first = ShardStream(shards, plan_rank(counts, 1, 0, 2, B), B, FMT)
    w0, w1 = first.iter_worker(0), first.iter_worker(1)
    part = [next(w0), next(w1), next(w0)]  # the DataLoader's delivery order
    assert [b.batch for b in part] == [0, 1, 2] and part[2].sample_ids.tolist() == [8, 9, 10, 11]
    resumed = ShardStream(shards, plan_rank(counts, 1, 0, 2, B, resume=3 * B), B, FMT)
    model, got = _model(), {}
    for b in part + list(resumed.iter_worker(0)) + list(resumed.iter_worker(1)):
        with torch.inference_mode():
            logits = model(b.inputs)
        for j, i in enumerate(b.sample_ids.tolist()):
            assert i not in got
            got[i] = logits[j]
    assert sorted(got) == sorted(full) and all(torch.equal(got[i], full[i][0]) for i in got)


def _wds_ids(urls, rank: int, world_size: int | None, worker: int, num_workers: int, monkeypatch,
             epoch: int | None = None) -> list:
    """The (url, key) ids webdataset's own split_by_node + split_by_worker give one consumer. webdataset reads
    rank/world from the RANK/WORLD_SIZE environment (else an initialised process group, else rank 0 of 1)
    and the worker from WORKER/NUM_WORKERS (else torch's worker info): webdataset/utils.py
    pytorch_worker_info."""
    import webdataset as wds

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if world_size is not None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("WORKER", str(worker))
    monkeypatch.setenv("NUM_WORKERS", str(num_workers))
    pipe = wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_node, wds.split_by_worker,
                            wds.tarfile_to_samples())
    if epoch is not None:
        pipe = pipe.with_epoch(epoch)
    return [(s["__url__"], s["__key__"]) for s in pipe]


def test_webdataset_split_by_node_and_worker_on_the_same_shards(shard_set, monkeypatch):
    """Measured, not assumed: (1) without RANK/WORLD_SIZE in the environment (a process group created from
    a config, as disteval's engine does, is not visible to webdataset unless torch.distributed is
    initialised in the reading process: DataLoader workers ask the env) every rank reads every shard: each
    sample W times; (2) with the env set, whole shards go to consumers round-robin, so consumers differ by up
    to a whole shard (37 samples vs 0) and the split follows shard boundaries, not global batches."""
    _, paths, _, _ = shard_set
    n, w, k = sum(SIZES), 3, 2
    ids = Counter(i for r in range(w) for j in range(k) for i in _wds_ids(paths, r, None, j, k, monkeypatch))
    assert len(ids) == n and set(ids.values()) == {w}  # every sample read W times: duplicated
    per = {(r, j): _wds_ids(paths, r, w, j, k, monkeypatch) for r in range(w) for j in range(k)}
    sizes = [len(v) for v in per.values()]
    assert Counter(i for v in per.values() for i in v) == Counter({i: 1 for i in ids})
    assert max(sizes) - min(sizes) >= 37 - 0  # e.g. [0, 23, 37, 2, 5, 13]: one shard per consumer or two
    # padding the short consumers to equal batch counts (what DDP evaluation loops do) must repeat samples
    ours = [len(p) for r in range(w) for p in plan_rank(SIZES, w, r, k, None)]
    assert max(ours) - min(ours) <= 1


class _Stop(Exception):
    pass


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loop_resume_mid_shard_equals_uninterrupted(shard_set, num_workers):
    """Through disteval's loop (evaluate_shard with a StreamSource, real DataLoader workers): rank 0 of 2 stops
    after 3 batches (inside shard 1); a run resumed from the evaluator state and the one samples-done count
    gives the uninterrupted metrics bit for bit and covers the rank's ids exactly once."""
    from disteval.data.streaming import StreamSource
    from disteval.rank.loop import CallbackHook, ShardSpec, evaluate_shard
    from disteval.metrics import ClassificationMetrics, check_coverage
    from disteval.metrics.evaluator import Evaluator

    out, paths, _, _ = shard_set
    source = StreamSource(load_index(str(out / "index.json"), paths), FMT)
    spec = ShardSpec(0, 2, B, num_workers=num_workers)
    model = _model()
    whole = Evaluator(ClassificationMetrics(10, topk=(1, 3)), bitwise=True)
    evaluate_shard(model, source, whole, spec)
    seen = {}

    def stop(progress):
        if progress.batches == 3:
            seen["state"], seen["samples"] = ev.state_dict(), progress.samples
            raise _Stop()

    ev = Evaluator(ClassificationMetrics(10, topk=(1, 3)), bitwise=True)
    with pytest.raises(_Stop):
        evaluate_shard(model, source, ev, spec, hooks=[CallbackHook(stop)])
    assert seen["samples"] == 3 * B
    resumed = Evaluator(ClassificationMetrics(10, topk=(1, 3)), bitwise=True)
    resumed.load_state_dict(seen["state"])
    spec.skip = seen["samples"]
    progress = evaluate_shard(model, source, resumed, spec)
    start, end = source.bounds(2, 0, B)
    assert progress.samples == end - start
    assert resumed.metric.compute() == whole.metric.compute()
    runs = resumed.coverage.runs().numpy()
    assert start == 0 and check_coverage(np.concatenate([runs, [[end, sum(SIZES)]]]), sum(SIZES)).ok  # (start, end) runs


def test_webdataset_equal_epochs_duplicate_and_drop(shard_set, monkeypatch):
    """webdataset's recipe for equal per-consumer sample counts under DDP, ``with_epoch(ceil(N / (W K)))``
    (DataPipeline.with_epoch: repeat the consumer's shards, cut at n; webdataset/pipeline.py), on the same
    shards: consumers with short shards read some samples twice, those with long shards stop early. Counted
    here, for W=3 and 2 workers."""
    _, paths, _, _ = shard_set
    n, w, k = sum(SIZES), 3, 2
    per = -(-n // (w * k))
    ids = Counter(i for r in range(w) for j in range(k)
                  for i in _wds_ids(paths, r, w, j, k, monkeypatch, epoch=per))
    every = {(p, f"s-{q:08d}") for p, (a, b) in zip(paths, zip(np.cumsum([0] + SIZES), np.cumsum(SIZES)))
             for q in range(a, b)}
    duplicated = sum(c - 1 for c in ids.values() if c > 1)
    dropped = len(every - set(ids))
    assert set(ids) <= every and duplicated > 0 and dropped > 0, (duplicated, dropped)
    # disteval's plans on the same counts: every sample once
    assert sorted(i for r in range(w) for p in plan_rank(SIZES, w, r, k, None) for a, b in p.spans
                  for i in range(a, b)) == list(range(n))


def test_image_text_pairs(tmp_path):
    """Image + ``.txt`` samples: targets are the captions (str, UTF-8), inputs the decoded RGB images."""
    import webdataset as wds
    from PIL import Image
    import io

    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(7, 6, 5, 3), dtype=np.uint8)
    path = tmp_path / "pairs.tar"
    with wds.TarWriter(str(path)) as sink:
        for i, img in enumerate(images):
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")  # lossless, so pixels compare with ==
            sink.write({"__key__": f"p{i}", "png": buf.getvalue(), "txt": f"caption {i} \u00e9"})
    shards = build_index([str(path)])
    ds = ShardStream(shards, plan_rank([7], 1, 0, 0, 3), 3, SampleFormat(image_mode="rgb8", target_field="txt"))
    batches = list(ds.iter_worker(0))
    assert [b.targets for b in batches] == [[f"caption {i} \u00e9" for i in range(a, min(a + 3, 7))]
                                               for a in (0, 3, 6)]
    x = torch.cat([b.inputs for b in batches])
    assert x.shape == (7, 3, 6, 5)
    assert torch.equal(x, torch.from_numpy(images.astype(np.float32) / 255.0).permute(0, 3, 1, 2))


def test_without_offsets_reads_prefixes_same_samples(shard_set):
    """An index without byte offsets (what remote URLs get) reaches a range by reading the shard's prefix:
    same batches and pixels as with offsets, more bytes read."""
    import dataclasses

    out, paths, _, _ = shard_set
    shards = load_index(str(out / "index.json"), paths)
    bare = [dataclasses.replace(s, offsets=None) for s in shards]
    counts = [s.num_samples for s in shards]
    for w, k in ((1, 0), (3, 2)):
        read = {}
        for name, index in (("offsets", shards), ("bare", bare)):
            got, read[name] = [], 0
            for r in range(w):
                ds = ShardStream(index, plan_rank(counts, w, r, k, B), B, FMT)
                got += [(b.batch, b.sample_ids.tolist(), b.inputs) for j in range(max(1, k))
                        for b in ds.iter_worker(j)]
                read[name] += ds.bytes_read[0]
            read[name + "_batches"] = got
        assert [(b, i) for b, i, _ in read["offsets_batches"]] == [(b, i) for b, i, _ in read["bare_batches"]]
        assert all(torch.equal(x, y) for (_, _, x), (_, _, y) in zip(read["offsets_batches"], read["bare_batches"]))
        assert read["bare"] >= read["offsets"]
    assert read["bare"] > read["offsets"]  # W=3 x 2 workers: ranges start inside shards


def _http_server(root: Path, ranges: bool):
    """A local HTTP server of ``root``; with ``ranges`` it answers ``Range: bytes=N-`` with 206 (Python's
    SimpleHTTPRequestHandler ignores Range and sends the whole file, as some servers do)."""
    import functools
    import http.server
    import threading

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            spec = self.headers.get("Range")
            if not ranges or not spec:
                return super().do_GET()
            data = (root / self.path.lstrip("/")).read_bytes()
            start = int(spec.split("=")[1].split("-")[0])
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            self.wfile.write(data[start:])

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.skipif(not __import__("shutil").which("curl"), reason="webdataset reads http(s) with curl")
def test_http_shards_byte_ranges(shard_set):
    """http shards: the index is built by streaming (webdataset's gopen, curl); each consumer asks for its
    byte range, so the bytes read are those of local seeks; a server that ignores byte ranges is an error
    naming the shard, never wrong samples."""
    out, paths, images, _ = shard_set
    local = load_index(str(out / "index.json"), paths)
    counts = [s.num_samples for s in local]
    for ranges in (True, False):
        server = _http_server(Path(out), ranges)
        try:
            urls = [f"http://127.0.0.1:{server.server_address[1]}/{Path(p).name}" for p in paths]
            shards = build_index(urls)
            assert [(s.keys, s.offsets) for s in shards] == [(s.keys, s.offsets) for s in local]
            assert all(s.size is None for s in shards)
            read, seen = {}, []
            for name, index in (("http", shards), ("local", local)):
                read[name] = 0
                for r in range(3):
                    ds = ShardStream(index, plan_rank(counts, 3, r, 2, B), B, FMT)
                    for j in range(2):
                        for b in ds.iter_worker(j):
                            if name == "http":
                                ids = b.sample_ids.numpy()
                                assert torch.equal(b.inputs[:, 0], torch.from_numpy(images[ids].astype(np.float32) / 255.0))
                                seen += ids.tolist()
                    read[name] += ds.bytes_read[0]
            assert sorted(seen) == list(range(sum(SIZES))) and read["http"] == read["local"]
            assert ranges
        except DataError as exc:
            assert not ranges and "ignored the byte range" in str(exc) and "/shard-0000" in str(exc)
        finally:
            server.shutdown()


def test_resume_keeps_skipped_ids(corrupt_set, tmp_path):
    """With data.on_decode_error=skip, a sample skipped before a preemption is still listed after the resume:
    the engine's checkpoint state carries the skipped positions (RankRun._checkpoint_state, written and read
    with disteval.rank.resume's save/load_checkpoint), the resumed loop starts from them."""
    from disteval.data.streaming import StreamSource
    from disteval.rank.engine import RankRun
    from disteval.rank.loop import CallbackHook, ShardSpec, evaluate_shard
    from disteval.metrics import ClassificationMetrics
    from disteval.metrics.evaluator import Evaluator
    from disteval.rank.resume import load_checkpoint, save_checkpoint

    out, paths, _, _ = corrupt_set
    source = StreamSource(load_index(str(out / "index.json"), paths), SampleFormat(image_mode="l8", on_decode_error="skip"))
    model, spec = _model(), ShardSpec(0, 1, B, num_workers=2)
    whole = Evaluator(ClassificationMetrics(10, topk=(1,)), bitwise=True)
    assert evaluate_shard(model, source, whole, spec).skipped == [7]
    ev, path, key = Evaluator(ClassificationMetrics(10, topk=(1,)), bitwise=True), tmp_path / "ckpt.pt", {"k": 1}

    def stop(progress):
        if progress.batches == 3:
            save_checkpoint(path, RankRun._checkpoint_state(ev, progress), progress.samples, key)
            raise _Stop()

    with pytest.raises(_Stop):
        evaluate_shard(model, source, ev, spec, hooks=[CallbackHook(stop)])
    ckpt = load_checkpoint(path, key)
    resumed = Evaluator(ClassificationMetrics(10, topk=(1,)), bitwise=True)
    resumed.load_state_dict(ckpt["state"])
    spec.skip, spec.skipped = ckpt["samples_done"], [int(i) for i in ckpt["state"]["stream_skipped"]]
    progress = evaluate_shard(model, source, resumed, spec)
    assert progress.skipped == [7] and progress.samples == sum(SIZES)
    assert resumed.metric.compute() == whole.metric.compute()


def test_driver_checks_shards_before_ranks_start(shard_set, tmp_path, monkeypatch, capsys):
    """The driver's data check (``check_data_root``, run before any rank starts): a stale ``data.index`` is a
    DataError naming the shard and how to rebuild it; without ``data.index`` the cached index is built, reused
    while it matches, rebuilt (and said so) when a shard changed; a truncated shard is a DataError naming it."""
    import shutil

    from omegaconf import OmegaConf

    from disteval.data.datasets import check_data_root

    _, paths, _, _ = shard_set
    for p in paths[:3]:
        shutil.copy(p, tmp_path / Path(p).name)
    urls = [str(tmp_path / Path(p).name) for p in paths[:3]]
    write_index(build_index(urls), str(tmp_path / "index.json"))
    monkeypatch.setenv("DISTEVAL_CACHE_DIR", str(tmp_path / "cache"))

    def data(**kw):
        return OmegaConf.create({"name": "webdataset", "split": "test", "urls": urls, "index": None,
                                 "allow_pipe": False, **kw})

    check_data_root(data(index=str(tmp_path / "index.json")))  # valid: accepted
    check_data_root(data())
    assert "indexing 3 shards" in capsys.readouterr().err
    check_data_root(data())
    assert capsys.readouterr().err == ""  # the cached index is reused
    os.utime(urls[1], ns=(1, 1))
    with pytest.raises(DataError, match=rf"stale shard index .*{Path(urls[1]).name} has size .*rebuild it"):
        check_data_root(data(index=str(tmp_path / "index.json")))
    check_data_root(data())
    assert "rebuilding the shard index: stale" in capsys.readouterr().err
    raw = Path(urls[1]).read_bytes()
    Path(urls[1]).write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataError, match=rf"{Path(urls[1]).name} is (unreadable or )?truncated"):
        check_data_root(data())


def test_dp_rank_and_size_come_from_the_caller_not_the_environment(shard_set, monkeypatch):
    """The streams take dp rank and size from the engine (here: rank 1 of 3, 2 workers), whatever RANK,
    WORLD_SIZE, WORKER and NUM_WORKERS say (webdataset's own splitters read them: webdataset/utils.py
    pytorch_worker_info), as the model-parallel issue needs (dp group != world)."""
    from disteval.data.streaming import StreamSource

    out, paths, _, _ = shard_set
    source = StreamSource(load_index(str(out / "index.json"), paths), FMT)
    start, end = source.bounds(3, 1, B)
    for env in ({}, {"RANK": "0", "WORLD_SIZE": "1", "WORKER": "0", "NUM_WORKERS": "1"},
                {"RANK": "4", "WORLD_SIZE": "8", "WORKER": "1", "NUM_WORKERS": "2"}):
        for name in ("RANK", "WORLD_SIZE", "WORKER", "NUM_WORKERS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        stream = source.stream(3, 1, 2, B, aligned=True)
        ids = sorted(i for j in range(2) for b in stream.iter_worker(j) for i in b.sample_ids.tolist())
        assert (start, end) == (28, 56) and ids == list(range(start, end)), env


@pytest.mark.parametrize("aligned", [True, False])
def test_given_batches_are_read_once_each_as_one_batch(shard_set, aligned):
    """A resume around recorded windows (``plan_rank`` given the batch spans): only the given position spans are read,
    each as exactly one batch with its own ids (also in fast mode, where a span need not start on the worker's
    grid), dealt to 3 workers round-robin so that in request order they arrive increasing; spans outside the
    rank's range are refused."""
    out, paths, images, _ = shard_set
    shards = load_index(str(out / "index.json"), paths)
    counts = [s.num_samples for s in shards]
    n = sum(counts)
    given = [(0, 4), (9, 12), (12, 16), (33, 35), (40, 44), (n - 3, n)]  # gaps: recorded windows
    plans = plan_rank(counts, 1, 0, 3, B if aligned else None, given)
    assert [p.spans for p in plans] == [tuple(given[0::3]), tuple(given[1::3]), tuple(given[2::3])]
    ds = ShardStream(shards, plans, B, FMT)
    per_worker = [list(ds.iter_worker(k)) for k in range(3)]
    in_request_order = [b for row in zip(*per_worker) for b in row]
    got = [tuple(b.sample_ids.tolist()) for b in in_request_order]
    assert got == [tuple(range(a, b)) for a, b in given]
    for b in in_request_order:  # the pixels are the images at those positions
        ids = b.sample_ids.numpy()
        assert torch.equal(b.inputs[:, 0], torch.from_numpy(images[ids]).float() / 255)
    # two short spans inside one batch-sized block of one worker stay two batches
    one = ShardStream(shards, plan_rank(counts, 1, 0, 0, B if aligned else None, [(0, 2), (2, 4)]), B, FMT)
    expect = [(0, 1, 2, 3)] if aligned else [(0, 1), (2, 3)]  # aligned: both lie in global batch 0
    assert [tuple(b.sample_ids.tolist()) for b in one.iter_worker(0)] == expect
    with pytest.raises(ValueError, match="not inside the rank's positions"):
        plan_rank(counts, 2, 1, 1, B, [(0, 4)])
