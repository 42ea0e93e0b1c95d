"""The last console line of every run and sweep: where its HTML report and its tracker runs are.

A Hydra callback (conf/console/end_line.yaml) composed before the ``logger`` group, so that Hydra, which calls
the ``*_end`` callbacks in reverse order, calls it after every tracker and after the sweep summary
(``disteval.job.sweep``) that writes SWEEP_DIR/report.html."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from disteval.driver.loggers.base import _leads, tracker_locations, trackers_line


def end_line(directory: str | Path) -> str:
    """``report: DIR/report.html; trackers: NAME LOCATION | ...`` for a run or sweep directory ("" when it has
    neither a report nor a recorded tracker location)."""
    directory = Path(directory)
    report = directory / "report.html"
    parts = [f"report: {report}"] if report.is_file() else []
    parts += [trackers_line(tracker_locations(directory))] if tracker_locations(directory) else []
    return "; ".join(parts)


class EndLine(Callback):
    """Prints ``end_line`` of the run (``on_run_end``) or of the sweep (``on_multirun_end``) to stderr, where the
    driver's other progress lines go, in the process that owns the records."""

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._print(config, Path(str(config.hydra.run.dir)).resolve())  # absolute, as the results: line

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        self._print(config, Path(str(config.hydra.sweep.dir)).resolve())

    @staticmethod
    def _print(config: DictConfig, directory: Path) -> None:
        if not _leads(config) and not (directory / "report.html").is_file():
            return
        line = end_line(directory)
        if line:
            print(f"disteval: {line}", file=sys.stderr, flush=True)
