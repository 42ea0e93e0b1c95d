"""Cost of disteval's per-batch segmentation statistics against a bare forward loop and torchmetrics.

    python benchmarks/segmentation.py [--size 512] [--batch-size 4] [--batches 6] [--repeats 3] [--threads 1]
                                      [--classes 21] [--device cpu] [--model NAME] [--smoke]

One process, one model: a randomly initialised torchvision segmentation model (``--model``, default
``lraspp_mobilenet_v3_large``, the lightest forward, so the hardest ratio; ``--classes`` outputs) on generated
``--size`` x ``--size`` images in ``--batches`` batches of ``--batch-size`` (labels: random
classes with 5 % of pixels at 255, ignored), ``--threads`` intra-op threads. Per batch, timed separately and
interleaved, each on the very same logits:

- ``forward``: ``model(x)["out"]`` (the bare forward loop: what any evaluation pays);
- ``disteval``: ``SegmentationMetrics.update`` (argmax at the label's resolution, int64 confusion by bincount,
  per-image intersection/union), the per-batch statistics of ``data=voc``;
- ``arg-max``: ``first_argmax`` of each image's logits alone, the part of the update that is the prediction
  itself (any evaluator pays it: torchvision's reference and torchmetrics call ``argmax``); the counting is
  the update minus it;
- ``one read``: ``amax`` over the classes of each image's logits, a single read of them: the floor of any
  exact arg-max on a CPU, where reading the logits from memory is the limit;
- ``torchmetrics``: ``MulticlassJaccardIndex(num_classes, ignore_index=255, average=None).update`` on the same
  logits (it takes the argmax itself).

Printed: the median time per batch of each over ``--repeats`` passes (after one warm-up pass) and the ratios
disteval/forward (target: under 2 % on CPU at 512x512) and disteval/torchmetrics, measured in the same run.
Checked (exit 1 naming the mismatch, never on a time): disteval's confusion matrix equals torchmetrics' ``confmat``
exactly, and every per-class IoU of disteval equals torchmetrics' to float32 precision (it computes in float32).

``--smoke``: 128x128, 2 batches of 2, 1 pass (seconds).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

IGNORE = 255
DEFAULT_MODEL = "lraspp_mobilenet_v3_large"


def make_batches(args) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``--batches`` (images float32 [B, 3, S, S], labels uint8 [B, S, S]) from a fixed seed."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(args.batches):
        x = torch.randn(args.batch_size, 3, args.size, args.size, generator=g)
        y = torch.randint(0, args.classes, (args.batch_size, args.size, args.size), generator=g)
        y[torch.rand(y.shape, generator=g) < 0.05] = IGNORE
        out.append((x, y.to(torch.uint8)))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_pass(model, batches, metric, tm, device) -> dict:
    """One pass over the batches: per batch the forward, disteval's update and torchmetrics' update, each timed
    on its own. Returns lists of seconds per batch."""
    from disteval.metrics.segmentation import first_argmax

    times = {"forward": [], "disteval": [], "arg-max": [], "one read": [], "torchmetrics": []}
    buffer = None
    with torch.inference_mode():
        for k, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            _sync(device)
            t0 = time.perf_counter()
            logits = model(x)["out"]
            _sync(device)
            t1 = time.perf_counter()
            metric.update(list(logits), list(y), torch.arange(k * len(y), (k + 1) * len(y)))
            _sync(device)
            t2 = time.perf_counter()
            tm.update(logits, y.long())
            _sync(device)
            t3 = time.perf_counter()
            if buffer is None or buffer.shape != logits.shape[1:]:
                buffer = torch.empty(logits.shape[1:], dtype=torch.bool, device=device)
            for one in logits:
                first_argmax(one, buffer)
            _sync(device)
            t4 = time.perf_counter()
            for one in logits:
                one.amax(0)
            _sync(device)
            t5 = time.perf_counter()
            times["forward"].append(t1 - t0)
            times["disteval"].append(t2 - t1)
            times["torchmetrics"].append(t3 - t2)
            times["arg-max"].append(t4 - t3)
            times["one read"].append(t5 - t4)
    return times


def check(metric, tm) -> list[str]:
    """Mismatches between disteval's and torchmetrics' statistics of the same batches (empty: they agree)."""
    problems = []
    ours = metric.states()["confusion"][0].cpu()
    theirs = tm.confmat.cpu().to(torch.int64)
    if not torch.equal(ours, theirs):
        diff = int((ours != theirs).sum())
        problems.append(f"confusion matrix differs from torchmetrics' confmat in {diff} cells")
    got = metric.compute()["per_class_IoU"]
    want = tm.compute().tolist()
    for c, (a, b) in enumerate(zip(got, want)):
        if a is not None and abs(a - b) > 1e-6 * max(1.0, abs(a)):
            problems.append(f"class {c}: IoU {a!r} != torchmetrics {b!r}")
    return problems


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=512, help="image side, pixels")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes (after one warm-up pass)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads")
    ap.add_argument("--classes", type=int, default=21)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a torchvision segmentation model name (random init)")
    ap.add_argument("--smoke", action="store_true", help="128x128, 2 batches of 2, 1 pass (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.batch_size, args.batches, args.repeats = 128, 2, 2, 1
    return args


def main() -> int:
    import torchvision
    from rich.console import Console
    from rich.table import Table
    from torchmetrics.classification import MulticlassJaccardIndex

    from _summary import row, write
    from disteval.metrics.segmentation import SegmentationMetrics

    args = parse_args()
    console = Console()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    extra = {} if args.model.startswith("lraspp") else {"aux_loss": False}
    model = torchvision.models.get_model(args.model, weights=None, weights_backbone=None, num_classes=args.classes,
                                         **extra).eval().to(device)
    batches = make_batches(args)

    def fresh():
        return (SegmentationMetrics(args.classes, IGNORE),
                MulticlassJaccardIndex(args.classes, ignore_index=IGNORE, average=None).to(device))

    run_pass(model, batches[:1], *fresh(), device)  # warm-up
    per_method: dict[str, list[float]] = {"forward": [], "disteval": [], "arg-max": [], "one read": [],
                                          "torchmetrics": []}
    problems = []
    for _ in range(args.repeats):
        metric, tm = fresh()
        times = run_pass(model, batches, metric, tm, device)
        for k, v in times.items():
            per_method[k].extend(v)
        problems += check(metric, tm)
    med = {k: statistics.median(v) for k, v in per_method.items()}
    table = Table(title=f"segmentation statistics per batch: {args.model} (random init), {args.batch_size} x "
                        f"{args.size}x{args.size}, {args.classes} classes, {args.threads} thread(s), {device}")
    for col in ("per batch", "median ms", "of forward"):
        table.add_column(col, justify="left" if col == "per batch" else "right")
    med["counting"] = max(0.0, med["disteval"] - med["arg-max"])
    labels = {"disteval": "disteval update", "arg-max": "  of which arg-max", "counting": "  of which counting",
              "one read": "one read of the logits (amax)"}
    for k in ("forward", "disteval", "arg-max", "counting", "one read", "torchmetrics"):
        table.add_row(labels.get(k, k), f"{med[k] * 1e3:.2f}", f"{med[k] / med['forward'] * 100:.2f} %")
    console.print(table)
    share = med["disteval"] / med["forward"]
    vs_tm = med["disteval"] / med["torchmetrics"]
    console.print(f"disteval statistics: {share * 100:.2f} % of the forward time (target < 2 % on CPU at 512x512; "
                  f"the arg-max {med['arg-max'] / med['forward'] * 100:.2f} %, the counting "
                  f"{med['counting'] / med['forward'] * 100:.2f} %; one read of the logits "
                  f"{med['one read'] / med['forward'] * 100:.2f} %); "
                  f"{vs_tm:.2f}x torchmetrics' MulticlassJaccardIndex update")
    write("segmentation", [row(f"segmentation statistics per batch vs {args.model} forward ({args.batch_size}x{args.size}^2, "
                     f"{args.threads} thread(s), {device})",
                     f"{med['disteval'] * 1e3:.1f} ms", f"forward {med['forward'] * 1e3:.0f} ms", share),
                 row(f"segmentation statistics vs torchmetrics MulticlassJaccardIndex update ({args.model} batches)",
                     f"{med['disteval'] * 1e3:.1f} ms", f"{med['torchmetrics'] * 1e3:.1f} ms", vs_tm)],
          args.smoke or args.model != DEFAULT_MODEL)  # the table's rows are the default model's
    if problems:
        for p in problems:
            console.print(f"MISMATCH: {p}")
        return 1
    console.print("checks passed: confusion matrix == torchmetrics' confmat, per-class IoU within float32")
    return 0


if __name__ == "__main__":
    sys.exit(main())
