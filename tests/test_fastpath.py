"""The fast path's CPU-testable parts (issue 19): the device feed, persistent loader workers, compile and
channels_last settings recorded and bit-identical across world sizes, the compile warm-up timed apart.
The GPU parts (no host synchronisation under ``torch.cuda.set_sync_debug_mode("error")``, the side-stream
prefetch) are in tests/test_gpu.py, marked ``gpu``."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import load_results
from disteval.data.wds_stream import StreamBatch
from disteval.loop import DeviceFeed, ShardSpec, _batch_to, _PERSISTENT, make_loader


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
    doctor = subprocess.run([sys.executable, "-m", "diagnostics", "doctor", str(run3), "--json"],
                            capture_output=True, text=True, timeout=300)
    report = json.loads(doctor.stdout)
    flags = next(c for c in report["runs"][0]["checks"] if (c["state"], c["check"]) == ("CONVERGENCE", "flags"))
    assert "eval.compile=true" in flags["finding"] and "model.channels_last=true" in flags["finding"]


def test_bad_compile_backend_is_refused_before_ranks(cli):
    proc, run_dir = cli("eval.compile=true", "eval.compile_backend=nonesuch")
    assert proc.returncode == 2 and "eval.compile_backend" in proc.stderr and "nonesuch" in proc.stderr
    assert not (run_dir / "ranks").exists()
