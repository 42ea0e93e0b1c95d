"""GPU checks of the fast path (issue 19). Marked ``gpu``: deselected (not skipped) where CUDA is absent, as in
CI (tests/conftest.py); ``scripts/gpu_check.sh`` runs them on a GPU machine.

- No host synchronisation per batch: the loop's own code (device feed, evaluator: metric update, coverage,
  float fold) and every device-resident metric's update run under ``torch.cuda.set_sync_debug_mode("error")``,
  which raises on any synchronising CUDA call (``.item()``, ``bool(t)``, ``nonzero``, a blocking copy). The
  model's forward is included for the classification CNN; torchvision's detectors synchronise inside NMS
  themselves and are left out (the detection metric copies its records to the host per batch by design:
  COCO matching runs on the CPU).
- Bit-identity across world sizes on one GPU: the same job at W = 1, 2, 3 (ranks sharing the GPU, gloo moving
  the states through host memory) gives the same metrics, compared with ==.
"""
from __future__ import annotations

import pytest
import torch

from conftest import load_results
from disteval.rank.loop import DeviceFeed
from disteval.metrics.classification import ClassificationMetrics
from disteval.metrics.collection import MetricCollection
from disteval.metrics.evaluator import Evaluator
from disteval.metrics.ranking import RankingMetrics
from disteval.models.reference_cnn import DigitsCNN

pytestmark = pytest.mark.gpu


def _batches(n: int, b: int, classes: int = 10):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, classes, (n,), generator=g)
    return [(x[i:i + b].pin_memory(), y[i:i + b].pin_memory(), torch.arange(i, min(i + b, n)))
            for i in range(0, n, b)]


def test_loop_and_metric_updates_issue_no_host_sync():
    dev = torch.device("cuda")
    model = DigitsCNN().eval().to(dev)
    metric = MetricCollection({"classification": ClassificationMetrics(10), "ranking": RankingMetrics(10)}).to(dev)
    ev = Evaluator(metric, bitwise=True, record_batches=False)
    batches = _batches(1000, 64)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.inference_mode():
            for k, (x, y, ids) in enumerate(DeviceFeed(batches, dev)):
                ev.process(k, model(x).float(), y, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ev.finish_local()  # the one host transfer: deferred checks and the local float total
    reference = ClassificationMetrics(10)
    with torch.inference_mode():
        for x, y, ids in batches:
            reference.update(model(x.to(dev)).float().cpu(), y, ids)
    assert metric.metrics["classification"].compute()["top1"] == reference.compute()["top1"]


def test_deferred_label_error_on_the_gpu_names_the_sample():
    from disteval.errors import DataError

    m = ClassificationMetrics(10).to("cuda")
    # the inputs made first: a tensor built from a Python list on the device is a blocking copy (a sync)
    logits, labels, ids = torch.zeros(3, 10, device="cuda"), torch.tensor([1, 11, 2], device="cuda"), torch.tensor([5, 6, 7])
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.update(logits, labels, ids)  # label 11 of 10 classes: recorded on the device, raised later
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with pytest.raises(DataError, match=r"sample id 6: label 11"):
        m.raise_deferred()


@pytest.mark.slow
def test_world_sizes_on_one_gpu_are_bit_identical(cli):
    metrics = {}
    for w in (1, 2, 3):
        proc, run_dir = cli(f"dist.world_size={w}", "dist.device=cuda", "communication.backend=gloo",
                            "data.batch_size=50", "eval.progress=false")
        assert proc.returncode == 0, proc.stderr[-3000:]
        r = load_results(run_dir)
        assert "cuda" in r["device"]
        metrics[w] = r["metrics"]
    assert metrics[1] == metrics[2] == metrics[3]


def test_canary_and_pin_on_the_gpu(cli):
    """Two ranks on the GPU, rank 1 with TF32 on (the tf32 drill: another GPU generation's defaults). warn: the
    canary runs on the device and, where TF32 changes the digits CNN's bits, finds two classes that differ in
    tf32; pin: TF32 off and highest matmul precision on every rank, the canary agrees (its record keeps the
    check before pinning), and the metrics == a one-rank GPU run."""
    job = ("dist.device=cuda", "communication.backend=gloo", "eval.progress=false")
    drill = {"DISTEVAL_FAULTS": "tf32@1"}
    proc, warn_dir = cli("dist.world_size=2", *job, env=drill)
    assert proc.returncode == 0, proc.stderr[-3000:]
    canary = load_results(warn_dir)["canary"]
    assert canary["policy"] == "warn" and "seconds" in canary
    if not canary["homogeneous"]:
        assert [c["ranks"] for c in canary["classes"]] == [[0], [1]] and "tf32" in canary["classes"][1]["differs"]
    proc, pin_dir = cli("dist.world_size=2", "dist.heterogeneous=pin", *job, env=drill)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pinned = load_results(pin_dir)
    assert pinned["canary"]["homogeneous"]
    if not canary["homogeneous"]:
        assert pinned["canary"]["pinned_cuda"]["tf32"] is False and not pinned["canary"]["before_pin"]["homogeneous"]
    proc, one_dir = cli("dist.world_size=1", *job)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert pinned["metrics"] == load_results(one_dir)["metrics"]
