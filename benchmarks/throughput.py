"""Throughput of disteval's evaluation loop against a bare forward loop, a torchmetrics loop and a loop that
gathers predictions per batch (accelerate's gather_for_metrics).

    python benchmarks/throughput.py [--world-sizes 1 2] [--rounds 3] [--repeats 3] [--batch-size 256]
                                    [--threads 1] [--limit N] [--allocator auto] [--smoke]
                                    [--device cpu|cuda] [--model NAME --data-root DIR] [--dtype fp32|bf16|fp16]

On a GPU (``--device cuda``, see scripts/gpu_check.sh): ``--model resnet50`` or ``vit_b_16`` (torchvision,
random weights: no download) on ``--data-root`` (an ImageFolder tree, e.g. symlinks to the shipped ImageNet
sample images, as scripts/gpu_check.sh makes), in ``--dtype bf16``; every method runs on the same device under the
same autocast, its batches already on the device for bare,
torchmetrics and gather (disteval loads them through its own loader and device feed, as a user's run does).

Same job for all three methods: the shipped Fashion-MNIST CNN (``+experiment=fashion_mnist``: ``model=fashion_cnn``,
the 10,000-image test split of Debian's dataset-fashion-mnist), the same batch size, the same intra-op threads
(``--threads``, default 1: disteval's bitwise default), the same batch-aligned shard per rank
(``disteval.common.ranges.batch_aligned_bounds``, what ``eval.mode=bitwise`` evaluates) and the same allocator.
The methods run in fresh child processes (W of them at world size W, as real ranks over gloo) started with the
allocator's environment (``--allocator``, resolved by ``disteval.common.allocator``; LD_PRELOAD and
GLIBC_TUNABLES act only at exec); each child reports the allocator really in force (from its /proc/self/maps).
Every child runs all three methods, interleaved pass by pass: two fresh processes of the same program can
differ by several percent in speed (memory layout, allocator state, thread placement), which a comparison
of methods run in separate processes would attribute to the methods.

- ``bare``: the shard's images and labels already in memory as batches (views of one tensor), then
  ``with torch.inference_mode(): for x, y in batches: correct += (model(x).argmax(1) == y).sum()``, and at
  W > 1 a single all_reduce of [count, correct] at the end;
- ``disteval``: the loop of ``python -m disteval``: ``disteval.rank.engine.RankRun.trial()`` (its DataLoader over
  the dataset, the classification task's step and metric in the Evaluator, the status/progress/guard/fault
  hooks, the watchdog thread, and the final synchronisation, coverage check and compute on rank 0), with
  ``eval.progress=false``;
- ``torchmetrics``: the same in-memory batches, ``MulticlassAccuracy`` top-1 and top-5 (micro) and
  ``MulticlassCalibrationError`` (15 bins, l1) updated per batch, ``compute()`` at the end (its own dist sync
  at W > 1);
- ``gather``: the same in-memory batches; per batch the predictions (arg-max) and labels of every rank are
  all_gathered (accelerate's ``gather_for_metrics``: a collective per batch, ranks in lockstep; a rank whose
  shard has one batch fewer gathers an empty, padded batch) and counted on the gathered tensors;
- ``loader`` (only when named in ``--methods``, as scripts/gpu_check.sh does): the bare loop reading the same
  dataset and shard through a plain DataLoader with the job's loader settings, batches moved to the device per
  step: disteval's fair baseline where the data come from files (on a GPU with JPEGs both are decode-bound).

Per child: one warm-up pass of each method (not timed), then ``--repeats`` rounds of one timed pass of each
method in turn, each pass started after a barrier at W > 1; a pass's time is the slowest rank's. images/s = N /
that time, median over all passes of all ``--rounds`` groups of fresh children. Also printed per method: the
ratio to bare at the same W and the minor page faults per batch during its timed passes (rank 0; allocation
churn that reaches the kernel).

Checked (exit 1 and MISMATCH naming it, never on a speed): at every W and in every pass all methods count the
same N samples and the same top-1 correct (disteval and torchmetrics also the same top-5 correct), as exact
integers compared with ==.

``--smoke``: W = 1 and 2, 1,024 images, batch 128, 1 round of 1 pass (seconds).

The disteval loop on a GPU issues no host synchronisation per batch (tests/test_gpu.py checks it under
``torch.cuda.set_sync_debug_mode("error")``); ``gather`` synchronises per batch by design, and torchmetrics'
updates do where they validate their inputs.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

METHODS = ("bare", "disteval", "torchmetrics", "gather")
EXTRA = ("loader",)  # --methods only: the bare loop reading through a plain DataLoader (scripts/gpu_check.sh)
FULL_N = 10_000
SMOKE = {"world_sizes": [1, 2], "rounds": 1, "repeats": 1, "batch_size": 128, "limit": 1024}


# ----------------------------------------------------------------------------------------------- allocator

def resolve_allocator(policy: str) -> dict:
    """{requested, name, library, env, note} of ``disteval.common.allocator.resolve(policy)``; ``env`` is what
    the children are exec'd with on top of this environment (``launch_env()``)."""
    from disteval.common import allocator

    c = allocator.resolve(policy)
    return {"requested": c.requested, "name": c.name, "library": c.library, "env": c.launch_env(), "note": c.note}


