"""Several checkpoints in one job (``model.checkpoints``), with real ranks: each checkpoint's metrics ``==`` the
metrics of its own one-checkpoint job (at another world size: bitwise mode), the per-checkpoint results files,
and bad sets refused before any rank starts, naming the key or the file."""
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from conftest import load_results, run_disteval
from recorded_runs import diagnostics_cli
from disteval.config import validated
from disteval.errors import ConfigError, DataError
from disteval.metrics.classification import ClassificationMetrics
from disteval.metrics.collection import PerModelMetrics
from disteval.models.checkpoint_set import expand_checkpoints
from disteval.testing.checkpoints import perturbed_checkpoints

SHIPPED = Path(__file__).resolve().parent.parent / "disteval" / "models" / "checkpoints" / "digits_cnn.pt"
JOB = ("+experiment=digits", "eval.progress=false")
KEEP = ("eval.save_predictions=true", "eval.predictions.logits=true", "eval.ci.resamples=100")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> list[Path]:
    """Three digits CNNs: the shipped weights and two seeded perturbations of them (different metrics)."""
    return perturbed_checkpoints(SHIPPED, tmp_path_factory.mktemp("ckpts"), (0.0, 0.3, 0.6), "step")


def test_each_checkpoint_equals_its_own_job(checkpoints, tmp_path):
    pattern = str(checkpoints[0].parent / "step_*.pt")
    proc = run_disteval(*JOB, *KEEP, f"model.checkpoints={pattern}", "dist.world_size=2", run_dir=tmp_path / "set")
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = load_results(tmp_path / "set")
    names = [b["name"] for b in job["checkpoints"]]
    assert names == ["step_0", "step_1", "step_2"] and list(job["metrics"]) == names
    assert "3 checkpoints on the same samples and batches" in proc.stdout
    for path, block in zip(checkpoints, job["checkpoints"]):
        own_dir = tmp_path / f"own_{path.stem}"
        one = run_disteval(*JOB, *KEEP, f"model.checkpoint={path}", "dist.world_size=1", run_dir=own_dir)
        assert one.returncode == 0, one.stderr[-3000:]
        own = load_results(own_dir)
        assert block["metrics"] == own["metrics"] == job["metrics"][block["name"]]
        assert block["path"] == str(path)
        member = json.loads((tmp_path / "set" / block["results"]).read_text())
        assert member["metrics"] == own["metrics"] and member["model"]["checkpoint"] == str(path)
        # its intervals and its prediction store are those of its own job
        ci = {k: v for k, v in block["confidence_intervals"].items() if k != "seconds"}
        assert ci == {k: v for k, v in own["confidence_intervals"].items() if k != "seconds"}
        store = tmp_path / "set" / "checkpoints" / block["name"] / "predictions"
        assert pq.read_table(store).sort_by("sample_id").equals(pq.read_table(own_dir / "predictions").sort_by("sample_id"))
        manifests = [json.loads((d / "_manifest.json").read_text())["model"] for d in (store, own_dir / "predictions")]
        assert manifests[0]["weights_digest"] == manifests[1]["weights_digest"] == block["weights_digest"]
        assert manifests[0]["checkpoint"] == str(path)
    # two checkpoints of the job compared on their stores, as two runs
    cmp = diagnostics_cli(["compare", str(tmp_path / "set/checkpoints/step_0"), str(tmp_path / "set/checkpoints/step_2"),
                           "--significance", "--json", "--resamples", "200"], cwd=tmp_path)
    assert cmp.returncode == 1, cmp.stderr[-2000:]
    assert json.loads(cmp.stdout)["significance"]["samples"] == job["dataset"]["num_samples"]
    # the three networks really differ (a set that forwarded one network three times would fail here)
    assert len({b["weights_digest"] for b in job["checkpoints"]}) == 3
    assert len({b["metrics"]["nll"] for b in job["checkpoints"]}) == 3
    # one sync for all: without stores and intervals, the collectives of a one-checkpoint job at the same W
    for name, spec in (("bare_set", f"model.checkpoints={pattern}"), ("bare_one", f"model.checkpoint={checkpoints[0]}")):
        proc = run_disteval(*JOB, spec, "dist.world_size=2", run_dir=tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # ... plus the broadcast of rank 0's expansion of the pattern (its length, then its bytes)
    set_ops, one_ops = (dict(load_results(tmp_path / n)["comm"]["by_op"]) for n in ("bare_set", "bare_one"))
    assert set_ops.pop("broadcast") == one_ops.pop("broadcast", 0) + 2 and set_ops == one_ops, (set_ops, one_ops)


def test_a_checkpoint_that_does_not_fit_is_named_before_ranks_start(checkpoints, tmp_path):
    bad = tmp_path / "wrong.pt"
    torch.save({"features.0.weight": torch.zeros(3, 3)}, bad)
    proc = run_disteval(*JOB, f"model.checkpoints=[{checkpoints[0]},{bad}]", "dist.world_size=2",
                        run_dir=tmp_path / "bad")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(bad) in proc.stderr and not (tmp_path / "bad" / "ranks").exists()
    assert not (tmp_path / "bad" / "results.json").exists()


def test_sets_that_cannot_be_expanded_or_combined_are_refused(checkpoints, tmp_path):
    folder = checkpoints[0].parent
    members = expand_checkpoints([str(checkpoints[2]), str(folder / "step_[01].pt")])
    assert [m.name for m in members] == ["step_2", "step_0", "step_1"]  # listed order, a pattern's files sorted
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    same_stem = [tmp_path / "a" / "last.pt", tmp_path / "b" / "last.pt"]
    for p in same_stem:
        p.write_bytes(b"x")
    assert [m.name for m in expand_checkpoints([str(p) for p in same_stem])] == ["a_last", "b_last"]
    dotted = [tmp_path / "a" / "x.y.pt", tmp_path / "a" / "x_y.pt"]  # the same name once cleaned
    for p in dotted:
        p.write_bytes(b"x")
    assert [m.name for m in expand_checkpoints([str(p) for p in dotted])] == ["x_y", "x_y-2"]
    cases = {"matches no file": str(folder / "epoch_*.pt"), "does not exist": [str(checkpoints[0]), "/nope.pt"],
             "listed more than once": [str(checkpoints[0]), str(checkpoints[0])],
             "use model.checkpoint for a single file": [str(checkpoints[0])]}
    for message, spec in cases.items():
        with pytest.raises(ConfigError, match=message) as info:
            expand_checkpoints(spec)
        assert info.value.key == "model.checkpoints"
    two = [str(checkpoints[0]), str(checkpoints[1])]
    for key, value in {"eval.trials": 2, "model.checkpoint": str(checkpoints[0]),
                       "eval.exclude_outlier_ranks": True}.items():
        group, _, leaf = key.rpartition(".")
        cfg = {"model": {"checkpoints": two}, "eval": {}}
        node = cfg
        for part in group.split("."):
            node = node.setdefault(part, {})
        node[leaf] = value
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            validated(cfg)


def test_per_model_metrics_route_one_output_per_model():
    metrics = PerModelMetrics({"a": ClassificationMetrics(3, topk=(1,)), "b": ClassificationMetrics(3, topk=(1,))})
    logits = torch.eye(3, dtype=torch.float32)
    targets, ids = torch.tensor([0, 1, 2]), torch.arange(3)
    metrics.update((logits, logits.flip(0)), targets, ids)
    out = metrics.compute()
    assert out["a"]["top1"] == 1.0 and out["b"]["top1"] == 1 / 3
    assert set(metrics.states()) == {f"{m}.{s}" for m in "ab" for s in ClassificationMetrics(3, topk=(1,)).states()}
    with pytest.raises(ValueError, match="a tuple of 2 outputs"):
        metrics.update(logits, targets, ids)
    nan = logits.clone()
    nan[1, 0] = float("nan")
    metrics.update((logits, nan), targets, ids)
    with pytest.raises(DataError, match="checkpoint b: .*sample id 1"):
        metrics.raise_deferred()


def _members_rank(rank: int, store_path: str, cwds: list[str], out: str) -> None:
    """One of two gloo ranks: in its own working directory (where the relative pattern finds other files), the
    set it evaluates (``model_set.members_of`` with the communicator), written to OUT/rank{r}.json."""
    import os

    import torch.distributed as dist

    from disteval.comm import Communicator
    from disteval.rank.model_set import members_of

    os.chdir(cwds[rank])
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        cfg = validated({"model": {"checkpoints": "ckpts/*.pt"}})
        got = [[m.name, m.path] for m in members_of(cfg, Communicator("cpu"))]
        Path(out, f"rank{rank}.json").write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_every_rank_evaluates_rank_0s_expansion_of_the_pattern(checkpoints, tmp_path):
    """Two real ranks whose working directories hold different files for the same relative pattern (as nodes with
    different filesystems would): both evaluate rank 0's files, in rank 0's order (each rank globbing on its own
    would give rank 1 the other set)."""
    import torch.multiprocessing as mp

    cwds = []
    for r, picks in enumerate(((0, 1), (1, 2))):
        (tmp_path / f"cwd{r}" / "ckpts").mkdir(parents=True)
        for i in picks:
            (tmp_path / f"cwd{r}" / "ckpts" / f"m{i}.pt").write_bytes(checkpoints[i].read_bytes())
        cwds.append(str(tmp_path / f"cwd{r}"))
    mp.spawn(_members_rank, args=(str(tmp_path / "store"), cwds, str(tmp_path)), nprocs=2, join=True)
    want = [[m.name, m.path] for m in expand_checkpoints(f"{cwds[0]}/ckpts/*.pt")]
    assert [n for n, _ in want] == ["m0", "m1"]
    for r in range(2):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == want, r
