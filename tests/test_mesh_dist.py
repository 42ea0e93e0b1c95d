"""Model-parallel evaluation with real ranks (gloo, CPU): a small torchvision VisionTransformer split by a device
mesh of dp_replicate x dp_shard x tp (FSDP2 over dp_shard, tensor parallelism over tp), generated data whose
global batches divide unevenly among the data-parallel ranks. One group of 4 ranks runs dp=2 x tp=2,
dp_shard=2 x tp=2, dp_shard=4, dp=4 and tp=4 (and the two mistakes); one group of 3 ranks runs dp=3 and
dp_shard=3. References: the unsplit model in this process (tp=1) and, for tp=2, the same mesh evaluating the
whole dataset on one data-parallel rank."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from disteval.data.sharding import lockstep_plan
from disteval.rank.loop import ShardSpec, evaluate_shard
from disteval.metrics import ClassificationMetrics
from disteval.metrics.evaluator import Evaluator
from disteval.models.parallel_plans import prepare_vit
from launchers.local import launch
from mesh_workers import BATCH, EVEN, NUM_CLASSES, SIZES, Capture, make_data, make_model, mesh_worker

# one size per case where it makes the dp ranks' batch counts unequal (9 global batches at N=33: 5/4, 3/2/2/2;
# 10 at N=37: 4/3/3), both sizes for dp=3 so that each size has tp=1 runs at dp sizes 1, 3 and 4
N33, N37 = SIZES
CASES_4 = [{"name": "dp2_tp2", "dims": [2, 1, 2], "mode": "run", "sizes": [N33]},
           {"name": "shard2_tp2", "dims": [1, 2, 2], "mode": "run", "sizes": [N33]},
           {"name": "shard4", "dims": [1, 4, 1], "mode": "run", "sizes": [N33]},
           {"name": "dp4", "dims": [4, 1, 1], "mode": "run", "sizes": [N33]},
           {"name": "tp4", "dims": [1, 1, 4], "mode": "run", "sizes": [N33]},
           {"name": "dp1_tp2", "dims": [2, 1, 2], "mode": "whole", "sizes": [N33]},
           {"name": "by_global_rank", "dims": [2, 1, 2], "mode": "global_rank", "sizes": [EVEN]},
           {"name": "sync_over_world", "dims": [2, 1, 2], "mode": "world_sync", "sizes": [N33]}]
CASES_3 = [{"name": "dp3", "dims": [3, 1, 1], "mode": "run", "sizes": [N33, N37]},
           {"name": "shard3", "dims": [1, 3, 1], "mode": "run", "sizes": [N37]}]
SIZES_OF = {c["name"]: c["sizes"] for c in CASES_4 + CASES_3}
INTEGER_KEYS = ("num_samples", "per_class_support", "classes_with_samples")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Rank files of both groups: {(case, n): [meta per rank]} and {(case, n): logits [n, C] from the TP rank 0
    of every dp rank, in sample order}."""
    out = tmp_path_factory.mktemp("mesh")
    launch(mesh_worker, (str(out), CASES_4), 4, str(out))
    launch(mesh_worker, (str(out), CASES_3), 3, str(out))
    metas, logits = {}, {}
    for case in CASES_4 + CASES_3:
        world = 4 if case in CASES_4 else 3
        for n in case.get("sizes", SIZES):
            files = [torch.load(out / f"{case['name']}_{n}_rank{r}.pt", weights_only=True) for r in range(world)]
            metas[case["name"], n] = [json.loads(f["meta"]) for f in files]
            parts = {m["start"]: f["logits"] for m, f in zip(metas[case["name"], n], files) if m["tp_rank"] == 0}
            logits[case["name"], n] = torch.cat([parts[k] for k in sorted(parts)])
    return metas, logits


@pytest.fixture(scope="module")
def reference():
    """The unsplit model in this process, one rank: {n: (logits [n, C], metrics)}; under key ("prepared", n)
    the same with ``prepare_vit``'s attention (the layout tensor parallelism splits), unsplit."""
    out = {}
    for key, model in ((None, make_model()), ("prepared", prepare_vit(make_model()))):
        for n in SIZES:
            ev, cap = Evaluator(ClassificationMetrics(NUM_CLASSES, topk=(1,))), Capture()
            evaluate_shard(model, make_data(n), ev, ShardSpec(0, 1, BATCH), hooks=[cap])
            out[n if key is None else (key, n)] = torch.cat(cap.outputs), ev.metric.compute()
    return out


def test_plan_counts_dummy_steps_from_batch_counts():
    # 9 global batches: dp_shard=4 gives 3,2,2,2 batches, so ranks 1-3 run one dummy forward each
    assert lockstep_plan(33, 4, 1, 4) == {"batches": [3, 2, 2, 2], "dummy_steps": [0, 1, 1, 1]}
    # two replica groups of dp_shard=2: lockstep within each group only
    assert lockstep_plan(37, 4, 2, 2) == {"batches": [3, 3, 2, 2], "dummy_steps": [0, 0, 0, 0]}
    assert lockstep_plan(33, 4, 2, 2) == {"batches": [3, 2, 2, 2], "dummy_steps": [0, 1, 0, 0]}
    assert lockstep_plan(33, 4, 4, 1)["dummy_steps"] == [0, 0, 0, 0]  # no sharded parameters: no peer in a forward
    assert lockstep_plan(33, 4, 1, 2, aligned=False) == {"batches": [5, 4], "dummy_steps": [0, 1]}  # 17 and 16 samples


