"""Compression as pure functions (exact round trips, wire sizes, measured error) and the refusal to
compress states a metric declares exact."""
import numpy as np
import pytest
import torch

from disteval.comm import compression as cz
from disteval.rank.sync import SyncPolicy, check_sync_policy
from disteval.errors import ConfigError
from disteval.metrics import ClassificationMetrics, MetricCollection, RankingMetrics


@pytest.mark.parametrize("lo,hi,wire", [(0, 9, torch.uint8), (-128, 127, torch.uint8), (-5, 999, torch.int16),
                                        (0, 2 ** 31 - 1, torch.int32), (-(2 ** 40), 2 ** 40, torch.int64)])
def test_integers_narrow_to_the_smallest_dtype_of_the_global_range(lo, hi, wire):
    x = torch.tensor([[lo, hi], [hi, lo]], dtype=torch.int64)
    p = cz.plan("lossless", torch.int64, False, lo, hi)
    w = cz.encode(x, p)
    assert w.dtype == wire
    assert torch.equal(cz.decode(w, p, torch.int64, tuple(x.shape)), x)


def test_bits_and_float32_round_trip():
    flags = torch.from_numpy(np.random.default_rng(0).random((13, 3)) > 0.5)
    p = cz.plan("lossless", torch.bool, False)
    w = cz.encode(flags, p)
    assert w.numel() == cz.encoded_rows(p, 13, 3) == 5  # ceil(39 / 8)
    assert torch.equal(cz.decode(w, p, torch.bool, (13, 3)), flags)
    halves = torch.tensor([0.5, 1.25, float("inf"), float("nan")], dtype=torch.float64)
    assert cz.exact_in_float32(halves) and not cz.exact_in_float32(torch.tensor([0.1], dtype=torch.float64))
    p = cz.plan("lossless", torch.float64, False, all_exact_f32=True)
    got = cz.decode(cz.encode(halves, p), p, torch.float64, (4,))
    assert torch.equal(got[:3], halves[:3]) and torch.isnan(got[3])


def test_lossy_only_for_compressible_floats_and_error_measured():
    x = torch.tensor([1.0, 1 + 2 ** -12, 3.14159, 0.0, -2e-3], dtype=torch.float64)
    assert cz.plan("fp16", torch.float64, compressible=False).kind == "raw"
    assert cz.plan("fp16", torch.int64, compressible=True).kind == "raw"
    p = cz.plan("fp16", torch.float64, compressible=True)
    q = x.numpy().astype(np.float16).astype(np.float64)  # numpy's correctly rounded cast
    abs_err, rel_err = cz.lossy_error(x, p)
    err = np.abs(q - x.numpy())
    assert abs_err == err.max() and rel_err == pytest.approx((err[x != 0] / np.abs(x.numpy()[x != 0])).max())
    assert cz.lossy_error(x, cz.plan("none", torch.float64, True)) == (0.0, 0.0)


def _metric():
    return MetricCollection({"classification": ClassificationMetrics(10), "ranking": RankingMetrics(10)})


@pytest.mark.parametrize("mode,states,needle", [
    ("fp16", ["ranking.targets"], "declared exact"),
    ("bf16", ["classification.count"], "exact sum-state"),
    ("lossless", ["classification.confusion"], "exact sum-state"),
    ("fp16", ["ranking.logits"], "unknown state")])
def test_refuses_to_compress_exact_states_naming_them(mode, states, needle):
    with pytest.raises(ConfigError, match="communication.compress_states") as info:
        check_sync_policy(_metric(), SyncPolicy(mode, states))
    assert needle in str(info.value) and states[0] in str(info.value)


def test_allowed_requests_pass():
    check_sync_policy(_metric(), SyncPolicy("fp16", ["ranking.scores"]))
    check_sync_policy(_metric(), SyncPolicy("lossless", ["ranking.targets", "ranking.scores"]))
    check_sync_policy(_metric(), SyncPolicy("fp16", None))


def test_only_float_gather_states_can_be_declared_compressible():
    m = ClassificationMetrics(3, topk=(1,))
    with pytest.raises(ValueError, match="compressible"):
        m.add_state("n", torch.zeros((), dtype=torch.int64), "sum", compressible=True)
    with pytest.raises(ValueError, match="sliceable"):
        m.add_state("s", torch.zeros((0, 3)), "gather", sliceable=True)
