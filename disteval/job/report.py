"""Presentation only: the rich console (progress bar, metrics table, per-rank table, robustness notes).
It reads records (results.json as built by ``disteval.job.records``) and never builds them."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from disteval.common.formatting import fmt
from disteval.common.pipeline import console_line as pipeline_line

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


def _samples(results: dict) -> str:
    """"M samples", or "N of M samples" when streamed samples were skipped (``decode_errors``)."""
    skipped = results.get("decode_errors") or {}
    return skipped["samples"] if skipped.get("skipped") else f"{results['dataset']['num_samples']} samples"


def print_metrics(results: dict, section: tuple | None = None, console: Console | None = None) -> None:
    """Print the metrics table (rich), the task's extra tables and notes, the per-rank table, robustness
    notes and where results.json went. ``section``: the task's ``console_section(metrics)`` = (rows of
    (label, value text), extra renderables, notes); None lists the scalar metrics as they are."""
    console = console or _console
    m = results["metrics"]
    if section is None:
        section = ([(k, fmt(v)) for k, v in m.items() if isinstance(v, (int, float)) or v is None], [], [])
    rows, extra, notes = section
    mode = results.get("mode")
    task = (results.get("task") or {}).get("name")
    cls = results["model"].get("class")
    member = results["model"].get("member")  # one checkpoint of a model.checkpoints job
    table = Table(title=f"disteval{' ' + task if task else ''}: {results['model']['name']}"
                        f"{' checkpoint ' + member if member else ''} on "
                        f"{results['dataset']['name']}",  # one short line; the details go in the caption
                  caption=f"{cls + ', ' if cls else ''}{_samples(results)}, world size "
                          f"{results['world_size']}{', ' + mode + ' mode' if mode else ''}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for label, value in rows:
        table.add_row(label, value)
    tp = results["throughput"]["images_per_s"]
    table.add_row("forward-only throughput (images/s)", fmt(tp) if tp is None else f"{tp:,.0f}")
    for label, value in _wall_times(results["timings"]):
        table.add_row(label, value)
    table.add_row("collectives", f"{results['comm']['collectives']} ({results['comm']['bytes']:,} bytes)")
    for state, c in (results["comm"].get("compression") or {}).items():
        if c["bytes_after"] != c["bytes_before"] or c["max_abs_error"]:
            table.add_row(f"{state} sent as {c['wire']}",
                          f"{c['bytes_before']:,} -> {c['bytes_after']:,} bytes, max error {c['max_abs_error']:.2g} "
                          f"abs / {c['max_rel_error']:.2g} rel")
    console.print(table)
    for renderable in extra:
        console.print(renderable)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}", soft_wrap=True)
    compute = results.get("compute") or {}
    if mode == "bitwise":
        console.print(f"bitwise mode: batch-aligned shards, {compute.get('threads')} intra-op thread(s) per rank, "
                      "order-independent float sums: these metrics are bit-identical at every world size "
                      "(same data, model, batch size, machine type and versions)", soft_wrap=True, highlight=False)
    elif mode == "fast":
        console.print("fast mode: counts are exact, float metrics may differ in the last bits with the world size "
                      "(eval.mode=bitwise makes them identical)", soft_wrap=True, highlight=False)
    if 1 < len(results["per_rank"]) <= 16:
        key = (results.get("task") or {}).get("rank_metric")  # the task's per-rank result (Task.rank_metric)
        ranks = Table(title="per rank")
        for col in ("rank", "host", "shard", "samples", "images/s", *([f"local {key}"] if key else [])):
            ranks.add_column(col, justify="right")
        for p in results["per_rank"]:
            ips = p["images_per_s"]
            ranks.add_row(str(p["rank"]), str(p["host"]), f"[{p['shard'][0]}, {p['shard'][1]})", str(p["samples"]),
                          "n/a" if ips is None else f"{ips:,.0f}", *([fmt(p["metrics"].get(key))] if key else []))
        console.print(ranks)
    _print_robustness(console, results)
    console.print(f"results: {Path(results['run_dir']) / 'results.json'}", soft_wrap=True)


def _wall_times(t: dict) -> list[tuple[str, str]]:
    """The two labelled wall times of results.json ``timings`` (seconds): the evaluation (rank 0: process
    group, data and model, forward, the task's work after the loop when it has some, sync) and the whole run
    (from the driver's start, imports and rank start-up included; absent in records written before it was
    kept)."""
    evaluation = t.get("evaluation_s", t["total"])
    after = f", after the loop {t['after_loop']:.2f}" if t.get("after_loop") else ""  # e.g. a sharded kNN search
    rows = [("wall time: evaluation (s)",
             f"{evaluation:.2f} (load {t['load']:.2f}{after}, sync {t['sync'] * 1000:.1f} ms)")]
    if t.get("process_wall_s") is not None:
        rows.append(("wall time: whole run (s)", f"{t['process_wall_s']:.2f} (from the driver's start)"))
    return rows


def _print_robustness(console: Console, results: dict) -> None:
    """Trials (mean ± std, median / MAD, sigma-clipped mean), outlier ranks, excluded samples, inexact sampler."""
    trials = results.get("trials")
    if trials:
        agree = "identical" if trials["agree"] else f"disagree: {trials['aggregate']} reported"
        table = Table(title=f"{trials['k']} trials ({agree})")
        for col in ("metric", "mean ± std", "median (MAD)", "sigma-clipped mean (dropped)", "spread"):
            table.add_column(col, justify="right")
        for name, st in trials["stats"].items():
            table.add_row(name, f"{st['mean']:.4f} ± {st['std']:.2g}", f"{st['median']:.4f} ({st['mad']:.2g})",
                          f"{st['sigma_clip_mean']:.4f} ({st['dropped']})", f"{st['spread']:.2g}")
        console.print(table)
    out = results.get("outliers") or {}
    hosts = {p["rank"]: p["host"] for p in results["per_rank"]}
    for r in out.get("outliers") or []:
        key = (results.get("task") or {}).get("rank_metric") or "accuracy"
        console.print(f"[yellow]outlier rank:[/] rank {r} on {hosts.get(r)}: local {key} z = {out['z'][r]:+.1f} "
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


def print_warnings(warnings: list[str], console: Console | None = None) -> None:
    """One ``warning:`` line per entry of results.json ``warnings`` (printed after the metrics table)."""
    console = console or Console()
    for w in warnings:
        console.print(f"[yellow]warning:[/] {escape(w)}", soft_wrap=True, highlight=False)


def print_intervals(ci: dict | None, console: Console | None = None, label: str | None = None) -> None:
    """One line with results.json ``confidence_intervals`` (``eval.ci.resamples`` > 0): each metric's bootstrap
    interval at its level; ``label`` (a checkpoint's name) leads the line."""
    if not ci:
        return
    console = console or Console()
    parts = [f"{k} [{v['low']:.4f}, {v['high']:.4f}]" for k, v in ci.items() if isinstance(v, dict)]
    console.print(f"{label + ': ' if label else ''}{ci['level']:.0%} bootstrap intervals over the {ci['samples']:,} "
                  f"{ci.get('unit', 'samples')} ({ci['resamples']} "
                  f"resamples, seed {ci['seed']}): " + ", ".join(parts), soft_wrap=True, highlight=False)


def print_checkpoint_table(names: list[str], sections: list[tuple], console: Console | None = None,
                           lower_labels: frozenset[str] = frozenset()) -> None:
    """The metrics of a job of several checkpoints side by side: one row per metric (the task's console rows,
    ``Task.console_section``), one column per checkpoint in the order listed; where a row's values all read as
    numbers and differ, the best is bold: the smallest for the rows in ``lower_labels`` (the metrics whose
    declaration says lower is better, ``Metric.meaning``: losses, calibration errors), else the largest."""
    if not names:
        return
    console = console or _console
    table = Table(title=f"{len(names)} checkpoints on the same samples and batches",
                  caption="each checkpoint's results: checkpoints/<name>/results.json in the run directory")
    table.add_column("metric")
    for n in names:
        table.add_column(n, justify="right")
    for i, (label, _) in enumerate(sections[0][0]):
        cells = [sec[0][i][1] if i < len(sec[0]) else "" for sec in sections]
        try:
            values = [float(c.replace(",", "")) for c in cells]
        except ValueError:
            values = []
        if len(set(values)) > 1:
            best = (min if label in lower_labels else max)(values)
            cells = [f"[bold]{c}[/]" if v == best else c for c, v in zip(cells, values)]
        table.add_row(label, *cells)
    console.print(table)
    notes: dict[str, list[str]] = {}
    for name, sec in zip(names, sections):
        for note in sec[2]:
            notes.setdefault(str(note), []).append(name)
    for note, which in notes.items():
        console.print(f"[yellow]note[/] ({', '.join(which)}): {note}", soft_wrap=True)


def present(results: dict, section_of: Callable[[dict], tuple], console: Console | None = None) -> None:
    """The console of a finished run, from its results.json alone, the same on every launch path (rank 0 of local
    ranks, the driver of a scheduler's job): the metrics table with the task's section
    (``section_of(metrics)``: the Task's ``console_section``), the intervals and the warnings; for a job of several
    checkpoints (results.json ``checkpoints``), the table of all members, the job's times and ranks, each member's
    intervals."""
    blocks = results.get("checkpoints")
    if blocks:
        lower = set((results.get("task") or {}).get("lower_is_better") or ())
        # the rows of those keys, labelled as the task labels them: the rows that leave its section without them
        labels = frozenset(label for b in blocks for label in
                           {r[0] for r in section_of(b["metrics"])[0]}
                           - {r[0] for r in section_of({k: v for k, v in b["metrics"].items() if k not in lower})[0]})
        print_checkpoint_table([b["name"] for b in blocks], [section_of(b["metrics"]) for b in blocks], console, labels)
        print_metrics(dict(results, metrics={}), ([], [], []), console)  # the job's throughput, times, ranks
        for b in blocks:
            print_intervals(b.get("confidence_intervals"), console, label=b["name"])
    else:
        print_metrics(results, section_of(results["metrics"]), console)
        print_intervals(results.get("confidence_intervals"), console)
    line = pipeline_line(results.get("pipeline"))
    if line:
        (console or Console()).print(f"[cyan]pipeline:[/] {escape(line)}", soft_wrap=True, highlight=False)
    print_warnings(results.get("warnings") or [], console)
