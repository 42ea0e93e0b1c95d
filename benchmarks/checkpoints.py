"""Several checkpoints in one job against one job per checkpoint: Fashion-MNIST, three small CNNs (the shipped
weights and two seeded perturbations), W=2 by default.

    python benchmarks/checkpoints.py [--repeats 3] [--world-size 2] [--smoke]

Each measurement is the wall time of a real ``python -m disteval`` process from its start to its exit (what a
user waits for: imports, rank start-up, data, model, forward, sync): one job with
``model.checkpoints=[a,b,c]`` against three jobs with ``model.checkpoint=a``, ``b``, ``c`` run one after the
other. Target (issue 28): the one job takes >= 1.5x less wall time. Checked (exit 1 naming the mismatch, never on
a time): every run completes and each checkpoint's metrics in the one job are == its own job's.

``--smoke``: one repeat on the first 2,000 test images. Needs Fashion-MNIST (apt-get install dataset-fashion-mnist).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import _summary  # noqa: E402
from disteval.testing.checkpoints import perturbed_checkpoints  # noqa: E402

SMOKE_LIMIT = ["data.limit=2000"]  # --smoke: the first 2,000 test images (the checks are the same)
SHIPPED = Path(__file__).resolve().parent.parent / "disteval" / "models" / "checkpoints" / "fashion_cnn.pt"


def make_checkpoints(folder: Path) -> list[Path]:
    """The shipped Fashion-MNIST CNN and two seeded perturbations of its weights (std 2 % and 5 % of each
    tensor's), saved as plain state dicts."""
    return perturbed_checkpoints(SHIPPED, folder, (0.0, 0.02, 0.05), "epoch")


def run(work: Path, name: str, overrides: list[str]) -> tuple[dict, float]:
    """(results.json, wall seconds of the process) of one job. Raises RuntimeError with its stderr on failure."""
    env = {k: v for k, v in os.environ.items() if k != "DISTEVAL_FAULTS"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "disteval", f"hydra.run.dir={work / name}", "eval.progress=false",
                           "+experiment=fashion_mnist", *overrides], env=env, cwd=work, capture_output=True,
                          text=True, timeout=900)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((work / name / "results.json").read_text()), seconds


def measure(work: Path, ckpts: list[Path], world: int, repeats: int, extra: list[str]) -> tuple[list, list, list[str]]:
    """Interleaved repeats (a drift of the machine's speed hits both): ([one job's seconds], [the separate
    jobs' summed seconds], problems). ``extra``: overrides of every job (the smoke's data.limit)."""
    joint, separate, problems = [], [], []
    listed = "[" + ",".join(str(c) for c in ckpts) + "]"
    for i in range(repeats):
        res, seconds = run(work, f"set_{i}", [f"model.checkpoints={listed}", f"dist.world_size={world}", *extra])
        joint.append(seconds)
        total = 0.0
        for c in ckpts:
            own, s = run(work, f"{c.stem}_{i}", [f"model.checkpoint={c}", f"dist.world_size={world}", *extra])
            total += s
            if res["metrics"][c.stem] != own["metrics"]:
                problems.append(f"{c.stem}: its metrics in the one job differ from its own job's")
        separate.append(total)
    return joint, separate, problems


def main() -> int:
    console = Console()
    args = _summary.fashion_job_args(__doc__, console, world_size=2)
    if args is None:
        return 0
    with tempfile.TemporaryDirectory(prefix="disteval-ckpts-") as tmp:
        ckpts = make_checkpoints(Path(tmp))
        joint, separate, problems = measure(Path(tmp), ckpts, args.world_size, 1 if args.smoke else args.repeats,
                                            SMOKE_LIMIT if args.smoke else [])
    one, three = statistics.median(joint), statistics.median(separate)
    table = Table(title=f"checkpoints in one job (Fashion-MNIST, 3 CNNs, W={args.world_size}, median wall s)")
    for col in ("how", "wall s", "per checkpoint s", "speed-up"):
        table.add_column(col, justify="left" if col == "how" else "right")
    table.add_row("one job, model.checkpoints=[a,b,c]", f"{one:.2f}", f"{one / 3:.2f}", f"{three / one:.2f}x")
    table.add_row("three jobs, model.checkpoint=a|b|c", f"{three:.2f}", f"{three / 3:.2f}", "1.00x")
    console.print(table)
    ratio = three / one
    console.print(f"target: >= 1.5x less wall time in one job: {ratio:.2f}x ({'met' if ratio >= 1.5 else 'NOT met'}"
                  f"{', smoke: one repeat' if args.smoke else ''})")
    rows = [_summary.row(f"3 checkpoints in one job vs 3 jobs, fashion-mnist W={args.world_size}: wall time",
                         f"{one:.2f} s", f"{three:.2f} s", one / three)]
    return _summary.finish("checkpoints", rows, problems, args.smoke, console)


if __name__ == "__main__":
    sys.exit(main())