@pytest.mark.parametrize("name", ["dp2_tp2", "shard2_tp2", "shard4", "dp4", "tp4", "dp3", "shard3"])
def test_counts_exact_and_lockstep_as_planned(runs, reference, name):
    metas, logits = runs
    for n in SIZES_OF[name]:
        ranks = metas[name, n]
        want = reference[n][1]
        for m in ranks:
            assert m["coverage_ok"] and m["sync_collectives"] == 2  # one sync over the dp group: all_reduce, all_gather
            assert m["batches"] == m["plan"]["batches"][m["dp_rank"]]
            assert m["dummy_steps"] == m["plan"]["dummy_steps"][m["dp_rank"]]
            for key in INTEGER_KEYS:
                assert m["metrics"][key] == want[key], (name, n, key)
            assert m["metrics"] == ranks[0]["metrics"]  # every rank holds the same synchronised numbers
        # TP peers of one dp rank evaluated the same samples into the same states
        for dp in {m["dp_rank"] for m in ranks}:
            assert len({json.dumps(m["tp_check"]) for m in ranks if m["dp_rank"] == dp}) == 1
        assert logits[name, n].shape == (n, NUM_CLASSES)
    dims = next(c["dims"] for c in CASES_4 + CASES_3 if c["name"] == name)
    if dims[1] > 1:  # FSDP: the uneven sizes really made ranks run dummy forwards
        assert any(m["dummy_steps"] > 0 for n in SIZES_OF[name] for m in metas[name, n])
    if dims[0] * dims[1] > 1:  # uneven dp shards
        assert any(len(set(metas[name, n][0]["plan"]["batches"])) > 1 for n in SIZES_OF[name])


@pytest.mark.parametrize("name", ["dp4", "shard4", "dp3", "shard3"])
def test_tp1_bit_identical_to_single_process(runs, reference, name):
    metas, logits = runs
    for n in SIZES_OF[name]:
        assert torch.equal(logits[name, n], reference[n][0]), (name, n)
        assert metas[name, n][0]["metrics"] == reference[n][1], (name, n)


def test_tp2_bit_identical_across_dp_sizes(runs):
    """For tp=2: dp size 1 (the whole set on one dp rank) equals dp=2 (replicated) and dp_shard=2 (FSDP)."""
    metas, logits = runs
    for name in ("dp2_tp2", "shard2_tp2"):
        assert torch.equal(logits[name, N33], logits["dp1_tp2", N33]), name
    assert metas["dp2_tp2", N33][0]["metrics"] == metas["shard2_tp2", N33][0]["metrics"]


def test_tensor_parallel_float_difference_measured(runs, reference):
    """tp > 1 against tp = 1, measured (docs/model-parallel.md): the logits differ by a few float32 ulps; the argmax, hence
    every integer count, is the same. The difference comes from the attention's layout (``prepare_vit``:
    scaled_dot_product_attention instead of nn.MultiheadAttention's fused path); against the same layout
    unsplit, tp = 2 and tp = 4 are compared too (row-parallel layers sum partial products in another order)."""
    metas, logits = runs
    for name in ("dp1_tp2", "tp4"):
        got = logits[name, N33]
        diff = (got - reference[N33][0]).abs().max().item()
        split = (got - reference["prepared", N33][0]).abs().max().item()
        scale = reference[N33][0].abs().max().item()
        print(f"{name} N={N33}: max |logit - tp1| = {diff:.3g}, vs the unsplit prepared layout {split:.3g} "
              f"(max |logit| {scale:.3g})")
        assert diff <= 1e-6 * scale and split <= 1e-6 * scale
        assert torch.equal(got.argmax(1), reference[N33][0].argmax(1))
    got, want = metas["tp4", N33][0]["metrics"]["nll"], reference[N33][1]["nll"]
    print(f"tp4 nll {got!r} vs tp1 {want!r}: relative difference {abs(got - want) / want:.3g}")
    assert abs(got - want) <= 1e-6 * want


def test_split_by_global_rank_is_caught_at_sync(runs):
    """The mistake: data split by global rank. TP peers then forward different samples (the all_reduce of the
    row-parallel layers mixes them) and over the world every sample is still seen once, but by a TP group of
    which only one rank holds it; the TP check names the ranks."""
    metas, _ = runs
    for m in metas["by_global_rank", EVEN]:
        peers = [0, 1] if m["rank"] < 2 else [2, 3]
        assert f"tensor-parallel peers {peers} evaluated different samples" in m["error"]
        assert "split by data-parallel rank, not by global rank" in m["error"]


def test_sync_over_world_would_double_count(runs):
    """The other mistake: correct data split but metric states summed over all ranks, TP peers included: every
    sample counted tp = 2 times; the coverage check reports each id duplicated."""
    metas, _ = runs
    n = N33
    for m in metas["sync_over_world", n]:
        assert m["metrics"]["num_samples"] == 2 * n
        assert m["coverage"] == {"ok": False, "duplicated": n, "missing": 0}


def test_counts_match_numpy_reference(reference):
    """The single-process reference itself against numpy: top-1 and class support."""
    for n in SIZES:
        logits, metrics = reference[n]
        labels = np.array([int(make_data(n)[i][1]) for i in range(n)])
        assert metrics["per_class_support"] == np.bincount(labels, minlength=NUM_CLASSES).tolist()
        assert metrics["top1"] == float(np.mean(logits.numpy().argmax(1) == labels))
