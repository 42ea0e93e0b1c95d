"""Console output (rich) and results.json assembly.

results.json fields (schema_version 1, see DESIGN.md): schema_version, experiment, run_dir, world_size,
dataset {name, split, root, num_samples, num_classes}, model {name, weights, checkpoint}, metrics {...},
coverage {num_samples, missing, duplicated, out_of_range, ok}, per_rank [{rank, host, shard [start, end),
samples, batches, metrics {accuracy, nll}, seconds {load, forward}, images_per_s}], timings {load, forward,
sync, total} (seconds, rank 0's clock; forward = slowest rank), throughput {images_per_s},
comm {collectives, bytes, by_op, chunked, compression {state: {mode, wire, bytes_before, bytes_after,
max_abs_error, max_rel_error}}, backend, profile}, precision, device, versions, config_digest, created.
"""
from __future__ import annotations

import hashlib
import json
import math
import platform
import time
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from disteval.records import SCHEMA_VERSION, atomic_write_json, json_safe, read_status

ROW_FIELDS = ("rank", "start", "end", "samples", "batches", "seconds_load", "seconds_forward", "accuracy", "nll")
_console = Console()


class GlobalProgress:
    """Rank 0's progress bar of the whole run: samples counted by all ranks (from their status records,
    passed in by ``refresh_from``; no collective), and the global rate in images/s. A no-op when
    ``enabled`` is False."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled = total, enabled
        self._t0 = time.perf_counter()
        self._progress = Progress(TextColumn("[bold]evaluating"), BarColumn(), MofNCompleteColumn(),
                                  TextColumn("{task.fields[rate]} images/s"), TimeElapsedColumn(),
                                  console=_console, transient=False) if enabled else None
        self._task = None

    def __enter__(self) -> "GlobalProgress":
        if self._progress:
            self._progress.start()
            self._task = self._progress.add_task("eval", total=self.total, rate="-")
        return self

    def __exit__(self, *exc) -> None:
        if self._progress:
            self._progress.stop()

    def _set(self, done: int) -> None:
        rate = done / max(time.perf_counter() - self._t0, 1e-9)
        self._progress.update(self._task, completed=done, rate=f"{rate:,.0f}")

    def refresh_from(self, records: list[dict | None]) -> None:
        if self._progress:
            self._set(sum(int(r.get("samples_done") or 0) for r in records if r))

    def finish(self) -> None:
        if self._progress:
            self._set(self.total)


def config_digest(cfg: Any) -> str:
    """sha256 of the resolved job config (canonical JSON), identifying what was evaluated."""
    container = OmegaConf.to_container(cfg, resolve=True) if OmegaConf.is_config(cfg) else cfg
    return "sha256:" + hashlib.sha256(json.dumps(container, sort_keys=True, default=str).encode()).hexdigest()


def versions() -> dict:
    import hydra
    import numpy
    import torch
    import torchvision

    import disteval

    return {"disteval": disteval.__version__, "python": platform.python_version(), "torch": torch.__version__,
            "torchvision": torchvision.__version__, "hydra": hydra.__version__, "numpy": numpy.__version__}


def build_results(cfg: Any, *, run_dir: str, world_size: int, num_samples: int, num_classes: int, metrics: dict,
                  coverage, rows: list[list[float]], comm: dict, backend: str, device: str,
                  timings: dict, extra: dict | None = None) -> dict:
    """Assemble the results.json record (see module docstring). ``rows`` are the per-rank float rows of
    ``ROW_FIELDS`` gathered at synchronisation; ``extra`` adds top-level fields (sampler, exact, trials,
    outliers, exclusion)."""
    per_rank = []
    for row in rows:
        r = dict(zip(ROW_FIELDS, row))
        rank = int(r["rank"])
        status = read_status(run_dir, rank) or {}
        fwd = r["seconds_forward"]
        per_rank.append({
            "rank": rank, "host": status.get("host"), "shard": [int(r["start"]), int(r["end"])],
            "samples": int(r["samples"]), "batches": int(r["batches"]),
            "metrics": {"accuracy": r["accuracy"], "nll": r["nll"]},
            "seconds": {"load": r["seconds_load"], "forward": fwd},
            "images_per_s": r["samples"] / fwd if fwd > 0 else None,
        })
    slowest = max((p["seconds"]["forward"] for p in per_rank), default=0.0)
    timings = dict(timings, forward=slowest)
    experiment = cfg.get("experiment_name") if hasattr(cfg, "get") else None
    return json_safe({
        "schema_version": SCHEMA_VERSION,
        "experiment": experiment or "default",
        "run_dir": str(run_dir),
        "world_size": world_size,
        "dataset": {"name": cfg.data.name, "split": cfg.data.split, "root": cfg.data.root,
                    "num_samples": num_samples, "num_classes": num_classes},
        "model": {"name": cfg.model.name, "weights": cfg.model.weights, "checkpoint": cfg.model.checkpoint},
        "metrics": metrics,
        "coverage": coverage.as_dict(),
        "per_rank": per_rank,
        "timings": timings,
        "throughput": {"images_per_s": num_samples / slowest if slowest > 0 else None},
        "comm": dict(comm, backend=backend, profile=_plain(cfg.get("communication_profile"))),
        "precision": {"model_dtype": str(cfg.precision.model_dtype), "tf32": bool(cfg.precision.tf32),
                      "deterministic": bool(cfg.precision.deterministic),
                      "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)},
        "device": device,
        "versions": versions(),
        "config_digest": config_digest(cfg),
        "created": time.time(),
        **(extra or {}),
    })


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def write_results(run_dir: str, results: dict) -> Path:
    """Write RUN_DIR/results.json atomically; returns its path."""
    path = Path(run_dir) / "results.json"
    atomic_write_json(path, results)
    return path


# COCOeval.summarize's 12 statistics, in its order and wording
COCO_LABELS = {"AP": "AP @[IoU=0.50:0.95 | area=all | maxDets=100]", "AP50": "AP @[IoU=0.50 | area=all | maxDets=100]",
               "AP75": "AP @[IoU=0.75 | area=all | maxDets=100]", "APs": "AP @[IoU=0.50:0.95 | area=small | maxDets=100]",
               "APm": "AP @[IoU=0.50:0.95 | area=medium | maxDets=100]",
               "APl": "AP @[IoU=0.50:0.95 | area=large | maxDets=100]", "AR1": "AR @[IoU=0.50:0.95 | area=all | maxDets=1]",
               "AR10": "AR @[IoU=0.50:0.95 | area=all | maxDets=10]",
               "AR100": "AR @[IoU=0.50:0.95 | area=all | maxDets=100]",
               "ARs": "AR @[IoU=0.50:0.95 | area=small | maxDets=100]",
               "ARm": "AR @[IoU=0.50:0.95 | area=medium | maxDets=100]",
               "ARl": "AR @[IoU=0.50:0.95 | area=large | maxDets=100]"}


def _print_per_category(console: Console, per_cat: dict, columns: int = 4) -> None:
    """Per-category AP@[.5:.95] in a few columns (n/a: no ground truth of that category)."""
    table = Table(title="per-category AP @[IoU=0.50:0.95 | area=all | maxDets=100]")
    for _ in range(columns):
        table.add_column("category")
        table.add_column("AP", justify="right")
    items = list(per_cat.items())
    rows = (len(items) + columns - 1) // columns
    for r in range(rows):
        cells = []
        for c in range(columns):
            i = c * rows + r
            cells += [items[i][0], _fmt(items[i][1])] if i < len(items) else ["", ""]
        table.add_row(*cells)
    console.print(table)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def print_metrics(results: dict, console: Console | None = None) -> None:
    """Print the metrics table (rich) and where results.json went."""
    console = console or _console
    m = results["metrics"]
    table = Table(title=f"disteval: {results['model']['name']} on {results['dataset']['name']} "
                        f"({results['dataset']['num_samples']} samples, world size {results['world_size']})")
    table.add_column("metric")
    table.add_column("value", justify="right")
    labels = {"accuracy": None, "auroc_macro": "AUROC (macro, one-vs-rest)", "ap_macro": "AP (macro, one-vs-rest)",
              "macro_precision": "macro precision", "macro_recall": "macro recall",
              "macro_f1": "macro F1", "nll": "NLL (mean cross-entropy)", "ece": f"ECE ({m.get('ece_bins')} bins)"}
    for key, value in m.items():
        if key.startswith("top") and key[3:].isdigit():
            table.add_row(f"top-{key[3:]} accuracy", _fmt(value))
    for key, label in labels.items():
        if label and key in m:
            table.add_row(label, _fmt(m[key]))
    for key, label in COCO_LABELS.items():
        if key in m:
            table.add_row(label, _fmt(m[key]))
    t, tp = results["timings"], results["throughput"]["images_per_s"]
    table.add_row("forward throughput (images/s)", _fmt(tp) if tp is None else f"{tp:,.0f}")
    table.add_row("wall time (s)", f"{t['total']:.2f} (sync {t['sync'] * 1000:.1f} ms)")
    table.add_row("collectives", f"{results['comm']['collectives']} ({results['comm']['bytes']:,} bytes)")
    for state, c in (results["comm"].get("compression") or {}).items():
        if c["bytes_after"] != c["bytes_before"] or c["max_abs_error"]:
            table.add_row(f"{state} sent as {c['wire']}",
                          f"{c['bytes_before']:,} -> {c['bytes_after']:,} bytes, max error {c['max_abs_error']:.2g} "
                          f"abs / {c['max_rel_error']:.2g} rel")
    console.print(table)
    if isinstance(m.get("per_category_ap"), dict):
        _print_per_category(console, m["per_category_ap"])
    present, total = m.get("classes_with_samples"), results["dataset"]["num_classes"]
    if present is not None and present < total:
        console.print(f"[yellow]note:[/] only {present} of {total} classes have samples; macro precision/recall/F1 "
                      "average over all classes (classes without samples count as 0, scikit-learn's "
                      "labels=range(C), zero_division=0)", soft_wrap=True)
    if 1 < len(results["per_rank"]) <= 16:
        ranks = Table(title="per rank")
        for col in ("rank", "host", "shard", "samples", "images/s", "local accuracy"):
            ranks.add_column(col, justify="right")
        for p in results["per_rank"]:
            ips = p["images_per_s"]
            ranks.add_row(str(p["rank"]), str(p["host"]), f"[{p['shard'][0]}, {p['shard'][1]})", str(p["samples"]),
                          "n/a" if ips is None else f"{ips:,.0f}", _fmt(p["metrics"]["accuracy"]))
        console.print(ranks)
    _print_robustness(console, results)
    console.print(f"results: {Path(results['run_dir']) / 'results.json'}", soft_wrap=True)


def _print_robustness(console: Console, results: dict) -> None:
    """Trials (mean ± std, median / MAD, sigma-clipped mean), outlier ranks, excluded samples, inexact sampler."""
    trials = results.get("trials")
    if trials:
        table = Table(title=f"{trials['k']} trials ({'identical' if trials['agree'] else 'disagree: ' + trials['aggregate'] + ' reported'})")
        for col in ("metric", "mean ± std", "median (MAD)", "sigma-clipped mean (dropped)", "spread"):
            table.add_column(col, justify="right")
        for name, st in trials["stats"].items():
            table.add_row(name, f"{st['mean']:.4f} ± {st['std']:.2g}", f"{st['median']:.4f} ({st['mad']:.2g})",
                          f"{st['sigma_clip_mean']:.4f} ({st['dropped']})", f"{st['spread']:.2g}")
        console.print(table)
    out = results.get("outliers") or {}
    hosts = {p["rank"]: p["host"] for p in results["per_rank"]}
    for r in out.get("outliers") or []:
        console.print(f"[yellow]outlier rank:[/] rank {r} on {hosts.get(r)}: local accuracy z = {out['z'][r]:+.1f} "
                      f"(modified z-score, median {out['median']:.4f}, |z| > {out['threshold']:g})", soft_wrap=True)
    ex = results.get("exclusion")
    if ex:
        console.print(f"[bold yellow]excluded ranks {ex['ranks']}:[/] the metrics above leave out "
                      f"{ex['samples_left_out']} of {results['dataset']['num_samples']} samples (shards {ex['shards']})",
                      soft_wrap=True)
    if not results.get("exact", True):
        cov = results["coverage"]
        console.print(f"[bold red]inexact:[/] data.sampler={results.get('sampler')} left {cov['missing']} samples out "
                      f"and counted {cov['duplicated']} twice; these metrics differ from a single-process run "
                      "(data.sampler=exact)", soft_wrap=True)
