"""Forward throughput and memory per rank of a small ViT under three device meshes of 4 ranks (CPU, gloo):
dp=4 (every rank holds the whole model; the baseline), dp=2 x tp=2 (tensor parallelism: heads and MLP split in
two) and dp_shard=4 (FSDP2: parameters sharded in four, all-gathered layer by layer in every forward).

    python benchmarks/model_parallel.py [--samples 256] [--batch-size 16] [--repeats 3] [--smoke]

One group of 4 real ranks builds the three meshes in turn (``disteval.comm.mesh``, ``disteval.rank.parallel``) and
evaluates the same generated images with each, exactly as ``python -m disteval dist.parallel.*`` does (exact
shards over the data-parallel ranks, planned dummy steps, TP check, one sync over the dp group). Per layout:
images/s of the whole group (N / slowest rank's loop time, median over ``--repeats`` rounds, layouts
alternating in each round), parameter bytes resident per rank (its local shards), and the peak resident memory
(VmHWM, reset through /proc/self/clear_refs) added while building the layout and running its first pass, per
rank (max over ranks; after one unmeasured warm-up pass, so that lazy imports are not counted); ratios against dp=4
measured in the same run. On CPU the collectives of FSDP and TP run
over loopback TCP and the ranks share the machine's cores: the ratios show what the layouts cost here, not on
GPUs with NVLink (docs/model-parallel.md has the paper estimate for ViT-G/14 on 8 x H200).

Checked (exit 1 naming the mismatch, never on a time): every layout counts every sample once, and the top-1
counts of the three layouts are equal.

``--smoke``: 24 images in batches of 4, 1 round, a tinier ViT (seconds).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYOUTS = {"dp=4": (4, 1, 1), "dp=2 x tp=2": (2, 1, 2), "dp_shard=4": (1, 4, 1)}
FULL_VIT = dict(image_size=32, patch_size=4, num_layers=4, num_heads=4, hidden_dim=128, mlp_dim=512)
SMOKE_VIT = dict(image_size=16, patch_size=8, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64)
NUM_CLASSES = 10


def _vm(key: str) -> int | None:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM), None where unreadable."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux: ``echo 5 > /proc/self/clear_refs``); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _model(vit: dict):
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(num_classes=NUM_CLASSES, **vit).eval()
    torch.nn.init.normal_(model.heads.head.weight)
    return model


def _local_bytes(model) -> int:
    """Bytes of the parameters this rank holds (a DTensor's local shard only)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _pass(model, groups, dataset, batch: int) -> dict:
    """One evaluation as the engine runs it under ``groups``: seconds of the loop, synced counts."""
    import torch.distributed as dist

    from disteval.comm import Communicator
    from disteval.data.sharding import lockstep_plan
    from disteval.rank.loop import ShardSpec, evaluate_shard
    from disteval.metrics import ClassificationMetrics, check_coverage
    from disteval.metrics.evaluator import Evaluator
    from disteval.rank.parallel import first_inputs
    from disteval.rank.sync import check_tp_peers, synchronise

    d = groups.dims
    plan = lockstep_plan(len(dataset), batch, d.dp_replicate, d.dp_shard)
    ev = Evaluator(ClassificationMetrics(NUM_CLASSES, topk=(1,)))
    spec = ShardSpec(groups.dp_rank, d.dp_size, batch, dummy_steps=plan["dummy_steps"][groups.dp_rank],
                     dummy_inputs=first_inputs(dataset, None))
    dist.barrier()
    t0 = time.perf_counter()
    evaluate_shard(model, dataset, ev, spec)
    seconds = time.perf_counter() - t0
    check_tp_peers(ev, Communicator(group=groups.tp_group), groups.tp_peers)
    runs = synchronise(ev, Communicator(group=groups.dp_group), {}).runs
    m = ev.metric.compute()
    return {"seconds": seconds, "num_samples": m["num_samples"], "top1": round(m["top1"] * m["num_samples"]),
            "coverage_ok": check_coverage(runs, len(dataset)).ok}


@record
def bench_worker(samples: int, batch: int, repeats: int, vit: dict) -> dict:
    """One rank: build each layout (memory measured), then ``repeats`` rounds over the layouts."""
    from torch.utils.data import TensorDataset

    from disteval.comm import RankEnv, destroy_process_group, init_process_group
    from disteval.comm.mesh import ParallelDims, build_mesh
    from disteval.data import IndexedDataset
    from disteval.rank.parallel import parallel_model

    env = RankEnv.from_env()
    torch.set_num_threads(1)
    init_process_group("gloo", 600, env)
    try:
        g = torch.Generator().manual_seed(0)
        size = vit["image_size"]
        dataset = IndexedDataset(TensorDataset(torch.randn(samples, 3, size, size, generator=g),
                                               torch.randint(0, NUM_CLASSES, (samples,), generator=g)))
        built, out = {}, {}
        warm = build_mesh(ParallelDims(*LAYOUTS["dp=4"]))  # one unmeasured pass: lazy imports, allocator arenas
        _pass(parallel_model(_model(vit), warm), warm, dataset, batch)
        for name, dims in LAYOUTS.items():
            rss0, reset = _vm("VmRSS"), _reset_peak()
            groups = build_mesh(ParallelDims(*dims))
            model = parallel_model(_model(vit), groups)
            first = _pass(model, groups, dataset, batch)
            peak = _vm("VmHWM") if reset else None
            built[name] = (model, groups)
            out[name] = {"param_bytes": _local_bytes(model), "peak_add_bytes": None if peak is None or rss0 is None
                         else peak - rss0, "rounds": [], "first": first}
        for _ in range(repeats):
            for name, (model, groups) in built.items():
                out[name]["rounds"].append(_pass(model, groups, dataset, batch))
        return out
    finally:
        destroy_process_group()


def check(per_rank: dict[int, dict], samples: int) -> list[str]:
    """Mismatches: a layout that did not count every sample once, or top-1 counts that differ between layouts."""
    problems, top1 = [], {}
    for r, res in sorted(per_rank.items()):
        for name, lay in res.items():
            for p in [lay["first"], *lay["rounds"]]:
                if not p["coverage_ok"] or p["num_samples"] != samples:
                    problems.append(f"rank {r}, {name}: counted {p['num_samples']} of {samples} samples "
                                    f"(coverage ok: {p['coverage_ok']})")
                top1.setdefault(name, set()).add(p["top1"])
    values = {name: sorted(v) for name, v in top1.items()}
    if len({tuple(v) for v in values.values()}) != 1 or any(len(v) != 1 for v in values.values()):
        problems.append(f"top-1 counts differ between layouts or rounds: {values}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="24 images, batches of 4, 1 round, a tinier ViT")
    args = ap.parse_args()
    vit = SMOKE_VIT if args.smoke else FULL_VIT
    if args.smoke:
        args.samples, args.batch_size, args.repeats = 24, 4, 1

    from rich.console import Console
    from rich.table import Table

    from _summary import row, write
    from launchers.local import launch

    with tempfile.TemporaryDirectory() as tmp:
        per_rank = launch(bench_worker, (args.samples, args.batch_size, args.repeats, vit), 4, tmp)
    problems = check(per_rank, args.samples)
    table = Table(title=f"model parallelism on CPU, 4 ranks: ViT {vit}, N={args.samples}, batch {args.batch_size}, "
                        f"median of {args.repeats} round(s)")
    for col in ("layout", "images/s (group)", "x dp=4", "param MiB/rank", "x dp=4", "peak added MiB/rank (max)", "x dp=4"):
        table.add_column(col, justify="right")
    stats = {}
    for name in LAYOUTS:
        slowest = [max(per_rank[r][name]["rounds"][k]["seconds"] for r in per_rank) for k in range(args.repeats)]
        peaks = [per_rank[r][name]["peak_add_bytes"] for r in per_rank]
        stats[name] = {"ips": args.samples / statistics.median(slowest),
                       "params": max(per_rank[r][name]["param_bytes"] for r in per_rank) / 2**20,
                       "peak": None if None in peaks else max(peaks) / 2**20}
    base = stats["dp=4"]
    headline = []
    for name, s in stats.items():
        pr = s["peak"] / base["peak"] if s["peak"] and base["peak"] else None
        table.add_row(name, f"{s['ips']:.1f}", f"{s['ips'] / base['ips']:.2f}", f"{s['params']:.2f}",
                      f"{s['params'] / base['params']:.2f}", "n/a" if s["peak"] is None else f"{s['peak']:.1f}",
                      "n/a" if pr is None else f"{pr:.2f}")
        if name != "dp=4":
            headline.append(row(f"{name} vs dp=4, small ViT on CPU (4 ranks): forward images/s", f"{s['ips']:.1f}",
                                f"{base['ips']:.1f}", s["ips"] / base["ips"]))
            headline.append(row(f"{name} vs dp=4: parameter MiB per rank", f"{s['params']:.2f}",
                                f"{base['params']:.2f}", s["params"] / base["params"]))
    console = Console(width=max(Console().width, 160))
    console.print(table)
    if problems:
        console.print("[bold red]MISMATCH[/]: " + "\n".join(problems), highlight=False)
        return 1
    write("model_parallel", headline, args.smoke)
    console.print(f"checks passed: every layout counted all {args.samples} samples once and the three layouts give "
                  "the same top-1 count")
    return 0


if __name__ == "__main__":
    sys.exit(main())
