"""``dist.parallel`` through ``python -m disteval``: the config checks before any rank starts, and one run of
4 ranks as dp_shard=2 x tp=2 (FSDP2 and tensor parallelism on a small ViT from a checkpoint) on a generated
ImageFolder whose 3 global batches split 2/1 between the data-parallel ranks."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import load_results, run_disteval
from disteval.config import ParallelConfig
from disteval.errors import ConfigError
from disteval.models.builders import tp_split_problems
from disteval.models.parallel_plans import prepare_vit, vit_state_dict_to_tp_layout
from disteval.models.reference_cnn import vit_tiny
from omegaconf import OmegaConf
from diagnostics.evidence import load_run
from diagnostics.machine import diagnose
from reference import reference_metrics
from test_imagenet import _tree

VIT = ("+experiment=imagenet_vit", "model.name=vit_tiny", "model.num_classes=3", "data.resize_size=32",
       "data.crop_size=32", "eval.classification.topk=[1,2]", "data.batch_size=4")


def test_parallel_config_product_must_equal_world_size():
    ParallelConfig().validate(3)  # all null: no mesh
    ParallelConfig(tp=2, dp_replicate=2).validate(4)
    with pytest.raises(ConfigError, match=r"dist.parallel: dp_replicate=1 x dp_shard=2 x tp=2 = 4 ranks, but "
                                          r"dist.world_size=3"):
        ParallelConfig(dp_shard=2, tp=2).validate(3)
    with pytest.raises(ConfigError, match="dist.parallel.tp"):
        ParallelConfig(tp=0).validate(1)


def test_tp_alone_leaves_the_rest_to_data_parallel_ranks():
    """``dist.world_size=4 dist.parallel.tp=2`` (README's 2 x 2 mesh): dp_replicate takes world_size / tp, in the
    driver's check and in the ranks' mesh (``dims_from_config`` on the composed job config); a world size that tp
    does not divide is refused, saying what to set."""
    from hydra import compose, initialize_config_dir

    from disteval.config import conf_dir, register_schemas, validated
    from disteval.rank.parallel import dims_from_config

    assert ParallelConfig(tp=2).degrees(4) == (2, 1, 2) and ParallelConfig(tp=2, dp_shard=1).degrees(4) == (1, 1, 2)
    register_schemas()
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        cfg = compose("config", ["+experiment=imagenet_vit_tp", "dist.world_size=4", "dist.parallel.tp=2"])
    dims = dims_from_config(validated(cfg), 4)  # as a rank receives it: the typed config
    assert (dims.dp_replicate, dims.dp_shard, dims.tp, dims.dp_size) == (2, 1, 2, 2)
    with pytest.raises(ConfigError, match=r"dist.world_size=5: the product must equal the world size \(with "
                                          r"dp_replicate and dp_shard null.*a multiple of 2"):
        ParallelConfig(tp=2).validate(5)


def test_bad_mesh_fails_before_ranks_start(cli, tmp_path):
    root = _tree(tmp_path / "val", per_class=1)
    proc, run_dir = cli(*VIT, f"data.root={root}", "dist.world_size=3", "dist.parallel.tp=2")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "dp_replicate=1 x dp_shard=1 x tp=2 = 2 ranks, but dist.world_size=3" in text
    assert not (run_dir / "ranks").exists()


def test_vit_attention_prepared_for_tp_keeps_the_weights():
    """``prepare_vit`` puts nn.MultiheadAttention's weights head-major into one nn.Linear; the converted torchvision
    state dict is exactly the prepared model's, and the outputs agree with the original to float32 rounding."""
    torch.manual_seed(0)
    original = vit_tiny(num_classes=3, image_size=32, num_heads=4).eval()
    state = {k: v.clone() for k, v in original.state_dict().items()}
    prepared = prepare_vit(copy.deepcopy(original))
    converted = vit_state_dict_to_tp_layout(state, 4)
    assert converted.keys() == prepared.state_dict().keys()
    assert all(torch.equal(converted[k], v) for k, v in prepared.state_dict().items())
    w = state["encoder.layers.encoder_layer_0.self_attention.in_proj_weight"]  # [Wq; Wk; Wv], head_dim 8
    qkv = converted["encoder.layers.encoder_layer_0.self_attention.qkv.weight"]
    assert torch.equal(qkv[:8], w[:8]) and torch.equal(qkv[8:16], w[32:40]) and torch.equal(qkv[16:24], w[64:72])
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(prepared(x), original(x), rtol=1e-5, atol=1e-5)


def test_tp_degree_must_divide_heads_and_mlp_width():
    """preflight's check (``check_parallel``), on the meta device: vit_tiny has 2 heads and an MLP of 64."""
    cfg = OmegaConf.create({"model": {"name": "vit_tiny", "num_classes": 3, "kwargs": None}})
    assert tp_split_problems(cfg.model, 2) == []
    problems = tp_split_problems(cfg.model, 4)
    assert problems == ["attention heads (encoder.layers.0.self_attention.num_heads = 2) is not a multiple of tp=4"]
    assert tp_split_problems(OmegaConf.create({"name": "vit_tiny", "num_classes": 3, "kwargs": {"mlp_dim": 65}}), 2) == [
        "MLP width (encoder.layers.0.mlp.0.out_features = 65) is not a multiple of tp=2"]
    assert "no tensor-parallel plan for DigitsCNN" in tp_split_problems(
        OmegaConf.create({"name": "digits_cnn", "num_classes": 10, "kwargs": None}), 2)[0]


@pytest.fixture(scope="module")
def mesh_run(tmp_path_factory):
    """One real run of 4 ranks, dp_shard=2 x tp=2: (run_dir, CompletedProcess, model, data root)."""
    tmp_path = tmp_path_factory.mktemp("meshcli")
    root = _tree(tmp_path / "val", per_class=3)  # 9 images: global batches of 4, 4, 1 -> dp ranks hold 2 and 1
    torch.manual_seed(0)
    model = vit_tiny(num_classes=3, image_size=32).eval()
    torch.nn.init.normal_(model.heads.head.weight)  # torchvision starts the head at zero
    torch.save(model.state_dict(), tmp_path / "vit.pt")
    run_dir = tmp_path / "run"
    proc = run_disteval(*VIT, f"data.root={root}", f"model.checkpoint={tmp_path / 'vit.pt'}", "dist.world_size=4",
                        "dist.parallel.dp_shard=2", "dist.parallel.tp=2", run_dir=run_dir)
    return run_dir, proc, model, root


def test_fsdp_and_tp_run_exact_with_planned_dummy_steps(mesh_run):
    run_dir, proc, model, root = mesh_run
    assert proc.returncode == 0, proc.stderr
    res = load_results(run_dir)
    par = res["parallel"]
    assert (par["dp_replicate"], par["dp_shard"], par["tp"], par["dp_size"]) == (1, 2, 2, 2)
    assert par["mesh_dim_names"] == ["dp_replicate", "dp_shard", "tp"]
    assert par["batches_per_dp_rank"] == [2, 1] and par["dummy_steps_per_dp_rank"] == [0, 1]
    rows = res["per_rank"]
    assert [(r["rank"], r["dp_rank"], r["tp_rank"]) for r in rows] == [(0, 0, 0), (2, 1, 0)]  # rank 0's dp group
    assert [r["dummy_steps"] for r in rows] == [0, 1] and [r["samples"] for r in rows] == [8, 1]
    assert res["exact"] and res["coverage"]["ok"]
    for r in range(4):  # every rank recorded its place in the mesh and its plan
        status = json.loads((run_dir / "ranks" / f"rank{r}" / "status.json").read_text())
        assert status["parallel"]["tp_peers"] == ([0, 1] if r < 2 else [2, 3])
        assert status["parallel"]["dummy_steps_planned"] == (0 if r < 2 else 1)
        assert status["phase"] == "done"
    # independent single-process reference: torchvision's ImageFolder, the same transform, the unsplit model
    tf = T.Compose([T.Resize(32, antialias=True), T.CenterCrop(32), T.ToTensor(),
                    T.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    ds = ImageFolder(str(root), transform=tf)
    with torch.no_grad():
        logits = model(torch.stack([ds[i][0] for i in range(len(ds))])).numpy()
    want = reference_metrics(logits, np.array(ds.targets), 3, topk=(1, 2))
    got = res["metrics"]
    assert got["num_samples"] == 9 and got["per_class_support"] == [3, 3, 3]
    for k in ("top1", "top2", "macro_f1"):
        assert got[k] == pytest.approx(want[k], rel=1e-12), k
    assert got["nll"] == pytest.approx(want["nll"], rel=1e-5)


def _copy(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


def _status(run: Path, r: int) -> dict:
    return json.loads((run / "ranks" / f"rank{r}" / "status.json").read_text())


def _write_status(run: Path, r: int, record: dict) -> None:
    (run / "ranks" / f"rank{r}" / "status.json").write_text(json.dumps(record))


def _finding(diag, state: str, check: str):
    return next(f for f in diag.findings if (f.state, f.check) == (state, check))


def test_doctor_reads_the_mesh_of_a_healthy_run(mesh_run):
    diag = diagnose(load_run(mesh_run[0]))
    assert diag.verdict is None, [f.as_dict() for f in diag.findings if f.status == "fail"]
    mesh = _finding(diag, "SHARDS", "mesh")
    assert mesh.status == "pass" and "batches per dp rank [2, 1], planned dummy steps [0, 1]" in mesh.finding
    assert _finding(diag, "SHARDS", "plan").status == "pass"  # shards over the 2 dp ranks, not the 4 ranks
    assert _finding(diag, "COMM", "tp_peers").status == "pass"


def test_doctor_counts_each_sample_once_per_data_parallel_group_without_results(mesh_run, tmp_path):
    """A failed mesh run leaves no results.json: N comes from the shards the ranks planned, one rank per
    data-parallel group (its TP peers plan the same samples), so the plan check neither counts a sample once per
    TP peer nor blames rank 0 for "ranks disagree on the dataset"."""
    run = _copy(mesh_run[0], tmp_path / "no_results")
    (run / "results.json").unlink()
    f = _finding(diagnose(load_run(run)), "SHARDS", "plan")
    assert f.status == "pass" and "exact shards of N=9 over W=2" in f.finding, f.as_dict()


def test_doctor_names_missing_dummy_steps_tp_digests_and_where_ranks_hang(mesh_run, tmp_path):
    """The real run's records, each changed as the failure would have left them."""
    # rank 3 (dp rank 1) skipped its planned dummy step
    run = _copy(mesh_run[0], tmp_path / "dummy")
    record = _status(run, 3)
    record["dummy_steps_done"] = 0
    _write_status(run, 3, record)
    f = _finding(diagnose(load_run(run)), "SHARDS", "mesh")
    assert f.status == "fail" and f.culprit == 3 and "ran 0 of its 1 planned dummy steps" in f.finding
    # TP peers [2, 3] were fed different samples: the TP check's error, as check_tp_peers words it
    run = _copy(mesh_run[0], tmp_path / "digests")
    (run / "results.json").unlink()
    for r in (2, 3):
        record = _status(run, r)
        record.update(phase="failed", error={"type": "DistevalError", "traceback": "", "message":
                      "tensor-parallel peers [2, 3] evaluated different samples (sample-id digests rank 2: 1, rank 3: "
                      "2): TP peers must receive identical batches; the data must be split by data-parallel rank, "
                      "not by global rank"})
        _write_status(run, r, record)
    f = _finding(diagnose(load_run(run)), "COMM", "tp_peers")
    assert f.status == "fail" and f.culprit == 2 and "split by global rank" in f.finding
    # ranks 2 and 3 left the forwards early and wait in the metric sync; 0 and 1 wait in an FSDP/TP forward
    run = _copy(mesh_run[0], tmp_path / "hang")
    (run / "results.json").unlink()
    for r in range(4):
        record = _status(run, r)
        record.update(phase="forward" if r < 2 else "sync", batches_done=1, dummy_steps_done=0,
                      in_collective=None if r < 2 else {"op": "synchronise", "since": record["t_update"]})
        _write_status(run, r, record)
    f = _finding(diagnose(load_run(run)), "COMM", "mesh_hang")
    assert f.status == "fail" and f.phase == "forward"
    assert "rank(s) [0, 1] wait in a model collective" in f.finding and "[2, 3] are already in the metric sync" in f.finding
    # every rank in the metric sync: named as a sync hang, not a model collective
    for r in range(2):
        record = _status(run, r)
        record.update(phase="sync", in_collective={"op": "synchronise", "since": record["t_update"]})
        _write_status(run, r, record)
    f = _finding(diagnose(load_run(run)), "COMM", "mesh_hang")
    assert f.status == "fail" and f.phase == "sync" and "wait in the metric sync over the data-parallel group" in f.finding


def test_a_killed_mesh_run_resumes_in_lockstep_and_on_another_layout(mesh_run, tmp_path):
    """eval.journal under a mesh: the first TP rank of each data-parallel group records its windows; rank 0
    killed after its first batch, the run resumed (a) on the same 2 x 2 mesh, whose dp ranks now have other
    batch counts left (the dummy steps are planned again over what is left: FSDP's collectives stay in
    lockstep) and (b) at W = 2 as tp=2 alone: metrics == the uninterrupted mesh run's, every sample once."""
    run_dir, proc, _, root = mesh_run
    assert proc.returncode == 0, proc.stderr
    want = load_results(run_dir)["metrics"]
    job = (*VIT, f"data.root={root}", f"model.checkpoint={run_dir.parent / 'vit.pt'}", "eval.journal.every_batches=1")
    mesh = ("dist.world_size=4", "dist.parallel.dp_shard=2", "dist.parallel.tp=2")
    killed = tmp_path / "killed"
    proc = run_disteval(*job, *mesh, "communication.timeout_s=10", run_dir=killed,
                        env={"DISTEVAL_FAULTS": "kill@0:batch=2"})
    assert proc.returncode != 0 and not (killed / "results.json").exists()
    assert sorted(p.name for p in killed.glob("ranks/rank0/journal/*.pt")) == ["000000000000-000000000004.pt"]
    assert not list(killed.glob("ranks/rank1/journal/*.pt"))  # rank 0's TP peer reads rank 0's records
    for name, layout in (("same_mesh", mesh), ("tp_only", ("dist.world_size=2", "dist.parallel.tp=2"))):
        proc = run_disteval(*job, *layout, f"eval.resume={killed}", run_dir=tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        res = load_results(tmp_path / name)
        assert res["metrics"] == want and res["coverage"]["ok"], name
        assert res["journal"]["samples_resumed"] >= 4, res["journal"]
        if name == "same_mesh":  # dp rank 0 has batch 1 left; dp rank 1 its batch unless it recorded it
            left = res["parallel"]["batches_per_dp_rank"]
            assert left[0] == 1 and res["parallel"]["dummy_steps_per_dp_rank"] == [0, 1 - left[1]], res["parallel"]
    # tp is part of what a record is of: a resume with another TP degree is refused before any rank starts
    proc = run_disteval(*job, "dist.world_size=1", f"eval.resume={killed}", run_dir=tmp_path / "no_tp")
    assert proc.returncode == 2 and "dist.parallel.tp: recorded 2, now 1" in proc.stderr