def allocator_in_force() -> dict:
    """What this process really runs with (``disteval.common.allocator.in_force``: /proc/self/maps and the
    GLIBC_TUNABLES it was exec'd with)."""
    from disteval.common import allocator

    return allocator.in_force()


def _describe(rec: dict) -> str:
    """One short line of an ``in_force()`` record."""
    return str(rec.get("in_force")) + (f" ({rec['library']})" if rec.get("library") else "") \
        + (f" (GLIBC_TUNABLES={rec['glibc_tunables']})" if rec.get("glibc_tunables") else "")


# ----------------------------------------------------------------------------------------------- children

def _job(overrides: list[str], experiment: str = "fashion_mnist") -> dict:
    """The composed job (``+experiment=EXPERIMENT`` and ``overrides``) as a plain dict."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from disteval.config import register_schemas

    register_schemas()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}", *overrides])
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)


def _in_memory_batches(dataset, start: int, end: int, batch: int, device, normalize=None) -> list:
    """This shard's items ``[start, end)`` stacked once into two tensors on ``device``, cut into batch views;
    uint8 pixels (imagefolder data) normalised once there (``normalize``: ``PixelNormalizer``), so the loops
    time the model on the floats it takes."""
    import torch

    xs = torch.stack([dataset[i][0] for i in range(start, end)]) if end > start else torch.zeros(0)
    ys = torch.tensor([int(dataset[i][1]) for i in range(start, end)], dtype=torch.int64)
    xs, ys = xs.to(device), ys.to(device)
    if normalize is not None:
        xs = normalize(xs)
    return [(xs[i:i + batch], ys[i:i + batch]) for i in range(0, end - start, batch)]


def _bare(model, batches, world_size: int, autocast, device=None) -> dict:
    """Count and top-1 correct over ``batches`` ((images, labels) on the model's device; ``device``: where to count
    when ``batches`` is an iterator, else the first batch's device)."""
    import torch
    import torch.distributed as dist

    dev = device if device is not None else (batches[0][0].device if batches else "cpu")
    acc = torch.zeros(2, dtype=torch.int64, device=dev)  # count, top-1
    with torch.inference_mode():
        for x, y in batches:
            with autocast():
                logits = model(x)
            acc[0] += y.numel()
            acc[1] += (logits.argmax(1) == y).sum()
        if world_size > 1:
            dist.all_reduce(acc)
    return {"count": int(acc[0]), "top1": int(acc[1]), "top5": None}


def _loader(model, loader, world_size: int, autocast, normalize=None) -> dict:
    """The bare loop, its batches read through ``loader`` (a plain DataLoader over the same dataset and shard with
    the job's loader settings) and moved to the model's device: what a hand-written loop over the same files
    gets. On a GPU with JPEG files the loader, not the loop, sets the pace of both this and disteval."""
    dev = next(model.parameters()).device
    norm = normalize or (lambda x: x)  # uint8 pixels normalised on the device, as disteval's step does
    moved = ((norm(batch[0].to(dev, non_blocking=True)), batch[1].to(dev, non_blocking=True)) for batch in loader)
    return _bare(model, moved, world_size, autocast, dev)


def _plain_loader(dataset, bounds: tuple[int, int], cfg, device):
    """A torch DataLoader over ``dataset[bounds[0]:bounds[1]]`` with the job's batch size, loader workers (forked)
    and prefetch, pinned memory on a GPU: a new one (and new workers) per pass, as disteval's loop makes."""
    from torch.utils.data import DataLoader, Subset

    workers = int(cfg.data.num_workers)
    return DataLoader(Subset(dataset, range(*bounds)), batch_size=int(cfg.data.batch_size), num_workers=workers,
                      pin_memory=device.type == "cuda", prefetch_factor=int(cfg.data.prefetch_factor) if workers else None,
                      multiprocessing_context="fork" if workers else None)


def _gather(model, batches, world_size: int, autocast, most: int) -> dict:
    """accelerate's gather_for_metrics pattern: an all_gather of predictions and labels after every batch
    (``most``: the largest batch count of any rank; ranks with fewer gather empty padded batches)."""
    import torch
    import torch.distributed as dist

    dev = batches[0][0].device if batches else torch.device("cpu")
    count = correct = 0
    b = max((y.numel() for _, y in batches), default=1)
    with torch.inference_mode():
        for k in range(most):
            pred = torch.full((b,), -1, dtype=torch.int64, device=dev)
            label = torch.full((b,), -1, dtype=torch.int64, device=dev)
            if k < len(batches):
                x, y = batches[k]
                with autocast():
                    logits = model(x)
                pred[:y.numel()], label[:y.numel()] = logits.argmax(1), y
            if world_size > 1:
                preds, labels = torch.empty(world_size * b, dtype=torch.int64, device=dev), torch.empty_like(pred.repeat(world_size))
                dist.all_gather_into_tensor(preds, pred)
                dist.all_gather_into_tensor(labels, label)
                pred, label = preds, labels
            keep = label >= 0  # gather_for_metrics drops the padding
            count += int(keep.sum())  # a host sync per batch, as accelerate's users' loops do
            correct += int((pred[keep] == label[keep]).sum())
    return {"count": count, "top1": correct, "top5": None}


def _torchmetrics(model, batches, num_classes: int, autocast) -> dict:
    import torch
    from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError

    dev = batches[0][0].device if batches else torch.device("cpu")
    top1 = MulticlassAccuracy(num_classes, top_k=1, average="micro").to(dev)
    top5 = MulticlassAccuracy(num_classes, top_k=5, average="micro").to(dev)
    ece = MulticlassCalibrationError(num_classes, n_bins=15, norm="l1").to(dev)
    count = 0
    with torch.inference_mode():
        for x, y in batches:
            with autocast():
                logits = model(x)
            top1.update(logits, y)
            top5.update(logits, y)
            ece.update(logits.float().softmax(1), y)
            count += y.numel()
        top1.compute(), top5.compute(), ece.compute()  # the timed end: each syncs its states across ranks
    out = {}
    for name, m in (("top1", top1), ("top5", top5)):
        with m.sync_context(should_sync=True):  # exact counts of the synced states (not timed)
            out[name] = int(m.tp.sum())
            out["count"] = int(m.tp.sum() + m.fn.sum())
    return out


def child(args) -> None:
    """One rank running every method of ``--child`` (comma-separated) in the same process, interleaved: a
    warm-up pass of each, then ``--repeats`` rounds of one timed pass of each method in turn, each pass after a
    barrier at W > 1. Interleaving in one process gives every method the same process (the same allocator
    state, memory layout, thread placement), so what differs between methods is the methods; an identical
    process can otherwise be several percent faster or slower than the next. Writes a JSON record."""
    import torch
    import torch.distributed as dist
    from disteval.config import job_config

    torch.set_num_threads(args.threads)
    methods = args.child.split(",")
    job = json.loads(Path(args.job).read_text())
    cfg = job_config(job)  # typed and validated, as a rank of python -m disteval receives it
    rank, w = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    record: dict = {"methods": {m: {"seconds": [], "results": [], "minflt": 0} for m in methods}, "rank": rank,
                    "world_size": w, "allocator": allocator_in_force()}
    barrier = (lambda: dist.barrier()) if w > 1 else (lambda: None)
    passes, finish = {}, []

    if "disteval" in methods:  # disteval's own bootstrap creates the process group the other methods reuse
        from disteval.rank.bootstrap import apply_compute_settings, connect, open_records
        from disteval.comm import RankEnv, destroy_process_group
        from disteval.common.liveness import beat_interval, heartbeat_timeout
        from disteval.rank.engine import RankRun
        from disteval.rank.watchdog import Watchdog

        class Run(RankRun):
            def evaluator(self):  # keeps the trial's evaluator, for the exact synced counts
                self.last = super().evaluator()
                return self.last

        env = RankEnv.from_env() if w > 1 else None
        ctx = open_records(cfg, args.workdir, env)  # one run directory shared by the ranks of this launch
        # the rank's heartbeat thread, reading peers' status files (not the rendezvous store, which the pass's end
        # destroys while the thread may be reading it: an abort at exit)
        timeout_s = heartbeat_timeout(cfg.dist.heartbeat_timeout_s, cfg.communication.timeout_s)
        watchdog = Watchdog(lambda: ctx.status, lambda: ctx.run_dir, rank, w,
                            (timeout_s, beat_interval(timeout_s, cfg.eval.status_interval_s)), None).start()
        connect(ctx)
        apply_compute_settings(ctx)
        run = Run(ctx)

        def one_disteval():
            run.trial()
            s = run.last.metric.states()
            correct = s["classification.correct_topk"][0].tolist()
            return {"count": int(s["classification.count"][0]), "top1": correct[0], "top5": correct[1]}
        passes["disteval"] = one_disteval
        finish.append(lambda: (watchdog.stop(), destroy_process_group()))
    elif w > 1:
        dist.init_process_group("nccl" if str(cfg.dist.device) == "cuda" else "gloo", init_method="env://",
                                rank=rank, world_size=w)
        finish.append(dist.destroy_process_group)
    record["threads"] = torch.get_num_threads()
    others = [m for m in methods if m != "disteval"]
    if others:
        from disteval.common.ranges import batch_aligned_bounds
        from disteval.data.pixels import PixelNormalizer
        from disteval.tasks import resolve_task

        from disteval import precision as prec
        from disteval.comm import resolve_device

        device = resolve_device(str(cfg.dist.device), int(os.environ.get("LOCAL_RANK", 0)))
        task = resolve_task(cfg)(cfg)
        dataset = task.dataset()
        model = task.model(device)
        b = int(cfg.data.batch_size)
        start, end = batch_aligned_bounds(len(dataset), b, w, rank)
        normalize = PixelNormalizer(cfg.data.mean, cfg.data.std) if cfg.data.name == "imagefolder" else None
        data = _in_memory_batches(dataset, start, end, b, device, normalize)
        most = max(-(-(e - s) // b) for s, e in (batch_aligned_bounds(len(dataset), b, w, r) for r in range(w)))

        def autocast():
            return prec.autocast(cfg.precision, device)
        passes["bare"] = lambda: _bare(model, data, w, autocast)
        passes["torchmetrics"] = lambda: _torchmetrics(model, data, task.num_classes, autocast)
        passes["gather"] = lambda: _gather(model, data, w, autocast, most)
        passes["loader"] = lambda: _loader(model, _plain_loader(dataset, (start, end), cfg, device), w, autocast,
                                           normalize)
    span = (run.plan.shard[1] - run.plan.shard[0]) if "disteval" in methods else (end - start)
    batches = -(-span // int(cfg.data.batch_size))

    for m in methods:  # warm-up, not timed
        barrier()
        passes[m]()
    for _ in range(args.repeats):
        for m in methods:
            barrier()
            flt0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            res = passes[m]()
            record["methods"][m]["seconds"].append(time.perf_counter() - t0)
            record["methods"][m]["minflt"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - flt0
            record["methods"][m]["results"].append(res)
    for m in methods:
        record["methods"][m]["minflt_per_batch"] = record["methods"][m].pop("minflt") / max(1, batches * args.repeats)
    record["batches"] = batches
    barrier()
    for f in finish:
        f()
    Path(args.out).write_text(json.dumps(record))
    # as a rank does once its work is delivered: end without the interpreter's teardown, in which gloo's threads
    # can still hold tensors of finished async work and abort the process ("terminate called ...", exit -6)
    from disteval.common import startup
    startup.skip_teardown_at_exit()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(method: str, w: int, args, job_path: Path, workdir: Path, alloc_env: dict) -> list[dict]:
    """W fresh child processes of ``method``; their records in rank order. Raises RuntimeError with the
    failing child's output."""
    port = _free_port()
    run_dir = Path(tempfile.mkdtemp(prefix=f"{method}_w{w}_", dir=workdir))
    procs = []
    for r in range(w):
        out = workdir / f"{method}_w{w}_r{r}_{time.monotonic_ns()}.json"
        env = dict(os.environ, **alloc_env, RANK=str(r), WORLD_SIZE=str(w), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(w), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", method, "--job", str(job_path),
               "--out", str(out), "--workdir", str(run_dir), "--threads", str(args.threads),
               "--repeats", str(args.repeats)]
        procs.append((subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
                      out))
    records, failed = [], []
    for proc, out in procs:
        try:
            text, _ = proc.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
            text += f"\n(timed out after {args.timeout:.0f} s)"
        if proc.returncode != 0 or not out.is_file():
            when = " after writing its record" if out.is_file() else " before writing its record"
            failed.append(f"{method} W={w}: exit {proc.returncode}{when}\n" + "\n".join(text.splitlines()[-30:]))
        else:
            records.append(json.loads(out.read_text()))
    if failed:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
        raise RuntimeError("\n".join(failed))
    return records


# ----------------------------------------------------------------------------------------------- parent

def check(passes: dict) -> list[str]:
    """Mismatches between methods' exact counts. ``passes``: {(W, method): [result dicts of every pass]}
    with ``count``, ``top1`` and ``top5`` (None where the method has no top-5); each field is compared with
    the first pass that has it."""
    problems = []
    for field in ("count", "top1", "top5"):
        refs = [(key, res[field]) for key, results in passes.items() for res in results[:1]
                if res.get(field) is not None]
        if not refs:
            problems.append(f"no method reported a {field} count")
            continue
        (ref_w, ref_m), ref = refs[0]
        for (w, method), results in passes.items():
            for k, res in enumerate(results):
                if res.get(field) is not None and res[field] != ref:
                    problems.append(f"W={w} {method} pass {k + 1}: {field} {res[field]} != {ref} "
                                    f"(W={ref_w} {ref_m} pass 1)")
    return problems


def headline(summary: dict) -> list[dict]:
    """Headline rows from the run's summary (the JSON line it prints): disteval against bare and torchmetrics at
    every W (issue targets: >= 0.97x bare, >= 1x torchmetrics)."""
    from _summary import row

    cfg, out = summary["config"], []
    for w, t in summary["throughput"].items():
        for other, target in (("bare", "0.97x"), ("loader", "0.97x"), ("torchmetrics", "1x"), ("gather", "1x")):
            if "disteval" in t and other in t:
                a, base = t["disteval"]["images_per_s"], t[other]["images_per_s"]
                out.append(row(f"loop at W={w}: images/s, disteval vs {other} loop ({cfg.get('model') or 'fashion-mnist'}"
                               f", {cfg.get('device', 'cpu')} {cfg.get('dtype', 'fp32')}, batch "
                               f"{cfg['batch_size']}, malloc {cfg['allocator']['name']}; target >= {target})",
                               f"{a:,.0f}", f"{base:,.0f}", a / base))
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="groups of fresh child processes per W")
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per child (after one warm-up pass)")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads of every rank of every method")
    ap.add_argument("--limit", type=int, default=None, help="images (default: all 10,000)")
    ap.add_argument("--allocator", default="auto", help="policy for disteval.common.allocator.resolve")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + EXTRA,
                    help="also: loader (the bare loop through a plain DataLoader over the same files)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"], help="autocast of every method")
    ap.add_argument("--model", default=None, help="a torchvision classifier (random weights), e.g. resnet50, "
                    "vit_b_16, on --data-root instead of the fashion-mnist CNN")
    ap.add_argument("--data-root", default=None, help="ImageFolder tree for --model")
    ap.add_argument("--num-workers", type=int, default=4, help="loader workers with --model (data.num_workers)")
    ap.add_argument("--smoke", action="store_true", help="W=1 2, 1,024 images in batches of 128, 1 pass (seconds)")
    for hidden in ("--child", "--job", "--out", "--workdir"):
        ap.add_argument(hidden, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:
        vars(args).update(SMOKE)
    if args.model and not args.data_root:
        ap.error("--model needs --data-root (an ImageFolder tree)")
    full = FULL_N if not args.model else _count_images(args.data_root)
    args.limit = min(args.limit, full) if args.limit else full
    return args


def _count_images(root: str) -> int:
    """Files in the class folders of an ImageFolder tree (what the benchmark evaluates at most)."""
    return sum(1 for d in Path(root).iterdir() if d.is_dir() for f in d.iterdir() if f.is_file())


def main() -> int:
    args = parse_args()
    if args.child:
        child(args)
        return 0

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 150))
    alloc = resolve_allocator(args.allocator)
    n, b = args.limit, args.batch_size
    overrides = [f"data.batch_size={b}", f"dist.threads={args.threads}", "eval.progress=false", "eval.mode=bitwise",
                 f"dist.device={args.device}", f"precision={args.dtype}", *([f"data.limit={n}"] if n < FULL_N else [])]
    experiment = "fashion_mnist"
    if args.model:  # a torchvision classifier on an ImageFolder tree (the GPU benchmark)
        experiment = "imagenet_vit"
        overrides += [f"model.name={args.model}", "model.weights=null", f"data.root={args.data_root}",
                      f"data.num_workers={args.num_workers}"]
    console.print(f"{args.model or 'fashion-mnist CNN'} on {args.device} ({args.dtype}), {n:,} images, batch {b}, "
                  f"{args.threads} thread(s) per rank, world sizes "
                  f"{args.world_sizes}, {args.rounds} round(s) x {args.repeats} pass(es) + 1 warm-up each per child, "
                  f"{os.cpu_count()} cores; allocator: requested {alloc['requested']!r} -> {alloc['name']} "
                  f"(env {alloc['env'] or '{}'})", highlight=False)
    t_start = time.perf_counter()
    seconds: dict = {}
    passes: dict = {}
    faults: dict = {}
    in_force: dict = {}
    with tempfile.TemporaryDirectory(prefix="throughput_bench_") as tmp:
        workdir = Path(tmp)
        job_path = workdir / "job.json"
        job_path.write_text(json.dumps(_job(overrides, experiment)))
        try:
            for rnd in range(args.rounds):
                for w in args.world_sizes:
                    recs = launch(",".join(args.methods), w, args, job_path, workdir, alloc["env"])
                    threads = {r["threads"] for r in recs}
                    for method in args.methods:
                        per_pass = [max(r["methods"][method]["seconds"][k] for r in recs) for k in range(args.repeats)]
                        seconds.setdefault((w, method), []).extend(per_pass)
                        passes.setdefault((w, method), []).extend(recs[0]["methods"][method]["results"])
                        faults.setdefault((w, method), []).append(recs[0]["methods"][method]["minflt_per_batch"])
                        in_force.setdefault((w, method), {_describe(r["allocator"]) for r in recs})
                        console.print(f"  round {rnd + 1}/{args.rounds}  W={w}  {method:<12} "
                                      + "  ".join(f"{n / s:7.0f}" for s in per_pass) + " images/s  "
                                      f"(threads {sorted(threads)}, {recs[0]['methods'][method]['minflt_per_batch']:.1f} minor faults "
                                      f"per batch, {recs[0]['allocator']['in_force']})", highlight=False)
        except RuntimeError as e:
            console.print("[bold red]a child failed[/]:")
            console.print(str(e), markup=False, highlight=False)
            return 1

    table = Table(title=f"loop throughput: disteval, bare forward, torchmetrics; fashion-mnist {n:,} images, "
                        f"batch {b}, {args.threads} thread(s) per rank (median of {args.rounds * args.repeats} passes)")
    table.caption = ("x/bare: throughput relative to the bare forward loop at the same W (< 1 = slower); minor "
                     "faults: per batch on rank 0 during the timed passes; allocator: in force in the children (/proc/self/maps)")
    for col in ("W", "method", "images/s", "min - max", "x/bare", "minor faults/batch", "allocator in force"):
        table.add_column(col, justify="left" if col in ("method", "allocator in force") else "right", no_wrap=True)
    summary: dict = {"config": {"images": n, "batch_size": b, "threads": args.threads, "rounds": args.rounds,
                                "device": args.device, "dtype": args.dtype, "model": args.model,
                                "repeats": args.repeats, "cores": os.cpu_count(), "allocator": alloc},
                     "throughput": {}}
    for w in args.world_sizes:
        med = {m: statistics.median(n / s for s in seconds[(w, m)]) for m in args.methods}
        for m in args.methods:
            ips = [n / s for s in seconds[(w, m)]]
            ratio = med[m] / med["bare"] if "bare" in med else float("nan")
            table.add_row(str(w), m, f"{med[m]:,.0f}", f"{min(ips):,.0f} - {max(ips):,.0f}", f"{ratio:.3f}x",
                          f"{statistics.median(faults[(w, m)]):.1f}", ", ".join(sorted(in_force[(w, m)])))
            summary["throughput"].setdefault(str(w), {})[m] = {
                "images_per_s": med[m], "runs": ips, "x_bare": ratio,
                "minflt_per_batch": statistics.median(faults[(w, m)]), "allocator_in_force": sorted(in_force[(w, m)])}
        if w != args.world_sizes[-1]:
            table.add_section()
    console.print(table)
    for w in args.world_sizes:
        t = summary["throughput"][str(w)]
        if "bare" in t and "disteval" in t:
            line = f"W={w}: disteval / bare {t['disteval']['x_bare']:.3f}x (target >= 0.97x, not checked)"
            if "torchmetrics" in t:
                tm = t["disteval"]["images_per_s"] / t["torchmetrics"]["images_per_s"]
                line += f", disteval / torchmetrics {tm:.3f}x (target >= 1, not checked)"
            console.print(line, highlight=False)
    problems = check(passes)
    ref = {f: next((res[f] for results in passes.values() for res in results if res.get(f) is not None), None)
           for f in ("count", "top1", "top5")}
    summary.update(counts=ref, problems=problems, seconds=time.perf_counter() - t_start)
    console.print(f"benchmark wall time {summary['seconds']:.0f} s")
    print(json.dumps(summary, sort_keys=True))
    if problems:
        console.print("[bold red]MISMATCH[/]: " + "\n".join(problems), highlight=False)
        return 1
    from _summary import write

    write("throughput_gpu" if args.device == "cuda" else "throughput", headline(summary),
          args.smoke or (n != FULL_N and not args.model) or not set(METHODS) <= set(args.methods))
    console.print(f"checks passed: every method counted {ref['count']:,} samples, {ref['top1']:,} top-1 correct"
                  + (f" and {ref['top5']:,} top-5 correct" if ref.get("top5") is not None else "")
                  + f" in every pass at W = {args.world_sizes}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
