"""Functions run inside real ranks (gloo, CPU) by tests/test_mesh_dist.py: one group of W ranks builds one
device mesh per case and evaluates a small torchvision VisionTransformer split by it (FSDP2 over dp_shard,
tensor parallelism over tp) on generated images, with the engine's pieces: the lockstep plan, the loop with
its dummy steps, the TP peers' check and the metric sync over the data-parallel group."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import TensorDataset

from disteval.comm import Communicator
from disteval.comm.mesh import ParallelDims, build_mesh
from disteval.data import IndexedDataset
from disteval.errors import DistevalError
from disteval.rank.loop import LoopHook, ShardSpec, evaluate_shard
from disteval.metrics import ClassificationMetrics, check_coverage
from disteval.metrics.evaluator import Evaluator
from disteval.models.reference_cnn import vit_tiny
from disteval.rank.parallel import first_inputs, parallel_model
from disteval.data.sharding import lockstep_plan
from disteval.rank.sync import check_tp_peers, synchronise
from dist_workers import rank_with_status

NUM_CLASSES = 5
IMAGE = 16
SIZES = (33, 37)  # at batch size 4: 9 and 10 global batches, so dp ranks of 2, 3 and 4 hold unequal counts
EVEN = 32  # 8 global batches: split by global rank over 4 ranks, TP peers' batches have the same shapes
BATCH = 4


def make_model(seed: int = 0) -> torch.nn.Module:
    """The test ViT: 2 layers, width 32, 4 heads, MLP 64, 16x16 images in 8x8 patches, 5 classes; initialised
    from ``seed``, head weights N(0, 1)."""
    torch.manual_seed(seed)
    model = vit_tiny(num_classes=NUM_CLASSES, image_size=IMAGE, patch_size=8, num_heads=4).eval()
    torch.nn.init.normal_(model.heads.head.weight)  # torchvision starts the head at zero: every logit would be 0
    return model


def make_data(n: int) -> IndexedDataset:
    """n generated images float32 [n, 3, 16, 16] (seed n) and labels in [0, 5)."""
    g = torch.Generator().manual_seed(n)
    return IndexedDataset(TensorDataset(torch.randn(n, 3, IMAGE, IMAGE, generator=g),
                                        torch.randint(0, NUM_CLASSES, (n,), generator=g)))


class Capture(LoopHook):
    """Keeps every real batch's outputs (dummy steps never reach ``on_outputs``)."""

    def __init__(self):
        self.outputs: list[torch.Tensor] = []

    def on_outputs(self, outputs):
        self.outputs.append(outputs.detach().clone())
        return outputs


def evaluate(model, groups, data: IndexedDataset, dp: tuple[int, int] | None = None):
    """Evaluate ``data`` on this rank's dp shard (``dp`` = (rank, size) overrides the mesh's, e.g. the global
    rank to show the mistake) with the planned dummy steps. Returns (evaluator, progress, logits, plan)."""
    d = groups.dims
    dp_rank, dp_size = dp or (groups.dp_rank, d.dp_size)
    plan = lockstep_plan(len(data), BATCH, d.dp_replicate, d.dp_shard)
    dummy = plan["dummy_steps"][groups.dp_rank] if dp is None else 0
    ev = Evaluator(ClassificationMetrics(NUM_CLASSES, topk=(1,)))
    cap = Capture()
    spec = ShardSpec(dp_rank, dp_size, BATCH, dummy_steps=dummy, dummy_inputs=first_inputs(data, None))
    progress = evaluate_shard(model, data, ev, spec, hooks=[cap])
    logits = torch.cat(cap.outputs) if cap.outputs else torch.zeros(0, NUM_CLASSES)
    return ev, progress, logits, plan


@record
def mesh_worker(out_dir: str, cases: list[dict]) -> None:
    """Each case {name, dims: [dp_replicate, dp_shard, tp], mode, sizes (default ``SIZES``)}: mode ``run``
    evaluates every size (TP check, one sync over the dp group) and writes on each rank ``{name}_{n}_rank{r}.pt`` (logits,
    sample range, dummy steps, metrics, TP digests); ``whole`` evaluates the whole dataset on every dp rank
    (dp size 1 within each replica: the tp-only reference); ``global_rank`` splits the data by global rank
    (the mistake) and records the TP check's error; ``world_sync`` splits correctly but synchronises over all
    ranks (the other mistake) and records the coverage report."""
    with rank_with_status(out_dir) as env:
        world = Communicator()
        for case in cases:
            groups = build_mesh(ParallelDims(*case["dims"]))
            dp_comm, tp_comm = Communicator(group=groups.dp_group), Communicator(group=groups.tp_group)
            # a split model gets rank 0's weights (set_model_state_dict, broadcast from rank 0): the other ranks
            # start from other ones, so any result equal to the reference proves the load
            split = case["dims"][1] > 1 or case["dims"][2] > 1
            model = parallel_model(make_model(0 if env.rank == 0 or not split else 1000 + env.rank), groups)
            for n in case.get("sizes", SIZES):
                data = make_data(n)
                out = {"rank": env.rank, "dp_rank": groups.dp_rank, "tp_rank": groups.tp_rank}
                if case["mode"] == "global_rank":
                    ev, progress, logits, plan = evaluate(model, groups, data, dp=(env.rank, env.world_size))
                    try:
                        check_tp_peers(ev, tp_comm, groups.tp_peers)
                        out["error"] = None
                    except DistevalError as exc:
                        out["error"] = str(exc)
                else:
                    ev, progress, logits, plan = evaluate(model, groups, data, dp=(0, 1) if case["mode"] == "whole" else None)
                    out["tp_check"] = check_tp_peers(ev, tp_comm, groups.tp_peers)
                    if case["mode"] == "world_sync":
                        cov = check_coverage(synchronise(ev, world, {}).runs, n)
                        out["coverage"] = {"ok": cov.ok, "duplicated": cov.duplicated, "missing": cov.missing}
                        out["metrics"] = ev.metric.compute()
                    elif case["mode"] == "run":
                        before = dp_comm.collectives
                        synced = synchronise(ev, dp_comm, {"rank": env.rank})
                        out["sync_collectives"] = dp_comm.collectives - before
                        out["coverage_ok"] = check_coverage(synced.runs, n).ok
                        out["metrics"] = ev.metric.compute()
                out.update(start=progress.start, end=progress.end, batches=progress.batches,
                           dummy_steps=progress.dummy_steps, plan=plan)
                torch.save({"logits": logits, "meta": json.dumps(out)},
                           Path(out_dir) / f"{case['name']}_{n}_rank{env.rank}.pt")
