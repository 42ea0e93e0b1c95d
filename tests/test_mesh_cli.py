"""``dist.parallel`` through ``python -m disteval``: the config checks before any rank starts, and one run of
4 ranks as dp_shard=2 x tp=2 (FSDP2 and tensor parallelism on a small ViT from a checkpoint) on a generated
ImageFolder whose 3 global batches split 2/1 between the data-parallel ranks."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision import transforms as T
from torchvision.datasets import ImageFolder

from conftest import load_results
from disteval.config import ParallelConfig
from disteval.errors import ConfigError
from disteval.models.reference_cnn import vit_tiny
from reference import reference_metrics
from test_imagenet import _tree

VIT = ("+experiment=imagenet_vit", "model.name=vit_tiny", "model.num_classes=3", "data.resize_size=32",
       "data.crop_size=32", "eval.topk=[1,2]", "data.batch_size=4")


def test_parallel_config_product_must_equal_world_size():
    ParallelConfig().validate(3)  # all null: no mesh
    ParallelConfig(tp=2, dp_replicate=2).validate(4)
    with pytest.raises(ConfigError, match=r"dist.parallel: dp_replicate=1 x dp_shard=2 x tp=2 = 4 ranks, but "
                                          r"dist.world_size=3"):
        ParallelConfig(dp_shard=2, tp=2).validate(3)
    with pytest.raises(ConfigError, match="dist.parallel.tp"):
        ParallelConfig(tp=0).validate(1)


def test_bad_mesh_fails_before_ranks_start(cli, tmp_path):
    root = _tree(tmp_path / "val", per_class=1)
    proc, run_dir = cli(*VIT, f"data.root={root}", "dist.world_size=3", "dist.parallel.tp=2")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "dp_replicate=1 x dp_shard=1 x tp=2 = 2 ranks, but dist.world_size=3" in text
    assert not (run_dir / "ranks").exists()
    # vit_tiny has 2 attention heads: they cannot be split 4 ways
    proc, run_dir = cli(*VIT, f"data.root={root}", "dist.world_size=4", "dist.parallel.tp=4")
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "dist.parallel.tp: model.name=vit_tiny: attention heads" in text
    assert "is not a multiple of tp=4" in text and not (run_dir / "ranks").exists()


def test_fsdp_and_tp_run_exact_with_planned_dummy_steps(cli, tmp_path):
    root = _tree(tmp_path / "val", per_class=3)  # 9 images: global batches of 4, 4, 1 -> dp ranks hold 2 and 1
    torch.manual_seed(0)
    model = vit_tiny(num_classes=3, image_size=32).eval()
    torch.nn.init.normal_(model.heads.head.weight)  # torchvision starts the head at zero
    torch.save(model.state_dict(), tmp_path / "vit.pt")
    proc, run_dir = cli(*VIT, f"data.root={root}", f"model.checkpoint={tmp_path / 'vit.pt'}", "dist.world_size=4",
                        "dist.parallel.dp_shard=2", "dist.parallel.tp=2")
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
