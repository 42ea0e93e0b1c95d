"""The fast path's CPU-testable parts (issue 19): the device feed, persistent loader workers, compile and
channels_last settings recorded and bit-identical across world sizes, the compile warm-up timed apart.
The GPU parts (no host synchronisation under ``torch.cuda.set_sync_debug_mode("error")``, the side-stream
prefetch) are in tests/test_gpu.py, marked ``gpu``."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import SAMPLE, load_results, sample_tree
from recorded_runs import diagnostics_cli
from disteval.data.device_feed import _batch_to
from disteval.data.wds_stream import StreamBatch
from disteval.rank.loop import DeviceFeed, ShardSpec, _PERSISTENT, make_loader


class _Items(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x, y, i


def test_batch_to_moves_inputs_and_tensor_targets_keeps_ids_on_host():
    """On the meta device (a device that is not the CPU, so a copy really happens): nested inputs and tensor
    targets move, sample ids and non-tensor targets (detection's dicts) stay where they are."""
    x, y, ids = torch.zeros(2, 3), torch.tensor([1, 2]), torch.tensor([7, 8])
    mx, my, mids = _batch_to((x, y, ids), torch.device("meta"))
    assert mx.device.type == "meta" and my.device.type == "meta" and mids is ids
    nested, targets = [torch.zeros(3), {"a": torch.ones(2)}], [{"boxes": torch.zeros(1, 4)}]
    mn, mt, _ = _batch_to((nested, targets, ids), torch.device("meta"))
    assert mn[0].device.type == "meta" and mn[1]["a"].device.type == "meta" and mt is targets
    sb = StreamBatch(x, y, ids, torch.zeros(0, dtype=torch.int64), 0, 3)
    ms = _batch_to(sb, torch.device("meta"))
    assert isinstance(ms, StreamBatch) and ms.inputs.device.type == "meta" and ms.targets.device.type == "meta"
    assert ms.sample_ids is ids and (ms.worker, ms.batch) == (0, 3)


def test_device_feed_on_cpu_passes_batches_through():
    batches = [(torch.zeros(2), torch.ones(2), torch.arange(2)) for _ in range(3)]
    fed = list(DeviceFeed(batches, torch.device("cpu")))
    assert len(fed) == 3 and all(a is b for a, b in zip(fed, batches))


def test_persistent_workers_are_kept_for_the_next_trial():
    """``data.persistent_workers`` (with eval.trials > 1): the second trial iterates the same loader, whose
    worker processes stay up between passes; both passes yield the same batches."""
    ds = _Items(torch.arange(20.0).reshape(10, 2), torch.arange(10))
    spec = ShardSpec(rank=1, world_size=2, batch_size=3, num_workers=1, persistent_workers=True)
    try:
        first, _ = make_loader(ds, spec)
        a = [b[2].tolist() for b in first]
        pids = first._iterator._workers[0].pid  # the persistent iterator keeps its workers
        second, _ = make_loader(ds, spec)
        assert second is first
        b = [b[2].tolist() for b in second]
        assert a == b and first._iterator._workers[0].pid == pids and a == [[6, 7, 8], [9]]
        assert first.prefetch_factor == 4
    finally:
        _PERSISTENT.clear()
    plain, _ = make_loader(ds, ShardSpec(rank=1, world_size=2, batch_size=3, num_workers=1))
    assert plain is not first and not plain.persistent_workers


_KILLED_WITH_WORKERS = """
import json, os, sys, time
import torch
from torch.utils.data import Dataset
from disteval.rank.loop import ShardSpec, make_loader

class Big(Dataset):  # items that are not tensors: pickled through the workers' result pipe (~200 kB a batch)
    def __len__(self):
        return 64
    def __getitem__(self, i):
        return {"i": i, "payload": list(range(25_000))}

loader, _ = make_loader(Big(), ShardSpec(rank=0, world_size=1, batch_size=2, num_workers=2, prefetch_factor=4,
                                         collate_fn=lambda items: items))
batches = iter(loader)
next(batches)
print(json.dumps([w.pid for w in batches._workers]), flush=True)
time.sleep(60)  # the workers fill the pipe with prefetched batches while the rank is killed here
"""


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_loader_workers_end_with_a_killed_rank(tmp_path):
    """A rank SIGKILLed while its loader workers hold prefetched batches: the workers end at once (the kernel's
    parent-death signal), not after torch's 5 s watchdog, and never stay blocked writing to a result pipe that
    no one reads (they held the killed rank's pipes open, and torch's elastic agent then waited 30 s for it)."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WITH_WORKERS], stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        time.sleep(1.0)  # the workers prefetch until the pipe is full
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 2.0
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [p for p in pids if _alive(p)]
        assert not left, f"loader worker(s) {left} still alive 2 s after their rank was killed"
    finally:
        proc.kill()
        for p in pids if "pids" in locals() else []:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_compile_and_channels_last_are_recorded_and_bit_identical_across_world_sizes(cli):
    """eval.compile (backend ``eager``: dynamo traces the model, no kernel generation, so the test stays
    short; inductor's kernels are the same for every rank because shapes are static) with channels_last:
    W=1 and W=3 give the same metrics bit for bit; results.json records the settings and the first batch's
    seconds apart; the doctor's CONVERGENCE flags name both."""
    runs = {}
    for w in (1, 3):
        proc, run_dir = cli(f"dist.world_size={w}", "data.batch_size=50", "eval.compile=true",
                            "eval.compile_backend=eager", "model.channels_last=true", "eval.progress=false")
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[w] = (load_results(run_dir), run_dir)
    (r1, _), (r3, run3) = runs[1], runs[3]
    assert r1["metrics"] == r3["metrics"]
    for r in (r1, r3):
        c = r["compute"]
        assert (c["compile"], c["compile_backend"], c["channels_last"], c["inference_mode"]) == (True, "eager", True, True)
        assert r["throughput"]["warmup_s"] > 0 and r["model"]["class"] == "OptimizedModule"
        assert all(p["seconds"]["warmup"] > 0 for p in r["per_rank"])
    doctor = diagnostics_cli(["doctor", str(run3), "--json"], cwd=run3.parent)
    report = json.loads(doctor.stdout)
    flags = next(c for c in report["runs"][0]["checks"] if (c["state"], c["check"]) == ("CONVERGENCE", "flags"))
    assert "eval.compile=true" in flags["finding"] and "model.channels_last=true" in flags["finding"]


def test_bad_compile_backend_is_refused_before_ranks(cli):
    proc, run_dir = cli("eval.compile=true", "eval.compile_backend=nonesuch")
    assert proc.returncode == 2 and "eval.compile_backend" in proc.stderr and "nonesuch" in proc.stderr
    assert not (run_dir / "ranks").exists()


needs_sample = pytest.mark.skipif(not SAMPLE.is_dir(), reason=f"{SAMPLE} absent (../shared is not beside this checkout)")


@needs_sample
def test_device_decode_gives_the_host_path_pixels_on_the_cpu(tmp_path):
    """decode_jpeg + torchvision's antialiased resize on the CPU give the PIL path's pixels bit for bit on
    the shipped ImageNet images (measured: all 1000; here 48); a non-JPEG is a DataError naming its id."""
    from PIL import Image
    from torchvision.io import read_file

    from disteval.data.datasets import imagenet_eval_transform
    from disteval.data.device_decode import DeviceDecoder, EncodedImages
    from disteval.errors import DataError

    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    files = sorted(SAMPLE.glob("*.jpg"))[:48]
    decoded = DeviceDecoder(256, 224, mean, std)(EncodedImages([read_file(str(f)) for f in files], range(48)),
                                                  torch.device("cpu"))
    tf = imagenet_eval_transform(256, 224, mean, std)
    assert torch.equal(decoded, torch.stack([tf(Image.open(f).convert("RGB")) for f in files]))
    png = tmp_path / "x.png"
    Image.new("RGB", (8, 8)).save(png)
    batch = EncodedImages([read_file(str(files[0])), read_file(str(png))], [40, 41])
    with pytest.raises(DataError, match=r"sample id 41: not a decodable JPEG"):
        DeviceDecoder(256, 224, mean, std)(batch, torch.device("cpu"))


@needs_sample
@pytest.mark.slow
def test_decode_on_device_run_equals_host_decoding_at_every_world_size(cli, tmp_path):
    """``data.decode_on_device=true`` through the engine (loader workers read bytes; the step decodes): W=1 and
    W=2 equal the host-decoded run's metrics bit for bit (same pixels on the CPU), recorded in compute."""
    root = sample_tree(tmp_path / "val", limit=6)  # 6 classes, one image each
    common = ["data=imagefolder", f"data.root={root}", "model=mobilenet_v2", "model.weights=null",
              "model.num_classes=6", "data.batch_size=4", "data.num_workers=1", "eval.progress=false", "eval.classification.topk=[1]"]
    runs = {}
    for name, extra in (("host", ["dist.world_size=1"]), ("device1", ["dist.world_size=1", "data.decode_on_device=true"]),
                        ("device2", ["dist.world_size=2", "data.decode_on_device=true"])):
        proc, run_dir = cli(*common, *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = load_results(run_dir)
    assert runs["host"]["metrics"] == runs["device1"]["metrics"] == runs["device2"]["metrics"]
    assert runs["device2"]["compute"]["decode_on_device"] and not runs["host"]["compute"]["decode_on_device"]


def test_decode_on_device_is_refused_for_data_without_encoded_images(cli):
    proc, run_dir = cli("data.decode_on_device=true")
    assert proc.returncode == 2 and "data.decode_on_device" in proc.stderr


class _Stuck(_Items):
    """Item 4 never arrives in time (a worker stuck on a file, or one whose batch cannot be sent)."""

    def __getitem__(self, i):
        if i == 4:
            import time

            time.sleep(30)
        return super().__getitem__(i)


def test_a_stuck_loader_worker_fails_the_rank_instead_of_hanging():
    from disteval.errors import DataError
    from disteval.rank.loop import evaluate_shard
    from disteval.metrics.classification import ClassificationMetrics
    from disteval.metrics.evaluator import Evaluator

    ds = _Stuck(torch.zeros(8, 3), torch.zeros(8, dtype=torch.long))
    spec = ShardSpec(rank=0, world_size=1, batch_size=2, num_workers=1, loader_timeout_s=1.0)
    model = torch.nn.Identity()
    with pytest.raises(DataError, match=r"no batch from the loader workers after global batch 1 within "
                                        r"data.loader_timeout_s"):
        evaluate_shard(model, ds, Evaluator(ClassificationMetrics(3, topk=(1,))), spec)
